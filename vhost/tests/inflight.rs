//! Reconnect after a backend restart with INFLIGHT_SHMFD: a raw vhost-user frontend (the rust-vmm
//! `vhost` crate's) hands the inflight region back and the backend resubmits the requests that
//! were in flight, in their original order, before taking new ones.
#![allow(clippy::unwrap_used)]

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use katablk_bdev::malloc::MallocDevice;
use katablk_bdev::sync::SyncIo;
use katablk_test_support::files::memfd;
use katablk_vhost::{BlkOptions, VhostBlkServer};
use vhost::vhost_user::message::{
    VhostUserInflight, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
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

const MEM: usize = 16 << 20;
const QSIZE: u16 = 16;

struct Guest {
    mem: GuestMemoryMmap<()>,
    file: File,
}

fn guest() -> Guest {
    let file = memfd(MEM as u64);
    let region = MmapRegion::from_file(FileOffset::new(file.try_clone().unwrap(), 0), MEM).unwrap();
    let mem =
        GuestMemoryMmap::from_regions(vec![GuestRegionMmap::new(region, GuestAddress(0)).unwrap()])
            .unwrap();
    Guest { mem, file }
}

fn connect(sock: &std::path::Path, g: &Guest) -> Frontend {
    let mut fe = Frontend::connect(sock, 1).unwrap();
    fe.set_owner().unwrap();
    let feats = fe.get_features().unwrap();
    let want = (1u64 << 32) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    assert_eq!(feats & want, want);
    fe.set_features(want).unwrap();
    let pf = fe.get_protocol_features().unwrap();
    assert!(pf.contains(VhostUserProtocolFeatures::INFLIGHT_SHMFD));
    assert!(pf.contains(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS));
    fe.set_protocol_features(
        VhostUserProtocolFeatures::INFLIGHT_SHMFD
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::REPLY_ACK,
    )
    .unwrap();
    // Wait for the backend's acknowledgement of every message, so that the test's next step
    // happens after the backend applied the previous one.
    fe.set_hdr_flags(vhost::vhost_user::message::VhostUserHeaderFlag::NEED_REPLY);
    let host = g.mem.get_host_address(GuestAddress(0)).unwrap() as u64;
    fe.set_mem_table(&[VhostUserMemoryRegionInfo {
        guest_phys_addr: 0,
        memory_size: MEM as u64,
        userspace_addr: host,
        mmap_offset: 0,
        mmap_handle: g.file.as_raw_fd(),
    }])
    .unwrap();
    fe
}

fn start_vring(
    fe: &mut Frontend,
    g: &Guest,
    q: &MockSplitQueue<GuestMemoryMmap<()>>,
    base: u16,
) -> (EventFd, EventFd) {
    let host = g.mem.get_host_address(GuestAddress(0)).unwrap() as u64;
    fe.set_vring_num(0, QSIZE).unwrap();
    fe.set_vring_base(0, base).unwrap();
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
    let kick = EventFd::new(0).unwrap();
    let call = EventFd::new(0).unwrap();
    fe.set_vring_call(0, &call).unwrap();
    fe.set_vring_kick(0, &kick).unwrap();
    fe.set_vring_enable(0, true).unwrap();
    kick.write(1).unwrap();
    (kick, call)
}

fn wait_used(q: &MockSplitQueue<GuestMemoryMmap<()>>, n: u16) {
    let t = Instant::now();
    while q.used().idx().load() < n {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "requests not completed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn write_chain(g: &Guest, at: u64, sector: u64, fill: u8) -> [RawDescriptor; 3] {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&1u32.to_le_bytes()); // VIRTIO_BLK_T_OUT
    h[8..].copy_from_slice(&sector.to_le_bytes());
    g.mem.write_slice(&h, GuestAddress(at)).unwrap();
    g.mem
        .write_slice(&[fill; 512], GuestAddress(at + 0x1000))
        .unwrap();
    g.mem.write_obj(0xffu8, GuestAddress(at + 0x2000)).unwrap();
    [
        RawDescriptor::from(SplitDescriptor::new(at, 16, 1, 0)),
        RawDescriptor::from(SplitDescriptor::new(at + 0x1000, 512, 1, 0)),
        RawDescriptor::from(SplitDescriptor::new(at + 0x2000, 1, 2, 0)),
    ]
}

#[test]
fn inflight_requests_resubmitted_in_order_after_backend_restart() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("inflight.sock");
    let dev = Arc::new(MallocDevice::new(2048, 512).unwrap());
    let opts = BlkOptions {
        queue_size: QSIZE,
        poll_us: 0,
        ..Default::default()
    };
    let g = guest();
    let q = MockSplitQueue::new(&g.mem, QSIZE);

    // First backend: the frontend gets the inflight region, then the backend "dies".
    let srv = VhostBlkServer::bind(&sock, dev.clone(), opts.clone(), None)
        .unwrap()
        .spawn()
        .unwrap();
    let mut fe = connect(&sock, &g);
    let (info, inflight_file) = fe
        .get_inflight_fd(&VhostUserInflight {
            mmap_size: 0,
            mmap_offset: 0,
            num_queues: 1,
            queue_size: QSIZE,
        })
        .unwrap();
    assert!(info.mmap_size >= 16 + 16 * u64::from(QSIZE));
    drop(fe);
    srv.stop().unwrap();

    // Two writes to the same sector are in the avail ring. The dead backend had taken both,
    // the second one (head 3) first: record that in the inflight region as it would have.
    let mut descs = write_chain(&g, 0x10_0000, 8, 0xaa).to_vec();
    descs.extend(write_chain(&g, 0x20_0000, 8, 0xbb));
    for (i, d) in descs.iter_mut().enumerate() {
        let sd = SplitDescriptor::from(*d);
        let next = if i % 3 == 2 { 0 } else { i as u16 + 1 };
        *d = RawDescriptor::from(SplitDescriptor::new(
            sd.addr().0,
            sd.len(),
            sd.flags(),
            next,
        ));
    }
    q.add_desc_chains(&descs, 0).unwrap();
    let region = MmapRegion::<()>::from_file(
        FileOffset::new(inflight_file.try_clone().unwrap(), 0),
        info.mmap_size as usize,
    )
    .unwrap();
    let inflight =
        GuestMemoryMmap::from_regions(vec![GuestRegionMmap::new(region, GuestAddress(0)).unwrap()])
            .unwrap();
    let desc = |h: u64| 16 + 16 * h;
    inflight.write_obj(1u64, GuestAddress(desc(3) + 8)).unwrap();
    inflight.write_obj(1u8, GuestAddress(desc(3))).unwrap();
    inflight.write_obj(2u64, GuestAddress(desc(0) + 8)).unwrap();
    inflight.write_obj(1u8, GuestAddress(desc(0))).unwrap();

    // The restarted backend gets the region back; the frontend restores last_avail to the used
    // index (0), as QEMU does when the backend died.
    let srv = VhostBlkServer::bind(&sock, dev.clone(), opts, None)
        .unwrap()
        .spawn()
        .unwrap();
    let mut fe = connect(&sock, &g);
    fe.set_inflight_fd(&info, inflight_file.as_raw_fd())
        .unwrap();
    let _fds = start_vring(&mut fe, &g, &q, 0);
    wait_used(&q, 2);
    let order: Vec<u32> = (0..2)
        .map(|i| q.used().ring().ref_at(i).unwrap().load().id())
        .collect();
    assert_eq!(
        order,
        vec![3, 0],
        "resubmitted in the order they were first taken"
    );
    assert_eq!(g.mem.read_obj::<u8>(GuestAddress(0x10_2000)).unwrap(), 0);
    assert_eq!(g.mem.read_obj::<u8>(GuestAddress(0x20_2000)).unwrap(), 0);
    // Nothing was taken twice: next_avail continued after the two in-flight heads.
    assert_eq!(fe.get_vring_base(0).unwrap(), 2);
    // Head 0 (0xaa) ran last.
    let mut io = SyncIo::new(&*dev).unwrap();
    let mut b = [0u8; 512];
    io.read_at(8 * 512, &mut b).unwrap();
    assert_eq!(b, [0xaa; 512]);
    // The region was cleared as the requests completed.
    assert_eq!(inflight.read_obj::<u8>(GuestAddress(desc(0))).unwrap(), 0);
    assert_eq!(inflight.read_obj::<u8>(GuestAddress(desc(3))).unwrap(), 0);
    drop(fe);
    srv.stop().unwrap();
}

#[test]
fn memory_slots_hot_add_and_remove() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("slots.sock");
    let dev = Arc::new(MallocDevice::new(2048, 512).unwrap());
    let opts = BlkOptions {
        queue_size: QSIZE,
        poll_us: 0,
        ..Default::default()
    };
    let srv = VhostBlkServer::bind(&sock, dev.clone(), opts, None)
        .unwrap()
        .spawn()
        .unwrap();
    let g = guest();
    let mut fe = connect(&sock, &g);
    assert!(fe.get_max_mem_slots().unwrap() >= 32);
    // Hot-add a second region at 1 GiB holding the data buffer, do I/O from it, remove it.
    let extra = memfd(MEM as u64);
    let region =
        MmapRegion::<()>::from_file(FileOffset::new(extra.try_clone().unwrap(), 0), MEM).unwrap();
    let gr = GuestRegionMmap::new(region, GuestAddress(1 << 30)).unwrap();
    let host2 = gr.as_ptr() as u64;
    let info2 = VhostUserMemoryRegionInfo {
        guest_phys_addr: 1 << 30,
        memory_size: MEM as u64,
        userspace_addr: host2,
        mmap_offset: 0,
        mmap_handle: extra.as_raw_fd(),
    };
    fe.add_mem_region(&info2).unwrap();
    let q = MockSplitQueue::new(&g.mem, QSIZE);
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&1u32.to_le_bytes());
    g.mem.write_slice(&h, GuestAddress(0x10_0000)).unwrap();
    let both = g.mem.insert_region(Arc::new(gr)).unwrap();
    both.write_slice(&[0x77; 4096], GuestAddress((1 << 30) + 0x1000))
        .unwrap();
    let descs = [
        RawDescriptor::from(SplitDescriptor::new(0x10_0000, 16, 1, 1)),
        RawDescriptor::from(SplitDescriptor::new((1 << 30) + 0x1000, 4096, 1, 2)),
        RawDescriptor::from(SplitDescriptor::new(0x10_2000, 1, 2, 0)),
    ];
    q.add_desc_chains(&descs, 0).unwrap();
    let _fds = start_vring(&mut fe, &g, &q, 0);
    wait_used(&q, 1);
    assert_eq!(g.mem.read_obj::<u8>(GuestAddress(0x10_2000)).unwrap(), 0);
    let mut io = SyncIo::new(&*dev).unwrap();
    let mut b = [0u8; 4096];
    io.read_at(0, &mut b).unwrap();
    assert_eq!(b, [0x77; 4096]);
    fe.remove_mem_region(&info2).unwrap();
    // A request pointing into the removed region now fails with IOERR, and the queue goes on.
    q.add_desc_chains(&descs, 3).unwrap();
    let (kick, _) = _fds;
    kick.write(1).unwrap();
    wait_used(&q, 2);
    assert_eq!(g.mem.read_obj::<u8>(GuestAddress(0x10_2000)).unwrap(), 1);
    drop(fe);
    srv.stop().unwrap();
}

