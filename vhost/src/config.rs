//! Device configuration: the options of one vhost-user-blk device, its virtio feature bits and
//! the `virtio_blk_config` space seen by the guest.

use katablk_bdev::DeviceInfo;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use crate::Error;

/// Sector size of the virtio-blk protocol.
pub const SECTOR_SIZE: u64 = 512;
/// Largest queue size the backend accepts.
pub const MAX_QUEUE_SIZE: u16 = 1024;
/// Largest number of queues the backend accepts.
pub const MAX_QUEUES: u16 = 64;
/// Memory slots offered with `CONFIGURE_MEM_SLOTS`.
pub const MAX_MEM_SLOTS: u64 = 509;
/// Discard / write-zeroes segments accepted in one request.
pub const MAX_DISCARD_SEG: u32 = 32;
/// Size of the config space we describe (up to and including `write_zeroes_may_unmap` and its
/// padding); reads beyond it return zeroes.
pub const CONFIG_SPACE_LEN: usize = 60;

/// Options of one vhost-user-blk device.
#[derive(Debug, Clone)]
pub struct BlkOptions {
    /// Number of virtqueues offered (1..=64).
    pub num_queues: u16,
    /// Largest queue size accepted (a power of two up to 1024).
    pub queue_size: u16,
    /// Expose the device read-only (`VIRTIO_BLK_F_RO`), whatever the backing allows.
    pub read_only: bool,
    /// Serial number returned by `GET_ID` (at most 20 bytes).
    pub serial: String,
    /// Busy-poll window in microseconds after the last activity of a worker (0: no polling).
    pub poll_us: u32,
    /// Worker threads: `queue_threads[i]` is the bitmask of the queues thread `i` serves. Empty:
    /// one thread per queue.
    pub queue_threads: Vec<u64>,
    /// Initial write-cache mode reported to the guest (true: writeback).
    pub writeback: bool,
    /// CPUs the worker threads are pinned to (empty: no pinning).
    pub cpus: Vec<usize>,
    /// Where the queue workers run: `None`, one OS thread each (adaptive polling, epoll when
    /// idle); or an external [`WorkerRuntime`] that calls each worker's step function (e.g. an
    /// SPDK poller on a reactor, next to the bdev's own pollers).
    pub runtime: Option<RuntimeHandle>,
    /// The rate limits the queues obey ([`katablk_bdev::qos`]): share one limiter between the
    /// controllers of one bdev. `None`: a limiter of this device's own, with no limits.
    pub qos: Option<std::sync::Arc<katablk_bdev::qos::Limiter>>,
}

/// What one iteration of a queue worker did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepResult {
    /// It took, completed or refused requests.
    Busy,
    /// Nothing to do: a runtime that accounts busy and idle time (SPDK's pollers) counts the
    /// step as idle.
    Idle,
    /// The worker has exited: the runtime must stop calling it.
    Exited,
}

/// One iteration of a queue worker.
pub type WorkerStep = Box<dyn FnMut() -> StepResult + Send>;

/// An executor of queue workers other than katablk's own threads. The runtime calls the step
/// function over and over (it must never block: requests complete by polling); the worker
/// keeps guest notifications off while it is polled.
pub trait WorkerRuntime: Send + Sync {
    /// Starts calling `step` (named `name`, preferably on `cpu`) until it returns false.
    fn spawn(
        &self,
        name: String,
        cpu: Option<usize>,
        step: WorkerStep,
    ) -> Result<Box<dyn WorkerJoin>, Error>;
}

/// Waits for a worker started by a [`WorkerRuntime`] to return false from its step.
pub trait WorkerJoin: Send {
    /// Blocks until the worker has exited (never called from the runtime's own threads).
    fn join(self: Box<Self>);
}

/// A shared [`WorkerRuntime`] (cloneable, printable in options).
#[derive(Clone)]
pub struct RuntimeHandle(pub std::sync::Arc<dyn WorkerRuntime>);

impl std::fmt::Debug for RuntimeHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RuntimeHandle(..)")
    }
}

impl Default for BlkOptions {
    fn default() -> Self {
        BlkOptions {
            num_queues: 1,
            queue_size: 256,
            read_only: false,
            serial: String::new(),
            poll_us: 50,
            queue_threads: Vec::new(),
            writeback: true,
            cpus: Vec::new(),
            runtime: None,
            qos: None,
        }
    }
}

impl BlkOptions {
    /// Checks the options, returning the queue-to-thread mapping to use.
    pub fn validate(&self) -> Result<Vec<u64>, Error> {
        if self.num_queues == 0 || self.num_queues > MAX_QUEUES {
            return Err(Error::Config(format!(
                "num-queues must be 1..={MAX_QUEUES}, not {}",
                self.num_queues
            )));
        }
        if !self.queue_size.is_power_of_two() || self.queue_size > MAX_QUEUE_SIZE {
            return Err(Error::Config(format!(
                "queue-size must be a power of two up to {MAX_QUEUE_SIZE}, not {}",
                self.queue_size
            )));
        }
        if self.serial.len() > VIRTIO_BLK_ID_BYTES as usize {
            return Err(Error::Config(format!(
                "serial must be at most {VIRTIO_BLK_ID_BYTES} bytes"
            )));
        }
        if self.queue_threads.is_empty() {
            return Ok((0..self.num_queues).map(|q| 1u64 << q).collect());
        }
        let all = if self.num_queues == 64 {
            u64::MAX
        } else {
            (1u64 << self.num_queues) - 1
        };
        let mut seen = 0u64;
        for &m in &self.queue_threads {
            if m == 0 || m & !all != 0 || m & seen != 0 {
                return Err(Error::Config(format!(
                    "queue-to-thread mapping {:x?} must give each of the {} queues to exactly one thread",
                    self.queue_threads, self.num_queues
                )));
            }
            seen |= m;
        }
        if seen != all {
            return Err(Error::Config(format!(
                "queue-to-thread mapping {:x?} leaves queues without a thread",
                self.queue_threads
            )));
        }
        Ok(self.queue_threads.clone())
    }

