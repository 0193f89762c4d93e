//! Surviving a file that shrinks under a shared mapping of it.
//!
//! Guest memory and the inflight region are shared mappings of files a vhost-user frontend owns,
//! and a file device on tmpfs maps its file (`memfile`). Their sizes are checked before they are
//! mapped (the vhost backend's `fdcheck`), but the owner of such a file can
//! `ftruncate` a file afterwards: the next access past the new end raises `SIGBUS`, whose
//! default action kills the process and every device it serves.
//!
//! [`install`] puts a process-wide `SIGBUS` handler in place (once). Mappings that a frontend
//! can shrink are registered with [`protect`], each with the [`Poison`] of the connection that
//! owns it. When a fault hits a registered mapping the handler maps anonymous zero pages over
//! the faulting page (so the access that faulted, and any later one, reads zeroes instead of
//! faulting again), marks the connection poisoned, wakes the server thread through the poison's
//! eventfd, and returns. The queue workers stop serving a poisoned connection's queues and the
//! server drops the frontend; other devices in the process go on undisturbed.
//!
//! A fault anywhere else is not ours: the handler passes it on to the handler installed before
//! it (Rust's own stack-overflow handler in a Rust program), or restores the default action and
//! raises the signal again, so the process dies of `SIGBUS` as it would have without us.
//!
//! The handler takes no lock and allocates nothing: the registry is a fixed array of slots whose
//! fields are atomics. A slot goes FREE → BUSY (being filled) → LIVE (visible to the handler)
//! → BUSY (being emptied) → FREE. Handlers count themselves in `ACTIVE` before they read the
//! registry; a slot being emptied releases its reference on the poison only once no handler is
//! running, so the handler never touches a freed poison.
//!
//! Only the faulting page is replaced (the next larger unit, the file's block size, is tried
//! when the mapping is on hugetlbfs, where 4 KiB pieces cannot be remapped). Whatever else is
//! mapped around it stays as it is: even a registration that outlived its mapping can then only
//! turn into zeroes a page that was faulting anyway.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Once};

use tracing::{error, warn};

use crate::eventfd::EventFd;
use crate::BdevError;

/// Registry capacity: mappings protected at once in the whole process (every device's memory
/// regions and inflight regions).
pub const MAX_PROTECTED: usize = 4096;

const FREE: u8 = 0;
const BUSY: u8 = 1;
const LIVE: u8 = 2;

/// One registered mapping.
struct Slot {
    state: AtomicU8,
    start: AtomicUsize,
    len: AtomicUsize,
    /// Smallest unit that can be remapped (the page size, or the huge page size).
    align: AtomicUsize,
    /// A reference (from `Arc::into_raw`) on the poison of the owning connection.
    poison: AtomicPtr<Poison>,
}

impl Slot {
    const fn new() -> Self {
        Slot {
            state: AtomicU8::new(FREE),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            align: AtomicUsize::new(0),
            poison: AtomicPtr::new(std::ptr::null_mut()),
        }
    }
}

static SLOTS: [Slot; MAX_PROTECTED] = [const { Slot::new() }; MAX_PROTECTED];
/// Signal handlers currently reading [`SLOTS`].
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// The system page size, read once at install (sysconf is not async-signal-safe).
static PAGE: AtomicUsize = AtomicUsize::new(4096);
/// `sa_sigaction` and `sa_flags` of the handler in place before ours.
static PREV_ACTION: AtomicUsize = AtomicUsize::new(libc::SIG_DFL);
static PREV_FLAGS: AtomicUsize = AtomicUsize::new(0);
/// Faults absorbed since the process started.
static ABSORBED: AtomicU64 = AtomicU64::new(0);
static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The poisoned state of one frontend connection, set by the signal handler when one of its
/// mappings faulted.
#[derive(Debug)]
pub struct Poison {
    poisoned: AtomicBool,
    /// The first faulting address seen.
    addr: AtomicUsize,
    /// Readable once poisoned: wakes the server thread to drop the frontend.
    wake: EventFd,
}

impl Poison {
    /// A fresh, unpoisoned state.
    pub fn new() -> Result<Arc<Self>, BdevError> {
        Ok(Arc::new(Poison {
            poisoned: AtomicBool::new(false),
            addr: AtomicUsize::new(0),
            wake: EventFd::new()?,
        }))
    }

    /// True once a mapping of the connection faulted.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// The faulting address (0 when not poisoned).
    pub fn fault_addr(&self) -> usize {
        self.addr.load(Ordering::Relaxed)
    }

    /// The eventfd that becomes readable when the connection is poisoned.
    pub fn wake_fd(&self) -> i32 {
        self.wake.fd()
    }

