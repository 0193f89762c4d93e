//! katablk-vhost driven by a real vhost-user client (libblkio's virtio-blk-vhost-user driver).
#![allow(clippy::unwrap_used)]

mod common;

use std::mem::MaybeUninit;
use std::process::Command;
use std::time::Duration;

use blkio::{Completion, ReqFlags};
use common::*;

const MIB: u64 = 1 << 20;

fn file_server(size: u64, extra: &[&str]) -> (tempfile::TempDir, std::path::PathBuf, Server) {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", size);
    let sock = dir.path().join("vhost.sock");
    let mut args = vec!["--file", img.to_str().unwrap()];
    args.extend_from_slice(extra);
    let srv = Server::start(&sock, &args);
    (dir, sock, srv)
}

#[test]
fn smoke_write_read() {
    let (_d, sock, _srv) = file_server(64 * MIB, &[]);
    let mut c = Client::connect(&sock, 1, false).unwrap();
    assert_eq!(c.capacity, 64 * MIB);
    let data = pattern(4096, 65536, 7);
    assert_eq!(c.write(0, 4096, &data), 0);
    assert_eq!(c.read(0, 4096, 65536).unwrap(), data);
    assert_eq!(c.flush(0), 0);
}

/// Random writes of many sizes and offsets, checked against a model of the disk.
fn patterns_on(sock: &std::path::Path, size: u64) {
    let mut c = Client::connect(sock, 1, false).unwrap();
    let mut model = vec![0u8; size as usize];
    let mut rng = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let sizes = [
        512usize,
        1024,
        4096,
        8192,
        12288,
        65536,
        131072,
        1 << 20,
        4 << 20,
    ];
    for i in 0..200 {
        let len = sizes[(next() % sizes.len() as u64) as usize];
        let off = (next() % ((size - len as u64) / 512)) * 512;
        let data = pattern(off, len, i as u8);
        assert_eq!(c.write(0, off, &data), 0, "write {len}@{off}");
        model[off as usize..off as usize + len].copy_from_slice(&data);
        if i % 7 == 0 {
            let roff = (next() % ((size - len as u64) / 512)) * 512;
            let back = c.read(0, roff, len).unwrap();
            assert!(
                back == model[roff as usize..roff as usize + len],
                "read {len}@{roff}"
            );
        }
    }
    for chunk in 0..size / (4 * MIB) {
        let off = chunk * 4 * MIB;
        let back = c.read(0, off, (4 * MIB) as usize).unwrap();
        assert!(
            back == model[off as usize..(off + 4 * MIB) as usize],
            "chunk {chunk}"
        );
    }
    // The first and last sector.
    assert_eq!(c.write(0, size - 512, &[0xee; 512]), 0);
    assert_eq!(c.read(0, size - 512, 512).unwrap(), vec![0xee; 512]);
}

#[test]
fn patterns_file() {
    let (_d, sock, _srv) = file_server(32 * MIB, &[]);
    patterns_on(&sock, 32 * MIB);
}

#[test]
fn patterns_malloc_no_polling() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("m.sock");
    let _srv = Server::start(&sock, &["--malloc", "32", "--poll-us", "0"]);
    patterns_on(&sock, 32 * MIB);
}

#[test]
fn patterns_file_direct() {
    // O_DIRECT needs a filesystem that supports it (not tmpfs): use /var/tmp.
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let img = image(dir.path(), "disk.img", 16 * MIB);
    let sock = dir.path().join("d.sock");
    let probe = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags_direct()
        .open(&img);
    if probe.is_err() {
        eprintln!("skipped: O_DIRECT not supported under /var/tmp");
        return;
    }
    let _srv = Server::start(&sock, &["--file", img.to_str().unwrap(), "--direct"]);
    patterns_on(&sock, 16 * MIB);
}

trait DirectExt {
    fn custom_flags_direct(&mut self) -> &mut Self;
}
impl DirectExt for std::fs::OpenOptions {
    fn custom_flags_direct(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.custom_flags(libc::O_DIRECT)
    }
}

#[test]
fn deep_queue_random_writes() {
    let (_d, sock, _srv) = file_server(16 * MIB, &[]);
    let mut c = Client::connect(&sock, 1, false).unwrap();
    // 64 writes of 64 KiB in flight at once, each to its own slot of the buffer region.
    let len = 65536usize;
    let buf = c.buf();
    for i in 0..64u64 {
        let data = pattern(i * len as u64, len, 3);
        // SAFETY: slot i of the 8 MiB region is ours.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.add(i as usize * len), len) };
        // SAFETY: as above.
        let p = unsafe { buf.add(i as usize * len) };
        c.queues[0].write(i * len as u64 * 3, p, len, i as usize, ReqFlags::empty());
    }
    let mut comps: Vec<MaybeUninit<Completion>> = (0..64).map(|_| MaybeUninit::uninit()).collect();
    let mut got = 0;
    while got < 64 {
        let mut t = Duration::from_secs(30);
        let n = c.queues[0]
            .do_io(&mut comps[..64 - got], 1, Some(&mut t), None)
            .unwrap();
        for cm in &comps[..n] {
            // SAFETY: do_io initialised n completions.
            assert_eq!(unsafe { cm.assume_init_ref() }.ret, 0);
        }
        got += n;
    }
    for i in 0..64u64 {
        let back = c.read(0, i * len as u64 * 3, len).unwrap();
        assert_eq!(back, pattern(i * len as u64, len, 3), "write {i}");
    }
}

