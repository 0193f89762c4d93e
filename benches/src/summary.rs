//! Aggregation of raw `katablk-bench` results into a comparison summary: median over rounds
//! per (case, workload, server), ratios candidate/baseline, and a Markdown table.

use crate::report::{BenchReport, ReportKind};
use crate::stats::{median, ratio};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Version of the summary layout.
pub const SUMMARY_VERSION: u32 = 1;

/// Median results of one workload on one server in one case.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Backing store case (`file`, `ram`, ...), from `--meta case=`.
    pub case: String,
    /// Workload name, from `--meta workload=` (or derived from the parameters).
    pub workload: String,
    /// Server name, from `--meta server=` (or the label).
    pub server: String,
    /// Number of rounds aggregated.
    pub rounds: usize,
    /// Median IOPS.
    pub iops: f64,
    /// IOPS of each round, in run order.
    pub iops_rounds: Vec<f64>,
    /// Server CPU (% of one core) of each round, in run order, where sampled.
    #[serde(default)]
    pub server_cpu_rounds: Vec<Option<f64>>,
    /// Median bandwidth, MB/s (10⁶ B/s).
    pub mb_per_sec: f64,
    /// Median of the rounds' mean latency, µs.
    pub lat_mean_us: f64,
    /// Median of the rounds' p50 latency, µs.
    pub lat_p50_us: f64,
    /// Median of the rounds' p99 latency, µs.
    pub lat_p99_us: f64,
    /// Median of the rounds' p99.9 latency, µs.
    pub lat_p999_us: f64,
    /// Median client CPU, % of one core.
    pub client_cpu_pct: f64,
    /// Median server CPU, % of one core (if sampled).
    pub server_cpu_pct: Option<f64>,
    /// Server CPU time per I/O, µs (median server CPU / median IOPS).
    pub server_cpu_us_per_io: Option<f64>,
    /// Median clusters allocated during the run (`--meta allocated_clusters=`, thin lvols).
    #[serde(default)]
    pub allocated_clusters: Option<f64>,
    /// Median of allocated clusters / completed I/Os: the share of writes that allocated.
    #[serde(default)]
    pub alloc_per_io: Option<f64>,
}

/// Median CPU use of a server that has a connected but idle client.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IdleRow {
    /// Backing store case.
    pub case: String,
    /// Server name.
    pub server: String,
    /// Rounds aggregated.
    pub rounds: usize,
    /// Median server CPU, % of one core.
    pub server_cpu_pct: Option<f64>,
}

/// Candidate/baseline ratios for one (case, workload). Above 1 means the candidate has more
/// of it (better for IOPS, worse for latency and CPU).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// Numerator server (empty in summaries written before there could be several).
    #[serde(default)]
    pub server: String,
    /// Backing store case.
    pub case: String,
    /// Workload name.
    pub workload: String,
    /// IOPS ratio.
    pub iops: Option<f64>,
    /// p50 latency ratio.
    pub lat_p50: Option<f64>,
    /// p99 latency ratio.
    pub lat_p99: Option<f64>,
    /// Server CPU % ratio.
    pub server_cpu: Option<f64>,
    /// Server CPU per I/O ratio.
    pub server_cpu_per_io: Option<f64>,
}

/// Pairs (lvol case, raw cases in order of preference) compared on the same server: the
/// thick lvol on a file against an aio bdev on the file, the thick lvol on RAM against the
/// malloc bdev, and thin first writes against the thick lvol on the file.
pub const LVOL_PAIRS: &[(&str, &[&str])] = &[
    ("lvol-file", &["aio-file", "file"]),
    ("lvol-ram", &["malloc", "ram"]),
    ("thin-first-write", &["lvol-file"]),
];

/// Servers whose lvol cases really are lvols (the others serve their raw backend there).
pub const LVOL_SERVERS: &[&str] = &["target"];

/// Goal: a thick lvol reaches at least this share of its raw device's IOPS.
pub const LVOL_GOAL: f64 = 0.95;

/// Paired rounds needed before the goal is judged on the paired ratio.
pub const MIN_PAIRS: usize = 3;

/// Server CPU share (% of one core) below which a round counts as disturbed.
pub const QUIET_CPU: f64 = 95.0;

/// The paired ratio over the rounds whose server CPU was ≥ [`QUIET_CPU`] in both cases.
fn quiet_pairs(l: &Row, b: &Row) -> (Option<f64>, usize) {
    if l.iops_rounds.len() != b.iops_rounds.len()
        || l.server_cpu_rounds.len() != l.iops_rounds.len()
        || b.server_cpu_rounds.len() != b.iops_rounds.len()
    {
        return (None, 0);
    }
    let v: Vec<f64> = (0..l.iops_rounds.len())
        .filter(|&i| {
            l.server_cpu_rounds[i].is_some_and(|c| c >= QUIET_CPU)
                && b.server_cpu_rounds[i].is_some_and(|c| c >= QUIET_CPU)
                && b.iops_rounds[i] > 0.0
        })
        .map(|i| l.iops_rounds[i] / b.iops_rounds[i])
        .collect();
    (median(&v), v.len())
}

