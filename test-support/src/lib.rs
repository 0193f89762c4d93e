//! Helpers shared by the integration tests of every katablk crate, each in one place (as
//! cloud-hypervisor's `test_infra` and mayastor's `io-engine-tests`): a dev-dependency only,
//! never published.
//!
//! - [`blk`]: the libblkio vhost-user-blk client the tests drive servers with (queue-aware
//!   requests, read-only connect, libblkio's buffer or a 2 MiB-aligned hugepage one, one
//!   request timeout).
//!
//! A test crate names it in `[dev-dependencies]` and uses it from `tests/common`, next to what
//! only that crate needs.

#![warn(missing_docs)]

pub mod blk;

pub use blk::Client;
