//! Queue workers: one thread per group of virtqueues, each taking requests from its queues'
//! available rings, submitting them to the block device's I/O channel with buffers that point into
//! guest memory, and putting completions in the used ring.
//!
//! Adaptive polling: while requests arrive or complete, and for `poll_us` after the last one, a
//! worker busy-polls its rings with guest notifications suppressed; then it re-enables
//! notifications and sleeps in `epoll_wait` on the kick eventfds and the channels' completion
//! eventfds, so an idle device costs no CPU.

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use katablk_bdev::qos::{Dir, Limiter};
use katablk_bdev::{iovec, BlockDevice, Completion, IoChannel, IoOp, IoRequest, SubmitError};
use tracing::{debug, error, warn};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryLoadGuard};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::timerfd::TimerFd;

use crate::chain::{self, Seg};
use crate::config::SECTOR_SIZE;
use crate::inflight::InflightQueue;
use crate::request::{self, Kind, Range, Request, Status};
use crate::ring;
use crate::{Error, GuestMem};
use katablk_bdev::sigbus::Poison;

/// The guest memory table a backend shares with its queue workers. Every replacement bumps a
/// generation, so a worker keeps its snapshot from one polling turn to the next and loads the
/// table again only when it changed (a load per turn cost 8 % of a worker's time at QD1).
#[derive(Clone)]
pub(crate) struct MemTable {
    table: GuestMemoryAtomic<GuestMem>,
    generation: Arc<AtomicU64>,
}

impl MemTable {
    pub fn new(mem: GuestMem) -> Self {
        MemTable {
            table: GuestMemoryAtomic::new(mem),
            generation: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The current table.
    pub fn memory(&self) -> GuestMemoryLoadGuard<GuestMem> {
        self.table.memory()
    }

    /// Replaces the table; workers pick the new one up at their next turn. A snapshot of the
    /// old one held by a request in flight keeps its regions mapped until it completes.
    pub fn replace(&self, mem: GuestMem) -> Result<(), Error> {
        self.table
            .lock()
            .map_err(|_| Error::Sys("memory table", std::io::Error::other("lock poisoned")))?
            .replace(mem);
        // After the table: a worker that sees the new generation loads the new table.
        self.generation.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// The current table with the generation it is at least as new as.
    fn snapshot(&self) -> (u64, Arc<GuestMem>) {
        let generation = self.generation.load(Ordering::Acquire);
        (generation, self.table.memory().into_inner())
    }

    /// True if the table was replaced after the snapshot of generation `generation`.
    ///
    /// The backend replaces the table before it acknowledges the message that changed it, and
    /// the frontend may use the new regions in the next chain it makes available. A worker that
    /// took its snapshot before the replacement and then reads the available index must check
    /// this before taking what it found: reading the index (an acquire load) orders this load
    /// after the frontend's write, which came after the acknowledgement.
    fn replaced_since(&self, generation: u64) -> bool {
        self.generation.load(Ordering::Acquire) != generation
    }

    /// `cached` if no replacement happened since it was taken, else the current table.
    fn refresh(&self, cached: Option<(u64, Arc<GuestMem>)>) -> (u64, Arc<GuestMem>) {
        match cached {
            Some((g, mem)) if g == self.generation.load(Ordering::Acquire) => (g, mem),
            _ => self.snapshot(),
        }
    }
}

/// State of the device shared by the backend and its workers.
pub(crate) struct DeviceShared {
    pub dev: Arc<dyn BlockDevice>,
    pub serial: String,
    pub read_only: bool,
    pub writeback: AtomicBool,
    pub poll: Duration,
    pub seg_max: usize,
    pub stats: crate::Stats,
    /// Set by the SIGBUS handler when the frontend's memory faulted: its queues are not served
    /// any more and the server drops it.
    pub poison: Arc<Poison>,
    /// The device's rate limits (shared with every controller of the same bdev); inactive
    /// unless a limit is set.
    pub qos: Arc<Limiter>,
}

/// A started virtqueue, handed to a worker.
pub(crate) struct VringCtx {
    pub index: u16,
    pub queue: Queue,
    pub kick: EventFd,
    pub call: Option<EventFd>,
    pub inflight: Option<InflightQueue>,
    /// Heads recovered from the inflight region, resubmitted before new requests.
    pub resubmit: VecDeque<u16>,
    pub counter: u64,
}

/// Messages from the backend to a worker.
pub(crate) enum Cmd {
    Start(Box<VringCtx>),
    /// Stop a queue once its in-flight requests have completed, and hand it back.
    Stop {
        index: u16,
        reply: mpsc::Sender<Option<Box<VringCtx>>>,
    },
    SetCall {
        index: u16,
        call: Option<EventFd>,
    },
    Exit,
}

/// The backend's handle on one worker thread.
pub(crate) struct WorkerHandle {
    cmds: Arc<Mutex<VecDeque<Cmd>>>,
    pending: Arc<AtomicBool>,
    wake: EventFd,
    thread: Option<std::thread::JoinHandle<()>>,
    external: Option<Box<dyn crate::config::WorkerJoin>>,
    /// Gone once the worker is dropped (it exited, or unwound from a panic).
    alive: std::sync::Weak<()>,
}

impl WorkerHandle {
    pub fn spawn(
        id: usize,
        shared: Arc<DeviceShared>,
        mem: MemTable,
        cpu: Option<usize>,
        runtime: Option<&crate::config::RuntimeHandle>,
    ) -> Result<Self, Error> {
        let wake = EventFd::new(EFD_NONBLOCK).map_err(|e| Error::Sys("eventfd", e))?;
        let cmds = Arc::new(Mutex::new(VecDeque::new()));
        let pending = Arc::new(AtomicBool::new(false));
        let epoll = Epoll::new().map_err(|e| Error::Sys("epoll_create", e))?;
        epoll
            .ctl(
                ControlOperation::Add,
                wake.as_raw_fd(),
                EpollEvent::new(EventSet::IN, WAKE_TOKEN),
            )
            .map_err(|e| Error::Sys("epoll_ctl", e))?;
        let timer = TimerFd::new().map_err(|e| {
            Error::Sys(
                "timerfd_create",
                std::io::Error::from_raw_os_error(e.errno()),
            )
        })?;
        epoll
            .ctl(
                ControlOperation::Add,
                timer.as_raw_fd(),
                EpollEvent::new(EventSet::IN, TIMER_TOKEN),
            )
            .map_err(|e| Error::Sys("epoll_ctl", e))?;
        let token = Arc::new(());
        let alive = Arc::downgrade(&token);
        let mut worker = Worker {
            _alive: token,
            epoll,
            wake: wake.try_clone().map_err(|e| Error::Sys("eventfd", e))?,
            cmds: cmds.clone(),
            pending: pending.clone(),
            shared,
            mem,
            cached: None,
            generation: 0,
            queues: Vec::new(),
            done: Vec::with_capacity(256),
            external: runtime.is_some(),
            exiting: false,
            timer,
        };
        if let Some(rt) = runtime {
            let join = rt.0.spawn(
                format!("katablk-q{id}"),
                cpu,
                Box::new(move || worker.step()),
            )?;
            return Ok(WorkerHandle {
                cmds,
                pending,
                wake,
                thread: None,
                external: Some(join),
                alive,
            });
        }
        let thread = std::thread::Builder::new()
            .name(format!("katablk-q{id}"))
            .spawn(move || {
                if let Some(cpu) = cpu {
                    pin_to_cpu(cpu);
                }
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.run()));
                if r.is_err() {
                    // The worker's queues take no more requests; the backend sees the thread
                    // gone (stop() returns) and the rest of the process carries on.
                    error!(worker = id, "queue worker panicked; its queues are stopped");
                }
            })
            .map_err(|e| Error::Sys("spawn worker", e))?;
        Ok(WorkerHandle {
            cmds,
            pending,
            wake,
            thread: Some(thread),
            external: None,
            alive,
        })
    }

    pub fn send(&self, cmd: Cmd) {
        if let Ok(mut q) = self.cmds.lock() {
            q.push_back(cmd);
        }
        self.pending.store(true, Ordering::Release);
        let _ = self.wake.write(1);
    }

    /// Stops queue `index` and waits for it to drain; `None` once the worker has ended (it
    /// exited or panicked), instead of waiting for a reply that cannot come.
    pub fn stop(&self, index: u16) -> Option<Box<VringCtx>> {
        let (tx, rx) = mpsc::channel();
        self.send(Cmd::Stop { index, reply: tx });
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(ctx) => return ctx,
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if self.alive.strong_count() == 0 {
                        return None;
                    }
                }
            }
        }
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        self.send(Cmd::Exit);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(j) = self.external.take() {
            j.join();
        }
    }
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and sched_setaffinity only touch
    // that local set.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            warn!(
                cpu,
                "cannot pin worker: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// Polling turns without progress between two reads of the clock (see `Worker::run`).
