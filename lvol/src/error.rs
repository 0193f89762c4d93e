//! Errors of the volume store.

use katablk_bdev::sync::SyncError;
use katablk_bdev::BdevError;
use thiserror::Error;

/// Everything that can go wrong in the volume store.
#[derive(Debug, Error)]
pub enum LvolError {
    /// The device does not hold a katablk volume store (no signature in either super block slot).
    #[error("not a katablk lvstore: {0}")]
    NotAnLvstore(String),
    /// The device does not hold an SPDK lvstore (import, inspect).
    #[error("not an SPDK lvstore: {0}")]
    NotSpdkLvstore(String),
    /// The store was written by a newer or unknown format version.
    #[error("unsupported lvstore format version {0}")]
    UnsupportedVersion(u32),
    /// The super block is damaged (bad checksum or inconsistent fields).
    #[error("corrupt super block: {0}")]
    CorruptSuperblock(String),
    /// Metadata pages are damaged; the store cannot be opened without losing data.
    #[error("corrupt metadata: {0}")]
    CorruptMetadata(String),
    /// The backing device is smaller than the store recorded in its super block.
    #[error("device too small: store needs {needed} bytes, device has {actual}")]
    DeviceTooSmall {
        /// Bytes the store covers.
        needed: u64,
        /// Bytes the device has.
        actual: u64,
    },
    /// Not enough free clusters.
    #[error("no space left on device: need {needed} clusters, {free} free")]
    NoSpace {
        /// Clusters needed.
        needed: u64,
        /// Clusters free.
        free: u64,
    },
    /// The metadata region is full.
    #[error("metadata region full ({0} pages)")]
    MdFull(u32),
    /// A volume with that name already exists.
    #[error("volume {0} already exists")]
    Exists(String),
    /// No volume with that name or UUID.
    #[error("no such volume: {0}")]
    NotFound(String),
    /// The operation is not permitted (e.g. deleting a snapshot with several clones).
    #[error("operation not permitted: {0}")]
    NotPermitted(String),
    /// The volume is read-only.
    #[error("volume {0} is read-only")]
    ReadOnly(String),
    /// I/O on the volume did not drain in time.
    #[error("volume {0} is busy")]
    Busy(String),
    /// A parameter is invalid.
    #[error("invalid parameter: {0}")]
    Invalid(String),
    /// The store has been destroyed or closed.
    #[error("lvstore is closed")]
    Closed,
    /// Metadata I/O failed.
    #[error("metadata I/O failed: {0}")]
    Io(#[from] SyncError),
    /// The backing device failed.
    #[error(transparent)]
    Bdev(#[from] BdevError),
}

impl LvolError {
    /// The errno an SPDK client would see for this error (positive value; SPDK returns its
    /// negation).
    pub fn errno(&self) -> i32 {
        match self {
            LvolError::NotAnLvstore(_)
            | LvolError::NotSpdkLvstore(_)
            | LvolError::UnsupportedVersion(_)
            | LvolError::CorruptSuperblock(_)
            | LvolError::CorruptMetadata(_) => libc::EILSEQ,
            LvolError::DeviceTooSmall { .. } => libc::EINVAL,
            LvolError::NoSpace { .. } | LvolError::MdFull(_) => libc::ENOSPC,
            LvolError::Exists(_) => libc::EEXIST,
            LvolError::NotFound(_) => libc::ENODEV,
            LvolError::NotPermitted(_) => libc::EPERM,
            LvolError::ReadOnly(_) => libc::EROFS,
            LvolError::Busy(_) => libc::EBUSY,
            LvolError::Invalid(_) => libc::EINVAL,
            LvolError::Closed => libc::ENODEV,
            LvolError::Io(_) | LvolError::Bdev(_) => libc::EIO,
        }
    }
}

/// Result alias of the crate.
pub type Result<T, E = LvolError> = std::result::Result<T, E>;
