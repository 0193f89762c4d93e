//! A vhost-user-blk backend (device side) serving any katablk [`BlockDevice`].
//!
//! - [`server::VhostBlkServer`] listens on a unix socket and serves frontends (QEMU, Cloud
//!   Hypervisor, libblkio) one after another.
//! - [`backend::BlkBackend`] handles the vhost-user messages: features, memory table (and
//!   memory-slot hot-add/removal), virtqueue setup, config space, inflight tracking.
//! - `queue` runs one worker thread per queue (or per configured group of queues) with
//!   adaptive polling, moving data between guest memory and the device with no copy.
//! - [`chain`] and [`request`] walk and parse descriptor chains strictly.
//! - [`fdcheck`] refuses memory files that do not cover what the frontend asks to map, and
//!   `katablk_bdev::sigbus` keeps a frontend that shrinks them afterwards from killing the
//!   process: a fault
//!   in its memory costs only its own connection.
//!
//! It is built on the rust-vmm `vhost` crate's protocol handling rather than on
//! `vhost-user-backend`, whose handler does not support `INFLIGHT_SHMFD` (needed so a frontend
//! can reconnect after a backend restart without losing requests) and whose workers cannot be
//! polled adaptively.

#![deny(missing_docs)]

pub mod backend;
pub mod chain;
pub mod config;
pub mod fdcheck;
pub mod inflight;
pub(crate) mod queue;
pub mod request;
mod ring;
pub mod server;

use std::sync::atomic::{AtomicU64, Ordering};

pub use config::{BlkOptions, RuntimeHandle, StepResult, WorkerJoin, WorkerRuntime, WorkerStep};
pub use katablk_bdev::BlockDevice;
pub use server::{ServerHandle, VhostBlkServer};

/// Guest memory as mapped by the backend.
pub type GuestMem = vm_memory::GuestMemoryMmap<()>;

