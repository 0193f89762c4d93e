//! Rate limits (QoS) for the requests of a block device, and for groups of devices.
//!
//! A [`Limiter`] holds up to four token buckets, in SPDK's terms (`bdev_set_qos_limit`): I/Os
//! per second of any kind, and bytes per second of reads and writes together, of reads and of
//! writes; 0 leaves a dimension unlimited. The consumer (the vhost-user queue workers) asks
//! [`Limiter::admit`] before it starts a request: either every bucket the request draws from is
//! not in debt, and the request is charged and may go, or the answer is how long to wait. A
//! request is charged in full even when that takes a bucket below zero, so one request larger
//! than a second's budget still goes (it is not starved) and the debt makes the next ones wait:
//! over any longer stretch the rate is the limit.
//!
//! A limiter may also belong to groups ([`Limiter::set_groups`]): a request must then pass its
//! own buckets and every group's, and is charged to all of them, so the volumes of one pod can
//! share one budget.
//!
//! Nothing here costs anything while no limit is set: [`Limiter::is_active`] is one relaxed
//! atomic load, and there are no timers: the caller arms one only while a request waits.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

/// The limits of one [`Limiter`], per second; 0 means unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QosLimits {
    /// Requests of any kind.
    pub rw_ios_per_sec: u64,
    /// Bytes read and written.
    pub rw_bytes_per_sec: u64,
    /// Bytes read.
    pub r_bytes_per_sec: u64,
    /// Bytes written.
    pub w_bytes_per_sec: u64,
}

impl QosLimits {
    /// No dimension is limited.
    pub fn is_unlimited(&self) -> bool {
        *self == Self::default()
    }
}

/// What a request is, as far as the limits are concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// A read of `n` bytes.
    Read(u64),
    /// A write of `n` bytes.
    Write(u64),
    /// Anything else (flush, discard, write-zeroes, get-id): one I/O, no bytes.
    Other,
}

/// How much of a second's budget a bucket may save up while idle: a short burst, so an idle
/// volume cannot send a long one later.
const BURST: Duration = Duration::from_millis(50);

#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Units per second; 0 = unlimited.
    rate: u64,
    /// Units available; negative while in debt.
    level: f64,
}

impl Bucket {
    fn new(rate: u64) -> Self {
        Bucket { rate, level: 0.0 }
    }

    fn cap(&self) -> f64 {
        (self.rate as f64 * BURST.as_secs_f64()).max(1.0)
    }

    fn refill(&mut self, dt: f64) {
        if self.rate != 0 {
            self.level = (self.level + self.rate as f64 * dt).min(self.cap());
        }
    }

    /// Time until the bucket is out of debt (zero when it is not in debt or unlimited).
    fn wait(&self) -> Duration {
        if self.rate == 0 || self.level >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.level / self.rate as f64)
        }
    }

    fn charge(&mut self, n: u64) {
        if self.rate != 0 {
            self.level -= n as f64;
        }
    }
}

#[derive(Debug)]
struct Buckets {
    limits: QosLimits,
    ios: Bucket,
    rw: Bucket,
    r: Bucket,
    w: Bucket,
    last: Instant,
}

impl Buckets {
    fn new(limits: QosLimits, now: Instant) -> Self {
        Buckets {
            limits,
            ios: Bucket::new(limits.rw_ios_per_sec),
            rw: Bucket::new(limits.rw_bytes_per_sec),
            r: Bucket::new(limits.r_bytes_per_sec),
            w: Bucket::new(limits.w_bytes_per_sec),
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        // Callers read the clock before they take the lock: a late one must not move `last`
        // back (the stretch in between would be credited twice).
        if now <= self.last {
            return;
        }
        let dt = (now - self.last).as_secs_f64();
        self.last = now;
        for b in [&mut self.ios, &mut self.rw, &mut self.r, &mut self.w] {
            b.refill(dt);
        }
    }

    /// The wait before `dir` may go (zero: now).
    fn wait(&self, dir: Dir) -> Duration {
        let mut w = self.ios.wait();
        match dir {
            Dir::Read(_) => w = w.max(self.rw.wait()).max(self.r.wait()),
            Dir::Write(_) => w = w.max(self.rw.wait()).max(self.w.wait()),
            Dir::Other => {}
        }
        w
    }

    fn charge(&mut self, dir: Dir) {
        self.ios.charge(1);
        match dir {
            Dir::Read(n) => {
                self.rw.charge(n);
                self.r.charge(n);
            }
            Dir::Write(n) => {
                self.rw.charge(n);
                self.w.charge(n);
            }
            Dir::Other => {}
        }
    }
}

/// Counters of a limiter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QosStats {
    /// Requests that had to wait at least once.
    pub throttled_requests: u64,
    /// Total time requests spent waiting, in nanoseconds (as reported by the caller).
    pub throttled_ns: u64,
}

