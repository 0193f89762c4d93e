//! The CSI driver: Identity, Controller and Node services for Kata vhost-user-blk volumes.
//!
//! Not implemented yet: this crate is filled by the CSI issue.

#![deny(missing_docs)]
