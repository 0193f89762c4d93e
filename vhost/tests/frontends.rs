//! The device config as VMM frontends read it. Two conventions for the GET_CONFIG / SET_CONFIG
//! offset are in use: 0-based (the vhost-user spec; QEMU, libblkio) and rust-vmm's
//! `VHOST_USER_CONFIG_OFFSET` (0x100) for the first byte. The second one is what Kata's
//! Dragonball VMM sends (kata-containers `src/dragonball/dbs_virtio_devices/src/vhost/vhost_user/
//! block.rs`, `VhostUserBlockDevice::new`); the test below replays its steps with the same rust-vmm
//! frontend. A backend that answers only one convention leaves the other frontend waiting for a
//! config reply that never has the 60 bytes it asked for.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use katablk_bdev::malloc::MallocDevice;
use katablk_vhost::{BlkOptions, VhostBlkServer};
use vhost::vhost_user::message::{VhostUserConfigFlags, VHOST_USER_CONFIG_OFFSET};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::VhostBackend;

/// Size of `struct virtio_blk_config` up to `write_zeroes_may_unmap` and its padding, as
/// Dragonball's `VirtioBlockConfig` declares it.
const CONFIG_LEN: u32 = 60;
const BLOCKS: u64 = 8192;

fn server(dir: &std::path::Path, queues: u16) -> (std::path::PathBuf, katablk_vhost::ServerHandle) {
    let sock = dir.join("blk.sock");
    let dev = Arc::new(MallocDevice::new(BLOCKS, 512).unwrap());
    let opts = BlkOptions {
        num_queues: queues,
        ..Default::default()
    };
    let srv = VhostBlkServer::bind(&sock, dev, opts, None)
        .unwrap()
        .spawn()
        .unwrap();
    (sock, srv)
}

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes(b[off..off + 2].try_into().unwrap())
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}

/// Dragonball's connect sequence, step by step: connect; GET_FEATURES; SET_FEATURES with every
/// offered feature; GET_PROTOCOL_FEATURES; SET_PROTOCOL_FEATURES with every offered protocol
/// feature; GET_CONFIG(VHOST_USER_CONFIG_OFFSET, size_of::<VirtioBlockConfig>(), WRITABLE).
#[test]
fn dragonball_reads_the_config_at_0x100() {
    let dir = tempfile::tempdir().unwrap();
    let (sock, srv) = server(dir.path(), 2);
    let mut fe = Frontend::connect(&sock, 1).unwrap();
    let avail = fe.get_features().unwrap();
    fe.set_features(avail).unwrap();
    let pf = fe.get_protocol_features().unwrap();
    fe.set_protocol_features(pf).unwrap();
    let (_, cfg) = fe
        .get_config(
            VHOST_USER_CONFIG_OFFSET,
            CONFIG_LEN,
            VhostUserConfigFlags::WRITABLE,
            &[0u8; CONFIG_LEN as usize],
        )
        .unwrap();
    assert_eq!(cfg.len(), CONFIG_LEN as usize);
    assert_eq!(u64::from_le_bytes(cfg[..8].try_into().unwrap()), BLOCKS);
    assert_eq!(u32_at(&cfg, 20), 512, "blk_size");
    assert_eq!(u16_at(&cfg, 34), 2, "num_queues");
    // The same bytes as the 0-based read QEMU makes.
    let (_, zero) = fe
        .get_config(
            0,
            CONFIG_LEN,
            VhostUserConfigFlags::WRITABLE,
            &[0u8; CONFIG_LEN as usize],
        )
        .unwrap();
    assert_eq!(cfg, zero);
    drop(fe);
    srv.stop().unwrap();
}

/// Partial reads and the writeback byte (offset 32) at both conventions; reads past the config
/// give zeroes.
#[test]
fn both_offset_conventions_for_reads_and_writes() {
    let dir = tempfile::tempdir().unwrap();
    let (sock, srv) = server(dir.path(), 1);
    let mut fe = Frontend::connect(&sock, 1).unwrap();
    fe.set_owner().unwrap();
    let avail = fe.get_features().unwrap();
    fe.set_features(avail).unwrap();
    let pf = fe.get_protocol_features().unwrap();
    fe.set_protocol_features(pf).unwrap();
    let flags = VhostUserConfigFlags::WRITABLE;
    let read = |fe: &mut Frontend, off: u32, len: u32| {
        fe.get_config(off, len, flags, &vec![0u8; len as usize])
            .map(|(_, b)| b)
    };
    for base in [0, VHOST_USER_CONFIG_OFFSET] {
        assert_eq!(u32_at(&read(&mut fe, base + 20, 4).unwrap(), 0), 512);
        assert_eq!(read(&mut fe, base + 60, 16).unwrap(), vec![0u8; 16]);
        // Toggle the write cache through this convention, read it back through the other.
        let other = VHOST_USER_CONFIG_OFFSET - base;
        for wce in [0u8, 1] {
            fe.set_config(base + 32, flags, &[wce]).unwrap();
            assert_eq!(read(&mut fe, other + 32, 1).unwrap(), vec![wce]);
        }
    }
    drop(fe);
    srv.stop().unwrap();
}