/// Median of the per-round ratios `a[i] / b[i]` (equal lengths ≥ 2, positive denominators).
fn paired_median(a: &[f64], b: &[f64]) -> Option<f64> {
    if a.len() != b.len() || a.len() < 2 {
        return None;
    }
    let v: Vec<f64> = a
        .iter()
        .zip(b)
        .filter(|(_, &y)| y > 0.0)
        .map(|(&x, &y)| x / y)
        .collect();
    if v.len() != a.len() {
        return None;
    }
    median(&v)
}

/// An lvol case divided by its raw case, same server and workload. IOPS above 1 is better
/// for the lvol.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LvolRatio {
    /// Server (the one with lvols: `target`).
    pub server: String,
    /// Numerator case (`lvol-file`, `lvol-ram`, `thin-first-write`).
    pub case: String,
    /// Denominator case (`aio-file`, `malloc`, `lvol-file`, ...).
    pub raw_case: String,
    /// Workload name.
    pub workload: String,
    /// IOPS ratio.
    pub iops: Option<f64>,
    /// p50 latency ratio.
    pub lat_p50: Option<f64>,
    /// p99 latency ratio.
    pub lat_p99: Option<f64>,
    /// Server CPU per I/O ratio.
    pub server_cpu_per_io: Option<f64>,
    /// Median over rounds of the per-round IOPS ratio (round *i* of the lvol case over
    /// round *i* of the raw case), when both cases have the same number of rounds, at least
    /// two. With `INTERLEAVE=1` a round's two runs are adjacent in time, so this ratio is
    /// not moved by slow drifts of the machine that the ratio of medians picks up.
    #[serde(default)]
    pub iops_paired: Option<f64>,
    /// Number of rounds paired for `iops_paired`.
    #[serde(default)]
    pub pairs: usize,
    /// `iops_paired` over the rounds in which the server had at least [`QUIET_CPU`] % of a
    /// core in both cases: a CPU-bound server below that was descheduled by something else
    /// on the machine, which disturbs that pair.
    #[serde(default)]
    pub iops_paired_quiet: Option<f64>,
    /// Number of rounds in `iops_paired_quiet`.
    #[serde(default)]
    pub quiet_pairs: usize,
    /// Whether the IOPS ratio ≥ [`LVOL_GOAL`] (thick lvol cases only): `iops_paired` when
    /// at least [`MIN_PAIRS`] rounds were paired, else `iops`.
    pub within_goal: Option<bool>,
    /// The same IOPS ratio of a server that serves the same backend in both cases (e.g.
    /// katablk-vhost's `--file` in lvol-file and aio-file): an A/A estimate of the noise
    /// between the two cases' measurement times.
    #[serde(default)]
    pub control_iops: Option<f64>,
    /// That server.
    #[serde(default)]
    pub control_server: Option<String>,
}

/// The whole summary, written as `summary.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// [`SUMMARY_VERSION`].
    pub version: u32,
    /// Name of the results directory.
    pub name: String,
    /// Server names, in order of first appearance.
    pub servers: Vec<String>,
    /// Case names, in order of first appearance.
    pub cases: Vec<String>,
    /// Workload names, in order of first appearance.
    pub workloads: Vec<String>,
    /// Server that ratios are relative to (denominator).
    pub baseline: String,
    /// Server whose results are divided by the baseline's (numerator).
    pub candidate: String,
    /// Median results.
    pub rows: Vec<Row>,
    /// Idle CPU results.
    pub idle: Vec<IdleRow>,
    /// Ratios server/baseline, where both were measured: the candidate first, then every
    /// other server.
    pub comparisons: Vec<Comparison>,
    /// Same-server ratios of an lvol case to its raw backing case ([`LVOL_PAIRS`]).
    #[serde(default)]
    pub lvol_ratios: Vec<LvolRatio>,
    /// Free-text notes (e.g. which server was skipped and why).
    pub notes: Vec<String>,
}

fn meta(r: &BenchReport, key: &str) -> Option<String> {
    r.params.meta.get(key).cloned()
}

/// The workload name used when `--meta workload=` was not given, e.g. `randread-4k-qd32-j1`.
pub fn default_workload_name(r: &BenchReport) -> String {
    let bs = crate::size::format_size(r.params.bs)
        .trim_end_matches("iB")
        .to_lowercase();
    format!(
        "{}-{bs}-qd{}-j{}",
        r.params.rw, r.params.iodepth, r.params.numjobs
    )
}

fn push_unique(v: &mut Vec<String>, s: &str) {
    if !v.iter().any(|x| x == s) {
        v.push(s.to_string());
    }
}

