//! A safe layer over SPDK's bindings (`spdk-sys`), and the `katablk-spdk` binary.
//!
//! The safe layer (with the `spdk` feature; its modules are documented in a `--features spdk`
//! build): `app` starts and stops the SPDK application framework (environment, reactors,
//! subsystems, JSON config, JSON-RPC server) on its own OS thread; `thread` sends messages to
//! SPDK threads and registers pollers; `bdev` opens SPDK bdevs as katablk
//! `katablk_bdev::BlockDevice`s (one SPDK thread and io_channel per katablk channel, guest
//! iovecs passed straight to the bdev); `dma` allocates DMA-able buffers; [`mem`] registers
//! guest memory with SPDK's memory map; `rpc` registers JSON-RPC methods implemented in Rust.
//!
//! The pure-Rust parts — environment options and their validation, core masks, the JSON token
//! conversion of RPC parameters, memory-registration alignment — are here in every build and
//! unit-tested.

#![deny(missing_docs)]

pub mod env;
pub mod json;
pub mod mem;

#[cfg(feature = "spdk")]
pub mod app;
#[cfg(feature = "spdk")]
pub mod bdev;
#[cfg(feature = "spdk")]
pub mod dma;
#[cfg(feature = "spdk")]
pub mod rpc;
#[cfg(feature = "spdk")]
pub mod runtime;
#[cfg(feature = "spdk")]
pub mod thread;

/// A negative errno as text.
fn errno(rc: i32) -> std::io::Error {
    std::io::Error::from_raw_os_error(rc.saturating_neg())
}

/// Errors of the SPDK layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Invalid environment options.
    #[error(transparent)]
    Env(#[from] env::EnvError),
    /// A name or argument SPDK cannot take.
    #[error("invalid argument: {0}")]
    InvalidName(String),
    /// An SPDK call failed with a negative errno.
    #[error("{0} failed: {e}", e = errno(*.1))]
    Call(&'static str, i32),
    /// A bdev could not be opened.
    #[error("cannot open bdev {0}: {e}", e = errno(*.1))]
    OpenBdev(String, i32),
    /// The call must be made on an SPDK thread.
    #[error("{0} must be called on an SPDK thread")]
    NotOnSpdkThread(&'static str),
    /// The call would block an SPDK thread.
    #[error("blocking call made on an SPDK thread")]
    OnSpdkThread,
    /// The framework is not running (any more).
    #[error("the SPDK application is not running")]
    Stopped,
    /// An application was already started in this process (DPDK initialises once).
    #[error("an SPDK application was already started in this process")]
    AlreadyStarted,
    /// `spdk_app_start` failed.
    #[error("SPDK failed to start (rc {0}); see its log above")]
    StartFailed(i32),
    /// A system call failed.
    #[error("{0}: {1}")]
    Io(&'static str, #[source] std::io::Error),
}

/// The raw bindings, from `spdk-sys`.
#[cfg(feature = "spdk")]
use spdk_sys::ffi;