#[test]
fn discard_and_write_zeroes() {
    let (_d, sock, _srv) = file_server(8 * MIB, &[]);
    let mut c = Client::connect(&sock, 1, false).unwrap();
    let data = vec![0x5au8; 1 << 20];
    assert_eq!(c.write(0, 0, &data), 0);
    assert_eq!(c.discard(0, 0, 65536), 0);
    assert_eq!(c.write_zeroes(0, 65536, 65536, false), 0);
    assert_eq!(c.write_zeroes(0, 131072, 4096, true), 0);
    let back = c.read(0, 0, 1 << 20).unwrap();
    assert!(back[..135168].iter().all(|&b| b == 0));
    assert!(back[135168..].iter().all(|&b| b == 0x5a));
    // Sub-sector discard ranges are rejected by the client or the server, never corrupting.
    assert_eq!(c.read(0, 135168, 512).unwrap(), vec![0x5a; 512]);
}

#[test]
fn flush_survives_server_stop() {
    let (d, sock, mut srv) = file_server(8 * MIB, &[]);
    {
        let mut c = Client::connect(&sock, 1, false).unwrap();
        assert_eq!(c.write(0, MIB, &pattern(MIB, 8192, 1)), 0);
        assert_eq!(c.flush(0), 0);
    }
    assert!(srv.stop().success());
    assert!(!sock.exists(), "socket removed on clean shutdown");
    let on_disk = std::fs::read(d.path().join("disk.img")).unwrap();
    assert_eq!(
        &on_disk[MIB as usize..MIB as usize + 8192],
        &pattern(MIB, 8192, 1)[..]
    );
}

#[test]
fn read_only_device() {
    let (_d, sock, _srv) = file_server(8 * MIB, &["--readonly"]);
    let mut c = Client::connect(&sock, 1, true).unwrap();
    assert!(c.read(0, 0, 4096).is_ok());
    assert_ne!(
        c.write(0, 0, &[1u8; 4096]),
        0,
        "write to a read-only device must fail"
    );
    assert_ne!(c.discard(0, 0, 4096), 0);
    assert_ne!(c.write_zeroes(0, 0, 4096, false), 0);
    assert_eq!(c.read(0, 0, 4096).unwrap(), vec![0u8; 4096]);
    drop(c);
    // A client that asks for a writable device is told it is read-only.
    if let Ok(mut c) = Client::connect(&sock, 1, false) {
        assert_ne!(c.write(0, 0, &[1u8; 512]), 0);
        assert_eq!(c.read(0, 0, 512).unwrap(), vec![0u8; 512]);
    }
}

#[test]
fn out_of_range_requests_fail() {
    let (_d, sock, _srv) = file_server(4 * MIB, &[]);
    let mut c = Client::connect(&sock, 1, false).unwrap();
    assert!(c.read(0, 4 * MIB, 512).is_err());
    assert!(c.read(0, 4 * MIB - 512, 1024).is_err());
    assert_ne!(c.write(0, 4 * MIB, &[1u8; 512]), 0);
    assert_ne!(c.discard(0, 4 * MIB - 512, 4096), 0);
    // The device still works afterwards.
    assert_eq!(c.write(0, 0, &[3u8; 512]), 0);
    assert_eq!(c.read(0, 0, 512).unwrap(), vec![3u8; 512]);
}

