//! Server plumbing for the target daemon: a unix-socket accept loop speaking SPDK's JSON-RPC.
//!
//! [`RpcServer::bind`] prepares the socket (removing a stale one, mode 0600 by default,
//! optional group); [`RpcServer::serve_until`] accepts connections and dispatches every request
//! to a [`Handler`]. [`Router`] is a ready-made handler: a registry of method names with
//! typed or raw handler functions, which also answers `rpc_get_methods`.
//!
//! Per connection:
//! - bytes are framed with [`StreamDecoder`] (no newlines needed, partial reads and pipelined
//!   requests are fine);
//! - each request runs in its own task, so handlers run concurrently, but replies are written
//!   in request order (as SPDK does), each followed by `\n`;
//! - notifications (no `id`) run but get no reply;
//! - a batch (JSON array) or a non-request value gets `-32600` and the connection goes on;
//! - invalid JSON gets a `-32700` reply with `"id": null` and the connection is closed after
//!   the replies before it are written: without framing, the stream cannot be resynchronized
//!   after a syntax error. (SPDK itself closes without a reply.) A message over the size limit
//!   gets `-32600` and is closed the same way; so does a request cut short by end of stream;
//! - a panicking handler yields `-32603` for that request; the server keeps running.
//!
//! Limits, so that no client can exhaust the daemon's memory, threads or file descriptors
//! (each in [`ServerConfig`]):
//! - at most [`ServerConfig::max_in_flight`] requests *and notifications* run or wait to be
//!   written per connection; past that the server stops reading from the connection, so a
//!   flood of notifications is back-pressured like pipelined calls and spawns no more tasks;
//! - at most [`ServerConfig::max_connections`] connections: further ones get one `-32603`
//!   error reply (id `null`) and are closed, with a rate-limited warning in the log;
//! - a connection that sends nothing for [`ServerConfig::idle_timeout`] while none of its
//!   requests is in flight is closed (default 10 minutes; [`crate::RpcClient`] reconnects by
//!   itself and, idle for a minute, opens a fresh connection before its next call);
//! - the bytes buffered for partial messages, across all connections, stay within
//!   [`ServerConfig::max_buffered_total`] (the first [`ServerConfig::unbudgeted_per_connection`]
//!   bytes of each connection are not counted, so small calls never fail); a connection whose
//!   next read would exceed it gets a `-12` (ENOMEM) error reply and is closed. The
//!   per-message limit [`ServerConfig::max_message_size`] still applies.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, error, info, warn};

use crate::error::ServerError;
use crate::methods::{Method, RpcGetMethods, RpcGetMethodsParams};
use crate::wire::{
    typed, DecodeError, Id, Request, Response, SpdkError, StreamDecoder, DEFAULT_MAX_MESSAGE_SIZE,
};

/// Longest unix socket path: `sun_path` is 108 bytes including the terminating NUL.
pub const MAX_SOCKET_PATH_LEN: usize = 107;

/// Default [`ServerConfig::max_in_flight`].
pub const DEFAULT_MAX_IN_FLIGHT: usize = 256;

/// Default [`ServerConfig::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 128;

/// Default [`ServerConfig::idle_timeout`]: 10 minutes.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// Default [`ServerConfig::max_buffered_total`]: 128 MiB, twice the default message limit.
pub const DEFAULT_MAX_BUFFERED_TOTAL: usize = 128 * 1024 * 1024;

/// Default [`ServerConfig::unbudgeted_per_connection`]: 256 KiB.
pub const DEFAULT_UNBUDGETED_PER_CONNECTION: usize = 256 * 1024;

