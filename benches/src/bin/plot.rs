//! `katablk-bench-plot`: draws PNG bar charts from a `summary.json` written by
//! `katablk-bench-summary`: IOPS, latency (p50/p99) and server CPU per workload, bars
//! grouped by server, one panel per case.
//!
//! Text is rendered with a TrueType font loaded at run time (plotters' `ab_glyph` backend,
//! no system font lookup): by default DejaVu Sans from Debian's `fonts-dejavu-core`.

use anyhow::{bail, Context, Result};
use clap::Parser;
use katablk_bench::plotting::{load_font, plot_err, FONT};
use katablk_bench::stats::format_rate;
use katablk_bench::summary::Summary;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Draw PNG bar charts (IOPS, latency, CPU) from a benchmark summary.json.
#[derive(Debug, Parser)]
#[command(name = "katablk-bench-plot", version)]
struct Args {
    /// summary.json written by katablk-bench-summary.
    summary: PathBuf,
    /// Directory for the PNG files (default: the summary's directory).
    #[arg(long)]
    out: Option<PathBuf>,
    /// TrueType font for all text (default: DejaVu Sans from fonts-dejavu-core).
    #[arg(long, env = "KATABLK_BENCH_FONT")]
    font: Option<PathBuf>,
}

/// A fixed colour for each server the scripts know, so that every run's charts match and no
/// two of them share one; others (qsd2, target-b, ...) take the rest in turn.
fn server_color(idx: usize, name: &str) -> RGBColor {
    match name {
        "katablk" => RGBColor(31, 119, 180),
        "qsd" => RGBColor(255, 127, 14),
        "spdk" => RGBColor(44, 160, 44),
        "kspdk" => RGBColor(214, 39, 40),
        "target" => RGBColor(148, 103, 189),
        "chvub" => RGBColor(140, 86, 75),
        _ => {
            const OTHERS: [RGBColor; 4] = [
                RGBColor(227, 119, 194),
                RGBColor(127, 127, 127),
                RGBColor(188, 189, 34),
                RGBColor(23, 190, 207),
            ];
            OTHERS[idx % OTHERS.len()]
        }
    }
}

/// Value of a series in (case, group), if measured.
type ValueFn<'a> = Box<dyn Fn(&str, &str) -> Option<f64> + 'a>;

/// One bar series: a name for the legend, a colour and its value in (case, group).
struct Series<'a> {
    name: String,
    color: RGBColor,
    value: ValueFn<'a>,
}

/// Draws one PNG with a panel per case; in each, a group of bars per entry of `groups`.
fn grouped_bars(
    path: &Path,
    title: &str,
    y_desc: &str,
    cases: &[String],
    groups: &[String],
    series: &[Series],
    fmt: &dyn Fn(f64) -> String,
) -> Result<()> {
    let panel_h = 430u32;
    let width = 1400u32;
    let height = 60 + panel_h * cases.len().max(1) as u32;
    let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (head, body) = root.split_vertically(60);
    head.draw(&Text::new(
        title.to_string(),
        (width as i32 / 2, 30),
        TextStyle::from((FONT, 26).into_font()).pos(Pos::new(HPos::Center, VPos::Center)),
    ))
    .map_err(plot_err)?;
    let panels = body.split_evenly((cases.len().max(1), 1));
    let n_groups = groups.len().max(1);
    let n_series = series.len().max(1);
    for (panel, case) in panels.iter().zip(cases) {
        let max = groups
            .iter()
            .flat_map(|g| series.iter().filter_map(move |s| (s.value)(case, g)))
            .fold(0.0f64, f64::max);
        // Headroom for the value labels and the legend (upper right).
        let headroom = 1.15 + 0.08 * n_series as f64;
        let y_max = if max > 0.0 { max * headroom } else { 1.0 };
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("case: {case}"), (FONT, 20))
            .margin(12)
            .margin_right(24)
            .x_label_area_size(36)
            .y_label_area_size(90)
            .build_cartesian_2d(0f64..n_groups as f64, 0f64..y_max)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_labels(8)
            .max_light_lines(1)
            .y_desc(y_desc)
            .y_label_formatter(&|v| fmt(*v))
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15))
            .draw()
            .map_err(plot_err)?;
        let slot = 0.8 / n_series as f64;
        for (si, s) in series.iter().enumerate() {
            let bars: Vec<(f64, f64)> = groups
                .iter()
                .enumerate()
                .filter_map(|(gi, g)| {
                    (s.value)(case, g).map(|v| (gi as f64 + 0.1 + si as f64 * slot, v))
                })
                .collect();
            let color = s.color;
            chart
                .draw_series(
                    bars.iter().map(|&(x, v)| {
                        Rectangle::new([(x, 0.0), (x + slot * 0.9, v)], color.filled())
                    }),
                )
                .map_err(plot_err)?
                .label(s.name.clone())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled())
                });
            chart
                .draw_series(bars.iter().map(|&(x, v)| {
                    Text::new(
                        fmt(v),
                        (x + slot * 0.45, v),
                        TextStyle::from((FONT, 13).into_font())
                            .pos(Pos::new(HPos::Center, VPos::Bottom)),
                    )
                }))
                .map_err(plot_err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font((FONT, 14))
            .draw()
            .map_err(plot_err)?;
        // Group names under the x axis (drawn on the root area, in backend pixels).
        for (gi, g) in groups.iter().enumerate() {
            let (px, py) = chart.backend_coord(&(gi as f64 + 0.5, 0.0));
            root.draw(&Text::new(
                g.clone(),
                (px, py + 8),
                TextStyle::from((FONT, 15).into_font()).pos(Pos::new(HPos::Center, VPos::Top)),
            ))
            .map_err(plot_err)?;
        }
    }
    root.present().map_err(plot_err)?;
    Ok(())
}

