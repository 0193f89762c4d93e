//! Helpers shared by the integration tests of every katablk crate, each in one place (as
//! cloud-hypervisor's `test_infra` and mayastor's `io-engine-tests`): a dev-dependency only,
//! never published.
//!
//! - [`blk`]: the libblkio vhost-user-blk client the tests drive servers with (queue-aware
//!   requests, read-only connect, libblkio's buffer or a 2 MiB-aligned hugepage one, one
//!   request timeout);
//! - [`daemon`]: a child process serving a socket (`katablk-vhost`, `katablk-target`, SPDK's
//!   `vhost`, `katablk-csi`, `qemu-storage-daemon`): spawn, wait for the socket, log capture,
//!   SIGTERM, kill -9, killed when dropped;
//! - [`bin`] and [`bin_path!`]: where a workspace binary was built;
//! - [`spdk_rpc`]: SPDK's python client `spdk-rpc`, found and run;
//! - [`pattern`]: deterministic data to write and check;
//! - [`files`]: sparse image files and memfds;
//! - [`raw`]: a raw, possibly hostile vhost-user frontend writing the wire format itself.
//!
//! A test crate names it in `[dev-dependencies]` and uses it from `tests/common`, next to what
//! only that crate needs.

#![warn(missing_docs)]

pub mod bin;
pub mod blk;
pub mod daemon;
pub mod files;
pub mod pattern;
pub mod raw;
pub mod spdk_rpc;

pub use blk::Client;
pub use daemon::Daemon;