    /// Forgets the poisoned state (for the next connection, once every mapping of the previous
    /// one is no longer accessed).
    pub fn reset(&self) {
        self.wake.clear();
        self.addr.store(0, Ordering::Relaxed);
        self.poisoned.store(false, Ordering::Release);
    }

    /// Called from the signal handler: only atomics and write(2).
    fn mark(&self, addr: usize) {
        let _ = self
            .addr
            .compare_exchange(0, addr, Ordering::Relaxed, Ordering::Relaxed);
        self.poisoned.store(true, Ordering::Release);
        let one: u64 = 1;
        // SAFETY: write(2) is async-signal-safe; the eventfd lives as long as `self`, and the
        // buffer is a live local u64, as eventfd writes require.
        unsafe {
            libc::write(
                self.wake.fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

/// Faults absorbed by the handler since the process started.
#[cfg(test)]
pub(crate) fn absorbed_faults() -> u64 {
    ABSORBED.load(Ordering::Relaxed)
}

/// Installs the process-wide `SIGBUS` handler (the first call does it; later calls return what
/// it did). False if `sigaction` failed, in which case faults stay fatal.
pub fn install() -> bool {
    INSTALL.call_once(|| {
        // SAFETY: sysconf has no memory-safety preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if let Ok(p) = usize::try_from(page) {
            if p.is_power_of_two() {
                PAGE.store(p, Ordering::Relaxed);
            }
        }
        // SAFETY: an all-zero sigaction is a valid value of this plain C struct.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: reads the current disposition of SIGBUS into `old`, a valid buffer.
        if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) } != 0 {
            error!(
                "cannot read the SIGBUS disposition: {}",
                std::io::Error::last_os_error()
            );
            return;
        }
        PREV_ACTION.store(old.sa_sigaction, Ordering::SeqCst);
        PREV_FLAGS.store(old.sa_flags as usize, Ordering::SeqCst);
        // SAFETY: as above.
        let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
        sa.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        // SAFETY: `sa.sa_mask` is a valid sigset_t to initialise.
        unsafe { libc::sigemptyset(&mut sa.sa_mask) };
        // SAFETY: `sa` is fully initialised and `on_sigbus` has the SA_SIGINFO signature; the
        // handler only performs async-signal-safe operations.
        if unsafe { libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) } != 0 {
            error!(
                "cannot install the SIGBUS handler: {}",
                std::io::Error::last_os_error()
            );
            return;
        }
        INSTALLED.store(true, Ordering::SeqCst);
    });
    INSTALLED.load(Ordering::SeqCst)
}

/// A registered mapping: while it lives, a `SIGBUS` in `[start, start + len)` poisons the
/// connection instead of killing the process. Drop it only once the mapping is no longer
/// accessed.
#[derive(Debug)]
pub struct Protection {
    slot: usize,
}

/// Registers the mapping `[start, start + len)` of a file whose block size is `block_size`
/// (the huge page size on hugetlbfs), owned by the connection `poison`. `None` (logged) if the
/// handler could not be installed or the registry is full: the mapping then stays unprotected.
pub fn protect(
    start: *const u8,
    len: usize,
    block_size: u64,
    poison: &Arc<Poison>,
) -> Option<Protection> {
    if !install() {
        return None;
    }
    let page = PAGE.load(Ordering::Relaxed);
    let align = usize::try_from(block_size)
        .ok()
        .filter(|b| b.is_power_of_two() && *b > page && *b <= 1 << 30)
        .unwrap_or(page);
    for (i, s) in SLOTS.iter().enumerate() {
        if s.state
            .compare_exchange(FREE, BUSY, Ordering::SeqCst, Ordering::Relaxed)
            .is_err()
        {
            continue;
        }
        s.start.store(start as usize, Ordering::SeqCst);
        s.len.store(len, Ordering::SeqCst);
        s.align.store(align, Ordering::SeqCst);
        s.poison
            .store(Arc::into_raw(poison.clone()).cast_mut(), Ordering::SeqCst);
        s.state.store(LIVE, Ordering::SeqCst);
        return Some(Protection { slot: i });
    }
    warn!(
        start = start as usize,
        len, "SIGBUS registry full ({MAX_PROTECTED} mappings): mapping left unprotected"
    );
    None
}

impl Drop for Protection {
    fn drop(&mut self) {
        let s = &SLOTS[self.slot];
        s.state.store(BUSY, Ordering::SeqCst);
        // A handler that saw the slot LIVE is counted in ACTIVE (it counts itself before reading
        // any state); one that starts now sees BUSY. Wait for the former before letting go of
        // the poison.
        while ACTIVE.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
        let p = s.poison.swap(std::ptr::null_mut(), Ordering::SeqCst);
        if !p.is_null() {
            // SAFETY: `p` came from `Arc::into_raw` in `protect` and is released exactly once
            // (swapped out above); no signal handler can be reading it any more.
            drop(unsafe { Arc::from_raw(p.cast_const()) });
        }
        s.state.store(FREE, Ordering::SeqCst);
    }
}

