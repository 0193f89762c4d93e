//! Starting and stopping the SPDK application framework (environment, reactors, subsystems,
//! JSON config, JSON-RPC server) on a dedicated OS thread.
//!
//! `spdk_app_start` blocks the thread that calls it: that thread becomes the reactor of the
//! main core and runs the application thread. [`SpdkApp::start`] calls it on a new OS thread
//! and returns once SPDK has initialised (or failed), so the rest of the process — katablk's
//! vhost-user workers — keeps running plain Rust threads and reaches SPDK through messages.
//! DPDK can be initialised once per process, so an application can be started once.

use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use tracing::{error, info};

use crate::env::EnvOptions;
use crate::ffi;
use crate::thread::Thread;
use crate::Error;

static STARTED: AtomicBool = AtomicBool::new(false);

/// A running SPDK application. Dropping it stops the framework and waits for it.
#[derive(Debug)]
pub struct SpdkApp {
    thread: Thread,
    join: Option<JoinHandle<i32>>,
    cores: Vec<u32>,
}

struct StartCtx {
    ready: mpsc::SyncSender<Result<Thread, Error>>,
}

unsafe extern "C" fn app_started(ctx: *mut c_void) {
    // SAFETY: `ctx` is the `StartCtx` owned by the starting OS thread's stack frame, which
    // outlives spdk_app_start; the start callback runs once.
    let ctx = unsafe { &*ctx.cast::<StartCtx>() };
    let r = Thread::current().ok_or(Error::NotOnSpdkThread("start callback"));
    let _ = ctx.ready.send(r);
}

fn cstring(s: &str) -> Result<CString, Error> {
    CString::new(s).map_err(|_| Error::InvalidName(s.to_string()))
}

impl SpdkApp {
    /// Starts SPDK with `opts` and waits until its subsystems are initialised and the JSON
    /// config (if any) is loaded. Fails if an application was already started in this process.
    pub fn start(opts: &EnvOptions) -> Result<SpdkApp, Error> {
        let cores = opts.validate()?;
        if STARTED.swap(true, Ordering::SeqCst) {
            return Err(Error::AlreadyStarted);
        }
        let o = opts.clone();
        let (tx, rx) = mpsc::sync_channel(1);
        let join = std::thread::Builder::new()
            .name("spdk-reactor-0".into())
            .spawn(move || run_app(o, tx))
            .map_err(|e| Error::Io("spawn the SPDK thread", e))?;
        match rx.recv() {
            Ok(Ok(thread)) => {
                info!(cores = ?cores, "SPDK application started");
                Ok(SpdkApp {
                    thread,
                    join: Some(join),
                    cores,
                })
            }
            Ok(Err(e)) => {
                let _ = join.join();
                Err(e)
            }
            Err(_) => {
                let rc = join.join().unwrap_or(-1);
                Err(Error::StartFailed(rc))
            }
        }
    }

    /// The application thread: where bdevs are opened and admin work runs.
    pub fn thread(&self) -> Thread {
        self.thread
    }

    /// The reactor cores.
    pub fn cores(&self) -> &[u32] {
        &self.cores
    }

    /// Stops the framework (subsystems are finished, bdevs unregistered) and waits for it.
    pub fn stop(mut self) -> Result<(), Error> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<(), Error> {
        let Some(join) = self.join.take() else {
            return Ok(());
        };
        self.thread.send(|| {
            // SAFETY: spdk_app_start_shutdown must run on an SPDK thread: this message runs on
            // the app thread, alive while `join` has not finished.
            unsafe { ffi::spdk_app_start_shutdown() }
        })?;
        match join.join() {
            Ok(0) => Ok(()),
            Ok(rc) => Err(Error::Call("spdk_app_start", rc)),
            Err(_) => Err(Error::Stopped),
        }
    }
}

impl Drop for SpdkApp {
    fn drop(&mut self) {
        if let Err(e) = self.stop_inner() {
            error!("stopping SPDK: {e}");
        }
    }
}

fn run_app(o: EnvOptions, ready: mpsc::SyncSender<Result<Thread, Error>>) -> i32 {
    let mut strings = Vec::new();
    let mut opts = ffi::spdk_app_opts::default();
    // SAFETY: `opts` is a valid spdk_app_opts of the size passed.
    unsafe { ffi::spdk_app_opts_init(&mut opts, std::mem::size_of::<ffi::spdk_app_opts>()) };
    let mut set = || -> Result<(), Error> {
        let name = cstring(&o.name)?;
        opts.name = name.as_ptr();
        strings.push(name);
        let mask = cstring(&o.core_mask)?;
        opts.reactor_mask = mask.as_ptr();
        strings.push(mask);
        if let Some(m) = o.mem_size_mib {
            opts.mem_size = m as i32;
        }
        if let Some(i) = o.shm_id {
            opts.shm_id = i;
        }
        opts.no_pci = o.no_pci;
        opts.no_huge = o.no_huge;
        if let Some(h) = &o.hugedir {
            let h = cstring(h)?;
            opts.hugedir = h.as_ptr();
            strings.push(h);
        }
        match &o.rpc_addr {
            Some(r) => {
                let r = cstring(r)?;
                opts.rpc_addr = r.as_ptr();
                strings.push(r);
            }
            None => opts.rpc_addr = std::ptr::null(),
        }
        if let Some(j) = &o.json_config {
            let j = cstring(j)?;
            opts.json_config_file = j.as_ptr();
            strings.push(j);
        }
        opts.disable_cpumask_locks = o.disable_cpumask_locks;
        // katablk installs its own SIGTERM/SIGINT handling and stops the app itself.
        opts.disable_signal_handlers = true;
        Ok(())
    };
    if let Err(e) = set() {
        let _ = ready.send(Err(e));
        return -libc::EINVAL;
    }
    // The C strings `opts` points to, kept alive until spdk_app_start returns.
    let _keep = strings;
    let ctx = StartCtx { ready };
    // SAFETY: `opts` and the strings it points to, and `ctx`, live until spdk_app_start
    // returns; the callback only reads `ctx`.
    let rc = unsafe {
        ffi::spdk_app_start(
            &mut opts,
            Some(app_started),
            (&ctx as *const StartCtx).cast_mut().cast(),
        )
    };
    // SAFETY: spdk_app_start returned, so the framework is stopped; fini releases it.
    unsafe { ffi::spdk_app_fini() };
    if rc != 0 {
        error!(rc, "spdk_app_start failed");
    }
    // A failed start never called the callback: dropping `ctx` closes the channel, which
    // `SpdkApp::start` reports as StartFailed.
    drop(ctx);
    rc
}