/// How often at most the "refusing connection" warning is logged.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Serves JSON-RPC calls. Implementations must be cheap to share: the server holds an
/// `Arc<Self>` and calls it from many tasks at once.
///
/// Implement it with `async fn call(...)` (the returned future must be `Send`), or use
/// [`Router`].
pub trait Handler: Send + Sync + 'static {
    /// Run `method` with `params` (`None` when the request had none). Return the `result`
    /// value or the error to send. Unknown methods should return
    /// [`SpdkError::method_not_found`].
    fn call(
        &self,
        method: &str,
        params: Option<Value>,
    ) -> impl Future<Output = Result<Value, SpdkError>> + Send;
}

/// A boxed handler future, as stored in a [`Router`].
pub type BoxFuture = Pin<Box<dyn Future<Output = Result<Value, SpdkError>> + Send>>;

type RouteFn = Arc<dyn Fn(Option<Value>) -> BoxFuture + Send + Sync>;

/// A [`Handler`] built from a registry of methods.
///
/// `rpc_get_methods` is answered from the registry (in registration order, itself included)
/// unless a route for it is registered explicitly. Unknown methods get `-32601 Method not
/// found`, SPDK's wording.
///
/// ```
/// use katablk_rpc::methods::{SpdkGetVersion, VersionInfo, VersionFields, NoParams};
/// use katablk_rpc::server::Router;
/// let router = Router::new().method::<SpdkGetVersion, _, _>(|_: NoParams| async {
///     Ok(VersionInfo {
///         version: "katablk v0.1.0".into(),
///         fields: VersionFields { major: 0, minor: 1, patch: 0, suffix: String::new(), commit: None },
///     })
/// });
/// assert!(router.method_names().contains(&"spdk_get_version"));
/// ```
#[derive(Clone, Default)]
pub struct Router {
    order: Vec<String>,
    routes: HashMap<String, RouteFn>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("methods", &self.order)
            .finish()
    }
}

impl Router {
    /// An empty registry (answering only `rpc_get_methods`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Register a raw handler: it gets the params as sent and returns the result value.
    /// Registering a name twice replaces the earlier handler.
    pub fn route<F, Fut>(mut self, name: impl Into<String>, f: F) -> Self
    where
        F: Fn(Option<Value>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, SpdkError>> + Send + 'static,
    {
        let name = name.into();
        let f: RouteFn = Arc::new(move |p| Box::pin(f(p)) as BoxFuture);
        if self.routes.insert(name.clone(), f).is_none() {
            self.order.push(name);
        }
        self
    }

    /// Register a typed handler for method `M`: params are parsed with [`typed`] (so unknown
    /// or mistyped params give `-32602` naming the field) and the result is serialized.
    pub fn method<M, F, Fut>(self, f: F) -> Self
    where
        M: Method,
        F: Fn(M::Params) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<M::Result, SpdkError>> + Send + 'static,
    {
        let f = Arc::new(f);
        self.route(M::NAME, move |params| {
            let f = Arc::clone(&f);
            async move {
                let p: M::Params = typed(params)?;
                let r = f(p).await?;
                serde_json::to_value(r)
                    .map_err(|e| SpdkError::internal(format!("cannot encode result: {e}")))
            }
        })
    }

    /// Registered method names, in registration order, including `rpc_get_methods`.
    pub fn method_names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.order.iter().map(String::as_str).collect();
        if !self.routes.contains_key(RpcGetMethods::NAME) {
            v.push(RpcGetMethods::NAME);
        }
        v
    }

    /// True if `name` is registered.
    pub fn has_method(&self, name: &str) -> bool {
        name == RpcGetMethods::NAME || self.routes.contains_key(name)
    }
}

impl Handler for Router {
    fn call(
        &self,
        method: &str,
        params: Option<Value>,
    ) -> impl Future<Output = Result<Value, SpdkError>> + Send {
        let route = self.routes.get(method).cloned();
        let builtin_methods = (route.is_none() && method == RpcGetMethods::NAME).then(|| {
            self.method_names()
                .into_iter()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        });
        async move {
            if let Some(route) = route {
                return route(params).await;
            }
            match builtin_methods {
                Some(names) => {
                    let _: RpcGetMethodsParams = typed(params)?;
                    Ok(Value::from(names))
                }
                None => Err(SpdkError::method_not_found()),
            }
        }
    }
}

