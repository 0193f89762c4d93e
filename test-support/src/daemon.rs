//! A server the tests run as a child process: `katablk-vhost`, `katablk-target`, SPDK's
//! `vhost`, `katablk-csi`, `qemu-storage-daemon`.
//!
//! A [`Daemon`] keeps its command line, so a test can stop or kill it and start the same
//! server again. Starting waits until its socket accepts connections (or its path exists),
//! failing the test with the end of its log when the child exits first or the socket does not
//! come within the timeout. Its stderr (and, when asked, stdout) can go to a log file. The
//! child is killed when the value is dropped, so a failing test leaves no server behind.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long [`Daemon::start`] waits for the socket by default.
pub const START_TIMEOUT: Duration = Duration::from_secs(20);

/// How often waits poll.
const POLL: Duration = Duration::from_millis(10);

/// How much of the log a failure shows.
const LOG_TAIL_LINES: usize = 40;

/// What tells that the child is ready.
#[derive(Clone, Debug)]
enum Ready {
    /// Nothing: started is ready.
    Spawned,
    /// A unix socket at this path accepts a connection.
    Connect(PathBuf),
    /// This path exists.
    Exists(PathBuf),
}

/// Where the child's output goes.
#[derive(Clone, Debug)]
struct Log {
    path: PathBuf,
    /// Appended to (a restarted child's log follows the previous one's), else truncated at
    /// each start.
    append: bool,
    /// stdout too, not only stderr.
    stdout: bool,
}

/// A child process serving a socket, and how to start it again.
#[derive(Debug)]
pub struct Daemon {
    /// The running child; `None` before the first start and once stopped or killed.
    pub child: Option<Child>,
    program: PathBuf,
    args: Vec<OsString>,
    envs: Vec<(OsString, OsString)>,
    ready: Ready,
    timeout: Duration,
    log: Option<Log>,
    null_stdout: bool,
}

impl Daemon {
    /// A daemon running `program`, not started yet; stdin is `/dev/null`, stdout and stderr
    /// are the test's unless a log is set.
    pub fn new(program: impl Into<PathBuf>) -> Daemon {
        Daemon {
            child: None,
            program: program.into(),
            args: Vec::new(),
            envs: Vec::new(),
            ready: Ready::Spawned,
            timeout: START_TIMEOUT,
            log: None,
            null_stdout: false,
        }
    }

    /// Adds one argument.
    pub fn arg(mut self, a: impl Into<OsString>) -> Daemon {
        self.args.push(a.into());
        self
    }

    /// Adds arguments.
    pub fn args<I, S>(mut self, args: I) -> Daemon
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets an environment variable of the child.
    pub fn env(mut self, k: impl Into<OsString>, v: impl Into<OsString>) -> Daemon {
        self.envs.push((k.into(), v.into()));
        self
    }

    /// Ready once a unix socket at `path` accepts a connection.
    pub fn wait_for_socket(mut self, path: impl Into<PathBuf>) -> Daemon {
        self.ready = Ready::Connect(path.into());
        self
    }

    /// Ready once `path` exists (for servers that must not see a probing connection).
    pub fn wait_for_path(mut self, path: impl Into<PathBuf>) -> Daemon {
        self.ready = Ready::Exists(path.into());
        self
    }

    /// How long a start may take (default [`START_TIMEOUT`]).
    pub fn timeout(mut self, t: Duration) -> Daemon {
        self.timeout = t;
        self
    }

    /// The child's stderr goes to `path`, appended to at each start.
    pub fn log(mut self, path: impl Into<PathBuf>) -> Daemon {
        self.log = Some(Log {
            path: path.into(),
            append: true,
            stdout: false,
        });
        self
    }

    /// The log (see [`Daemon::log`]) is truncated at each start instead.
    pub fn fresh_log(mut self) -> Daemon {
        self.log.as_mut().expect("fresh_log after log").append = false;
        self
    }

    /// The child's stdout goes to the log too (see [`Daemon::log`]).
    pub fn log_stdout(mut self) -> Daemon {
        self.log.as_mut().expect("log_stdout after log").stdout = true;
        self
    }

