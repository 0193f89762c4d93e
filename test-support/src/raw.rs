//! A raw, possibly hostile vhost-user frontend: it writes the wire format itself (12-byte
//! header: request, flags, size; then the payload; descriptors in SCM_RIGHTS) so it can send
//! anything, well-formed or not, to `katablk-vhost` or `katablk-target`.
//!
//! Also here: payload builders for the messages it sends, guest memory in a memfd with a
//! split virtqueue laid out by hand (to drive a running queue and then pull the memory from
//! under it), descriptors of every kind, and a small deterministic random generator for
//! fuzzing.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

pub use crate::files::memfd;
pub use codes::*;

/// The protocol's numbers: frontend request codes (the vhost-user spec's numbering), header
/// flags, virtio and vhost-user protocol feature bits.
#[allow(missing_docs)]
mod codes {
    pub const NOOP: u32 = 0;
    pub const GET_FEATURES: u32 = 1;
    pub const SET_FEATURES: u32 = 2;
    pub const SET_OWNER: u32 = 3;
    pub const RESET_OWNER: u32 = 4;
    pub const SET_MEM_TABLE: u32 = 5;
    pub const SET_LOG_BASE: u32 = 6;
    pub const SET_LOG_FD: u32 = 7;
    pub const SET_VRING_NUM: u32 = 8;
    pub const SET_VRING_ADDR: u32 = 9;
    pub const SET_VRING_BASE: u32 = 10;
    pub const GET_VRING_BASE: u32 = 11;
    pub const SET_VRING_KICK: u32 = 12;
    pub const SET_VRING_CALL: u32 = 13;
    pub const SET_VRING_ERR: u32 = 14;
    pub const GET_PROTOCOL_FEATURES: u32 = 15;
    pub const SET_PROTOCOL_FEATURES: u32 = 16;
    pub const GET_QUEUE_NUM: u32 = 17;
    pub const SET_VRING_ENABLE: u32 = 18;
    pub const SET_BACKEND_REQ_FD: u32 = 21;
    pub const GET_CONFIG: u32 = 24;
    pub const SET_CONFIG: u32 = 25;
    pub const GET_INFLIGHT_FD: u32 = 31;
    pub const SET_INFLIGHT_FD: u32 = 32;
    pub const RESET_DEVICE: u32 = 34;
    pub const VRING_KICK: u32 = 35;
    pub const GET_MAX_MEM_SLOTS: u32 = 36;
    pub const ADD_MEM_REG: u32 = 37;
    pub const REM_MEM_REG: u32 = 38;
    pub const SET_STATUS: u32 = 39;
    pub const GET_STATUS: u32 = 40;
    pub const SET_DEVICE_STATE_FD: u32 = 42;
    pub const CHECK_DEVICE_STATE: u32 = 43;
    pub const GET_SHMEM_CONFIG: u32 = 44;
    /// The highest request code the protocol (as the `vhost` crate knows it) defines.
    pub const LAST_REQUEST: u32 = 44;

    // Header flags.
    pub const VERSION: u32 = 0x1;
    pub const REPLY: u32 = 0x4;
    pub const NEED_REPLY: u32 = 0x8;

    pub const F_VERSION_1: u64 = 1 << 32;
    pub const F_PROTOCOL_FEATURES: u64 = 1 << 30;
    pub const PF_MQ: u64 = 1 << 0;
    pub const PF_REPLY_ACK: u64 = 1 << 3;
    pub const PF_BACKEND_REQ: u64 = 1 << 5;
    pub const PF_CONFIG: u64 = 1 << 9;
    pub const PF_INFLIGHT_SHMFD: u64 = 1 << 12;
    pub const PF_RESET_DEVICE: u64 = 1 << 13;
    pub const PF_CONFIGURE_MEM_SLOTS: u64 = 1 << 15;

    /// Largest payload the backend accepts in one message.
    pub const MAX_MSG_SIZE: usize = 0x1000;

    pub const KIB: u64 = 1 << 10;
    pub const MIB: u64 = 1 << 20;
}

/// A non-blocking eventfd.
pub fn eventfd() -> File {
    // SAFETY: plain eventfd(2); checked below.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor owned by nobody else.
    unsafe { File::from_raw_fd(fd) }
}

