//! `katablk-bench`: a fio-like load generator for vhost-user-blk servers.

use anyhow::Result;
use clap::Parser;
use katablk_bench::cli::BenchArgs;
use katablk_bench::engine;
use std::process::ExitCode;
use tracing_subscriber::EnvFilter;

fn run(args: &BenchArgs) -> Result<()> {
    let report = engine::run(&args.to_config())?;
    if !args.quiet {
        print!("{}", report.to_text());
    }
    if let Some(path) = &args.json {
        report.write_json(path)?;
        if args.quiet {
            println!("{}", path.display());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = BenchArgs::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line with the whole context chain, no backtrace: these are user errors.
            eprintln!("katablk-bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
