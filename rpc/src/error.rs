//! Error types: the JSON-RPC error object SPDK puts on the wire ([`SpdkError`]), what a client
//! call can fail with ([`RpcError`]) and what setting up a server can fail with ([`ServerError`]).

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// JSON-RPC 2.0 standard error codes and the negative errno values SPDK returns.
pub mod codes {
    /// Invalid JSON was received.
    pub const PARSE_ERROR: i32 = -32700;
    /// The JSON sent is not a valid request object.
    pub const INVALID_REQUEST: i32 = -32600;
    /// The method does not exist or is not available.
    pub const METHOD_NOT_FOUND: i32 = -32601;
    /// Invalid method parameters.
    pub const INVALID_PARAMS: i32 = -32602;
    /// Internal JSON-RPC error.
    pub const INTERNAL_ERROR: i32 = -32603;

    /// `-EPERM`: operation not permitted.
    pub const EPERM: i32 = -1;
    /// `-ENOENT`: no such file or directory.
    pub const ENOENT: i32 = -2;
    /// `-EIO`: input/output error.
    pub const EIO: i32 = -5;
    /// `-ENOMEM`: cannot allocate memory.
    pub const ENOMEM: i32 = -12;
    /// `-EBUSY`: device or resource busy.
    pub const EBUSY: i32 = -16;
    /// `-EEXIST`: file exists.
    pub const EEXIST: i32 = -17;
    /// `-ENODEV`: no such device.
    pub const ENODEV: i32 = -19;
    /// `-EINVAL`: invalid argument.
    pub const EINVAL: i32 = -22;
    /// `-ENOSPC`: no space left on device.
    pub const ENOSPC: i32 = -28;
    /// `-ENOTSUP` (`-EOPNOTSUPP` on Linux): operation not supported.
    pub const ENOTSUP: i32 = -95;
}

/// The `error` member of a JSON-RPC response, as SPDK sends it:
/// `{"code":-19,"message":"No such device"}`.
///
/// Handlers in a [`crate::server::RpcServer`] return it; clients get it back inside
/// [`RpcError::Spdk`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("JSON-RPC error {code}: {message}")]
pub struct SpdkError {
    /// Error code: a JSON-RPC standard code (-32700..-32600) or a negative errno.
    pub code: i32,
    /// Human-readable message (SPDK uses `strerror()` text for errno codes).
    pub message: String,
    /// Optional extra data (JSON-RPC 2.0 allows it; SPDK never sends it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

/// `strerror()` text for the errno values SPDK commonly returns (Linux/glibc wording).
fn strerror(errno: i32) -> Option<&'static str> {
    Some(match errno {
        1 => "Operation not permitted",
        2 => "No such file or directory",
        5 => "Input/output error",
        12 => "Cannot allocate memory",
        16 => "Device or resource busy",
        17 => "File exists",
        19 => "No such device",
        22 => "Invalid argument",
        28 => "No space left on device",
        95 => "Operation not supported",
        _ => return None,
    })
}

impl SpdkError {
    /// An error with an explicit code and message.
    pub fn new(code: i32, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            data: None,
        }
    }

    /// `-32700 Parse error`.
    pub fn parse_error() -> Self {
        Self::new(codes::PARSE_ERROR, "Parse error")
    }

    /// `-32600 Invalid request` with a detail message.
    pub fn invalid_request(message: impl Into<String>) -> Self {
        Self::new(codes::INVALID_REQUEST, message)
    }

    /// `-32601 Method not found`, SPDK's exact wording.
    pub fn method_not_found() -> Self {
        Self::new(codes::METHOD_NOT_FOUND, "Method not found")
    }

    /// `-32602` invalid params with a detail message.
    pub fn invalid_params(message: impl Into<String>) -> Self {
        Self::new(codes::INVALID_PARAMS, message)
    }

    /// `-32603` internal error with a detail message.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(codes::INTERNAL_ERROR, message)
    }

    /// An SPDK-style `-errno` error with the `strerror()` message, e.g.
    /// `from_errno(19)` (or `-19`) gives `{"code":-19,"message":"No such device"}`.
    pub fn from_errno(errno: i32) -> Self {
        let e = errno.saturating_abs();
        let message = strerror(e).map_or_else(|| format!("Unknown error {e}"), str::to_owned);
        Self::new(-e, message)
    }

    /// `-19 No such device`: SPDK's answer for a missing bdev or lvstore.
    pub fn no_such_device() -> Self {
        Self::from_errno(19)
    }

    /// `-17 File exists`: SPDK's answer for a duplicate name.
    pub fn exists() -> Self {
        Self::from_errno(17)
    }

    /// `-16 Device or resource busy`.
    pub fn busy() -> Self {
        Self::from_errno(16)
    }

    /// `-22 Invalid argument`.
    pub fn einval() -> Self {
        Self::from_errno(22)
    }

    /// Attach JSON-RPC `data` to the error.
    pub fn with_data(mut self, data: Value) -> Self {
        self.data = Some(data);
        self
    }

    /// True for "the object does not exist": `-19 ENODEV`, `-2 ENOENT`, and the `-32602`
    /// replies SPDK gives for missing bdevs/controllers in vhost calls ("No such device",
    /// "... does not exist", "No such file or directory").
    pub fn is_not_found(&self) -> bool {
        match self.code {
            codes::ENODEV | codes::ENOENT => true,
            codes::INVALID_PARAMS | codes::INTERNAL_ERROR => {
                let m = self.message.to_ascii_lowercase();
                m.contains("no such device")
                    || m.contains("does not exist")
                    || m.contains("no such file or directory")
                    || m.contains("not found")
            }
            _ => false,
        }
    }

    /// True for "the object already exists": `-17 EEXIST` or an "already exists"/"File exists"
    /// message under a generic code.
    pub fn is_exists(&self) -> bool {
        if self.code == codes::EEXIST {
            return true;
        }
        let m = self.message.to_ascii_lowercase();
        matches!(self.code, codes::INVALID_PARAMS | codes::INTERNAL_ERROR)
            && (m.contains("already exists") || m.contains("file exists"))
    }

    /// True for `-16 EBUSY` or a "Device or resource busy" message.
    pub fn is_busy(&self) -> bool {
        self.code == codes::EBUSY || self.message.contains("Device or resource busy")
    }

    /// True for `-28 ENOSPC` or SPDK's `-32602 "No space left on device"`.
    pub fn is_no_space(&self) -> bool {
        self.code == codes::ENOSPC || self.message.contains("No space left on device")
    }
}

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    /// The server answered with a JSON-RPC error object.
    #[error("SPDK error {code}: {message}")]
    Spdk {
        /// Error code (see [`codes`]).
        code: i32,
        /// Error message.
        message: String,
    },
    /// No reply within the call's timeout.
    #[error("{method}: no reply within {after:?}")]
    Timeout {
        /// The method called.
        method: String,
        /// The timeout that expired.
        after: Duration,
    },
    /// Could not connect to the server socket.
    #[error("cannot connect to {path}: {source}")]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// Underlying error.
        #[source]
        source: io::Error,
    },
    /// The connection broke while the call was in flight (and was not retried).
    #[error("connection lost: {0}")]
    Disconnected(String),
    /// The server sent something that is not a valid JSON-RPC response.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The reply's `result` does not have the expected type (or the params did not serialize).
    #[error("{method}: cannot decode result: {source}")]
    Decode {
        /// The method called.
        method: String,
        /// Underlying serde error.
        #[source]
        source: serde_json::Error,
    },
}

