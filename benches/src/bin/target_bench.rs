//! `katablk-target-bench`: control-plane and idle-cost measurements of `katablk-target`, and
//! a small JSON-RPC helper for the benchmark scripts.
//!
//! - `katablk-target-bench rpc METHOD [PARAMS_JSON]`: one SPDK JSON-RPC call, result on stdout.
//! - `katablk-target-bench run`: starts (or attaches to) a target and measures
//!   (a) RPC latency: create a thin lvol and a vhost-user-blk controller, time until the
//!   controller socket accepts a connection, delete both; N times, p50/p99/max;
//!   (b) idle cost: RSS and CPU of the daemon with M idle controllers, then with one idle
//!   libblkio client connected per controller.

use anyhow::{bail, Context, Result};
use clap::{Args as ClapArgs, Parser, Subcommand};
use katablk_bench::cpu::CpuSampler;
use katablk_bench::engine::Device;
use katablk_bench::stats::median;
use katablk_rpc::RpcClient;
use serde::Serialize;
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, Parser)]
#[command(name = "katablk-target-bench", version)]
/// katablk-target control-plane and idle-cost benchmark, and a JSON-RPC helper.
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// One JSON-RPC call; prints the result as JSON (exit 1 with the error on failure).
    Rpc(RpcArgs),
    /// RPC latency and idle cost measurements.
    Run(RunArgs),
}

#[derive(Debug, ClapArgs)]
struct RpcArgs {
    /// The target's JSON-RPC socket.
    #[arg(short = 's', long = "socket", default_value = katablk_rpc::DEFAULT_SOCKET_PATH)]
    socket: PathBuf,
    /// Per-call timeout, seconds.
    #[arg(short = 't', long, default_value_t = 60)]
    timeout: u64,
    /// Method name, e.g. bdev_get_bdevs.
    method: String,
    /// Params as a JSON object (omitted: no params).
    params: Option<String>,
}

#[derive(Debug, ClapArgs)]
struct RunArgs {
    /// Start this katablk-target binary (with a private socket directory); default when
    /// --rpc is not given: target/release/katablk-target next to this binary.
    #[arg(long)]
    target: Option<PathBuf>,
    /// Attach to a running target's RPC socket instead of starting one (needs --pid and
    /// --socket-dir).
    #[arg(long)]
    rpc: Option<PathBuf>,
    /// PID of the attached target (for RSS and CPU).
    #[arg(long)]
    pid: Option<u32>,
    /// Controller socket directory of the attached target (its -S).
    #[arg(long)]
    socket_dir: Option<PathBuf>,
    /// Extra arguments for a started target (e.g. "--poll-us 0"), split on spaces.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    target_args: String,
    /// Create/delete iterations of the RPC latency test (0: skip).
    #[arg(long, default_value_t = 50)]
    iterations: usize,
    /// Controllers for the idle-cost test (0: skip).
    #[arg(long, default_value_t = 100)]
    controllers: usize,
    /// Backing of the idle controllers: thin lvols or null bdevs.
    #[arg(long, default_value = "lvol", value_parser = ["lvol", "null"])]
    backing: String,
    /// Seconds of each idle CPU measurement.
    #[arg(long, default_value_t = 10.0)]
    idle_secs: f64,
    /// Idle clients to connect (one per controller; 0: skip the connected measurement).
    #[arg(long, default_value_t = 100)]
    clients: usize,
    /// Clients to try if connecting --clients fails.
    #[arg(long, default_value_t = 20)]
    clients_fallback: usize,
    /// Queues per controller (the target's --max-queues) and per client.
    #[arg(long, default_value_t = 1)]
    queues: u16,
    /// Size of each thin lvol / null bdev, MiB.
    #[arg(long, default_value_t = 64)]
    vol_mib: u64,
    /// Size of the malloc bdev holding the lvstore, MiB.
    #[arg(long, default_value_t = 1024)]
    store_mib: u64,
    /// Controller cpumask (default: the target's default).
    #[arg(long)]
    cpumask: Option<String>,
    /// Write the JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write a Markdown section here.
    #[arg(long)]
    md: Option<PathBuf>,
}

