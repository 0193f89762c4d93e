//! Cloud Hypervisor's vhost-user-blk frontend, message by message, with the rust-vmm frontend it
//! is built on (cloud-hypervisor `virtio-devices/src/vhost_user/blk.rs` `Blk::new`, and
//! `vu_common_ctrl.rs` `negotiate_features_vhost_user` / `setup_vhost_user` /
//! `update_mem_table`, main of 2026-08):
//!
//! 1. GET_FEATURES, SET_FEATURES (its offer ∩ the backend's), GET_PROTOCOL_FEATURES,
//!    SET_PROTOCOL_FEATURES with CONFIG | MQ | CONFIGURE_MEM_SLOTS | REPLY_ACK |
//!    INFLIGHT_SHMFD | LOG_SHMFD | DEVICE_STATE ∩ the backend's;
//! 2. GET_QUEUE_NUM when MQ was acked (it refuses a backend with fewer queues than asked);
//! 3. GET_CONFIG at offset **0**, `size_of::<VirtioBlockConfig>()` = 60 bytes, WRITABLE (the
//!    0x100 convention was dropped in 2026; Dragonball still uses it, see `frontends.rs`);
//! 4. the guest's writeback toggle: SET_CONFIG at offset 0x20, 1 byte;
//! 5. activation: SET_FEATURES again, SET_MEM_TABLE (every region with its fd), SET_VRING_NUM
//!    for each queue *before* the inflight region ("it could tell backends, like SPDK, how
//!    many virt queues to be handled"), GET_INFLIGHT_FD + SET_INFLIGHT_FD, then per queue
//!    SET_VRING_ADDR, SET_VRING_BASE, SET_VRING_CALL, SET_VRING_KICK, SET_VRING_ENABLE;
//! 6. memory hot-plug: ADD_MEM_REG with the new region's fd.
//!
//! Then a write and a read through the split ring the way the guest's driver fills it.
#![allow(clippy::unwrap_used)]

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use katablk_bdev::malloc::MallocDevice;
use katablk_test_support::files::memfd;
use katablk_test_support::pattern::seeded;
use katablk_vhost::{BlkOptions, VhostBlkServer};
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserInflight, VhostUserProtocolFeatures,
    VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap,
    MmapRegion,
};
use vmm_sys_util::eventfd::EventFd;

const MEM: usize = 8 << 20;
const QSIZE: u16 = 64;
const QUEUES: usize = 2;
const BLOCKS: u64 = 4096;
/// `size_of::<VirtioBlockConfig>()` in cloud-hypervisor's `block/src/lib.rs`.
const CONFIG_LEN: u32 = 60;
/// Offset of `writeback` in that struct.
const WRITEBACK: u32 = 0x20;

// Feature bits cloud-hypervisor offers (virtio_blk.h numbering).
const F_SIZE_MAX: u64 = 1 << 1;
const F_SEG_MAX: u64 = 1 << 2;
const F_GEOMETRY: u64 = 1 << 4;
const F_RO: u64 = 1 << 5;
const F_BLK_SIZE: u64 = 1 << 6;
const F_FLUSH: u64 = 1 << 9;
const F_TOPOLOGY: u64 = 1 << 10;
const F_CONFIG_WCE: u64 = 1 << 11;
const F_MQ: u64 = 1 << 12;
const F_DISCARD: u64 = 1 << 13;
const F_WRITE_ZEROES: u64 = 1 << 14;
const F_VERSION_1: u64 = 1 << 32;
const F_RING_EVENT_IDX: u64 = 1 << 29;
const F_RING_INDIRECT_DESC: u64 = 1 << 28;

fn region_info(
    mem: &GuestMemoryMmap<()>,
    file: &File,
    gpa: u64,
    len: usize,
) -> VhostUserMemoryRegionInfo {
    VhostUserMemoryRegionInfo {
        guest_phys_addr: gpa,
        memory_size: len as u64,
        userspace_addr: mem.get_host_address(GuestAddress(gpa)).unwrap() as u64,
        mmap_offset: 0,
        mmap_handle: file.as_raw_fd(),
    }
}

fn chain(
    mem: &GuestMemoryMmap<()>,
    at: u64,
    req: u32,
    sector: u64,
    data: Option<&[u8]>,
    first: u16,
) -> Vec<RawDescriptor> {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&req.to_le_bytes());
    h[8..].copy_from_slice(&sector.to_le_bytes());
    mem.write_slice(&h, GuestAddress(at)).unwrap();
    if let Some(d) = data {
        mem.write_slice(d, GuestAddress(at + 0x1000)).unwrap();
    }
    mem.write_obj(0xffu8, GuestAddress(at + 0x2000)).unwrap();
    // Device-writable data for reads (flag 2), next (flag 1) between the three.
    let data_flags = if data.is_some() { 1 } else { 1 | 2 };
    vec![
        RawDescriptor::from(SplitDescriptor::new(at, 16, 1, first + 1)),
        RawDescriptor::from(SplitDescriptor::new(
            at + 0x1000,
            4096,
            data_flags,
            first + 2,
        )),
        RawDescriptor::from(SplitDescriptor::new(at + 0x2000, 1, 2, 0)),
    ]
}