#[test]
fn several_queues_at_once() {
    let (_d, sock, _srv) = file_server(32 * MIB, &["--num-queues", "4"]);
    let c = Client::connect(&sock, 4, false).unwrap();
    let common::Client {
        blkio: _b,
        queues,
        region,
        ..
    } = c;
    let base = region.addr;
    let threads: Vec<_> = queues
        .into_iter()
        .enumerate()
        .map(|(qi, mut q)| {
            std::thread::spawn(move || {
                let slot = base + qi * (2 << 20);
                for i in 0..100u64 {
                    let off = (qi as u64 * 8 * MIB) + i * 65536;
                    let data = pattern(off, 65536, qi as u8);
                    // SAFETY: each thread uses its own 2 MiB slot of the region.
                    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), slot as *mut u8, 65536) };
                    q.write(off, slot as *const u8, 65536, 0, ReqFlags::empty());
                    let mut cm = [MaybeUninit::<Completion>::uninit()];
                    let mut t = Duration::from_secs(30);
                    assert_eq!(q.do_io(&mut cm, 1, Some(&mut t), None).unwrap(), 1);
                    // SAFETY: initialised by do_io.
                    assert_eq!(unsafe { cm[0].assume_init_ref() }.ret, 0);
                    q.read(off, (slot + 65536) as *mut u8, 65536, 0, ReqFlags::empty());
                    let mut t = Duration::from_secs(30);
                    assert_eq!(q.do_io(&mut cm, 1, Some(&mut t), None).unwrap(), 1);
                    // SAFETY: initialised by do_io.
                    assert_eq!(unsafe { cm[0].assume_init_ref() }.ret, 0);
                    // SAFETY: the read filled 64 KiB at slot + 64 KiB.
                    let back =
                        unsafe { std::slice::from_raw_parts((slot + 65536) as *const u8, 65536) };
                    assert!(back == &data[..], "queue {qi} write {i}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn queue_to_thread_mapping() {
    let (_d, sock, _srv) = file_server(
        8 * MIB,
        &["--num-queues", "4", "--queue-threads", "0x3,0xc"],
    );
    let mut c = Client::connect(&sock, 4, false).unwrap();
    for q in 0..4 {
        let off = q as u64 * MIB;
        assert_eq!(c.write(q, off, &pattern(off, 4096, 9)), 0);
    }
    for q in 0..4 {
        let off = q as u64 * MIB;
        assert_eq!(c.read(3 - q, off, 4096).unwrap(), pattern(off, 4096, 9));
    }
}

#[test]
fn client_disconnect_and_reconnect() {
    let (_d, sock, _srv) = file_server(8 * MIB, &["--num-queues", "2"]);
    for round in 0..5u8 {
        let mut c = Client::connect(&sock, if round % 2 == 0 { 1 } else { 2 }, false).unwrap();
        if round > 0 {
            assert_eq!(
                c.read(0, u64::from(round - 1) * 4096, 4096).unwrap(),
                vec![round - 1; 4096]
            );
        }
        assert_eq!(c.write(0, u64::from(round) * 4096, &[round; 4096]), 0);
        // Dropped without flush: a disconnect is not an exit.
    }
}

#[test]
fn server_restart_mid_run() {
    let (_d, sock, mut srv) = file_server(8 * MIB, &[]);
    let mut c = Client::connect(&sock, 1, false).unwrap();
    for i in 0..32u64 {
        assert_eq!(c.write(0, i * 65536, &pattern(i, 65536, 2)), 0);
    }
    assert_eq!(c.flush(0), 0);
    srv.kill();
    drop(c);
    srv.spawn();
    let mut c = Client::connect(&sock, 1, false).unwrap();
    for i in 0..32u64 {
        assert_eq!(c.read(0, i * 65536, 65536).unwrap(), pattern(i, 65536, 2));
    }
}

fn run_fail(args: &[&str]) -> String {
    let out = Command::new(bin()).args(args).output().unwrap();
    assert!(!out.status.success(), "{args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let s = sock.to_str().unwrap();
    let e = run_fail(&["--socket", s, "--file", "/nonexistent/disk.img"]);
    assert!(
        e.contains("/nonexistent/disk.img") && e.contains("No such file"),
        "{e}"
    );
    let long = format!("{}/{}", dir.path().display(), "x".repeat(120));
    let e = run_fail(&["--socket", &long, "--malloc", "4"]);
    assert!(e.contains("limited to 107"), "{e}");
    let e = run_fail(&["--socket", s]);
    assert!(e.contains("--file") || e.contains("required"), "{e}");
    let e = run_fail(&["--socket", "/nonexistent-dir/s.sock", "--malloc", "4"]);
    assert!(e.contains("does not exist"), "{e}");
    let e = run_fail(&["--socket", s, "--malloc", "4", "--queue-size", "100"]);
    assert!(e.contains("power of two"), "{e}");
    // A regular file at the socket path is not removed.
    std::fs::write(&sock, b"keep").unwrap();
    let e = run_fail(&["--socket", s, "--malloc", "4"]);
    assert!(e.contains("not a socket"), "{e}");
    assert_eq!(std::fs::read(&sock).unwrap(), b"keep");
    // Permission denied, as an unprivileged user on a root-only file.
    let img = image(dir.path(), "disk.img", MIB);
    std::fs::set_permissions(&img, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(bin())
        .args(["--socket", &format!("{}/n.sock", dir.path().display())])
        .args(["--file", img.to_str().unwrap()])
        .output();
    match out {
        Ok(o) if unsafe_is_root() => {
            assert!(!o.status.success());
            let e = String::from_utf8_lossy(&o.stderr);
            assert!(e.contains("Permission denied"), "{e}");
        }
        _ => eprintln!("skipped permission check: needs root and setpriv"),
    }
}

fn unsafe_is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn stale_socket_is_replaced_live_one_refused() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    // A stale socket: bound then the listener dropped.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    assert!(sock.exists());
    let _srv = Server::start(&sock, &["--malloc", "4"]);
    let e = run_fail(&["--socket", sock.to_str().unwrap(), "--malloc", "4"]);
    assert!(e.contains("another server"), "{e}");
    let mut c = Client::connect(&sock, 1, false).unwrap();
    assert_eq!(c.write(0, 0, &[1; 512]), 0);
}

#[test]
fn patterns_every_io_mode() {
    for mode in ["io_uring", "threads", "inline"] {
        let (_d, sock, _srv) = file_server(16 * MIB, &["--io-mode", mode, "--num-queues", "2"]);
        patterns_on(&sock, 16 * MIB);
    }
}
