//! The rate-limit benchmark (`scripts/bench-qos.sh`): what its runs show, scenario by scenario.
//!
//! Every run is a `katablk-bench` report tagged `server`, `scenario` and `run`, with a
//! [`Timeline`] of completions per interval; limits changed while a client ran are in
//! `<server>-<scenario>.events` (one line per RPC: its return time, the bdev, the fields set).

use crate::report::{BenchReport, Timeline};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// How far a limited rate may stray from its limit: ±5 %.
pub const TOLERANCE: f64 = 0.05;

/// One limit set over RPC.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Event {
    /// When the RPC returned, seconds since the Unix epoch.
    pub unix_s: f64,
    /// The bdev (or `group`).
    pub target: String,
    /// `rw_ios_per_sec` it set, if it set one.
    pub rw_ios_per_sec: Option<u64>,
}

/// Parses an events file; lines that do not start with a time are skipped.
pub fn parse_events(text: &str) -> Vec<Event> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ' ');
            let unix_s = it.next()?.parse().ok()?;
            let target = it.next()?.to_string();
            let rest = it.next().unwrap_or("");
            let rw_ios_per_sec = rest.split_once("rw_ios_per_sec").and_then(|(_, v)| {
                let digits: String = v
                    .trim_start_matches(|c: char| !c.is_ascii_digit())
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                digits.parse().ok()
            });
            Some(Event {
                unix_s,
                target,
                rw_ios_per_sec,
            })
        })
        .collect()
}

/// Mean rate (I/Os or bytes per second) of the samples whose midpoints fall in each window of
/// `secs` seconds, in order; windows with less than half their length sampled are left out.
pub fn windows(tl: &Timeline, secs: f64, bytes: bool) -> Vec<f64> {
    let mut acc: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for s in &tl.samples {
        let mid = (s.t_s - s.len_s / 2.0).max(0.0);
        let w = (mid / secs) as u64;
        let e = acc.entry(w).or_default();
        e.0 += if bytes {
            s.bytes_per_sec * s.len_s
        } else {
            s.ios as f64
        };
        e.1 += s.len_s;
    }
    acc.values()
        .filter(|(_, len)| *len >= secs / 2.0)
        .map(|(v, len)| v / len)
        .collect()
}

fn rate_of(r: &BenchReport, bytes: bool) -> f64 {
    if bytes {
        r.total.total.bytes_per_sec
    } else {
        r.total.total.iops
    }
}

/// A limit held over a whole run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Hold {
    /// The limit (I/Os or bytes per second).
    pub limit: f64,
    /// What the same client did with no limit.
    pub free: f64,
    /// Mean over the limited run.
    pub mean: f64,
    /// `mean / limit - 1`.
    pub deviation: f64,
    /// The largest `|window / limit - 1|` over its one-second windows.
    pub worst_second: f64,
    /// One-second windows measured.
    pub seconds: usize,
    /// Mean and every second within [`TOLERANCE`], and the client could push more.
    pub within: bool,
    /// p99 latency of the limited run, µs.
    pub p99_us: f64,
}

/// How `limited` held `limit` (`bytes`: a bandwidth limit), against the unlimited `free`.
pub fn hold(free: &BenchReport, limited: &BenchReport, limit: f64, bytes: bool) -> Hold {
    let mean = rate_of(limited, bytes);
    let secs = limited
        .timeline
        .as_ref()
        .map(|t| windows(t, 1.0, bytes))
        .unwrap_or_default();
    let worst_second = secs
        .iter()
        .map(|w| (w / limit - 1.0).abs())
        .fold(0.0, f64::max);
    let deviation = mean / limit - 1.0;
    let free = rate_of(free, bytes);
    Hold {
        limit,
        free,
        mean,
        deviation,
        worst_second,
        seconds: secs.len(),
        within: deviation.abs() <= TOLERANCE
            && worst_second <= TOLERANCE
            && !secs.is_empty()
            && free > limit * (1.0 + TOLERANCE),
        p99_us: limited.total.total.lat.p99_ns as f64 / 1e3,
    }
}

