//! Running katablk's vhost-user queue workers on SPDK reactors.
//!
//! [`SpdkRuntime`] implements the vhost crate's [`WorkerRuntime`]: each queue worker becomes an
//! SPDK thread with one poller that calls the worker's step function on every reactor
//! iteration. The worker opens its bdev channels on that thread, so a request goes from the
//! virtqueue to `spdk_bdev_*` and its completion back to the used ring on one core with no
//! hand-off, as in SPDK's own vhost target.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::mpsc;

use katablk_vhost::{StepResult, WorkerJoin, WorkerRuntime, WorkerStep};
use tracing::{error, warn};

use crate::thread::{exit_current, send_to_current, Poller, Thread};

/// Queue workers as SPDK threads polled by the application's reactors.
#[derive(Debug, Clone)]
pub struct SpdkRuntime {
    app: Thread,
    cores: Vec<u32>,
}

impl SpdkRuntime {
    /// A runtime creating its threads through the application thread `app`, on `cores`
    /// (the application's reactor cores).
    pub fn new(app: Thread, cores: Vec<u32>) -> SpdkRuntime {
        SpdkRuntime { app, cores }
    }
}

struct Join(mpsc::Receiver<()>);

impl WorkerJoin for Join {
    fn join(self: Box<Self>) {
        let _ = self.0.recv();
    }
}

fn err(e: impl std::fmt::Display) -> katablk_vhost::Error {
    katablk_vhost::Error::Sys("SPDK worker", std::io::Error::other(e.to_string()))
}

impl WorkerRuntime for SpdkRuntime {
    fn spawn(
        &self,
        name: String,
        cpu: Option<usize>,
        step: WorkerStep,
    ) -> Result<Box<dyn WorkerJoin>, katablk_vhost::Error> {
        let core = cpu
            .and_then(|c| u32::try_from(c).ok())
            .filter(|c| self.cores.contains(c));
        let t = self
            .app
            .run(move || Thread::create_on(&name, core))
            .map_err(err)?
            .map_err(err)?;
        let (tx, rx) = mpsc::sync_channel(1);
        t.send(move || {
            let holder: Rc<RefCell<Option<Poller>>> = Default::default();
            let h2 = holder.clone();
            let mut step = step;
            let mut tx = Some(tx);
            let mut done = false;
            let p = Poller::register(
                move || {
                    if done {
                        return false;
                    }
                    // A panic must not unwind into SPDK's C poller loop (that aborts the
                    // process, every volume with it): a worker that panicked ends like one
                    // that exited, and its backend sees it gone.
                    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut step)) {
                        // Busy or idle in SPDK's accounting (thread_get_stats, spdk_top).
                        Ok(StepResult::Busy) => return true,
                        Ok(StepResult::Idle) => return false,
                        Ok(StepResult::Exited) => {}
                        Err(_) => error!("queue worker panicked; its queues are stopped"),
                    }
                    // The worker exited: unregister and end the thread outside this callback.
                    done = true;
                    let (h3, tx) = (h2.clone(), tx.take());
                    let r = send_to_current(move || {
                        h3.borrow_mut().take();
                        if let Err(e) = exit_current() {
                            warn!("worker thread exit: {e}");
                        }
                        if let Some(tx) = tx {
                            let _ = tx.send(());
                        }
                    });
                    if let Err(e) = r {
                        warn!("worker teardown: {e}");
                    }
                    true
                },
                0,
            );
            match p {
                Ok(p) => *holder.borrow_mut() = Some(p),
                Err(e) => {
                    warn!("cannot poll a queue worker: {e}");
                    let _ = exit_current();
                    // Dropping `tx` (in the closure that failed to register) ends join().
                }
            }
        })
        .map_err(err)?;
        Ok(Box::new(Join(rx)))
    }
}