/// Signals an eventfd (a kick).
pub fn kick(fd: &File) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live local buffer to a descriptor we own.
    let n = unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    assert_eq!(n, 8, "eventfd write: {}", std::io::Error::last_os_error());
}

/// A pipe: (read end, write end).
pub fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors are fresh and owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// A small deterministic random generator (splitmix64): the same seed gives the same run.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// The next 32 random bits.
    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0);
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi == u64::MAX && lo == 0 {
            return self.next_u64();
        }
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    /// One of `v` (not empty), uniformly.
    pub fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        v.truncate(n);
        v
    }

    /// A value that is often interesting at a boundary: 0, 1, powers of two and their
    /// neighbours, all ones, or anything.
    pub fn edgy_u64(&mut self) -> u64 {
        match self.below(8) {
            0 => 0,
            1 => u64::MAX - self.below(4),
            2 => 1u64 << self.below(64),
            3 => (1u64 << self.below(64)).wrapping_sub(1),
            4 => (1u64 << self.below(64)).wrapping_add(1),
            5 => self.below(4096),
            6 => 1u64 << 63,
            _ => self.next_u64(),
        }
    }

    /// Like [`Rng::edgy_u64`], for 32-bit fields.
    pub fn edgy_u32(&mut self) -> u32 {
        match self.below(6) {
            0 => 0,
            1 => u32::MAX - self.below(4) as u32,
            2 => 1u32 << self.below(32),
            3 => self.below(300) as u32,
            4 => 0x100 + self.below(0x100) as u32,
            _ => self.next_u32(),
        }
    }
}

/// Descriptors of every kind a hostile frontend might attach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FdKind {
    /// A memfd of this many bytes.
    Memfd(u64),
    /// An eventfd.
    EventFd,
    /// The read end of a pipe.
    PipeRead,
    /// The write end of a pipe.
    PipeWrite,
    /// `/dev/null`.
    DevNull,
    /// `/dev/zero`.
    DevZero,
    /// One end of a unix socket pair.
    Socket,
    /// A directory.
    Directory,
    /// A 64 KiB regular file.
    RegularFile,
}

impl FdKind {
    /// One kind, memfds of interesting sizes twice as likely as each other kind.
    pub fn random(rng: &mut Rng) -> FdKind {
        match rng.below(10) {
            0 | 1 => FdKind::Memfd(rng.pick(&[0, 1, 4095, 4096, 8192, 64 * KIB, MIB, 2 * MIB])),
            2 => FdKind::EventFd,
            3 => FdKind::PipeRead,
            4 => FdKind::PipeWrite,
            5 => FdKind::DevNull,
            6 => FdKind::DevZero,
            7 => FdKind::Socket,
            8 => FdKind::Directory,
            _ => FdKind::RegularFile,
        }
    }

    /// Opens one; `keep` holds whatever must stay open with it (the other end of a pipe or
    /// socket pair). `dir` is a scratch directory.
    pub fn open(self, dir: &Path, keep: &mut Vec<OwnedFd>) -> OwnedFd {
        match self {
            FdKind::Memfd(len) => memfd(len).into(),
            FdKind::EventFd => eventfd().into(),
            FdKind::PipeRead => {
                let (r, w) = pipe();
                keep.push(w);
                r
            }
            FdKind::PipeWrite => {
                let (r, w) = pipe();
                keep.push(r);
                w
            }
            FdKind::DevNull => File::open("/dev/null").expect("open /dev/null").into(),
            FdKind::DevZero => File::open("/dev/zero").expect("open /dev/zero").into(),
            FdKind::Socket => {
                let (a, b) = UnixStream::pair().expect("socketpair");
                keep.push(b.into());
                a.into()
            }
            FdKind::Directory => File::open(dir).expect("open the scratch directory").into(),
            FdKind::RegularFile => {
                let p = dir.join("regular");
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .read(true)
                    .write(true)
                    .open(&p)
                    .expect("create the regular file");
                f.set_len(64 * KIB).expect("size the regular file");
                f.into()
            }
        }
    }
}

/// What the backend answered.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// A `REPLY_ACK` (or u64) reply: 0 is success.
    Ack(u64),
    /// The backend closed the connection.
    Closed,
}

/// The backend has closed the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