fn value_of<'a>(
    s: &'a Summary,
    server: &'a str,
    f: impl Fn(&katablk_bench::summary::Row) -> Option<f64> + 'a,
) -> ValueFn<'a> {
    Box::new(move |case, wl| {
        s.rows
            .iter()
            .find(|r| r.case == case && r.workload == wl && r.server == server)
            .and_then(&f)
            .filter(|v| v.is_finite())
    })
}

fn run(args: &Args) -> Result<()> {
    load_font(args.font.as_deref())?;
    let s = Summary::read_json(&args.summary)?;
    let out = match &args.out {
        Some(o) => o.clone(),
        None => args
            .summary
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from(".")),
    };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    if s.rows.is_empty() {
        bail!("{} has no results to plot", args.summary.display());
    }
    let servers: Vec<(usize, &String)> = s.servers.iter().enumerate().collect();
    let subtitle = |what: &str| format!("{what} — {} (median of rounds)", s.name);

    let iops: Vec<Series> = servers
        .iter()
        .map(|(i, name)| Series {
            name: (*name).clone(),
            color: server_color(*i, name),
            value: value_of(&s, name, |r| Some(r.iops)),
        })
        .collect();
    let p = out.join("iops.png");
    grouped_bars(
        &p,
        &subtitle("IOPS"),
        "IOPS",
        &s.cases,
        &s.workloads,
        &iops,
        &format_rate,
    )?;
    println!("{}", p.display());

    let mut lat = Vec::new();
    for (i, name) in &servers {
        let base = server_color(*i, name);
        lat.push(Series {
            name: format!("{name} p50"),
            color: base,
            value: value_of(&s, name, |r| Some(r.lat_p50_us)),
        });
        lat.push(Series {
            name: format!("{name} p99"),
            color: RGBColor(base.0 / 2 + 127, base.1 / 2 + 127, base.2 / 2 + 127),
            value: value_of(&s, name, |r| Some(r.lat_p99_us)),
        });
    }
    let p = out.join("latency.png");
    let us = |v: f64| {
        if v >= 100.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.1}")
        }
    };
    grouped_bars(
        &p,
        &subtitle("Latency p50 / p99 (µs, lower is better)"),
        "µs",
        &s.cases,
        &s.workloads,
        &lat,
        &us,
    )?;
    println!("{}", p.display());

    let mut groups = s.workloads.clone();
    if !s.idle.is_empty() {
        groups.push("idle".to_string());
    }
    let cpu: Vec<Series> = servers
        .iter()
        .map(|(i, name)| {
            let row = value_of(&s, name, |r| r.server_cpu_pct);
            let idle = &s.idle;
            let name2: &str = name;
            Series {
                name: (*name).clone(),
                color: server_color(*i, name),
                value: Box::new(move |case: &str, g: &str| {
                    if g == "idle" {
                        idle.iter()
                            .find(|r| r.case == case && r.server == name2)
                            .and_then(|r| r.server_cpu_pct)
                    } else {
                        row(case, g)
                    }
                }),
            }
        })
        .collect();
    let p = out.join("cpu.png");
    grouped_bars(
        &p,
        &subtitle("Server CPU (% of one core)"),
        "CPU %",
        &s.cases,
        &groups,
        &cpu,
        &|v| format!("{v:.0}"),
    )?;
    println!("{}", p.display());
    Ok(())
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("katablk-bench-plot: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