    /// The child's stdout goes to `/dev/null`.
    pub fn null_stdout(mut self) -> Daemon {
        self.null_stdout = true;
        self
    }

    /// Starts the child and waits until it is ready; returns the running daemon.
    pub fn start(mut self) -> Daemon {
        self.spawn();
        self
    }

    /// Starts the child (again, after [`Daemon::term`] or [`Daemon::kill`]) and waits until it
    /// is ready: panics, with the end of its log, if it exits first or is not ready in time.
    pub fn spawn(&mut self) {
        assert!(self.child.is_none(), "{} is already running", self.name());
        let mut c = Command::new(&self.program);
        c.args(&self.args).stdin(Stdio::null());
        for (k, v) in &self.envs {
            c.env(k, v);
        }
        if self.null_stdout {
            c.stdout(Stdio::null());
        }
        if let Some(log) = &self.log {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(log.append)
                .truncate(!log.append)
                .open(&log.path)
                .unwrap_or_else(|e| panic!("open {}: {e}", log.path.display()));
            if log.stdout {
                c.stdout(f.try_clone().expect("duplicate the log descriptor"));
            }
            c.stderr(f);
        }
        let child = c
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.program.display()));
        self.child = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let t0 = Instant::now();
        loop {
            let ready = match &self.ready {
                Ready::Spawned => return,
                Ready::Connect(p) => std::os::unix::net::UnixStream::connect(p).is_ok(),
                Ready::Exists(p) => p.exists(),
            };
            if ready {
                return;
            }
            if let Some(st) = self.try_wait() {
                panic!(
                    "{} exited early: {st}; its log ends:\n{}",
                    self.name(),
                    self.log_tail()
                );
            }
            if t0.elapsed() > self.timeout {
                panic!(
                    "{}: {:?} not ready after {:?}; its log ends:\n{}",
                    self.name(),
                    self.ready,
                    self.timeout,
                    self.log_tail()
                );
            }
            std::thread::sleep(POLL);
        }
    }

    /// The program's file name, for messages.
    pub fn name(&self) -> String {
        self.program
            .file_name()
            .unwrap_or(self.program.as_os_str())
            .to_string_lossy()
            .into_owned()
    }

    /// The program run.
    pub fn program(&self) -> &Path {
        &self.program
    }

    fn running(&mut self) -> &mut Child {
        let name = self.name();
        self.child
            .as_mut()
            .unwrap_or_else(|| panic!("{name} is not running"))
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child
            .as_ref()
            .unwrap_or_else(|| panic!("{} is not running", self.name()))
            .id()
    }

    /// The child's exit status if it has exited (`None` while it runs).
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.running().try_wait().expect("waitpid")
    }

    /// The whole log (empty without one, or before anything was written).
    pub fn log_text(&self) -> String {
        self.log
            .as_ref()
            .and_then(|l| std::fs::read_to_string(&l.path).ok())
            .unwrap_or_default()
    }

    /// The log's path, if it has one.
    pub fn log_path(&self) -> Option<&Path> {
        self.log.as_ref().map(|l| l.path.as_path())
    }

    fn log_tail(&self) -> String {
        let log = self.log_text();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
    }

    fn sigterm(&mut self) {
        let pid = libc::pid_t::try_from(self.pid()).expect("pid fits pid_t");
        // SAFETY: kill(2) of our own child, which has not been waited for, so its pid is ours.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }

    /// SIGTERM, then waits for the child to exit; returns its status.
    pub fn term(&mut self) -> ExitStatus {
        self.sigterm();
        let mut c = self.child.take().expect("running child");
        c.wait().expect("waitpid")
    }

    /// SIGTERM, then waits up to `timeout` for the child to exit: its status, or `None` when it
    /// did not exit in time (it is then killed).
    pub fn term_within(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.sigterm();
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.try_wait() {
                self.child = None;
                return Some(st);
            }
            if t0.elapsed() > timeout {
                self.kill();
                return None;
            }
            std::thread::sleep(POLL);
        }
    }

    /// SIGKILL (`kill -9`), then waits for the child.
    pub fn kill(&mut self) {
        let mut c = self.child.take().expect("running child");
        c.kill().expect("kill the child");
        c.wait().expect("waitpid");
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