/// A limit changed while the client ran.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Change {
    /// The limit before (I/Os per second).
    pub from: u64,
    /// The limit after.
    pub to: u64,
    /// When the RPC returned, seconds into the measured window.
    pub at_s: f64,
    /// From the RPC's return to the end of the first interval that, with the one after it, was
    /// within [`TOLERANCE`] of `to` (an upper bound: the interval's length is the resolution).
    pub effect_s: Option<f64>,
    /// Mean rate from then until the next change (or the end), against `to`: `mean / to - 1`.
    pub held_deviation: Option<f64>,
}

/// The changes of a run from its events: the first event (before the window) is the starting
/// limit.
pub fn changes(run: &BenchReport, events: &[Event]) -> Vec<Change> {
    let Some(tl) = &run.timeline else {
        return Vec::new();
    };
    let evs: Vec<(f64, u64)> = events
        .iter()
        .filter_map(|e| Some((e.unix_s - tl.start_unix_s, e.rw_ios_per_sec?)))
        .collect();
    let mut out = Vec::new();
    for (i, w) in evs.windows(2).enumerate() {
        let ((_, from), (at, to)) = (w[0], w[1]);
        let until = evs.get(i + 2).map_or(f64::INFINITY, |e| e.0);
        let after: Vec<_> = tl
            .samples
            .iter()
            .filter(|s| s.t_s - s.len_s >= at - 1e-3 && s.t_s <= until + 1e-3)
            .collect();
        let ok = |iops: f64| (iops / to as f64 - 1.0).abs() <= TOLERANCE;
        let first = (0..after.len())
            .find(|&k| ok(after[k].iops) && after.get(k + 1).is_none_or(|n| ok(n.iops)));
        let effect_s = first.map(|k| after[k].t_s - at);
        let held_deviation = first.and_then(|k| {
            let rest = &after[k..];
            let len: f64 = rest.iter().map(|s| s.len_s).sum();
            let ios: u64 = rest.iter().map(|s| s.ios).sum();
            (len > 0.0).then(|| ios as f64 / len / to as f64 - 1.0)
        });
        out.push(Change {
            from,
            to,
            at_s: at,
            effect_s,
            held_deviation,
        });
    }
    out
}

/// Two volumes busy at once, the first limited in the second phase.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Neighbour {
    /// The free volume's IOPS and p99 (µs) with the other idle, if measured.
    pub alone: Option<(f64, f64)>,
    /// The free volume's IOPS while the other was unlimited, and while it was limited.
    pub free_iops: (f64, f64),
    /// The free volume's p99 (µs) in the same two phases.
    pub free_p99_us: (f64, f64),
    /// The limited volume's IOPS in the two phases, and its limit.
    pub limited_iops: (f64, f64),
    /// The limit.
    pub limit: f64,
    /// Rounds of the two phases (medians of them above).
    pub rounds: usize,
    /// `free_iops.1 / free_iops.0`.
    pub iops_ratio: f64,
    /// `free_p99_us.1 / free_p99_us.0`.
    pub p99_ratio: f64,
    /// The free one kept at least (1 - TOLERANCE) of its IOPS and a p99 no worse than
    /// (1 + TOLERANCE) of before, and the limited one held its limit.
    pub unharmed: bool,
}

/// The neighbour scenario from its runs (`alone`: the free volume with the other idle; each
/// phase's runs are rounds, and the medians count).
pub fn neighbour(
    alone: Option<&BenchReport>,
    free_m0: &[&BenchReport],
    free_m1: &[&BenchReport],
    lim_m0: &[&BenchReport],
    lim_m1: &[&BenchReport],
    limit: f64,
) -> Neighbour {
    let p99 = |r: &BenchReport| r.total.total.lat.p99_ns as f64 / 1e3;
    let iops = |r: &BenchReport| r.total.total.iops;
    let med = |rs: &[&BenchReport], f: &dyn Fn(&BenchReport) -> f64| {
        let mut v: Vec<f64> = rs.iter().map(|r| f(r)).collect();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    };
    let free_iops = (med(free_m1, &iops), med(lim_m1, &iops));
    let free_p99_us = (med(free_m1, &p99), med(lim_m1, &p99));
    let limited_iops = (med(free_m0, &iops), med(lim_m0, &iops));
    let iops_ratio = free_iops.1 / free_iops.0;
    let p99_ratio = free_p99_us.1 / free_p99_us.0;
    Neighbour {
        alone: alone.map(|r| (r.total.total.iops, p99(r))),
        free_iops,
        free_p99_us,
        limited_iops,
        limit,
        rounds: free_m1.len().min(lim_m1.len()),
        iops_ratio,
        p99_ratio,
        unharmed: iops_ratio >= 1.0 - TOLERANCE
            && p99_ratio <= 1.0 + TOLERANCE
            && (limited_iops.1 / limit - 1.0).abs() <= TOLERANCE,
    }
}

