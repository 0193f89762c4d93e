//! `katablk-spdk`: SPDK's bdev layer with katablk's vhost-user-blk data plane, in one process.
//!
//! It starts the SPDK application framework (reactors, bdev subsystem with every SPDK bdev
//! module: NVMe, AIO, malloc, null, lvol, ...; SPDK's JSON-RPC server and JSON config), and
//! registers `vhost_create_blk_controller`, `vhost_delete_controller` and
//! `vhost_get_controllers` (SPDK's names, parameters and reply shapes) implemented by katablk:
//! each controller serves an SPDK bdev over vhost-user-blk with katablk's backend, guest buffers
//! passed to the bdev with no copy. Flags follow SPDK's `vhost` app (`-S`, `-r`, `-m`, `-s`,
//! `--json`), so katablk-csi and scripts drive it like SPDK's vhost.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use clap::Parser;
use katablk_bdev::BlockDevice;
use katablk_spdk::app::SpdkApp;
use katablk_spdk::bdev::SpdkBdev;
use katablk_spdk::env::EnvOptions;
use katablk_spdk::rpc::{register_method, MethodError};
use katablk_spdk::thread::Thread;
use katablk_vhost::{BlkOptions, ServerHandle, VhostBlkServer};
use serde_json::{json, Value};
use tracing::{info, warn};

#[derive(Parser, Debug)]
#[command(name = "katablk-spdk", version, about)]
struct Args {
    /// Directory of the controller sockets (`<dir>/<ctrlr>`), as SPDK vhost's -S.
    #[arg(short = 'S', long = "socket-dir", default_value = ".")]
    socket_dir: PathBuf,
    /// JSON-RPC socket (SPDK's).
    #[arg(short = 'r', long = "rpc-socket", default_value = "/var/tmp/spdk.sock")]
    rpc_socket: String,
    /// Reactor core mask.
    #[arg(short = 'm', long = "cpumask", default_value = "0x1")]
    cpumask: String,
    /// Memory for SPDK in MiB (hugepages, or anonymous memory with --no-huge).
    #[arg(short = 's', long = "mem-size")]
    mem_size: Option<u32>,
    /// Run without hugepages (AIO, malloc, null, lvol bdevs only; not NVMe).
    #[arg(long)]
    no_huge: bool,
    /// Probe PCI devices (needed for local NVMe through SPDK's userspace driver).
    #[arg(long)]
    pci: bool,
    /// SPDK JSON config to load at start (save_config format).
    #[arg(short = 'c', long = "json")]
    json: Option<String>,
    /// Do not lock the reactor cores (to share them with another SPDK process).
    #[arg(long)]
    disable_cpumask_locks: bool,
    /// Shared memory id (to run next to another SPDK process).
    #[arg(short = 'i', long = "shm-id")]
    shm_id: Option<i32>,
    /// Busy-poll window of katablk's queue workers, in microseconds.
    #[arg(long, default_value_t = 50)]
    poll_us: u32,
    /// Queues offered per controller.
    #[arg(long, default_value_t = 4)]
    max_queues: u16,
    /// Run each controller's queue workers on their own OS threads (adaptive polling, epoll
    /// when idle) instead of as SPDK threads polled by the reactors (the default: requests go
    /// from the virtqueue to the bdev and back on one core, as in SPDK's vhost).
    #[arg(long)]
    worker_threads: bool,
    /// Permission bits of controller sockets.
    #[arg(long, default_value = "660", value_parser = parse_octal)]
    socket_mode: u32,
}

/// The queue-to-worker mapping of a controller on the reactors: one worker (SPDK thread) per
/// core it may run on, its queues dealt round-robin. SPDK's vhost polls all of a controller's
/// queues from one thread; a thread per queue would cost every reactor iteration a thread
/// poll for each queue the driver leaves unused (measured with one core and two queues, one
/// in use: 3.1M reactor iterations/s against 3.6-4.0M with one thread, 4k reads QD1).
fn deal_queues(num_queues: u16, cores: usize) -> Vec<u64> {
    if num_queues == 0 || num_queues > 64 {
        // Out of range: the backend's own check of num_queues reports it.
        return Vec::new();
    }
    let n = cores.clamp(1, usize::from(num_queues));
    let mut masks = vec![0u64; n];
    for q in 0..usize::from(num_queues) {
        masks[q % n] |= 1 << q;
    }
    masks
}

fn parse_octal(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8).map_err(|e| format!("{s}: {e}"))
}