impl RpcError {
    /// The SPDK error, if the server answered with one.
    pub fn as_spdk(&self) -> Option<SpdkError> {
        match self {
            Self::Spdk { code, message } => Some(SpdkError::new(*code, message.clone())),
            _ => None,
        }
    }

    /// The JSON-RPC error code, if the server answered with one.
    pub fn code(&self) -> Option<i32> {
        match self {
            Self::Spdk { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// See [`SpdkError::is_not_found`]; false for non-SPDK errors.
    pub fn is_not_found(&self) -> bool {
        self.as_spdk().is_some_and(|e| e.is_not_found())
    }

    /// See [`SpdkError::is_exists`]; false for non-SPDK errors.
    pub fn is_exists(&self) -> bool {
        self.as_spdk().is_some_and(|e| e.is_exists())
    }

    /// See [`SpdkError::is_busy`]; false for non-SPDK errors.
    pub fn is_busy(&self) -> bool {
        self.as_spdk().is_some_and(|e| e.is_busy())
    }

    /// See [`SpdkError::is_no_space`]; false for non-SPDK errors.
    pub fn is_no_space(&self) -> bool {
        self.as_spdk().is_some_and(|e| e.is_no_space())
    }

    /// True if the call failed for transport reasons (timeout, connect, lost connection).
    pub fn is_transport(&self) -> bool {
        matches!(
            self,
            Self::Timeout { .. } | Self::Connect { .. } | Self::Disconnected(_)
        )
    }
}

impl From<SpdkError> for RpcError {
    fn from(e: SpdkError) -> Self {
        Self::Spdk {
            code: e.code,
            message: e.message,
        }
    }
}

/// Why an [`crate::server::RpcServer`] could not be set up or run.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A unix socket path must fit `sockaddr_un.sun_path` (108 bytes with the NUL).
    #[error("socket path {path:?} is {len} bytes, longer than the {max}-byte limit of sun_path")]
    PathTooLong {
        /// The path.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
        /// The limit (107).
        max: usize,
    },
    /// Something that is not a socket is in the way.
    #[error("{0:?} exists and is not a unix socket; refusing to remove it")]
    NotASocket(PathBuf),
    /// [`crate::server::ServerConfig::group`] found no such group.
    #[error("no group named {0:?} in /etc/group")]
    UnknownGroup(String),
    /// Another server is listening on the path.
    #[error("{0:?} is in use by a live server")]
    InUse(PathBuf),
    /// An I/O error while binding or setting permissions.
    #[error("{what} {path:?}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The socket path.
        path: PathBuf,
        /// Underlying error.
        #[source]
        source: io::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_messages_match_spdk() {
        let e = SpdkError::from_errno(-19);
        assert_eq!(e, SpdkError::new(-19, "No such device"));
        assert_eq!(SpdkError::exists().message, "File exists");
        assert_eq!(SpdkError::einval().message, "Invalid argument");
        assert_eq!(SpdkError::from_errno(4242).code, -4242);
    }

    #[test]
    fn classification() {
        assert!(SpdkError::no_such_device().is_not_found());
        assert!(SpdkError::from_errno(2).is_not_found());
        assert!(SpdkError::invalid_params("No such device").is_not_found());
        assert!(SpdkError::invalid_params("bdev foo does not exist").is_not_found());
        assert!(!SpdkError::invalid_params("No space left on device").is_not_found());
        assert!(SpdkError::invalid_params("No space left on device").is_no_space());
        assert!(SpdkError::exists().is_exists());
        assert!(!SpdkError::method_not_found().is_not_found());
        let r: RpcError = SpdkError::exists().into();
        assert!(r.is_exists());
        assert_eq!(r.code(), Some(-17));
    }

    #[test]
    fn serializes_like_spdk() {
        let v = serde_json::to_string(&SpdkError::method_not_found()).unwrap();
        assert_eq!(v, r#"{"code":-32601,"message":"Method not found"}"#);
    }
}
