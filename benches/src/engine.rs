//! The load generator: connects to a vhost-user-blk server with libblkio, runs one job
//! (thread) per virtqueue and measures throughput, latency and CPU use.

use crate::cpu::{CpuSampler, CpuUsage};
use crate::pattern::{check_pattern, fill_pattern, mix64, OffsetGen, Rng};
use crate::report::{
    BenchReport, DeviceInfo, JobReport, Params, ReportKind, Timeline, TimelineSample,
    REPORT_VERSION,
};
use crate::stats::{new_histogram, IoStats};
use anyhow::{bail, Context, Result};
use blkio::{Blkio, Blkioq, Completion, Errno, MemoryRegion, ReqFlags};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::mem::MaybeUninit;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The I/O pattern of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// Random reads.
    Randread,
    /// Random writes.
    Randwrite,
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Random mixed reads and writes (`--rwmixread` percent reads).
    Randrw,
}

impl Workload {
    /// The fio name of the workload.
    pub fn name(self) -> &'static str {
        match self {
            Self::Randread => "randread",
            Self::Randwrite => "randwrite",
            Self::Read => "read",
            Self::Write => "write",
            Self::Randrw => "randrw",
        }
    }

    /// Whether offsets are random (otherwise sequential).
    pub fn is_random(self) -> bool {
        matches!(self, Self::Randread | Self::Randwrite | Self::Randrw)
    }

    /// Percentage of reads given `--rwmixread`.
    pub fn read_percent(self, rwmixread: u8) -> u8 {
        match self {
            Self::Randread | Self::Read => 100,
            Self::Randwrite | Self::Write => 0,
            Self::Randrw => rwmixread.min(100),
        }
    }
}

/// How a job waits for completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PollMode {
    /// Spin on the used ring (`do_io` with `min_completions` = 0): lowest latency, one core
    /// per job.
    Busy,
    /// Sleep on the queue's completion eventfd (`do_io` with `min_completions` = 1).
    Event,
}

impl PollMode {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Busy => "busy",
            Self::Event => "event",
        }
    }
}

/// Everything a run needs; built from the command line by [`crate::cli`].
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// vhost-user socket.
    pub socket: PathBuf,
    /// I/O pattern.
    pub workload: Workload,
    /// Percentage of reads for `randrw`.
    pub rwmixread: u8,
    /// Block size in bytes.
    pub bs: u64,
    /// I/Os in flight per job.
    pub iodepth: u32,
    /// Jobs, one thread and one virtqueue each.
    pub numjobs: u32,
    /// Measured time.
    pub runtime: Duration,
    /// Warm-up before measuring.
    pub ramp: Duration,
    /// Bytes of the device to use; `None`: all of it.
    pub size: Option<u64>,
    /// Virtqueue size.
    pub queue_size: u32,
    /// How completions are waited for.
    pub poll: PollMode,
    /// I/O buffers at 2 MiB-aligned addresses and sizes.
    pub align_2m: bool,
    /// Write patterns and read them back.
    pub verify: bool,
    /// Seed of the offset generators.
    pub seed: u64,
    /// Free-text label.
    pub label: Option<String>,
    /// Key/value tags for the summary tool.
    pub meta: BTreeMap<String, String>,
    /// Server process to sample CPU use of.
    pub server_pid: Option<u32>,
    /// Show a progress bar (only drawn on a terminal).
    pub progress: bool,
    /// Instead of I/O, stay connected and idle for this long (CPU measurement).
    pub idle: Option<Duration>,
    /// Split requests into segments of at most this many bytes (also done when the device's
    /// max-segment-len requires it).
    pub segment_size: Option<u64>,
    /// Record completions every this long over the measured window (`timeline`).
    pub interval: Option<Duration>,
}

/// How long a job waits for any completion before declaring the server stuck.
const STALL_TIMEOUT: Duration = Duration::from_secs(10);

const PHASE_RAMP: u8 = 0;
const PHASE_MEASURE: u8 = 1;
const PHASE_STOP: u8 = 2;

fn blkio_err(what: &str, e: blkio::Error) -> anyhow::Error {
    anyhow::anyhow!("{what}: {} (errno {:?})", e.message(), e.errno())
}

/// A connected and started vhost-user-blk device.
pub struct Device {
    blkio: Blkio,
    queues: Vec<Blkioq>,
    /// Properties reported by the server.
    pub info: DeviceInfo,
    /// Allocate I/O buffers 2 MiB-aligned on hugepages ([`katablk_bdev::shm::SharedRegion`])
    /// instead of with libblkio.
    pub align_2m: bool,
    /// Buffers allocated here; declared after `blkio` so they are unmapped after it.
    own: Vec<katablk_bdev::shm::SharedRegion>,
}