const IDLE_CLOCK_TURNS: u32 = 16;

const WAKE_TOKEN: u64 = u64::MAX;
/// The worker's QoS retry timer (armed only while a request waits for its budget).
const TIMER_TOKEN: u64 = u64::MAX - 1;
/// Requests taken in one batch before the completions so far are published and the driver
/// notified ([`Worker::publish_early`]). Measured on a 2-vCPU VM with a libblkio driver at
/// QD32 on a RAM bdev: 4 and 8 did best (1.5x the IOPS of publishing once per batch), 16 less;
/// a wake-up of the driver costs a few microseconds there, so fewer would cost more than they
/// bring.
const EARLY_COMPLETION_BATCH: usize = 8;
/// The same in data bytes: large requests are published after this much data even before
/// EARLY_COMPLETION_BATCH of them (eight 128 KiB reads take ~100 µs to copy). Not under an
/// external runtime: its steps only submit (the copies run in its pollers, between steps),
/// and ending a step per 256 KiB there cost a notification per two 128 KiB reads, three
/// times the driver's CPU per request of SPDK's vhost (which takes up to 32 per poll).
const EARLY_COMPLETION_BYTES: u64 = 256 << 10;
/// Shortest sleep of a queue waiting for its QoS budget (SPDK's QoS works in 1 ms timeslices
/// too): at 10,000 IOPS one wake-up per ten requests instead of one per request.
const QOS_MIN_NAP: Duration = Duration::from_millis(1);

/// Per-request state, preallocated per queue entry.
struct Slot {
    head: u16,
    req: Option<Request>,
    /// Next discard / write-zeroes range to submit.
    next_range: usize,
    /// A flush follows the write (write-through mode).
    flush_after: bool,
    status: Status,
    /// The guest memory snapshot the buffers point into (its address, in the queue's `held`
    /// list, which keeps it until completion so a memory region removed meanwhile stays
    /// mapped). Never dereferenced.
    mem: Option<*const GuestMem>,
    segs: Vec<Seg>,
    iov: Vec<iovec>,
    ranges: Vec<Range>,
}

// SAFETY: the raw pointers in `iov` point into guest memory kept alive by the snapshot `mem` names
// (held by the queue) and are only used by the worker that owns the slot; `mem` is only compared.
unsafe impl Send for Slot {}

/// A memory snapshot requests in flight point into, with how many do: requests hold their
/// snapshot through this count instead of an atomic reference count update each.
struct Held {
    mem: Arc<GuestMem>,
    requests: u32,
}

/// The snapshots of a queue's requests in flight (usually one).
#[derive(Default)]
struct HeldSnapshots {
    list: Vec<Held>,
}

impl HeldSnapshots {
    /// Counts one more request in flight in `mem`; returns the key its slot keeps.
    fn hold(&mut self, mem: &Arc<GuestMem>) -> *const GuestMem {
        let key = Arc::as_ptr(mem);
        if let Some(h) = self.list.iter_mut().find(|h| Arc::as_ptr(&h.mem) == key) {
            h.requests += 1;
        } else {
            self.list.retain(|h| h.requests > 0);
            self.list.push(Held {
                mem: mem.clone(),
                requests: 1,
            });
        }
        key
    }

    /// One request in the snapshot `key` completed. A snapshot no request needs any more is
    /// let go, unless it is the current one (`current`), which the next request will likely
    /// use again: that one is let go before the worker sleeps ([`HeldSnapshots::release_idle`]).
    fn release(&mut self, key: *const GuestMem, current: &Arc<GuestMem>) {
        if let Some(k) = self.list.iter().position(|h| Arc::as_ptr(&h.mem) == key) {
            let h = &mut self.list[k];
            h.requests = h.requests.saturating_sub(1);
            if h.requests == 0 && key != Arc::as_ptr(current) {
                self.list.swap_remove(k);
            }
        }
    }

    /// Lets go of the snapshots no request needs.
    fn release_idle(&mut self) {
        self.list.retain(|h| h.requests > 0);
    }
}

/// A queue being served by a worker.
struct Active {
    ctx: Box<VringCtx>,
    chan: Box<dyn IoChannel>,
    slots: Vec<Slot>,
    free: Vec<u16>,
    stopping: Option<mpsc::Sender<Option<Box<VringCtx>>>>,
    broken: bool,
    has_notify: bool,
    /// Parsed requests waiting for the QoS budget, in ring order; while any waits, no new
    /// request is taken (the rest wait in the guest's ring).
    throttled: VecDeque<u16>,
    /// When the first of them was refused (for the throttled-time counter).
    throttled_since: Option<Instant>,
    /// When the first of them may be admitted.
    retry_at: Option<Instant>,
    /// The used index when the driver was last considered for a notification.
    signalled: u16,
    /// Host addresses of the rings in the current memory snapshot.
    rings: ring::Rings,
    /// The snapshots of requests in flight.
    held: HeldSnapshots,
}

impl Active {
    /// An available index more than a ring ahead of ours is the driver's bug or an attack:
    /// stops the queue with one message and returns true.
    fn stop_if_wild(&mut self, avail: u16) -> bool {
        let next = self.ctx.queue.next_avail();
        if avail.wrapping_sub(next) <= self.ctx.queue.size() {
            return false;
        }
        error!(
            queue = self.ctx.index,
            avail, next, "available index more than a ring ahead; queue stopped"
        );
        self.broken = true;
        true
    }
}

/// Where `run` is in a stretch of turns without progress.
struct Idle {
    /// Start of the stretch (the clock is read only then, not on every busy turn).
    since: Option<Instant>,
    /// Turns without progress since the clock was last read: it is read every
    /// IDLE_CLOCK_TURNS of them, not on each (a clock read costs as much as a turn).
    turns: u32,
    /// Guest notifications are enabled (they are suppressed while polling).
    notify_on: bool,
}

struct Worker {
    /// Held while the worker exists (see [`WorkerHandle::stop`]).
    _alive: Arc<()>,
    epoll: Epoll,
    wake: EventFd,
    cmds: Arc<Mutex<VecDeque<Cmd>>>,
    pending: Arc<AtomicBool>,
    shared: Arc<DeviceShared>,
    mem: MemTable,
    /// The memory table of the last turn, with its generation: kept while the worker polls,
    /// dropped before it sleeps (so regions the frontend removed are unmapped while idle).
    cached: Option<(u64, Arc<GuestMem>)>,
    /// The generation of the snapshot this turn uses (see [`MemTable::replaced_since`]).
    generation: u64,
    queues: Vec<Active>,
    done: Vec<Completion>,
    /// Driven by an external runtime's step calls: never block, never sleep.
    external: bool,
    /// Exit was requested (external mode): finish once every queue has drained.
    exiting: bool,
    /// Wakes the worker when a request held back by QoS may go.
    timer: TimerFd,
}

