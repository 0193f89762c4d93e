use thiserror::Error;

/// Errors opening or driving a device.
#[derive(Debug, Error)]
pub enum BdevError {
    /// The backing file or device could not be opened.
    #[error("cannot open {path}: {source}")]
    Open {
        /// Path that failed.
        path: String,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A size or parameter is invalid.
    #[error("invalid parameter: {0}")]
    Invalid(String),
    /// A system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl BdevError {
    pub(crate) fn io(what: &'static str, source: std::io::Error) -> Self {
        BdevError::Io { what, source }
    }
}

/// Why a request could not be queued.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    /// The channel has `depth` requests in flight; poll completions and retry.
    #[error("channel full")]
    Full,
    /// Offset or length is not a multiple of the block size.
    #[error("misaligned request: offset {offset} length {len}")]
    Misaligned {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        len: u64,
    },
    /// The range ends beyond the device.
    #[error("request beyond end of device: offset {offset} length {len} size {size}")]
    OutOfRange {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        len: u64,
        /// Device size in bytes.
        size: u64,
    },
    /// More buffers than `max_segments`, or `len` disagrees with the buffers.
    #[error("bad buffer list")]
    BadBuffers,
    /// The device is read-only.
    #[error("device is read-only")]
    ReadOnly,
    /// The device does not support the operation.
    #[error("operation not supported")]
    Unsupported,
}

/// Why a submitted request failed.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum IoError {
    /// The backing store reported an errno.
    #[error("I/O error (errno {0})")]
    Errno(i32),
    /// The device does not support the operation.
    #[error("operation not supported")]
    Unsupported,
    /// Fewer bytes than requested were transferred (end of a shrunk file, say).
    #[error("short transfer: {done} of {wanted} bytes")]
    Short {
        /// Bytes transferred.
        done: u64,
        /// Bytes requested.
        wanted: u64,
    },
}

impl From<SubmitError> for IoError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Unsupported => IoError::Unsupported,
            SubmitError::ReadOnly => IoError::Errno(libc::EROFS),
            SubmitError::Full => IoError::Errno(libc::EAGAIN),
            _ => IoError::Errno(libc::EINVAL),
        }
    }
}

/// An unknown [`crate::file::IoMode`] name.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("unknown I/O mode `{input}`: expected one of auto, io_uring (or uring), threads, inline")]
pub struct ParseIoModeError {
    /// The text that was given.
    pub input: String,
}
