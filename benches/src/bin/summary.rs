//! `katablk-bench-summary`: aggregates the raw JSON results of a comparison run into
//! `summary.json` and `summary.md` (median over rounds, candidate/baseline ratios).

use anyhow::{bail, Result};
use clap::Parser;
use katablk_bench::summary;
use std::path::PathBuf;
use std::process::ExitCode;

/// Aggregate katablk-bench JSON results (median per case/workload/server, ratios).
#[derive(Debug, Parser)]
#[command(name = "katablk-bench-summary", version)]
struct Args {
    /// Results directory: raw reports are read from DIR/raw, else from the archive
    /// DIR/raw.tar.gz (committed runs), else from DIR itself.
    dir: PathBuf,
    /// Server the ratios are relative to (denominator).
    #[arg(long, default_value = "qsd")]
    baseline: String,
    /// Server divided by the baseline (numerator).
    #[arg(long, default_value = "katablk")]
    candidate: String,
    /// File stem of the outputs in DIR: STEM.json and STEM.md (e.g. summary-vs-chvub for a
    /// second summary over another baseline).
    #[arg(long, default_value = "summary")]
    output: String,
    /// Extra note to record in the summary (repeatable).
    #[arg(long)]
    note: Vec<String>,
}

fn run(args: &Args) -> Result<()> {
    let reports = summary::read_run(&args.dir)?;
    if reports.is_empty() {
        bail!("no katablk-bench JSON reports in {}", args.dir.display());
    }
    let name = args
        .dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "results".to_string());
    let mut s = summary::build(&name, &reports, &args.baseline, &args.candidate);
    s.notes.extend(args.note.iter().cloned());
    let json = args.dir.join(format!("{}.json", args.output));
    let md = args.dir.join(format!("{}.md", args.output));
    s.write_json(&json)?;
    std::fs::write(&md, s.to_markdown())?;
    println!(
        "{} reports -> {} and {}",
        reports.len(),
        json.display(),
        md.display()
    );
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("katablk-bench-summary: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