impl Worker {
    /// The part of an iteration both modes share: apply pending commands, service every queue,
    /// hand back drained stops. `None` when the worker must exit, else the memory snapshot used
    /// (to keep in `cached` for the next turn) and whether any queue made progress.
    fn turn(&mut self) -> Option<((u64, Arc<GuestMem>), bool)> {
        // A plain load first: the swap's locked write would cost every polling turn.
        if self.pending.load(Ordering::Relaxed)
            && self.pending.swap(false, Ordering::Acquire)
            && !self.handle_cmds()
        {
            return None;
        }
        if self.shared.poison.is_poisoned() {
            self.fail_poisoned();
        }
        let before = self.cached.as_ref().map(|(_, m)| Arc::as_ptr(m));
        let snap = self.mem.refresh(self.cached.take());
        self.generation = snap.0;
        if before.is_some_and(|b| b != Arc::as_ptr(&snap.1)) {
            // A new table: a snapshot held for no request is not the current one any more.
            for q in &mut self.queues {
                q.held.release_idle();
            }
        }
        let mut progress = false;
        for i in 0..self.queues.len() {
            progress |= self.service(i, &snap.1);
        }
        self.finish_stops();
        Some((snap, progress))
    }

    /// The frontend's memory faulted (it shrank a memory file under us): stop taking requests
    /// and touching the rings of every queue; the server drops the frontend, which stops them.
    fn fail_poisoned(&mut self) {
        let addr = self.shared.poison.fault_addr();
        for q in self.queues.iter_mut().filter(|q| !q.broken) {
            error!(
                queue = q.ctx.index,
                fault_addr = format_args!("{addr:#x}"),
                "frontend memory became inaccessible (SIGBUS: the frontend shrank its guest \
                 memory or inflight file); queue stopped"
            );
            q.broken = true;
        }
    }

    /// One iteration under an external runtime.
    fn step(&mut self) -> crate::StepResult {
        let Some((snap, progress)) = self.turn() else {
            return crate::StepResult::Exited;
        };
        if self.exiting && self.queues.iter().all(|q| q.chan.in_flight() == 0) {
            for i in 0..self.queues.len() {
                self.reap(i, &snap.1);
                self.notify(i, &snap.1);
            }
            self.queues.clear();
            return crate::StepResult::Exited;
        }
        self.cached = Some(snap);
        if progress {
            crate::StepResult::Busy
        } else {
            crate::StepResult::Idle
        }
    }