/// One message as the header describes it.
pub fn encode(req: u32, flags: u32, size: u32, payload: &[u8]) -> Vec<u8> {
    let mut msg = Vec::with_capacity(12 + payload.len());
    msg.extend_from_slice(&req.to_le_bytes());
    msg.extend_from_slice(&flags.to_le_bytes());
    msg.extend_from_slice(&size.to_le_bytes());
    msg.extend_from_slice(payload);
    msg
}

/// A frontend that writes the vhost-user wire format itself.
pub struct Raw {
    /// The connection to the backend.
    pub sock: UnixStream,
}

impl Raw {
    /// Connects with 20 s read and write timeouts (a backend that stops reading or answering
    /// fails the test instead of hanging it).
    pub fn connect(path: &Path) -> Raw {
        let sock = UnixStream::connect(path)
            .unwrap_or_else(|e| panic!("connect to {}: {e}", path.display()));
        sock.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("set the read timeout");
        sock.set_write_timeout(Some(Duration::from_secs(20)))
            .expect("set the write timeout");
        Raw { sock }
    }

    /// Sends `bytes` with `fds` (at most 32) attached to the first `sendmsg`.
    pub fn send_bytes(&self, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
        assert!(fds.len() <= 32);
        let mut sent = 0usize;
        loop {
            let rest = &bytes[sent..];
            let mut iov = libc::iovec {
                iov_base: rest.as_ptr() as *mut libc::c_void,
                iov_len: rest.len(),
            };
            // Room for 32 descriptors, u64-aligned as cmsghdr needs.
            let mut cmsg = [0u64; 24];
            // SAFETY: a zeroed msghdr is valid; the pointers set below refer to live local
            // buffers.
            let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
            mh.msg_iov = &mut iov;
            mh.msg_iovlen = 1;
            if !fds.is_empty() && sent == 0 {
                let n = std::mem::size_of_val(fds) as u32;
                mh.msg_control = cmsg.as_mut_ptr().cast();
                // SAFETY: CMSG_SPACE is a pure size computation.
                mh.msg_controllen = unsafe { libc::CMSG_SPACE(n) } as usize;
                assert!(mh.msg_controllen <= std::mem::size_of_val(&cmsg));
                // SAFETY: the control buffer is large enough for one SCM_RIGHTS header and its
                // descriptors (checked above); CMSG_FIRSTHDR/CMSG_DATA point into it.
                unsafe {
                    let c = libc::CMSG_FIRSTHDR(&mh);
                    (*c).cmsg_level = libc::SOL_SOCKET;
                    (*c).cmsg_type = libc::SCM_RIGHTS;
                    (*c).cmsg_len = libc::CMSG_LEN(n) as usize;
                    std::ptr::copy_nonoverlapping(
                        fds.as_ptr(),
                        libc::CMSG_DATA(c).cast::<RawFd>(),
                        fds.len(),
                    );
                }
            }
            // SAFETY: `mh` describes valid buffers for the duration of the call.
            let n = unsafe { libc::sendmsg(self.sock.as_raw_fd(), &mh, libc::MSG_NOSIGNAL) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            sent += n as usize;
            if sent >= bytes.len() {
                return Ok(());
            }
        }
    }

    /// Sends one message (size field = payload length); an error means the backend is gone.
    pub fn send(&self, req: u32, flags: u32, payload: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
        self.send_bytes(&encode(req, flags, payload.len() as u32, payload), fds)
    }

    /// Reads the reply to `req` (panics on a malformed reply).
    pub fn reply(&mut self, req: u32) -> Reply {
        let mut hdr = [0u8; 12];
        match self.sock.read_exact(&mut hdr) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                return Reply::Closed
            }
            Err(e) => panic!("no reply to request {req}: {e}"),
        }
        let word =
            |i: usize| u32::from_le_bytes(hdr[i * 4..i * 4 + 4].try_into().expect("4 bytes"));
        assert_eq!(word(0), req, "reply to another request");
        assert_ne!(word(1) & REPLY, 0, "not a reply");
        let mut body = vec![0u8; word(2) as usize];
        if self.sock.read_exact(&mut body).is_err() {
            return Reply::Closed;
        }
        assert_eq!(body.len(), 8, "unexpected reply size");
        Reply::Ack(u64::from_le_bytes(body[..8].try_into().expect("8 bytes")))
    }

    /// Sends `req` asking for an acknowledgement, and returns it.
    pub fn request(&mut self, req: u32, payload: &[u8], fds: &[RawFd]) -> Reply {
        if self.send(req, VERSION | NEED_REPLY, payload, fds).is_err() {
            return Reply::Closed;
        }
        self.reply(req)
    }

    /// Sends `req` and reads its reply, which carries `body` bytes and one descriptor.
    pub fn request_fd(&mut self, req: u32, payload: &[u8], body: usize) -> (Vec<u8>, File) {
        self.send(req, VERSION, payload, &[])
            .expect("send the request");
        let mut buf = vec![0u8; 12 + body];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let mut cmsg = [0u64; 8];
        // SAFETY: a zeroed msghdr is valid; the pointers set below refer to live local buffers.
        let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
        mh.msg_iov = &mut iov;
        mh.msg_iovlen = 1;
        mh.msg_control = cmsg.as_mut_ptr().cast();
        mh.msg_controllen = std::mem::size_of_val(&cmsg);
        // SAFETY: `mh` describes valid buffers for the duration of the call.
        let n = unsafe { libc::recvmsg(self.sock.as_raw_fd(), &mut mh, libc::MSG_CMSG_CLOEXEC) };
        assert_eq!(n as usize, buf.len(), "short reply to request {req}");
        // SAFETY: recvmsg filled the control buffer, bounded by msg_controllen; an SCM_RIGHTS
        // payload is an array of descriptors now owned by this process.
        let fd = unsafe {
            let c = libc::CMSG_FIRSTHDR(&mh);
            assert!(!c.is_null(), "no descriptor in the reply to request {req}");
            assert_eq!((*c).cmsg_type, libc::SCM_RIGHTS);
            File::from_raw_fd(std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>()))
        };
        let word =
            |i: usize| u32::from_le_bytes(buf[i * 4..i * 4 + 4].try_into().expect("4 bytes"));
        assert_eq!(word(0), req);
        assert_eq!(word(2) as usize, body);
        (buf[12..].to_vec(), fd)
    }

    /// Sends `req` (no payload) and returns the u64 of its reply.
    pub fn get_u64(&mut self, req: u32) -> u64 {
        self.send(req, VERSION, &[], &[]).expect("send the request");
        match self.reply(req) {
            Reply::Ack(v) => v,
            Reply::Closed => panic!("closed on request {req}"),
        }
    }

    /// Features, protocol features (with `REPLY_ACK`, so refusals are answered), owner.
    pub fn handshake(&mut self) {
        self.handshake_with(
            PF_MQ | PF_REPLY_ACK | PF_INFLIGHT_SHMFD | PF_CONFIGURE_MEM_SLOTS | PF_CONFIG,
        );
    }

    /// [`Raw::handshake`] acknowledging the protocol features `protocol` (which the backend must
    /// offer; `REPLY_ACK` among them for refusals to be answered).
    pub fn handshake_with(&mut self, protocol: u64) {
        let f = self.get_u64(GET_FEATURES);
        let want = F_VERSION_1 | F_PROTOCOL_FEATURES;
        assert_eq!(f & want, want);
        self.send(SET_FEATURES, VERSION, &want.to_le_bytes(), &[])
            .expect("send SET_FEATURES");
        let pf = self.get_u64(GET_PROTOCOL_FEATURES);
        assert_eq!(pf & protocol, protocol);
        self.send(SET_PROTOCOL_FEATURES, VERSION, &protocol.to_le_bytes(), &[])
            .expect("send SET_PROTOCOL_FEATURES");
        assert_eq!(self.request(SET_OWNER, &[], &[]), Reply::Ack(0));
    }

    /// Reads whatever the backend sent without waiting, closing any descriptors that came with
    /// it: how many bytes, or [`Closed`].
    pub fn drain(&mut self) -> Result<usize, Closed> {
        self.recv_available(None)
    }

    /// [`Raw::drain`], appending the bytes to `out`.
    pub fn drain_into(&mut self, out: &mut Vec<u8>) -> Result<usize, Closed> {
        self.recv_available(Some(out))
    }

    /// Reads without waiting until nothing is left, appending the bytes to `out` if given.
    fn recv_available(&mut self, mut out: Option<&mut Vec<u8>>) -> Result<usize, Closed> {
        let mut total = 0;
        loop {
            let mut buf = [0u8; 8192];
            let mut iov = libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: buf.len(),
            };
            let mut cmsg = [0u64; 40];
            // SAFETY: a zeroed msghdr is valid; the pointers set below refer to live buffers.
            let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
            mh.msg_iov = &mut iov;
            mh.msg_iovlen = 1;
            mh.msg_control = cmsg.as_mut_ptr().cast();
            mh.msg_controllen = std::mem::size_of_val(&cmsg);
            // SAFETY: `mh` describes valid buffers for the duration of the call.
            let n = unsafe {
                libc::recvmsg(
                    self.sock.as_raw_fd(),
                    &mut mh,
                    libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
                )
            };
            close_received(&mh);
            if n == 0 {
                return Err(Closed);
            }
            if n < 0 {
                let e = std::io::Error::last_os_error();
                return match e.kind() {
                    std::io::ErrorKind::WouldBlock => Ok(total),
                    std::io::ErrorKind::Interrupted => continue,
                    _ => Err(Closed),
                };
            }
            if let Some(out) = out.as_deref_mut() {
                out.extend_from_slice(&buf[..n as usize]);
            }
            total += n as usize;
        }
    }

    /// Waits up to `timeout` for the next bytes from the backend, then drains them: how many
    /// bytes, or [`Closed`].
    pub fn wait_some(&mut self, timeout: Duration) -> Result<usize, Closed> {
        if !self.readable_within(timeout) {
            return Ok(0);
        }
        self.drain()
    }

    /// [`Raw::wait_some`], appending the bytes to `out`.
    pub fn wait_some_into(
        &mut self,
        timeout: Duration,
        out: &mut Vec<u8>,
    ) -> Result<usize, Closed> {
        if !self.readable_within(timeout) {
            return Ok(0);
        }
        self.drain_into(out)
    }

    /// True once the socket has something to read (or was closed), waiting up to `timeout`.
    fn readable_within(&self, timeout: Duration) -> bool {
        let mut p = libc::pollfd {
            fd: self.sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut p, 1, ms) > 0 }
    }

    /// True once the backend has closed the connection (within 20 s).
    pub fn wait_closed(&mut self) -> bool {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if self.wait_some(Duration::from_millis(200)).is_err() {
                return true;
            }
        }
        false
    }
}

