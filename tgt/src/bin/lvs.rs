//! `katablk-lvs`: offline tools for lvstore images and devices: inspect a katablk or SPDK
//! lvstore, import an SPDK lvstore into a new katablk one, export a katablk lvstore as an
//! SPDK one. Run them on stores that no target has open.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use katablk_bdev::file::{FileDevice, FileOptions};
use katablk_bdev::BlockDevice;
use katablk_lvol::spdk::{is_spdk_blobstore, SpdkLvstore};
use katablk_lvol::LvStore;
use serde_json::json;

#[derive(Parser, Debug)]
#[command(
    name = "katablk-lvs",
    version,
    about = "Inspect, import and export lvstores"
)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Print the lvstore on a file or block device (katablk or SPDK format) as JSON.
    Inspect {
        /// Image file or block device.
        path: PathBuf,
    },
    /// Copy an SPDK lvstore into a new katablk lvstore (names, UUIDs, snapshots, clones,
    /// thin provisioning and data kept).
    ImportSpdk {
        /// The SPDK lvstore (only read).
        #[arg(long)]
        from: PathBuf,
        /// The new katablk lvstore: a block device, or a file (created with --size, or the
        /// size of the source, if missing). Its content is overwritten.
        #[arg(long)]
        to: PathBuf,
        /// Size of a new destination file (bytes, or with K/M/G/T suffix).
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
    },
    /// Write a katablk lvstore as an SPDK lvstore that SPDK's lvol module examines.
    ExportSpdk {
        /// The katablk lvstore (opened, then closed cleanly again).
        #[arg(long)]
        from: PathBuf,
        /// The new SPDK lvstore: a block device, or a file (created with --size, or the size
        /// of the source, if missing). Its content is overwritten.
        #[arg(long)]
        to: PathBuf,
        /// Size of a new destination file (bytes, or with K/M/G/T suffix).
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
    },
}

fn parse_size(s: &str) -> Result<u64, String> {
    let (num, mul) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1 << 30),
        Some('t' | 'T') => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| format!("bad size {s:?}"))
}

fn open(path: &Path, read_only: bool) -> Result<Arc<dyn BlockDevice>> {
    let opts = FileOptions {
        read_only,
        ..FileOptions::default()
    };
    let dev =
        FileDevice::open(path, &opts).with_context(|| format!("opening {}", path.display()))?;
    Ok(Arc::new(dev))
}

/// Opens the destination, creating a file of `size` (or `default`) bytes if it is missing.
fn open_dest(path: &Path, size: Option<u64>, default: u64) -> Result<Arc<dyn BlockDevice>> {
    if !path.exists() {
        let f =
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        f.set_len(size.unwrap_or(default))
            .with_context(|| format!("sizing {}", path.display()))?;
    } else if size.is_some() {
        bail!("{} exists: --size is only for new files", path.display());
    }
    open(path, false)
}

fn inspect(path: &Path) -> Result<serde_json::Value> {
    let dev = open(path, true)?;
    if is_spdk_blobstore(&*dev) {
        let s = SpdkLvstore::open(dev)?;
        let cs = s.sb.cluster_size;
        let lvols: Vec<_> = s
            .lvols
            .values()
            .map(|l| {
                json!({
                    "name": l.name,
                    "uuid": l.uuid.to_string(),
                    "alias": format!("{}/{}", s.name, l.name),
                    "size_bytes": l.size_bytes(cs),
                    "num_allocated_clusters": l.allocated(),
                    "is_thin_provisioned": l.thin,
                    "read_only": l.read_only,
                    "is_snapshot": s.has_clones(l.blob_id),
                    "is_clone": l.parent.is_some(),
                    "parent": l.parent.and_then(|p| s.lvols.get(&p)).map(|p| p.name.clone()),
                    "clear_method": l.clear.as_str(),
                })
            })
            .collect();
        return Ok(json!({
            "format": "spdk",
            "version": s.sb.version,
            "clean": s.sb.clean,
            "name": s.name,
            "uuid": s.uuid.to_string(),
            "cluster_size": cs,
            "block_size": s.sb.io_unit_size,
            "size_bytes": s.sb.size,
            "lvols": lvols,
            "skipped_blobs": s.skipped.iter().map(|(id, why)| json!({"blob_id": id, "reason": why})).collect::<Vec<_>>(),
        }));
    }
    // A katablk store needs a writable open (it records the open in its super block).
    drop(dev);
    let lvs = LvStore::open(open(path, false)?)?;
    let i = lvs.info();
    let lvols: Vec<_> = lvs
        .list()
        .iter()
        .map(|l| {
            json!({
                "name": l.name,
                "uuid": l.uuid.to_string(),
                "alias": l.alias,
                "size_bytes": l.size_bytes,
                "num_allocated_clusters": l.num_allocated_clusters,
                "is_thin_provisioned": l.thin,
                "read_only": l.read_only,
                "is_snapshot": l.snapshot,
                "is_clone": l.clone,
                "clones": l.clones,
            })
        })
        .collect();
    let v = json!({
        "format": "katablk",
        "name": i.name,
        "uuid": i.uuid.to_string(),
        "cluster_size": i.cluster_size,
        "block_size": i.block_size,
        "total_data_clusters": i.total_data_clusters,
        "free_clusters": i.free_clusters,
        "open": format!("{:?}", lvs.open_report()),
        "lvols": lvols,
    });
    lvs.close();
    Ok(v)
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let out = match args.cmd {
        Cmd::Inspect { path } => inspect(&path)?,
        Cmd::ImportSpdk { from, to, size } => {
            let src_dev = open(&from, true)?;
            let default = src_dev.info().size_bytes();
            let src = SpdkLvstore::open(src_dev)
                .with_context(|| format!("reading the SPDK lvstore on {}", from.display()))?;
            let dst = open_dest(&to, size, default)?;
            let (lvs, r) = LvStore::import_spdk(&src, dst)
                .with_context(|| format!("importing into {}", to.display()))?;
            lvs.close();
            json!({
                "imported": r.lvols.iter().map(|(n, _)| n).collect::<Vec<_>>(),
                "clusters_copied": r.clusters_copied,
                "skipped_blobs": r.skipped.iter().map(|(id, why)| json!({"blob_id": id, "reason": why})).collect::<Vec<_>>(),
            })
        }
        Cmd::ExportSpdk { from, to, size } => {
            let src_dev = open(&from, false)?;
            let default = src_dev.info().size_bytes();
            let lvs = LvStore::open(src_dev)
                .with_context(|| format!("opening the lvstore on {}", from.display()))?;
            let dst = open_dest(&to, size, default)?;
            let r = lvs
                .export_spdk(dst)
                .with_context(|| format!("exporting to {}", to.display()))?;
            lvs.close();
            json!({
                "exported": r.lvols.iter().map(|(n, id)| json!({"name": n, "blob_id": id})).collect::<Vec<_>>(),
                "clusters_copied": r.clusters_copied,
                "super_blob": r.super_blob,
                "md_pages": r.md_len,
            })
        }
    };
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
