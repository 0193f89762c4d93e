//! The file device in every execution mode (inline, io_uring, thread pool, auto), buffered, with
//! `O_DIRECT` and on tmpfs (copied through the device's mapping): data integrity, deep queues, flush/discard/write-zeroes, every rejection,
//! back-pressure, reads past the end of a shrunk file, and dropping a channel with requests in
//! flight.

// Test code: a panic is how a failure is reported (helpers sit outside `#[test]` functions).
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashSet;

use common::*;
use katablk_bdev::file::IoMode;
use katablk_bdev::{iovec, BlockDevice, IoChannel, IoOp, IoRequest, SubmitError};

const BS: u64 = 512;

fn seed(mode: IoMode, backing: Backing) -> u64 {
    mode as u64 * 3 + backing as u64 + 1
}

fn overlaps(ranges: &[(u64, u64)], off: u64, len: u64) -> bool {
    ranges.iter().any(|&(o, l)| off < o + l && o < off + len)
}

/// Batches of random non-overlapping writes and reads (random offsets, sizes and iovec splits)
/// checked against an in-memory copy, then a full read-back.
fn random_rw_verify(mode: IoMode, backing: Backing) {
    let Some(t) = make_dev(mode, backing, 8 << 20) else {
        return;
    };
    let size = t.size();
    let unit = t.align();
    let mut model = vec![0u8; size as usize];
    let mut ch = t.channel(16, 8);
    let mut rng = Rng::new(seed(mode, backing));
    for round in 0..30 {
        let is_write = round % 3 != 2;
        let mut bufs: Vec<AlignedBuf> = Vec::new();
        let mut iovs: Vec<Vec<iovec>> = Vec::new();
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for _ in 0..16 {
            let nblk = rng.range(1, 64);
            let off = rng.range(0, size / BS - nblk) * BS;
            let len = nblk * BS;
            if overlaps(&ranges, off, len) {
                continue;
            }
            let mut b = AlignedBuf::new(len as usize);
            if is_write {
                rng.fill(&mut b);
                model[off as usize..(off + len) as usize].copy_from_slice(&b);
            }
            iovs.push(split_iov(&mut b, 8, unit, &mut rng));
            bufs.push(b);
            ranges.push((off, len));
        }
        for (i, (&(off, len), iov)) in ranges.iter().zip(&iovs).enumerate() {
            let req = IoRequest {
                op: if is_write { IoOp::Write } else { IoOp::Read },
                offset: off,
                len,
                iov,
                token: i as u64,
            };
            submit(ch.as_mut(), &req).unwrap();
        }
        let done = drain(ch.as_mut());
        assert_eq!(done.len(), ranges.len());
        for c in &done {
            let (_, len) = ranges[c.token as usize];
            assert_eq!(c.result, Ok(len), "token {}", c.token);
        }
        if !is_write {
            for (b, &(off, len)) in bufs.iter().zip(&ranges) {
                assert!(
                    b[..] == model[off as usize..(off + len) as usize],
                    "read mismatch at {off}+{len}"
                );
            }
        }
    }
    let mut off = 0;
    while off < size {
        let b = read_at(ch.as_mut(), off, 1 << 20);
        assert!(
            b[..] == model[off as usize..off as usize + (1 << 20)],
            "at {off}"
        );
        off += 1 << 20;
    }
}