/// Closes the descriptors an `SCM_RIGHTS` message delivered into `mh`'s control buffer.
fn close_received(mh: &libc::msghdr) {
    if mh.msg_controllen == 0 || mh.msg_control.is_null() {
        return;
    }
    // SAFETY: CMSG_FIRSTHDR/CMSG_NXTHDR walk the control buffer filled in by recvmsg, bounded by
    // msg_controllen; SCM_RIGHTS payloads are arrays of descriptors now owned by this process,
    // closed here exactly once.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(mh);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    drop(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(mh, c);
        }
    }
}

/// One region of a SET_MEM_TABLE / ADD_MEM_REG payload.
pub fn region(gpa: u64, size: u64, uaddr: u64, offset: u64) -> Vec<u8> {
    [gpa, size, uaddr, offset]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

/// A SET_MEM_TABLE payload: the region count, padding, then the regions.
pub fn mem_table(regions: &[Vec<u8>]) -> Vec<u8> {
    let mut p = (regions.len() as u32).to_le_bytes().to_vec();
    p.extend_from_slice(&[0u8; 4]);
    for r in regions {
        p.extend_from_slice(r);
    }
    p
}

/// An ADD_MEM_REG / REM_MEM_REG payload: padding, then the region.
pub fn add_mem_reg(r: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8; 8];
    p.extend_from_slice(r);
    p
}

