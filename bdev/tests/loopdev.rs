//! The file device on a real block device (a loop device over a file in /var/tmp), in every mode,
//! buffered and `O_DIRECT`: covers the `BLKDISCARD`/`BLKZEROOUT` paths and block-device sizing.
//! Needs root and the loop driver; skipped, with the reason printed, otherwise.

// Test code: a panic is how a failure is reported (helpers sit outside `#[test]` functions).
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::*;
use katablk_bdev::file::{FileDevice, FileOptions, IoMode};
use katablk_bdev::sync::SyncIo;
use katablk_bdev::{BlockDevice, IoOp, IoRequest};

const SIZE: u64 = 16 << 20;

/// A loop device attached to a temporary file; detached on drop.
struct LoopDev {
    dev: PathBuf,
    _backing: tempfile::NamedTempFile,
}

impl LoopDev {
    fn new() -> Option<Self> {
        let backing = tempfile::Builder::new()
            .prefix("katablk-loop")
            .tempfile_in("/var/tmp")
            .unwrap();
        backing.as_file().set_len(SIZE).unwrap();
        let out = match Command::new("losetup")
            .args(["-f", "--show"])
            .arg(backing.path())
            .output()
        {
            Ok(o) => o,
            Err(e) => {
                println!("skipped: cannot run losetup: {e}");
                return None;
            }
        };
        if !out.status.success() {
            println!(
                "skipped: losetup failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return None;
        }
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        Some(LoopDev {
            dev,
            _backing: backing,
        })
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

fn open(l: &LoopDev, mode: IoMode, direct: bool) -> Option<FileDevice> {
    let opts = FileOptions {
        direct,
        mode,
        ..Default::default()
    };
    let d = match FileDevice::open(&l.dev, &opts) {
        Ok(d) => d,
        Err(e) => {
            println!("skipped: cannot open {}: {e}", l.dev.display());
            return None;
        }
    };
    if mode == IoMode::IoUring {
        if let Err(e) = d.open_channel(1, 1) {
            println!("skipped: io_uring unavailable: {e}");
            return None;
        }
    }
    Some(d)
}

fn exercise(l: &LoopDev, mode: IoMode, direct: bool) {
    let Some(dev) = open(l, mode, direct) else {
        return;
    };
    let info = dev.info();
    assert_eq!(info.size_bytes(), SIZE);
    assert!(
        dev.describe().starts_with("blockdev "),
        "{}",
        dev.describe()
    );
    assert!(info.discard && info.write_zeroes);
    let mut io = SyncIo::new(&dev).unwrap();
    let mut ch = dev.open_channel(8, 4).unwrap();
    let fill = vec![0x3cu8; 1 << 20];
    write_at(ch.as_mut(), 0, &fill);
    write_at(ch.as_mut(), 1 << 20, &fill);
    io.flush().unwrap();

    // BLKDISCARD (loop devices punch a hole in the backing file: reads back as zeroes).
    no_data(ch.as_mut(), IoOp::Discard, 64 << 10, 64 << 10);
    // BLKZEROOUT.
    no_data(
        ch.as_mut(),
        IoOp::WriteZeroes { unmap: false },
        256 << 10,
        12 << 10,
    );
    // Unmapping write-zeroes goes through BLKDISCARD.
    no_data(
        ch.as_mut(),
        IoOp::WriteZeroes { unmap: true },
        1 << 20,
        128 << 10,
    );
    // Queued together with data requests: the inline completions must still be reported.
    let mut buf = AlignedBuf::new(4096);
    let iov = iov1(&mut buf);
    let reqs = [
        IoRequest::no_data(IoOp::Discard, 1536 << 10, 4096, 1),
        IoRequest {
            op: IoOp::Read,
            offset: 0,
            len: 4096,
            iov: &iov,
            token: 2,
        },
        IoRequest::no_data(IoOp::WriteZeroes { unmap: false }, 1600 << 10, 512, 3),
        IoRequest::no_data(IoOp::Flush, 0, 0, 4),
    ];
    for r in &reqs {
        submit(ch.as_mut(), r).unwrap();
    }
    let mut done = drain(ch.as_mut());
    done.sort_by_key(|c| c.token);
    let results: Vec<_> = done.iter().map(|c| c.result).collect();
    assert_eq!(results, [Ok(0), Ok(4096), Ok(0), Ok(0)]);
    assert!(buf.iter().all(|&b| b == 0x3c));

    let zeroed = [
        (64 << 10, 64 << 10),
        (256 << 10, 12 << 10),
        (1 << 20, 128 << 10),
        (1536 << 10, 4096),
        (1600 << 10, 512),
    ];
    let b = read_at(ch.as_mut(), 0, 2 << 20);
    for (i, &x) in b.iter().enumerate() {
        let pos = i as u64;
        let z = zeroed.iter().any(|&(o, l)| pos >= o && pos < o + l);
        assert_eq!(
            x,
            if z { 0 } else { 0x3c },
            "{mode} direct={direct} byte {pos}"
        );
    }
    // The rest of the device was never written.
    let b = read_at(ch.as_mut(), SIZE - (1 << 20), 1 << 20);
    assert!(b.iter().all(|&x| x == 0));
}

#[test]
fn loop_device_all_modes() {
    let Some(l) = LoopDev::new() else {
        return;
    };
    for mode in MODES {
        for direct in [false, true] {
            exercise(&l, mode, direct);
        }
    }
}