/// Client memory from [`katablk_bdev::shm::SharedRegion`], as a libblkio region.
fn shared_region(r: &katablk_bdev::shm::SharedRegion) -> MemoryRegion {
    MemoryRegion {
        addr: r.addr() as usize,
        iova: r.addr() as u64,
        len: r.len(),
        fd: r.fd(),
        fd_offset: 0,
        flags: 0,
    }
}

impl Device {
    /// Connects to `socket` and starts `num_queues` queues of `queue_size` entries.
    pub fn connect(socket: &Path, num_queues: u32, queue_size: u32) -> Result<Device> {
        match std::fs::metadata(socket) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
                "socket {} does not exist: is the vhost-user-blk server running, and is --socket right?",
                socket.display()
            ),
            Err(e) => {
                return Err(e).with_context(|| format!("cannot access socket {}", socket.display()))
            }
            Ok(m) if !m.file_type().is_socket() => {
                bail!("{} exists but is not a Unix socket", socket.display())
            }
            Ok(_) => {}
        }
        let path = socket
            .to_str()
            .with_context(|| format!("socket path {} is not UTF-8", socket.display()))?;
        let mut blkio =
            Blkio::new("virtio-blk-vhost-user").map_err(|e| blkio_err("creating blkio", e))?;
        blkio
            .set_str("path", path)
            .map_err(|e| blkio_err("setting path", e))?;
        if let Err(e) = blkio.connect() {
            if e.errno() == Errno::CONNREFUSED {
                bail!(
                    "connection refused on {path}: nothing is listening (a stale socket left by a dead server?)"
                );
            }
            return Err(blkio_err(&format!("connecting to {path}"), e));
        }
        let get_i32 = |b: &Blkio, n: &str| b.get_i32(n).map_err(|e| blkio_err(n, e));
        let info = DeviceInfo {
            capacity: blkio
                .get_u64("capacity")
                .map_err(|e| blkio_err("capacity", e))?,
            max_queues: get_i32(&blkio, "max-queues")?,
            request_alignment: get_i32(&blkio, "request-alignment")?,
            max_transfer: get_i32(&blkio, "max-transfer")?,
            max_segment_len: get_i32(&blkio, "max-segment-len")?,
            max_segments: get_i32(&blkio, "max-segments")?,
            mem_region_alignment: blkio
                .get_u64("mem-region-alignment")
                .map_err(|e| blkio_err("mem-region-alignment", e))?,
            flush_needed: blkio
                .get_bool("flush-needed")
                .map_err(|e| blkio_err("flush-needed", e))?,
        };
        tracing::debug!(?info, "connected to {path}");
        if num_queues as i64 > i64::from(info.max_queues) {
            bail!(
                "the server offers {} queue(s) but {num_queues} were requested (--numjobs/--queues); \
                 start the server with more queues",
                info.max_queues
            );
        }
        let nq = i32::try_from(num_queues).context("too many queues")?;
        blkio
            .set_i32("num-queues", nq)
            .map_err(|e| blkio_err("setting num-queues", e))?;
        let qs = i32::try_from(queue_size).context("queue size too large")?;
        blkio
            .set_i32("queue-size", qs)
            .map_err(|e| blkio_err("setting queue-size", e))?;
        let started = blkio.start().map_err(|e| blkio_err("starting queues", e))?;
        Ok(Device {
            blkio,
            queues: started.queues,
            info,
            align_2m: false,
            own: Vec::new(),
        })
    }

    /// Allocates and maps a shared-memory I/O buffer of at least `len` bytes.
    pub fn alloc_buffer(&mut self, len: usize) -> Result<MemoryRegion> {
        let align = usize::try_from(self.info.mem_region_alignment.max(1))
            .context("mem-region-alignment too large")?;
        let len = len.max(1).div_ceil(align) * align;
        let region = if self.align_2m {
            let r = katablk_bdev::shm::SharedRegion::new(len)
                .map_err(|e| anyhow::anyhow!("allocating I/O buffers: {e}"))?;
            if !r.is_hugepages() {
                tracing::warn!("no free 2 MiB hugepages: --align-2m buffers on normal pages");
            }
            let region = shared_region(&r);
            self.own.push(r);
            region
        } else {
            self.blkio
                .alloc_mem_region(len)
                .map_err(|e| blkio_err("allocating I/O buffers", e))?
        };
        self.blkio
            .map_mem_region(&region)
            .map_err(|e| blkio_err("mapping I/O buffers into the server", e))?;
        Ok(region)
    }
}

/// A counter on its own cache line, so jobs do not slow each other down.
#[repr(align(64))]
#[derive(Default)]
struct PaddedCounter(AtomicU64);

/// State shared between the jobs and the main thread.
struct Control {
    phase: AtomicU8,
    abort: AtomicBool,
    completed: Vec<PaddedCounter>,
}