/// A SET_INFLIGHT_FD / GET_INFLIGHT_FD payload.
pub fn inflight(mmap_size: u64, mmap_offset: u64, num_queues: u16, queue_size: u16) -> Vec<u8> {
    let mut p = mmap_size.to_le_bytes().to_vec();
    p.extend_from_slice(&mmap_offset.to_le_bytes());
    p.extend_from_slice(&num_queues.to_le_bytes());
    p.extend_from_slice(&queue_size.to_le_bytes());
    p.extend_from_slice(&[0u8; 4]);
    p
}

/// A vring state payload (SET_VRING_NUM, SET_VRING_BASE, SET_VRING_ENABLE): index, number.
pub fn vring_state(index: u32, num: u32) -> Vec<u8> {
    let mut p = index.to_le_bytes().to_vec();
    p.extend_from_slice(&num.to_le_bytes());
    p
}

/// A SET_VRING_ADDR payload: index, flags, then the ring addresses as the frontend sees them.
pub fn vring_addr(index: u32, flags: u32, desc: u64, used: u64, avail: u64, log: u64) -> Vec<u8> {
    let mut p = vring_state(index, flags);
    for a in [desc, used, avail, log] {
        p.extend_from_slice(&a.to_le_bytes());
    }
    p
}

/// A GET_CONFIG / SET_CONFIG payload: offset, size, flags, then `data`.
pub fn config_msg(offset: u32, size: u32, flags: u32, data: &[u8]) -> Vec<u8> {
    let mut p = offset.to_le_bytes().to_vec();
    p.extend_from_slice(&size.to_le_bytes());
    p.extend_from_slice(&flags.to_le_bytes());
    p.extend_from_slice(data);
    p
}