/// Maps anonymous zero pages over `[base, base + len)`; true on success.
///
/// # Safety
///
/// The range must lie inside a mapping whose contents may be thrown away (a registered guest
/// or inflight mapping of a connection being poisoned).
unsafe fn zero_map(base: usize, len: usize) -> bool {
    // SAFETY: the caller guarantees the range is one of our faulting file mappings; MAP_FIXED
    // replaces exactly that range. mmap is a plain system call, safe in a signal handler.
    let r = unsafe {
        libc::mmap(
            base as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    r != libc::MAP_FAILED
}

/// Looks `addr` up in the registry and, if a registered mapping holds it, replaces the faulting
/// page with zeroes and poisons the mapping's connection. True if the fault was absorbed.
fn absorb(addr: usize) -> bool {
    let page = PAGE.load(Ordering::Relaxed);
    ACTIVE.fetch_add(1, Ordering::SeqCst);
    let mut absorbed = false;
    for s in SLOTS.iter() {
        if s.state.load(Ordering::SeqCst) != LIVE {
            continue;
        }
        let start = s.start.load(Ordering::SeqCst);
        let len = s.len.load(Ordering::SeqCst);
        if addr < start || addr - start >= len {
            continue;
        }
        let align = s.align.load(Ordering::SeqCst).max(page);
        // SAFETY: the page holding `addr` is inside this registered mapping and faults.
        let mut ok = unsafe { zero_map(addr & !(page - 1), page) };
        if !ok && align > page {
            // hugetlbfs: only whole huge pages can be replaced.
            let base = (addr & !(align - 1)).max(start);
            // SAFETY: as above; the range is clipped to the registered mapping.
            ok = unsafe { zero_map(base, align.min(start + len - base)) };
        }
        if ok {
            let p = s.poison.load(Ordering::SeqCst);
            if !p.is_null() {
                // SAFETY: the slot holds a reference on the poison, released only once ACTIVE
                // drops to zero (see `Protection::drop`), and we are counted in ACTIVE.
                unsafe { &*p }.mark(addr);
            }
            absorbed = true;
            break;
        }
    }
    ACTIVE.fetch_sub(1, Ordering::SeqCst);
    if absorbed {
        ABSORBED.fetch_add(1, Ordering::Relaxed);
    }
    absorbed
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: __errno_location returns this thread's errno, always valid.
    let errno = unsafe { *libc::__errno_location() };
    let ours = if info.is_null() {
        false
    } else {
        // SAFETY: the kernel passes a valid siginfo_t with SA_SIGINFO; si_addr is meaningful
        // for the SIGBUS fault codes checked first.
        let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
        (code == libc::BUS_ADRERR || code == libc::BUS_OBJERR) && absorb(addr)
    };
    // SAFETY: as above; restores the interrupted code's errno.
    unsafe { *libc::__errno_location() = errno };
    if ours {
        return;
    }
    let prev = PREV_ACTION.load(Ordering::SeqCst);
    let flags = PREV_FLAGS.load(Ordering::SeqCst) as libc::c_int;
    if prev == libc::SIG_DFL || prev == libc::SIG_IGN {
        // SAFETY: an all-zero sigaction with SIG_DFL is the default disposition; sigaction and
        // raise are async-signal-safe. The raised signal is blocked until this handler returns,
        // then kills the process with SIGBUS as if no handler had been installed.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
            libc::raise(libc::SIGBUS);
        }
        return;
    }
    if flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the previous handler was installed with SA_SIGINFO, so its address is a
        // function of this signature; it gets the arguments we were given.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(prev) };
        f(sig, info, ctx);
    } else {
        // SAFETY: without SA_SIGINFO the previous handler is a plain `void (*)(int)`.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(prev) };
        f(sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::fd::{AsRawFd, FromRawFd};

    fn memfd(len: u64) -> File {
        // SAFETY: memfd_create with a NUL-terminated name; checked below.
        let fd = unsafe { libc::memfd_create(c"sigbus".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor owned by nobody else.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(len).unwrap();
        f
    }

    fn map(f: &File, len: usize) -> *mut u8 {
        // SAFETY: a fresh shared mapping of our own memfd; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p.cast()
    }

    /// A registered mapping whose file shrinks: reads past the new end return zeroes, the
    /// poison is set and its eventfd readable; the slot is freed with the protection.
    #[test]
    fn shrunk_mapping_reads_zeroes_and_poisons() {
        const LEN: usize = 1 << 20;
        let f = memfd(LEN as u64);
        let p = map(&f, LEN);
        let poison = Poison::new().unwrap();
        let guard = protect(p, LEN, 4096, &poison).unwrap();
        // SAFETY: inside the mapping, the file still covers it.
        unsafe { p.add(LEN - 1).write_volatile(7) };
        f.set_len(4096).unwrap();
        let before = absorbed_faults();
        // SAFETY: inside the mapping; past the end of the file now, so it faults and the
        // handler replaces the page.
        let v = unsafe { p.add(LEN / 2 + 5).read_volatile() };
        assert_eq!(v, 0);
        // The replaced page is plain memory now.
        // SAFETY: as above.
        unsafe { p.add(LEN / 2).write_volatile(3) };
        // SAFETY: as above.
        assert_eq!(unsafe { p.add(LEN / 2).read_volatile() }, 3);
        // SAFETY: the first page is still backed by the file.
        unsafe { p.write_volatile(1) };
        assert!(poison.is_poisoned());
        assert_eq!(poison.fault_addr(), p as usize + LEN / 2 + 5);
        assert_eq!(absorbed_faults(), before + 1);
        let mut count = 0u64;
        // SAFETY: reads 8 bytes from the poison's non-blocking eventfd into a local u64.
        let n = unsafe { libc::read(poison.wake_fd(), (&mut count as *mut u64).cast(), 8) };
        assert_eq!((n, count), (8, 1));
        poison.reset();
        assert!(!poison.is_poisoned());
        drop(guard);
        assert!(SLOTS
            .iter()
            .all(|s| s.poison.load(Ordering::SeqCst) != Arc::as_ptr(&poison).cast_mut()));
        assert_eq!(Arc::strong_count(&poison), 1);
        // SAFETY: unmaps our own mapping.
        unsafe { libc::munmap(p.cast(), LEN) };
    }

    /// On hugetlbfs only whole huge pages can be remapped: the 4 KiB attempt fails and the
    /// handler replaces the faulting huge page (the file's block size).
    /// Skipped when the machine has no free huge pages.
    #[test]
    fn shrunk_hugetlb_mapping_reads_zeroes_and_poisons() {
        const HUGE: usize = 2 << 20;
        // SAFETY: memfd_create with a NUL-terminated name; checked below.
        let fd = unsafe {
            libc::memfd_create(
                c"sigbus-huge".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
            )
        };
        if fd < 0 {
            eprintln!("no hugetlb memfd: {}", std::io::Error::last_os_error());
            return;
        }
        // SAFETY: a fresh descriptor owned by nobody else.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(2 * HUGE as u64).unwrap();
        // SAFETY: a fresh shared mapping of our own memfd; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                2 * HUGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            eprintln!("no free huge pages: {}", std::io::Error::last_os_error());
            return;
        }
        let p = p.cast::<u8>();
        let poison = Poison::new().unwrap();
        let guard = protect(p, 2 * HUGE, HUGE as u64, &poison).unwrap();
        // SAFETY: inside the mapping, backed by the file (pages reserved at mmap).
        unsafe { p.write_volatile(1) };
        f.set_len(HUGE as u64).unwrap();
        // SAFETY: inside the mapping, past the new end of the file: faults, and the handler
        // replaces the second huge page.
        assert_eq!(unsafe { p.add(HUGE + 4096).read_volatile() }, 0);
        assert!(poison.is_poisoned());
        // SAFETY: the first huge page is still the file's.
        assert_eq!(unsafe { p.read_volatile() }, 1);
        drop(guard);
        // SAFETY: unmaps our own mapping.
        unsafe { libc::munmap(p.cast(), 2 * HUGE) };
    }

    /// A fault in a mapping nobody registered still kills the process with SIGBUS (checked in
    /// a forked child, which only makes raw system calls).
    #[test]
    fn unregistered_fault_still_kills() {
        assert!(install());
        let f = memfd(0);
        // SAFETY: fork in a test process; the child only makes async-signal-safe system calls
        // (mmap, a faulting read, _exit) and allocates nothing.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: raw system calls on our own memfd in the child, then _exit.
            unsafe {
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ,
                    libc::MAP_SHARED,
                    f.as_raw_fd(),
                    0,
                );
                if p == libc::MAP_FAILED {
                    libc::_exit(2);
                }
                std::ptr::read_volatile(p.cast::<u8>());
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFSIGNALED(status), "child exited: {status:#x}");
        assert_eq!(libc::WTERMSIG(status), libc::SIGBUS);
    }
}