fn alloc_meta(r: &BenchReport) -> Option<f64> {
    meta(r, "allocated_clusters").and_then(|v| v.parse().ok())
}

fn med(reports: &[&BenchReport], f: impl Fn(&BenchReport) -> f64) -> f64 {
    let v: Vec<f64> = reports.iter().map(|r| f(r)).collect();
    median(&v).unwrap_or(f64::NAN)
}

fn med_opt(reports: &[&BenchReport], f: impl Fn(&BenchReport) -> Option<f64>) -> Option<f64> {
    let v: Vec<f64> = reports.iter().filter_map(|r| f(r)).collect();
    median(&v)
}

/// (case, workload, server).
type GroupKey = (String, String, String);

/// Builds the summary of `reports` (in run order).
pub fn build(name: &str, reports: &[BenchReport], baseline: &str, candidate: &str) -> Summary {
    let mut servers = Vec::new();
    let mut cases = Vec::new();
    let mut workloads = Vec::new();
    // (case, workload, server) -> reports, in first-seen order.
    let mut groups: Vec<(GroupKey, Vec<&BenchReport>)> = Vec::new();
    let mut idle_groups: Vec<((String, String), Vec<&BenchReport>)> = Vec::new();
    for r in reports {
        let case = meta(r, "case").unwrap_or_else(|| "default".to_string());
        let server = meta(r, "server")
            .or_else(|| r.params.label.clone())
            .unwrap_or_else(|| "server".to_string());
        push_unique(&mut servers, &server);
        push_unique(&mut cases, &case);
        match r.kind {
            ReportKind::Idle => {
                let key = (case, server);
                match idle_groups.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, v)) => v.push(r),
                    None => idle_groups.push((key, vec![r])),
                }
            }
            ReportKind::Io => {
                let workload = meta(r, "workload").unwrap_or_else(|| default_workload_name(r));
                push_unique(&mut workloads, &workload);
                let key = (case, workload, server);
                match groups.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, v)) => v.push(r),
                    None => groups.push((key, vec![r])),
                }
            }
        }
    }

    let rows: Vec<Row> = groups
        .iter()
        .map(|((case, workload, server), rs)| {
            let iops = med(rs, |r| r.total.total.iops);
            let server_cpu_pct = med_opt(rs, |r| r.server_cpu.as_ref().map(|c| c.percent));
            Row {
                case: case.clone(),
                workload: workload.clone(),
                server: server.clone(),
                rounds: rs.len(),
                iops,
                iops_rounds: rs.iter().map(|r| r.total.total.iops).collect(),
                server_cpu_rounds: rs
                    .iter()
                    .map(|r| r.server_cpu.as_ref().map(|c| c.percent))
                    .collect(),
                mb_per_sec: med(rs, |r| r.total.total.mb_per_sec()),
                lat_mean_us: med(rs, |r| r.total.total.lat.mean_ns / 1e3),
                lat_p50_us: med(rs, |r| r.total.total.lat.p50_ns as f64 / 1e3),
                lat_p99_us: med(rs, |r| r.total.total.lat.p99_ns as f64 / 1e3),
                lat_p999_us: med(rs, |r| r.total.total.lat.p999_ns as f64 / 1e3),
                client_cpu_pct: med(rs, |r| r.client_cpu.percent),
                server_cpu_pct,
                server_cpu_us_per_io: server_cpu_pct.and_then(|c| ratio(c / 100.0 * 1e6, iops)),
                allocated_clusters: med_opt(rs, alloc_meta),
                alloc_per_io: med_opt(rs, |r| {
                    alloc_meta(r).and_then(|a| ratio(a, r.total.total.ios as f64))
                }),
            }
        })
        .collect();

    let idle = idle_groups
        .iter()
        .map(|((case, server), rs)| IdleRow {
            case: case.clone(),
            server: server.clone(),
            rounds: rs.len(),
            server_cpu_pct: med_opt(rs, |r| r.server_cpu.as_ref().map(|c| c.percent)),
        })
        .collect();

    let find = |case: &str, workload: &str, server: &str| {
        rows.iter()
            .find(|r| r.case == case && r.workload == workload && r.server == server)
    };
    let opt_ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => ratio(a, b),
        _ => None,
    };
    let mut comparisons = Vec::new();
    let mut numerators: Vec<&str> = vec![candidate];
    for s in &servers {
        if s != candidate && s != baseline {
            numerators.push(s);
        }
    }
    for num in &numerators {
        for case in &cases {
            for workload in &workloads {
                if let (Some(c), Some(b)) =
                    (find(case, workload, num), find(case, workload, baseline))
                {
                    comparisons.push(Comparison {
                        server: num.to_string(),
                        case: case.clone(),
                        workload: workload.clone(),
                        iops: ratio(c.iops, b.iops),
                        lat_p50: ratio(c.lat_p50_us, b.lat_p50_us),
                        lat_p99: ratio(c.lat_p99_us, b.lat_p99_us),
                        server_cpu: opt_ratio(c.server_cpu_pct, b.server_cpu_pct),
                        server_cpu_per_io: opt_ratio(
                            c.server_cpu_us_per_io,
                            b.server_cpu_us_per_io,
                        ),
                    });
                }
            }
        }
    }

    let mut lvol_ratios = Vec::new();
    for (lcase, raws) in LVOL_PAIRS {
        for server in servers
            .iter()
            .filter(|s| LVOL_SERVERS.contains(&s.as_str()))
        {
            for workload in &workloads {
                let Some(l) = find(lcase, workload, server) else {
                    continue;
                };
                let Some(b) = raws.iter().find_map(|rc| find(rc, workload, server)) else {
                    continue;
                };
                let iops = ratio(l.iops, b.iops);
                let iops_paired = paired_median(&l.iops_rounds, &b.iops_rounds);
                let pairs = if iops_paired.is_some() {
                    l.iops_rounds.len()
                } else {
                    0
                };
                let judged = if pairs >= MIN_PAIRS {
                    iops_paired
                } else {
                    iops
                };
                let (iops_paired_quiet, quiet_n) = quiet_pairs(l, b);
                let control = if lcase.starts_with("lvol-") {
                    servers
                        .iter()
                        .filter(|s| !LVOL_SERVERS.contains(&s.as_str()))
                        .find_map(|s| {
                            let a = find(lcase, workload, s)?;
                            let r = find(&b.case, workload, s)?;
                            Some((s.clone(), ratio(a.iops, r.iops)?))
                        })
                } else {
                    None
                };
                lvol_ratios.push(LvolRatio {
                    control_iops: control.as_ref().map(|c| c.1),
                    control_server: control.map(|c| c.0),
                    server: server.clone(),
                    case: lcase.to_string(),
                    raw_case: b.case.clone(),
                    workload: workload.clone(),
                    iops,
                    iops_paired,
                    pairs,
                    iops_paired_quiet,
                    quiet_pairs: quiet_n,
                    lat_p50: ratio(l.lat_p50_us, b.lat_p50_us),
                    lat_p99: ratio(l.lat_p99_us, b.lat_p99_us),
                    server_cpu_per_io: opt_ratio(l.server_cpu_us_per_io, b.server_cpu_us_per_io),
                    within_goal: if lcase.starts_with("lvol-") {
                        judged.map(|x| x >= LVOL_GOAL)
                    } else {
                        None
                    },
                });
            }
        }
    }

    let mut notes = Vec::new();
    for s in [baseline, candidate] {
        if !servers.iter().any(|x| x == s) {
            notes.push(format!(
                "no results for server {s:?}: ratios {candidate}/{baseline} are not available"
            ));
        }
    }

    Summary {
        version: SUMMARY_VERSION,
        name: name.to_string(),
        servers,
        cases,
        workloads,
        baseline: baseline.to_string(),
        candidate: candidate.to_string(),
        rows,
        idle,
        comparisons,
        lvol_ratios,
        notes,
    }
}

