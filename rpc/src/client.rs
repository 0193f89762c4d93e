//! An async SPDK JSON-RPC client over a unix socket.
//!
//! One [`RpcClient`] holds one connection, shared by every task that clones it: requests are
//! pipelined (written back to back by a writer task, so a cancelled call never leaves half a
//! request on the socket) and a reader task matches replies to callers by id, so replies may
//! arrive in any order. The connection is opened on first use and re-opened after it breaks.
//!
//! ## Retries on a broken connection
//! - A request that was never completely written (the connection was already known to be
//!   dead, or the write failed) cannot have run, so it is retried once on a new connection,
//!   whatever the method.
//! - A request that was written but whose reply was lost with the connection is retried once
//!   only if the method is an idempotent read ([`Method::IDEMPOTENT`]): `spdk_get_version`,
//!   `rpc_get_methods`, `framework_wait_init`, `framework_get_subsystems`,
//!   `framework_get_config`, `bdev_get_bdevs`, `bdev_get_iostat`, `bdev_wait_for_examine`,
//!   `bdev_lvol_get_lvstores`, `bdev_lvol_get_lvols`, `vhost_get_controllers`. A mutation
//!   (create/delete/resize/...) fails with [`RpcError::Disconnected`]: it may or may not have
//!   run, and the caller decides (the CSI driver re-issues it and treats
//!   [`RpcError::is_exists`] / [`RpcError::is_not_found`] as success).
//! - Timeouts are never retried.
//!
//! ## Idle connections
//! A server may close connections that stay idle (katablk-target does after 10 minutes). So
//! that a call never races such a close, a connection unused for
//! [`RpcClientBuilder::idle_reconnect`] (default one minute) is closed by the client and a new
//! one is opened for the next call.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::error::RpcError;
use crate::methods::*;
use crate::wire::{params_value, Id, Request, Response, StreamDecoder, DEFAULT_MAX_MESSAGE_SIZE};

/// SPDK's default RPC socket.
pub const DEFAULT_SOCKET_PATH: &str = "/var/tmp/spdk.sock";

/// Default per-call timeout (SPDK's python client also waits 60 s).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Default connect timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Default [`RpcClientBuilder::idle_reconnect`]: a minute, well below katablk-target's
/// 10-minute server-side idle timeout.
pub const DEFAULT_IDLE_RECONNECT: Duration = Duration::from_secs(60);

/// Builder for [`RpcClient`].
#[derive(Debug, Clone)]
pub struct RpcClientBuilder {
    path: PathBuf,
    timeout: Duration,
    connect_timeout: Duration,
    max_message_size: usize,
    idle_reconnect: Duration,
}

impl RpcClientBuilder {
    /// Default per-call timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Connect timeout.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Largest accepted reply, in bytes (default 64 MiB).
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.max_message_size = bytes;
        self
    }

    /// Open a new connection for a call when the current one has been unused this long
    /// (so that the server's idle timeout never closes it under a call).
    pub fn idle_reconnect(mut self, idle: Duration) -> Self {
        self.idle_reconnect = idle;
        self
    }

    /// Build the client; it connects on first use.
    pub fn build(self) -> RpcClient {
        RpcClient {
            inner: Arc::new(Inner {
                path: self.path,
                timeout: self.timeout,
                connect_timeout: self.connect_timeout,
                max_message_size: self.max_message_size,
                idle_reconnect: self.idle_reconnect,
                next_id: AtomicU64::new(1),
                conn: tokio::sync::Mutex::new(None),
            }),
        }
    }
}

/// A cloneable handle to one pipelined JSON-RPC connection. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct RpcClient {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    timeout: Duration,
    connect_timeout: Duration,
    max_message_size: usize,
    idle_reconnect: Duration,
    next_id: AtomicU64,
    conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
}

type ReplyTx = oneshot::Sender<Result<Response, RpcError>>;

/// State shared between callers and the reader task.
#[derive(Debug, Default)]
struct Shared {
    pending: HashMap<u64, ReplyTx>,
    /// Why the connection is dead, once it is.
    closed: Option<String>,
    /// When a call was last sent or a reply last received.
    last_used: Option<Instant>,
}

struct WriteReq {
    bytes: Vec<u8>,
    done: oneshot::Sender<Result<(), String>>,
}