impl<H: Handler> Handler for Arc<H> {
    fn call(
        &self,
        method: &str,
        params: Option<Value>,
    ) -> impl Future<Output = Result<Value, SpdkError>> + Send {
        (**self).call(method, params)
    }
}

/// How to set up an [`RpcServer`].
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Socket path (SPDK's default is `/var/tmp/spdk.sock`).
    pub path: PathBuf,
    /// Permission bits of the socket file (default `0o600`).
    pub mode: u32,
    /// Group to give the socket to (numeric gid), e.g. so a CSI driver in that group can
    /// connect with mode `0o660`.
    pub gid: Option<u32>,
    /// Largest accepted request, in bytes (default 64 MiB).
    pub max_message_size: usize,
    /// How long graceful shutdown waits for in-flight requests before dropping connections.
    pub shutdown_grace: Duration,
    /// Requests and notifications that may run or wait to be written per connection before
    /// the server stops reading from it (default 256).
    pub max_in_flight: usize,
    /// Connections served at once; more are refused (default 128).
    pub max_connections: usize,
    /// Close a connection that sent nothing for this long and has nothing in flight
    /// (default 10 minutes; `None`: never).
    pub idle_timeout: Option<Duration>,
    /// Bytes of partial messages buffered across all connections (default 128 MiB).
    pub max_buffered_total: usize,
    /// Buffered bytes per connection not counted against
    /// [`max_buffered_total`](Self::max_buffered_total) (default 256 KiB).
    pub unbudgeted_per_connection: usize,
}

impl ServerConfig {
    /// Defaults for `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            mode: 0o600,
            gid: None,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            shutdown_grace: Duration::from_secs(5),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            idle_timeout: Some(DEFAULT_IDLE_TIMEOUT),
            max_buffered_total: DEFAULT_MAX_BUFFERED_TOTAL,
            unbudgeted_per_connection: DEFAULT_UNBUDGETED_PER_CONNECTION,
        }
    }

    /// Set the socket's permission bits.
    pub fn mode(mut self, mode: u32) -> Self {
        self.mode = mode;
        self
    }

    /// Set the socket's group.
    pub fn gid(mut self, gid: u32) -> Self {
        self.gid = Some(gid);
        self
    }

    /// Set the socket's group by name, looked up in `/etc/group` (no NSS: LDAP/SSSD groups
    /// need [`gid`](Self::gid)).
    pub fn group(self, name: &str) -> Result<Self, ServerError> {
        let path = Path::new("/etc/group");
        let text = std::fs::read_to_string(path).map_err(io_err("reading", path))?;
        let gid = text
            .lines()
            .filter_map(|l| {
                let mut f = l.split(':');
                let n = f.next()?;
                let gid = f.nth(1)?;
                (n == name).then(|| gid.parse::<u32>().ok()).flatten()
            })
            .next()
            .ok_or_else(|| ServerError::UnknownGroup(name.to_owned()))?;
        Ok(self.gid(gid))
    }

    /// Set the request size limit.
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.max_message_size = bytes;
        self
    }

    /// Set the graceful-shutdown grace period.
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// Set the per-connection in-flight limit (at least 1).
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n.max(1);
        self
    }

    /// Set the connection limit (at least 1).
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Set the idle timeout (`None`: connections never time out).
    pub fn idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// Set the budget for partial messages across connections, and how many bytes of each
    /// connection are not counted against it.
    pub fn max_buffered(mut self, total: usize, unbudgeted_per_connection: usize) -> Self {
        self.max_buffered_total = total;
        self.unbudgeted_per_connection = unbudgeted_per_connection;
        self
    }
}

/// The memory budget for buffered partial messages, shared by every connection.
#[derive(Debug)]
struct Budget {
    used: AtomicUsize,
    limit: usize,
}