/// 64 writes, then 64 reads, all in flight at once (plus a flush in between), each reaped once.
fn deep_queue(mode: IoMode, backing: Backing) {
    let Some(t) = make_dev(mode, backing, 4 << 20) else {
        return;
    };
    const N: usize = 64;
    let mut ch = t.channel(N + 1, 4);
    let mut wbufs: Vec<AlignedBuf> = (0..N)
        .map(|i| AlignedBuf::filled(8192, i as u8 + 1))
        .collect();
    let wiovs: Vec<[iovec; 2]> = wbufs
        .iter_mut()
        .map(|b| {
            let p = b.as_mut_ptr();
            [
                iovec {
                    iov_base: p.cast(),
                    iov_len: 4096,
                },
                iovec {
                    iov_base: p.wrapping_add(4096).cast(),
                    iov_len: 4096,
                },
            ]
        })
        .collect();
    for (i, iov) in wiovs.iter().enumerate() {
        let req = IoRequest {
            op: IoOp::Write,
            offset: (i * 8192) as u64,
            len: 8192,
            iov,
            token: i as u64,
        };
        submit(ch.as_mut(), &req).unwrap();
        if i == N / 2 {
            ch.commit().unwrap();
        }
    }
    submit(ch.as_mut(), &IoRequest::no_data(IoOp::Flush, 0, 0, 1000)).unwrap();
    assert_eq!(ch.in_flight(), N + 1);
    let done = drain(ch.as_mut());
    assert_eq!(done.len(), N + 1);
    let tokens: HashSet<u64> = done.iter().map(|c| c.token).collect();
    assert_eq!(tokens.len(), N + 1);
    assert!(done
        .iter()
        .all(|c| c.result == Ok(if c.token == 1000 { 0 } else { 8192 })));

    let mut rbufs: Vec<AlignedBuf> = (0..N).map(|_| AlignedBuf::new(8192)).collect();
    let riovs: Vec<[iovec; 3]> = rbufs
        .iter_mut()
        .map(|b| {
            let p = b.as_mut_ptr();
            [
                iovec {
                    iov_base: p.cast(),
                    iov_len: 2048,
                },
                iovec {
                    iov_base: p.wrapping_add(2048).cast(),
                    iov_len: 4096,
                },
                iovec {
                    iov_base: p.wrapping_add(6144).cast(),
                    iov_len: 2048,
                },
            ]
        })
        .collect();
    for (i, iov) in riovs.iter().enumerate() {
        let req = IoRequest {
            op: IoOp::Read,
            offset: (i * 8192) as u64,
            len: 8192,
            iov,
            token: 100 + i as u64,
        };
        submit(ch.as_mut(), &req).unwrap();
    }
    assert_eq!(ch.in_flight(), N);
    let done = drain(ch.as_mut());
    assert_eq!(done.len(), N);
    let tokens: HashSet<u64> = done.iter().map(|c| c.token).collect();
    assert_eq!(tokens, (100..100 + N as u64).collect());
    assert!(done.iter().all(|c| c.result == Ok(8192)));
    for (i, b) in rbufs.iter().enumerate() {
        assert!(b.iter().all(|&x| x == i as u8 + 1), "buffer {i}");
    }
}

/// Flush, discard, and write-zeroes with and without unmap (also several at once).
fn flush_discard_write_zeroes(mode: IoMode, backing: Backing) {
    let Some(t) = make_dev(mode, backing, 4 << 20) else {
        return;
    };
    let info = t.dev.info();
    assert!(info.discard && info.write_zeroes && info.volatile_cache);
    let size = t.size();
    let mut ch = t.channel(8, 4);
    let fill = vec![0x11u8; 1 << 20];
    for off in (0..size).step_by(1 << 20) {
        write_at(ch.as_mut(), off, &fill);
    }
    no_data(ch.as_mut(), IoOp::Flush, 0, 0);
    no_data(ch.as_mut(), IoOp::Discard, 64 << 10, 64 << 10);
    no_data(
        ch.as_mut(),
        IoOp::WriteZeroes { unmap: false },
        256 << 10,
        12 << 10,
    );
    no_data(
        ch.as_mut(),
        IoOp::WriteZeroes { unmap: true },
        1 << 20,
        64 << 10,
    );
    // Zero-length ranges are accepted and do nothing.
    no_data(ch.as_mut(), IoOp::Discard, 0, 0);
    no_data(ch.as_mut(), IoOp::WriteZeroes { unmap: false }, 0, 0);
    // Several at once, with a flush among them.
    let batch = [
        IoRequest::no_data(IoOp::Discard, 2 << 20, 4096, 1),
        IoRequest::no_data(IoOp::WriteZeroes { unmap: false }, (2 << 20) + 8192, 512, 2),
        IoRequest::no_data(IoOp::Flush, 0, 0, 3),
        IoRequest::no_data(IoOp::WriteZeroes { unmap: true }, 3 << 20, 1 << 20, 4),
    ];
    for r in &batch {
        submit(ch.as_mut(), r).unwrap();
    }
    let done = drain(ch.as_mut());
    assert_eq!(done.len(), 4);
    assert!(done.iter().all(|c| c.result == Ok(0)), "{done:?}");

    let zeroed = [
        (64 << 10, 64 << 10),
        (256 << 10, 12 << 10),
        (1 << 20, 64 << 10),
        (2 << 20, 4096),
        ((2 << 20) + 8192, 512),
        (3 << 20, 1 << 20),
    ];
    for off in (0..size).step_by(1 << 20) {
        let b = read_at(ch.as_mut(), off, 1 << 20);
        for (i, &x) in b.iter().enumerate() {
            let pos = off + i as u64;
            let z = zeroed.iter().any(|&(o, l)| pos >= o && pos < o + l);
            assert_eq!(x, if z { 0 } else { 0x11 }, "byte {pos}");
        }
    }
}

