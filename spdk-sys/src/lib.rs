//! Bindings to SPDK, generated with bindgen when the `spdk` feature is enabled and SPDK is found.
//!
//! Not implemented yet: this crate is filled by the spdk-sys issue; without the feature it is empty.

#![deny(missing_docs)]