/// What one job does.
#[derive(Clone, Debug)]
struct JobSpec {
    index: u32,
    read_percent: u8,
    bs: u64,
    iodepth: u32,
    random: bool,
    region_base: u64,
    region_len: u64,
    seq_start: u64,
    seed: u64,
    verify: bool,
    poll: PollMode,
    /// Largest segment the device accepts (0: no limit); larger blocks are split into
    /// several segments (readv/writev).
    seg_len: u64,
}

/// Raw results of one job.
struct JobOutput {
    read_hist: Histogram<u64>,
    write_hist: Histogram<u64>,
    read_ios: u64,
    write_ios: u64,
    verified: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Read,
    Write,
    VerifyWrite,
    VerifyRead,
}

struct Slot {
    op: Op,
    offset: u64,
    seq: u64,
    submitted: Instant,
    buf: *mut u8,
    check_buf: *mut u8,
    /// Segments of `buf` and `check_buf` when a block needs several (else empty). Built once;
    /// never changed while the slot has I/O in flight, so the pointers given to the queue
    /// stay valid.
    iov: Vec<libc::iovec>,
    check_iov: Vec<libc::iovec>,
}

/// Splits `len` bytes at `base` into segments of at most `seg` bytes.
fn segments(base: *mut u8, len: usize, seg: usize) -> Vec<libc::iovec> {
    (0..len.div_ceil(seg))
        .map(|k| libc::iovec {
            // SAFETY: k * seg < len, so the pointer stays inside the buffer of `len` bytes.
            iov_base: unsafe { base.add(k * seg) }.cast(),
            iov_len: seg.min(len - k * seg),
        })
        .collect()
}

