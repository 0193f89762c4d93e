//! A minimal non-blocking `eventfd(2)` wrapper: the completion signal that asynchronous channels
//! expose through [`crate::IoChannel::notify_fd`].

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::BdevError;

/// A non-blocking, close-on-exec eventfd.
#[derive(Debug)]
pub(crate) struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// Creates an eventfd with a zero counter.
    pub(crate) fn new() -> Result<Self, BdevError> {
        // SAFETY: plain system call with integer arguments; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(BdevError::io("eventfd", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a freshly created descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(EventFd { fd })
    }

    /// The descriptor, for `poll`/`epoll`.
    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Makes the descriptor readable (adds one to the counter).
    pub(crate) fn signal(&self) {
        let one: u64 = 1;
        loop {
            // SAFETY: writes 8 bytes from a valid local to an owned descriptor.
            let r = unsafe {
                libc::write(
                    self.fd.as_raw_fd(),
                    (&one as *const u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
            // EAGAIN means the counter is saturated, which still reads as "signalled".
            if r >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return;
            }
        }
    }

    /// Resets the counter to zero (no-op when it already is).
    pub(crate) fn clear(&self) {
        let mut v: u64 = 0;
        loop {
            // SAFETY: reads 8 bytes into a valid local from an owned descriptor.
            let r = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    (&mut v as *mut u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
            if r >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return;
            }
        }
    }

    /// Waits until the descriptor is readable or `timeout_ms` passes (`-1`: forever). Returns
    /// early on a signal.
    pub(crate) fn wait_readable(&self, timeout_ms: libc::c_int) {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd on the stack for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(e: &EventFd) -> bool {
        let mut pfd = libc::pollfd {
            fd: e.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        unsafe { libc::poll(&mut pfd, 1, 0) == 1 }
    }

    #[test]
    fn signal_and_clear() {
        let e = EventFd::new().unwrap();
        assert!(!readable(&e));
        e.signal();
        e.signal();
        assert!(readable(&e));
        e.clear();
        assert!(!readable(&e));
        e.clear();
        e.wait_readable(0);
    }
}