/// Guest memory of the attacker: a memfd of `len` bytes mapped in the test process, served at
/// gpa 0. Once the file is shrunk, only what still lies inside it may be touched (the test
/// process has no SIGBUS handler).
pub struct Guest {
    /// The memfd (shrink it to pull the memory from under the backend).
    pub file: File,
    ptr: *mut u8,
    /// Its length when created.
    pub len: u64,
}

/// A split virtqueue of `size` entries laid out in the first page of a [`Guest`]: descriptor
/// table at 0, available ring at 0x400, used ring at 0x800 (size up to 64).
#[derive(Debug, Clone, Copy)]
pub struct Ring {
    /// Entries.
    pub size: u16,
    /// Guest address of the descriptor table.
    pub desc: u64,
    /// Guest address of the available ring.
    pub avail: u64,
    /// Guest address of the used ring.
    pub used: u64,
}

impl Ring {
    /// The layout for `size` entries (a power of two, at most 64).
    pub fn new(size: u16) -> Ring {
        assert!(size <= 64 && size.is_power_of_two());
        Ring {
            size,
            desc: 0,
            avail: 0x400,
            used: 0x800,
        }
    }
}

impl Guest {
    /// `len` bytes (at least a page) of a new memfd, mapped.
    pub fn new(len: u64) -> Guest {
        assert!(len >= 4096);
        let file = memfd(len);
        // SAFETY: a fresh shared mapping of a file we own, of its full length; checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        Guest {
            file,
            ptr: ptr.cast(),
            len,
        }
    }

    /// The address of the mapping in this process (what a frontend reports as `user_addr`).
    pub fn host(&self) -> u64 {
        self.ptr as u64
    }

    /// Writes `data` at `gpa`.
    pub fn write(&self, gpa: u64, data: &[u8]) {
        assert!(gpa + data.len() as u64 <= self.len);
        // SAFETY: in bounds of the live mapping (checked above); the frontend may write its own
        // memory at any time.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(gpa as usize), data.len())
        };
    }

    /// The byte at `gpa`.
    pub fn read_u8(&self, gpa: u64) -> u8 {
        assert!(gpa < self.len);
        // SAFETY: in bounds of the live mapping; the backend writes it concurrently, hence the
        // volatile read.
        unsafe { std::ptr::read_volatile(self.ptr.add(gpa as usize)) }
    }

    /// The little-endian u16 at `gpa` (2-aligned).
    pub fn read_u16(&self, gpa: u64) -> u16 {
        assert!(gpa + 2 <= self.len && gpa % 2 == 0);
        // SAFETY: in bounds and aligned (checked above); volatile as the backend writes it.
        u16::from_le(unsafe { std::ptr::read_volatile(self.ptr.add(gpa as usize).cast::<u16>()) })
    }

    fn write_u16(&self, gpa: u64, v: u16) {
        assert!(gpa + 2 <= self.len && gpa % 2 == 0);
        // SAFETY: in bounds and aligned (checked above).
        unsafe { std::ptr::write_volatile(self.ptr.add(gpa as usize).cast::<u16>(), v.to_le()) }
    }

    /// Descriptor `i` of `ring`.
    pub fn set_desc(&self, ring: &Ring, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = addr.to_le_bytes().to_vec();
        d.extend_from_slice(&len.to_le_bytes());
        d.extend_from_slice(&flags.to_le_bytes());
        d.extend_from_slice(&next.to_le_bytes());
        self.write(ring.desc + 16 * u64::from(i % ring.size), &d);
    }

    /// Makes `head` available and publishes the new index.
    pub fn push_avail(&self, ring: &Ring, head: u16) {
        let idx = self.read_u16(ring.avail + 2);
        self.write_u16(ring.avail + 4 + 2 * u64::from(idx % ring.size), head);
        fence(Ordering::SeqCst);
        self.write_u16(ring.avail + 2, idx.wrapping_add(1));
    }

    /// Sets the available index directly (to anything).
    pub fn set_avail_idx(&self, ring: &Ring, idx: u16) {
        self.write_u16(ring.avail + 2, idx);
    }

    /// The used ring's index.
    pub fn used_idx(&self, ring: &Ring) -> u16 {
        self.read_u16(ring.used + 2)
    }

    /// A 512-byte virtio-blk write of `data_gpa` to `sector` as descriptors `first..first + 3`,
    /// header at `hdr_gpa` and status byte at `hdr_gpa + 0x10` (set to 0xff): returns the head.
    pub fn write_request(
        &self,
        ring: &Ring,
        first: u16,
        hdr_gpa: u64,
        data_gpa: u64,
        sector: u64,
    ) -> u16 {
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&1u32.to_le_bytes()); // VIRTIO_BLK_T_OUT
        h[8..].copy_from_slice(&sector.to_le_bytes());
        self.write(hdr_gpa, &h);
        self.write(hdr_gpa + 0x10, &[0xff]);
        self.set_desc(ring, first, hdr_gpa, 16, 1, first + 1);
        self.set_desc(ring, first + 1, data_gpa, 512, 1, first + 2);
        self.set_desc(ring, first + 2, hdr_gpa + 0x10, 1, 2, 0);
        first
    }

    /// Waits (up to 20 s) for the used index to reach `n`.
    pub fn wait_used(&self, ring: &Ring, n: u16) -> bool {
        let t = Instant::now();
        while self.used_idx(ring) < n {
            if t.elapsed() > Duration::from_secs(20) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping made in `new`, which nothing else refers to any more.
        unsafe { libc::munmap(self.ptr.cast(), self.len as usize) };
    }
}

