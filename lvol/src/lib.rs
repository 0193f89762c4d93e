//! Logical volume store (SPDK blobstore/lvol model) on any katablk [`BlockDevice`].
//!
//! An [`LvStore`] divides a block device into clusters (4 MiB by default) and hands them out
//! to volumes ([`Lvol`]), each of which is itself a [`BlockDevice`] with its own
//! [`IoChannel`](katablk_bdev::IoChannel) that maps the caller's buffers straight onto the
//! backing device. Volumes may be thick or thin provisioned; snapshots, clones, inflate,
//! decouple-parent and snapshot merge follow SPDK's lvol semantics.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use katablk_bdev::{BlockDevice, malloc::MallocDevice};
//! # use katablk_lvol::{LvStore, LvsOptions};
//! let dev: Arc<dyn BlockDevice> = Arc::new(MallocDevice::new(1 << 19, 512)?);
//! let lvs = LvStore::create(dev.clone(), LvsOptions::new("lvs0"))?;
//! let vol = lvs.create_lvol("lvol0", 64 << 20, true)?;
//! let snap = lvs.snapshot("lvol0", "snap0")?;
//! let clone = lvs.clone("snap0", "clone0")?;
//! # let _ = (vol, snap, clone);
//! drop(lvs);
//! let lvs = LvStore::open(dev)?;
//! assert_eq!(lvs.list().len(), 3);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The on-disk format and its crash-safety rules are described in `docs/FORMAT.md`.
//!
//! Usage notes:
//!
//! * [`LvStore`] is `Send + Sync` and serialises metadata operations internally; share it
//!   with an `Arc`. Keep it alive while its volumes are served: it owns the worker thread that
//!   allocates clusters for first writes to thin volumes (dropping it closes the store cleanly;
//!   volume handles then still serve allocated clusters but fail allocating writes).
//! * Volume lookups accept the name, the alias `<lvs>/<lvol>` or the UUID string.
//! * Sizes are rounded up to whole clusters. Errors map to SPDK's errno values with
//!   [`LvolError::errno`] (`EEXIST` duplicate, `ENOSPC` no space, `EPERM` snapshot with several
//!   clones, `ENODEV` missing volume).
//! * Open a device with at most one `LvStore` at a time (there is no on-disk lock).
//!
//! [`BlockDevice`]: katablk_bdev::BlockDevice

#![deny(missing_docs)]

mod alloc;
mod channel;
pub mod cluster_map;
mod error;
mod export;
mod import;
mod lvol;
pub mod md;
mod recover;
mod shared;
mod snapshot;
pub mod spdk;
mod store;
pub mod superblock;

pub use error::{LvolError, Result};
pub use export::ExportReport;
pub use import::ImportReport;
pub use lvol::{Lvol, LvolInfo};
pub use md::ClearMethod;
pub use recover::OpenReport;
pub use store::{LvStore, LvolOptions, LvsInfo, LvsOptions, DEFAULT_CLUSTER_SIZE};
