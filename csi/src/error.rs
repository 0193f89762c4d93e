//! The driver's error type and its mapping onto CSI gRPC status codes.

use std::io;
use std::path::PathBuf;

use katablk_rpc::RpcError;
use tonic::{Code, Status};

/// Everything a CSI call can fail with. Each variant names the CSI code it maps to, except
/// [`CsiError::Rpc`], which is classified from the SPDK reply (see [`CsiError::code`]).
#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    /// A malformed request: `INVALID_ARGUMENT`.
    #[error("{0}")]
    InvalidArgument(String),
    /// The volume, snapshot or path does not exist: `NOT_FOUND`.
    #[error("{0}")]
    NotFound(String),
    /// The name exists with incompatible properties: `ALREADY_EXISTS`.
    #[error("{0}")]
    AlreadyExists(String),
    /// The object is in a state that forbids the call: `FAILED_PRECONDITION`.
    #[error("{0}")]
    FailedPrecondition(String),
    /// Out of space or topology unsatisfiable: `RESOURCE_EXHAUSTED`.
    #[error("{0}")]
    ResourceExhausted(String),
    /// A capacity the driver cannot provide: `OUT_OF_RANGE`.
    #[error("{0}")]
    OutOfRange(String),
    /// A bad pagination token: `ABORTED`.
    #[error("{0}")]
    Aborted(String),
    /// The SPDK target does not answer: `UNAVAILABLE`.
    #[error("SPDK target unavailable: {0}")]
    Unavailable(String),
    /// A method this driver does not serve: `UNIMPLEMENTED`.
    #[error("{0}")]
    Unimplemented(String),
    /// Anything else: `INTERNAL`.
    #[error("{0}")]
    Internal(String),
    /// A JSON-RPC call to the target failed.
    #[error("{op}: {source}")]
    Rpc {
        /// The JSON-RPC method.
        op: &'static str,
        /// What the client reported.
        #[source]
        source: RpcError,
    },
    /// A local system call failed.
    #[error("{what} {path:?}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// Result alias for driver operations.
pub type Result<T, E = CsiError> = std::result::Result<T, E>;

impl CsiError {
    /// An I/O error on `path`.
    pub fn io(what: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Io {
            what,
            path: path.into(),
            source,
        }
    }

    /// A closure for `map_err` on JSON-RPC calls.
    pub fn rpc(op: &'static str) -> impl FnOnce(RpcError) -> Self {
        move |source| Self::Rpc { op, source }
    }

    /// The CSI status code of this error.
    pub fn code(&self) -> Code {
        match self {
            Self::InvalidArgument(_) => Code::InvalidArgument,
            Self::NotFound(_) => Code::NotFound,
            Self::AlreadyExists(_) => Code::AlreadyExists,
            Self::FailedPrecondition(_) => Code::FailedPrecondition,
            Self::ResourceExhausted(_) => Code::ResourceExhausted,
            Self::OutOfRange(_) => Code::OutOfRange,
            Self::Aborted(_) => Code::Aborted,
            Self::Unavailable(_) => Code::Unavailable,
            Self::Unimplemented(_) => Code::Unimplemented,
            Self::Internal(_) | Self::Io { .. } => Code::Internal,
            Self::Rpc { source, .. } => {
                if source.is_transport() {
                    Code::Unavailable
                } else if source.is_not_found() {
                    Code::NotFound
                } else if source.is_exists() {
                    Code::AlreadyExists
                } else if source.is_no_space() {
                    Code::ResourceExhausted
                } else if source.is_busy() {
                    Code::FailedPrecondition
                } else {
                    Code::Internal
                }
            }
        }
    }

    /// True if the target could not be reached.
    pub fn is_unavailable(&self) -> bool {
        self.code() == Code::Unavailable
    }
}

/// The longest message a CSI error carries: messages quote caller input, which can be huge.
pub const MAX_MESSAGE_LEN: usize = 1024;

impl From<CsiError> for Status {
    fn from(e: CsiError) -> Self {
        let mut m = e.to_string();
        if m.len() > MAX_MESSAGE_LEN {
            let mut end = MAX_MESSAGE_LEN;
            while !m.is_char_boundary(end) {
                end -= 1;
            }
            let total = m.len();
            m.truncate(end);
            m.push_str(&format!("… ({total} bytes)"));
        }
        Status::new(e.code(), m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use katablk_rpc::SpdkError;

    #[test]
    fn rpc_errors_map_to_csi_codes() {
        let c = |e: SpdkError| {
            CsiError::Rpc {
                op: "x",
                source: e.into(),
            }
            .code()
        };
        assert_eq!(c(SpdkError::no_such_device()), Code::NotFound);
        assert_eq!(c(SpdkError::exists()), Code::AlreadyExists);
        assert_eq!(
            c(SpdkError::invalid_params("No space left on device")),
            Code::ResourceExhausted
        );
        assert_eq!(c(SpdkError::busy()), Code::FailedPrecondition);
        assert_eq!(c(SpdkError::einval()), Code::Internal);
        let t = CsiError::Rpc {
            op: "x",
            source: RpcError::Disconnected("gone".into()),
        };
        assert_eq!(t.code(), Code::Unavailable);
        assert!(t.is_unavailable());
        let s: Status = CsiError::NotFound("v".into()).into();
        assert_eq!(s.code(), Code::NotFound);
    }
}