/// Queue `index` of a backend set up on `ring` in `g` (memory table: `g` at gpa 0), plus the
/// kick and call eventfds.
pub struct RunningQueue {
    /// The kick eventfd (see [`kick`]).
    pub kick: File,
    /// The call eventfd.
    pub call: File,
}

impl Raw {
    /// Sets up queue `index` on `ring` in `g` (after [`Raw::handshake`]) and checks that a write
    /// from `g`'s first page through it completes with status 0.
    pub fn start_queue(&mut self, g: &Guest, ring: &Ring, index: u32) -> RunningQueue {
        let ok = Reply::Ack(0);
        assert_eq!(
            self.request(
                SET_MEM_TABLE,
                &mem_table(&[region(0, g.len, g.host(), 0)]),
                &[g.file.as_raw_fd()]
            ),
            ok
        );
        assert_eq!(
            self.request(
                SET_VRING_NUM,
                &vring_state(index, u32::from(ring.size)),
                &[]
            ),
            ok
        );
        assert_eq!(
            self.request(SET_VRING_BASE, &vring_state(index, 0), &[]),
            ok
        );
        let h = g.host();
        let addr = vring_addr(index, 0, h + ring.desc, h + ring.used, h + ring.avail, 0);
        assert_eq!(self.request(SET_VRING_ADDR, &addr, &[]), ok);
        let call = eventfd();
        let kick_fd = eventfd();
        let i = u64::from(index).to_le_bytes();
        assert_eq!(self.request(SET_VRING_CALL, &i, &[call.as_raw_fd()]), ok);
        assert_eq!(self.request(SET_VRING_KICK, &i, &[kick_fd.as_raw_fd()]), ok);
        assert_eq!(
            self.request(SET_VRING_ENABLE, &vring_state(index, 1), &[]),
            ok
        );
        let used = g.used_idx(ring);
        let head = g.write_request(ring, 0, 0xc00, 0xe00, 8);
        g.push_avail(ring, head);
        kick(&kick_fd);
        assert!(
            g.wait_used(ring, used.wrapping_add(1)),
            "first request not completed"
        );
        assert_eq!(g.read_u8(0xc10), 0, "first request failed");
        RunningQueue {
            kick: kick_fd,
            call,
        }
    }
}
