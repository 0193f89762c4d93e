//! A hostile vhost-user frontend must never kill the daemon with SIGBUS (issue 18, finding V1).
//!
//! A raw frontend speaks the wire format directly (12-byte header: request, flags, size; then
//! the payload; descriptors in SCM_RIGHTS) to a `katablk-vhost` child process and sends memory
//! files that do not back what it asks to map: an inflight file smaller than its mapping,
//! memory regions longer than their file, an `mmap_offset` past the end of the file, a
//! descriptor chain pointing past the end of a file, files that are not regular files, and a
//! memory file shrunk under a running queue. After each attack the test checks that
//! (a) the attacked daemon is still running,
//! (b) the attack got an error reply (a NACK with `REPLY_ACK`) or a disconnect,
//! (c) a well-behaved libblkio client of another daemon (connected before the attack) still
//!     does I/O, and so does a fresh libblkio client of the attacked daemon.
#![allow(clippy::unwrap_used)]

mod common;

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::{pattern, Client, Server};
use katablk_test_support::raw::*;
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap,
    MmapRegion,
};
use vmm_sys_util::eventfd::EventFd;

const QSIZE: u16 = 16;

/// The protocol features the attacker acknowledges.
const ATTACKER_FEATURES: u64 = PF_MQ | PF_REPLY_ACK | PF_INFLIGHT_SHMFD | PF_CONFIGURE_MEM_SLOTS;

/// The attacked daemon, a neighbour daemon and a libblkio client of the neighbour.
struct Node {
    _dir: tempfile::TempDir,
    attacked: Server,
    neighbour_srv: Server,
    neighbour: Client,
    round: u8,
}

impl Node {
    fn new() -> Node {
        let dir = tempfile::tempdir().unwrap();
        let attacked = Server::start(
            &dir.path().join("attacked.sock"),
            &["--malloc", "16", "--queue-size", "256"],
        );
        let mut neighbour_srv =
            Server::start(&dir.path().join("neighbour.sock"), &["--malloc", "16"]);
        let neighbour = connect_client(&mut neighbour_srv, "start");
        let mut n = Node {
            _dir: dir,
            attacked,
            neighbour_srv,
            neighbour,
            round: 0,
        };
        n.neighbour_io();
        n
    }

    fn attacker(&self) -> Raw {
        let mut r = Raw::connect(&self.attacked.socket);
        r.handshake_with(ATTACKER_FEATURES);
        r
    }

    fn neighbour_io(&mut self) {
        self.round += 1;
        let off = u64::from(self.round) * 64 * KIB;
        let data = pattern(off, 64 * KIB as usize, self.round);
        assert_eq!(self.neighbour.write(0, off, &data), 0, "neighbour write");
        assert_eq!(
            self.neighbour.read(0, off, data.len()).unwrap(),
            data,
            "neighbour read"
        );
    }

    /// (a) the attacked daemon runs, (c) the neighbour and a fresh client of the attacked
    /// daemon do I/O.
    fn check_healthy(&mut self, what: &str) {
        self.neighbour_io();
        let mut c = connect_client(&mut self.attacked, what);
        let off = 3 * MIB;
        let data = pattern(off, 8192, self.round);
        assert_eq!(c.write(0, off, &data), 0, "{what}: fresh client write");
        assert_eq!(
            c.read(0, off, data.len()).unwrap(),
            data,
            "{what}: fresh client read"
        );
        drop(c);
        assert_running(&mut self.attacked, what);
        assert_running(&mut self.neighbour_srv, what);
    }
}

fn assert_running(srv: &mut Server, what: &str) {
    let st = srv.daemon.try_wait();
    assert!(
        st.is_none(),
        "{what}: daemon {} died: {st:?}",
        srv.socket.display()
    );
}

