//! SPDK threads, messages and pollers.
//!
//! An `spdk_thread` is SPDK's unit of execution: a reactor (one OS thread per core of the
//! application's core mask) runs many of them, each with its message queue and pollers. Any OS
//! thread may send a message to an SPDK thread ([`Thread::send`]); pollers and I/O channels
//! belong to the SPDK thread they were created on.

use std::ffi::{c_int, c_void, CString};
use std::sync::mpsc;

use crate::ffi;
use crate::Error;

/// A handle to an `spdk_thread` that may be used from any OS thread to send it messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thread(*mut ffi::spdk_thread);

// SAFETY: the handle is only used with spdk_thread_send_msg (documented thread-safe) and for
// identity; everything that must run on the thread is sent there as a message.
unsafe impl Send for Thread {}
// SAFETY: as for Send: no method dereferences the pointer outside SPDK's thread-safe calls.
unsafe impl Sync for Thread {}

type Msg = Box<dyn FnOnce() + Send>;

unsafe extern "C" fn run_msg(ctx: *mut c_void) {
    // SAFETY: `ctx` is the `Box<Msg>` leaked by `Thread::send`, delivered exactly once.
    let f = unsafe { Box::from_raw(ctx.cast::<Msg>()) };
    f();
}

impl Thread {
    /// The SPDK thread the calling OS thread is running, if any.
    pub fn current() -> Option<Thread> {
        // SAFETY: spdk_get_thread only reads a thread-local.
        let t = unsafe { ffi::spdk_get_thread() };
        (!t.is_null()).then_some(Thread(t))
    }

    /// The application thread (the first thread, on the main core).
    pub fn app() -> Option<Thread> {
        // SAFETY: spdk_thread_get_app_thread reads a global set once at start.
        let t = unsafe { ffi::spdk_thread_get_app_thread() };
        (!t.is_null()).then_some(Thread(t))
    }

    /// Wraps a raw thread pointer.
    ///
    /// # Safety
    /// `t` must be a live `spdk_thread` for as long as the handle is used.
    pub unsafe fn from_raw(t: *mut ffi::spdk_thread) -> Thread {
        Thread(t)
    }

    /// The raw pointer.
    pub fn as_ptr(&self) -> *mut ffi::spdk_thread {
        self.0
    }

    /// Creates a new SPDK thread, scheduled by the framework on one of the application's cores.
    /// Must be called from an SPDK thread (use [`Thread::run`] on the app thread otherwise).
    pub fn create(name: &str) -> Result<Thread, Error> {
        if Thread::current().is_none() {
            return Err(Error::NotOnSpdkThread("spdk_thread_create"));
        }
        let cname = CString::new(name).map_err(|_| Error::InvalidName(name.to_string()))?;
        // SAFETY: `cname` is a valid C string for the call; a NULL cpumask means every core of
        // the application, and SPDK copies the name.
        let t = unsafe { ffi::spdk_thread_create(cname.as_ptr(), std::ptr::null()) };
        if t.is_null() {
            return Err(Error::Call("spdk_thread_create", -libc::ENOMEM));
        }
        Ok(Thread(t))
    }

    /// Like [`Thread::create`], restricted to reactor `core` when given.
    pub fn create_on(name: &str, core: Option<u32>) -> Result<Thread, Error> {
        let Some(core) = core else {
            return Thread::create(name);
        };
        if Thread::current().is_none() {
            return Err(Error::NotOnSpdkThread("spdk_thread_create"));
        }
        let cname = CString::new(name).map_err(|_| Error::InvalidName(name.to_string()))?;
        let mut set = ffi::spdk_cpuset::default();
        // SAFETY: `set` is a valid cpuset; SPDK copies it and the name.
        let t = unsafe {
            ffi::spdk_cpuset_zero(&mut set);
            ffi::spdk_cpuset_set_cpu(&mut set, core, true);
            ffi::spdk_thread_create(cname.as_ptr(), &set)
        };
        if t.is_null() {
            return Err(Error::Call("spdk_thread_create", -libc::ENOMEM));
        }
        Ok(Thread(t))
    }

    /// Runs `f` on this thread, later. Fails if the thread no longer takes messages.
    pub fn send(&self, f: impl FnOnce() + Send + 'static) -> Result<(), Error> {
        let b: Box<Msg> = Box::new(Box::new(f));
        let ctx = Box::into_raw(b).cast::<c_void>();
        // SAFETY: spdk_thread_send_msg may be called from any thread; `run_msg` takes back the
        // box exactly once when the message runs.
        let rc = unsafe { ffi::spdk_thread_send_msg(self.0, Some(run_msg), ctx) };
        if rc != 0 {
            // SAFETY: the message was not queued, so the box is still ours.
            drop(unsafe { Box::from_raw(ctx.cast::<Msg>()) });
            return Err(Error::Call("spdk_thread_send_msg", rc));
        }
        Ok(())
    }

