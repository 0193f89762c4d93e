//! Benchmarks for katablk: a vhost-user-blk load generator and report tooling.

#![deny(missing_docs)]