/// A read-only device refuses every modifying request at submission.
fn read_only_rejected(mode: IoMode, backing: Backing) {
    let Some(t) = make_dev_opts(mode, backing, 1 << 20, true) else {
        return;
    };
    assert!(t.dev.info().read_only);
    let mut ch = t.channel(4, 4);
    let mut b = AlignedBuf::new(4096);
    let iov = iov1(&mut b);
    let w = IoRequest {
        op: IoOp::Write,
        offset: 0,
        len: 4096,
        iov: &iov,
        token: 1,
    };
    assert_eq!(submit(ch.as_mut(), &w), Err(SubmitError::ReadOnly));
    for op in [
        IoOp::Discard,
        IoOp::WriteZeroes { unmap: false },
        IoOp::WriteZeroes { unmap: true },
    ] {
        let r = IoRequest::no_data(op, 0, 4096, 2);
        assert_eq!(
            submit(ch.as_mut(), &r),
            Err(SubmitError::ReadOnly),
            "{op:?}"
        );
    }
    assert_eq!(ch.in_flight(), 0);
    let r = IoRequest {
        op: IoOp::Read,
        ..w
    };
    assert_eq!(run1(ch.as_mut(), &r), Ok(4096));
    no_data(ch.as_mut(), IoOp::Flush, 0, 0);
}