/// What one connection has taken from the [`Budget`]; given back on drop.
struct Charge {
    budget: Arc<Budget>,
    charged: usize,
}

impl Charge {
    /// Raise the charge to `want` if the budget allows it; lowering always succeeds.
    fn try_set(&mut self, want: usize) -> bool {
        if want <= self.charged {
            self.set(want);
            return true;
        }
        let extra = want - self.charged;
        let ok = self
            .budget
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(extra).filter(|t| *t <= self.budget.limit)
            })
            .is_ok();
        if ok {
            self.charged = want;
        }
        ok
    }

    /// Set the charge to what is really allocated, even past the limit (only by the rounding
    /// of an allocation that was checked beforehand).
    fn set(&mut self, actual: usize) {
        if actual >= self.charged {
            self.budget
                .used
                .fetch_add(actual - self.charged, Ordering::AcqRel);
        } else {
            self.budget
                .used
                .fetch_sub(self.charged - actual, Ordering::AcqRel);
        }
        self.charged = actual;
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.set(0);
    }
}

/// Counts refused connections and logs them at most every [`REFUSAL_LOG_INTERVAL`].
#[derive(Default)]
struct Refusals {
    unreported: u64,
    last_log: Option<Instant>,
}

impl Refusals {
    fn refuse(&mut self, stream: UnixStream, open: usize, limit: usize) {
        self.unreported += 1;
        let due = self
            .last_log
            .is_none_or(|t| t.elapsed() >= REFUSAL_LOG_INTERVAL);
        if due {
            warn!(
                open,
                limit,
                refused = self.unreported,
                "refusing RPC connection: too many connections"
            );
            self.unreported = 0;
            self.last_log = Some(Instant::now());
        }
        let reply = Response::error(
            Id::Null,
            SpdkError::internal(format!(
                "Internal error: too many RPC connections (limit {limit}); try again later"
            )),
        );
        // Best effort, never waiting: a fresh socket's send buffer takes one short reply.
        let _ = stream.try_write(&reply.to_bytes());
    }
}

/// Removes the socket file on drop, if it is still the one we created.
#[derive(Debug)]
struct SocketFile {
    path: PathBuf,
    dev_ino: (u64, u64),
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Ok(md) = std::fs::symlink_metadata(&self.path) {
            if (md.dev(), md.ino()) == self.dev_ino {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    warn!(path = %self.path.display(), "cannot remove RPC socket: {e}");
                }
            }
        }
    }
}

