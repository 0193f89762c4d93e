//! SPDK JSON-RPC 2.0 over a unix stream socket: wire types, a client and server plumbing.
//!
//! Not implemented yet: this crate is filled by the target issue.

#![deny(missing_docs)]