/// A libblkio client of `srv`: one attempt, since the daemon was ready before the attack and
/// its accept loop takes the next frontend as soon as the previous one is dropped.
fn connect_client(srv: &mut Server, what: &str) -> Client {
    assert_running(srv, what);
    Client::connect(&srv.socket, 1, false)
        .unwrap_or_else(|e| panic!("{what}: client connect to {}: {e}", srv.socket.display()))
}

/// (b): the attack got a NACK and then a disconnect, or the disconnect at once.
fn assert_refused(raw: &mut Raw, r: Reply, what: &str) {
    match r {
        Reply::Ack(0) => panic!("{what}: accepted"),
        Reply::Ack(_) | Reply::Closed => {}
    }
    assert!(raw.wait_closed(), "{what}: frontend not dropped");
}

/// The reproducer verbatim (no REPLY_ACK, so no reply is possible): SET_INFLIGHT_FD
/// with a 0-byte memfd. Then the same with REPLY_ACK, with a 4 KiB memfd for an 8 KiB mapping,
/// and with the mapping past the end of a large enough file.
#[test]
fn inflight_fd_smaller_than_its_mapping_is_refused() {
    let mut node = Node::new();

    let mut raw = Raw::connect(&node.attacked.socket);
    raw.send(
        SET_PROTOCOL_FEATURES,
        VERSION,
        &PF_INFLIGHT_SHMFD.to_le_bytes(),
        &[],
    )
    .unwrap();
    let f = memfd(0);
    raw.send(
        SET_INFLIGHT_FD,
        VERSION,
        &inflight(MIB, 0, 1, 256),
        &[f.as_raw_fd()],
    )
    .unwrap();
    assert!(raw.wait_closed(), "reproducer: frontend not dropped");
    node.check_healthy("0-byte inflight memfd");

    for (file_len, size, offset) in [(4 * KIB, 8 * KIB, 0), (64 * KIB, 8 * KIB, 60 * KIB)] {
        let mut raw = node.attacker();
        let f = memfd(file_len);
        let r = raw.request(
            SET_INFLIGHT_FD,
            &inflight(size, offset, 1, 256),
            &[f.as_raw_fd()],
        );
        let what = format!("inflight {size} bytes at {offset} of a {file_len}-byte memfd");
        assert_refused(&mut raw, r, &what);
        node.check_healthy(&what);
    }
}

/// A 64 TiB memory region on a 4 KiB memfd, by SET_MEM_TABLE and by ADD_MEM_REG.
#[test]
fn memory_region_longer_than_its_file_is_refused() {
    let mut node = Node::new();
    let f = memfd(4 * KIB);
    let huge = region(0, 64 << 40, 0x7f00_0000_0000, 0);

    let mut raw = node.attacker();
    let r = raw.request(
        SET_MEM_TABLE,
        &mem_table(std::slice::from_ref(&huge)),
        &[f.as_raw_fd()],
    );
    assert_refused(&mut raw, r, "SET_MEM_TABLE 64 TiB on 4 KiB");
    node.check_healthy("SET_MEM_TABLE 64 TiB on 4 KiB");

    // A valid first region, then a second one longer than its file.
    let good = memfd(MIB);
    let mut raw = node.attacker();
    let r = raw.request(
        SET_MEM_TABLE,
        &mem_table(&[
            region(0, MIB, 0x7e00_0000_0000, 0),
            region(MIB, 64 << 40, 0x7f00_0000_0000, 0),
        ]),
        &[good.as_raw_fd(), f.as_raw_fd()],
    );
    assert_refused(&mut raw, r, "SET_MEM_TABLE second region too long");
    node.check_healthy("SET_MEM_TABLE second region too long");

    let mut raw = node.attacker();
    let r = raw.request(ADD_MEM_REG, &add_mem_reg(&huge), &[f.as_raw_fd()]);
    assert_refused(&mut raw, r, "ADD_MEM_REG 64 TiB on 4 KiB");
    node.check_healthy("ADD_MEM_REG 64 TiB on 4 KiB");
}

