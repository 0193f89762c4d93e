//! The daemon against hostile or careless RPC input (issue 18 R2, R3 and the cheap ones):
//! aio bdevs on FIFOs, character devices and sockets are refused without blocking; the
//! connection cap and idle timeout flags; refused names and sizes; exact ids.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::*;
use katablk_rpc::methods::*;

fn connect(t: &Target) -> UnixStream {
    let s = UnixStream::connect(&t.rpc).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s
}

/// Send one request and read one reply line.
fn round_trip(s: &mut UnixStream, req: &str) -> String {
    s.write_all(req.as_bytes()).unwrap();
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    while !out.ends_with(b"\n") {
        assert_eq!(s.read(&mut b).unwrap(), 1, "EOF");
        out.push(b[0]);
    }
    String::from_utf8(out).unwrap()
}

/// A connection the target serves: connections that just closed (such as the start-up
/// probe) may still be counted for a moment, so retry while refused (up to 20 s).
fn connect_served(t: &Target, req: &str) -> UnixStream {
    for _ in 0..400 {
        let mut s = connect(t);
        if s.write_all(req.as_bytes()).is_ok() {
            let mut out = Vec::new();
            let mut b = [0u8; 1];
            while !out.ends_with(b"\n") {
                match s.read(&mut b) {
                    Ok(1) => out.push(b[0]),
                    _ => break,
                }
            }
            if String::from_utf8_lossy(&out).contains("katablk-target") {
                return s;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("no connection served");
}

fn read_all(s: &mut UnixStream) -> String {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8(out).unwrap()
}

#[test]
fn aio_on_a_fifo_device_or_socket_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = Target::start(dir.path(), &[]);
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo(3) with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let rpc = client(&t);
    let r = rt();
    let cases = [
        (fifo.display().to_string(), "a FIFO"),
        ("/dev/null".to_string(), "a character device"),
        (t.rpc.display().to_string(), "a socket"),
        (dir.path().display().to_string(), "a directory"),
    ];
    for (path, what) in cases {
        for readonly in [true, false] {
            let e = r
                .block_on(rpc.bdev_aio_create(&BdevAioCreateParams {
                    filename: path.clone(),
                    name: "bad0".into(),
                    readonly: Some(readonly),
                    ..Default::default()
                }))
                .unwrap_err();
            assert_eq!(e.code(), Some(-22), "{path}: {e}");
            assert!(e.to_string().contains(what), "{path}: {e}");
        }
    }
    let e = r
        .block_on(rpc.bdev_aio_create(&BdevAioCreateParams {
            filename: dir.path().join("nope").display().to_string(),
            name: "bad0".into(),
            ..Default::default()
        }))
        .unwrap_err();
    assert_eq!(e.code(), Some(-2), "{e}");
    // The target still answers, and stops on SIGTERM.
    assert!(r.block_on(rpc.bdev_get_bdevs(None)).unwrap().is_empty());
    assert!(t.term().success());
}

#[test]
fn connection_cap_and_idle_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let t = Target::start(
        dir.path(),
        &["--rpc-max-connections", "2", "--rpc-idle-timeout", "1"],
    );
    let version = r#"{"jsonrpc":"2.0","id":1,"method":"spdk_get_version"}"#;
    let mut a = connect_served(&t, version);
    let mut b = connect_served(&t, version);
    // A third is refused with a reply saying why; the first two still work.
    let mut c = connect(&t);
    let out = read_all(&mut c);
    assert!(out.contains("too many RPC connections"), "{out:?}");
    assert!(round_trip(&mut a, version).contains("katablk-target"));
    assert!(t.log().contains("refusing RPC connection"));
    // Idle connections are closed after the timeout...
    assert_eq!(read_all(&mut a), "");
    assert_eq!(read_all(&mut b), "");
    // ...which makes room, and the client reconnects by itself across it.
    let rpc = client(&t);
    let r = rt();
    r.block_on(rpc.spdk_get_version()).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    r.block_on(rpc.spdk_get_version()).unwrap();
}

#[test]
fn bad_names_and_sizes_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let t = Target::start(dir.path(), &[]);
    let rpc = client(&t);
    let r = rt();
    let malloc = |name: &str, num_blocks: u64| BdevMallocCreateParams {
        num_blocks,
        block_size: 512,
        name: Some(name.into()),
        ..Default::default()
    };
    for bad in [
        "..",
        ".",
        "a/b",
        "evil\u{202e}txt",
        "zero\u{200b}width",
        "nl\nx",
    ] {
        let e = r
            .block_on(rpc.bdev_malloc_create(&malloc(bad, 64)))
            .unwrap_err();
        assert_eq!(e.code(), Some(-22), "{bad:?}: {e}");
        assert!(e.to_string().contains("bad bdev name"), "{e}");
    }
    for good in [
        "Malloc0",
        "ctrlr-0123abcd",
        "1805619a-ba2e-4045-a21e-46aa9deccde4",
    ] {
        r.block_on(rpc.bdev_malloc_create(&malloc(good, 64)))
            .unwrap();
    }
    for bad in ["..", "x\u{2066}y"] {
        let e = r
            .block_on(
                rpc.vhost_create_blk_controller(&VhostCreateBlkControllerParams {
                    ctrlr: bad.into(),
                    dev_name: "Malloc0".into(),
                    ..Default::default()
                }),
            )
            .unwrap_err();
        assert_eq!(e.code(), Some(-22), "{bad:?}: {e}");
    }
    // 16 TiB of RAM is refused (this machine has far less).
    let e = r
        .block_on(rpc.bdev_malloc_create(&malloc("huge", 1 << 35)))
        .unwrap_err();
    assert_eq!(e.code(), Some(-12), "{e}");
    assert!(e.to_string().contains("memory available"), "{e}");
    // A null bdev whose byte size overflows is refused.
    let e = r
        .block_on(rpc.bdev_null_create(&BdevNullCreateParams {
            name: "null0".into(),
            num_blocks: u64::MAX / 256,
            block_size: 512,
            ..Default::default()
        }))
        .unwrap_err();
    assert_eq!(e.code(), Some(-22), "{e}");
    assert!(e.to_string().contains("overflow"), "{e}");
    // A large but representable null bdev is fine.
    r.block_on(rpc.bdev_null_create(&BdevNullCreateParams {
        name: "null1".into(),
        num_blocks: 1 << 40,
        block_size: 512,
        ..Default::default()
    }))
    .unwrap();
}

