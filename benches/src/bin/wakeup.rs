//! `katablk-bench-wakeup`: the latency floor of a QD1 request with event-driven completions.
//!
//! Two threads pinned to two CPUs play a vhost-user-blk exchange with no device behind it: the
//! "driver" publishes a request (a store to a shared cache line, as into an available ring) and
//! waits for the completion the way an event-driven client does (a blocking `read` or `poll` of
//! an eventfd); the "server" busy-polls the shared line, as a polling vhost-user backend does,
//! and signals the eventfd at once. What is measured is what no server can take out of a QD1
//! round trip: one cache-line handoff each way and one cross-CPU wake-up of a sleeping thread
//! (on a VM: the vCPU's halt, the host's IPI and the guest scheduler). `--wait spin` replaces the
//! eventfd with a second shared line, the floor of a busy-polling client.

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use katablk_bench::stats::{new_histogram, LatencySummary};
use serde::Serialize;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the driver thread waits for a completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Wait {
    /// Blocking `read(2)` of the call eventfd.
    Read,
    /// `poll(2)` on the call eventfd, then `read(2)` (libblkio's blocking wait).
    Poll,
    /// Busy-poll a shared completion line; no eventfd.
    Spin,
}

/// Measure the QD1 round-trip floor of a polling server and an event-driven client.
#[derive(Debug, Parser)]
#[command(name = "katablk-bench-wakeup", version)]
struct Args {
    /// CPU of the polling "server" thread.
    #[arg(long, default_value_t = 0)]
    server_cpu: usize,
    /// CPU of the waiting "driver" thread.
    #[arg(long, default_value_t = 1)]
    client_cpu: usize,
    /// How the driver waits.
    #[arg(long, value_enum, default_value_t = Wait::Poll)]
    wait: Wait,
    /// Seconds to measure.
    #[arg(long, default_value_t = 3.0)]
    secs: f64,
    /// Seconds of warm-up before measuring.
    #[arg(long, default_value_t = 0.5)]
    ramp: f64,
    /// Write the result as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
struct Report {
    server_cpu: usize,
    client_cpu: usize,
    wait: Wait,
    round_trips: u64,
    /// Request published to completion seen, per round trip.
    round_trip: LatencySummary,
    /// Server's signal to the driver running again (one wake-up).
    wake: LatencySummary,
}

/// One cache line each, so the two directions do not share a line.
#[repr(align(64))]
#[derive(Default)]
struct Line(AtomicU64);

#[derive(Default)]
struct Shared {
    request: Line,
    done: Line,
    /// When the server signalled the current completion, in ns since `epoch`.
    signalled_ns: Line,
    stop: AtomicBool,
}

fn pin(cpu: usize) -> Result<()> {
    // SAFETY: `cpu_set_t` is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu >= libc::CPU_SETSIZE as usize {
        bail!("CPU {cpu} out of range");
    }
    // SAFETY: `cpu` is below CPU_SETSIZE, checked above.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("pinning to CPU {cpu}"));
    }
    Ok(())
}

fn eventfd() -> Result<OwnedFd> {
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("eventfd");
    }
    // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn signal(fd: i32) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64 to an eventfd the caller keeps open.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

fn wait_fd(fd: i32, poll_first: bool) -> Result<()> {
    if poll_first {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; an infinite timeout.
        if unsafe { libc::poll(&mut p, 1, -1) } < 0 {
            return Err(std::io::Error::last_os_error()).context("poll");
        }
    }
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a live u64 from an eventfd the caller keeps open.
    if unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) } != 8 {
        return Err(std::io::Error::last_os_error()).context("eventfd read");
    }
    Ok(())
}

fn run(args: &Args) -> Result<Report> {
    let shared = Arc::new(Shared::default());
    let call = Arc::new(eventfd()?);
    let epoch = Instant::now();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
    let server = {
        let shared = Arc::clone(&shared);
        let call = Arc::clone(&call);
        let cpu = args.server_cpu;
        let wait = args.wait;
        std::thread::Builder::new()
            .name("server".into())
            .spawn(move || -> Result<()> {
                let pinned = pin(cpu);
                let failed = pinned.is_err();
                // The driver waits for this before publishing anything.
                let _ = ready_tx.send(pinned);
                if failed {
                    return Ok(());
                }
                let mut seen = 0;
                while !shared.stop.load(Ordering::Relaxed) {
                    let r = shared.request.0.load(Ordering::Acquire);
                    if r == seen {
                        std::hint::spin_loop();
                        continue;
                    }
                    seen = r;
                    let now = u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    shared.signalled_ns.0.store(now, Ordering::Relaxed);
                    shared.done.0.store(r, Ordering::Release);
                    if wait != Wait::Spin {
                        signal(call.as_raw_fd());
                    }
                }
                Ok(())
            })
            .context("spawning the server thread")?
    };
    let result = (|| -> Result<Report> {
        ready_rx
            .recv()
            .context("the server thread ended before it started")??;
        pin(args.client_cpu)?;
        let mut rtt = new_histogram()?;
        let mut wake = new_histogram()?;
        let ramp_end = Duration::from_secs_f64(args.ramp);
        let end = ramp_end + Duration::from_secs_f64(args.secs);
        let mut seq = 0u64;
        loop {
            let t0 = epoch.elapsed();
            if t0 >= end {
                break;
            }
            seq += 1;
            shared.request.0.store(seq, Ordering::Release);
            match args.wait {
                Wait::Spin => {
                    while shared.done.0.load(Ordering::Acquire) != seq {
                        std::hint::spin_loop();
                    }
                }
                Wait::Read | Wait::Poll => wait_fd(call.as_raw_fd(), args.wait == Wait::Poll)?,
            }
            let t1 = epoch.elapsed();
            if t0 < ramp_end {
                continue;
            }
            let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
            rtt.saturating_record(ns(t1 - t0).max(1));
            let sig = shared.signalled_ns.0.load(Ordering::Relaxed);
            wake.saturating_record(ns(t1).saturating_sub(sig).max(1));
        }
        Ok(Report {
            server_cpu: args.server_cpu,
            client_cpu: args.client_cpu,
            wait: args.wait,
            round_trips: rtt.len(),
            round_trip: LatencySummary::from_histogram(&rtt),
            wake: LatencySummary::from_histogram(&wake),
        })
    })();
    shared.stop.store(true, Ordering::Relaxed);
    // The server may be spinning on an unchanged request: it sees `stop` on its next turn.
    match server.join() {
        Ok(r) => r?,
        Err(_) => bail!("the server thread panicked"),
    }
    result
}

fn print(r: &Report) {
    let us = |ns: u64| ns as f64 / 1000.0;
    println!(
        "server CPU {} -> client CPU {}, wait {:?}: {} round trips",
        r.server_cpu, r.client_cpu, r.wait, r.round_trips
    );
    for (name, l) in [("round trip", &r.round_trip), ("wake-up", &r.wake)] {
        println!(
            "  {name:<10} p50 {:.2} us  p90 {:.2}  p99 {:.2}  mean {:.2}",
            us(l.p50_ns),
            us(l.p90_ns),
            us(l.p99_ns),
            l.mean_ns / 1000.0
        );
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args).and_then(|r| {
        print(&r);
        if let Some(path) = &args.json {
            let text = serde_json::to_string_pretty(&r).context("encoding the report")?;
            std::fs::write(path, text + "\n")
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("katablk-bench-wakeup: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