/// `mmap_offset` past the end of the file (and an offset whose sum with the size overflows).
#[test]
fn mmap_offset_past_end_of_file_is_refused() {
    let mut node = Node::new();
    let f = memfd(64 * KIB);
    let cases = [
        (
            "offset 1 MiB in a 64 KiB memfd",
            region(0, 4 * KIB, 0x7f00_0000_0000, MIB),
        ),
        (
            "region ending 4 KiB past the end",
            region(0, 64 * KIB, 0x7f00_0000_0000, 4 * KIB),
        ),
        (
            "offset + size overflows",
            region(0, 64 * KIB, 0x7f00_0000_0000, u64::MAX - 4095),
        ),
        (
            "offset past i64::MAX",
            region(0, 4 * KIB, 0x7f00_0000_0000, 1 << 63),
        ),
    ];
    for (what, r) in &cases {
        let mut raw = node.attacker();
        let reply = raw.request(
            SET_MEM_TABLE,
            &mem_table(std::slice::from_ref(r)),
            &[f.as_raw_fd()],
        );
        assert_refused(&mut raw, reply, what);
        node.check_healthy(what);

        let mut raw = node.attacker();
        let reply = raw.request(ADD_MEM_REG, &add_mem_reg(r), &[f.as_raw_fd()]);
        assert_refused(&mut raw, reply, &format!("ADD_MEM_REG {what}"));
        node.check_healthy(what);
    }
}

/// Descriptors that are not regular files: a directory, a FIFO, a socket, a character device.
#[test]
fn memory_fds_that_are_not_regular_files_are_refused() {
    let mut node = Node::new();
    let dir = tempfile::tempdir().unwrap();
    let d = File::open(dir.path()).unwrap();
    let null = File::open("/dev/null").unwrap();
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe writes.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both descriptors are fresh and owned by nobody else.
    let (pr, _pw) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
    let (sa, _sb) = UnixStream::pair().unwrap();
    for (what, fd) in [
        ("directory", d.as_raw_fd()),
        ("/dev/null", null.as_raw_fd()),
        ("FIFO", pr.as_raw_fd()),
        ("socket", sa.as_raw_fd()),
    ] {
        let mut raw = node.attacker();
        let r = raw.request(
            SET_MEM_TABLE,
            &mem_table(&[region(0, 64 * KIB, 0x7f00_0000_0000, 0)]),
            &[fd],
        );
        assert_refused(&mut raw, r, &format!("memory table on a {what}"));
        let mut raw = node.attacker();
        let r = raw.request(SET_INFLIGHT_FD, &inflight(8 * KIB, 0, 1, 256), &[fd]);
        assert_refused(&mut raw, r, &format!("inflight on a {what}"));
        node.check_healthy(what);
    }
}

/// Guest memory of the attacker, mapped in the test: a memfd of `len` bytes at gpa 0.
struct Guest {
    mem: GuestMemoryMmap<()>,
    file: File,
    host: u64,
    len: u64,
}

fn guest(len: u64) -> Guest {
    let file = memfd(len);
    let r =
        MmapRegion::from_file(FileOffset::new(file.try_clone().unwrap(), 0), len as usize).unwrap();
    let mem =
        GuestMemoryMmap::from_regions(vec![GuestRegionMmap::new(r, GuestAddress(0)).unwrap()])
            .unwrap();
    let host = mem.get_host_address(GuestAddress(0)).unwrap() as u64;
    Guest {
        mem,
        file,
        host,
        len,
    }
}

/// A write of 512 bytes from `data` to `sector`, header and status in the first page:
/// descriptors `first..first + 3`.
fn write_chain(g: &Guest, first: u16, hdr: u64, data: u64, sector: u64) -> [RawDescriptor; 3] {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&1u32.to_le_bytes()); // VIRTIO_BLK_T_OUT
    h[8..].copy_from_slice(&sector.to_le_bytes());
    g.mem.write_slice(&h, GuestAddress(hdr)).unwrap();
    g.mem.write_obj(0xffu8, GuestAddress(hdr + 0x100)).unwrap();
    [
        RawDescriptor::from(SplitDescriptor::new(hdr, 16, 1, first + 1)),
        RawDescriptor::from(SplitDescriptor::new(data, 512, 1, first + 2)),
        RawDescriptor::from(SplitDescriptor::new(hdr + 0x100, 1, 2, 0)),
    ]
}