/// Volumes sharing one group limit.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Group {
    /// The group's limit (I/Os per second).
    pub limit: f64,
    /// Each member's IOPS with all of them busy.
    pub members: Vec<(String, f64)>,
    /// Their sum.
    pub sum: f64,
    /// `sum / limit - 1`.
    pub deviation: f64,
    /// The largest `|second / limit - 1|` of the members' summed one-second windows.
    pub worst_second: f64,
    /// One member busy alone: its IOPS (it may use the whole budget).
    pub alone: f64,
    /// Sum and alone within [`TOLERANCE`] of the limit.
    pub within: bool,
}

/// The group scenario from the members' runs (busy together) and one member's run alone.
pub fn group(members: &[(String, &BenchReport)], alone: &BenchReport, limit: f64) -> Group {
    let sum: f64 = members.iter().map(|(_, r)| r.total.total.iops).sum();
    let per_second: Vec<Vec<f64>> = members
        .iter()
        .filter_map(|(_, r)| r.timeline.as_ref().map(|t| windows(t, 1.0, false)))
        .collect();
    let n = per_second.iter().map(Vec::len).min().unwrap_or(0);
    // The members start a moment apart: leave out the first and last second.
    let worst_second = (1..n.saturating_sub(1))
        .map(|i| per_second.iter().map(|w| w[i]).sum::<f64>())
        .map(|s| (s / limit - 1.0).abs())
        .fold(0.0, f64::max);
    let deviation = sum / limit - 1.0;
    let alone = alone.total.total.iops;
    Group {
        limit,
        members: members
            .iter()
            .map(|(n, r)| (n.clone(), r.total.total.iops))
            .collect(),
        sum,
        deviation,
        worst_second,
        alone,
        within: deviation.abs() <= TOLERANCE && (alone / limit - 1.0).abs() <= TOLERANCE,
    }
}

/// Everything one server did in the benchmark.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ServerResults {
    /// `hold-4k`.
    pub hold_4k: Option<Hold>,
    /// `hold-128k` (bytes per second).
    pub hold_128k: Option<Hold>,
    /// `change`.
    pub changes: Vec<Change>,
    /// `neighbour`.
    pub neighbour: Option<Neighbour>,
    /// `group`.
    pub group: Option<Group>,
    /// `idle`: server CPU % with the limited controllers and one idle client, and their number.
    pub idle_cpu_pct: Option<(f64, u64)>,
}

/// The limits the script was run with.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Limits {
    /// hold-4k's `rw_ios_per_sec`.
    pub hold_iops: f64,
    /// hold-128k's `rw_mbytes_per_sec` (MiB/s, as SPDK's).
    pub hold_mbps: f64,
    /// neighbour's limit.
    pub neigh_iops: f64,
    /// group's limit.
    pub group_iops: f64,
}

/// Reports of one run, by server, scenario and run name.
pub type Runs<'a> = BTreeMap<(String, String, String), &'a BenchReport>;

/// Indexes reports by their `server`, `scenario` and `run` tags.
pub fn index(reports: &[BenchReport]) -> Runs<'_> {
    reports
        .iter()
        .filter_map(|r| {
            let m = &r.params.meta;
            Some((
                (
                    m.get("server")?.clone(),
                    m.get("scenario")?.clone(),
                    m.get("run")?.clone(),
                ),
                r,
            ))
        })
        .collect()
}