fn wait_used(q: &MockSplitQueue<GuestMemoryMmap<()>>, n: u16) {
    let t = Instant::now();
    while q.used().idx().load() < n {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "request not completed"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn cloud_hypervisor_connects_configures_and_does_io() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("ch.sock");
    let dev = Arc::new(MallocDevice::new(BLOCKS, 512).unwrap());
    let opts = BlkOptions {
        num_queues: QUEUES as u16,
        queue_size: QSIZE,
        poll_us: 0,
        ..Default::default()
    };
    let srv = VhostBlkServer::bind(&sock, dev, opts, None)
        .unwrap()
        .spawn()
        .unwrap();
    let mut fe = Frontend::connect(&sock, QUEUES as u64).unwrap();
    fe.set_owner().unwrap();

    // 1. Features.
    let offer = F_SIZE_MAX
        | F_SEG_MAX
        | F_GEOMETRY
        | F_RO
        | F_BLK_SIZE
        | F_FLUSH
        | F_TOPOLOGY
        | F_CONFIG_WCE
        | F_DISCARD
        | F_WRITE_ZEROES
        | F_MQ
        | F_VERSION_1
        | F_RING_EVENT_IDX
        | F_RING_INDIRECT_DESC
        | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    let backend = fe.get_features().unwrap();
    let acked = offer & backend;
    assert_ne!(acked & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits(), 0);
    for f in [
        F_VERSION_1,
        F_FLUSH,
        F_BLK_SIZE,
        F_MQ,
        F_CONFIG_WCE,
        F_DISCARD,
        F_WRITE_ZEROES,
    ] {
        assert_ne!(acked & f, 0, "feature bit {f:#x} not offered");
    }
    fe.set_features(acked).unwrap();
    let ch_protocol = VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::INFLIGHT_SHMFD
        | VhostUserProtocolFeatures::LOG_SHMFD
        | VhostUserProtocolFeatures::DEVICE_STATE;
    let pf = fe.get_protocol_features().unwrap() & ch_protocol;
    for p in [
        VhostUserProtocolFeatures::CONFIG,
        VhostUserProtocolFeatures::MQ,
        VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS,
        VhostUserProtocolFeatures::REPLY_ACK,
        VhostUserProtocolFeatures::INFLIGHT_SHMFD,
    ] {
        assert!(pf.contains(p), "protocol feature {p:?} not offered");
    }
    fe.set_protocol_features(pf).unwrap();

    // 2. Queues.
    assert!(fe.get_queue_num().unwrap() >= QUEUES as u64);

    // 3. The config at offset 0.
    let (_, cfg) = fe
        .get_config(
            0,
            CONFIG_LEN,
            VhostUserConfigFlags::WRITABLE,
            &[0u8; CONFIG_LEN as usize],
        )
        .unwrap();
    assert_eq!(cfg.len(), CONFIG_LEN as usize);
    assert_eq!(u64::from_le_bytes(cfg[..8].try_into().unwrap()), BLOCKS);
    assert_eq!(
        u16::from_le_bytes(cfg[34..36].try_into().unwrap()),
        QUEUES as u16
    );

    // 4. Writeback off and on again.
    for wce in [0u8, 1] {
        fe.set_config(WRITEBACK, VhostUserConfigFlags::WRITABLE, &[wce])
            .unwrap();
        let (_, b) = fe
            .get_config(WRITEBACK, 1, VhostUserConfigFlags::WRITABLE, &[0u8])
            .unwrap();
        assert_eq!(b, vec![wce]);
    }

    // 5. Activation, every message acknowledged (REPLY_ACK) so a refusal shows up here.
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    fe.set_features(acked).unwrap();
    let file = memfd(MEM as u64);
    let region = MmapRegion::from_file(FileOffset::new(file.try_clone().unwrap(), 0), MEM).unwrap();
    let mem =
        GuestMemoryMmap::from_regions(vec![GuestRegionMmap::new(region, GuestAddress(0)).unwrap()])
            .unwrap();
    fe.set_mem_table(&[region_info(&mem, &file, 0, MEM)])
        .unwrap();
    for q in 0..QUEUES {
        fe.set_vring_num(q, QSIZE).unwrap();
    }
    let (info, inflight) = fe
        .get_inflight_fd(&VhostUserInflight {
            mmap_size: 0,
            mmap_offset: 0,
            num_queues: QUEUES as u16,
            queue_size: QSIZE,
        })
        .unwrap();
    fe.set_inflight_fd(&info, inflight.as_raw_fd()).unwrap();
    let host = mem.get_host_address(GuestAddress(0)).unwrap() as u64;
    let queues: Vec<_> = (0..QUEUES)
        .map(|i| {
            MockSplitQueue::create(&mem, GuestAddress(0x40_0000 + 0x10_0000 * i as u64), QSIZE)
        })
        .collect();
    let mut fds = Vec::new();
    for (i, q) in queues.iter().enumerate() {
        fe.set_vring_addr(
            i,
            &VringConfigData {
                queue_max_size: QSIZE,
                queue_size: QSIZE,
                flags: 0,
                desc_table_addr: host + q.desc_table_addr().0,
                used_ring_addr: host + q.used_addr().0,
                avail_ring_addr: host + q.avail_addr().0,
                log_addr: None,
            },
        )
        .unwrap();
        fe.set_vring_base(i, 0).unwrap();
        let call = EventFd::new(0).unwrap();
        let kick = EventFd::new(0).unwrap();
        fe.set_vring_call(i, &call).unwrap();
        fe.set_vring_kick(i, &kick).unwrap();
        fe.set_vring_enable(i, true).unwrap();
        fds.push((kick, call));
    }

    // 6. Memory hot-plug: a second region, and the data of the requests in it.
    let hot = memfd(MEM as u64);
    let hot_region =
        MmapRegion::from_file(FileOffset::new(hot.try_clone().unwrap(), 0), MEM).unwrap();
    let hot_mem = GuestMemoryMmap::from_regions(vec![GuestRegionMmap::new(
        hot_region,
        GuestAddress(MEM as u64),
    )
    .unwrap()])
    .unwrap();
    fe.add_mem_region(&region_info(&hot_mem, &hot, MEM as u64, MEM))
        .unwrap();

    // A write on queue 1 (its buffers in the hot-plugged region), then a read back on queue 0.
    let data = seeded(1, 4096);
    let at = MEM as u64 + 0x1_0000;
    let w = chain(&hot_mem, at, 1, 16, Some(&data), 0);
    queues[1].add_desc_chains(&w, 0).unwrap();
    fds[1].0.write(1).unwrap();
    wait_used(&queues[1], 1);
    assert_eq!(
        hot_mem.read_obj::<u8>(GuestAddress(at + 0x2000)).unwrap(),
        0,
        "write status"
    );
    let r = chain(&mem, 0x10_0000, 0, 16, None, 0);
    queues[0].add_desc_chains(&r, 0).unwrap();
    fds[0].0.write(1).unwrap();
    wait_used(&queues[0], 1);
    assert_eq!(
        mem.read_obj::<u8>(GuestAddress(0x10_2000)).unwrap(),
        0,
        "read status"
    );
    let mut back = vec![0u8; 4096];
    mem.read_slice(&mut back, GuestAddress(0x10_1000)).unwrap();
    assert_eq!(back, data);
    drop(fe);
    srv.stop().unwrap();
}

/// The protocol's first message is SET_OWNER: a frontend that sets up and kicks a queue
/// without it gets no I/O served until it sends it.
#[test]
fn no_queue_runs_before_set_owner() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("owner.sock");
    let dev = Arc::new(MallocDevice::new(BLOCKS, 512).unwrap());
    let opts = BlkOptions {
        queue_size: QSIZE,
        poll_us: 0,
        ..Default::default()
    };
    let srv = VhostBlkServer::bind(&sock, dev, opts, None)
        .unwrap()
        .spawn()
        .unwrap();
    let mut fe = Frontend::connect(&sock, 1).unwrap();
    let feats = fe.get_features().unwrap();
    fe.set_features(feats & (F_VERSION_1 | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()))
        .unwrap();
    let pf = fe.get_protocol_features().unwrap();
    fe.set_protocol_features(pf & VhostUserProtocolFeatures::REPLY_ACK)
        .unwrap();
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    let file = memfd(MEM as u64);
    let region = MmapRegion::from_file(FileOffset::new(file.try_clone().unwrap(), 0), MEM).unwrap();
    let mem =
        GuestMemoryMmap::from_regions(vec![GuestRegionMmap::new(region, GuestAddress(0)).unwrap()])
            .unwrap();
    fe.set_mem_table(&[region_info(&mem, &file, 0, MEM)])
        .unwrap();
    let host = mem.get_host_address(GuestAddress(0)).unwrap() as u64;
    let q = MockSplitQueue::create(&mem, GuestAddress(0x40_0000), QSIZE);
    fe.set_vring_num(0, QSIZE).unwrap();
    fe.set_vring_addr(
        0,
        &VringConfigData {
            queue_max_size: QSIZE,
            queue_size: QSIZE,
            flags: 0,
            desc_table_addr: host + q.desc_table_addr().0,
            used_ring_addr: host + q.used_addr().0,
            avail_ring_addr: host + q.avail_addr().0,
            log_addr: None,
        },
    )
    .unwrap();
    fe.set_vring_base(0, 0).unwrap();
    let call = EventFd::new(0).unwrap();
    let kick = EventFd::new(0).unwrap();
    fe.set_vring_call(0, &call).unwrap();
    fe.set_vring_kick(0, &kick).unwrap();
    fe.set_vring_enable(0, true).unwrap();
    let r = chain(&mem, 0x10_0000, 0, 0, None, 0);
    q.add_desc_chains(&r, 0).unwrap();
    kick.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(q.used().idx().load(), 0, "served before SET_OWNER");
    fe.set_owner().unwrap();
    kick.write(1).unwrap();
    wait_used(&q, 1);
    assert_eq!(mem.read_obj::<u8>(GuestAddress(0x10_2000)).unwrap(), 0);
    drop(fe);
    srv.stop().unwrap();
}
