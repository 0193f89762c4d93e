//! `katablk-bench-qos`: reads a run of `scripts/bench-qos.sh` (its `raw/` directory or
//! `raw.tar.gz`) and writes `summary.md`, `summary.json` and timeline charts: `hold.png`
//! (each limited run as % of its limit), `change.png` (IOPS while the limit changes),
//! `neighbour.png` and `group.png`.

use anyhow::{Context, Result};
use clap::Parser;
use katablk_bench::plotting::{load_font, plot_err, FONT};
use katablk_bench::qos::{self, Limits, TOLERANCE};
use katablk_bench::report::BenchReport;
use katablk_bench::stats::format_rate;
use katablk_bench::summary::{read_run, read_run_file};
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Summarise and chart a rate-limit benchmark run (scripts/bench-qos.sh).
#[derive(Debug, Parser)]
#[command(name = "katablk-bench-qos", version)]
struct Args {
    /// The run's directory.
    dir: PathBuf,
    /// hold-4k's rw_ios_per_sec.
    #[arg(long, default_value_t = 20000.0)]
    hold_iops: f64,
    /// hold-128k's rw_mbytes_per_sec (MiB/s).
    #[arg(long, default_value_t = 200.0)]
    hold_mbps: f64,
    /// The change scenario's limits, in order (for the chart's steps; the verdicts read the
    /// events file).
    #[arg(long, default_value = "20000 5000 40000")]
    change_iops: String,
    /// neighbour's limit on the first volume.
    #[arg(long, default_value_t = 10000.0)]
    neigh_iops: f64,
    /// group's limit.
    #[arg(long, default_value_t = 30000.0)]
    group_iops: f64,
    /// TrueType font for the charts (default: DejaVu Sans from fonts-dejavu-core).
    #[arg(long, env = "KATABLK_BENCH_FONT")]
    font: Option<PathBuf>,
    /// Write only summary.md and summary.json.
    #[arg(long)]
    no_plots: bool,
}

fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 6] = [
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(255, 127, 14),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
    ];
    C[i % C.len()]
}

/// One line of a chart: legend name and (seconds, value) points.
struct Line {
    name: String,
    points: Vec<(f64, f64)>,
}

/// One panel: a title, a y axis, lines and horizontal reference values (dashed).
struct Panel {
    title: String,
    y_desc: String,
    lines: Vec<Line>,
    refs: Vec<f64>,
}

fn draw(path: &Path, title: &str, panels: &[Panel]) -> Result<()> {
    let (w, ph) = (1200u32, 380u32);
    let h = 50 + ph * panels.len().max(1) as u32;
    let root = BitMapBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (head, body) = root.split_vertically(50);
    head.titled(title, (FONT, 24)).map_err(plot_err)?;
    for (area, p) in body
        .split_evenly((panels.len().max(1), 1))
        .iter()
        .zip(panels)
    {
        let x_max = p
            .lines
            .iter()
            .flat_map(|l| l.points.iter().map(|q| q.0))
            .fold(1.0f64, f64::max);
        let y_max = p
            .lines
            .iter()
            .flat_map(|l| l.points.iter().map(|q| q.1))
            .chain(p.refs.iter().copied())
            .fold(1.0f64, f64::max)
            * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(&p.title, (FONT, 18))
            .margin(10)
            .margin_right(24)
            .x_label_area_size(36)
            .y_label_area_size(80)
            .build_cartesian_2d(0f64..x_max, 0f64..y_max)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc("seconds into the measured window")
            .y_desc(p.y_desc.as_str())
            .y_label_formatter(&|v| format_rate(*v))
            .label_style((FONT, 13))
            .axis_desc_style((FONT, 14))
            .max_light_lines(1)
            .draw()
            .map_err(plot_err)?;
        for r in &p.refs {
            let r = *r;
            chart
                .draw_series(DashedLineSeries::new(
                    [(0.0, r), (x_max, r)],
                    6,
                    4,
                    BLACK.mix(0.5).stroke_width(1),
                ))
                .map_err(plot_err)?;
        }
        for (i, l) in p.lines.iter().enumerate() {
            let c = color(i);
            chart
                .draw_series(LineSeries::new(l.points.iter().copied(), c.stroke_width(2)))
                .map_err(plot_err)?
                .label(l.name.clone())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], c.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font((FONT, 13))
            .draw()
            .map_err(plot_err)?;
    }
    root.present().map_err(plot_err)?;
    Ok(())
}

fn points(
    r: &BenchReport,
    f: impl Fn(&katablk_bench::report::TimelineSample) -> f64,
) -> Vec<(f64, f64)> {
    r.timeline
        .as_ref()
        .map(|t| t.samples.iter().map(|s| (s.t_s, f(s))).collect())
        .unwrap_or_default()
}