#[test]
fn ids_beyond_64_bits_are_echoed_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let t = Target::start(dir.path(), &[]);
    let mut s = connect(&t);
    let out = round_trip(
        &mut s,
        r#"{"jsonrpc":"2.0","id":123456789012345678901234567890,"method":"spdk_get_version"}"#,
    );
    assert!(
        out.starts_with(r#"{"jsonrpc":"2.0","id":123456789012345678901234567890,"result""#),
        "{out}"
    );
}

/// A field of `/proc/<pid>/status` (`Threads`, `VmRSS` in kB).
fn proc_status(pid: u32, key: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

#[test]
fn notification_flood_is_bounded_and_does_not_stall_other_clients() {
    let dir = tempfile::tempdir().unwrap();
    let t = Target::start(dir.path(), &[]);
    let pid = t.daemon.pid();
    let mut flood = connect(&t);
    let writer = std::thread::spawn(move || {
        let note = br#"{"jsonrpc":"2.0","method":"bdev_get_bdevs"}"#.repeat(1000);
        for _ in 0..200 {
            if flood.write_all(&note).is_err() {
                break;
            }
        }
        flood
    });
    let rpc = client(&t);
    let r = rt();
    let (mut threads, mut rss_kb) = (0, 0);
    for _ in 0..20 {
        // Generous: the point is "answered", not "fast" (before the fix: seconds per call).
        let t0 = std::time::Instant::now();
        r.block_on(rpc.bdev_get_bdevs(None)).unwrap();
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        threads = threads.max(proc_status(pid, "Threads"));
        rss_kb = rss_kb.max(proc_status(pid, "VmRSS"));
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(writer.join().unwrap());
    eprintln!("peak: {threads} threads, {rss_kb} kB resident");
    // Two workers, at most 64 blocking threads, and a few of the daemon's own.
    assert!(threads <= 80, "{threads} threads");
    assert!(rss_kb < 512 * 1024, "{rss_kb} kB resident");
}