#[derive(Debug)]
struct Conn {
    shared: Arc<Mutex<Shared>>,
    writes: mpsc::UnboundedSender<WriteReq>,
    reader: JoinHandle<()>,
    writer: JoinHandle<()>,
}

impl std::fmt::Debug for WriteReq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteReq")
            .field("len", &self.bytes.len())
            .finish()
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.reader.abort();
        self.writer.abort();
    }
}

/// Lock the shared state, recovering from a poisoned lock (the state stays consistent: every
/// critical section is a single map operation).
fn lock(shared: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Mark the connection dead and fail every waiting call.
fn close_shared(shared: &Mutex<Shared>, reason: String) {
    let pending = {
        let mut s = lock(shared);
        if s.closed.is_none() {
            s.closed = Some(reason.clone());
        }
        std::mem::take(&mut s.pending)
    };
    for (_, tx) in pending {
        let _ = tx.send(Err(RpcError::Disconnected(reason.clone())));
    }
}

impl Conn {
    fn is_closed(&self) -> bool {
        lock(&self.shared).closed.is_some()
    }

    /// True if nothing is in flight and nothing was sent or received for `idle`.
    fn is_idle(&self, idle: Duration) -> bool {
        let s = lock(&self.shared);
        s.pending.is_empty() && s.last_used.is_some_and(|t| t.elapsed() >= idle)
    }

    fn open(stream: UnixStream, max_message_size: usize) -> Self {
        let (rd, wr) = stream.into_split();
        let shared = Arc::new(Mutex::new(Shared::default()));
        let (tx, rx) = mpsc::unbounded_channel();
        let reader = tokio::spawn(read_replies(rd, Arc::clone(&shared), max_message_size));
        let writer = tokio::spawn(write_requests(wr, rx, Arc::clone(&shared)));
        Self {
            shared,
            writes: tx,
            reader,
            writer,
        }
    }
}

async fn write_requests(
    mut wr: tokio::net::unix::OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<WriteReq>,
    shared: Arc<Mutex<Shared>>,
) {
    let mut failed: Option<String> = None;
    while let Some(req) = rx.recv().await {
        if let Some(reason) = &failed {
            let _ = req.done.send(Err(reason.clone()));
            continue;
        }
        match wr.write_all(&req.bytes).await {
            Ok(()) => {
                let _ = req.done.send(Ok(()));
            }
            Err(e) => {
                let reason = format!("write failed: {e}");
                let _ = req.done.send(Err(reason.clone()));
                close_shared(&shared, reason.clone());
                failed = Some(reason);
            }
        }
    }
}

async fn read_replies(
    mut rd: tokio::net::unix::OwnedReadHalf,
    shared: Arc<Mutex<Shared>>,
    max: usize,
) {
    let mut dec = StreamDecoder::new(max);
    let mut buf = vec![0u8; 64 * 1024];
    let reason = 'conn: loop {
        let n = match rd.read(&mut buf).await {
            Ok(0) => break 'conn "server closed the connection".to_owned(),
            Ok(n) => n,
            Err(e) => break 'conn format!("read failed: {e}"),
        };
        dec.feed(&buf[..n]);
        loop {
            let v = match dec.next_value() {
                Ok(Some(v)) => v,
                Ok(None) => break,
                Err(e) => break 'conn format!("undecodable reply: {e}"),
            };
            let raw_id = v.get("id").and_then(Value::as_u64);
            let resp = match Response::from_value(v) {
                Ok(r) => r,
                Err(e) => {
                    warn!("invalid JSON-RPC reply: {e}");
                    // Fail the caller it belongs to, if we can tell.
                    if let Some(tx) = raw_id.and_then(|id| lock(&shared).pending.remove(&id)) {
                        let _ = tx.send(Err(RpcError::Protocol(e)));
                    }
                    continue;
                }
            };
            let id = match &resp.id {
                Id::Number(n) => n.as_u64(),
                _ => None,
            };
            match id {
                Some(id) => {
                    let tx = {
                        let mut s = lock(&shared);
                        s.last_used = Some(Instant::now());
                        s.pending.remove(&id)
                    };
                    match tx {
                        Some(tx) => {
                            let _ = tx.send(Ok(resp));
                        }
                        None => debug!(id, "dropping reply nobody waits for (timed out?)"),
                    }
                }
                None => {
                    // A reply the server could not tie to a request (e.g. -32700 with a null
                    // id): our stream is out of sync; fail everything.
                    let what = match &resp.payload {
                        Err(e) => format!("server error without request id: {e}"),
                        Ok(_) => "reply without a usable id".to_owned(),
                    };
                    let pending = std::mem::take(&mut lock(&shared).pending);
                    for (_, tx) in pending {
                        let _ = tx.send(Err(RpcError::Protocol(what.clone())));
                    }
                }
            }
        }
    };
    debug!("RPC client connection closed: {reason}");
    close_shared(&shared, reason);
}