/// Sets up queue 0 on the mock queue's rings in `g` (memory table: `g` at gpa 0) and checks
/// that a write from `g`'s first page through the queue completes. Returns the kick eventfd.
fn start_queue(raw: &mut Raw, g: &Guest, q: &MockSplitQueue<GuestMemoryMmap<()>>) -> EventFd {
    let len = g.len;
    assert_eq!(
        raw.request(
            SET_MEM_TABLE,
            &mem_table(&[region(0, len, g.host, 0)]),
            &[g.file.as_raw_fd()]
        ),
        Reply::Ack(0)
    );
    assert_eq!(
        raw.request(SET_VRING_NUM, &vring_state(0, u32::from(QSIZE)), &[]),
        Reply::Ack(0)
    );
    assert_eq!(
        raw.request(SET_VRING_BASE, &vring_state(0, 0), &[]),
        Reply::Ack(0)
    );
    let mut addr = vring_state(0, 0);
    for a in [q.desc_table_addr(), q.used_addr(), q.avail_addr()] {
        addr.extend_from_slice(&(g.host + a.0).to_le_bytes());
    }
    addr.extend_from_slice(&0u64.to_le_bytes());
    assert_eq!(raw.request(SET_VRING_ADDR, &addr, &[]), Reply::Ack(0));
    let call = EventFd::new(0).unwrap();
    let kick = EventFd::new(0).unwrap();
    assert_eq!(
        raw.request(SET_VRING_CALL, &0u64.to_le_bytes(), &[call.as_raw_fd()]),
        Reply::Ack(0)
    );
    assert_eq!(
        raw.request(SET_VRING_KICK, &0u64.to_le_bytes(), &[kick.as_raw_fd()]),
        Reply::Ack(0)
    );
    assert_eq!(
        raw.request(SET_VRING_ENABLE, &vring_state(0, 1), &[]),
        Reply::Ack(0)
    );
    // A first write from the first page: the queue works.
    q.add_desc_chains(&write_chain(g, 0, 0x800, 0xc00, 8), 0)
        .unwrap();
    kick.write(1).unwrap();
    wait_used(q, 1);
    assert_eq!(g.mem.read_obj::<u8>(GuestAddress(0x900)).unwrap(), 0);
    kick
}