struct Controller {
    bdev: SpdkBdev,
    /// Capacity last announced to the frontend, in blocks.
    announced: u64,
    cpumask: String,
    readonly: bool,
    socket: PathBuf,
    handle: ServerHandle,
}

struct State {
    app: Thread,
    runtime: Option<katablk_vhost::RuntimeHandle>,
    socket_dir: PathBuf,
    poll_us: u32,
    max_queues: u16,
    /// Reactor cores of the application.
    cores: usize,
    socket_mode: u32,
    ctrlrs: Mutex<BTreeMap<String, Controller>>,
}

fn no_such_device() -> MethodError {
    MethodError::new(-32602, "No such device")
}

fn invalid(msg: impl Into<String>) -> MethodError {
    MethodError::new(-32602, msg)
}

fn params_object(p: &Value) -> Result<&serde_json::Map<String, Value>, MethodError> {
    p.as_object()
        .ok_or_else(|| invalid("Invalid parameters: an object is expected"))
}

fn check_keys(o: &serde_json::Map<String, Value>, allowed: &[&str]) -> Result<(), MethodError> {
    for k in o.keys() {
        if !allowed.contains(&k.as_str()) {
            return Err(invalid(format!(
                "Invalid parameters: unknown parameter {k}"
            )));
        }
    }
    Ok(())
}

fn str_param<'a>(
    o: &'a serde_json::Map<String, Value>,
    k: &str,
) -> Result<Option<&'a str>, MethodError> {
    match o.get(k) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(format!("Invalid parameters: {k} must be a string"))),
    }
}

fn bool_param(o: &serde_json::Map<String, Value>, k: &str) -> Result<bool, MethodError> {
    match o.get(k) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(invalid(format!(
            "Invalid parameters: {k} must be a boolean"
        ))),
    }
}

/// CPUs of a hex mask such as 0x3.
fn mask_cpus(mask: &str) -> Result<Vec<usize>, MethodError> {
    let hex = mask.trim_start_matches("0x").trim_start_matches("0X");
    let v = u128::from_str_radix(hex, 16)
        .map_err(|_| invalid(format!("Invalid parameters: cpumask {mask}")))?;
    let cpus: Vec<usize> = (0..128).filter(|b| v & (1u128 << b) != 0).collect();
    if cpus.is_empty() {
        return Err(invalid("Invalid parameters: empty cpumask"));
    }
    Ok(cpus)
}

impl State {
    /// Tells connected frontends about capacity changes (SPDK resize events: an lvol resized,
    /// an AIO file grown and rescanned) with CONFIG_CHANGE_MSG, as SPDK's vhost-blk does.
    fn announce_resizes(&self) {
        let Ok(mut c) = self.ctrlrs.lock() else {
            return;
        };
        for (n, c) in c.iter_mut() {
            let now = c.bdev.info().num_blocks;
            if now != c.announced {
                let sent = c.handle.notify_config_change();
                info!(ctrlr = %n, blocks = now, sent, "capacity changed");
                c.announced = now;
            }
        }
    }

    fn reap_removed(&self) {
        let gone: Vec<(String, Controller)> = match self.ctrlrs.lock() {
            Ok(mut c) => {
                let names: Vec<String> = c
                    .iter()
                    .filter(|(_, c)| c.bdev.is_removed())
                    .map(|(n, _)| n.clone())
                    .collect();
                names
                    .into_iter()
                    .filter_map(|n| c.remove(&n).map(|c| (n, c)))
                    .collect()
            }
            Err(_) => return,
        };
        for (n, c) in gone {
            warn!(ctrlr = %n, bdev = c.bdev.name(), "bdev removed: deleting its controller");
            if let Err(e) = c.handle.stop() {
                warn!(ctrlr = %n, "stopping: {e}");
            }
            remove_socket(&c.socket);
        }
    }