/// Results per server; `events(server, scenario)` gives that scenario's events.
pub fn analyse(
    runs: &Runs<'_>,
    limits: &Limits,
    events: &dyn Fn(&str, &str) -> Vec<Event>,
) -> BTreeMap<String, ServerResults> {
    let servers: std::collections::BTreeSet<&String> = runs.keys().map(|k| &k.0).collect();
    let mut out = BTreeMap::new();
    for server in servers {
        let get = |scen: &str, run: &str| {
            runs.get(&(server.clone(), scen.to_string(), run.to_string()))
                .copied()
        };
        let mut r = ServerResults::default();
        if let (Some(f), Some(l)) = (get("hold-4k", "free"), get("hold-4k", "limited")) {
            r.hold_4k = Some(hold(f, l, limits.hold_iops, false));
        }
        if let (Some(f), Some(l)) = (get("hold-128k", "free"), get("hold-128k", "limited")) {
            r.hold_128k = Some(hold(f, l, limits.hold_mbps * 1048576.0, true));
        }
        if let Some(l) = get("change", "limited") {
            r.changes = changes(l, &events(server, "change"));
        }
        let rounds = |prefix: &str| -> Vec<&BenchReport> {
            runs.range((server.clone(), "neighbour".to_string(), String::new())..)
                .take_while(|(k, _)| k.0 == *server && k.1 == "neighbour")
                .filter(|(k, _)| k.2 == prefix || k.2.starts_with(&format!("{prefix}-r")))
                .map(|(_, r)| *r)
                .collect()
        };
        let (a, b, c, d) = (
            rounds("free-m0"),
            rounds("free-m1"),
            rounds("limited-m0"),
            rounds("limited-m1"),
        );
        if !(a.is_empty() || b.is_empty() || c.is_empty() || d.is_empty()) {
            r.neighbour = Some(neighbour(
                get("neighbour", "alone-m1"),
                &a,
                &b,
                &c,
                &d,
                limits.neigh_iops,
            ));
        }
        let members: Vec<(String, &BenchReport)> = ["m0", "m1", "m2"]
            .iter()
            .filter_map(|m| Some((m.to_string(), get("group", &format!("all-{m}"))?)))
            .collect();
        if let (3, Some(alone)) = (members.len(), get("group", "alone-m0")) {
            r.group = Some(group(&members, alone, limits.group_iops));
        }
        if let Some(i) = get("idle", "idle") {
            let n = i
                .params
                .meta
                .get("controllers")
                .and_then(|c| c.parse().ok())
                .unwrap_or(0);
            r.idle_cpu_pct = i.server_cpu.as_ref().map(|c| (c.percent, n));
        }
        out.insert(server.clone(), r);
    }
    out
}

fn pct(x: f64) -> String {
    format!("{:+.1} %", x * 100.0)
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "**no**"
    }
}

fn rate(v: f64, bytes: bool) -> String {
    if bytes {
        format!("{:.1} MiB/s", v / 1048576.0)
    } else {
        format!("{:.0}", v)
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "n/a".into(),
    }
}