/// Asks the CPU to start loading the cache line at `p`: a hint, which never faults and changes
/// nothing the program can see, whatever the address. The request path uses it to overlap the
/// cache misses of a batch of chains (descriptors and headers the driver wrote on another core)
/// instead of taking them one after the other.
#[inline(always)]
pub(crate) fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 does not fault on any address (SSE is part of x86_64's baseline).
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Host address of guest range `[addr, addr + len)` when it lies inside one memory region (the
/// usual case): one region lookup instead of vm-memory's slice iterators on the per-request
/// path. `None` when the range is outside guest memory or spans regions (callers then take the
/// general path).
pub(crate) fn host_range(mem: &GuestMem, addr: u64, len: usize) -> Option<*mut u8> {
    use vm_memory::{Address, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};
    let r = mem.find_region(vm_memory::GuestAddress(addr))?;
    let off = addr.checked_sub(r.start_addr().raw_value())?;
    if off.checked_add(len as u64)? > r.len() {
        return None;
    }
    r.get_host_address(MemoryRegionAddress(off)).ok()
}

/// Copies guest bytes at host address `src` into `dst` with volatile loads (the guest may
/// change them meanwhile), eight bytes per store: byte loads stored one by one and then read
/// back as words (a request header's sector) stall on store forwarding. Where `src` is
/// 8-aligned each word is one load; elsewhere (libblkio packs its headers unaligned) eight byte
/// loads assembled in a register.
///
/// # Safety
/// The `dst.len()` bytes at `src` must be mapped memory that stays mapped during the call.
pub(crate) unsafe fn read_volatile_bytes(src: *const u8, dst: &mut [u8]) {
    let aligned = (src as usize) % 8 == 0;
    let mut k = 0;
    for w in dst.chunks_exact_mut(8) {
        let v = if aligned {
            // SAFETY: inside the caller's range, and 8-aligned (`src` is, `k` steps by 8).
            u64::from_le(unsafe { std::ptr::read_volatile(src.add(k).cast::<u64>()) })
        } else {
            let mut v = 0u64;
            for i in 0..8 {
                // SAFETY: inside the caller's range.
                v |= u64::from(unsafe { std::ptr::read_volatile(src.add(k + i)) }) << (8 * i);
            }
            v
        };
        w.copy_from_slice(&v.to_le_bytes());
        k += 8;
    }
    for b in &mut dst[k..] {
        // SAFETY: inside the caller's range.
        *b = unsafe { std::ptr::read_volatile(src.add(k)) };
        k += 1;
    }
}

/// Errors of the vhost-user-blk backend.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Invalid options.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The socket path is unusable.
    #[error("socket {path}: {reason}")]
    Socket {
        /// The path.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A system call failed.
    #[error("{0}: {1}")]
    Sys(&'static str, #[source] std::io::Error),
    /// The vhost-user protocol layer failed.
    #[error("vhost-user: {0}")]
    Protocol(#[from] vhost::vhost_user::Error),
    /// A memory file sent by the frontend was refused.
    #[error("refused memory file: {0}")]
    Fd(#[from] fdcheck::FdError),
    /// The block-device layer failed (its process-wide facilities, such as the `SIGBUS` guard).
    #[error("block device layer: {0}")]
    Bdev(#[from] katablk_bdev::BdevError),
}

/// I/O counters of one device.
#[derive(Debug, Default)]
pub struct Stats {
    /// Completed reads.
    pub read_ops: AtomicU64,
    /// Bytes read.
    pub read_bytes: AtomicU64,
    /// Completed writes.
    pub write_ops: AtomicU64,
    /// Bytes written.
    pub write_bytes: AtomicU64,
    /// Completed flushes.
    pub flush_ops: AtomicU64,
    /// Completed discard and write-zeroes requests.
    pub unmap_ops: AtomicU64,
    /// Requests failed by the device.
    pub io_errors: AtomicU64,
    /// Malformed requests rejected.
    pub bad_requests: AtomicU64,
}

/// A point-in-time copy of [`Stats`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Completed reads.
    pub read_ops: u64,
    /// Bytes read.
    pub read_bytes: u64,
    /// Completed writes.
    pub write_ops: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// Completed flushes.
    pub flush_ops: u64,
    /// Completed discard and write-zeroes requests.
    pub unmap_ops: u64,
    /// Requests failed by the device.
    pub io_errors: u64,
    /// Malformed requests rejected.
    pub bad_requests: u64,
}

impl std::ops::AddAssign for StatsSnapshot {
    fn add_assign(&mut self, o: StatsSnapshot) {
        self.read_ops += o.read_ops;
        self.read_bytes += o.read_bytes;
        self.write_ops += o.write_ops;
        self.write_bytes += o.write_bytes;
        self.flush_ops += o.flush_ops;
        self.unmap_ops += o.unmap_ops;
        self.io_errors += o.io_errors;
        self.bad_requests += o.bad_requests;
    }
}

impl Stats {
    /// Reads every counter.
    pub fn snapshot(&self) -> StatsSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            read_ops: l(&self.read_ops),
            read_bytes: l(&self.read_bytes),
            write_ops: l(&self.write_ops),
            write_bytes: l(&self.write_bytes),
            flush_ops: l(&self.flush_ops),
            unmap_ops: l(&self.unmap_ops),
            io_errors: l(&self.io_errors),
            bad_requests: l(&self.bad_requests),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn volatile_byte_reads_copy_exactly_at_any_alignment() {
        let src: Vec<u8> = (0..64u8).collect();
        for start in 0..9 {
            for len in 0..40 {
                let mut dst = vec![0xffu8; len];
                // SAFETY: `start + len` is at most 48, inside `src`.
                unsafe { super::read_volatile_bytes(src.as_ptr().add(start), &mut dst) };
                assert_eq!(dst, &src[start..start + len], "start {start} len {len}");
            }
        }
    }
}
