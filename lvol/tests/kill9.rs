//! kill -9 of a process writing to a file-backed store, then reopen: every write acknowledged
//! by a completed flush must be there (the child reports its writes and flushes on a pipe).
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pattern;
use katablk_bdev::file::{FileDevice, FileOptions};
use katablk_bdev::sync::SyncIo;
use katablk_bdev::BlockDevice;
use katablk_lvol::{LvStore, LvsOptions};

const ENV: &str = "KATABLK_LVOL_KILL9_FILE";
const CS: u64 = 256 << 10;
const VOLS: usize = 3;
const BLOCKS: u64 = 4 * CS / 4096;

fn dev(path: &str) -> Arc<dyn BlockDevice> {
    Arc::new(FileDevice::open(path, &FileOptions::default()).unwrap())
}

/// The child: writes, flushes, snapshots and merges forever, reporting on stdout.
#[test]
fn kill9_child() {
    let Ok(path) = std::env::var(ENV) else { return };
    let lvs = match LvStore::open(dev(&path)) {
        Ok(l) => l,
        Err(_) => {
            let mut o = LvsOptions::new("lvs0");
            o.cluster_size = CS as u32;
            LvStore::create(dev(&path), o).unwrap()
        }
    };
    for i in 0..VOLS {
        if lvs.lvol(&format!("v{i}")).is_err() {
            lvs.create_lvol(&format!("v{i}"), 4 * CS, i != 0).unwrap();
        }
    }
    let out = std::io::stdout();
    let say = |s: String| {
        let mut o = out.lock();
        writeln!(o, "{s}").unwrap();
        o.flush().unwrap();
    };
    say("READY".into());
    let seed = std::process::id() as u64;
    let mut x = seed | 1;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut tag = seed << 32;
    loop {
        let v = (rnd() % VOLS as u64) as usize;
        let vol = lvs.lvol(&format!("v{v}")).unwrap();
        let mut io = SyncIo::new(&*vol).unwrap();
        for _ in 0..(rnd() % 8 + 1) {
            tag += 1;
            let blk = rnd() % BLOCKS;
            say(format!("W {v} {blk} {tag}"));
            io.write_at(blk * 4096, &pattern(tag, 4096)).unwrap();
        }
        io.flush().unwrap();
        say(format!("F {v}"));
        drop(io);
        match rnd() % 10 {
            0 => {
                let _ = lvs.snapshot(&format!("v{v}"), &format!("s{tag}"));
            }
            1 => {
                if let Some(s) = lvs.list().into_iter().find(|l| l.name.starts_with('s')) {
                    let _ = lvs.delete(&s.name);
                }
            }
            2 => {
                let _ = lvs.create_lvol(&format!("t{tag}"), CS, true);
            }
            3 => {
                if let Some(t) = lvs.list().into_iter().find(|l| l.name.starts_with('t')) {
                    let _ = lvs.delete(&t.name);
                }
            }
            _ => {}
        }
    }
}

#[test]
fn kill9_and_reopen() {
    let f = tempfile::NamedTempFile::new().unwrap();
    f.as_file().set_len(16 << 20).unwrap();
    let path = f.path().to_str().unwrap().to_string();
    // Per block: tag acknowledged by a flush, and tags written since.
    let mut blocks: HashMap<(usize, u64), (u64, Vec<u64>)> = HashMap::new();
    let exe = std::env::current_exe().unwrap();
    for round in 0..4 {
        let mut child = Command::new(&exe)
            .args(["kill9_child", "--exact", "--nocapture", "--test-threads=1"])
            .env(ENV, &path)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        // Wait for READY, then let it run a little.
        let start = Instant::now();
        let mut lines = Vec::new();
        let mut ready = false;
        let run_for = Duration::from_millis(150 + 100 * round);
        loop {
            match rx.recv_timeout(Duration::from_millis(20)) {
                Ok(l) => {
                    if l == "READY" {
                        ready = true;
                    }
                    lines.push(l);
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(_) => break,
            }
            if ready && start.elapsed() > run_for {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "child never got ready"
            );
        }
        child.kill().unwrap();
        child.wait().unwrap();
        reader.join().unwrap();
        lines.extend(rx.try_iter());
        let mut pending: HashMap<usize, Vec<(u64, u64)>> = HashMap::new();
        for l in &lines {
            let p: Vec<&str> = l.split(' ').collect();
            match p[0] {
                "W" => {
                    let (v, blk, tag) = (
                        p[1].parse::<usize>().unwrap(),
                        p[2].parse::<u64>().unwrap(),
                        p[3].parse::<u64>().unwrap(),
                    );
                    pending.entry(v).or_default().push((blk, tag));
                    blocks
                        .entry((v, blk))
                        .or_insert((0, Vec::new()))
                        .1
                        .push(tag);
                }
                "F" => {
                    let v = p[1].parse::<usize>().unwrap();
                    for (blk, tag) in pending.remove(&v).unwrap_or_default() {
                        let e = blocks.get_mut(&(v, blk)).unwrap();
                        e.0 = tag;
                        e.1.retain(|&t| t > tag);
                    }
                }
                _ => {}
            }
        }
        // Reopen and check.
        let lvs = LvStore::open(dev(&path)).unwrap_or_else(|e| panic!("round {round}: {e}"));
        let info = lvs.info();
        let alloc: u64 = lvs.list().iter().map(|l| l.num_allocated_clusters).sum();
        assert_eq!(alloc + info.free_clusters, info.total_data_clusters);
        for v in 0..VOLS {
            let vol = lvs.lvol(&format!("v{v}")).unwrap();
            let mut io = SyncIo::new(&*vol).unwrap();
            let mut buf = vec![0u8; 4096];
            for blk in 0..BLOCKS {
                io.read_at(blk * 4096, &mut buf).unwrap();
                let (acked, later) = blocks.get(&(v, blk)).cloned().unwrap_or((0, Vec::new()));
                let ok = std::iter::once(acked)
                    .chain(later.iter().copied())
                    .any(|t| pattern(t, 4096) == buf);
                assert!(
                    ok,
                    "round {round}: v{v} block {blk}: acked {acked}, later {later:?}, got {:?}",
                    &buf[..8]
                );
            }
        }
        // Whatever was read is now the durable state of unacknowledged blocks.
        drop(lvs);
        let lvs = LvStore::open(dev(&path)).unwrap();
        for v in 0..VOLS {
            let vol = lvs.lvol(&format!("v{v}")).unwrap();
            let mut io = SyncIo::new(&*vol).unwrap();
            let mut buf = vec![0u8; 4096];
            for blk in 0..BLOCKS {
                io.read_at(blk * 4096, &mut buf).unwrap();
                let mut t = [0u8; 8];
                t.copy_from_slice(&buf[..8]);
                let e = blocks.entry((v, blk)).or_insert((0, Vec::new()));
                e.0 = u64::from_le_bytes(t);
                e.1.clear();
            }
        }
        eprintln!("round {round}: {} lines", lines.len());
    }
}
