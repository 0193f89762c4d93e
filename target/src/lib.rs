//! The embedded SPDK-compatible target: bdevs, lvstores and vhost-user-blk controllers driven by
//! SPDK JSON-RPC.
//!
//! Not implemented yet: this crate is filled by the target issue.

#![deny(missing_docs)]