    fn run(&mut self) {
        let mut events = vec![EpollEvent::default(); 64];
        let mut idle = Idle {
            since: None,
            turns: 0,
            notify_on: true,
        };
        loop {
            let Some((snap, progress)) = self.turn() else {
                return;
            };
            if !self.may_sleep(&snap.1, progress, &mut idle) {
                self.cached = Some(snap);
                continue;
            }
            drop(snap);
            for q in &mut self.queues {
                q.held.release_idle();
            }
            let n = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
                Err(e) => {
                    error!("epoll_wait: {e}");
                    return;
                }
            };
            for ev in &events[..n] {
                let t = ev.data();
                if t == WAKE_TOKEN {
                    let _ = self.wake.read();
                    continue;
                }
                if t == TIMER_TOKEN {
                    // Readable: the read does not block.
                    let _ = self.timer.wait();
                    continue;
                }
                let index = (t / 2) as u16;
                if let Some(q) = self.queues.iter_mut().find(|q| q.ctx.index == index) {
                    if t % 2 == 0 {
                        let _ = q.ctx.kick.read();
                    } else {
                        q.chan.clear_notify();
                    }
                }
            }
        }
    }

    /// After a turn of `run`: whether the worker should sleep in `epoll_wait` now (true), or
    /// poll again (false). Sleeping needs the poll window to have passed without progress and
    /// notifications to be re-armed with nothing new behind them; it arms the QoS timer when a
    /// request waits for its budget.
    fn may_sleep(&mut self, mem: &GuestMem, progress: bool, idle: &mut Idle) -> bool {
        let poll = self.shared.poll;
        if progress {
            idle.since = None;
            idle.turns = 0;
            if !poll.is_zero() && idle.notify_on {
                for q in &mut self.queues {
                    let _ = q.ctx.queue.disable_notification(mem);
                }
                idle.notify_on = false;
            }
            return false;
        }
        let must_spin = self
            .queues
            .iter()
            .any(|q| !q.has_notify && q.chan.in_flight() > 0);
        let idle_start = *idle.since.get_or_insert_with(Instant::now);
        // A queue held back by its rate limit has nothing to poll for until its budget
        // returns: sleep on the timer rather than spin, so a throttled device does not
        // take the CPU its limit left to others.
        let throttled = self.queues.iter().any(|q| q.retry_at.is_some());
        if must_spin {
            std::hint::spin_loop();
            return false;
        }
        if !poll.is_zero() && !throttled {
            idle.turns += 1;
            if idle.turns % IDLE_CLOCK_TURNS != 0 || idle_start.elapsed() < poll {
                std::hint::spin_loop();
                return false;
            }
        }
        // Re-arm notifications before sleeping (with EVENT_IDX this publishes avail_event,
        // without which the driver would stop kicking), then look once more for requests
        // that raced with it.
        idle.notify_on = true;
        let mut more = false;
        for q in &mut self.queues {
            if !q.broken {
                let waiting = q.ctx.queue.enable_notification(mem).unwrap_or(false);
                // New requests behind ones held back by QoS wait for the timer: they are
                // not taken before those go.
                more |= waiting && q.throttled.is_empty();
            }
        }
        if more {
            return false;
        }
        // A request waits for its QoS budget: sleep until it may go (or something else
        // happens). Armed only then, so an idle or unlimited device has no timer.
        if let Some(at) = self
            .queues
            .iter()
            .filter(|q| !q.broken)
            .filter_map(|q| q.retry_at)
            .min()
        {
            let now = Instant::now();
            if at <= now {
                return false;
            }
            if let Err(e) = self.timer.reset(at - now, None) {
                error!("timerfd: {e}");
                return false;
            }
        }
        true
    }

    /// Applies pending commands; false on exit.
    fn handle_cmds(&mut self) -> bool {
        loop {
            let cmd = match self.cmds.lock() {
                Ok(mut q) => q.pop_front(),
                Err(_) => return false,
            };
            let Some(cmd) = cmd else { return true };
            match cmd {
                Cmd::Exit if self.external => {
                    // Polled by a runtime: stop taking requests and finish (in `step`) once
                    // what is in flight has completed.
                    self.exiting = true;
                }
                Cmd::Exit => {
                    // Drain what is in flight so no request touches memory after we return.
                    for i in 0..self.queues.len() {
                        self.drain(i);
                    }
                    self.queues.clear();
                    return false;
                }
                Cmd::Start(ctx) => self.start(ctx),
                Cmd::Stop { index, reply } => {
                    match self.queues.iter_mut().find(|q| q.ctx.index == index) {
                        Some(q) => q.stopping = Some(reply),
                        None => {
                            let _ = reply.send(None);
                        }
                    }
                }
                Cmd::SetCall { index, call } => {
                    if let Some(q) = self.queues.iter_mut().find(|q| q.ctx.index == index) {
                        q.ctx.call = call;
                    }
                }
            }
        }
    }

    fn start(&mut self, ctx: Box<VringCtx>) {
        let size = usize::from(ctx.queue.size());
        let chan = match self.shared.dev.open_channel(size, self.shared.seg_max + 2) {
            Ok(c) => c,
            Err(e) => {
                error!(queue = ctx.index, "cannot open I/O channel: {e}");
                return;
            }
        };
        let index = ctx.index;
        let kick_fd = ctx.kick.as_raw_fd();
        if let Err(e) = self.epoll.ctl(
            ControlOperation::Add,
            kick_fd,
            EpollEvent::new(EventSet::IN, u64::from(index) * 2),
        ) {
            error!(queue = index, "epoll add kick: {e}");
            return;
        }
        let notify = chan.notify_fd();
        if let Some(fd) = notify {
            if let Err(e) = self.epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, u64::from(index) * 2 + 1),
            ) {
                error!(queue = index, "epoll add completion fd: {e}");
            }
        }
        let slots = (0..size)
            .map(|_| Slot {
                head: 0,
                req: None,
                next_range: 0,
                flush_after: false,
                status: Status::Ok,
                mem: None,
                segs: Vec::new(),
                iov: Vec::new(),
                ranges: Vec::new(),
            })
            .collect();
        let mut ctx = ctx;
        if self.external {
            // Polled continuously: the driver need not kick.
            let mem = self.mem.memory();
            let _ = ctx.queue.disable_notification(&*mem);
        }
        debug!(queue = index, size, "queue started");
        let signalled = ctx.queue.next_used();
        self.queues.push(Active {
            ctx,
            chan,
            slots,
            free: (0..size as u16).rev().collect(),
            stopping: None,
            broken: false,
            has_notify: notify.is_some(),
            throttled: VecDeque::new(),
            throttled_since: None,
            retry_at: None,
            signalled,
            rings: ring::Rings::default(),
            held: HeldSnapshots::default(),
        });
        // Requests may have been queued before the kick was registered.
        let _ = self.wake.write(1);
    }

    /// Waits for every in-flight request of queue `i`.
    fn drain(&mut self, i: usize) {
        let mem = self.mem.memory().into_inner();
        while self.queues[i].chan.in_flight() > 0 {
            self.reap(i, &mem);
            if self.queues[i].chan.in_flight() > 0 {
                let _ = self.queues[i].chan.wait(Some(Duration::from_millis(100)));
            }
        }
        self.reap(i, &mem);
        self.notify(i, &mem);
    }

    /// Hands back queues whose stop was requested once they have drained.
    fn finish_stops(&mut self) {
        let mut i = 0;
        while i < self.queues.len() {
            if self.queues[i].stopping.is_some() {
                if self.external {
                    let mem = self.mem.memory().into_inner();
                    self.reap(i, &mem);
                    if self.queues[i].chan.in_flight() > 0 {
                        i += 1;
                        continue;
                    }
                    self.notify(i, &mem);
                } else {
                    self.drain(i);
                }
                let q = self.queues.swap_remove(i);
                let _ = self.epoll.ctl(
                    ControlOperation::Delete,
                    q.ctx.kick.as_raw_fd(),
                    EpollEvent::default(),
                );
                if let Some(fd) = q.chan.notify_fd() {
                    let _ = self
                        .epoll
                        .ctl(ControlOperation::Delete, fd, EpollEvent::default());
                }
                debug!(queue = q.ctx.index, "queue stopped");
                if let Some(reply) = q.stopping {
                    let _ = reply.send(Some(q.ctx));
                }
            } else {
                i += 1;
            }
        }
    }

    /// Reaps completions and takes new requests of queue `i`; true if anything happened.
    fn service(&mut self, i: usize, mem: &Arc<GuestMem>) -> bool {
        let mut progress = self.reap(i, mem);
        // Tell the driver now, not after the new batch below has been taken and submitted:
        // it reaps and refills while the worker serves that batch.
        self.notify(i, mem);
        if !self.queues[i].broken && !self.queues[i].throttled.is_empty() {
            progress |= self.release_throttled(i, mem);
        }
        if !self.queues[i].broken
            && !self.exiting
            && self.queues[i].stopping.is_none()
            && self.queues[i].throttled.is_empty()
            && self.take(i, mem)
        {
            progress = true;
            // Devices that complete inline (RAM, page cache) are done by now: put their
            // completions in the used ring in the same batch, with one notification.
            self.reap(i, mem);
        }
        // Everything completed above (inline devices, refused requests) in one notification.
        self.notify(i, mem);
        progress
    }

    /// Dispatches the requests of queue `i` held back by QoS, in order, as far as the budget
    /// allows; all of them when the queue is stopping, the worker exiting, or the limits were
    /// lifted. True if any went.
    fn release_throttled(&mut self, i: usize, mem: &Arc<GuestMem>) -> bool {
        let shared = self.shared.clone();
        let bypass = self.exiting || self.queues[i].stopping.is_some() || !shared.qos.is_active();
        let mut released = false;
        let mut info: Option<katablk_bdev::DeviceInfo> = None;
        while let Some(&slot_idx) = self.queues[i].throttled.front() {
            let q = &mut self.queues[i];
            if !bypass {
                let dir = q.slots[usize::from(slot_idx)]
                    .req
                    .map_or(Dir::Other, |r| qos_dir(&r));
                if let Err(wait) = shared.qos.admit(dir) {
                    let now = Instant::now();
                    q.throttled_since.get_or_insert(now);
                    // Wake no more often than every QOS_MIN_NAP: the budget keeps
                    // accruing meanwhile, so a wake-up releases a batch, at the same rate.
                    // A retry already due sooner stays (turns in between, on kicks, must not
                    // push it out).
                    let next = now + wait.max(QOS_MIN_NAP);
                    q.retry_at = Some(
                        q.retry_at
                            .filter(|t| *t > now)
                            .map_or(next, |t| t.min(next)),
                    );
                    break;
                }
            }
            q.throttled.pop_front();
            q.retry_at = None;
            if let Some(t) = q.throttled_since.take() {
                shared.qos.record_wait(t.elapsed());
            }
            let info = info.get_or_insert_with(|| shared.dev.info()).clone();
            self.dispatch(i, slot_idx, mem, &info);
            released = true;
        }
        if released {
            if let Err(e) = self.queues[i].chan.commit() {
                error!(queue = self.queues[i].ctx.index, "commit: {e}");
            }
        }
        released
    }

    fn notify(&mut self, i: usize, mem: &Arc<GuestMem>) {
        let q = &mut self.queues[i];
        if q.broken {
            return;
        }
        let used = q.ctx.queue.next_used();
        let since = std::mem::replace(&mut q.signalled, used);
        if since == used {
            // Nothing new in the used ring (most steps of a polling worker): no ring view.
            return;
        }
        if q.rings
            .view(mem, &q.ctx.queue)
            .needs_notification(&q.ctx.queue, since)
        {
            if let Some(call) = &q.ctx.call {
                let _ = call.write(1);
            }
        }
    }

    /// Takes new requests from the available ring while slots are free.
    fn take(&mut self, i: usize, mem: &Arc<GuestMem>) -> bool {
        let mut took = false;
        let mut taken = 0usize;
        let mut bytes = 0u64;
        // The device's properties once per batch, not per request, and not at all when the
        // ring is empty (a polling worker looks many times between requests).
        let mut info: Option<katablk_bdev::DeviceInfo> = None;
        // The available index seen; a wild one stops the queue once (`stop_if_wild`), here
        // and when it is read again below.
        let mut avail = {
            let q = &mut self.queues[i];
            // An unreadable ring counts as empty (resubmitted chains are still taken).
            let avail = q
                .rings
                .view(mem, &q.ctx.queue)
                .avail_idx(&q.ctx.queue)
                .unwrap_or(q.ctx.queue.next_avail());
            let ahead = avail.wrapping_sub(q.ctx.queue.next_avail());
            if ahead == 0 && q.ctx.resubmit.is_empty() {
                // Nothing new: the common case of a polling worker, answered with one load.
                return false;
            }
            if q.stop_if_wild(avail) {
                return false;
            }
            if self.mem.replaced_since(self.generation) {
                // These chains may use regions added after this turn's snapshot: take them
                // at the next turn, with the new table (progress: the worker turns again).
                if q.ctx.resubmit.is_empty() {
                    return true;
                }
                q.ctx.queue.next_avail()
            } else {
                avail
            }
        };
        self.prefetch_batch(i, mem, avail);
        loop {
            if self.shared.poison.is_poisoned() {
                break;
            }
            let q = &mut self.queues[i];
            let Some(&slot_idx) = q.free.last() else {
                break;
            };
            let rings = q.rings.view(mem, &q.ctx.queue);
            let head = if let Some(h) = q.ctx.resubmit.pop_front() {
                h
            } else {
                if q.ctx.queue.next_avail() == avail {
                    // The batch seen is taken: look once more for chains added meanwhile.
                    match rings.avail_idx(&q.ctx.queue) {
                        Some(a) if a != avail => {
                            if q.stop_if_wild(a) || self.mem.replaced_since(self.generation) {
                                break;
                            }
                            avail = a;
                        }
                        _ => break,
                    }
                }
                match rings.pop_head(&mut q.ctx.queue) {
                    Some(h) => {
                        // The counter resumes from the inflight region, which the frontend
                        // writes: it may be anything, up to u64::MAX.
                        q.ctx.counter = q.ctx.counter.wrapping_add(1);
                        if let Some(inf) = &q.ctx.inflight {
                            inf.begin(h, q.ctx.counter);
                        }
                        h
                    }
                    None => break,
                }
            };
            q.free.pop();
            took = true;
            let table = rings.desc_table(&q.ctx.queue);
            let slot = &mut q.slots[usize::from(slot_idx)];
            slot.head = head;
            slot.next_range = 0;
            slot.flush_after = false;
            slot.status = Status::Ok;
            slot.req = None;
            let key = q.held.hold(mem);
            let slot = &mut q.slots[usize::from(slot_idx)];
            slot.mem = Some(key);
            let walked = chain::walk_table(table, head, &mut slot.segs, self.shared.seg_max + 2);
            if let Err(e) = walked {
                debug!(queue = q.ctx.index, head, "bad descriptor chain: {e}");
                self.shared
                    .stats
                    .bad_requests
                    .fetch_add(1, Ordering::Relaxed);
                slot.status = Status::IoErr;
                self.complete(i, slot_idx, mem);
                continue;
            }
            match request::parse(
                mem,
                &slot.segs,
                &mut slot.iov,
                &mut slot.ranges,
                self.shared.seg_max + 2,
            ) {
                Ok(req) => {
                    slot.req = Some(req);
                    if self.shared.qos.is_active() {
                        // Admitted in ring order: the first that must wait holds the rest.
                        q.throttled.push_back(slot_idx);
                        self.release_throttled(i, mem);
                        if !self.queues[i].throttled.is_empty() {
                            break;
                        }
                        continue;
                    }
                    bytes += req.data_len;
                    let info = info.get_or_insert_with(|| self.shared.dev.info());
                    self.dispatch(i, slot_idx, mem, info);
                    taken += 1;
                    if taken >= EARLY_COMPLETION_BATCH
                        || (!self.external && bytes >= EARLY_COMPLETION_BYTES)
                    {
                        if self.external {
                            // Under an external runtime the device completes in the
                            // runtime's own pollers, which run between steps: end the batch
                            // here, so these complete (and reach the driver) while the rest
                            // waits for the next step, instead of the whole ring at once.
                            break;
                        }
                        self.publish_early(i, mem);
                        self.prefetch_batch(i, mem, avail);
                        taken = 0;
                        bytes = 0;
                    }
                }
                Err(e) => {
                    debug!(queue = q.ctx.index, head, "bad request: {e}");
                    self.shared
                        .stats
                        .bad_requests
                        .fetch_add(1, Ordering::Relaxed);
                    slot.status = e.status();
                    self.complete(i, slot_idx, mem);
                }
            }
        }
        if took {
            if let Err(e) = self.queues[i].chan.commit() {
                error!(queue = self.queues[i].ctx.index, "commit: {e}");
            }
        }
        took
    }

    /// Starts loading the descriptors, then the first buffers (headers), of the next chains up
    /// to `avail` (at most a batch, and no more than free slots): the driver wrote them on
    /// another core, so each is a cache miss, which taken one chain at a time would cost a
    /// round trip to the other core's cache per descriptor and per header. A hint only: the
    /// chains are read and checked as before when they are taken.
    fn prefetch_batch(&mut self, i: usize, mem: &Arc<GuestMem>, avail: u16) {
        let q = &mut self.queues[i];
        if !q.ctx.resubmit.is_empty() {
            return;
        }
        let n = usize::from(avail.wrapping_sub(q.ctx.queue.next_avail()))
            .min(q.free.len())
            .min(EARLY_COMPLETION_BATCH) as u16;
        if n < 2 {
            // One chain: nothing to overlap its misses with.
            return;
        }
        let rings = q.rings.view(mem, &q.ctx.queue);
        let table = rings.desc_table(&q.ctx.queue);
        for k in 0..n {
            if let Some(h) = rings.peek_head(&q.ctx.queue, k) {
                table.prefetch(h);
            }
        }
        for k in 0..n {
            if let Some(h) = rings.peek_head(&q.ctx.queue, k) {
                table.prefetch_first_buffer(h);
            }
        }
    }

    /// In the middle of a long batch: submits what was taken so far, puts what has completed
    /// in the used ring and notifies the driver, so that it reaps and submits again while the
    /// rest of the batch is served. Without this, a driver that submits a whole queue depth
    /// at once and sleeps until completions arrive would wait for the whole batch, then the
    /// worker for the driver: the two would take turns instead of working at the same time.
    fn publish_early(&mut self, i: usize, mem: &Arc<GuestMem>) {
        if let Err(e) = self.queues[i].chan.commit() {
            error!(queue = self.queues[i].ctx.index, "commit: {e}");
        }
        if self.reap(i, mem) {
            self.notify(i, mem);
        }
    }

    /// Starts (or continues) the device work of a parsed request.
    fn dispatch(
        &mut self,
        i: usize,
        slot_idx: u16,
        mem: &Arc<GuestMem>,
        info: &katablk_bdev::DeviceInfo,
    ) {
        let shared = &self.shared;
        let q = &mut self.queues[i];
        let slot = &mut q.slots[usize::from(slot_idx)];
        let Some(req) = slot.req else {
            return;
        };
        let read_only = shared.read_only || info.read_only;
        let bs = u64::from(info.block_size);
        let size = info.size_bytes();
        let token = u64::from(slot_idx);
        let check = |sector: u64, len: u64| -> Option<u64> {
            let off = sector.checked_mul(SECTOR_SIZE)?;
            let end = off.checked_add(len)?;
            (off % bs == 0 && len % bs == 0 && end <= size).then_some(off)
        };
        let result: Result<bool, Status> = match req.kind {
            Kind::GetId => {
                if request::write_id(mem, &slot.segs, &shared.serial).is_ok() {
                    Ok(false)
                } else {
                    Err(Status::IoErr)
                }
            }
            Kind::In | Kind::Out => {
                if req.kind == Kind::Out && read_only {
                    Err(Status::IoErr)
                } else if let Some(off) = check(req.sector, req.data_len) {
                    if req.data_len == 0 {
                        Ok(false)
                    } else {
                        let op = if req.kind == Kind::In {
                            IoOp::Read
                        } else {
                            slot.flush_after = !shared.writeback.load(Ordering::Relaxed);
                            IoOp::Write
                        };
                        let r = IoRequest {
                            op,
                            offset: off,
                            len: req.data_len,
                            iov: &slot.iov,
                            token,
                        };
                        // SAFETY: the iovecs point into guest memory kept mapped by `slot.mem`
                        // until the completion is reaped; the device owns the buffers until then
                        // (the worker does not touch them).
                        submit(&mut *q.chan, &r)
                    }
                } else {
                    debug!(
                        queue = q.ctx.index,
                        sector = req.sector,
                        len = req.data_len,
                        "request out of range"
                    );
                    Err(Status::IoErr)
                }
            }
            Kind::Flush => submit(&mut *q.chan, &IoRequest::no_data(IoOp::Flush, 0, 0, token)),
            Kind::Discard | Kind::WriteZeroes => {
                if read_only {
                    Err(Status::IoErr)
                } else {
                    match slot.ranges.get(slot.next_range).copied() {
                        None => Ok(false),
                        Some(r) => {
                            slot.next_range += 1;
                            let len = u64::from(r.num_sectors) * SECTOR_SIZE;
                            match check(r.sector, len) {
                                None => Err(Status::IoErr),
                                Some(_) if len == 0 => Ok(false),
                                Some(off) => {
                                    let op = if req.kind == Kind::Discard {
                                        IoOp::Discard
                                    } else {
                                        IoOp::WriteZeroes { unmap: r.unmap }
                                    };
                                    match submit(
                                        &mut *q.chan,
                                        &IoRequest::no_data(op, off, len, token),
                                    ) {
                                        // Discard is a hint: a device without it succeeds.
                                        Err(Status::Unsupp) if req.kind == Kind::Discard => {
                                            Ok(false)
                                        }
                                        other => other,
                                    }
                                }
                            }
                        }
                    }
                }
            }
        };
        match result {
            Ok(true) => {}
            Ok(false) => {
                if slot.next_range < slot.ranges.len() {
                    // Zero-length range done inline; continue with the next one.
                    self.dispatch(i, slot_idx, mem, &self.shared.dev.info());
                } else {
                    self.complete(i, slot_idx, mem);
                }
            }
            Err(s) => {
                slot.status = s;
                self.complete(i, slot_idx, mem);
            }
        }
    }

    /// Reaps finished device requests of queue `i`.
    fn reap(&mut self, i: usize, mem: &Arc<GuestMem>) -> bool {
        self.done.clear();
        let mut done = std::mem::take(&mut self.done);
        let n = self.queues[i].chan.poll(&mut done);
        let mut tally = Tally::default();
        for c in &done {
            let slot_idx = c.token as u16;
            let q = &mut self.queues[i];
            let Some(slot) = q.slots.get_mut(usize::from(slot_idx)) else {
                continue;
            };
            let Some(req) = slot.req else { continue };
            match c.result {
                Err(e) => {
                    warn!(queue = q.ctx.index, sector = req.sector, kind = ?req.kind, "I/O error: {e}");
                    self.shared.stats.io_errors.fetch_add(1, Ordering::Relaxed);
                    slot.status = Status::IoErr;
                    self.complete(i, slot_idx, mem);
                }
                Ok(_) => {
                    if slot.flush_after {
                        slot.flush_after = false;
                        let r = IoRequest::no_data(IoOp::Flush, 0, 0, c.token);
                        if let Err(s) = submit(&mut *q.chan, &r) {
                            slot.status = s;
                            self.complete(i, slot_idx, mem);
                        } else {
                            let _ = q.chan.commit();
                        }
                    } else if slot.next_range < slot.ranges.len() {
                        self.dispatch(i, slot_idx, mem, &self.shared.dev.info());
                        let _ = self.queues[i].chan.commit();
                    } else {
                        tally.add(&req);
                        self.complete(i, slot_idx, mem);
                    }
                }
            }
        }
        self.done = done;
        tally.publish(&self.shared.stats);
        n > 0
    }

    /// Writes the status, puts the head in the used ring and frees the slot.
    fn complete(&mut self, i: usize, slot_idx: u16, mem: &Arc<GuestMem>) {
        let q = &mut self.queues[i];
        let slot = &mut q.slots[usize::from(slot_idx)];
        let used_len = match (slot.status, slot.req) {
            (Status::Ok, Some(r)) => r.used_len,
            _ => 1,
        };
        let status = slot
            .req
            .map(|r| r.status)
            .or_else(|| request::status_addr(&slot.segs));
        let used_len = match status {
            Some(addr) => {
                if !request::write_status(mem, addr, slot.status) {
                    debug!(queue = q.ctx.index, "status byte not writable");
                }
                used_len
            }
            None => 0,
        };
        let head = slot.head;
        let held = slot.mem.take();
        slot.req = None;
        if let Some(key) = held {
            q.held.release(key, mem);
        }
        if let Some(inf) = &q.ctx.inflight {
            inf.pre_put(head);
        }
        let rings = q.rings.view(mem, &q.ctx.queue);
        if let Err(e) = rings.add_used(&mut q.ctx.queue, head, used_len) {
            error!(
                queue = q.ctx.index,
                "cannot add to used ring: {}; queue stopped", e.0
            );
            q.broken = true;
        }
        if let Some(inf) = &q.ctx.inflight {
            inf.post_put(head, q.ctx.queue.next_used());
        }
        q.free.push(slot_idx);
    }
}

