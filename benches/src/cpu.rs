//! CPU accounting: the client's own CPU time (getrusage) and a server's CPU use from
//! `/proc/PID/stat` (utime + stime of all its threads).

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// User and system CPU time consumed by a process.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpuTimes {
    /// Time in user mode.
    pub user: Duration,
    /// Time in kernel mode.
    pub system: Duration,
}

impl CpuTimes {
    /// `self - earlier`, saturating at zero.
    pub fn since(&self, earlier: &CpuTimes) -> CpuTimes {
        CpuTimes {
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
        }
    }
}

/// CPU use over a wall-clock window, as reported in the JSON results.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuUsage {
    /// Process ID, for a server; `None` for the client itself.
    pub pid: Option<u32>,
    /// User CPU seconds in the window.
    pub user_s: f64,
    /// System CPU seconds in the window.
    pub sys_s: f64,
    /// Length of the window in seconds.
    pub wall_s: f64,
    /// (user + sys) / wall × 100: 100 means one core fully busy.
    pub percent: f64,
}

impl CpuUsage {
    /// Builds the usage of `times` over `wall`.
    pub fn new(pid: Option<u32>, times: CpuTimes, wall: Duration) -> Self {
        let user_s = times.user.as_secs_f64();
        let sys_s = times.system.as_secs_f64();
        let wall_s = wall.as_secs_f64();
        let percent = if wall_s > 0.0 {
            (user_s + sys_s) / wall_s * 100.0
        } else {
            0.0
        };
        Self {
            pid,
            user_s,
            sys_s,
            wall_s,
            percent,
        }
    }
}

fn timeval(tv: libc::timeval) -> Duration {
    Duration::from_secs(tv.tv_sec.max(0) as u64) + Duration::from_micros(tv.tv_usec.max(0) as u64)
}

/// CPU time used so far by this process (all threads).
pub fn self_times() -> Result<CpuTimes> {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `ru` points to writable memory of the size of `struct rusage`, which
    // getrusage fills on success; we read it only then.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("getrusage");
    }
    // SAFETY: getrusage succeeded, so the struct is initialised (it was zeroed anyway).
    let ru = unsafe { ru.assume_init() };
    Ok(CpuTimes {
        user: timeval(ru.ru_utime),
        system: timeval(ru.ru_stime),
    })
}

/// Clock ticks per second used by `/proc/PID/stat`.
pub fn clock_ticks() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

/// Parses `utime` and `stime` (fields 14 and 15, in clock ticks) from the text of
/// `/proc/PID/stat`. The command name (field 2) may contain spaces and parentheses,
/// so fields are counted after its last `)`.
pub fn parse_proc_stat(text: &str) -> Result<(u64, u64)> {
    let close = text
        .rfind(')')
        .context("malformed /proc/PID/stat: no ')' after the command name")?;
    // After ") " come fields 3 (state), 4, ...: utime is field 14, so index 11 here.
    let fields: Vec<&str> = text[close + 1..].split_whitespace().collect();
    if fields.len() < 13 {
        bail!("malformed /proc/PID/stat: only {} fields", fields.len() + 2);
    }
    let utime = fields[11].parse().context("parsing utime")?;
    let stime = fields[12].parse().context("parsing stime")?;
    Ok((utime, stime))
}

/// CPU time used so far by process `pid` (the whole thread group, exited threads included).
pub fn proc_times(pid: u32) -> Result<CpuTimes> {
    let path = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading {path} (is process {pid} running?)"))?;
    let (utime, stime) = parse_proc_stat(&text)?;
    let hz = clock_ticks();
    let ticks =
        |t: u64| Duration::from_secs(t / hz) + Duration::from_nanos((t % hz) * 1_000_000_000 / hz);
    Ok(CpuTimes {
        user: ticks(utime),
        system: ticks(stime),
    })
}

/// Where a CPU measurement started: take one with [`CpuSampler::start`], finish with
/// [`CpuSampler::finish`].
#[derive(Clone, Debug)]
pub struct CpuSampler {
    pid: Option<u32>,
    start_times: CpuTimes,
    start: Instant,
}

impl CpuSampler {
    /// Starts measuring process `pid`, or this process if `None`.
    pub fn start(pid: Option<u32>) -> Result<Self> {
        Ok(Self {
            pid,
            start_times: Self::read(pid)?,
            start: Instant::now(),
        })
    }

    fn read(pid: Option<u32>) -> Result<CpuTimes> {
        match pid {
            Some(p) => proc_times(p),
            None => self_times(),
        }
    }

    /// CPU use since [`CpuSampler::start`].
    pub fn finish(&self) -> Result<CpuUsage> {
        let now = Self::read(self.pid)?;
        Ok(CpuUsage::new(
            self.pid,
            now.since(&self.start_times),
            self.start.elapsed(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_command_name() {
        let line = "1234 (qemu (storage) d) S 1 1234 1234 0 -1 4194560 1234 0 0 0 \
                    250 75 0 0 20 0 3 0 12345 1000000 500 18446744073709551615";
        assert_eq!(parse_proc_stat(line).unwrap(), (250, 75));
    }

    #[test]
    fn rejects_truncated_stat() {
        assert!(parse_proc_stat("1 (x) S 1 2").is_err());
        assert!(parse_proc_stat("garbage").is_err());
    }

    #[test]
    fn own_process_is_readable_both_ways() {
        let pid = std::process::id();
        let sampler = CpuSampler::start(Some(pid)).unwrap();
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_add(i * i);
        }
        std::hint::black_box(x);
        let usage = sampler.finish().unwrap();
        assert!(usage.percent >= 0.0);
        assert!(self_times().unwrap().user > Duration::ZERO);
    }

    #[test]
    fn usage_percent() {
        let u = CpuUsage::new(
            None,
            CpuTimes {
                user: Duration::from_millis(1500),
                system: Duration::from_millis(500),
            },
            Duration::from_secs(4),
        );
        assert_eq!(u.percent, 50.0);
    }
}