/// The rate limits of one device (or of a group of devices), shared by every queue that serves
/// it and changeable at any time.
#[derive(Debug)]
pub struct Limiter {
    /// Own limits set, or member of a group: the only thing read on the unlimited path.
    active: AtomicBool,
    own_limited: AtomicBool,
    buckets: Mutex<Buckets>,
    groups: RwLock<Vec<Arc<Limiter>>>,
    throttled_requests: AtomicU64,
    throttled_ns: AtomicU64,
}

impl Default for Limiter {
    fn default() -> Self {
        Limiter {
            active: AtomicBool::new(false),
            own_limited: AtomicBool::new(false),
            buckets: Mutex::new(Buckets::new(QosLimits::default(), Instant::now())),
            groups: RwLock::new(Vec::new()),
            throttled_requests: AtomicU64::new(0),
            throttled_ns: AtomicU64::new(0),
        }
    }
}

impl Limiter {
    /// A limiter with no limits.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn lock(&self) -> MutexGuard<'_, Buckets> {
        self.buckets.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether any limit (own or a group's) may apply: false means [`Limiter::admit`] would
    /// always say yes, and callers skip it.
    #[inline]
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    fn update_active(&self) {
        let groups = !self
            .groups
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty();
        self.active.store(
            groups || self.own_limited.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
    }

    /// Sets the limits, taking effect for the next request. Saved-up budget is kept up to the
    /// new burst size and debt is kept, so changing a limit (any number of times) neither lets
    /// a burst through nor forgets what was just sent.
    pub fn set_limits(&self, limits: QosLimits) {
        self.set_limits_at(limits, Instant::now());
    }

    /// [`Limiter::set_limits`] at a given time (tests).
    pub fn set_limits_at(&self, limits: QosLimits, now: Instant) {
        let mut b = self.lock();
        b.refill(now);
        let old = std::mem::replace(&mut *b, Buckets::new(limits, now));
        let keep = |new: &mut Bucket, old: Bucket| {
            if new.rate != 0 && old.rate != 0 {
                new.level = old.level.min(new.cap());
            }
        };
        keep(&mut b.ios, old.ios);
        keep(&mut b.rw, old.rw);
        keep(&mut b.r, old.r);
        keep(&mut b.w, old.w);
        drop(b);
        self.own_limited
            .store(!limits.is_unlimited(), Ordering::Relaxed);
        self.update_active();
    }

    /// The limits set.
    pub fn limits(&self) -> QosLimits {
        self.lock().limits
    }

    /// Makes this limiter a member of `groups` (replacing its previous ones).
    pub fn set_groups(&self, groups: Vec<Arc<Limiter>>) {
        *self.groups.write().unwrap_or_else(|p| p.into_inner()) = groups;
        self.update_active();
    }

    /// The groups this limiter belongs to.
    pub fn groups(&self) -> Vec<Arc<Limiter>> {
        self.groups
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// May a request of `dir` start now? `Ok` charges it to this limiter and its groups;
    /// `Err(wait)` charges nothing and says how long until it may (ask again then).
    pub fn admit(&self, dir: Dir) -> Result<(), Duration> {
        self.admit_at(dir, Instant::now())
    }

    /// [`Limiter::admit`] at a given time (tests).
    pub fn admit_at(&self, dir: Dir, now: Instant) -> Result<(), Duration> {
        let groups = self.groups.read().unwrap_or_else(|p| p.into_inner());
        // Lock order: own buckets, then the groups in their order; a group never locks its
        // members, so there is no cycle.
        let mut own = self.lock();
        own.refill(now);
        let mut locked: Vec<MutexGuard<'_, Buckets>> = groups.iter().map(|g| g.lock()).collect();
        let mut wait = own.wait(dir);
        for g in &mut locked {
            g.refill(now);
            wait = wait.max(g.wait(dir));
        }
        if !wait.is_zero() {
            return Err(wait);
        }
        own.charge(dir);
        for g in &mut locked {
            g.charge(dir);
        }
        Ok(())
    }

    /// Records that a request waited `waited` before it was admitted.
    pub fn record_wait(&self, waited: Duration) {
        self.throttled_requests.fetch_add(1, Ordering::Relaxed);
        self.throttled_ns.fetch_add(
            u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Counters.
    pub fn stats(&self) -> QosStats {
        QosStats {
            throttled_requests: self.throttled_requests.load(Ordering::Relaxed),
            throttled_ns: self.throttled_ns.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Admits as many requests as the limiter lets through in `secs` of simulated time, each
    /// asked for as soon as the previous answer allows.
    fn run(l: &Limiter, dir: Dir, secs: f64) -> u64 {
        let t0 = Instant::now();
        let end = t0 + Duration::from_secs_f64(secs);
        let mut t = t0;
        let mut n = 0;
        while t < end {
            match l.admit_at(dir, t) {
                Ok(()) => n += 1,
                Err(w) => t += w,
            }
        }
        n
    }

    #[test]
    fn unlimited_costs_one_load() {
        let l = Limiter::new();
        assert!(!l.is_active());
        assert!(l.admit(Dir::Read(1 << 20)).is_ok());
        l.set_limits(QosLimits {
            rw_ios_per_sec: 1000,
            ..Default::default()
        });
        assert!(l.is_active());
        l.set_limits(QosLimits::default());
        assert!(!l.is_active());
    }

    #[test]
    fn rates_hold_within_a_percent() {
        let l = Limiter::new();
        l.set_limits(QosLimits {
            rw_ios_per_sec: 10_000,
            ..Default::default()
        });
        let n = run(&l, Dir::Read(4096), 10.0);
        assert!((99_000..=101_500).contains(&n), "{n}");
        let l = Limiter::new();
        l.set_limits(QosLimits {
            rw_bytes_per_sec: 100 << 20,
            ..Default::default()
        });
        let n = run(&l, Dir::Write(128 << 10), 10.0);
        let want = 10 * (100 << 20) / (128 << 10);
        assert!(n.abs_diff(want) * 100 <= want, "{n} vs {want}");
    }

    #[test]
    fn read_and_write_limits_are_separate() {
        let l = Limiter::new();
        l.set_limits(QosLimits {
            r_bytes_per_sec: 1 << 20,
            ..Default::default()
        });
        let t = Instant::now();
        // Reads run into debt; writes are not limited at all.
        assert!(l.admit_at(Dir::Read(4 << 20), t).is_ok());
        let w = l.admit_at(Dir::Read(4096), t).unwrap_err();
        assert!(w > Duration::from_secs(3), "{w:?}");
        for _ in 0..1000 {
            assert!(l.admit_at(Dir::Write(1 << 20), t).is_ok());
        }
    }

    #[test]
    fn a_request_larger_than_the_budget_is_not_starved() {
        let l = Limiter::new();
        l.set_limits(QosLimits {
            rw_bytes_per_sec: 1 << 20,
            ..Default::default()
        });
        let t = Instant::now();
        assert!(l.admit_at(Dir::Read(64 << 20), t).is_ok());
        // ... and the debt holds the next ones back for as long as it took.
        let w = l.admit_at(Dir::Read(512), t).unwrap_err();
        assert!(w >= Duration::from_secs(63), "{w:?}");
    }

    #[test]
    fn a_limit_changed_mid_run_applies_at_once_and_keeps_debt() {
        let l = Limiter::new();
        let lim = |n| QosLimits {
            rw_ios_per_sec: n,
            ..Default::default()
        };
        l.set_limits(lim(1000));
        let t0 = Instant::now();
        let mut t = t0;
        let mut first = 0;
        while t < t0 + Duration::from_secs(1) {
            match l.admit_at(Dir::Other, t) {
                Ok(()) => first += 1,
                Err(w) => t += w,
            }
        }
        // Raised five times in a row (SPDK's second-change bug must not happen here).
        for n in [2000, 3000, 4000, 5000] {
            l.set_limits_at(lim(n), t);
        }
        let mut second = 0;
        let t1 = t;
        while t < t1 + Duration::from_secs(1) {
            match l.admit_at(Dir::Other, t) {
                Ok(()) => second += 1,
                Err(w) => t += w,
            }
        }
        assert!((990..=1060).contains(&first), "{first}");
        assert!((4950..=5100).contains(&second), "{second}");
        assert_eq!(l.limits(), lim(5000));
    }

    #[test]
    fn a_late_clock_reading_credits_nothing_twice() {
        let l = Limiter::new();
        l.set_limits(QosLimits {
            rw_ios_per_sec: 1000,
            ..Default::default()
        });
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        // Drain the bucket at t1, then a caller that read the clock at t0 comes in late.
        while l.admit_at(Dir::Other, t1).is_ok() {}
        assert!(l.admit_at(Dir::Other, t0).is_err());
        // At t1 nothing was credited in between.
        assert!(l.admit_at(Dir::Other, t1).is_err());
    }

    #[test]
    fn a_group_shares_one_budget() {
        let g = Limiter::new();
        g.set_limits(QosLimits {
            rw_ios_per_sec: 3000,
            ..Default::default()
        });
        let members: Vec<_> = (0..3).map(|_| Limiter::new()).collect();
        for m in &members {
            assert!(!m.is_active());
            m.set_groups(vec![g.clone()]);
            assert!(m.is_active());
        }
        // One clock; each member asks in turn (who asks first rotates, as independent queue
        // workers would), as eager as the others.
        let t0 = Instant::now();
        let end = t0 + Duration::from_secs(2);
        let mut t = t0;
        let mut n = [0u64; 3];
        let mut round = 0;
        while t < end {
            let mut wait = Duration::MAX;
            round += 1;
            for k in 0..3 {
                let i = (round + k) % 3;
                match members[i].admit_at(Dir::Other, t) {
                    Ok(()) => {
                        n[i] += 1;
                        wait = Duration::ZERO;
                    }
                    Err(w) => wait = wait.min(w),
                }
            }
            t += wait;
        }
        let total: u64 = n.iter().sum();
        assert!((5900..=6200).contains(&total), "{n:?}");
        for x in n {
            assert!(x > 1500, "{n:?}");
        }
    }
}