/// The I/O counters of one batch of completions, added to the device's shared counters once
/// per batch rather than with two atomic additions per request.
#[derive(Default)]
struct Tally {
    read_ops: u64,
    read_bytes: u64,
    write_ops: u64,
    write_bytes: u64,
    flush_ops: u64,
    unmap_ops: u64,
}

impl Tally {
    fn add(&mut self, req: &Request) {
        match req.kind {
            Kind::In => {
                self.read_ops += 1;
                self.read_bytes += req.data_len;
            }
            Kind::Out => {
                self.write_ops += 1;
                self.write_bytes += req.data_len;
            }
            Kind::Flush => self.flush_ops += 1,
            Kind::Discard | Kind::WriteZeroes => self.unmap_ops += 1,
            Kind::GetId => {}
        }
    }

    fn publish(&self, s: &crate::Stats) {
        let add = |a: &AtomicU64, n: u64| {
            if n > 0 {
                a.fetch_add(n, Ordering::Relaxed);
            }
        };
        add(&s.read_ops, self.read_ops);
        add(&s.read_bytes, self.read_bytes);
        add(&s.write_ops, self.write_ops);
        add(&s.write_bytes, self.write_bytes);
        add(&s.flush_ops, self.flush_ops);
        add(&s.unmap_ops, self.unmap_ops);
    }
}

