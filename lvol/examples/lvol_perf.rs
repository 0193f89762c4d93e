//! Rough per-request overhead of an lvol channel over a RAM device: 4 KiB random I/O at queue
//! depth 32 on the raw device, a thick volume, and a thin volume (first writes allocate).
//!
//! `cargo run --release -p katablk-lvol --example lvol_perf`
//!
//! With a path (`-- /dev/shm/lvol-perf.img`), the same on a 2 GiB file device instead: raw
//! file vs thick volume, with the CPU time per request of the submitting thread.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use katablk_bdev::file::{FileDevice, FileOptions};
use katablk_bdev::malloc::MallocDevice;
use katablk_bdev::{iovec, BlockDevice, Completion, IoOp, IoRequest};
use katablk_lvol::{LvStore, LvsOptions};

fn run(name: &str, dev: &dyn BlockDevice, op: IoOp, secs: f64) {
    let size = dev.info().size_bytes();
    let qd = 32;
    let mut ch = dev.open_channel(qd, 1).unwrap();
    let mut bufs: Vec<Vec<u8>> = (0..qd).map(|_| vec![7u8; 4096]).collect();
    let mut rng: u64 = 0x1234_5678;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let blocks = size / 4096;
    let mut done: Vec<Completion> = Vec::with_capacity(qd);
    let start = Instant::now();
    let cpu0 = thread_cpu();
    let mut ios = 0u64;
    let submit =
        |ch: &mut Box<dyn katablk_bdev::IoChannel>, b: &mut Vec<u8>, tok: u64, off: u64| {
            let iov = [iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: 4096,
            }];
            // SAFETY: each buffer is used by one request at a time and outlives the channel.
            unsafe {
                ch.submit(&IoRequest {
                    op,
                    offset: off,
                    len: 4096,
                    iov: &iov,
                    token: tok,
                })
                .unwrap()
            };
        };
    for (i, b) in bufs.iter_mut().enumerate() {
        submit(&mut ch, b, i as u64, (next() % blocks) * 4096);
    }
    ch.commit().unwrap();
    while start.elapsed() < Duration::from_secs_f64(secs) {
        done.clear();
        if ch.poll(&mut done) == 0 {
            ch.wait(Some(Duration::from_millis(10))).unwrap();
            continue;
        }
        for c in &done {
            assert!(c.result.is_ok());
            ios += 1;
            let t = c.token as usize;
            submit(&mut ch, &mut bufs[t], c.token, (next() % blocks) * 4096);
        }
        ch.commit().unwrap();
    }
    while ch.in_flight() > 0 {
        done.clear();
        ch.poll(&mut done);
        ch.wait(Some(Duration::from_millis(10))).unwrap();
    }
    let el = start.elapsed().as_secs_f64();
    let cpu = thread_cpu() - cpu0;
    println!(
        "{name:<28} {:>10.0} IOPS {:>8.3} us CPU/IO",
        ios as f64 / el,
        cpu * 1e6 / ios.max(1) as f64
    );
}

/// CPU time of the calling thread in seconds.
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the kernel to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn file_mode(path: &str) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(2 << 30).unwrap();
    // Fill it so that reads hit allocated pages, as a thick volume's do.
    let chunk = vec![0x5au8; 1 << 20];
    for i in 0..2048u64 {
        std::os::unix::fs::FileExt::write_all_at(&f, &chunk, i << 20).unwrap();
    }
    drop(f);
    let raw: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::open(path, &FileOptions::default()).unwrap());
    let secs = 3.0;
    // LVOL_PERF_ONLY=file|lvol runs one side (e.g. under `perf stat`), after the same setup.
    let only = std::env::var("LVOL_PERF_ONLY").unwrap_or_default();
    let lvs = LvStore::create(raw.clone(), LvsOptions::new("lvs0")).unwrap();
    let thick = lvs.create_lvol("thick", 1 << 30, false).unwrap();
    // First touch of the volume's clusters (the store may have punched them).
    run("lvol thick write (warm-up)", &*thick, IoOp::Write, 1.0);
    for _ in 0..2 {
        if only != "lvol" {
            run("file read", &*raw, IoOp::Read, secs);
            run("file write", &*raw, IoOp::Write, secs);
        }
        if only != "file" {
            run("lvol thick read", &*thick, IoOp::Read, secs);
            run("lvol thick write", &*thick, IoOp::Write, secs);
        }
    }
    drop(thick);
    drop(lvs);
    let _ = std::fs::remove_file(path);
}

fn main() {
    if let Some(path) = std::env::args().nth(1) {
        file_mode(&path);
        return;
    }
    let raw: Arc<dyn BlockDevice> = Arc::new(MallocDevice::new((2u64 << 30) / 512, 512).unwrap());
    run("malloc write", &*raw, IoOp::Write, 1.0);
    run("malloc read", &*raw, IoOp::Read, 1.0);
    let lvs = LvStore::create(raw.clone(), LvsOptions::new("lvs0")).unwrap();
    let thick = lvs.create_lvol("thick", 1 << 30, false).unwrap();
    run("lvol thick write", &*thick, IoOp::Write, 1.0);
    run("lvol thick read", &*thick, IoOp::Read, 1.0);
    let thin = lvs.create_lvol("thin", 512 << 20, true).unwrap();
    let t = Instant::now();
    run("lvol thin write (allocating)", &*thin, IoOp::Write, 1.0);
    println!(
        "  clusters allocated: {} in {:?}",
        lvs.allocations(),
        t.elapsed()
    );
    run("lvol thin write (allocated)", &*thin, IoOp::Write, 1.0);
    run("lvol thin read", &*thin, IoOp::Read, 1.0);
    lvs.snapshot("thick", "snap").unwrap();
    run("lvol clone-of-snap write (CoW)", &*thick, IoOp::Write, 1.0);
    println!("  clusters allocated: {}", lvs.allocations());
}