/// Reads every `*.json` result in `dir` (sorted by file name, which the comparison script
/// makes the run order), skipping files that are not `katablk-bench` reports.
pub fn read_dir(dir: &Path) -> Result<Vec<BenchReport>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading directory {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    paths.sort();
    let mut out = Vec::new();
    for p in paths {
        match BenchReport::read_json(&p) {
            Ok(r) => out.push(r),
            Err(e) => tracing::warn!("skipping {}: {e:#}", p.display()),
        }
    }
    Ok(out)
}

/// Name of the archive that holds a committed run's raw data (`raw/`, `logs/` and the like).
pub const RAW_ARCHIVE: &str = "raw.tar.gz";

/// Reads the `raw/*.json` results of a run's archive ([`RAW_ARCHIVE`], a gzip'd tar), sorted by
/// file name like [`read_dir`], skipping entries that are not `katablk-bench` reports.
pub fn read_archive(path: &Path) -> Result<Vec<BenchReport>> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(file));
    let mut found: Vec<(String, Vec<u8>)> = Vec::new();
    for entry in tar
        .entries()
        .with_context(|| format!("reading {}", path.display()))?
    {
        let mut entry = entry.with_context(|| format!("reading {}", path.display()))?;
        let name = entry.path()?.to_string_lossy().into_owned();
        let name = name.trim_start_matches("./");
        let Some(file) = name.strip_prefix("raw/") else {
            continue;
        };
        if file.contains('/') || !file.ends_with(".json") {
            continue;
        }
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut entry, &mut data)
            .with_context(|| format!("reading {name} in {}", path.display()))?;
        found.push((name.to_string(), data));
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = Vec::new();
    for (name, data) in found {
        match serde_json::from_slice::<BenchReport>(&data) {
            Ok(r) => out.push(r),
            Err(e) => tracing::warn!("skipping {name} in {}: {e}", path.display()),
        }
    }
    Ok(out)
}