/// What a request costs in the QoS budget: its data bytes for reads and writes, one I/O for
/// everything.
fn qos_dir(r: &Request) -> Dir {
    match r.kind {
        Kind::In => Dir::Read(r.data_len),
        Kind::Out => Dir::Write(r.data_len),
        _ => Dir::Other,
    }
}

/// Submits one request, mapping refusals to a virtio status; Ok(true) when queued.
fn submit(chan: &mut dyn IoChannel, r: &IoRequest<'_>) -> Result<bool, Status> {
    // SAFETY: callers pass buffers that stay valid until the completion is reaped (see
    // `Worker::dispatch`); requests without buffers carry no pointers.
    match unsafe { chan.submit(r) } {
        Ok(()) => Ok(true),
        Err(SubmitError::Unsupported) => Err(Status::Unsupp),
        Err(e) => {
            debug!("request refused by device: {e}");
            Err(Status::IoErr)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use katablk_bdev::malloc::MallocDevice;
    use virtio_bindings::virtio_blk::*;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress};

    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;

    fn d(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
        RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
    }

    fn worker(mem: &MemTable, read_only: bool) -> Worker {
        let shared = Arc::new(DeviceShared {
            dev: Arc::new(MallocDevice::new(2048, 512).unwrap()),
            serial: "mock-serial".into(),
            read_only,
            writeback: AtomicBool::new(true),
            poll: Duration::ZERO,
            seg_max: 62,
            stats: Default::default(),
            poison: Poison::new().unwrap(),
            qos: Limiter::new(),
        });
        Worker {
            _alive: Arc::new(()),
            epoll: Epoll::new().unwrap(),
            wake: EventFd::new(EFD_NONBLOCK).unwrap(),
            cmds: Default::default(),
            pending: Default::default(),
            shared,
            mem: mem.clone(),
            cached: None,
            generation: 0,
            queues: Vec::new(),
            done: Vec::new(),
            external: false,
            exiting: false,
            timer: TimerFd::new().unwrap(),
        }
    }

    /// Queue 0 over `queue`, with a fresh kick eventfd and `call`.
    fn vring(queue: Queue, call: Option<EventFd>) -> Box<VringCtx> {
        Box::new(VringCtx {
            index: 0,
            queue,
            kick: EventFd::new(EFD_NONBLOCK).unwrap(),
            call,
            inflight: None,
            resubmit: VecDeque::new(),
            counter: 0,
        })
    }

    fn header(m: &GuestMem, at: u64, ty: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&ty.to_le_bytes());
        h[8..].copy_from_slice(&sector.to_le_bytes());
        m.write_slice(&h, GuestAddress(at)).unwrap();
    }

    /// `n` read chains of `len` bytes each (request `r` reads sector `r`): header at
    /// 0x10_0000 + r * 4 KiB, data from 0x20_0000, status byte at 0x80_0000 + r.
    fn reads(m: &GuestMem, n: u64, len: u32) -> Vec<RawDescriptor> {
        let stride = u64::from(len).max(0x1000);
        let mut descs = Vec::new();
        for r in 0..n {
            let at = 0x10_0000 + r * 0x1000;
            header(m, at, VIRTIO_BLK_T_IN, r);
            let i = (r * 3) as u16;
            descs.push(d(at, 16, F_NEXT, i + 1));
            descs.push(d(0x20_0000 + r * stride, len, F_NEXT | F_WRITE, i + 2));
            descs.push(d(0x80_0000 + r, 1, F_WRITE, 0));
        }
        descs
    }

    /// Requests in a mock queue are served against a RAM device: the status bytes and used ring
    /// entries written back into guest memory are checked, and a malformed chain gets IOERR
    /// without stopping the queue.
    /// A worker's cached table is used until the backend replaces it, then the new one.
    #[test]
    fn requests_hold_their_snapshot_until_the_last_one_completes() {
        let gm = || Arc::new(GuestMem::from_ranges(&[(GuestAddress(0), 0x1000)]).unwrap());
        let (old, new) = (gm(), gm());
        let mut held = HeldSnapshots::default();
        let a = held.hold(&old);
        let b = held.hold(&old);
        assert_eq!(
            Arc::strong_count(&old),
            2,
            "one reference for both requests"
        );
        // The table is replaced while both are in flight: a third request uses the new one.
        let c = held.hold(&new);
        held.release(a, &new);
        assert_eq!(Arc::strong_count(&old), 2, "kept while a request needs it");
        held.release(b, &new);
        assert_eq!(Arc::strong_count(&old), 1, "let go after its last request");
        // The current snapshot stays held between requests, until the worker sleeps.
        held.release(c, &new);
        assert_eq!(Arc::strong_count(&new), 2);
        held.release_idle();
        assert_eq!(Arc::strong_count(&new), 1);
    }

    #[test]
    fn a_cached_table_is_replaced_at_the_next_turn() {
        let gm = GuestMem::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let table = MemTable::new(gm);
        let first = table.refresh(None);
        let again = table.refresh(Some((first.0, first.1.clone())));
        assert!(Arc::ptr_eq(&first.1, &again.1));
        let bigger = GuestMem::from_ranges(&[(GuestAddress(0), 0x20_0000)]).unwrap();
        table.replace(bigger).unwrap();
        let after = table.refresh(Some(again));
        assert!(!Arc::ptr_eq(&first.1, &after.1));
        assert_ne!(after.0, first.0);
        assert_eq!(vm_memory::GuestMemoryBackend::num_regions(&*after.1), 1);
        assert!(crate::host_range(&after.1, 0x1f_f000, 4096).is_some());
        // The old snapshot, held by a request in flight, still maps its region.
        assert!(crate::host_range(&first.1, 0xf_f000, 4096).is_some());
    }

    /// A region the backend added (and acknowledged) after a worker's turn began is used by
    /// the next chain the driver makes available (libblkio adds its buffers after starting
    /// the queue): the worker takes that chain with the new table, not the turn's snapshot,
    /// which would fail it with IOERR as "not in guest memory".
    #[test]
    fn chains_after_a_table_change_wait_for_the_new_table() {
        let gm = GuestMem::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let mem = MemTable::new(gm);
        let old = mem.memory().into_inner();
        let m = &*old;
        let mq = MockSplitQueue::new(m, 16);
        let queue: Queue = mq.create_queue().unwrap();
        let mut w = worker(&mem, false);
        w.start(vring(queue, None));
        // The turn's snapshot is taken: one region.
        let (snap, _) = w.turn().unwrap();
        assert!(Arc::ptr_eq(&snap.1, &old));
        // The backend adds a region at 1 MiB; the driver puts a read into it.
        let buf = vm_memory::GuestRegionMmap::from_range(GuestAddress(0x10_0000), 0x1_0000, None)
            .unwrap();
        mem.replace(old.insert_region(Arc::new(buf)).unwrap())
            .unwrap();
        header(m, 0x1000, VIRTIO_BLK_T_IN, 0);
        let chain = [
            d(0x1000, 16, F_NEXT, 1),
            d(0x10_0000, 4096, F_NEXT | F_WRITE, 2),
            d(0x2000, 1, F_WRITE, 0),
        ];
        mq.add_desc_chains(&chain, 0).unwrap();
        m.write_obj::<u8>(0xff, GuestAddress(0x2000)).unwrap();
        // The rest of the same turn sees the chain: it waits for the next turn.
        assert!(w.service(0, &snap.1), "the worker must turn again");
        assert_eq!(mq.used().idx().load(), 0);
        w.cached = Some(snap);
        w.turn().unwrap();
        assert_eq!(mq.used().idx().load(), 1);
        let st = m.read_obj::<u8>(GuestAddress(0x2000)).unwrap();
        assert_eq!(st, VIRTIO_BLK_S_OK as u8);
    }

    /// Under an external runtime a step takes at most EARLY_COMPLETION_BATCH requests, and
    /// each step that put chains in the used ring signals once; a step with nothing new
    /// does not signal.
    #[test]
    fn external_steps_take_a_batch_and_signal_only_new_completions() {
        let gm = GuestMem::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap();
        let mem = MemTable::new(gm);
        let snap = mem.memory().into_inner();
        let m = &*snap;
        let mq = MockSplitQueue::new(m, 64);
        let n = EARLY_COMPLETION_BATCH as u64 * 2 + 3;
        mq.add_desc_chains(&reads(m, n, 512), 0).unwrap();
        let queue: Queue = mq.create_queue().unwrap();
        let call = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut w = worker(&mem, false);
        w.external = true;
        w.start(vring(queue, Some(call.try_clone().unwrap())));
        let batch = EARLY_COMPLETION_BATCH as u16;
        for want in [batch, 2 * batch, n as u16] {
            assert!(w.service(0, &snap));
            assert_eq!(mq.used().idx().load(), want);
            assert_eq!(call.read().unwrap(), 1, "one signal per step");
        }
        assert!(!w.service(0, &snap));
        assert!(call.read().is_err(), "no signal without new completions");
        for r in 0..n {
            let st = m.read_obj::<u8>(GuestAddress(0x80_0000 + r)).unwrap();
            assert_eq!(st, VIRTIO_BLK_S_OK as u8);
        }
    }

    /// A step tells its runtime whether it did anything: busy while it takes or completes
    /// requests, idle on an empty ring, exited once it has finished.
    #[test]
    fn external_steps_report_busy_idle_and_exit() {
        let gm = GuestMem::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap();
        let mem = MemTable::new(gm);
        let snap = mem.memory().into_inner();
        let m = &*snap;
        let mq = MockSplitQueue::new(m, 64);
        mq.add_desc_chains(&reads(m, 3, 512), 0).unwrap();
        let queue: Queue = mq.create_queue().unwrap();
        let mut w = worker(&mem, false);
        w.external = true;
        w.start(vring(queue, None));
        assert_eq!(w.step(), crate::StepResult::Busy);
        assert_eq!(mq.used().idx().load(), 3);
        assert_eq!(w.step(), crate::StepResult::Idle);
        w.exiting = true;
        assert_eq!(w.step(), crate::StepResult::Exited);
    }

    /// Under an external runtime the batch is not cut by bytes: eight 64 KiB reads (twice
    /// EARLY_COMPLETION_BYTES) go in one step, as eight 512-byte ones do.
    #[test]
    fn external_steps_are_not_cut_by_bytes() {
        let gm = GuestMem::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap();
        let mem = MemTable::new(gm);
        let snap = mem.memory().into_inner();
        let m = &*snap;
        let mq = MockSplitQueue::new(m, 64);
        let n = EARLY_COMPLETION_BATCH as u64 + 2;
        let len = 64u32 << 10;
        assert!(EARLY_COMPLETION_BATCH as u64 * u64::from(len) > EARLY_COMPLETION_BYTES);
        mq.add_desc_chains(&reads(m, n, len), 0).unwrap();
        let queue: Queue = mq.create_queue().unwrap();
        let mut w = worker(&mem, false);
        w.external = true;
        w.start(vring(queue, None));
        assert!(w.service(0, &snap));
        assert_eq!(mq.used().idx().load(), EARLY_COMPLETION_BATCH as u16);
        assert!(w.service(0, &snap));
        assert_eq!(mq.used().idx().load(), n as u16);
    }

    /// A worker whose thread has ended (it exited, or panicked) does not hang the backend's
    /// stop of one of its queues.
    #[test]
    fn stopping_a_queue_of_an_ended_worker_returns() {
        let gm = GuestMem::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let mem = MemTable::new(gm);
        let shared = worker(&mem, false).shared;
        let h = WorkerHandle::spawn(0, shared, mem, None, None).unwrap();
        h.send(Cmd::Exit);
        let t0 = Instant::now();
        while h.alive.strong_count() > 0 {
            assert!(t0.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(h.stop(0).is_none());
    }

    #[test]
    fn a_wild_available_index_stops_the_queue_once() {
        let gm = GuestMem::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap();
        let mem = MemTable::new(gm);
        let snap = mem.memory().into_inner();
        let mq = MockSplitQueue::new(&*snap, 16);
        mq.avail().idx().store(u16::to_le(40));
        let queue: Queue = mq.create_queue().unwrap();
        let mut w = worker(&mem, false);
        w.start(vring(queue, Some(EventFd::new(EFD_NONBLOCK).unwrap())));
        assert!(!w.service(0, &snap));
        assert!(w.queues[0].broken);
        // Not looked at again.
        assert!(!w.service(0, &snap));
        assert_eq!(mq.used().idx().load(), 0);
    }

    #[test]
    fn worker_serves_mock_queue() {
        let gm = GuestMem::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap();
        let mem = MemTable::new(gm);
        let snap = mem.memory().into_inner();
        let m = &*snap;
        let mq = MockSplitQueue::new(m, 16);
        // Chain 0: write 1024 bytes at sector 4. Chain 1: read them back. Chain 2: bad (no
        // status). Chain 3: GET_ID. Chain 4: unknown type. Chain 5: write beyond the end.
        header(m, 0x10_0000, VIRTIO_BLK_T_OUT, 4);
        m.write_slice(&[0xabu8; 1024], GuestAddress(0x20_0000))
            .unwrap();
        header(m, 0x11_0000, VIRTIO_BLK_T_IN, 4);
        header(m, 0x12_0000, VIRTIO_BLK_T_IN, 0);
        header(m, 0x13_0000, VIRTIO_BLK_T_GET_ID, 0);
        header(m, 0x14_0000, 99, 0);
        header(m, 0x15_0000, VIRTIO_BLK_T_OUT, 2047);
        let descs = [
            d(0x10_0000, 16, F_NEXT, 1),
            d(0x20_0000, 1024, F_NEXT, 2),
            d(0x30_0000, 1, F_WRITE, 0),
            d(0x11_0000, 16, F_NEXT, 4),
            d(0x21_0000, 1024, F_NEXT | F_WRITE, 5),
            d(0x31_0000, 1, F_WRITE, 0),
            d(0x12_0000, 16, 0, 0),
            d(0x13_0000, 16, F_NEXT, 8),
            d(0x23_0000, 20, F_NEXT | F_WRITE, 9),
            d(0x33_0000, 1, F_WRITE, 0),
            d(0x14_0000, 16, F_NEXT, 11),
            d(0x34_0000, 1, F_WRITE, 0),
            d(0x15_0000, 16, F_NEXT, 13),
            d(0x25_0000, 1024, F_NEXT, 14),
            d(0x35_0000, 1, F_WRITE, 0),
        ];
        mq.add_desc_chains(&descs, 0).unwrap();
        let queue: Queue = mq.create_queue().unwrap();
        let mut w = worker(&mem, false);
        w.start(vring(queue, Some(EventFd::new(EFD_NONBLOCK).unwrap())));
        assert!(w.service(0, &snap));
        let status = |a: u64| m.read_obj::<u8>(GuestAddress(a)).unwrap();
        assert_eq!(status(0x30_0000), VIRTIO_BLK_S_OK as u8);
        assert_eq!(status(0x31_0000), VIRTIO_BLK_S_OK as u8);
        let mut back = [0u8; 1024];
        m.read_slice(&mut back, GuestAddress(0x21_0000)).unwrap();
        assert_eq!(back, [0xab; 1024]);
        assert_eq!(status(0x33_0000), VIRTIO_BLK_S_OK as u8);
        let mut id = [0u8; 20];
        m.read_slice(&mut id, GuestAddress(0x23_0000)).unwrap();
        assert_eq!(&id[..11], b"mock-serial");
        assert_eq!(status(0x34_0000), VIRTIO_BLK_S_UNSUPP as u8);
        assert_eq!(status(0x35_0000), VIRTIO_BLK_S_IOERR as u8);
        // Used ring: six entries, in order, with the lengths written.
        assert_eq!(mq.used().idx().load(), 6);
        let used: Vec<(u32, u32)> = (0..6)
            .map(|i| {
                let e = mq.used().ring().ref_at(i).unwrap().load();
                (e.id(), e.len())
            })
            .collect();
        assert_eq!(
            used,
            vec![(6, 0), (7, 21), (10, 1), (12, 1), (0, 1), (3, 1025)]
        );
        let s = w.shared.stats.snapshot();
        assert_eq!((s.read_ops, s.write_ops, s.bad_requests), (1, 1, 2));
        // The call eventfd was signalled.
        assert!(w.queues[0].ctx.call.as_ref().unwrap().read().unwrap() > 0);
    }

    #[test]
    fn read_only_worker_rejects_writes() {
        let gm = GuestMem::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap();
        let mem = MemTable::new(gm);
        let snap = mem.memory().into_inner();
        let m = &*snap;
        let mq = MockSplitQueue::new(m, 16);
        header(m, 0x10_0000, VIRTIO_BLK_T_OUT, 0);
        let descs = [
            d(0x10_0000, 16, F_NEXT, 1),
            d(0x20_0000, 512, F_NEXT, 2),
            d(0x30_0000, 1, F_WRITE, 0),
        ];
        mq.add_desc_chains(&descs, 0).unwrap();
        let mut w = worker(&mem, true);
        w.start(vring(mq.create_queue().unwrap(), None));
        w.service(0, &snap);
        assert_eq!(
            m.read_obj::<u8>(GuestAddress(0x30_0000)).unwrap(),
            VIRTIO_BLK_S_IOERR as u8
        );
    }
}