    /// Runs `f` on this thread and waits for its result. Must not be called from an SPDK
    /// thread (it would block a reactor); use [`Thread::send`] there.
    pub fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, Error> {
        if Thread::current().is_some() {
            return Err(Error::OnSpdkThread);
        }
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(move || {
            let _ = tx.send(f());
        })?;
        rx.recv().map_err(|_| Error::Stopped)
    }
}

type LocalMsg = Box<dyn FnOnce()>;

unsafe extern "C" fn run_local_msg(ctx: *mut c_void) {
    // SAFETY: `ctx` is the `Box<LocalMsg>` leaked by `send_to_current`, delivered once, on the
    // thread that sent it.
    let f = unsafe { Box::from_raw(ctx.cast::<LocalMsg>()) };
    f();
}

/// Runs `f` later on the current SPDK thread (after the current poller or message returns).
/// `f` need not be `Send`: it never leaves this thread.
pub fn send_to_current(f: impl FnOnce() + 'static) -> Result<(), Error> {
    let t = Thread::current().ok_or(Error::NotOnSpdkThread("send_to_current"))?;
    let b: Box<LocalMsg> = Box::new(Box::new(f));
    let ctx = Box::into_raw(b).cast::<c_void>();
    // SAFETY: the message is queued to the calling thread itself, so the non-Send closure runs
    // on the thread that made it; `run_local_msg` takes the box back exactly once.
    let rc = unsafe { ffi::spdk_thread_send_msg(t.0, Some(run_local_msg), ctx) };
    if rc != 0 {
        // SAFETY: not queued, still ours.
        drop(unsafe { Box::from_raw(ctx.cast::<LocalMsg>()) });
        return Err(Error::Call("spdk_thread_send_msg", rc));
    }
    Ok(())
}

type PollFn = Box<dyn FnMut() -> bool>;

unsafe extern "C" fn run_poller(ctx: *mut c_void) -> c_int {
    // SAFETY: `ctx` is the `Box<PollFn>` owned by the `Poller`, which unregisters the poller
    // before freeing it; pollers run only on their own thread, never concurrently.
    let f = unsafe { &mut *ctx.cast::<PollFn>() };
    if f() {
        ffi::SPDK_POLLER_BUSY as c_int
    } else {
        ffi::SPDK_POLLER_IDLE as c_int
    }
}

/// A function run by the current SPDK thread on every iteration (or every `period_us`). It
/// returns true when it did work. Unregistered when dropped, which must happen on the same
/// SPDK thread (the type is not `Send`).
pub struct Poller {
    raw: *mut ffi::spdk_poller,
    ctx: *mut PollFn,
}

impl Poller {
    /// Registers `f` on the current SPDK thread.
    pub fn register(f: impl FnMut() -> bool + 'static, period_us: u64) -> Result<Poller, Error> {
        if Thread::current().is_none() {
            return Err(Error::NotOnSpdkThread("spdk_poller_register"));
        }
        let ctx: *mut PollFn = Box::into_raw(Box::new(Box::new(f)));
        // SAFETY: on an SPDK thread (checked); `ctx` stays valid until the poller is
        // unregistered in Drop.
        let raw = unsafe { ffi::spdk_poller_register(Some(run_poller), ctx.cast(), period_us) };
        if raw.is_null() {
            // SAFETY: not registered, still ours.
            drop(unsafe { Box::from_raw(ctx) });
            return Err(Error::Call("spdk_poller_register", -libc::ENOMEM));
        }
        Ok(Poller { raw, ctx })
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        // SAFETY: Poller is !Send, so this runs on the thread that registered it; after
        // spdk_poller_unregister the poller function is never called again (even when called
        // from inside the poller itself), so the context can be freed.
        unsafe {
            ffi::spdk_poller_unregister(&mut self.raw);
            drop(Box::from_raw(self.ctx));
        }
    }
}

/// Marks the current SPDK thread as exiting; the framework destroys it once its pollers and
/// I/O channels are gone.
pub fn exit_current() -> Result<(), Error> {
    let t = Thread::current().ok_or(Error::NotOnSpdkThread("spdk_thread_exit"))?;
    // SAFETY: called on the thread itself, as SPDK requires.
    let rc = unsafe { ffi::spdk_thread_exit(t.0) };
    if rc != 0 {
        return Err(Error::Call("spdk_thread_exit", rc));
    }
    Ok(())
}
