//! One hostile vhost-user frontend never takes down another volume of the same target.
//!
//! A `katablk-target` child serves two RAM bdevs through two vhost-user-blk controllers, A and
//! B. A well-behaved libblkio client of B writes and reads back (verifying) in a thread the
//! whole time, while a raw frontend (`katablk_test_support::raw`) attacks A: inflight and
//! memory files smaller than their mappings, `mmap_offset` past the end, files that are not
//! regular files, memory and inflight files shrunk under a running queue, garbage headers, a
//! header announcing a huge payload then closing, half a header then silence, every request
//! code 0..=60 with random payloads, random descriptors attached to random messages. After
//! every attack: the target runs and has not panicked, JSON-RPC answers, B's client saw no
//! error and keeps making progress, and a fresh libblkio client of A does verified I/O. At the
//! end all of B's data is read back and verified.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blkio::ReqFlags;
use common::{fill, Client, Target};
use katablk_test_support::raw::*;
use serde_json::{json, Value};

/// One JSON-RPC call on a fresh connection (30 s timeout): `result`, or `error`.
fn rpc(sock: &Path, method: &str, params: Option<Value>) -> Result<Value, Value> {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut req = json!({"jsonrpc": "2.0", "id": 1, "method": method});
    if let Some(p) = params {
        req["params"] = p;
    }
    s.write_all(req.to_string().as_bytes()).unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 65536];
    loop {
        let n = s.read(&mut chunk).unwrap();
        assert!(
            n > 0,
            "{method}: connection closed: {}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
        match serde_json::from_slice::<Value>(&buf) {
            Ok(v) => {
                return match v.get("error") {
                    Some(e) => Err(e.clone()),
                    None => Ok(v["result"].clone()),
                }
            }
            Err(e) if e.is_eof() => continue,
            Err(e) => panic!(
                "{method}: bad reply: {e}: {}",
                String::from_utf8_lossy(&buf)
            ),
        }
    }
}

/// Writes `data` at `off` and reads it back; Err says what went wrong.
fn write_read(c: &mut Client, off: u64, data: &[u8]) -> Result<(), String> {
    let p = c.buf();
    // SAFETY: the region is ours and 8 MiB long; `data` is at most 64 KiB.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
    c.queues[0].write(off, p, data.len(), 0, ReqFlags::empty());
    match c.try_wait1(0) {
        Some(0) => {}
        r => return Err(format!("write at {off}: {r:?}")),
    }
    read_check(c, off, data)
}

fn read_check(c: &mut Client, off: u64, data: &[u8]) -> Result<(), String> {
    // Read into the second MiB of the region, so a read that did nothing cannot pass.
    // SAFETY: 1 MiB + 64 KiB stays within the 8 MiB region.
    let p = unsafe { c.buf().add(1 << 20) };
    // SAFETY: as above; clears the target buffer.
    unsafe { std::ptr::write_bytes(p, 0xa5, data.len()) };
    c.queues[0].read(off, p, data.len(), 0, ReqFlags::empty());
    match c.try_wait1(0) {
        Some(0) => {}
        r => return Err(format!("read at {off}: {r:?}")),
    }
    // SAFETY: `data.len()` bytes were just read there.
    let got = unsafe { std::slice::from_raw_parts(p, data.len()) };
    if got != data {
        return Err(format!("data at {off} does not verify"));
    }
    Ok(())
}

const SLOTS: u64 = 128;
const CHUNK: usize = 64 << 10;

