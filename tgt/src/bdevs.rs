//! Base bdevs (aio, malloc, null), the checks before one is created, and how every bdev is
//! reported (`bdev_get_bdevs`).

use std::os::unix::fs::FileTypeExt;
use std::sync::Arc;

use katablk_bdev::BlockDevice;
use katablk_rpc::methods::{
    AioDriverSpecific, BdevInfo, DriverSpecific, LvolDriverSpecific, SupportedIoTypes,
};
use katablk_rpc::SpdkError;
use uuid::Uuid;

use crate::error::einval;

/// Checks that `path` can back an aio bdev: it must be a regular file or a block device.
///
/// Looked at through an `O_PATH` descriptor, which opens nothing: no FIFO waits for a writer,
/// no device driver runs its open. (Opening a FIFO read-only blocks until a writer comes.)
/// The real open happens after this, outside the target's lock, and checks the type again.
pub fn check_aio_backing(path: &str) -> Result<(), SpdkError> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| {
            SpdkError::new(
                -e.raw_os_error().unwrap_or(libc::EINVAL),
                format!("{path}: {e}"),
            )
        })?;
    let ft = f
        .metadata()
        .map_err(|e| {
            SpdkError::new(
                -e.raw_os_error().unwrap_or(libc::EIO),
                format!("{path}: {e}"),
            )
        })?
        .file_type();
    let what = if ft.is_file() || ft.is_block_device() {
        return Ok(());
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    };
    Err(einval(format!(
        "{path} is {what}; an aio bdev needs a regular file or a block device"
    )))
}

/// Bytes of a RAM or null bdev of `num_blocks` blocks, refusing sizes that overflow (or do
/// not fit a file offset, `i64`).
pub fn ram_bytes(num_blocks: u64, block_size: u32) -> Result<u64, SpdkError> {
    num_blocks
        .checked_mul(u64::from(block_size))
        .filter(|b| i64::try_from(*b).is_ok())
        .ok_or_else(|| {
            einval(format!(
                "{num_blocks} blocks of {block_size} bytes overflow a 64-bit byte size"
            ))
        })
}

/// Memory the kernel says can be allocated without swapping (`MemAvailable`), if known.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses a malloc bdev larger than the memory available (it is mapped lazily, so it would
/// be accepted and then fail, or push the host into the OOM killer, as the guest fills it).
pub fn check_malloc_fits(bytes: u64) -> Result<(), SpdkError> {
    match mem_available() {
        Some(avail) if bytes > avail => Err(SpdkError::new(
            -libc::ENOMEM,
            format!(
                "Cannot allocate memory: a malloc bdev of {bytes} bytes is larger than the \
                 {avail} bytes of memory available"
            ),
        )),
        _ => Ok(()),
    }
}

/// What a base bdev is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BaseKind {
    /// A file or block device (`bdev_aio_create`).
    Aio {
        /// Path.
        filename: String,
        /// Opened read-only.
        readonly: bool,
        /// A block size was given explicitly.
        block_size_override: bool,
    },
    /// RAM (`bdev_malloc_create`).
    Malloc,
    /// Null (`bdev_null_create`).
    Null,
}

/// A base bdev.
pub struct BaseBdev {
    /// Name.
    pub name: String,
    /// UUID (also its alias).
    pub uuid: Uuid,
    /// Kind and creation parameters.
    pub kind: BaseKind,
    /// The device.
    pub dev: Arc<dyn BlockDevice>,
}

fn io_types(dev: &dyn BlockDevice, flush: bool) -> SupportedIoTypes {
    let i = dev.info();
    SupportedIoTypes {
        read: true,
        write: !i.read_only,
        unmap: i.discard && !i.read_only,
        flush,
        reset: true,
        write_zeroes: i.write_zeroes && !i.read_only,
        ..Default::default()
    }
}

impl BaseBdev {
    /// SPDK's `bdev_get_bdevs` entry; `claimed` when an lvstore sits on it.
    pub fn info(&self, claimed: bool) -> BdevInfo {
        let i = self.dev.info();
        let (product, driver_specific, numa, flush) = match &self.kind {
            BaseKind::Aio {
                filename,
                readonly,
                block_size_override,
            } => (
                "AIO disk",
                DriverSpecific {
                    aio: Some(AioDriverSpecific {
                        filename: filename.clone(),
                        block_size_override: *block_size_override,
                        readonly: *readonly,
                        fallocate: false,
                        nowait: false,
                    }),
                    ..Default::default()
                },
                None,
                true,
            ),
            BaseKind::Malloc => ("Malloc disk", DriverSpecific::default(), Some(-1), true),
            BaseKind::Null => ("Null disk", DriverSpecific::default(), None, false),
        };
        BdevInfo {
            name: self.name.clone(),
            aliases: vec![self.uuid.to_string()],
            product_name: product.into(),
            block_size: i.block_size,
            num_blocks: i.num_blocks,
            uuid: Some(self.uuid.to_string()),
            numa_id: numa,
            claimed,
            claim_type: claimed.then(|| "read_many_write_one".to_string()),
            supported_io_types: io_types(&*self.dev, flush),
            driver_specific,
            ..Default::default()
        }
    }
}

/// SPDK's `bdev_get_bdevs` entry for an lvol.
pub fn lvol_bdev_info(
    info: &katablk_lvol::LvolInfo,
    base_bdev: &str,
    dev: &dyn BlockDevice,
    claimed: bool,
) -> BdevInfo {
    let mut t = io_types(dev, false);
    t.write = !info.read_only;
    t.seek_hole = true;
    t.seek_data = true;
    BdevInfo {
        name: info.uuid.to_string(),
        aliases: vec![info.alias.clone()],
        product_name: "Logical Volume".into(),
        block_size: info.block_size,
        num_blocks: info.num_blocks,
        uuid: Some(info.uuid.to_string()),
        claimed,
        claim_type: claimed.then(|| "read_many_write_one".to_string()),
        supported_io_types: t,
        driver_specific: DriverSpecific {
            lvol: Some(LvolDriverSpecific {
                lvol_store_uuid: info.lvs_uuid.to_string(),
                base_bdev: base_bdev.to_string(),
                thin_provision: info.thin,
                num_allocated_clusters: info.num_allocated_clusters,
                snapshot: info.snapshot,
                clone: info.clone,
                base_snapshot: info.base_snapshot.clone(),
                clones: (!info.clones.is_empty()).then(|| info.clones.clone()),
                esnap_clone: false,
                external_snapshot_name: None,
            }),
            ..Default::default()
        },
        ..Default::default()
    }
}