    fn create(&self, p: Value) -> Result<Value, MethodError> {
        let o = params_object(&p)?;
        check_keys(
            o,
            &[
                "ctrlr",
                "dev_name",
                "cpumask",
                "readonly",
                "packed_ring",
                "transport",
            ],
        )?;
        let ctrlr = str_param(o, "ctrlr")?
            .ok_or_else(|| invalid("Invalid parameters: ctrlr is required"))?
            .to_string();
        let dev = str_param(o, "dev_name")?
            .ok_or_else(|| invalid("Invalid parameters: dev_name is required"))?;
        let readonly = bool_param(o, "readonly")?;
        if bool_param(o, "packed_ring")? {
            return Err(invalid("packed ring is not supported"));
        }
        if let Some(t) = str_param(o, "transport")? {
            if t != "vhost_user_blk" {
                return Err(invalid(format!("Invalid parameters: transport {t}")));
            }
        }
        if ctrlr.is_empty() || ctrlr.contains('/') || ctrlr == "." || ctrlr == ".." {
            return Err(invalid(format!(
                "Invalid parameters: controller name {ctrlr:?}"
            )));
        }
        let cpumask = str_param(o, "cpumask")?.unwrap_or("").to_string();
        let cpus = if cpumask.is_empty() {
            Vec::new()
        } else {
            mask_cpus(&cpumask)?
        };
        let mut ctrlrs = self.ctrlrs.lock().map_err(|_| no_such_device())?;
        if ctrlrs.contains_key(&ctrlr) {
            return Err(MethodError::new(-17, "File exists"));
        }
        let socket = self.socket_dir.join(&ctrlr);
        if socket.as_os_str().len() > 107 {
            return Err(invalid(format!(
                "socket path {} is longer than 107 bytes",
                socket.display()
            )));
        }
        let bdev = SpdkBdev::open(self.app, dev, readonly).map_err(|e| {
            warn!(dev, "{e}");
            no_such_device()
        })?;
        let opts = BlkOptions {
            num_queues: self.max_queues,
            read_only: readonly,
            serial: ctrlr.chars().take(20).collect(),
            poll_us: self.poll_us,
            queue_threads: if self.runtime.is_some() {
                let cores = if cpus.is_empty() {
                    self.cores
                } else {
                    cpus.len()
                };
                deal_queues(self.max_queues, cores)
            } else {
                Vec::new()
            },
            cpus,
            runtime: self.runtime.clone(),
            ..Default::default()
        };
        let server = VhostBlkServer::bind(
            &socket,
            Arc::new(bdev.clone()),
            opts,
            Some(self.socket_mode),
        )
        .map_err(|e| MethodError::new(-32603, e.to_string()))?;
        let handle = server
            .spawn()
            .map_err(|e| MethodError::new(-32603, e.to_string()))?;
        info!(%ctrlr, bdev = bdev.name(), socket = %socket.display(), "controller created");
        let announced = bdev.info().num_blocks;
        ctrlrs.insert(
            ctrlr,
            Controller {
                announced,
                bdev,
                cpumask,
                readonly,
                socket,
                handle,
            },
        );
        Ok(Value::Bool(true))
    }

    fn delete(&self, p: Value) -> Result<Value, MethodError> {
        let o = params_object(&p)?;
        check_keys(o, &["ctrlr"])?;
        let ctrlr = str_param(o, "ctrlr")?
            .ok_or_else(|| invalid("Invalid parameters: ctrlr is required"))?;
        let mut ctrlrs = self.ctrlrs.lock().map_err(|_| no_such_device())?;
        let c = ctrlrs.get(ctrlr).ok_or_else(no_such_device)?;
        if c.handle.is_connected() {
            return Err(MethodError::new(-16, "Device or resource busy"));
        }
        let c = ctrlrs.remove(ctrlr).ok_or_else(no_such_device)?;
        c.handle
            .stop()
            .map_err(|e| MethodError::new(-32603, e.to_string()))?;
        info!(ctrlr, "controller deleted");
        Ok(Value::Bool(true))
    }