/// The I/O loop of one job: keeps `iodepth` requests in flight on queue `q` until the
/// main thread says stop, then drains.
fn run_job(mut q: Blkioq, spec: JobSpec, buf_base: usize, ctl: Arc<Control>) -> Result<JobOutput> {
    let bs = usize::try_from(spec.bs).context("block size")?;
    let depth = spec.iodepth as usize;
    let mut rng = Rng::new(spec.seed);
    let base = buf_base as *mut u8;

    // Initialise all buffers with non-trivial data once, so writes do not send zeroes.
    let total = depth * bs * if spec.verify { 2 } else { 1 };
    // SAFETY: the region at `base` was allocated and mapped by `Device::alloc_buffer` with at
    // least `total` bytes, lives until the `Device` is dropped after this thread is joined,
    // and no I/O is in flight yet, so nothing else accesses it.
    let all = unsafe { std::slice::from_raw_parts_mut(base, total) };
    for chunk in all.chunks_exact_mut(8) {
        chunk.copy_from_slice(&rng.next_u64().to_le_bytes());
    }

    let mut gens: Vec<OffsetGen> = if spec.verify {
        (0..depth as u64)
            .map(|i| {
                OffsetGen::new(spec.region_base, spec.region_len, spec.bs, spec.random, 0)
                    .interleaved(depth as u64, i)
            })
            .collect()
    } else {
        vec![OffsetGen::new(
            spec.region_base,
            spec.region_len,
            spec.bs,
            spec.random,
            spec.seq_start,
        )]
    };

    let now = Instant::now();
    let mut slots: Vec<Slot> = (0..depth)
        .map(|i| {
            let (buf, check_buf) = if spec.verify {
                // SAFETY: 2 * depth * bs bytes were allocated; slot i uses [2i*bs, (2i+2)*bs).
                unsafe { (base.add(2 * i * bs), base.add((2 * i + 1) * bs)) }
            } else {
                // SAFETY: depth * bs bytes were allocated; slot i uses [i*bs, (i+1)*bs).
                (unsafe { base.add(i * bs) }, std::ptr::null_mut())
            };
            let seg = usize::try_from(spec.seg_len).unwrap_or(usize::MAX);
            let split = seg > 0 && bs > seg;
            let seg_of = |p: *mut u8| {
                if split && !p.is_null() {
                    segments(p, bs, seg)
                } else {
                    Vec::new()
                }
            };
            Slot {
                op: Op::Read,
                offset: 0,
                seq: 0,
                submitted: now,
                iov: seg_of(buf),
                check_iov: seg_of(check_buf),
                buf,
                check_buf,
            }
        })
        .collect();

    let mut read_hist = new_histogram()?;
    let mut write_hist = new_histogram()?;
    let (mut read_ios, mut write_ios, mut verified) = (0u64, 0u64, 0u64);
    let mut seq_counter = u64::from(spec.index) << 48;

    // Picks the next operation of slot `i` and submits it.
    let mut start_new = |q: &mut Blkioq, slot: &mut Slot, i: usize, gens: &mut [OffsetGen]| {
        let gen = if spec.verify {
            &mut gens[i]
        } else {
            &mut gens[0]
        };
        slot.offset = gen.next(&mut rng);
        slot.op = if spec.verify {
            seq_counter += 1;
            slot.seq = seq_counter;
            // SAFETY: slot.buf points to bs bytes owned by this slot, whose previous I/O has
            // completed, so neither the server nor another slot accesses them now.
            let data = unsafe { std::slice::from_raw_parts_mut(slot.buf, bs) };
            fill_pattern(data, slot.offset, slot.seq);
            Op::VerifyWrite
        } else if spec.read_percent >= 100 || rng.percent(spec.read_percent) {
            Op::Read
        } else {
            Op::Write
        };
        submit(q, slot, i, bs);
    };

    for (i, slot) in slots.iter_mut().enumerate() {
        start_new(&mut q, slot, i, &mut gens);
    }

    let mut completions: Vec<MaybeUninit<Completion>> =
        (0..depth).map(|_| MaybeUninit::uninit()).collect();
    let mut inflight = depth;
    let mut stopping = false;
    let mut last_completion = Instant::now();
    let mut idle_loops = 0u32;
    let counter = &ctl.completed[spec.index as usize].0;

    while inflight > 0 {
        let res = match spec.poll {
            PollMode::Busy => q.do_io(&mut completions, 0, None, None),
            PollMode::Event => {
                let mut timeout = Duration::from_secs(1);
                q.do_io(&mut completions, 1, Some(&mut timeout), None)
            }
        };
        let n = match res {
            Ok(n) => n,
            Err(e) if e.errno() == Errno::TIME => 0,
            Err(e) => return Err(blkio_err(&format!("job {}: do_io", spec.index), e)),
        };
        let phase = ctl.phase.load(Ordering::Relaxed);
        if phase == PHASE_STOP || ctl.abort.load(Ordering::Relaxed) {
            stopping = true;
        }
        if n == 0 {
            idle_loops = idle_loops.wrapping_add(1);
            if (spec.poll == PollMode::Event || idle_loops % 4096 == 0)
                && last_completion.elapsed() > STALL_TIMEOUT
            {
                bail!(
                    "job {}: no completion for {} s with {inflight} I/O(s) in flight: is the server stuck?",
                    spec.index,
                    STALL_TIMEOUT.as_secs()
                );
            }
            continue;
        }
        let measuring = phase == PHASE_MEASURE;
        let done = Instant::now();
        last_completion = done;
        for c in &completions[..n] {
            // SAFETY: do_io returned n, so it initialised the first n completions.
            let c = unsafe { c.assume_init_ref() };
            let i = c.user_data;
            let slot = &mut slots[i];
            if c.ret != 0 {
                let err = std::io::Error::from_raw_os_error(-c.ret);
                bail!(
                    "job {}: {:?} of {bs} bytes at offset {} failed: {err}",
                    spec.index,
                    slot.op,
                    slot.offset
                );
            }
            let lat =
                u64::try_from(done.duration_since(slot.submitted).as_nanos()).unwrap_or(u64::MAX);
            match slot.op {
                Op::Read | Op::VerifyRead => {
                    if measuring {
                        read_hist.saturating_record(lat.max(1));
                        read_ios += 1;
                    }
                }
                Op::Write | Op::VerifyWrite => {
                    if measuring {
                        write_hist.saturating_record(lat.max(1));
                        write_ios += 1;
                    }
                }
            }
            match slot.op {
                Op::VerifyWrite => {
                    // Read the block back into the slot's second buffer.
                    slot.op = Op::VerifyRead;
                    submit(&mut q, slot, i, bs);
                    continue;
                }
                Op::VerifyRead => {
                    // SAFETY: check_buf points to bs bytes owned by this slot, and the read
                    // into it has completed.
                    let data = unsafe { std::slice::from_raw_parts(slot.check_buf, bs) };
                    if let Some(at) = check_pattern(data, slot.offset, slot.seq) {
                        bail!(
                            "job {}: verify failed at device offset {} (+{at} bytes): the data read back \
                             is not what was written",
                            spec.index,
                            slot.offset
                        );
                    }
                    verified += 1;
                }
                Op::Read | Op::Write => {}
            }
            if stopping {
                inflight -= 1;
            } else {
                start_new(&mut q, slot, i, &mut gens);
            }
        }
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }
    Ok(JobOutput {
        read_hist,
        write_hist,
        read_ios,
        write_ios,
        verified,
    })
}

