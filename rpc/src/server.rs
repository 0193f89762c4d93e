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

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, error, info, warn};

use crate::error::ServerError;
use crate::methods::{Method, RpcGetMethods, RpcGetMethodsParams};
use crate::wire::{
    typed, DecodeError, Id, Request, Response, SpdkError, StreamDecoder, DEFAULT_MAX_MESSAGE_SIZE,
};

/// Longest unix socket path: `sun_path` is 108 bytes including the terminating NUL.
pub const MAX_SOCKET_PATH_LEN: usize = 107;

/// Replies that may be queued (computing or waiting to be written) per connection before the
/// server stops reading from it.
const MAX_IN_FLIGHT: usize = 256;

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
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        next_conn += 1;
                        debug!(conn = next_conn, "RPC connection accepted");
                        let conn = Connection {
                            id: next_conn,
                            handler: Arc::clone(&handler),
                            max_message_size: config.max_message_size,
                            stop: stop_rx.clone(),
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
    /// Being computed by a handler task.
    Pending(Id, JoinHandle<Result<Value, SpdkError>>),
}

struct Connection<H> {
    id: u64,
    handler: Arc<H>,
    max_message_size: usize,
    stop: watch::Receiver<bool>,
}

impl<H: Handler> Connection<H> {
    async fn run(self, stream: UnixStream) {
        let (rd, wr) = stream.into_split();
        let (tx, rx) = mpsc::channel::<Slot>(MAX_IN_FLIGHT);
        // Reader and writer run in this one task, so aborting the connection (shutdown grace
        // expired) stops both. Handler tasks are detached: an operation that started runs to
        // completion even if its reply can no longer be sent.
        tokio::join!(self.read_requests(rd, tx), write_replies(self.id, wr, rx));
        debug!(conn = self.id, "RPC connection closed");
    }

    async fn read_requests(&self, mut rd: tokio::net::unix::OwnedReadHalf, tx: mpsc::Sender<Slot>) {
        let conn_id = self.id;
        let mut stop = self.stop.clone();
        let mut dec = StreamDecoder::new(self.max_message_size);
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = tokio::select! {
                biased;
                _ = stop.wait_for(|stop| *stop) => return,
                r = rd.read(&mut buf) => match r {
                    Ok(n) => n,
                    Err(e) => {
                        debug!(conn = conn_id, "RPC read failed: {e}");
                        return;
                    }
                },
            };
            if n == 0 {
                match dec.finish() {
                    Ok(Some(v)) => {
                        let _ = self.dispatch(v, &tx).await;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        let _ = tx.send(Slot::Ready(decode_error_reply(conn_id, &e))).await;
                    }
                }
                return;
            }
            dec.feed(&buf[..n]);
            loop {
                match dec.next_value() {
                    Ok(Some(v)) => {
                        if self.dispatch(v, &tx).await.is_err() {
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
        }
    }

    /// Queue the reply for one decoded value. Err if the writer is gone.
    async fn dispatch(&self, v: Value, tx: &mpsc::Sender<Slot>) -> Result<(), ()> {
        let req = match Request::from_value(v) {
            Ok(r) => r,
            Err(bad) => {
                let reply = Response::error(bad.id.unwrap_or(Id::Null), bad.error);
                return tx.send(Slot::Ready(reply.to_bytes())).await.map_err(drop);
            }
        };
        debug!(conn = self.id, method = %req.method, id = ?req.id, "RPC request");
        let handler = Arc::clone(&self.handler);
        let Request {
            method, params, id, ..
        } = req;
        let task = tokio::spawn(async move { handler.call(&method, params).await });
        match id {
            Some(id) => tx.send(Slot::Pending(id, task)).await.map_err(drop),
            None => {
                // Notification: no reply; still report failures in the log.
                let conn = self.id;
                tokio::spawn(async move {
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
        let bytes = match slot {
            Slot::Ready(b) => b,
            Slot::Pending(id, task) => {
                let payload = match task.await {
                    Ok(r) => r,
                    Err(e) if e.is_panic() => {
                        error!(conn, id = ?id, "RPC handler panicked");
                        Err(SpdkError::internal("Internal error: handler panicked"))
                    }
                    Err(e) => Err(SpdkError::internal(format!("Internal error: {e}"))),
                };
                Response { id, payload }.to_bytes()
            }
        };
        if let Err(e) = wr.write_all(&bytes).await {
            debug!(conn, "RPC write failed: {e}");
            return;
        }
    }
    let _ = wr.shutdown().await;
}