/// The summary as Markdown: a section per scenario, a column per server, and where both
/// katablk-target (`target`) and SPDK's vhost (`spdk`) ran, target/spdk.
pub fn to_markdown(name: &str, results: &BTreeMap<String, ServerResults>) -> String {
    let mut o = String::new();
    let servers: Vec<&String> = results.keys().collect();
    let _ = writeln!(o, "# Rate limits on the vhost-user path: {name}\n");
    let _ = writeln!(
        o,
        "Within = mean and every one-second window within ±{:.0} % of the limit, while the same \
         client unlimited does more. IOPS from the client (libblkio, 4k randread QD32 or 128k read \
         QD8); p99 in µs.\n",
        TOLERANCE * 100.0
    );
    for (title, bytes, get) in [
        (
            "hold-4k: rw_ios_per_sec",
            false,
            (|r: &ServerResults| r.hold_4k.clone()) as fn(&ServerResults) -> Option<Hold>,
        ),
        ("hold-128k: rw_mbytes_per_sec", true, |r: &ServerResults| {
            r.hold_128k.clone()
        }),
    ] {
        let _ = writeln!(o, "## {title}\n");
        let _ = writeln!(
            o,
            "| server | limit | unlimited | limited mean | deviation | worst second | seconds | p99 | within |"
        );
        let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---:|---:|---|");
        for s in &servers {
            if let Some(h) = get(&results[*s]) {
                let _ = writeln!(
                    o,
                    "| {s} | {} | {} | {} | {} | {} | {} | {:.0} | {} |",
                    rate(h.limit, bytes),
                    rate(h.free, bytes),
                    rate(h.mean, bytes),
                    pct(h.deviation),
                    pct(h.worst_second),
                    h.seconds,
                    h.p99_us,
                    yes(h.within)
                );
            }
        }
        o.push('\n');
    }
    let _ = writeln!(
        o,
        "## change: rw_ios_per_sec changed while the client runs\n"
    );
    let _ = writeln!(
        o,
        "Effect = from the RPC's return to the end of the first interval that, with the next, \
         is within ±{:.0} % of the new limit (interval resolution).\n",
        TOLERANCE * 100.0
    );
    let _ = writeln!(
        o,
        "| server | change | at | effect | held after (mean vs limit) | within 1 s |"
    );
    let _ = writeln!(o, "|---|---|---:|---:|---:|---|");
    for s in &servers {
        for c in &results[*s].changes {
            let _ = writeln!(
                o,
                "| {s} | {} → {} | {:.2} s | {} | {} | {} |",
                c.from,
                c.to,
                c.at_s,
                c.effect_s.map_or("never".into(), |e| format!("{:.2} s", e)),
                c.held_deviation.map_or("n/a".into(), pct),
                yes(c.effect_s.is_some_and(|e| e <= 1.0)
                    && c.held_deviation.is_some_and(|d| d.abs() <= TOLERANCE))
            );
        }
    }
    o.push('\n');
    let _ = writeln!(
        o,
        "## neighbour: a free volume at QD1 beside one pushing QD32, unlimited, then limited\n"
    );
    let _ = writeln!(
        o,
        "Medians of the rounds (phases alternate). Unharmed = with the other limited, the free \
         volume keeps ≥ 95 % of the IOPS and ≤ 105 % of the p99 it had beside the unlimited \
         other (and the limited one holds its limit).\n"
    );
    let _ = writeln!(
        o,
        "| server | free volume alone: IOPS, p99 | free volume IOPS (other unlimited → limited) | its p99 | other volume IOPS | limit | IOPS ratio | p99 ratio | rounds | unharmed |"
    );
    let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for s in &servers {
        if let Some(n) = &results[*s].neighbour {
            let _ = writeln!(
                o,
                "| {s} | {} | {:.0} → {:.0} | {:.0} → {:.0} | {:.0} → {:.0} | {:.0} | {:.2} | {:.2} | {} | {} |",
                n.alone
                    .map_or("n/a".into(), |(i, p)| format!("{i:.0}, {p:.0} µs")),
                n.free_iops.0,
                n.free_iops.1,
                n.free_p99_us.0,
                n.free_p99_us.1,
                n.limited_iops.0,
                n.limited_iops.1,
                n.limit,
                n.iops_ratio,
                n.p99_ratio,
                n.rounds,
                yes(n.unharmed)
            );
        }
    }
    o.push('\n');
    let _ = writeln!(
        o,
        "## group: three volumes in one katablk_set_qos_group (katablk's extension; SPDK has none)\n"
    );
    let _ = writeln!(
        o,
        "| server | limit | members (all busy) | sum | deviation | worst second | one alone | within |"
    );
    let _ = writeln!(o, "|---|---:|---|---:|---:|---:|---:|---|");
    for s in &servers {
        if let Some(g) = &results[*s].group {
            let m: Vec<String> = g
                .members
                .iter()
                .map(|(n, v)| format!("{n} {v:.0}"))
                .collect();
            let _ = writeln!(
                o,
                "| {s} | {:.0} | {} | {:.0} | {} | {} | {:.0} | {} |",
                g.limit,
                m.join(", "),
                g.sum,
                pct(g.deviation),
                pct(g.worst_second),
                g.alone,
                yes(g.within)
            );
        }
    }
    o.push('\n');
    let _ = writeln!(
        o,
        "## idle: limited controllers, one idle client connected\n"
    );
    let _ = writeln!(o, "| server | controllers | server CPU |");
    let _ = writeln!(o, "|---|---:|---:|");
    for s in &servers {
        if let Some((c, n)) = results[*s].idle_cpu_pct {
            let _ = writeln!(o, "| {s} | {n} | {c:.1} % |");
        }
    }
    o.push('\n');
    if let (Some(t), Some(p)) = (results.get("target"), results.get("spdk")) {
        let _ = writeln!(
            o,
            "## katablk-target / SPDK vhost, same limits, same run\n\n| measure | target | spdk | target/spdk |\n|---|---:|---:|---:|"
        );
        let row = |o: &mut String,
                   what: &str,
                   a: Option<f64>,
                   b: Option<f64>,
                   f: &dyn Fn(f64) -> String| {
            let _ = writeln!(
                o,
                "| {what} | {} | {} | {} |",
                a.map_or("n/a".into(), f),
                b.map_or("n/a".into(), f),
                ratio(a, b)
            );
        };
        let n0 = |v: f64| format!("{v:.0}");
        let n1 = |v: f64| format!("{v:.1}");
        let d = |v: f64| format!("{:.2} %", v * 100.0);
        row(
            &mut o,
            "hold-4k limited IOPS",
            t.hold_4k.as_ref().map(|h| h.mean),
            p.hold_4k.as_ref().map(|h| h.mean),
            &n0,
        );
        row(
            &mut o,
            "hold-4k worst second |dev|",
            t.hold_4k.as_ref().map(|h| h.worst_second),
            p.hold_4k.as_ref().map(|h| h.worst_second),
            &d,
        );
        row(
            &mut o,
            "hold-4k p99 µs",
            t.hold_4k.as_ref().map(|h| h.p99_us),
            p.hold_4k.as_ref().map(|h| h.p99_us),
            &n0,
        );
        row(
            &mut o,
            "hold-128k limited MiB/s",
            t.hold_128k.as_ref().map(|h| h.mean / 1048576.0),
            p.hold_128k.as_ref().map(|h| h.mean / 1048576.0),
            &n1,
        );
        row(
            &mut o,
            "hold-128k worst second |dev|",
            t.hold_128k.as_ref().map(|h| h.worst_second),
            p.hold_128k.as_ref().map(|h| h.worst_second),
            &d,
        );
        let worst_effect = |r: &ServerResults| {
            r.changes
                .iter()
                .map(|c| c.effect_s.unwrap_or(f64::INFINITY))
                .reduce(f64::max)
        };
        row(
            &mut o,
            "change: slowest effect, s",
            worst_effect(t),
            worst_effect(p),
            &|v| format!("{v:.2}"),
        );
        row(
            &mut o,
            "neighbour: free volume IOPS (other limited)",
            t.neighbour.as_ref().map(|n| n.free_iops.1),
            p.neighbour.as_ref().map(|n| n.free_iops.1),
            &n0,
        );
        row(
            &mut o,
            "neighbour: free volume p99 µs (other limited)",
            t.neighbour.as_ref().map(|n| n.free_p99_us.1),
            p.neighbour.as_ref().map(|n| n.free_p99_us.1),
            &n0,
        );
        row(
            &mut o,
            "idle server CPU %",
            t.idle_cpu_pct.map(|c| c.0),
            p.idle_cpu_pct.map(|c| c.0),
            &n1,
        );
        o.push('\n');
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::TimelineSample;

    fn report(iops: f64, samples: &[f64], len: f64) -> BenchReport {
        let mut r: BenchReport =
            serde_json::from_str(include_str!("../tests/data/qos-report.json")).unwrap();
        r.total.total.iops = iops;
        r.total.total.bytes_per_sec = iops * 4096.0;
        let mut t = 0.0;
        r.timeline = Some(Timeline {
            start_unix_s: 1000.0,
            interval_s: len,
            samples: samples
                .iter()
                .map(|&v| {
                    t += len;
                    TimelineSample {
                        t_s: t,
                        len_s: len,
                        ios: (v * len).round() as u64,
                        iops: v,
                        bytes_per_sec: v * 4096.0,
                    }
                })
                .collect(),
        });
        r
    }

    #[test]
    fn events_parse_the_limit() {
        let e = parse_events(
            "1000.5 m0 \"rw_ios_per_sec\": 5000\n1001 m0 \"rw_mbytes_per_sec\": 20\njunk\n",
        );
        assert_eq!(e.len(), 2);
        assert_eq!((e[0].unix_s, e[0].rw_ios_per_sec), (1000.5, Some(5000)));
        assert_eq!(e[1].rw_ios_per_sec, None);
    }

    #[test]
    fn hold_checks_mean_and_every_second() {
        let free = report(100_000.0, &[], 0.1);
        let good = report(20_100.0, &[20_100.0; 30], 0.1);
        let h = hold(&free, &good, 20_000.0, false);
        assert_eq!(h.seconds, 3);
        assert!(h.within && (h.deviation - 0.005).abs() < 1e-9, "{h:?}");
        // A burst in one second breaks it even with a fine mean.
        let mut s = vec![19_000.0; 10];
        s.extend([23_000.0; 10]);
        s.extend([18_000.0; 10]);
        let h = hold(&free, &report(20_000.0, &s, 0.1), 20_000.0, false);
        assert!(!h.within && (h.worst_second - 0.15).abs() < 1e-9, "{h:?}");
        // A client that cannot push past the limit proves nothing.
        let h = hold(&report(20_500.0, &[], 0.1), &good, 20_000.0, false);
        assert!(!h.within);
    }

    #[test]
    fn change_effect_is_the_first_settled_interval() {
        // 10 samples of 100 ms at 20k, then 5k from the 3rd interval after the change at 1.0 s.
        let mut s = vec![20_000.0; 10];
        s.extend([15_000.0, 8_000.0, 5_000.0, 5_050.0, 4_990.0, 5_000.0]);
        let r = report(0.0, &s, 0.1);
        let ev = [
            Event {
                unix_s: 999.0,
                target: "m0".into(),
                rw_ios_per_sec: Some(20_000),
            },
            Event {
                unix_s: 1001.0,
                target: "m0".into(),
                rw_ios_per_sec: Some(5_000),
            },
        ];
        let c = changes(&r, &ev);
        assert_eq!(c.len(), 1);
        assert_eq!((c[0].from, c[0].to), (20_000, 5_000));
        assert!((c[0].at_s - 1.0).abs() < 1e-9);
        assert!((c[0].effect_s.unwrap() - 0.3).abs() < 1e-6, "{c:?}");
        assert!(c[0].held_deviation.unwrap().abs() < 0.01);
    }

    #[test]
    fn neighbour_and_group_verdicts() {
        let (f0, f1, l0) = (
            report(90_000.0, &[], 0.1),
            report(90_000.0, &[], 0.1),
            report(10_000.0, &[], 0.1),
        );
        let (a, b, c) = (
            report(120_000.0, &[], 0.1),
            report(10.0, &[], 0.1),
            report(121_000.0, &[], 0.1),
        );
        let n = neighbour(None, &[&f0], &[&f1], &[&l0], &[&a, &b, &c], 10_000.0);
        assert!(n.unharmed && n.iops_ratio > 1.3, "medians: {n:?}");
        let m = report(10_000.0, &[10_000.0; 40], 0.1);
        let g = group(
            &[("m0".into(), &m), ("m1".into(), &m), ("m2".into(), &m)],
            &report(29_900.0, &[], 0.1),
            30_000.0,
        );
        assert!(
            g.within && g.deviation.abs() < 1e-9 && g.worst_second < 1e-9,
            "{g:?}"
        );
    }
}