/// A bound JSON-RPC unix socket, ready to serve.
#[derive(Debug)]
pub struct RpcServer {
    listener: std::os::unix::net::UnixListener,
    config: ServerConfig,
    socket: SocketFile,
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> ServerError + 'a {
    move |source| ServerError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

impl RpcServer {
    /// Bind the socket: check the path length, remove a stale socket (refusing to touch a
    /// non-socket file or a socket a live server answers on), bind, then set the mode and
    /// group. Does not need a tokio runtime.
    ///
    /// The mode is applied right after `bind`, so for a moment the socket has the
    /// umask-derived mode; put it in a directory only the daemon can write if that matters.
    pub fn bind(config: ServerConfig) -> Result<Self, ServerError> {
        let path = config.path.clone();
        let len = path.as_os_str().len();
        if len > MAX_SOCKET_PATH_LEN {
            return Err(ServerError::PathTooLong {
                path,
                len,
                max: MAX_SOCKET_PATH_LEN,
            });
        }
        match std::fs::symlink_metadata(&path) {
            Ok(md) if md.file_type().is_socket() => {
                match std::os::unix::net::UnixStream::connect(&path) {
                    Ok(_) => return Err(ServerError::InUse(path)),
                    Err(e) => {
                        debug!(path = %path.display(), "removing stale RPC socket ({e})");
                        match std::fs::remove_file(&path) {
                            Ok(()) => {}
                            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                            Err(e) => return Err(io_err("removing stale socket", &path)(e)),
                        }
                    }
                }
            }
            Ok(_) => return Err(ServerError::NotASocket(path)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("checking", &path)(e)),
        }
        let listener =
            std::os::unix::net::UnixListener::bind(&path).map_err(io_err("binding", &path))?;
        let md = std::fs::symlink_metadata(&path).map_err(io_err("checking", &path))?;
        let socket = SocketFile {
            path: path.clone(),
            dev_ino: (md.dev(), md.ino()),
        };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(config.mode))
            .map_err(io_err("setting mode of", &path))?;
        if let Some(gid) = config.gid {
            std::os::unix::fs::chown(&path, None, Some(gid))
                .map_err(io_err("setting group of", &path))?;
        }
        listener
            .set_nonblocking(true)
            .map_err(io_err("configuring", &path))?;
        info!(path = %path.display(), "JSON-RPC server listening");
        Ok(Self {
            listener,
            config,
            socket,
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.socket.path
    }

    /// Serve until the process ends.
    pub async fn serve<H: Handler>(self, handler: Arc<H>) -> Result<(), ServerError> {
        self.serve_until(handler, std::future::pending()).await
    }

    /// Serve until `shutdown` completes, then shut down gracefully: stop accepting, stop
    /// reading new requests, let in-flight requests finish and their replies be written (for
    /// up to [`ServerConfig::shutdown_grace`]), close connections and remove the socket file.
    pub async fn serve_until<H, F>(self, handler: Arc<H>, shutdown: F) -> Result<(), ServerError>
    where
        H: Handler,
        F: Future<Output = ()>,
    {
        let RpcServer {
            listener,
            config,
            socket,
        } = self;
        let listener =
            UnixListener::from_std(listener).map_err(io_err("registering", &socket.path))?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut conns = JoinSet::new();
        let mut next_conn: u64 = 0;
        let mut refusals = Refusals::default();
        let budget = Arc::new(Budget {
            used: AtomicUsize::new(0),
            limit: config.max_buffered_total,
        });
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        while conns.try_join_next().is_some() {}
                        if conns.len() >= config.max_connections {
                            refusals.refuse(stream, conns.len(), config.max_connections);
                            continue;
                        }
                        next_conn += 1;
                        debug!(conn = next_conn, "RPC connection accepted");
                        let conn = Connection {
                            id: next_conn,
                            handler: Arc::clone(&handler),
                            max_message_size: config.max_message_size,
                            stop: stop_rx.clone(),
                            max_in_flight: config.max_in_flight,
                            permits: Arc::new(Semaphore::new(config.max_in_flight)),
                            idle_timeout: config.idle_timeout,
                            unbudgeted: config.unbudgeted_per_connection,
                            budget: Arc::clone(&budget),
                        };
                        conns.spawn(conn.run(stream));
                    }
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        warn!("RPC accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
        info!(path = %socket.path.display(), "JSON-RPC server shutting down");
        drop(listener);
        drop(socket);
        let _ = stop_tx.send(true);
        let drain = async { while conns.join_next().await.is_some() {} };
        if tokio::time::timeout(config.shutdown_grace, drain)
            .await
            .is_err()
        {
            warn!(
                "RPC shutdown grace period expired; dropping {} connection(s)",
                conns.len()
            );
            conns.abort_all();
            while conns.join_next().await.is_some() {}
        }
        Ok(())
    }
}

/// One queued reply, in request order.
enum Slot {
    /// Already encoded.
    Ready(Vec<u8>),
    /// Being computed by a handler task; the permit is given back once the reply is written.
    Pending(
        Id,
        JoinHandle<Result<Value, SpdkError>>,
        OwnedSemaphorePermit,
    ),
}

struct Connection<H> {
    id: u64,
    handler: Arc<H>,
    max_message_size: usize,
    stop: watch::Receiver<bool>,
    max_in_flight: usize,
    /// One per request or notification running or waiting to be written.
    permits: Arc<Semaphore>,
    idle_timeout: Option<Duration>,
    unbudgeted: usize,
    budget: Arc<Budget>,
}

/// Why reading from a connection stopped.
enum ReadEnd {
    /// End of stream.
    Eof,
    /// Shutdown, a read error or an idle timeout: nothing more to do.
    Stop,
}

impl<H: Handler> Connection<H> {
    async fn run(self, stream: UnixStream) {
        let (rd, wr) = stream.into_split();
        let (tx, rx) = mpsc::channel::<Slot>(self.max_in_flight);
        // Reader and writer run in this one task, so aborting the connection (shutdown grace
        // expired) stops both. Handler tasks are detached: an operation that started runs to
        // completion even if its reply can no longer be sent.
        tokio::join!(self.read_requests(rd, tx), write_replies(self.id, wr, rx));
        debug!(conn = self.id, "RPC connection closed");
    }