/// The results of a run directory: `DIR/raw/*.json` while the run is fresh, else its archive
/// `DIR/raw.tar.gz` (how runs are committed), else `DIR/*.json`.
pub fn read_run(dir: &Path) -> Result<Vec<BenchReport>> {
    let raw = dir.join("raw");
    let archive = dir.join(RAW_ARCHIVE);
    if raw.is_dir() {
        read_dir(&raw)
    } else if archive.is_file() {
        read_archive(&archive)
    } else {
        read_dir(dir)
    }
}

/// One file of a run's raw data, `DIR/raw/NAME`, read from the directory while the run is fresh,
/// else from its archive; `None` when neither has it.
pub fn read_run_file(dir: &Path, name: &str) -> Result<Option<Vec<u8>>> {
    let fresh = dir.join("raw").join(name);
    if fresh.is_file() {
        return std::fs::read(&fresh)
            .map(Some)
            .with_context(|| format!("reading {}", fresh.display()));
    }
    let archive = dir.join(RAW_ARCHIVE);
    if !archive.is_file() {
        return Ok(None);
    }
    let file =
        std::fs::File::open(&archive).with_context(|| format!("opening {}", archive.display()))?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(file));
    let want = format!("raw/{name}");
    for entry in tar
        .entries()
        .with_context(|| format!("reading {}", archive.display()))?
    {
        let mut entry = entry.with_context(|| format!("reading {}", archive.display()))?;
        let path = entry.path()?.to_string_lossy().into_owned();
        if path.trim_start_matches("./") == want {
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut data)
                .with_context(|| format!("reading {want} in {}", archive.display()))?;
            return Ok(Some(data));
        }
    }
    Ok(None)
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:.digits$}"),
        _ => "n/a".to_string(),
    }
}