fn wait_used(q: &MockSplitQueue<GuestMemoryMmap<()>>, n: u16) {
    let t = Instant::now();
    while q.used().idx().load() < n {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "request not completed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A running queue, then ADD_MEM_REG of a region at gpa 1 MiB longer than its 4 KiB file and a
/// request whose header lies in it, 512 KiB past the end of the file. The region is refused
/// and the request never succeeds (the attacker kicks anyway): it is either not taken before
/// the frontend is dropped or failed with IOERR, its header not being in guest memory.
#[test]
fn descriptor_past_end_of_file_is_never_read() {
    let mut node = Node::new();
    let g = guest(64 * KIB);
    let q = MockSplitQueue::new(&g.mem, QSIZE);
    let mut raw = node.attacker();
    let kick = start_queue(&mut raw, &g, &q);

    let short = memfd(4 * KIB);
    let r = raw.request(
        ADD_MEM_REG,
        &add_mem_reg(&region(MIB, MIB, 0x7f00_0000_0000, 0)),
        &[short.as_raw_fd()],
    );
    // The chain: header at gpa 1 MiB + 512 KiB, data and status in the first region.
    let hdr = MIB + 512 * KIB;
    let descs = [
        RawDescriptor::from(SplitDescriptor::new(hdr, 16, 1, 4)),
        RawDescriptor::from(SplitDescriptor::new(0x2000, 512, 1, 5)),
        RawDescriptor::from(SplitDescriptor::new(0x3000, 1, 2, 0)),
    ];
    g.mem.write_obj(0xffu8, GuestAddress(0x3000)).unwrap();
    q.add_desc_chains(&descs, 3).unwrap();
    kick.write(1).unwrap();
    assert_refused(
        &mut raw,
        r,
        "ADD_MEM_REG 1 MiB on 4 KiB, header past the end",
    );
    std::thread::sleep(Duration::from_millis(100));
    // Not taken before the frontend was dropped, or failed: never read from past the end of
    // the file nor completed successfully.
    let status = g.mem.read_obj::<u8>(GuestAddress(0x3000)).unwrap();
    assert_ne!(status, 0, "request past the end of the file succeeded");
    assert!(q.used().idx().load() <= 2);
    node.check_healthy("descriptor past the end of the file");
}

/// The frontend shrinks its 1 MiB memory file to 4 KiB under a running queue, then kicks a
/// write whose data buffer lies in the upper half: the backend's access faults, the fault is
/// absorbed, the attacker's connection is dropped, everything else goes on.
#[test]
fn memory_shrunk_under_a_running_queue_costs_only_that_connection() {
    let mut node = Node::new();
    let g = guest(MIB);
    let q = MockSplitQueue::new(&g.mem, QSIZE);
    let mut raw = node.attacker();
    let kick = start_queue(&mut raw, &g, &q);

    // Data in the upper half, written while it still exists.
    let data = 768 * KIB;
    g.mem.write_slice(&[0x5a; 512], GuestAddress(data)).unwrap();
    let chain = write_chain(&g, 3, 0x810, data, 16);
    g.file.set_len(4 * KIB).unwrap();
    // From here on the test touches only the first page (the rings, header, status).
    q.add_desc_chains(&chain, 3).unwrap();
    kick.write(1).unwrap();
    assert!(
        raw.wait_closed(),
        "the frontend whose memory vanished was not dropped"
    );
    node.check_healthy("memory shrunk under a running queue");

    // A second attacker in a row truncates its whole memory file, rings included, and kicks:
    // the worker faults reading the available ring. The test no longer touches that memory.
    let g = guest(MIB);
    let q = MockSplitQueue::new(&g.mem, QSIZE);
    let mut raw = node.attacker();
    let kick = start_queue(&mut raw, &g, &q);
    g.file.set_len(0).unwrap();
    kick.write(1).unwrap();
    assert!(
        raw.wait_closed(),
        "the frontend whose rings vanished was not dropped"
    );
    node.check_healthy("whole memory file truncated");
}

/// GET_INFLIGHT_FD hands the frontend the backend's own inflight memfd: the frontend shrinks it
/// to nothing under a running queue and kicks a request, whose recording in the inflight region
/// faults in the worker. Only the attacker's connection is lost.
#[test]
fn inflight_file_shrunk_under_a_running_queue_costs_only_that_connection() {
    let mut node = Node::new();
    let g = guest(MIB);
    let q = MockSplitQueue::new(&g.mem, QSIZE);
    let mut raw = node.attacker();
    let (body, file) = raw.request_fd(GET_INFLIGHT_FD, &inflight(0, 0, 1, QSIZE), 24);
    let size = u64::from_le_bytes(body[..8].try_into().unwrap());
    assert!(size >= 16 + 16 * u64::from(QSIZE));
    assert_eq!(file.metadata().unwrap().len(), size);
    let kick = start_queue(&mut raw, &g, &q);
    file.set_len(0).unwrap();
    q.add_desc_chains(&write_chain(&g, 3, 0x810, 0xe00, 16), 3)
        .unwrap();
    kick.write(1).unwrap();
    assert!(
        raw.wait_closed(),
        "the frontend whose inflight region vanished was not dropped"
    );
    node.check_healthy("inflight file shrunk under a running queue");
}