fn run(a: &Args) -> Result<()> {
    let reports = read_run(&a.dir)?;
    let runs = qos::index(&reports);
    anyhow::ensure!(
        !runs.is_empty(),
        "no bench-qos reports (tagged server/scenario/run) in {}",
        a.dir.display()
    );
    let limits = Limits {
        hold_iops: a.hold_iops,
        hold_mbps: a.hold_mbps,
        neigh_iops: a.neigh_iops,
        group_iops: a.group_iops,
    };
    let dir = a.dir.clone();
    let events = move |server: &str, scen: &str| {
        read_run_file(&dir, &format!("{server}-{scen}.events"))
            .ok()
            .flatten()
            .map(|b| qos::parse_events(&String::from_utf8_lossy(&b)))
            .unwrap_or_default()
    };
    let results = qos::analyse(&runs, &limits, &events);
    let name = a
        .dir
        .file_name()
        .map_or("run".into(), |n| n.to_string_lossy().into_owned());
    let mut md = qos::to_markdown(&name, &results);
    if !a.no_plots {
        md.push_str(
            "Charts: `hold.png` (each limited run per 100 ms interval, as % of its limit; \
             dashed: ±5 %), `change.png`, `neighbour.png`, `group.png`.\n",
        );
    }
    std::fs::write(a.dir.join("summary.md"), &md).context("writing summary.md")?;
    let json = serde_json::to_string_pretty(&serde_json::json!({
        "name": name,
        "tolerance": TOLERANCE,
        "limits": limits,
        "servers": results,
    }))?;
    std::fs::write(a.dir.join("summary.json"), json + "\n").context("writing summary.json")?;
    print!("{md}");
    if a.no_plots {
        return Ok(());
    }
    load_font(a.font.as_deref())?;
    let servers: Vec<String> = results.keys().cloned().collect();
    let get = |s: &str, scen: &str, run: &str| {
        runs.get(&(s.to_string(), scen.to_string(), run.to_string()))
            .copied()
    };
    // hold.png: % of the limit.
    let mut panels = Vec::new();
    for (scen, limit, bytes) in [
        ("hold-4k", a.hold_iops, false),
        ("hold-128k", a.hold_mbps * 1048576.0, true),
    ] {
        let lines = servers
            .iter()
            .filter_map(|s| {
                let r = get(s, scen, "limited")?;
                Some(Line {
                    name: s.clone(),
                    points: points(r, |x| {
                        100.0 * if bytes { x.bytes_per_sec } else { x.iops } / limit
                    }),
                })
            })
            .collect();
        panels.push(Panel {
            title: format!(
                "{scen}: limit {}",
                if bytes {
                    format!("{} MiB/s", a.hold_mbps)
                } else {
                    format!("{} IOPS", a.hold_iops)
                }
            ),
            y_desc: "% of the limit".into(),
            lines,
            refs: vec![95.0, 105.0],
        });
    }
    draw(
        &a.dir.join("hold.png"),
        "A limited volume holds its limit",
        &panels,
    )?;
    // change.png
    let lines: Vec<Line> = servers
        .iter()
        .filter_map(|s| {
            Some(Line {
                name: s.clone(),
                points: points(get(s, "change", "limited")?, |x| x.iops),
            })
        })
        .collect();
    let refs = a
        .change_iops
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    draw(
        &a.dir.join("change.png"),
        "rw_ios_per_sec changed while the client runs",
        &[Panel {
            title: format!("limits {} (dashed)", a.change_iops),
            y_desc: "IOPS".into(),
            lines,
            refs,
        }],
    )?;
    // neighbour.png: a panel per server.
    let panels: Vec<Panel> = servers
        .iter()
        .filter_map(|s| {
            let mut lines = Vec::new();
            for (run, label) in [
                ("alone-m1", "free volume (QD1), other idle"),
                ("free-m1-r1", "free volume, other unlimited"),
                ("limited-m1-r1", "free volume, other limited"),
                ("free-m0-r1", "other volume, unlimited"),
                ("limited-m0-r1", "other volume, limited"),
            ] {
                lines.push(Line {
                    name: label.into(),
                    points: points(get(s, "neighbour", run)?, |x| x.iops),
                });
            }
            Some(Panel {
                title: format!(
                    "{s}: limit {} IOPS on the other volume (round 1)",
                    a.neigh_iops
                ),
                y_desc: "IOPS".into(),
                lines,
                refs: vec![a.neigh_iops],
            })
        })
        .collect();
    if !panels.is_empty() {
        draw(
            &a.dir.join("neighbour.png"),
            "Two volumes, one limited",
            &panels,
        )?;
    }
    // group.png
    let panels: Vec<Panel> = servers
        .iter()
        .filter_map(|s| {
            let mut lines = Vec::new();
            let mut sum: Vec<(f64, f64)> = Vec::new();
            for m in ["m0", "m1", "m2"] {
                let p = points(get(s, "group", &format!("all-{m}"))?, |x| x.iops);
                for (i, q) in p.iter().enumerate() {
                    match sum.get_mut(i) {
                        Some(e) => e.1 += q.1,
                        None => sum.push(*q),
                    }
                }
                lines.push(Line {
                    name: m.into(),
                    points: p,
                });
            }
            lines.push(Line {
                name: "sum".into(),
                points: sum,
            });
            Some(Panel {
                title: format!("{s}: group limit {} IOPS", a.group_iops),
                y_desc: "IOPS".into(),
                lines,
                refs: vec![a.group_iops],
            })
        })
        .collect();
    if !panels.is_empty() {
        draw(
            &a.dir.join("group.png"),
            "Three volumes share one group budget",
            &panels,
        )?;
    }
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("katablk-bench-qos: {e:#}");
            ExitCode::FAILURE
        }
    }
}