    fn get(&self, p: Value) -> Result<Value, MethodError> {
        let name = match &p {
            Value::Null => None,
            _ => {
                let o = params_object(&p)?;
                check_keys(o, &["name"])?;
                str_param(o, "name")?.map(str::to_string)
            }
        };
        let ctrlrs = self.ctrlrs.lock().map_err(|_| no_such_device())?;
        if let Some(n) = &name {
            if !ctrlrs.contains_key(n) {
                return Err(no_such_device());
            }
        }
        let v: Vec<Value> = ctrlrs
            .iter()
            .filter(|(n, _)| name.as_ref().is_none_or(|x| x == *n))
            .map(|(n, c)| {
                let sessions: Vec<Value> = if c.handle.is_connected() {
                    vec![json!({"vid": 0, "id": 0, "name": format!("{n}s0"), "started": true,
                                "max_queues": self.max_queues, "inflight_task_cnt": 0})]
                } else {
                    vec![]
                };
                json!({
                    "ctrlr": n,
                    "cpumask": if c.cpumask.is_empty() { "0x1".to_string() } else { c.cpumask.clone() },
                    "delay_base_us": 0,
                    "iops_threshold": 60000,
                    "socket": c.socket.display().to_string(),
                    "sessions": sessions,
                    "backend_specific": {"block": {
                        "readonly": c.readonly,
                        "bdev": c.bdev.name(),
                        "transport": "vhost_user_blk"
                    }}
                })
            })
            .collect();
        Ok(Value::Array(v))
    }
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    if !args.socket_dir.is_dir() {
        anyhow::bail!(
            "socket directory {} does not exist",
            args.socket_dir.display()
        );
    }
    let socket_dir = std::fs::canonicalize(&args.socket_dir)
        .with_context(|| format!("socket directory {}", args.socket_dir.display()))?;
    let env = EnvOptions {
        name: "katablk_spdk".into(),
        core_mask: args.cpumask.clone(),
        mem_size_mib: args.mem_size,
        shm_id: args.shm_id,
        no_pci: !args.pci,
        hugedir: None,
        no_huge: args.no_huge,
        rpc_addr: Some(args.rpc_socket.clone()),
        json_config: args.json.clone(),
        disable_cpumask_locks: args.disable_cpumask_locks,
    };
    env.validate().context("options")?;
    let state: Arc<Mutex<Option<Arc<State>>>> = Arc::new(Mutex::new(None));
    type Method = fn(&State, Value) -> Result<Value, MethodError>;
    let methods: [(&str, Method); 3] = [
        ("vhost_create_blk_controller", State::create),
        ("vhost_delete_controller", State::delete),
        ("vhost_get_controllers", State::get),
    ];
    for (name, f) in methods {
        let st = state.clone();
        register_method(name, move |p| {
            let s = st
                .lock()
                .ok()
                .and_then(|g| g.clone())
                .ok_or_else(|| MethodError::new(-1, "not initialized"))?;
            f(&s, p)
        })?;
    }
    let app = SpdkApp::start(&env).context("starting SPDK")?;
    let runtime = (!args.worker_threads).then(|| {
        katablk_vhost::RuntimeHandle(Arc::new(katablk_spdk::runtime::SpdkRuntime::new(
            app.thread(),
            app.cores().to_vec(),
        )))
    });
    let st = Arc::new(State {
        app: app.thread(),
        runtime,
        socket_dir,
        poll_us: args.poll_us,
        max_queues: args.max_queues,
        cores: app.cores().len(),
        socket_mode: args.socket_mode,
        ctrlrs: Mutex::new(BTreeMap::new()),
    });
    if let Ok(mut g) = state.lock() {
        *g = Some(st.clone());
    }
    info!(rpc = %args.rpc_socket, sockets = %st.socket_dir.display(), "katablk-spdk ready");
    wait_for_signal(&st)?;
    info!("shutting down");
    let ctrlrs = std::mem::take(&mut *st.ctrlrs.lock().map_err(|_| anyhow::anyhow!("poisoned"))?);
    for (n, c) in ctrlrs {
        if let Err(e) = c.handle.stop() {
            warn!(ctrlr = %n, "stopping: {e}");
        }
        drop(c.bdev);
        remove_socket(&c.socket);
    }
    if let Ok(mut g) = state.lock() {
        *g = None;
    }
    drop(st);
    app.stop().context("stopping SPDK")?;
    Ok(())
}

fn remove_socket(p: &Path) {
    if std::fs::symlink_metadata(p).is_ok() {
        let _ = std::fs::remove_file(p);
    }
}

/// Waits for SIGTERM/SIGINT; meanwhile removes controllers whose bdev SPDK hot-removed (a
/// `bdev_*_delete` RPC, an NVMe controller gone): SPDK finishes removing the bdev only once
/// every descriptor is closed, so the controller's server is stopped (the frontend sees the
/// device go away, requests in flight fail) and its descriptor closed.
fn wait_for_signal(st: &State) -> Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])?;
    loop {
        if let Some(sig) = signals.pending().next() {
            info!(sig, "signal");
            return Ok(());
        }
        st.reap_removed();
        st.announce_resizes();
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::deal_queues;

    #[test]
    fn queues_are_dealt_to_one_worker_per_core() {
        assert_eq!(deal_queues(2, 1), vec![0b11]);
        assert_eq!(deal_queues(4, 2), vec![0b0101, 0b1010]);
        assert_eq!(deal_queues(2, 8), vec![0b01, 0b10]);
        assert_eq!(deal_queues(64, 1), vec![u64::MAX]);
        assert!(deal_queues(0, 1).is_empty());
        assert!(deal_queues(65, 1).is_empty());
    }
}
