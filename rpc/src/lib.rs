//! SPDK JSON-RPC 2.0 over a unix stream socket: wire types, a client and server plumbing.
//!
//! - [`wire`]: request/response envelopes, [`SpdkError`], the [`wire::StreamDecoder`] that
//!   frames back-to-back JSON values, and [`wire::typed`] for params.
//! - [`methods`]: typed params and results of the SPDK methods katablk uses, with SPDK's exact
//!   parameter names and reply shapes.
//! - [`client`]: [`RpcClient`], an async pipelining client (one connection, many callers).
//! - [`server`]: [`RpcServer`], the unix-socket accept loop and per-connection dispatch to a
//!   [`server::Handler`], plus [`server::Router`], a method-name registry.

#![deny(missing_docs)]

pub mod client;
pub mod error;
pub mod methods;
pub mod server;
pub mod wire;

pub use client::{RpcClient, DEFAULT_SOCKET_PATH};
pub use error::{codes, RpcError, ServerError, SpdkError};
pub use server::{Handler, Router, RpcServer, ServerConfig};