/// Removes a pending entry when the call ends, however it ends.
struct PendingGuard<'a> {
    shared: &'a Mutex<Shared>,
    id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        lock(self.shared).pending.remove(&self.id);
    }
}

/// How a single attempt failed.
enum Attempt {
    /// The request was not (completely) written: safe to retry.
    NotSent(RpcError),
    /// Written, then the connection died.
    Lost(RpcError),
    /// Anything else (timeout, protocol): final.
    Final(RpcError),
}

impl RpcClient {
    /// A client for `path` with default settings; connects on first use.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self::builder(path).build()
    }

    /// A client for SPDK's default socket, [`DEFAULT_SOCKET_PATH`].
    pub fn default_socket() -> Self {
        Self::new(DEFAULT_SOCKET_PATH)
    }

    /// A builder with default settings.
    pub fn builder(path: impl Into<PathBuf>) -> RpcClientBuilder {
        RpcClientBuilder {
            path: path.into(),
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            idle_reconnect: DEFAULT_IDLE_RECONNECT,
        }
    }

    /// Connect now (instead of on first call), reporting [`RpcError::Connect`] early.
    pub async fn connect(path: impl Into<PathBuf>) -> Result<Self, RpcError> {
        let c = Self::new(path);
        let deadline = Instant::now() + c.inner.connect_timeout;
        c.connection(deadline).await?;
        Ok(c)
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The default per-call timeout.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// Drop the current connection (in-flight calls fail with [`RpcError::Disconnected`]);
    /// the next call reconnects.
    pub async fn disconnect(&self) {
        if let Some(c) = self.inner.conn.lock().await.take() {
            close_shared(&c.shared, "disconnected by client".to_owned());
        }
    }

    async fn connection(&self, deadline: Instant) -> Result<Arc<Conn>, RpcError> {
        let mut slot = self.inner.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            if c.is_idle(self.inner.idle_reconnect) {
                debug!("RPC client connection idle; opening a new one");
                close_shared(&c.shared, "idle connection replaced".to_owned());
            } else if !c.is_closed() {
                return Ok(Arc::clone(c));
            }
        }
        *slot = None;
        let limit = deadline.min(Instant::now() + self.inner.connect_timeout);
        let path = &self.inner.path;
        let stream = match tokio::time::timeout_at(limit, UnixStream::connect(path)).await {
            Ok(Ok(s)) => s,
            Ok(Err(source)) => {
                return Err(RpcError::Connect {
                    path: path.clone(),
                    source,
                })
            }
            Err(_) => {
                let source = std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out");
                return Err(RpcError::Connect {
                    path: path.clone(),
                    source,
                });
            }
        };
        debug!(path = %path.display(), "RPC client connected");
        let c = Arc::new(Conn::open(stream, self.inner.max_message_size));
        *slot = Some(Arc::clone(&c));
        Ok(c)
    }

    async fn forget(&self, conn: &Arc<Conn>) {
        let mut slot = self.inner.conn.lock().await;
        if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
            *slot = None;
        }
    }

    async fn attempt(
        &self,
        conn: &Conn,
        method: &str,
        params: &Option<Value>,
        deadline: Instant,
    ) -> Result<Value, Attempt> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let req = Request::new(method, Id::from(id), params.clone());
        let mut bytes = serde_json::to_vec(&req).map_err(|source| {
            Attempt::Final(RpcError::Decode {
                method: method.to_owned(),
                source,
            })
        })?;
        bytes.push(b'\n');
        let (reply_tx, reply_rx) = oneshot::channel();
        {
            let mut s = lock(&conn.shared);
            if let Some(reason) = &s.closed {
                return Err(Attempt::NotSent(RpcError::Disconnected(reason.clone())));
            }
            s.pending.insert(id, reply_tx);
            s.last_used = Some(Instant::now());
        }
        // Unregisters on every exit, including the caller dropping this future.
        let _pending = PendingGuard {
            shared: &conn.shared,
            id,
        };
        let (done_tx, done_rx) = oneshot::channel();
        if conn
            .writes
            .send(WriteReq {
                bytes,
                done: done_tx,
            })
            .is_err()
        {
            return Err(Attempt::NotSent(RpcError::Disconnected(
                "writer stopped".to_owned(),
            )));
        }
        let timeout = |after: Duration| RpcError::Timeout {
            method: method.to_owned(),
            after,
        };
        let total = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout_at(deadline, done_rx).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(reason))) => {
                return Err(Attempt::NotSent(RpcError::Disconnected(reason)));
            }
            Ok(Err(_)) => {
                return Err(Attempt::NotSent(RpcError::Disconnected(
                    "writer stopped".to_owned(),
                )));
            }
            Err(_) => {
                return Err(Attempt::Final(timeout(total)));
            }
        }
        match tokio::time::timeout_at(deadline, reply_rx).await {
            Ok(Ok(Ok(resp))) => Ok(resp
                .payload
                .map_err(RpcError::from)
                .map_err(Attempt::Final)?),
            Ok(Ok(Err(e @ RpcError::Disconnected(_)))) => Err(Attempt::Lost(e)),
            Ok(Ok(Err(e))) => Err(Attempt::Final(e)),
            Ok(Err(_)) => Err(Attempt::Lost(RpcError::Disconnected(
                "connection dropped".to_owned(),
            ))),
            Err(_) => Err(Attempt::Final(timeout(total))),
        }
    }

    /// Call `method` with raw params; see [`call_with`](Self::call_with).
    pub async fn call_value(
        &self,
        method: &str,
        params: Option<Value>,
        idempotent: bool,
        timeout: Duration,
    ) -> Result<Value, RpcError> {
        let deadline = Instant::now() + timeout;
        let mut retried = false;
        loop {
            let conn = self.connection(deadline).await?;
            match self.attempt(&conn, method, &params, deadline).await {
                Ok(v) => return Ok(v),
                Err(Attempt::Final(e)) => return Err(e),
                Err(Attempt::NotSent(e)) => {
                    self.forget(&conn).await;
                    if retried {
                        return Err(e);
                    }
                    debug!(method, "request not sent ({e}); reconnecting and retrying");
                }
                Err(Attempt::Lost(e)) => {
                    self.forget(&conn).await;
                    if retried || !idempotent {
                        return Err(e);
                    }
                    debug!(method, "reply lost ({e}); retrying idempotent call");
                }
            }
            retried = true;
        }
    }

    /// Call any method: serialize `params` (`()` or an empty struct means no params), wait for
    /// the reply within the default timeout, decode `result` as `R`. Treated as
    /// non-idempotent (see the [module docs](self) on retries).
    pub async fn call<P: Serialize, R: DeserializeOwned>(
        &self,
        method: &str,
        params: &P,
    ) -> Result<R, RpcError> {
        self.call_with(method, params, false, self.inner.timeout)
            .await
    }

    /// [`call`](Self::call) with an explicit idempotency flag and timeout.
    pub async fn call_with<P: Serialize, R: DeserializeOwned>(
        &self,
        method: &str,
        params: &P,
        idempotent: bool,
        timeout: Duration,
    ) -> Result<R, RpcError> {
        let params = params_value(params).map_err(|source| RpcError::Decode {
            method: method.to_owned(),
            source,
        })?;
        let v = self.call_value(method, params, idempotent, timeout).await?;
        serde_json::from_value(v).map_err(|source| RpcError::Decode {
            method: method.to_owned(),
            source,
        })
    }

    /// Call a typed method with the default timeout.
    pub async fn call_method<M: Method>(&self, params: &M::Params) -> Result<M::Result, RpcError> {
        self.call_with(M::NAME, params, M::IDEMPOTENT, self.inner.timeout)
            .await
    }

    /// Call a typed method with an explicit timeout.
    pub async fn call_method_timeout<M: Method>(
        &self,
        params: &M::Params,
        timeout: Duration,
    ) -> Result<M::Result, RpcError> {
        self.call_with(M::NAME, params, M::IDEMPOTENT, timeout)
            .await
    }
}