/// Latency distribution of one step, µs.
#[derive(Debug, Serialize)]
struct Dist {
    n: usize,
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
    mean_us: f64,
}

fn dist(v: &[f64]) -> Dist {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let pct = |p: f64| -> f64 {
        if s.is_empty() {
            return f64::NAN;
        }
        // Nearest rank.
        let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
        s[rank.clamp(1, s.len()) - 1]
    };
    Dist {
        n: s.len(),
        p50_us: median(&s).unwrap_or(f64::NAN),
        p99_us: pct(99.0),
        max_us: s.last().copied().unwrap_or(f64::NAN),
        mean_us: if s.is_empty() {
            f64::NAN
        } else {
            s.iter().sum::<f64>() / s.len() as f64
        },
    }
}

#[derive(Debug, Serialize)]
struct RpcLatency {
    iterations: usize,
    /// bdev_lvol_create (thin).
    create_lvol: Dist,
    /// vhost_create_blk_controller.
    create_controller: Dist,
    /// From the controller RPC's reply until connect() on its socket succeeds.
    socket_ready_after_reply: Dist,
    /// From the first RPC until the socket accepts a connection.
    create_total: Dist,
    /// vhost_delete_controller.
    delete_controller: Dist,
    /// bdev_lvol_delete.
    delete_lvol: Dist,
}

/// /proc/PID/status memory fields, KiB.
#[derive(Debug, Clone, Copy, Default, Serialize)]
struct Mem {
    vm_rss_kib: u64,
    rss_anon_kib: u64,
    rss_file_kib: u64,
    rss_shmem_kib: u64,
    threads: u64,
}

fn read_mem(pid: u32) -> Result<Mem> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let mut m = Mem::default();
    for line in text.lines() {
        let mut it = line.split_whitespace();
        let (Some(k), Some(v)) = (it.next(), it.next()) else {
            continue;
        };
        let v: u64 = v.parse().unwrap_or(0);
        match k {
            "VmRSS:" => m.vm_rss_kib = v,
            "RssAnon:" => m.rss_anon_kib = v,
            "RssFile:" => m.rss_file_kib = v,
            "RssShmem:" => m.rss_shmem_kib = v,
            "Threads:" => m.threads = v,
            _ => {}
        }
    }
    Ok(m)
}

#[derive(Debug, Serialize)]
struct IdlePoint {
    mem: Mem,
    /// Daemon CPU over the idle window, % of one core.
    cpu_pct: f64,
    idle_secs: f64,
}

#[derive(Debug, Serialize)]
struct ClientsResult {
    requested: usize,
    connected: usize,
    /// Why the requested number could not be connected (then `connected` is the fallback).
    fallback_reason: Option<String>,
    idle: IdlePoint,
    /// Daemon RSS growth per connected client, KiB (over the idle controllers).
    daemon_rss_per_client_kib: f64,
    /// This process's RSS growth per client (libblkio client side), KiB.
    client_rss_per_client_kib: f64,
}

#[derive(Debug, Serialize)]
struct IdleCost {
    controllers: usize,
    backing: String,
    /// Target with its lvstore (or nothing) but no controllers.
    before: IdlePoint,
    /// With the idle controllers, no client.
    after: IdlePoint,
    /// (after − before) VmRSS / controllers, KiB.
    rss_per_controller_kib: f64,
    /// (after − before) threads / controllers.
    threads_per_controller: f64,
    clients: Option<ClientsResult>,
}

#[derive(Debug, Serialize)]
struct Report {
    version: u32,
    tool: String,
    timestamp_unix: u64,
    target_pid: u32,
    target_started: bool,
    queues: u16,
    cpumask: Option<String>,
    rpc_latency: Option<RpcLatency>,
    idle: Option<IdleCost>,
    notes: Vec<String>,
}

