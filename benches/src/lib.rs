//! Benchmarks for katablk: a vhost-user-blk load generator and report tooling.
//!
//! The crate has four binaries:
//! - `katablk-bench`: a fio-like load generator on libblkio (`virtio-blk-vhost-user` driver);
//! - `katablk-bench-summary`: aggregates raw JSON results (median over rounds, ratios);
//! - `katablk-bench-plot`: draws PNG bar charts from a summary;
//! - `katablk-bench-qos`: the rate-limit benchmark's verdicts, summary and timeline charts.
//!
//! The modules below hold everything the binaries share, so it can be unit tested.

#![deny(missing_docs)]

pub mod cli;
pub mod cpu;
pub mod engine;
pub mod pattern;
pub mod plotting;
pub mod qos;
pub mod report;
pub mod size;
pub mod stats;
pub mod summary;
