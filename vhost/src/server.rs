//! The listening side: a unix socket served to one frontend at a time, until shutdown.

use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use katablk_bdev::{sync::SyncIo, BlockDevice};
use tracing::{debug, error, info, warn};
use vhost::vhost_user::{BackendReqHandler, Error as VuError};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::backend::BlkBackend;
use crate::queue::DeviceShared;
use crate::{BlkOptions, Error, StatsSnapshot};
use katablk_bdev::sigbus::Poison;

/// Longest usable unix socket path (`sun_path` is 108 bytes with the terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// The frontend's end of the backend-initiated channel (`SET_BACKEND_REQ_FD`), if it gave one.
type BackendChannel = Arc<Mutex<Option<UnixStream>>>;

/// vhost-user message code of `SET_BACKEND_REQ_FD`.
const SET_BACKEND_REQ_FD: u32 = 21;
/// Backend-to-frontend message code of `CONFIG_CHANGE_MSG`.
const CONFIG_CHANGE_MSG: u32 = 2;
/// Header flag: protocol version 1.
const VHOST_USER_VERSION: u32 = 0x1;

/// A vhost-user-blk device listening on a unix socket.
pub struct VhostBlkServer {
    path: PathBuf,
    listener: UnixListener,
    backend: Arc<Mutex<BlkBackend>>,
    shared: Arc<DeviceShared>,
    stop: Arc<EventFd>,
    channel: BackendChannel,
    connected: Arc<AtomicBool>,
    /// The connected frontend's socket while it is served (cleared before the socket closes).
    conn: ConnFd,
}

/// The socket of the frontend being served, for [`ShutdownHandle::shutdown`].
type ConnFd = Arc<Mutex<Option<std::os::fd::RawFd>>>;

/// Tells the connected frontend that the config space changed (e.g. the capacity after a
/// resize), so the guest re-reads it. Returns false if no frontend gave a backend channel.
fn notify_config_change(channel: &BackendChannel) -> bool {
    let Ok(mut guard) = channel.lock() else {
        return false;
    };
    let Some(stream) = guard.as_mut() else {
        return false;
    };
    let mut hdr = [0u8; 12];
    hdr[..4].copy_from_slice(&CONFIG_CHANGE_MSG.to_le_bytes());
    hdr[4..8].copy_from_slice(&VHOST_USER_VERSION.to_le_bytes());
    match std::io::Write::write_all(stream, &hdr) {
        Ok(()) => true,
        Err(e) => {
            warn!("config change notification failed: {e}");
            *guard = None;
            false
        }
    }
}

/// Requests whose sender always waits for a reply (the `vhost` crate sends none when the
/// handler refuses them): GET_FEATURES, GET_VRING_BASE, GET_PROTOCOL_FEATURES, GET_QUEUE_NUM,
/// GET_CONFIG, GET_INFLIGHT_FD, GET_MAX_MEM_SLOTS, SET_DEVICE_STATE_FD, CHECK_DEVICE_STATE.
const REPLY_EXPECTED: [u32; 9] = [1, 11, 15, 17, 24, 31, 36, 42, 43];

/// What a peek at the next message found.
struct Peeked {
    /// Its request code (if a whole header was there).
    code: Option<u32>,
    /// The backend channel of a `SET_BACKEND_REQ_FD`.
    channel: Option<UnixStream>,
}

/// Peeks at the next message on `fd`: its request code, and, if it is `SET_BACKEND_REQ_FD`, a
/// duplicate of the channel descriptor it carries (the `vhost` crate keeps its own, but offers
/// no way to send `CONFIG_CHANGE_MSG` on it). Descriptors peeked with other messages are closed
/// at once.
fn peek_message(fd: i32) -> Peeked {
    let mut code = None;
    let channel = peek_backend_channel(fd, &mut code);
    Peeked { code, channel }
}