    fn in_flight(&self) -> usize {
        self.max_in_flight - self.permits.available_permits()
    }

    /// One read, giving up after the idle timeout if nothing is in flight.
    async fn read_some(
        &self,
        rd: &mut tokio::net::unix::OwnedReadHalf,
        buf: &mut [u8],
        partial: bool,
    ) -> Result<usize, ReadEnd> {
        loop {
            let r = match self.idle_timeout {
                Some(t) => match tokio::time::timeout(t, rd.read(buf)).await {
                    Ok(r) => r,
                    Err(_) if self.in_flight() > 0 => continue,
                    Err(_) => {
                        if partial {
                            warn!(conn = self.id, idle = ?t, "closing RPC connection idle in the middle of a message");
                        } else {
                            debug!(conn = self.id, idle = ?t, "closing idle RPC connection");
                        }
                        return Err(ReadEnd::Stop);
                    }
                },
                None => rd.read(buf).await,
            };
            return match r {
                Ok(0) => Err(ReadEnd::Eof),
                Ok(n) => Ok(n),
                Err(e) => {
                    debug!(conn = self.id, "RPC read failed: {e}");
                    Err(ReadEnd::Stop)
                }
            };
        }
    }

    async fn read_requests(&self, mut rd: tokio::net::unix::OwnedReadHalf, tx: mpsc::Sender<Slot>) {
        let conn_id = self.id;
        let mut stop = self.stop.clone();
        let mut dec = StreamDecoder::new(self.max_message_size);
        let mut charge = Charge {
            budget: Arc::clone(&self.budget),
            charged: 0,
        };
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let read = tokio::select! {
                biased;
                _ = stop.wait_for(|stop| *stop) => return,
                r = self.read_some(&mut rd, &mut buf, dec.has_partial()) => r,
            };
            let n = match read {
                Ok(n) => n,
                Err(ReadEnd::Stop) => return,
                Err(ReadEnd::Eof) => {
                    match dec.finish() {
                        Ok(Some(v)) => {
                            // Only a top-level scalar can be left at end of stream: never a
                            // request, so no id to take from the raw bytes.
                            let _ = self.dispatch(v, &[], &tx).await;
                        }
                        Ok(None) => {}
                        Err(e) => {
                            let _ = tx.send(Slot::Ready(decode_error_reply(conn_id, &e))).await;
                        }
                    }
                    return;
                }
            };
            let want = dec.memory_after_feed(n).saturating_sub(self.unbudgeted);
            if !charge.try_set(want) {
                let _ = tx
                    .send(Slot::Ready(budget_error_reply(conn_id, &self.budget)))
                    .await;
                return;
            }
            dec.feed(&buf[..n]);
            loop {
                match dec.next_message() {
                    Ok(Some((v, frame))) => {
                        if self.dispatch(v, frame, &tx).await.is_err() {
                            return; // writer gone: peer stopped reading
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        let _ = tx.send(Slot::Ready(decode_error_reply(conn_id, &e))).await;
                        return;
                    }
                }
            }
            dec.release();
            charge.set(dec.memory().saturating_sub(self.unbudgeted));
        }
    }