/// Out-of-range, misaligned and malformed requests are refused and never completed.
fn range_and_alignment_rejected(mode: IoMode, backing: Backing) {
    let Some(t) = make_dev(mode, backing, 1 << 20) else {
        return;
    };
    let size = t.size();
    let mut ch = t.channel(4, 2);
    let mut b = AlignedBuf::new(8192);
    let p = b.as_mut_ptr();
    let one = |len: usize| {
        [iovec {
            iov_base: p.cast(),
            iov_len: len,
        }]
    };
    fn read(
        ch: &mut dyn IoChannel,
        offset: u64,
        len: u64,
        iov: &[iovec],
    ) -> Result<(), SubmitError> {
        let req = IoRequest {
            op: IoOp::Read,
            offset,
            len,
            iov,
            token: 5,
        };
        submit(ch, &req)
    }
    let iov512 = one(512);
    let iov1024 = one(1024);
    let iov100 = one(100);
    assert!(matches!(
        read(ch.as_mut(), size, 512, &iov512),
        Err(SubmitError::OutOfRange { .. })
    ));
    assert!(matches!(
        read(ch.as_mut(), size - 512, 1024, &iov1024),
        Err(SubmitError::OutOfRange { .. })
    ));
    assert!(matches!(
        read(ch.as_mut(), u64::MAX - 511, 512, &iov512),
        Err(SubmitError::OutOfRange { .. })
    ));
    assert!(matches!(
        read(ch.as_mut(), 100, 512, &iov512),
        Err(SubmitError::Misaligned { .. })
    ));
    let e = read(ch.as_mut(), 0, 100, &iov100);
    if backing.direct() {
        // The buffer length is checked against the O_DIRECT alignment first.
        assert_eq!(e, Err(SubmitError::BadBuffers));
    } else {
        assert!(matches!(e, Err(SubmitError::Misaligned { .. })), "{e:?}");
    }
    // Lengths that disagree with the buffers, no buffers, too many buffers.
    assert_eq!(
        read(ch.as_mut(), 0, 1024, &iov512),
        Err(SubmitError::BadBuffers)
    );
    assert_eq!(read(ch.as_mut(), 0, 0, &[]), Err(SubmitError::BadBuffers));
    let three = [iov512[0]; 3];
    assert_eq!(
        read(ch.as_mut(), 0, 1536, &three),
        Err(SubmitError::BadBuffers)
    );
    // Discard and write-zeroes ranges are checked too.
    for op in [IoOp::Discard, IoOp::WriteZeroes { unmap: false }] {
        let r = IoRequest::no_data(op, size - 512, 1024, 6);
        assert!(matches!(
            submit(ch.as_mut(), &r),
            Err(SubmitError::OutOfRange { .. })
        ));
        let r = IoRequest::no_data(op, 512, 100, 6);
        assert!(matches!(
            submit(ch.as_mut(), &r),
            Err(SubmitError::Misaligned { .. })
        ));
    }
    // Buffer alignment under O_DIRECT.
    let odd = [iovec {
        iov_base: p.wrapping_add(1).cast(),
        iov_len: 512,
    }];
    let halves = [
        iovec {
            iov_base: p.cast(),
            iov_len: 256,
        },
        iovec {
            iov_base: p.wrapping_add(256).cast(),
            iov_len: 256,
        },
    ];
    if backing.direct() {
        assert_eq!(t.align(), 512);
        assert_eq!(
            read(ch.as_mut(), 0, 512, &odd),
            Err(SubmitError::BadBuffers)
        );
        assert_eq!(
            read(ch.as_mut(), 0, 512, &halves),
            Err(SubmitError::BadBuffers)
        );
        assert_eq!(ch.in_flight(), 0);
    } else {
        // Buffered I/O takes any buffer layout.
        assert_eq!(read(ch.as_mut(), 0, 512, &odd), Ok(()));
        assert_eq!(read(ch.as_mut(), 0, 512, &halves), Ok(()));
        assert_eq!(drain(ch.as_mut()).len(), 2);
    }
    assert_eq!(ch.in_flight(), 0);
    let mut out = Vec::new();
    assert_eq!(ch.poll(&mut out), 0);
}

/// `depth` requests in flight make the next submission fail with `Full` until one is reaped.
fn full_backpressure(mode: IoMode, backing: Backing) {
    let Some(t) = make_dev(mode, backing, 1 << 20) else {
        return;
    };
    let mut ch = t.channel(4, 1);
    let mut bufs: Vec<AlignedBuf> = (0..8).map(|_| AlignedBuf::new(4096)).collect();
    let iovs: Vec<[iovec; 1]> = bufs.iter_mut().map(|b| iov1(b)).collect();
    let req = |i: usize| IoRequest {
        op: IoOp::Read,
        offset: (i * 4096) as u64,
        len: 4096,
        iov: &iovs[i],
        token: i as u64,
    };
    for i in 0..4 {
        submit(ch.as_mut(), &req(i)).unwrap();
    }
    assert_eq!(submit(ch.as_mut(), &req(4)), Err(SubmitError::Full));
    ch.commit().unwrap();
    assert_eq!(submit(ch.as_mut(), &req(4)), Err(SubmitError::Full));
    // Reap at least one, then there is room again.
    let mut out = Vec::new();
    while out.is_empty() {
        ch.wait(None).unwrap();
        ch.poll(&mut out);
    }
    let room = out.len();
    for i in 0..room {
        submit(ch.as_mut(), &req(4 + i)).unwrap();
    }
    assert_eq!(ch.in_flight(), 4);
    assert_eq!(submit(ch.as_mut(), &req(7)), Err(SubmitError::Full));
    out.extend(drain(ch.as_mut()));
    assert_eq!(out.len(), 4 + room);
    assert!(out.iter().all(|c| c.result == Ok(4096)));
    assert_eq!(ch.in_flight(), 0);
}