/// Enqueues the current operation of `slot` (tagged `i`), stamping its submission time.
fn submit(q: &mut Blkioq, slot: &mut Slot, i: usize, bs: usize) {
    slot.submitted = Instant::now();
    if !slot.iov.is_empty() {
        let f = ReqFlags::empty();
        // Lengths fit: they were checked against max-segments (an i32) before the run.
        let n = slot.iov.len() as u32;
        match slot.op {
            Op::Read => q.readv(slot.offset, slot.iov.as_ptr(), n, i, f),
            Op::VerifyRead => q.readv(slot.offset, slot.check_iov.as_ptr(), n, i, f),
            Op::Write | Op::VerifyWrite => q.writev(slot.offset, slot.iov.as_ptr(), n, i, f),
        }
        return;
    }
    match slot.op {
        Op::Read => q.read(slot.offset, slot.buf, bs, i, ReqFlags::empty()),
        Op::VerifyRead => q.read(slot.offset, slot.check_buf, bs, i, ReqFlags::empty()),
        Op::Write | Op::VerifyWrite => q.write(slot.offset, slot.buf, bs, i, ReqFlags::empty()),
    }
}

fn params_of(cfg: &RunConfig, size: u64) -> Params {
    Params {
        socket: cfg.socket.display().to_string(),
        rw: cfg.workload.name().to_string(),
        rwmixread: cfg.workload.read_percent(cfg.rwmixread),
        bs: cfg.bs,
        iodepth: cfg.iodepth,
        numjobs: cfg.numjobs,
        runtime_s: cfg.runtime.as_secs_f64(),
        ramp_s: cfg.ramp.as_secs_f64(),
        size,
        queue_size: cfg.queue_size,
        poll: cfg.poll.name().to_string(),
        verify: cfg.verify,
        seed: cfg.seed,
        label: cfg.label.clone(),
        meta: cfg.meta.clone(),
        server_pid: cfg.server_pid,
        segment_size: cfg.segment_size,
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn tool_name() -> String {
    format!("katablk-bench {}", env!("CARGO_PKG_VERSION"))
}

/// Checks the parts of a configuration that do not need the device.
pub fn validate(cfg: &RunConfig) -> Result<()> {
    if cfg.bs == 0 || cfg.bs % 512 != 0 {
        bail!("--bs must be a non-zero multiple of 512 (got {})", cfg.bs);
    }
    if cfg.iodepth == 0 {
        bail!("--iodepth must be at least 1");
    }
    if cfg.numjobs == 0 {
        bail!("--numjobs must be at least 1");
    }
    if !cfg.queue_size.is_power_of_two() || cfg.queue_size > 32768 {
        bail!(
            "--queue-size must be a power of two up to 32768 (got {})",
            cfg.queue_size
        );
    }
    if cfg.runtime.is_zero() && cfg.idle.is_none() {
        bail!("--runtime must be greater than 0");
    }
    Ok(())
}

/// Connects, runs the configured workload (or idle measurement) and returns its report.
pub fn run(cfg: &RunConfig) -> Result<BenchReport> {
    validate(cfg)?;
    let mut dev = Device::connect(&cfg.socket, cfg.numjobs, cfg.queue_size)?;
    dev.align_2m = cfg.align_2m;
    if let Some(idle) = cfg.idle {
        return run_idle(cfg, dev, idle);
    }
    let info = dev.info.clone();
    let ra = u64::try_from(info.request_alignment.max(1)).unwrap_or(512);
    if cfg.bs % ra != 0 {
        bail!(
            "--bs {} is not a multiple of the device's request alignment {ra}",
            cfg.bs
        );
    }
    if info.max_transfer > 0 && cfg.bs > info.max_transfer as u64 {
        bail!(
            "--bs {} exceeds the device's max-transfer {}",
            cfg.bs,
            info.max_transfer
        );
    }
    let device_seg = u64::try_from(info.max_segment_len.max(0)).unwrap_or(0);
    let seg_len = match (device_seg, cfg.segment_size) {
        (0, Some(s)) => s,
        (d, Some(s)) => d.min(s),
        (d, None) => d,
    };
    if seg_len > 0 && cfg.bs > seg_len {
        let nseg = cfg.bs.div_ceil(seg_len);
        let max_segs = u64::try_from(info.max_segments.max(1)).unwrap_or(1);
        if nseg > max_segs {
            bail!(
                "--bs {} needs {nseg} segments of at most {seg_len} bytes, but the device takes {max_segs} per request",
                cfg.bs
            );
        }
        tracing::info!(
            "--bs {} is sent as {nseg} segments of at most {seg_len} bytes",
            cfg.bs
        );
    }
    let size = cfg.size.unwrap_or(info.capacity);
    if size > info.capacity {
        bail!(
            "--size {size} is larger than the device ({} bytes)",
            info.capacity
        );
    }
    let size = size / cfg.bs * cfg.bs;
    if size < cfg.bs {
        bail!(
            "the device ({} bytes) is smaller than one block of {}",
            info.capacity,
            cfg.bs
        );
    }
    if u64::from(cfg.iodepth) * 3 > u64::from(cfg.queue_size) {
        tracing::warn!(
            "iodepth {} needs {} descriptors but --queue-size is {}: fewer requests will be in flight",
            cfg.iodepth,
            cfg.iodepth * 3,
            cfg.queue_size
        );
    }

    // Verification needs disjoint regions per job (and per slot, see OffsetGen::interleaved).
    let per_job = (size / u64::from(cfg.numjobs)) / cfg.bs * cfg.bs;
    if cfg.verify && per_job < cfg.bs * u64::from(cfg.iodepth) {
        bail!(
            "--verify needs at least iodepth ({}) blocks per job, but each of the {} job(s) has only {} bytes",
            cfg.iodepth,
            cfg.numjobs,
            per_job
        );
    }

    let ctl = Arc::new(Control {
        phase: AtomicU8::new(if cfg.ramp.is_zero() {
            PHASE_MEASURE
        } else {
            PHASE_RAMP
        }),
        abort: AtomicBool::new(false),
        completed: (0..cfg.numjobs).map(|_| PaddedCounter::default()).collect(),
    });

    let bs = usize::try_from(cfg.bs).context("block size")?;
    let mut buffers = Vec::new();
    for _ in 0..cfg.numjobs {
        let len = bs * cfg.iodepth as usize * if cfg.verify { 2 } else { 1 };
        buffers.push(dev.alloc_buffer(len)?);
    }

    let read_percent = cfg.workload.read_percent(cfg.rwmixread);
    let mut handles = Vec::new();
    let queues: Vec<Blkioq> = dev.queues.drain(..).collect();
    let mut client_sampler = CpuSampler::start(None)?;
    let mut server_sampler = cfg
        .server_pid
        .map(|p| CpuSampler::start(Some(p)))
        .transpose()?;
    let started = Instant::now();
    for (j, q) in queues.into_iter().enumerate() {
        let j32 = u32::try_from(j).context("job index")?;
        let (region_base, region_len) = if cfg.verify {
            (u64::from(j32) * per_job, per_job)
        } else {
            (0, size)
        };
        let spec = JobSpec {
            index: j32,
            read_percent,
            bs: cfg.bs,
            iodepth: cfg.iodepth,
            random: cfg.workload.is_random(),
            region_base,
            region_len,
            seq_start: u64::from(j32) * per_job,
            seed: mix64(cfg.seed.wrapping_add(u64::from(j32))),
            verify: cfg.verify,
            poll: cfg.poll,
            seg_len,
        };
        let ctl = Arc::clone(&ctl);
        let buf_base = buffers[j].addr;
        let handle = std::thread::Builder::new()
            .name(format!("job{j}"))
            .spawn(move || {
                let res = run_job(q, spec, buf_base, Arc::clone(&ctl));
                if res.is_err() {
                    ctl.abort.store(true, Ordering::Relaxed);
                }
                res
            })
            .context("spawning job thread")?;
        handles.push(handle);
    }

    // Phases: ramp, measure, stop; the bar shows progress and the current IOPS.
    let ramp_end = started + cfg.ramp;
    let end = ramp_end + cfg.runtime;
    let bar = make_bar(cfg.progress, cfg.ramp + cfg.runtime);
    let mut measure_start = started;
    let mut last = (Instant::now(), 0u64);
    let total_completed = || -> u64 {
        ctl.completed
            .iter()
            .map(|c| c.0.load(Ordering::Relaxed))
            .sum()
    };
    let mut timeline = TimelineRecorder::new(cfg.interval, cfg.bs);
    if ctl.phase.load(Ordering::Relaxed) == PHASE_MEASURE {
        timeline.start(measure_start, total_completed());
    }
    loop {
        let now = Instant::now();
        if ctl.abort.load(Ordering::Relaxed) {
            break;
        }
        if ctl.phase.load(Ordering::Relaxed) == PHASE_RAMP && now >= ramp_end {
            client_sampler = CpuSampler::start(None)?;
            server_sampler = cfg
                .server_pid
                .map(|p| CpuSampler::start(Some(p)))
                .transpose()?;
            measure_start = Instant::now();
            timeline.start(measure_start, total_completed());
            ctl.phase.store(PHASE_MEASURE, Ordering::Relaxed);
        }
        if now >= end {
            timeline.sample(now, total_completed(), true);
            break;
        }
        timeline.sample(now, total_completed(), false);
        if now.duration_since(last.0) >= Duration::from_millis(500) {
            let done = total_completed();
            let rate = (done - last.1) as f64 / now.duration_since(last.0).as_secs_f64();
            let phase = if now < ramp_end { "ramp" } else { "run" };
            bar.set_message(format!("{phase} {} IOPS", crate::stats::format_rate(rate)));
            last = (now, done);
        }
        bar.set_position(now.duration_since(started).as_millis() as u64);
        let nap = Duration::from_millis(50)
            .min(end.saturating_duration_since(now))
            .min(timeline.until_next(now));
        std::thread::sleep(nap);
    }
    ctl.phase.store(PHASE_STOP, Ordering::Relaxed);
    let measure_end = Instant::now();
    let client_cpu = client_sampler.finish()?;
    let server_cpu = match &server_sampler {
        Some(s) => Some(s.finish()?),
        None => None,
    };
    bar.finish_and_clear();

    let mut outputs = Vec::new();
    let mut first_err = None;
    for h in handles {
        match h.join() {
            Ok(Ok(out)) => outputs.push(out),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(_) => {
                first_err.get_or_insert(anyhow::anyhow!("a job thread panicked"));
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    drop(dev);

    let elapsed = measure_end.duration_since(measure_start);
    let mut report = build_report(cfg, info, size, elapsed, &outputs, client_cpu, server_cpu)?;
    report.timeline = timeline.finish();
    Ok(report)
}

/// Samples the jobs' completion counters at fixed intervals of the measured window.
struct TimelineRecorder {
    interval: Option<Duration>,
    bs: u64,
    /// Start of the window (monotonic and wall clock) and the counter then.
    start: Option<(Instant, f64)>,
    /// Previous sample: when, and the counter.
    prev: (Instant, u64),
    next: Instant,
    samples: Vec<TimelineSample>,
}

impl TimelineRecorder {
    fn new(interval: Option<Duration>, bs: u64) -> Self {
        let now = Instant::now();
        TimelineRecorder {
            interval: interval.filter(|i| !i.is_zero()),
            bs,
            start: None,
            prev: (now, 0),
            next: now,
            samples: Vec::new(),
        }
    }

    fn start(&mut self, at: Instant, completed: u64) {
        let Some(interval) = self.interval else {
            return;
        };
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.start = Some((at, unix));
        self.prev = (at, completed);
        self.next = at + interval;
    }

    /// Records a sample when an interval has ended (or, with `last`, whatever is left).
    fn sample(&mut self, now: Instant, completed: u64, last: bool) {
        let (Some(interval), Some((start, _))) = (self.interval, self.start) else {
            return;
        };
        if now < self.next && !last {
            return;
        }
        let len = now.duration_since(self.prev.0).as_secs_f64();
        if len <= 0.0 || (last && len < interval.as_secs_f64() / 10.0) {
            return;
        }
        let ios = completed.saturating_sub(self.prev.1);
        self.samples.push(TimelineSample {
            t_s: now.duration_since(start).as_secs_f64(),
            len_s: len,
            ios,
            iops: ios as f64 / len,
            bytes_per_sec: (ios * self.bs) as f64 / len,
        });
        self.prev = (now, completed);
        while self.next <= now {
            self.next += interval;
        }
    }

    /// How long the main loop may sleep before the next sample is due.
    fn until_next(&self, now: Instant) -> Duration {
        match (self.interval, self.start) {
            (Some(_), Some(_)) => self.next.saturating_duration_since(now),
            _ => Duration::MAX,
        }
    }

    fn finish(self) -> Option<Timeline> {
        let (interval, (_, unix)) = (self.interval?, self.start?);
        Some(Timeline {
            start_unix_s: unix,
            interval_s: interval.as_secs_f64(),
            samples: self.samples,
        })
    }
}

fn build_report(
    cfg: &RunConfig,
    info: DeviceInfo,
    size: u64,
    elapsed: Duration,
    outputs: &[JobOutput],
    client_cpu: CpuUsage,
    server_cpu: Option<CpuUsage>,
) -> Result<BenchReport> {
    let mut jobs = Vec::new();
    let mut all_read = new_histogram()?;
    let mut all_write = new_histogram()?;
    let (mut tr, mut tw, mut tv) = (0u64, 0u64, 0u64);
    for (j, o) in outputs.iter().enumerate() {
        let mut both = o.read_hist.clone();
        both.add(&o.write_hist).context("merging histograms")?;
        jobs.push(JobReport {
            job: Some(u32::try_from(j).context("job index")?),
            read: IoStats::new(&o.read_hist, o.read_ios, o.read_ios * cfg.bs, elapsed),
            write: IoStats::new(&o.write_hist, o.write_ios, o.write_ios * cfg.bs, elapsed),
            total: IoStats::new(
                &both,
                o.read_ios + o.write_ios,
                (o.read_ios + o.write_ios) * cfg.bs,
                elapsed,
            ),
            verified: o.verified,
        });
        all_read.add(&o.read_hist).context("merging histograms")?;
        all_write.add(&o.write_hist).context("merging histograms")?;
        tr += o.read_ios;
        tw += o.write_ios;
        tv += o.verified;
    }
    let mut both = all_read.clone();
    both.add(&all_write).context("merging histograms")?;
    let total = JobReport {
        job: None,
        read: IoStats::new(&all_read, tr, tr * cfg.bs, elapsed),
        write: IoStats::new(&all_write, tw, tw * cfg.bs, elapsed),
        total: IoStats::new(&both, tr + tw, (tr + tw) * cfg.bs, elapsed),
        verified: tv,
    };
    Ok(BenchReport {
        version: REPORT_VERSION,
        kind: ReportKind::Io,
        tool: tool_name(),
        timestamp_unix: now_unix(),
        params: params_of(cfg, size),
        device: info,
        elapsed_s: elapsed.as_secs_f64(),
        jobs,
        total,
        client_cpu,
        server_cpu,
        timeline: None,
    })
}

fn make_bar(enabled: bool, total: Duration) -> ProgressBar {
    if !enabled || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(
        Some(total.as_millis() as u64),
        ProgressDrawTarget::stderr_with_hz(4),
    );
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] [{wide_bar}] {percent:>3}% {msg}",
    ) {
        bar.set_style(style);
    }
    bar
}

/// Stays connected with all queues started and a buffer mapped, doing no I/O, and measures
/// the CPU use of the server (and of this client) meanwhile.
fn run_idle(cfg: &RunConfig, mut dev: Device, idle: Duration) -> Result<BenchReport> {
    let _buf = dev.alloc_buffer(usize::try_from(cfg.bs).context("block size")?)?;
    let info = dev.info.clone();
    let bar = make_bar(cfg.progress, idle);
    let client_sampler = CpuSampler::start(None)?;
    let server_sampler = cfg
        .server_pid
        .map(|p| CpuSampler::start(Some(p)))
        .transpose()?;
    let started = Instant::now();
    let end = started + idle;
    while Instant::now() < end {
        bar.set_position(started.elapsed().as_millis() as u64);
        std::thread::sleep(
            Duration::from_millis(100).min(end.saturating_duration_since(Instant::now())),
        );
    }
    let elapsed = started.elapsed();
    let client_cpu = client_sampler.finish()?;
    let server_cpu = match &server_sampler {
        Some(s) => Some(s.finish()?),
        None => None,
    };
    bar.finish_and_clear();
    let mut params = params_of(cfg, info.capacity);
    params.runtime_s = idle.as_secs_f64();
    params.ramp_s = 0.0;
    Ok(BenchReport {
        version: REPORT_VERSION,
        kind: ReportKind::Idle,
        tool: tool_name(),
        timestamp_unix: now_unix(),
        params,
        device: info,
        elapsed_s: elapsed.as_secs_f64(),
        jobs: Vec::new(),
        total: JobReport::default(),
        client_cpu,
        server_cpu,
        timeline: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cover_the_buffer_exactly() {
        let mut buf = vec![0u8; 10 * 1024];
        let base = buf.as_mut_ptr();
        let segs = segments(base, buf.len(), 4096);
        assert_eq!(segs.len(), 3);
        assert_eq!(
            segs.iter().map(|s| s.iov_len).collect::<Vec<_>>(),
            vec![4096, 4096, 2048]
        );
        assert_eq!(segs[0].iov_base as usize, base as usize);
        assert_eq!(segs[2].iov_base as usize, base as usize + 8192);
        assert_eq!(segments(base, 4096, 4096).len(), 1);
    }

    #[test]
    fn timeline_samples_each_interval_and_the_rest() {
        let ms = Duration::from_millis;
        let mut t = TimelineRecorder::new(Some(ms(100)), 4096);
        let t0 = Instant::now();
        t.sample(t0, 0, false);
        assert!(t.samples.is_empty(), "nothing before the window starts");
        t.start(t0, 1_000);
        t.sample(t0 + ms(50), 1_500, false);
        assert!(t.samples.is_empty(), "the interval has not ended");
        t.sample(t0 + ms(100), 2_000, false);
        t.sample(t0 + ms(250), 3_500, false);
        t.sample(t0 + ms(260), 3_600, true);
        let tl = t.finish().unwrap();
        let got: Vec<(u64, u64)> = tl
            .samples
            .iter()
            .map(|s| ((s.t_s * 1000.0).round() as u64, s.ios))
            .collect();
        assert_eq!(got, [(100, 1_000), (250, 1_500), (260, 100)]);
        assert!((tl.samples[0].iops - 10_000.0).abs() < 1e-6);
        assert!((tl.samples[0].bytes_per_sec - 10_000.0 * 4096.0).abs() < 1e-3);
        assert!(TimelineRecorder::new(None, 4096).finish().is_none());
    }

    #[test]
    fn workload_read_percentages() {
        assert_eq!(Workload::Randread.read_percent(30), 100);
        assert_eq!(Workload::Write.read_percent(30), 0);
        assert_eq!(Workload::Randrw.read_percent(30), 30);
        assert!(Workload::Randrw.is_random());
        assert!(!Workload::Read.is_random());
    }
}