/// The well-behaved client of controller B, writing and verifying in a thread.
struct Neighbour {
    stop: Arc<AtomicBool>,
    ios: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    last_error: Arc<Mutex<String>>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Neighbour {
    fn start(sock: PathBuf) -> Neighbour {
        let stop = Arc::new(AtomicBool::new(false));
        let ios = Arc::new(AtomicU64::new(0));
        let errors = Arc::new(AtomicU64::new(0));
        let last_error = Arc::new(Mutex::new(String::new()));
        let (s, i, e, l) = (
            stop.clone(),
            ios.clone(),
            errors.clone(),
            last_error.clone(),
        );
        let fail = move |msg: String| {
            e.fetch_add(1, Ordering::SeqCst);
            *l.lock().unwrap() = msg;
        };
        let thread = std::thread::spawn(move || {
            let mut c = Client::connect(&sock, 1, false).unwrap();
            let mut written = vec![None; SLOTS as usize];
            let mut round = 0u64;
            while !s.load(Ordering::Relaxed) {
                let slot = round % SLOTS;
                let data = fill(round, CHUNK);
                if let Err(m) = write_read(&mut c, slot * CHUNK as u64, &data) {
                    fail(m);
                    return 0;
                }
                written[slot as usize] = Some(round);
                i.fetch_add(2, Ordering::SeqCst);
                round += 1;
            }
            // Everything written is still there.
            let mut verified = 0;
            for (slot, r) in written.iter().enumerate() {
                if let Some(r) = r {
                    if let Err(m) = read_check(&mut c, slot as u64 * CHUNK as u64, &fill(*r, CHUNK))
                    {
                        fail(format!("final check: {m}"));
                    }
                    i.fetch_add(1, Ordering::SeqCst);
                    verified += 1;
                }
            }
            verified
        });
        Neighbour {
            stop,
            ios,
            errors,
            last_error,
            thread: Some(thread),
        }
    }

    fn assert_ok(&self, what: &str) {
        assert_eq!(
            self.errors.load(Ordering::SeqCst),
            0,
            "{what}: controller B's client failed: {}",
            self.last_error.lock().unwrap()
        );
    }

    /// B's client has no error and makes progress (within 60 s).
    fn assert_progress(&self, what: &str) {
        let before = self.ios.load(Ordering::SeqCst);
        let t = Instant::now();
        while self.ios.load(Ordering::SeqCst) <= before + 2 {
            self.assert_ok(what);
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "{what}: controller B's client makes no progress"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        self.assert_ok(what);
    }

    /// Stops the client; returns (I/Os done, slots verified at the end).
    fn finish(&mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::SeqCst);
        let verified = self.thread.take().unwrap().join().unwrap();
        self.assert_ok("final check");
        (self.ios.load(Ordering::SeqCst), verified)
    }
}

/// The target, its two controllers and B's client.
struct Bench {
    _dir: tempfile::TempDir,
    t: Target,
    a: PathBuf,
    nb: Neighbour,
    scratch: PathBuf,
    cases: u32,
    log_seen: usize,
    round: u64,
}

impl Bench {
    fn new() -> Bench {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let scratch = dir.path().join("scratch");
        std::fs::create_dir(&scratch).unwrap();
        let t = Target::start(dir.path(), &["--state-dir", state.to_str().unwrap()]);
        for (bdev, ctrlr) in [("MallocA", "ctrlrA"), ("MallocB", "ctrlrB")] {
            let p = json!({"name": bdev, "num_blocks": 65536, "block_size": 512});
            assert_eq!(
                rpc(&t.rpc, "bdev_malloc_create", Some(p)).unwrap(),
                json!(bdev)
            );
            let p = json!({"ctrlr": ctrlr, "dev_name": bdev});
            rpc(&t.rpc, "vhost_create_blk_controller", Some(p)).unwrap();
        }
        let a = t.ctrlr_socket("ctrlrA");
        let nb = Neighbour::start(t.ctrlr_socket("ctrlrB"));
        let b = Bench {
            _dir: dir,
            t,
            a,
            nb,
            scratch,
            cases: 0,
            log_seen: 0,
            round: 0,
        };
        b.nb.assert_progress("start");
        b
    }

    fn attacker(&self) -> Raw {
        let mut r = Raw::connect(&self.a);
        r.handshake();
        r
    }

    /// The target runs, has not panicked and answers JSON-RPC; B's client is fine.
    fn check_target(&mut self, what: &str) {
        let st = self.t.daemon.try_wait();
        assert!(
            st.is_none(),
            "{what}: katablk-target died: {st:?}\n{}",
            self.t.log()
        );
        let log = self.t.log();
        let new = &log[self.log_seen.min(log.len())..];
        assert!(
            !new.contains("panicked"),
            "{what}: katablk-target panicked:\n{new}"
        );
        self.log_seen = log.len();
        let v = rpc(&self.t.rpc, "spdk_get_version", None).unwrap();
        assert!(v["version"].as_str().is_some(), "{what}: {v}");
        let bdevs = rpc(&self.t.rpc, "bdev_get_bdevs", None).unwrap();
        assert_eq!(bdevs.as_array().unwrap().len(), 2, "{what}: {bdevs}");
        rpc(&self.t.rpc, "vhost_get_controllers", None).unwrap();
        self.nb.assert_progress(what);
    }