/// Reads past the end of a file shrunk under the device return zeroes for the missing part.
fn short_read_at_eof(mode: IoMode, backing: Backing) {
    let Some(t) = make_dev(mode, backing, 1 << 20) else {
        return;
    };
    let mut ch = t.channel(8, 4);
    let fill = vec![0xabu8; 1 << 20];
    write_at(ch.as_mut(), 0, &fill);
    no_data(ch.as_mut(), IoOp::Flush, 0, 0);
    let eof = (512 << 10) + 100;
    t.file.as_file().set_len(eof).unwrap();
    assert_eq!(t.size(), 1 << 20, "the device keeps its capacity");

    // Straddling the new end, three buffers.
    let mut b = AlignedBuf::filled(64 << 10, 0xcd);
    let p = b.as_mut_ptr();
    let iov = [
        iovec {
            iov_base: p.cast(),
            iov_len: 16 << 10,
        },
        iovec {
            iov_base: p.wrapping_add(16 << 10).cast(),
            iov_len: 32 << 10,
        },
        iovec {
            iov_base: p.wrapping_add(48 << 10).cast(),
            iov_len: 16 << 10,
        },
    ];
    let start = (512 << 10) - (32 << 10);
    let req = IoRequest {
        op: IoOp::Read,
        offset: start,
        len: 64 << 10,
        iov: &iov,
        token: 1,
    };
    assert_eq!(run1(ch.as_mut(), &req), Ok(64 << 10));
    let valid = (eof - start) as usize;
    assert!(b[..valid].iter().all(|&x| x == 0xab));
    assert!(b[valid..].iter().all(|&x| x == 0), "tail not zeroed");

    // Wholly past the end.
    let z = read_at(ch.as_mut(), 768 << 10, 8192);
    assert!(z.iter().all(|&x| x == 0));
    // Up to the block before the end: untouched data.
    let d = read_at(ch.as_mut(), 0, 512 << 10);
    assert!(d.iter().all(|&x| x == 0xab));
}

/// Dropping a channel with requests in flight finishes them first: writes land, and read buffers
/// are filled before `drop` returns.
fn drop_with_requests_in_flight(mode: IoMode, backing: Backing) {
    let Some(t) = make_dev(mode, backing, 2 << 20) else {
        return;
    };
    const N: usize = 32;
    const LEN: usize = 16 << 10;
    let mut wbufs: Vec<AlignedBuf> = (0..N)
        .map(|i| AlignedBuf::filled(LEN, i as u8 + 1))
        .collect();
    let wiovs: Vec<[iovec; 1]> = wbufs.iter_mut().map(|b| iov1(b)).collect();
    let mut ch = t.channel(N, 2);
    for (i, iov) in wiovs.iter().enumerate() {
        let req = IoRequest {
            op: IoOp::Write,
            offset: (i * LEN) as u64,
            len: LEN as u64,
            iov,
            token: i as u64,
        };
        submit(ch.as_mut(), &req).unwrap();
    }
    ch.commit().unwrap();
    drop(ch);
    let data = std::fs::read(t.path()).unwrap();
    for i in 0..N {
        assert!(
            data[i * LEN..(i + 1) * LEN]
                .iter()
                .all(|&x| x == i as u8 + 1),
            "write {i} lost"
        );
    }

    let mut rbufs: Vec<AlignedBuf> = (0..N).map(|_| AlignedBuf::new(LEN)).collect();
    let riovs: Vec<[iovec; 1]> = rbufs.iter_mut().map(|b| iov1(b)).collect();
    let mut ch = t.channel(N, 2);
    for (i, iov) in riovs.iter().enumerate() {
        let req = IoRequest {
            op: IoOp::Read,
            offset: (i * LEN) as u64,
            len: LEN as u64,
            iov,
            token: i as u64,
        };
        submit(ch.as_mut(), &req).unwrap();
    }
    ch.commit().unwrap();
    drop(ch);
    for (i, b) in rbufs.iter().enumerate() {
        assert!(b.iter().all(|&x| x == i as u8 + 1), "read {i} unfinished");
    }
}