/// A RAM device whose reported size can change, standing in for an lvol being resized.
struct Resizable {
    inner: MallocDevice,
    blocks: std::sync::atomic::AtomicU64,
}

impl katablk_bdev::BlockDevice for Resizable {
    fn info(&self) -> katablk_bdev::DeviceInfo {
        let mut i = self.inner.info();
        i.num_blocks = self.blocks.load(std::sync::atomic::Ordering::Relaxed);
        i
    }
    fn open_channel(
        &self,
        depth: usize,
        segs: usize,
    ) -> Result<Box<dyn katablk_bdev::IoChannel>, katablk_bdev::BdevError> {
        self.inner.open_channel(depth, segs)
    }
    fn describe(&self) -> String {
        "resizable".into()
    }
}

#[test]
fn config_change_notification_after_resize() {
    use katablk_bdev::BlockDevice;
    use std::io::Read;
    use vhost::vhost_user::message::VhostUserConfigFlags;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("cfg.sock");
    let dev = Arc::new(Resizable {
        inner: MallocDevice::new(8192, 512).unwrap(),
        blocks: 4096.into(),
    });
    let opts = BlkOptions {
        queue_size: QSIZE,
        ..Default::default()
    };
    let srv = VhostBlkServer::bind(&sock, dev.clone(), opts, None)
        .unwrap()
        .spawn()
        .unwrap();
    let mut fe = Frontend::connect(&sock, 1).unwrap();
    fe.set_owner().unwrap();
    fe.get_features().unwrap();
    fe.set_features((1u64 << 32) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits())
        .unwrap();
    let pf = fe.get_protocol_features().unwrap();
    assert!(pf.contains(VhostUserProtocolFeatures::BACKEND_REQ));
    fe.set_protocol_features(
        VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::BACKEND_REQ,
    )
    .unwrap();
    let (mine, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    fe.set_backend_request_fd(&theirs).unwrap();
    drop(theirs);
    let cap = |fe: &mut Frontend| {
        let (_, b) = fe
            .get_config(0, 8, VhostUserConfigFlags::WRITABLE, &[0u8; 8])
            .unwrap();
        u64::from_le_bytes(b[..8].try_into().unwrap())
    };
    assert_eq!(cap(&mut fe), 4096);
    dev.blocks.store(8192, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(dev.info().num_blocks, 8192);
    assert!(srv.notify_config_change());
    let mut hdr = [0u8; 12];
    mine.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    (&mine).read_exact(&mut hdr).unwrap();
    assert_eq!(
        u32::from_le_bytes(hdr[..4].try_into().unwrap()),
        2,
        "CONFIG_CHANGE_MSG"
    );
    assert_eq!(cap(&mut fe), 8192);
    drop(fe);
    srv.stop().unwrap();
}