    /// Queue the reply for one decoded value (`frame`: its raw bytes). Err if the writer is
    /// gone. Waits while the connection's in-flight limit is reached.
    async fn dispatch(&self, v: Value, frame: &[u8], tx: &mpsc::Sender<Slot>) -> Result<(), ()> {
        let req = match Request::from_message(v, frame) {
            Ok(r) => r,
            Err(bad) => {
                let reply = Response::error(bad.id.unwrap_or(Id::Null), bad.error);
                return tx.send(Slot::Ready(reply.to_bytes())).await.map_err(drop);
            }
        };
        debug!(conn = self.id, method = %req.method, id = ?req.id, "RPC request");
        let permit = Arc::clone(&self.permits)
            .acquire_owned()
            .await
            .map_err(drop)?;
        let handler = Arc::clone(&self.handler);
        let Request {
            method, params, id, ..
        } = req;
        match id {
            Some(id) => {
                let task = tokio::spawn(async move { handler.call(&method, params).await });
                tx.send(Slot::Pending(id, task, permit)).await.map_err(drop)
            }
            None => {
                // Notification: no reply, but it holds its permit until it is done, so
                // notifications count against the in-flight limit like calls. Failures are
                // logged.
                let conn = self.id;
                let task = tokio::spawn(async move { handler.call(&method, params).await });
                tokio::spawn(async move {
                    let _permit = permit;
                    match task.await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => debug!(conn, "RPC notification failed: {e}"),
                        Err(e) => error!(conn, "RPC notification handler panicked: {e}"),
                    }
                });
                Ok(())
            }
        }
    }
}

fn budget_error_reply(conn: u64, budget: &Budget) -> Vec<u8> {
    warn!(
        conn,
        limit = budget.limit,
        "closing RPC connection: partial messages across connections exceed the buffer budget"
    );
    let err = SpdkError::new(
        crate::error::codes::ENOMEM,
        format!(
            "Cannot allocate memory: partial requests across connections exceed the server's \
             {}-byte buffer budget",
            budget.limit
        ),
    );
    Response::error(Id::Null, err).to_bytes()
}

fn decode_error_reply(conn: u64, e: &DecodeError) -> Vec<u8> {
    warn!(conn, "closing RPC connection: {e}");
    let err = match e {
        DecodeError::Parse(msg) => SpdkError::new(
            crate::error::codes::PARSE_ERROR,
            format!("Parse error: {msg}"),
        ),
        DecodeError::TooLarge { limit } => SpdkError::invalid_request(format!(
            "Invalid request: message exceeds the maximum size of {limit} bytes"
        )),
    };
    Response::error(Id::Null, err).to_bytes()
}

async fn write_replies(
    conn: u64,
    mut wr: tokio::net::unix::OwnedWriteHalf,
    mut rx: mpsc::Receiver<Slot>,
) {
    while let Some(slot) = rx.recv().await {
        // The permit is held until the reply is written (dropped at the end of the loop).
        let (bytes, _permit) = match slot {
            Slot::Ready(b) => (b, None),
            Slot::Pending(id, task, permit) => {
                let payload = match task.await {
                    Ok(r) => r,
                    Err(e) if e.is_panic() => {
                        error!(conn, id = ?id, "RPC handler panicked");
                        Err(SpdkError::internal("Internal error: handler panicked"))
                    }
                    Err(e) => Err(SpdkError::internal(format!("Internal error: {e}"))),
                };
                (Response { id, payload }.to_bytes(), Some(permit))
            }
        };
        if let Err(e) = wr.write_all(&bytes).await {
            debug!(conn, "RPC write failed: {e}");
            return;
        }
    }
    let _ = wr.shutdown().await;
}