    /// Largest number of data segments per request (`seg_max`).
    pub fn seg_max(&self) -> u32 {
        u32::from(self.queue_size).saturating_sub(2).max(1)
    }
}

/// Virtio feature bits offered for a device.
pub fn virtio_features(read_only: bool) -> u64 {
    let mut f = (1u64 << VIRTIO_F_VERSION_1)
        | (1u64 << VIRTIO_RING_F_EVENT_IDX)
        | (1u64 << VIRTIO_RING_F_INDIRECT_DESC)
        | (1u64 << VIRTIO_BLK_F_SEG_MAX)
        | (1u64 << VIRTIO_BLK_F_BLK_SIZE)
        | (1u64 << VIRTIO_BLK_F_TOPOLOGY)
        | (1u64 << VIRTIO_BLK_F_FLUSH)
        | (1u64 << VIRTIO_BLK_F_CONFIG_WCE)
        | (1u64 << VIRTIO_BLK_F_MQ)
        | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    if read_only {
        f |= 1u64 << VIRTIO_BLK_F_RO;
    } else {
        f |= (1u64 << VIRTIO_BLK_F_DISCARD) | (1u64 << VIRTIO_BLK_F_WRITE_ZEROES);
    }
    f
}

/// vhost-user protocol features offered.
pub fn protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
        | VhostUserProtocolFeatures::INFLIGHT_SHMFD
        | VhostUserProtocolFeatures::RESET_DEVICE
        | VhostUserProtocolFeatures::BACKEND_REQ
}

/// Builds the `virtio_blk_config` space for a device.
pub fn config_space(
    info: &DeviceInfo,
    opts: &BlkOptions,
    writeback: bool,
) -> [u8; CONFIG_SPACE_LEN] {
    let mut c = [0u8; CONFIG_SPACE_LEN];
    let capacity = info.size_bytes() / SECTOR_SIZE;
    let put32 = |c: &mut [u8; CONFIG_SPACE_LEN], off: usize, v: u32| {
        c[off..off + 4].copy_from_slice(&v.to_le_bytes())
    };
    c[0..8].copy_from_slice(&capacity.to_le_bytes());
    // size_max (8): no limit beyond seg_max.
    put32(&mut c, 12, opts.seg_max());
    // geometry (16..20) left zero.
    put32(&mut c, 20, info.block_size);
    // topology: physical_block_exp, alignment_offset, min_io_size (in logical blocks),
    // opt_io_size (in logical blocks).
    let exp = (info.physical_block_size.max(info.block_size) / info.block_size).trailing_zeros();
    c[24] = exp as u8;
    c[25] = 0;
    c[26..28].copy_from_slice(&1u16.to_le_bytes());
    put32(&mut c, 28, info.optimal_io_size / info.block_size);
    c[32] = u8::from(writeback);
    c[34..36].copy_from_slice(&opts.num_queues.to_le_bytes());
    let max_sectors = (u32::MAX / SECTOR_SIZE as u32) & !((info.block_size / 512).max(1) - 1);
    if !opts.read_only && !info.read_only {
        if info.discard {
            put32(&mut c, 36, max_sectors);
            put32(&mut c, 40, MAX_DISCARD_SEG);
            put32(&mut c, 44, info.block_size / SECTOR_SIZE as u32);
        }
        if info.write_zeroes {
            put32(&mut c, 48, max_sectors);
            put32(&mut c, 52, MAX_DISCARD_SEG);
            c[56] = u8::from(info.discard);
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> DeviceInfo {
        DeviceInfo {
            block_size: 4096,
            num_blocks: 256,
            read_only: false,
            volatile_cache: true,
            discard: true,
            write_zeroes: true,
            buf_align: 1,
            physical_block_size: 4096,
            optimal_io_size: 0,
        }
    }

    #[test]
    fn config_layout() {
        let opts = BlkOptions {
            num_queues: 4,
            ..Default::default()
        };
        let c = config_space(&info(), &opts, true);
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), 2048);
        assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), 254);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 4096);
        assert_eq!(c[32], 1);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 4);
        assert_eq!(
            u32::from_le_bytes(c[40..44].try_into().unwrap()),
            MAX_DISCARD_SEG
        );
        assert_eq!(u32::from_le_bytes(c[44..48].try_into().unwrap()), 8);
        assert_eq!(c[56], 1);
    }

    #[test]
    fn mapping_validation() {
        let mut o = BlkOptions {
            num_queues: 4,
            ..Default::default()
        };
        assert_eq!(o.validate().unwrap(), vec![1, 2, 4, 8]);
        o.queue_threads = vec![0b0011, 0b1100];
        assert_eq!(o.validate().unwrap(), vec![3, 12]);
        o.queue_threads = vec![0b0011, 0b0110];
        assert!(o.validate().is_err());
        o.queue_threads = vec![0b0011];
        assert!(o.validate().is_err());
        o.queue_size = 100;
        assert!(o.validate().is_err());
    }

    #[test]
    fn read_only_features() {
        let f = virtio_features(true);
        assert_ne!(f & (1 << VIRTIO_BLK_F_RO), 0);
        assert_eq!(f & (1 << VIRTIO_BLK_F_DISCARD), 0);
    }
}