/// Generates one test per mode and buffering for each scenario.
macro_rules! matrix {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            use katablk_bdev::file::IoMode;
            use crate::common::Backing;
            #[test]
            fn inline_buffered() { super::$name(IoMode::Inline, Backing::Buffered) }
            #[test]
            fn inline_direct() { super::$name(IoMode::Inline, Backing::Direct) }
            #[test]
            fn inline_memory() { super::$name(IoMode::Inline, Backing::Memory) }
            #[test]
            fn uring_buffered() { super::$name(IoMode::IoUring, Backing::Buffered) }
            #[test]
            fn uring_direct() { super::$name(IoMode::IoUring, Backing::Direct) }
            #[test]
            fn uring_memory() { super::$name(IoMode::IoUring, Backing::Memory) }
            #[test]
            fn threads_buffered() { super::$name(IoMode::ThreadPool, Backing::Buffered) }
            #[test]
            fn threads_direct() { super::$name(IoMode::ThreadPool, Backing::Direct) }
            #[test]
            fn threads_memory() { super::$name(IoMode::ThreadPool, Backing::Memory) }
            #[test]
            fn auto_buffered() { super::$name(IoMode::Auto, Backing::Buffered) }
            #[test]
            fn auto_direct() { super::$name(IoMode::Auto, Backing::Direct) }
        }
    )*};
}

matrix!(
    random_rw_verify,
    deep_queue,
    flush_discard_write_zeroes,
    read_only_rejected,
    range_and_alignment_rejected,
    full_backpressure,
    short_read_at_eof,
    drop_with_requests_in_flight,
);

#[test]
fn io_mode_parsing() {
    for (s, m) in [
        ("auto", IoMode::Auto),
        ("io_uring", IoMode::IoUring),
        ("uring", IoMode::IoUring),
        ("IO-URING", IoMode::IoUring),
        ("threads", IoMode::ThreadPool),
        (" inline ", IoMode::Inline),
    ] {
        assert_eq!(s.parse::<IoMode>().unwrap(), m, "{s}");
    }
    for m in MODES {
        assert_eq!(m.to_string().parse::<IoMode>().unwrap(), m);
    }
    let e = "aio".parse::<IoMode>().unwrap_err();
    assert!(
        e.to_string().contains("`aio`") && e.to_string().contains("io_uring"),
        "{e}"
    );
    assert_eq!(IoMode::default(), IoMode::Auto);
}

#[test]
fn auto_resolves_and_describes() {
    let t = make_dev(IoMode::Auto, false, 1 << 20).unwrap();
    let eff = t.dev.effective_mode();
    assert!(matches!(eff, IoMode::IoUring | IoMode::ThreadPool));
    assert!(
        t.dev.describe().contains(&format!("auto: {eff}")),
        "{}",
        t.dev.describe()
    );
    let ch = t.channel(4, 4);
    assert!(ch.notify_fd().is_some());
    let inline = make_dev(IoMode::Inline, false, 1 << 20).unwrap();
    assert!(inline.channel(4, 4).notify_fd().is_none());
    assert_eq!(inline.dev.effective_mode(), IoMode::Inline);
}

/// The eventfd of an asynchronous channel becomes readable when a completion is ready, and
/// `clear_notify` resets it.
#[test]
fn notify_fd_readiness() {
    for mode in [IoMode::IoUring, IoMode::ThreadPool] {
        let Some(t) = make_dev(mode, false, 1 << 20) else {
            continue;
        };
        let mut ch = t.channel(4, 4);
        let fd = ch.notify_fd().unwrap();
        let readable = |ms: i32| {
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut pfd, 1, ms) == 1 }
        };
        ch.clear_notify();
        assert!(!readable(0), "{mode}");
        for (i, op) in [IoOp::Flush, IoOp::Discard].into_iter().enumerate() {
            submit(ch.as_mut(), &IoRequest::no_data(op, 0, 4096, i as u64)).unwrap();
            ch.commit().unwrap();
            assert!(readable(10_000), "{mode} {op:?}");
            ch.clear_notify();
            let mut out = Vec::new();
            while out.is_empty() {
                ch.wait(None).unwrap();
                ch.poll(&mut out);
            }
            assert_eq!(out[0].result, Ok(0));
        }
        ch.clear_notify();
        assert!(!readable(0), "{mode}");
    }
}
