//! Logical volume store (SPDK blobstore/lvol model) on any katablk `BlockDevice`.
//!
//! Not implemented yet: this crate is filled by the lvol issue.

#![deny(missing_docs)]
