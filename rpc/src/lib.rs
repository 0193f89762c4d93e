//! SPDK JSON-RPC 2.0 over a unix stream socket: wire types, a client and server plumbing.
//!
//! - [`wire`]: request/response envelopes, [`SpdkError`], the [`wire::StreamDecoder`] that
//!   frames back-to-back JSON values, and [`wire::typed`] for params.
//! - [`methods`]: typed params and results of the SPDK methods katablk uses, with SPDK's exact
//!   parameter names and reply shapes.
//! - [`client`]: [`RpcClient`], an async pipelining client (one connection, many callers).
//! - [`server`]: [`RpcServer`], the unix-socket accept loop and per-connection dispatch to a
//!   [`server::Handler`], plus [`server::Router`], a method-name registry.
//!
//! ```no_run
//! use std::sync::Arc;
//! use katablk_rpc::{methods::*, RpcClient, Router, RpcServer, ServerConfig, SpdkError};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let router = Router::new().method::<BdevLvolDelete, _, _>(|p: LvolNameParams| async move {
//!     if p.name == "lvs0/lvol0" { Ok(true) } else { Err(SpdkError::no_such_device()) }
//! });
//! let server = RpcServer::bind(ServerConfig::new("/var/tmp/spdk.sock"))?;
//! tokio::spawn(server.serve(Arc::new(router)));
//!
//! let client = RpcClient::new("/var/tmp/spdk.sock");
//! match client.bdev_lvol_delete("lvs0/lvol1").await {
//!     Err(e) if e.is_not_found() => {} // already gone: an idempotent delete succeeds
//!     r => {
//!         r?;
//!     }
//! }
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

pub mod client;
pub mod error;
pub mod methods;
pub mod server;
pub mod wire;

pub use client::{RpcClient, DEFAULT_SOCKET_PATH};
pub use error::{codes, RpcError, ServerError, SpdkError};
pub use server::{Handler, Router, RpcServer, ServerConfig};