    /// After an attack (its connection closed): everything above, and a fresh libblkio
    /// client of A does verified I/O.
    fn check(&mut self, what: &str) {
        self.cases += 1;
        self.check_target(what);
        self.round += 1;
        // The attack's connection is closed: the next frontend is served at once and its
        // first request succeeds (a failure here once came from a worker taking a chain with
        // the memory table of before the frontend's last ADD_MEM_REG).
        let mut c = Client::connect(&self.a, 1, false)
            .unwrap_or_else(|e| panic!("{what}: no client of A: {e}\n{}", self.t.log()));
        let off = (self.round % 64) * CHUNK as u64;
        let data = fill(self.round ^ 0xa, 8192);
        if let Err(e) = write_read(&mut c, off, &data) {
            panic!("{what}: fresh client of A: {e}\n{}", self.t.log());
        }
        drop(c);
        self.check_target(what);
    }
}

/// The attack got a NACK and then a disconnect, or the disconnect at once.
fn assert_refused(raw: &mut Raw, r: Reply, what: &str) {
    assert_ne!(r, Reply::Ack(0), "{what}: accepted");
    assert!(raw.wait_closed(), "{what}: frontend not dropped");
}

fn bad_files(b: &mut Bench) {
    // The reproducer (no REPLY_ACK): SET_INFLIGHT_FD with a 0-byte memfd.
    let raw = Raw::connect(&b.a);
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
    let mut raw = raw;
    assert!(
        raw.wait_closed(),
        "0-byte inflight memfd: frontend not dropped"
    );
    drop(raw);
    b.check("0-byte inflight memfd");

    for (file_len, size, offset) in [(4 * KIB, 8 * KIB, 0), (64 * KIB, 8 * KIB, 60 * KIB)] {
        let what = format!("inflight {size} bytes at {offset} of a {file_len}-byte memfd");
        let mut raw = b.attacker();
        let f = memfd(file_len);
        let r = raw.request(
            SET_INFLIGHT_FD,
            &inflight(size, offset, 1, 256),
            &[f.as_raw_fd()],
        );
        assert_refused(&mut raw, r, &what);
        drop(raw);
        b.check(&what);
    }

    // Memory regions far longer than their file.
    let f = memfd(4 * KIB);
    let good = memfd(MIB);
    let huge = region(0, 64 << 40, 0x7f00_0000_0000, 0);
    let cases: [(&str, u32, Vec<u8>, Vec<i32>); 3] = [
        (
            "SET_MEM_TABLE 64 TiB on 4 KiB",
            SET_MEM_TABLE,
            mem_table(std::slice::from_ref(&huge)),
            vec![f.as_raw_fd()],
        ),
        (
            "SET_MEM_TABLE second region too long",
            SET_MEM_TABLE,
            mem_table(&[
                region(0, MIB, 0x7e00_0000_0000, 0),
                region(MIB, 64 << 40, 0x7f00_0000_0000, 0),
            ]),
            vec![good.as_raw_fd(), f.as_raw_fd()],
        ),
        (
            "ADD_MEM_REG 64 TiB on 4 KiB",
            ADD_MEM_REG,
            add_mem_reg(&huge),
            vec![f.as_raw_fd()],
        ),
    ];
    for (what, req, p, fds) in &cases {
        let mut raw = b.attacker();
        let r = raw.request(*req, p, fds);
        assert_refused(&mut raw, r, what);
        drop(raw);
        b.check(what);
    }

    // mmap_offset past the end of the file.
    let f = memfd(64 * KIB);
    for (what, r) in [
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
    ] {
        for (req, p) in [
            (SET_MEM_TABLE, mem_table(std::slice::from_ref(&r))),
            (ADD_MEM_REG, add_mem_reg(&r)),
        ] {
            let what = format!("request {req}: {what}");
            let mut raw = b.attacker();
            let reply = raw.request(req, &p, &[f.as_raw_fd()]);
            assert_refused(&mut raw, reply, &what);
            drop(raw);
            b.check(&what);
        }
    }

    // Descriptors that are not regular files.
    for kind in [
        FdKind::Directory,
        FdKind::DevNull,
        FdKind::PipeRead,
        FdKind::Socket,
    ] {
        let mut keep = Vec::new();
        let fd = kind.open(&b.scratch, &mut keep);
        for (req, p) in [
            (
                SET_MEM_TABLE,
                mem_table(&[region(0, 64 * KIB, 0x7f00_0000_0000, 0)]),
            ),
            (SET_INFLIGHT_FD, inflight(8 * KIB, 0, 1, 256)),
        ] {
            let what = format!("request {req} on a {kind:?}");
            let mut raw = b.attacker();
            let r = raw.request(req, &p, &[fd.as_raw_fd()]);
            assert_refused(&mut raw, r, &what);
            drop(raw);
            b.check(&what);
        }
    }
}

fn shrunk_under_running_queue(b: &mut Bench) {
    // Guest memory shrunk from 1 MiB to 4 KiB, then a write whose data lies in the upper half.
    let g = Guest::new(MIB);
    let r = Ring::new(16);
    let mut raw = b.attacker();
    let q = raw.start_queue(&g, &r, 0);
    let data = 768 * KIB;
    g.write(data, &[0x5a; 512]);
    let head = g.write_request(&r, 3, 0xc20, data, 16);
    g.file.set_len(4 * KIB).unwrap();
    // From here on only the first page (rings, header, status) is touched.
    g.push_avail(&r, head);
    kick(&q.kick);
    assert!(raw.wait_closed(), "memory shrunk: frontend not dropped");
    drop(raw);
    drop(q);
    b.check("memory shrunk under a running queue");

    // The whole memory file truncated, rings included, then a kick.
    let g = Guest::new(MIB);
    let mut raw = b.attacker();
    let q = raw.start_queue(&g, &r, 0);
    g.file.set_len(0).unwrap();
    kick(&q.kick);
    assert!(raw.wait_closed(), "memory truncated: frontend not dropped");
    drop(raw);
    b.check("whole memory file truncated under a running queue");

    // The backend's own inflight file (GET_INFLIGHT_FD) shrunk to nothing, then a request.
    let g = Guest::new(MIB);
    let mut raw = b.attacker();
    let (body, file) = raw.request_fd(GET_INFLIGHT_FD, &inflight(0, 0, 1, 16), 24);
    let size = u64::from_le_bytes(body[..8].try_into().unwrap());
    assert_eq!(file.metadata().unwrap().len(), size);
    let q = raw.start_queue(&g, &r, 0);
    file.set_len(0).unwrap();
    let head = g.write_request(&r, 3, 0xc20, 0xe00, 16);
    g.push_avail(&r, head);
    kick(&q.kick);
    assert!(raw.wait_closed(), "inflight shrunk: frontend not dropped");
    drop(raw);
    b.check("inflight file shrunk under a running queue");
}

fn garbage(b: &mut Bench, rng: &mut Rng) {
    let mut cases: Vec<(String, Vec<u8>)> = Vec::new();
    for i in 0..6 {
        cases.push((format!("12 random bytes #{i}"), rng.bytes(12)));
    }
    cases.push(("4 KiB of junk".into(), rng.bytes(4096)));
    cases.push(("version 0".into(), encode(GET_FEATURES, 0, 0, &[])));
    cases.push(("version 3".into(), encode(GET_FEATURES, 3, 0, &[])));
    cases.push((
        "a reply sent to the backend".into(),
        encode(GET_FEATURES, VERSION | REPLY, 0, &[]),
    ));
    cases.push((
        "size 0x1001".into(),
        encode(SET_FEATURES, VERSION, 0x1001, &[0; 8]),
    ));
    cases.push((
        "request 0xffffffff".into(),
        encode(u32::MAX, VERSION, 0, &[]),
    ));
    cases.push((
        "huge payload announced, then close".into(),
        encode(SET_MEM_TABLE, VERSION, u32::MAX, &[]),
    ));
    cases.push((
        "4 KiB payload announced, none sent, then close".into(),
        encode(SET_CONFIG, VERSION, 0x1000, &[]),
    ));
    cases.push((
        "4 KiB payload announced, 100 bytes sent, then close".into(),
        encode(SET_MEM_TABLE, VERSION | NEED_REPLY, 0x1000, &rng.bytes(100)),
    ));
    for (what, bytes) in cases {
        for handshake in [false, true] {
            let what = format!("{what} (handshake first: {handshake})");
            let mut raw = if handshake {
                b.attacker()
            } else {
                Raw::connect(&b.a)
            };
            let _ = raw.send_bytes(&bytes, &[]);
            // Junk may also be the start of a message waiting for more: close after a moment.
            let _ = raw.wait_some(Duration::from_millis(20));
            drop(raw);
            b.check(&what);
        }
    }

    // Half a header, then silence: B and JSON-RPC go on while A's handler waits.
    let raw = b.attacker();
    raw.send_bytes(&encode(GET_FEATURES, VERSION, 0, &[])[..6], &[])
        .unwrap();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(2) {
        b.check_target("half a header, then silence (during the silence)");
    }
    drop(raw);
    b.check("half a header, then silence");
}

fn every_request_code(b: &mut Bench, rng: &mut Rng) {
    for req in 0..=60u32 {
        let mut raw = b.attacker();
        for _ in 0..4 {
            let len = rng.pick(&[0usize, 8, 12, 24, 40, 64, 200]);
            let payload = rng.bytes(len);
            let flags = rng.pick(&[VERSION | NEED_REPLY, VERSION]);
            if raw.send(req, flags, &payload, &[]).is_err() || raw.drain().is_err() {
                break;
            }
        }
        let _ = raw.wait_some(Duration::from_millis(10));
        drop(raw);
        b.check(&format!("request {req} with random payloads"));
    }
}

fn random_fds(b: &mut Bench, rng: &mut Rng) {
    for case in 0..16 {
        let mut raw = b.attacker();
        let mut sent = Vec::new();
        for _ in 0..8 {
            let req = rng.below(46) as u32;
            let mut keep: Vec<OwnedFd> = Vec::new();
            let mut fds: Vec<OwnedFd> = Vec::new();
            for _ in 0..rng.range(1, 3) {
                let kind = FdKind::random(rng);
                fds.push(kind.open(&b.scratch, &mut keep));
            }
            let raw_fds: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
            let len = rng.pick(&[0usize, 8, 24, 40, 72]);
            let payload = rng.bytes(len);
            sent.push(req);
            if raw
                .send(req, VERSION | NEED_REPLY, &payload, &raw_fds)
                .is_err()
                || raw.drain().is_err()
            {
                break;
            }
        }
        let _ = raw.wait_some(Duration::from_millis(10));
        drop(raw);
        b.check(&format!("random descriptors #{case} on requests {sent:?}"));
    }
}

#[test]
fn one_hostile_frontend_never_takes_down_another_volume() {
    let mut b = Bench::new();
    let mut rng = Rng::new(0x686f_7374_696c_6531);
    bad_files(&mut b);
    shrunk_under_running_queue(&mut b);
    garbage(&mut b, &mut rng);
    every_request_code(&mut b, &mut rng);
    random_fds(&mut b, &mut rng);
    let cases = b.cases;
    let (ios, verified) = b.nb.finish();
    b.check_target_alive();
    eprintln!(
        "hostile_frontend: {cases} attack cases on controller A; controller B's client did {ios} \
         I/Os ({verified} slots verified at the end), 0 errors"
    );
    assert!(verified > 0);
}

impl Bench {
    fn check_target_alive(&mut self) {
        let st = self.t.daemon.try_wait();
        assert!(st.is_none(), "katablk-target died: {st:?}");
        assert!(
            !self.t.log().contains("panicked"),
            "katablk-target panicked"
        );
    }
}