fn peek_backend_channel(fd: i32, code_out: &mut Option<u32>) -> Option<UnixStream> {
    let mut hdr = [0u8; 12];
    let mut iov = libc::iovec {
        iov_base: hdr.as_mut_ptr().cast(),
        iov_len: hdr.len(),
    };
    // Room for the largest number of descriptors one message may carry (32).
    let mut cmsg = [0u64; 40];
    // SAFETY: a zeroed msghdr is valid; the pointers set below refer to live local buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cmsg);
    // SAFETY: `msg` describes valid buffers; MSG_PEEK leaves the message in the socket.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_PEEK | libc::MSG_CMSG_CLOEXEC) };
    if n < 12 {
        return None;
    }
    let mut fds = Vec::new();
    // SAFETY: CMSG_FIRSTHDR/CMSG_NXTHDR walk the control buffer filled in by recvmsg, bounded by
    // msg_controllen; SCM_RIGHTS payloads are arrays of c_int.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<libc::c_int>();
                for i in 0..count {
                    fds.push(std::ptr::read_unaligned(data.add(i)));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    let code = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    *code_out = Some(code);
    let mut keep = None;
    for fd in fds {
        if code == SET_BACKEND_REQ_FD && keep.is_none() {
            // SAFETY: `fd` was just installed in this process by recvmsg and is owned by nobody
            // else.
            keep = Some(unsafe { <UnixStream as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        } else {
            // SAFETY: as above; the duplicate is not needed.
            unsafe { libc::close(fd) };
        }
    }
    keep
}

/// Stops a running server from another thread (or a signal handler thread).
#[derive(Clone)]
pub struct ShutdownHandle(Arc<EventFd>, ConnFd);

impl ShutdownHandle {
    /// Asks the server to finish: in-flight requests complete, the device is flushed, the socket
    /// is removed. The frontend's connection is shut down too, so a frontend that stopped in the
    /// middle of a message (the server thread waiting for its rest) cannot hold the server.
    pub fn shutdown(&self) {
        let _ = self.0.write(1);
        let conn = self.1.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(fd) = *conn {
            // SAFETY: `fd` is the open socket of the connection being served: it is cleared
            // under this lock before the socket is closed, so it names no other file.
            // shutdown(2) only changes the socket's state.
            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
        }
    }
}

/// A server running on its own thread.
pub struct ServerHandle {
    stop: ShutdownHandle,
    thread: Option<std::thread::JoinHandle<Result<(), Error>>>,
    shared: Arc<DeviceShared>,
    channel: BackendChannel,
    connected: Arc<AtomicBool>,
}

impl ServerHandle {
    /// True while a frontend is connected.
    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    /// Tells the connected frontend that the device's config space changed (call it after the
    /// device was resized): the guest sees the new capacity. False if no frontend is connected
    /// or it gave no backend channel.
    pub fn notify_config_change(&self) -> bool {
        notify_config_change(&self.channel)
    }

    /// I/O counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// Stops the server and waits for it.
    pub fn stop(mut self) -> Result<(), Error> {
        self.stop.shutdown();
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(Error::Config("server thread panicked".into())),
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.stop.shutdown();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Checks that `path` can be bound, removing a stale socket left by a dead server.
fn prepare_socket_path(path: &Path) -> Result<(), Error> {
    let sock_err = |reason: String| Error::Socket {
        path: path.display().to_string(),
        reason,
    };
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(sock_err(format!(
            "path is {len} bytes long; unix socket paths are limited to {MAX_SOCKET_PATH}"
        )));
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err(sock_err("another server is listening on it".into()));
            }
            info!(path = %path.display(), "removing stale socket");
            std::fs::remove_file(path).map_err(|e| sock_err(format!("cannot remove: {e}")))
        }
        Ok(_) => Err(sock_err("exists and is not a socket".into())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match path.parent() {
            Some(p) if !p.as_os_str().is_empty() && !p.is_dir() => Err(sock_err(format!(
                "directory {} does not exist",
                p.display()
            ))),
            _ => Ok(()),
        },
        Err(e) => Err(sock_err(e.to_string())),
    }
}

/// Waits until one of `fds` is readable (or hung up); returns which are.
fn poll_fds<const N: usize>(fds: [i32; N], timeout_ms: i32) -> std::io::Result<[bool; N]> {
    let mut pfds = fds.map(|fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    });
    loop {
        // SAFETY: `pfds` is a valid array of N pollfd structures for the duration of the call.
        let r = unsafe { libc::poll(pfds.as_mut_ptr(), N as libc::nfds_t, timeout_ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(pfds.map(|p| p.revents != 0));
    }
}

impl VhostBlkServer {
    /// Binds `socket` (removing a stale socket) for a device served with `opts`. With `mode`,
    /// the socket file gets those permission bits (e.g. 0o660 for a VMM in a group).
    pub fn bind(
        socket: impl AsRef<Path>,
        dev: Arc<dyn BlockDevice>,
        opts: BlkOptions,
        mode: Option<u32>,
    ) -> Result<Self, Error> {
        let path = socket.as_ref().to_path_buf();
        opts.validate()?;
        let info = dev.info();
        let shared = Arc::new(DeviceShared {
            read_only: opts.read_only || info.read_only,
            writeback: AtomicBool::new(opts.writeback),
            poll: Duration::from_micros(u64::from(opts.poll_us)),
            seg_max: opts.seg_max() as usize,
            serial: opts.serial.clone(),
            stats: Default::default(),
            poison: Poison::new()?,
            qos: opts.qos.clone().unwrap_or_default(),
            dev,
        });
        let backend = Arc::new(Mutex::new(BlkBackend::new(shared.clone(), opts)?));
        prepare_socket_path(&path)?;
        let listener = UnixListener::bind(&path).map_err(|e| Error::Socket {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        if let Some(mode) = mode {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).map_err(
                |e| Error::Socket {
                    path: path.display().to_string(),
                    reason: format!("chmod: {e}"),
                },
            )?;
        }
        let stop = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(|e| Error::Sys("eventfd", e))?);
        Ok(VhostBlkServer {
            path,
            listener,
            backend,
            shared,
            stop,
            channel: Arc::new(Mutex::new(None)),
            connected: Arc::new(AtomicBool::new(false)),
            conn: Arc::new(Mutex::new(None)),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A handle to stop [`VhostBlkServer::run`].
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle(self.stop.clone(), self.conn.clone())
    }

    /// I/O counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// See [`ServerHandle::notify_config_change`].
    pub fn notify_config_change(&self) -> bool {
        notify_config_change(&self.channel)
    }

    /// Runs the server on a new thread.
    pub fn spawn(self) -> Result<ServerHandle, Error> {
        let stop = self.shutdown_handle();
        let shared = self.shared.clone();
        let channel = self.channel.clone();
        let connected = self.connected.clone();
        let thread = std::thread::Builder::new()
            .name("katablk-vhost".into())
            .spawn(move || self.run())
            .map_err(|e| Error::Sys("spawn server", e))?;
        Ok(ServerHandle {
            stop,
            thread: Some(thread),
            shared,
            channel,
            connected,
        })
    }

    /// Serves frontends one after another until shut down; then flushes the device and removes
    /// the socket.
    pub fn run(self) -> Result<(), Error> {
        info!(socket = %self.path.display(), device = %self.shared.dev.describe(), "serving");
        let res = self.serve();
        if let Ok(mut b) = self.backend.lock() {
            b.disconnect();
        }
        if !self.shared.read_only {
            match SyncIo::new(&*self.shared.dev).map(|mut io| io.flush()) {
                Ok(Ok(())) => debug!("device flushed"),
                Ok(Err(e)) => warn!("final flush failed: {e}"),
                Err(e) => warn!("final flush failed: {e}"),
            }
        }
        let _ = std::fs::remove_file(&self.path);
        info!(socket = %self.path.display(), "stopped");
        res
    }

    fn serve(&self) -> Result<(), Error> {
        let lfd = self.listener.as_raw_fd();
        let sfd = self.stop.as_raw_fd();
        loop {
            let [ready, stop] = poll_fds([lfd, sfd], -1).map_err(|e| Error::Sys("poll", e))?;
            if stop {
                return Ok(());
            }
            if !ready {
                continue;
            }
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) => {
                    warn!("accept: {e}");
                    continue;
                }
            };
            info!("frontend connected");
            // The previous frontend's mappings are gone or no longer accessed: a fault now
            // belongs to this one.
            if let Ok(mut b) = self.backend.lock() {
                b.prune_protected();
            }
            self.shared.poison.reset();
            self.connected.store(true, Ordering::Release);
            let stopped = self.serve_connection(stream);
            if let Ok(mut c) = self.channel.lock() {
                *c = None;
            }
            if let Ok(mut b) = self.backend.lock() {
                b.disconnect();
            }
            self.connected.store(false, Ordering::Release);
            info!("frontend disconnected");
            if stopped {
                return Ok(());
            }
        }
    }

    /// Handles one frontend's messages; true if shutdown was requested meanwhile.
    fn serve_connection(&self, stream: UnixStream) -> bool {
        let mut handler = BackendReqHandler::from_stream(stream, self.backend.clone());
        let cfd = handler.as_raw_fd();
        *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = Some(cfd);
        let stopped = self.serve_messages(&mut handler, cfd);
        // Cleared before `handler`, and with it the socket, is dropped.
        *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = None;
        drop(handler);
        stopped
    }

    fn serve_messages(
        &self,
        handler: &mut BackendReqHandler<Mutex<BlkBackend>>,
        cfd: std::os::fd::RawFd,
    ) -> bool {
        let sfd = self.stop.as_raw_fd();
        let pfd = self.shared.poison.wake_fd();
        loop {
            match poll_fds([cfd, sfd, pfd], -1) {
                Ok([_, true, _]) => return true,
                Ok([_, _, true]) => {
                    self.drop_poisoned();
                    return false;
                }
                Ok([false, false, false]) => continue,
                Ok([true, false, false]) => {}
                Err(e) => {
                    warn!("poll: {e}");
                    return false;
                }
            }
            let peeked = peek_message(cfd);
            if let Some(ch) = peeked.channel {
                debug!("frontend gave a backend channel");
                if let Ok(mut c) = self.channel.lock() {
                    *c = Some(ch);
                }
            }
            match handler.handle_request() {
                Ok(()) => {}
                Err(VuError::Disconnected) => return false,
                Err(
                    e @ (VuError::InvalidParam
                    | VuError::InvalidOperation(_)
                    | VuError::ReqHandlerError(_)
                    | VuError::InactiveFeature(_)
                    | VuError::InactiveOperation(_)
                    | VuError::FeatureMismatch),
                ) => {
                    if peeked.code.is_some_and(|c| REPLY_EXPECTED.contains(&c)) {
                        // The frontend waits for a reply that will not come: tell it by
                        // closing, rather than leave it hanging.
                        warn!(request = ?peeked.code, "dropping frontend: refused a request \
                            it waits for a reply to: {e}");
                        return false;
                    }
                    warn!("request refused: {e}");
                }
                Err(e) => {
                    warn!("dropping frontend: {e}");
                    return false;
                }
            }
            if self
                .backend
                .lock()
                .ok()
                .and_then(|mut b| b.take_fatal())
                .is_some()
            {
                // Refused (and logged) above: a frontend that sends memory it does not back is
                // broken or hostile, and without REPLY_ACK it could not even be told.
                warn!("dropping frontend after refusing its memory file");
                return false;
            }
            if self.shared.poison.is_poisoned() {
                self.drop_poisoned();
                return false;
            }
        }
    }

    fn drop_poisoned(&self) {
        let addr = self.shared.poison.fault_addr();
        error!(
            fault_addr = format_args!("{addr:#x}"),
            "dropping frontend: its memory became inaccessible (SIGBUS: its guest memory or \
             inflight file was shrunk under a running queue)"
        );
    }
}