impl Summary {
    /// Renders the summary as Markdown tables.
    pub fn to_markdown(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "# Benchmark summary: {}\n", self.name);
        let _ = writeln!(
            o,
            "Median of {} round(s) per cell. Latency in µs (submission to completion as seen by the \
             client); CPU in % of one core over the measured window.\n",
            self.rows.iter().map(|r| r.rounds).max().unwrap_or(0)
        );
        for n in &self.notes {
            let _ = writeln!(o, "> **Note:** {n}\n");
        }
        let _ = writeln!(o, "## Results\n");
        let _ = writeln!(
            o,
            "| case | workload | server | IOPS | MB/s | p50 | p99 | p99.9 | server CPU % | server µs/IO | client CPU % | rounds |"
        );
        let _ = writeln!(
            o,
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for r in &self.rows {
            let _ = writeln!(
                o,
                "| {} | {} | {} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} | {:.1} | {} |",
                r.case,
                r.workload,
                r.server,
                r.iops,
                r.mb_per_sec,
                r.lat_p50_us,
                r.lat_p99_us,
                r.lat_p999_us,
                fmt_opt(r.server_cpu_pct, 1),
                fmt_opt(r.server_cpu_us_per_io, 2),
                r.client_cpu_pct,
                r.rounds
            );
        }
        let _ = writeln!(o, "\n## Ratios to {}\n", self.baseline);
        if self.comparisons.is_empty() {
            let _ = writeln!(o, "No workload was measured on both servers.");
        } else {
            let _ = writeln!(
                o,
                "server / {b} in the same run: IOPS above 1 is better for the server; latency and \
                 CPU below 1 are better for it.\n",
                b = self.baseline
            );
            let _ = writeln!(
                o,
                "| server | case | workload | IOPS | p50 | p99 | server CPU | server CPU/IO |"
            );
            let _ = writeln!(o, "|---|---|---|---:|---:|---:|---:|---:|");
            for c in &self.comparisons {
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {} | {} | {} | {} | {} |",
                    if c.server.is_empty() {
                        &self.candidate
                    } else {
                        &c.server
                    },
                    c.case,
                    c.workload,
                    fmt_opt(c.iops, 2),
                    fmt_opt(c.lat_p50, 2),
                    fmt_opt(c.lat_p99, 2),
                    fmt_opt(c.server_cpu, 2),
                    fmt_opt(c.server_cpu_per_io, 2)
                );
            }
        }
        if !self.lvol_ratios.is_empty() {
            let _ = writeln!(o, "\n## Lvol / raw device (same server)\n");
            let _ = writeln!(
                o,
                "Goal: a thick lvol within 5 % of its raw backing device (IOPS ratio ≥ {LVOL_GOAL:.2}), \
                 notably at 4 KiB QD32. thin-first-write / lvol-file compares writes to a fresh thin \
                 lvol (allocating) with the thick lvol. IOPS is the ratio of the medians; paired is \
                 the median of the per-round ratios (round i over round i; with INTERLEAVE=1 the two \
                 runs of a round are adjacent in time), and the goal is judged on it from \
                 {MIN_PAIRS} rounds on; quiet is the same over the rounds in which the server had \
                 at least {QUIET_CPU:.0} % of a core in both cases (below that a CPU-bound server \
                 was descheduled by something else). The last column is the same ratio for a server that serves \
                 the same backend in both cases (katablk-vhost, QSD): far from 1.000 means the \
                 machine changed between the cases and the lvol ratio is not trustworthy.\n"
            );
            let _ = writeln!(
                o,
                "| server | lvol case | raw case | workload | IOPS | IOPS paired (rounds) | paired, quiet (rounds) | p50 | p99 | server CPU/IO | goal | control IOPS (A/A) |"
            );
            let _ = writeln!(
                o,
                "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|"
            );
            for l in &self.lvol_ratios {
                let goal = match l.within_goal {
                    Some(true) => "met",
                    Some(false) => "**missed**",
                    None => "",
                };
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {goal} | {} |",
                    l.server,
                    l.case,
                    l.raw_case,
                    l.workload,
                    fmt_opt(l.iops, 3),
                    match l.iops_paired {
                        Some(x) => format!("{x:.3} ({})", l.pairs),
                        None => String::new(),
                    },
                    match l.iops_paired_quiet {
                        Some(x) => format!("{x:.3} ({})", l.quiet_pairs),
                        None => String::new(),
                    },
                    fmt_opt(l.lat_p50, 2),
                    fmt_opt(l.lat_p99, 2),
                    fmt_opt(l.server_cpu_per_io, 2),
                    match (&l.control_server, l.control_iops) {
                        (Some(s), Some(x)) => format!("{x:.3} ({s})"),
                        _ => String::new(),
                    },
                );
            }
        }
        let thin: Vec<&Row> = self
            .rows
            .iter()
            .filter(|r| r.allocated_clusters.is_some())
            .collect();
        if !thin.is_empty() {
            let _ = writeln!(o, "\n## Thin lvol allocation\n");
            let _ = writeln!(
                o,
                "| case | workload | server | IOPS | clusters allocated | allocating share of I/Os |\n|---|---|---|---:|---:|---:|"
            );
            for r in thin {
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {:.0} | {} | {} |",
                    r.case,
                    r.workload,
                    r.server,
                    r.iops,
                    fmt_opt(r.allocated_clusters, 0),
                    r.alloc_per_io
                        .map(|x| format!("{:.2} %", x * 100.0))
                        .unwrap_or_else(|| "n/a".into())
                );
            }
        }
        if !self.idle.is_empty() {
            let _ = writeln!(o, "\n## Idle server CPU (client connected, no I/O)\n");
            let _ = writeln!(o, "| case | server | server CPU % | rounds |");
            let _ = writeln!(o, "|---|---|---:|---:|");
            for i in &self.idle {
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {} |",
                    i.case,
                    i.server,
                    fmt_opt(i.server_cpu_pct, 1),
                    i.rounds
                );
            }
        }
        o
    }

    /// Writes `summary.json`-style pretty JSON.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).context("serialising summary")?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
    }

    /// Reads a summary written by [`Summary::write_json`].
    pub fn read_json(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuUsage;
    use crate::report::{DeviceInfo, JobReport, Params, REPORT_VERSION};
    use crate::stats::IoStats;
    use std::collections::BTreeMap;

    fn report(
        case: &str,
        workload: &str,
        server: &str,
        iops: f64,
        p99_ns: u64,
        cpu: f64,
    ) -> BenchReport {
        let mut meta = BTreeMap::new();
        meta.insert("case".into(), case.into());
        meta.insert("workload".into(), workload.into());
        meta.insert("server".into(), server.into());
        let mut stats = IoStats {
            ios: iops as u64,
            bytes: iops as u64 * 4096,
            iops,
            bytes_per_sec: iops * 4096.0,
            ..IoStats::default()
        };
        stats.lat.p50_ns = p99_ns / 2;
        stats.lat.p99_ns = p99_ns;
        BenchReport {
            version: REPORT_VERSION,
            kind: ReportKind::Io,
            tool: "t".into(),
            timestamp_unix: 0,
            params: Params {
                rw: "randread".into(),
                bs: 4096,
                iodepth: 32,
                numjobs: 1,
                meta,
                ..Params::default()
            },
            device: DeviceInfo::default(),
            elapsed_s: 1.0,
            jobs: vec![],
            total: JobReport {
                job: None,
                read: stats.clone(),
                write: IoStats::default(),
                total: stats,
                verified: 0,
            },
            client_cpu: CpuUsage::default(),
            server_cpu: Some(CpuUsage {
                percent: cpu,
                ..CpuUsage::default()
            }),
            timeline: None,
        }
    }

    #[test]
    fn medians_and_ratios() {
        let mut rs = Vec::new();
        for (i, (k, q)) in [(100.0, 50.0), (300.0, 60.0), (200.0, 40.0)]
            .iter()
            .enumerate()
        {
            rs.push(report(
                "file",
                "rr",
                "katablk",
                *k,
                1000 * (i as u64 + 1),
                50.0,
            ));
            rs.push(report("file", "rr", "qsd", *q, 4000, 100.0));
        }
        let mut idle = report("file", "", "qsd", 0.0, 0, 2.0);
        idle.kind = ReportKind::Idle;
        rs.push(idle);
        let s = build("t", &rs, "qsd", "katablk");
        assert_eq!(s.servers, vec!["katablk", "qsd"]);
        assert_eq!(s.rows.len(), 2);
        let k = &s.rows[0];
        assert_eq!(k.rounds, 3);
        assert_eq!(k.iops, 200.0);
        assert_eq!(k.iops_rounds, vec![100.0, 300.0, 200.0]);
        assert_eq!(k.lat_p99_us, 2.0);
        assert_eq!(k.server_cpu_us_per_io, Some(0.5 * 1e6 / 200.0));
        let c = &s.comparisons[0];
        assert_eq!(c.iops, Some(4.0));
        assert_eq!(c.lat_p99, Some(0.5));
        assert_eq!(c.server_cpu, Some(0.5));
        assert_eq!(s.idle.len(), 1);
        assert_eq!(s.idle[0].server_cpu_pct, Some(2.0));
        assert!(s.notes.is_empty());
        let md = s.to_markdown();
        assert!(md.contains("| file | rr | katablk | 200 |"), "{md}");
        assert!(md.contains("| katablk | file | rr | 4.00 | 0.50 |"), "{md}");
    }

    #[test]
    fn baseline_only_has_no_ratios_and_a_note() {
        let rs = vec![report("ram", "rr", "qsd", 10.0, 100, 1.0)];
        let s = build("t", &rs, "qsd", "katablk");
        assert!(s.comparisons.is_empty());
        assert_eq!(s.notes.len(), 1);
        assert!(s
            .to_markdown()
            .contains("No workload was measured on both servers"));
    }

    #[test]
    fn summary_json_round_trip() {
        let rs = vec![
            report("ram", "rr", "qsd", 10.0, 100, 1.0),
            report("ram", "rr", "katablk", 20.0, 100, 1.0),
        ];
        let s = build("t", &rs, "qsd", "katablk");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("summary.json");
        s.write_json(&p).unwrap();
        assert_eq!(Summary::read_json(&p).unwrap(), s);
    }

    #[test]
    fn reads_reports_from_a_directory_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        report("a", "w", "s2", 2.0, 1, 1.0)
            .write_json(&dir.path().join("002.json"))
            .unwrap();
        report("a", "w", "s1", 1.0, 1, 1.0)
            .write_json(&dir.path().join("001.json"))
            .unwrap();
        std::fs::write(dir.path().join("junk.json"), "{}").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "x").unwrap();
        let rs = read_dir(dir.path()).unwrap();
        assert_eq!(rs.len(), 2);
        assert_eq!(rs[0].total.total.iops, 1.0);
    }

    #[test]
    fn reads_a_committed_run_from_its_archive_like_its_raw_directory() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("raw");
        std::fs::create_dir(&raw).unwrap();
        report("a", "w", "s2", 2.0, 1, 1.0)
            .write_json(&raw.join("002.json"))
            .unwrap();
        report("a", "w", "s1", 1.0, 1, 1.0)
            .write_json(&raw.join("001.json"))
            .unwrap();
        std::fs::write(raw.join("junk.json"), "{}").unwrap();
        std::fs::create_dir(dir.path().join("logs")).unwrap();
        std::fs::write(dir.path().join("logs/001.json"), "not a report").unwrap();
        let fresh = read_run(dir.path()).unwrap();
        assert_eq!(fresh.len(), 2);
        // Packed as scripts/bench-compare.sh does it (`tar -czf raw.tar.gz raw logs`).
        let st = std::process::Command::new("tar")
            .args(["-czf", RAW_ARCHIVE, "raw", "logs"])
            .current_dir(dir.path())
            .status()
            .unwrap();
        assert!(st.success());
        std::fs::remove_dir_all(&raw).unwrap();
        let packed = read_run(dir.path()).unwrap();
        assert_eq!(packed, fresh);
        assert_eq!(packed[0].total.total.iops, 1.0);
    }

    #[test]
    fn every_committed_run_has_its_raw_data_in_one_archive() {
        let results = Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
        let mut runs = 0;
        for e in std::fs::read_dir(&results).unwrap() {
            let d = e.unwrap().path();
            if !d.join("summary.json").is_file() {
                continue;
            }
            runs += 1;
            assert!(
                !d.join("raw").exists(),
                "{}: raw/ is not packed",
                d.display()
            );
            let rs = read_run(&d).unwrap();
            assert!(!rs.is_empty(), "{}: no reports in its archive", d.display());
        }
        assert!(runs > 0);
    }

    #[test]
    fn lvol_ratios_third_server_and_thin_allocation() {
        let mut thin = report("thin-first-write", "rw", "target", 50.0, 100, 1.0);
        thin.params
            .meta
            .insert("allocated_clusters".into(), "25".into());
        let rs = vec![
            report("aio-file", "rw", "target", 100.0, 100, 1.0),
            report("aio-file", "rw", "qsd", 50.0, 100, 1.0),
            report("lvol-file", "rw", "target", 96.0, 100, 1.0),
            report("malloc", "rw", "target", 100.0, 100, 1.0),
            report("lvol-ram", "rw", "target", 90.0, 100, 1.0),
            thin,
        ];
        let s = build("t", &rs, "qsd", "katablk");
        let c = &s.comparisons[0];
        assert_eq!((c.server.as_str(), c.iops), ("target", Some(2.0)));
        assert_eq!(s.lvol_ratios.len(), 3);
        let f = &s.lvol_ratios[0];
        assert_eq!(
            (f.case.as_str(), f.raw_case.as_str()),
            ("lvol-file", "aio-file")
        );
        assert_eq!(f.within_goal, Some(true));
        assert_eq!(s.lvol_ratios[1].within_goal, Some(false));
        let t = &s.lvol_ratios[2];
        assert_eq!(
            (t.raw_case.as_str(), t.iops, t.within_goal),
            ("lvol-file", Some(50.0 / 96.0), None)
        );
        let row = s
            .rows
            .iter()
            .find(|r| r.case == "thin-first-write")
            .unwrap();
        assert_eq!(row.allocated_clusters, Some(25.0));
        assert_eq!(row.alloc_per_io, Some(0.5));
        let md = s.to_markdown();
        assert!(
            md.contains("| target | lvol-ram | malloc | rw | 0.900 |"),
            "{md}"
        );
        assert!(md.contains("**missed**"), "{md}");
        assert!(md.contains("50.00 %"), "{md}");
    }

    #[test]
    fn paired_ratio_cancels_drift_and_judges_the_goal() {
        // The machine slows down round by round; each round's lvol run is 4 % below the raw
        // run next to it. Medians of each case mix rounds; the paired ratio does not.
        let raw = [100.0, 80.0, 60.0];
        let lvol = [96.0, 76.8, 57.6];
        let mut rs = Vec::new();
        for i in 0..3 {
            rs.push(report("aio-file", "rw", "target", raw[i], 100, 1.0));
            rs.push(report("lvol-file", "rw", "target", lvol[i], 100, 1.0));
        }
        let s = build("t", &rs, "qsd", "katablk");
        let f = &s.lvol_ratios[0];
        assert_eq!(f.pairs, 3);
        assert!((f.iops_paired.unwrap() - 0.96).abs() < 1e-9);
        assert_eq!(f.within_goal, Some(true));
        assert!(s.to_markdown().contains("0.960 (3)"));
        // Two pairs: reported, but the goal is judged on the ratio of medians.
        let s2 = build("t", &rs[..4], "qsd", "katablk");
        assert_eq!(s2.lvol_ratios[0].pairs, 2);
        assert_eq!(s2.lvol_ratios[0].within_goal, Some(true));
        // Unequal round counts: no pairing.
        let s3 = build("t", &rs[..5], "qsd", "katablk");
        assert_eq!(s3.lvol_ratios[0].iops_paired, None);
        assert_eq!(paired_median(&[1.0, 2.0], &[1.0, 0.0]), None);
        // Quiet pairs: round 2's raw run had the server descheduled (50 % of a core).
        let mut rs = Vec::new();
        for (raw, lvol, cpu) in [(100.0, 97.0, 98.0), (50.0, 96.0, 50.0), (100.0, 98.0, 99.0)] {
            rs.push(report("aio-file", "rw", "target", raw, 100, cpu));
            rs.push(report("lvol-file", "rw", "target", lvol, 100, 98.0));
        }
        let s = build("t", &rs, "qsd", "katablk");
        let f = &s.lvol_ratios[0];
        assert_eq!(f.quiet_pairs, 2);
        assert!((f.iops_paired_quiet.unwrap() - 0.975).abs() < 1e-9);
        assert!(s.to_markdown().contains("0.975 (2)"));
    }

    #[test]
    fn default_workload_names() {
        let r = report("a", "w", "s", 1.0, 1, 1.0);
        assert_eq!(default_workload_name(&r), "randread-4k-qd32-j1");
    }
}