struct Target {
    child: Option<Child>,
    pid: u32,
    rpc_sock: PathBuf,
    socket_dir: PathBuf,
    tmp: Option<PathBuf>,
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(t) = &self.tmp {
            let _ = std::fs::remove_dir_all(t);
        }
    }
}

fn wait_socket(path: &Path, timeout: Duration) -> Result<Duration> {
    let t0 = Instant::now();
    loop {
        if UnixStream::connect(path).is_ok() {
            return Ok(t0.elapsed());
        }
        if t0.elapsed() > timeout {
            bail!(
                "{} does not accept connections after {timeout:?}",
                path.display()
            );
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

fn start_target(a: &RunArgs) -> Result<Target> {
    if let Some(rpc) = &a.rpc {
        let pid = a.pid.context("--rpc needs --pid (for RSS and CPU)")?;
        let socket_dir = a
            .socket_dir
            .clone()
            .context("--rpc needs --socket-dir (the target's -S)")?;
        return Ok(Target {
            child: None,
            pid,
            rpc_sock: rpc.clone(),
            socket_dir,
            tmp: None,
        });
    }
    let bin = match &a.target {
        Some(b) => b.clone(),
        None => std::env::current_exe()
            .context("locating this binary")?
            .with_file_name("katablk-target"),
    };
    let tmp = std::env::temp_dir().join(format!("katablk-target-bench.{}", std::process::id()));
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let rpc_sock = tmp.join("rpc.sock");
    let log = std::fs::File::create(tmp.join("target.log")).context("creating target.log")?;
    let mut cmd = Command::new(&bin);
    cmd.arg("-S")
        .arg(&tmp)
        .arg("-r")
        .arg(&rpc_sock)
        .arg("--max-queues")
        .arg(a.queues.to_string())
        .args(a.target_args.split_whitespace())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    let child = cmd
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut t = Target {
        pid: child.id(),
        child: Some(child),
        rpc_sock,
        socket_dir: tmp.clone(),
        tmp: Some(tmp),
    };
    if let Err(e) = wait_socket(&t.rpc_sock, Duration::from_secs(10)) {
        if let Some(c) = &mut t.child {
            if let Ok(Some(st)) = c.try_wait() {
                bail!("{} exited ({st}) before serving RPC", bin.display());
            }
        }
        return Err(e);
    }
    Ok(t)
}

/// Blocking JSON-RPC calls on a private runtime.
struct Rpc {
    rt: tokio::runtime::Runtime,
    client: RpcClient,
}

impl Rpc {
    fn new(sock: &Path) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("tokio runtime")?;
        Ok(Self {
            rt,
            client: RpcClient::new(sock),
        })
    }

    fn call(&self, method: &str, params: Value) -> Result<Value> {
        let p = if params.is_null() { None } else { Some(params) };
        self.rt
            .block_on(
                self.client
                    .call_value(method, p, false, Duration::from_secs(60)),
            )
            .with_context(|| method.to_string())
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

const LVS: &str = "tbench_lvs";
const STORE_BDEV: &str = "tbench_mal0";

fn rpc_latency(a: &RunArgs, t: &Target, rpc: &Rpc) -> Result<RpcLatency> {
    let (mut cl, mut cc, mut ready, mut total, mut dc, mut dl) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for i in 0..a.iterations {
        let lvol = format!("lat{i}");
        let ctrlr = format!("tbench_lat{i}");
        let t0 = Instant::now();
        rpc.call(
            "bdev_lvol_create",
            json!({"lvol_name": lvol, "size_in_mib": a.vol_mib, "thin_provision": true, "lvs_name": LVS}),
        )?;
        let t1 = Instant::now();
        let mut p = json!({"ctrlr": ctrlr, "dev_name": format!("{LVS}/{lvol}")});
        if let Some(m) = &a.cpumask {
            p["cpumask"] = json!(m);
        }
        rpc.call("vhost_create_blk_controller", p)?;
        let t2 = Instant::now();
        let sock = t.socket_dir.join(&ctrlr);
        wait_socket(&sock, Duration::from_secs(10))?;
        let t3 = Instant::now();
        rpc.call("vhost_delete_controller", json!({"ctrlr": ctrlr}))?;
        let t4 = Instant::now();
        rpc.call("bdev_lvol_delete", json!({"name": format!("{LVS}/{lvol}")}))?;
        let t5 = Instant::now();
        cl.push(us(t1 - t0));
        cc.push(us(t2 - t1));
        ready.push(us(t3 - t2));
        total.push(us(t3 - t0));
        dc.push(us(t4 - t3));
        dl.push(us(t5 - t4));
    }
    Ok(RpcLatency {
        iterations: a.iterations,
        create_lvol: dist(&cl),
        create_controller: dist(&cc),
        socket_ready_after_reply: dist(&ready),
        create_total: dist(&total),
        delete_controller: dist(&dc),
        delete_lvol: dist(&dl),
    })
}

fn idle_point(pid: u32, secs: f64) -> Result<IdlePoint> {
    let s = CpuSampler::start(Some(pid))?;
    std::thread::sleep(Duration::from_secs_f64(secs));
    let cpu = s.finish()?;
    Ok(IdlePoint {
        mem: read_mem(pid)?,
        cpu_pct: cpu.percent,
        idle_secs: secs,
    })
}

/// Connects one idle client (`queues` queues, one mapped 4 KiB buffer) per socket.
fn connect_clients(socks: &[PathBuf], queues: u16) -> Result<Vec<(Device, blkio::MemoryRegion)>> {
    let mut out = Vec::with_capacity(socks.len());
    for s in socks {
        let mut d = Device::connect(s, u32::from(queues), 256)
            .with_context(|| format!("client {} of {}", out.len() + 1, socks.len()))?;
        let r = d.alloc_buffer(4096)?;
        out.push((d, r));
    }
    Ok(out)
}

fn idle_cost(a: &RunArgs, t: &Target, rpc: &Rpc, notes: &mut Vec<String>) -> Result<IdleCost> {
    // Let the daemon settle after the latency test.
    std::thread::sleep(Duration::from_millis(500));
    let before = idle_point(t.pid, a.idle_secs)?;
    let mut socks = Vec::new();
    for i in 0..a.controllers {
        let ctrlr = format!("tbench_idle{i}");
        let dev = if a.backing == "lvol" {
            let lvol = format!("idle{i}");
            rpc.call(
                "bdev_lvol_create",
                json!({"lvol_name": lvol, "size_in_mib": a.vol_mib, "thin_provision": true, "lvs_name": LVS}),
            )?;
            format!("{LVS}/{lvol}")
        } else {
            let name = format!("tbench_null{i}");
            rpc.call(
                "bdev_null_create",
                json!({"name": name, "num_blocks": a.vol_mib * 2048, "block_size": 512}),
            )?;
            name
        };
        let mut p = json!({"ctrlr": ctrlr, "dev_name": dev});
        if let Some(m) = &a.cpumask {
            p["cpumask"] = json!(m);
        }
        rpc.call("vhost_create_blk_controller", p)?;
        socks.push(t.socket_dir.join(&ctrlr));
    }
    for s in &socks {
        wait_socket(s, Duration::from_secs(10))?;
    }
    std::thread::sleep(Duration::from_millis(500));
    let after = idle_point(t.pid, a.idle_secs)?;
    let n = a.controllers.max(1) as f64;
    let rss_per_controller_kib = (after.mem.vm_rss_kib as f64 - before.mem.vm_rss_kib as f64) / n;
    let threads_per_controller = (after.mem.threads as f64 - before.mem.threads as f64) / n;

    let clients = if a.clients == 0 {
        None
    } else {
        let self_pid = std::process::id();
        let own_before = read_mem(self_pid)?;
        let want = a.clients.min(socks.len());
        let (conns, reason) = match connect_clients(&socks[..want], a.queues) {
            Ok(c) => (c, None),
            Err(e) => {
                let reason = format!("{want} clients failed: {e:#}");
                eprintln!(
                    "katablk-target-bench: {reason}; trying {}",
                    a.clients_fallback
                );
                notes.push(format!(
                    "{reason}; measured with {} clients instead",
                    a.clients_fallback
                ));
                let n = a.clients_fallback.min(socks.len());
                // Let the target notice the dropped connections first.
                std::thread::sleep(Duration::from_secs(1));
                (connect_clients(&socks[..n], a.queues)?, Some(reason))
            }
        };
        std::thread::sleep(Duration::from_millis(500));
        let own_after = read_mem(self_pid)?;
        let idle = idle_point(t.pid, a.idle_secs)?;
        let k = conns.len().max(1) as f64;
        let r = ClientsResult {
            requested: a.clients,
            connected: conns.len(),
            fallback_reason: reason,
            daemon_rss_per_client_kib: (idle.mem.vm_rss_kib as f64 - after.mem.vm_rss_kib as f64)
                / k,
            client_rss_per_client_kib: (own_after.vm_rss_kib as f64 - own_before.vm_rss_kib as f64)
                / k,
            idle,
        };
        drop(conns);
        Some(r)
    };

    // Clean up (matters when attached to a long-lived target).
    std::thread::sleep(Duration::from_millis(200));
    for i in 0..a.controllers {
        rpc.call(
            "vhost_delete_controller",
            json!({"ctrlr": format!("tbench_idle{i}")}),
        )?;
        if a.backing == "lvol" {
            rpc.call(
                "bdev_lvol_delete",
                json!({"name": format!("{LVS}/idle{i}")}),
            )?;
        } else {
            rpc.call(
                "bdev_null_delete",
                json!({"name": format!("tbench_null{i}")}),
            )?;
        }
    }
    Ok(IdleCost {
        controllers: a.controllers,
        backing: a.backing.clone(),
        before,
        after,
        rss_per_controller_kib,
        threads_per_controller,
        clients,
    })
}

fn markdown(r: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "## katablk-target control plane and idle cost\n");
    let _ = writeln!(
        o,
        "Target pid {} ({}), {} queue(s) per controller, controller cpumask {}.\n",
        r.target_pid,
        if r.target_started {
            "started by the benchmark"
        } else {
            "attached"
        },
        r.queues,
        r.cpumask.as_deref().unwrap_or("default")
    );
    if let Some(l) = &r.rpc_latency {
        let _ = writeln!(
            o,
            "### RPC latency ({} iterations, µs)\n\n| step | p50 | p99 | max | mean |\n|---|---:|---:|---:|---:|",
            l.iterations
        );
        for (name, d) in [
            ("bdev_lvol_create (thin)", &l.create_lvol),
            ("vhost_create_blk_controller", &l.create_controller),
            ("reply → socket accepts", &l.socket_ready_after_reply),
            (
                "**create total** (lvol + controller + socket)",
                &l.create_total,
            ),
            ("vhost_delete_controller", &l.delete_controller),
            ("bdev_lvol_delete", &l.delete_lvol),
        ] {
            let _ = writeln!(
                o,
                "| {name} | {:.0} | {:.0} | {:.0} | {:.0} |",
                d.p50_us, d.p99_us, d.max_us, d.mean_us
            );
        }
        let _ = writeln!(o);
    }
    if let Some(i) = &r.idle {
        let _ = writeln!(
            o,
            "### Idle cost ({} controllers on {} backing; goals ≈0 % CPU, ≤ 2 MiB per controller)\n",
            i.controllers, i.backing
        );
        let _ = writeln!(
            o,
            "| state | VmRSS MiB | RssAnon MiB | threads | daemon CPU % ({} s) |\n|---|---:|---:|---:|---:|",
            i.after.idle_secs
        );
        let row = |o: &mut String, name: &str, p: &IdlePoint| {
            let _ = writeln!(
                o,
                "| {name} | {:.1} | {:.1} | {} | {:.2} |",
                p.mem.vm_rss_kib as f64 / 1024.0,
                p.mem.rss_anon_kib as f64 / 1024.0,
                p.mem.threads,
                p.cpu_pct
            );
        };
        row(&mut o, "no controllers", &i.before);
        row(
            &mut o,
            &format!("{} idle controllers", i.controllers),
            &i.after,
        );
        if let Some(c) = &i.clients {
            row(
                &mut o,
                &format!("+ {} idle clients connected", c.connected),
                &c.idle,
            );
        }
        let _ = writeln!(
            o,
            "\nPer controller: **{:.0} KiB** RSS ({:.2} MiB), {:.2} threads.",
            i.rss_per_controller_kib,
            i.rss_per_controller_kib / 1024.0,
            i.threads_per_controller
        );
        if let Some(c) = &i.clients {
            let _ = writeln!(
                o,
                "Per connected client: {:.0} KiB more daemon RSS; {:.0} KiB on the client side \
                 (libblkio, in the benchmark process).",
                c.daemon_rss_per_client_kib, c.client_rss_per_client_kib
            );
            if let Some(why) = &c.fallback_reason {
                let _ = writeln!(
                    o,
                    "\n> {} clients were requested but {why}; {} were connected instead.",
                    c.requested, c.connected
                );
            }
        }
    }
    for n in &r.notes {
        let _ = writeln!(o, "\n> **Note:** {n}");
    }
    o
}

fn run(a: &RunArgs) -> Result<()> {
    let t = start_target(a)?;
    let rpc = Rpc::new(&t.rpc_sock)?;
    rpc.call("framework_wait_init", Value::Null)?;
    let mut notes = Vec::new();
    let need_store = a.iterations > 0 || (a.controllers > 0 && a.backing == "lvol");
    if need_store {
        rpc.call(
            "bdev_malloc_create",
            json!({"name": STORE_BDEV, "num_blocks": a.store_mib * 2048, "block_size": 512}),
        )?;
        rpc.call(
            "bdev_lvol_create_lvstore",
            json!({"bdev_name": STORE_BDEV, "lvs_name": LVS, "clear_method": "none"}),
        )?;
    }
    let rpc_latency = if a.iterations > 0 {
        eprintln!(
            "katablk-target-bench: RPC latency, {} iterations",
            a.iterations
        );
        Some(rpc_latency(a, &t, &rpc)?)
    } else {
        None
    };
    let idle = if a.controllers > 0 {
        eprintln!(
            "katablk-target-bench: idle cost, {} controllers, {} s per point",
            a.controllers, a.idle_secs
        );
        Some(idle_cost(a, &t, &rpc, &mut notes)?)
    } else {
        None
    };
    if need_store {
        rpc.call("bdev_lvol_delete_lvstore", json!({"lvs_name": LVS}))?;
        rpc.call("bdev_malloc_delete", json!({"name": STORE_BDEV}))?;
    }
    let report = Report {
        version: 1,
        tool: format!("katablk-target-bench {}", env!("CARGO_PKG_VERSION")),
        timestamp_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        target_pid: t.pid,
        target_started: t.child.is_some(),
        queues: a.queues,
        cpumask: a.cpumask.clone(),
        rpc_latency,
        idle,
        notes,
    };
    let md = markdown(&report);
    print!("{md}");
    if let Some(p) = &a.json {
        let text = serde_json::to_string_pretty(&report).context("serialising report")?;
        std::fs::write(p, text + "\n").with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &a.md {
        std::fs::write(p, &md).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

fn rpc_cmd(a: &RpcArgs) -> Result<()> {
    let params: Value = match &a.params {
        Some(p) => serde_json::from_str(p).with_context(|| format!("params {p:?} are not JSON"))?,
        None => Value::Null,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    let client = RpcClient::new(&a.socket);
    let p = if params.is_null() { None } else { Some(params) };
    let v = rt
        .block_on(client.call_value(&a.method, p, false, Duration::from_secs(a.timeout)))
        .with_context(|| a.method.clone())?;
    println!(
        "{}",
        serde_json::to_string_pretty(&v).context("printing result")?
    );
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match &cli.cmd {
        Cmd::Rpc(a) => rpc_cmd(a),
        Cmd::Run(a) => run(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("katablk-target-bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
