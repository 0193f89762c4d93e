//! Property test: random sequences of reads, writes, discards, write-zeroes and flushes, issued
//! concurrently in batches of non-overlapping requests, must behave like an in-memory byte array
//! in every execution mode (buffered, `O_DIRECT`, and on tmpfs through the device's mapping).

// Test code: a panic is how a failure is reported (helpers sit outside `#[test]` functions).
#![allow(clippy::unwrap_used)]

mod common;

use common::{drain, make_dev, read_at, split_iov, submit, AlignedBuf, Backing, Rng};
use katablk_bdev::file::IoMode;
use katablk_bdev::{iovec, IoOp, IoRequest};
use proptest::prelude::*;

const BS: u64 = 512;
const BLOCKS: u64 = 512;
const DEPTH: usize = 8;

#[derive(Debug, Clone)]
enum Op {
    Write {
        blk: u64,
        nblk: u64,
        seed: u64,
        segs: usize,
    },
    Read {
        blk: u64,
        nblk: u64,
        segs: usize,
    },
    Discard {
        blk: u64,
        nblk: u64,
    },
    Zero {
        blk: u64,
        nblk: u64,
        unmap: bool,
    },
    Flush,
    /// Wait for everything in flight before going on.
    Barrier,
}

fn range() -> impl Strategy<Value = (u64, u64)> {
    (0..BLOCKS, 1..=32u64).prop_map(|(b, n)| (b.min(BLOCKS - n), n))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (range(), any::<u64>(), 1..=6usize).prop_map(|((blk, nblk), seed, segs)| Op::Write {
            blk,
            nblk,
            seed,
            segs
        }),
        4 => (range(), 1..=6usize).prop_map(|((blk, nblk), segs)| Op::Read { blk, nblk, segs }),
        1 => range().prop_map(|(blk, nblk)| Op::Discard { blk, nblk }),
        1 => (range(), any::<bool>()).prop_map(|((blk, nblk), unmap)| Op::Zero { blk, nblk, unmap }),
        1 => Just(Op::Flush),
        1 => Just(Op::Barrier),
    ]
}

/// One queued request: its buffer (reads and writes), iovecs, range and, for reads, the bytes
/// the model expects.
struct Pending {
    buf: Option<AlignedBuf>,
    iov: Vec<iovec>,
    op: IoOp,
    off: u64,
    len: u64,
    expect: Option<Vec<u8>>,
}

fn run_model(mode: IoMode, backing: impl Into<Backing>, ops: &[Op]) {
    let Some(t) = make_dev(mode, backing, BLOCKS * BS) else {
        return;
    };
    let align = t.align();
    let mut model = vec![0u8; (BLOCKS * BS) as usize];
    let mut batch: Vec<Pending> = Vec::new();
    let mut ch = t.channel(DEPTH, 6);

    let run_batch = |ch: &mut dyn katablk_bdev::IoChannel, batch: &mut Vec<Pending>| {
        for (i, p) in batch.iter().enumerate() {
            let req = IoRequest {
                op: p.op,
                offset: p.off,
                len: p.len,
                iov: &p.iov,
                token: i as u64,
            };
            submit(ch, &req).unwrap();
        }
        let done = drain(ch);
        assert_eq!(done.len(), batch.len());
        for c in done {
            let p = &batch[c.token as usize];
            let want = if matches!(p.op, IoOp::Read | IoOp::Write) {
                p.len
            } else {
                0
            };
            assert_eq!(c.result, Ok(want), "{:?} {}+{}", p.op, p.off, p.len);
            if let (Some(e), Some(b)) = (&p.expect, &p.buf) {
                assert!(
                    b[..] == e[..],
                    "read {}+{} differs from the model",
                    p.off,
                    p.len
                );
            }
        }
        batch.clear();
    };

    for op in ops {
        let (off, len) = match *op {
            Op::Write { blk, nblk, .. }
            | Op::Read { blk, nblk, .. }
            | Op::Discard { blk, nblk }
            | Op::Zero { blk, nblk, .. } => (blk * BS, nblk * BS),
            Op::Flush => (0, 0),
            Op::Barrier => {
                run_batch(ch.as_mut(), &mut batch);
                continue;
            }
        };
        let conflict = len > 0
            && batch
                .iter()
                .any(|p| p.len > 0 && off < p.off + p.len && p.off < off + len);
        if conflict || batch.len() == DEPTH {
            run_batch(ch.as_mut(), &mut batch);
        }
        let span = off as usize..(off + len) as usize;
        let p = match *op {
            Op::Write { seed, segs, .. } => {
                let mut rng = Rng::new(seed);
                let mut b = AlignedBuf::new(len as usize);
                rng.fill(&mut b);
                model[span].copy_from_slice(&b);
                let iov = split_iov(&mut b, segs, align, &mut rng);
                Pending {
                    buf: Some(b),
                    iov,
                    op: IoOp::Write,
                    off,
                    len,
                    expect: None,
                }
            }
            Op::Read { segs, nblk, .. } => {
                let mut rng = Rng::new(off ^ nblk);
                let mut b = AlignedBuf::filled(len as usize, 0xee);
                let iov = split_iov(&mut b, segs, align, &mut rng);
                Pending {
                    buf: Some(b),
                    iov,
                    op: IoOp::Read,
                    off,
                    len,
                    expect: Some(model[span].to_vec()),
                }
            }
            Op::Discard { .. } | Op::Zero { .. } => {
                model[span].fill(0);
                let op = match *op {
                    Op::Zero { unmap, .. } => IoOp::WriteZeroes { unmap },
                    _ => IoOp::Discard,
                };
                Pending {
                    buf: None,
                    iov: Vec::new(),
                    op,
                    off,
                    len,
                    expect: None,
                }
            }
            Op::Flush | Op::Barrier => Pending {
                buf: None,
                iov: Vec::new(),
                op: IoOp::Flush,
                off: 0,
                len: 0,
                expect: None,
            },
        };
        batch.push(p);
    }
    run_batch(ch.as_mut(), &mut batch);
    // Everything must match at the end.
    let all = read_at(ch.as_mut(), 0, (BLOCKS * BS) as usize);
    assert!(all[..] == model[..], "final contents differ from the model");
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 32,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("regressions"),
        )),
        ..ProptestConfig::default()
    })]

    #[test]
    fn model_inline_buffered(ops in proptest::collection::vec(op(), 1..80)) {
        run_model(IoMode::Inline, false, &ops);
    }

    #[test]
    fn model_uring_buffered(ops in proptest::collection::vec(op(), 1..80)) {
        run_model(IoMode::IoUring, false, &ops);
    }

    #[test]
    fn model_uring_direct(ops in proptest::collection::vec(op(), 1..80)) {
        run_model(IoMode::IoUring, true, &ops);
    }

    #[test]
    fn model_threads_buffered(ops in proptest::collection::vec(op(), 1..80)) {
        run_model(IoMode::ThreadPool, false, &ops);
    }

    #[test]
    fn model_threads_direct(ops in proptest::collection::vec(op(), 1..80)) {
        run_model(IoMode::ThreadPool, true, &ops);
    }

    /// tmpfs: the device copies through its mapping wherever the pages are allocated.
    #[test]
    fn model_uring_memory(ops in proptest::collection::vec(op(), 1..80)) {
        run_model(IoMode::IoUring, Backing::Memory, &ops);
    }

    #[test]
    fn model_threads_memory(ops in proptest::collection::vec(op(), 1..80)) {
        run_model(IoMode::ThreadPool, Backing::Memory, &ops);
    }
}
