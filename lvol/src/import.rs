//! Import of an SPDK lvstore into a new katablk lvstore: same store name and UUID, cluster
//! size and block size; every volume with its name, UUID, size, thin/thick provisioning,
//! read-only flag, clear method and place in the snapshot/clone tree; every allocated
//! cluster's data copied (unallocated clusters stay unallocated, so thin volumes stay thin).

use std::collections::BTreeMap;
use std::sync::Arc;

use katablk_bdev::sync::SyncIo;
use katablk_bdev::BlockDevice;

use crate::error::{LvolError, Result};
use crate::md::BlobMd;
use crate::spdk::SpdkLvstore;
use crate::store::{LvStore, LvsOptions};

/// What [`LvStore::import_spdk`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImportReport {
    /// Volumes created (name, katablk blob id).
    pub lvols: Vec<(String, u64)>,
    /// Clusters copied.
    pub clusters_copied: u64,
    /// SPDK blobs not imported, with the reason.
    pub skipped: Vec<(u64, String)>,
}

impl LvStore {
    /// Creates a katablk lvstore on `dst` holding a copy of the SPDK lvstore `src` (see
    /// [`crate::spdk`]). `dst` must be at least as large as the SPDK store's used part; its
    /// old content is lost. The SPDK store is only read. If the import fails half way, `dst`
    /// holds a store with the volumes imported so far: destroy it and start again.
    pub fn import_spdk(
        src: &SpdkLvstore,
        dst: Arc<dyn BlockDevice>,
    ) -> Result<(LvStore, ImportReport)> {
        let dinfo = dst.info();
        if dinfo.block_size > src.sb.io_unit_size {
            return Err(LvolError::Invalid(format!(
                "destination block size {} is larger than the SPDK store's io unit {}",
                dinfo.block_size, src.sb.io_unit_size
            )));
        }
        let mut opts = LvsOptions::new(&src.name);
        opts.uuid = Some(src.uuid);
        opts.cluster_size = src.sb.cluster_size;
        opts.clear_method = crate::ClearMethod::None;
        let lvs = LvStore::create(dst, opts)?;
        let cs = u64::from(src.sb.cluster_size);
        let mut report = ImportReport {
            skipped: src.skipped.clone(),
            ..Default::default()
        };
        // Parents before children.
        let mut order: Vec<u64> = Vec::new();
        let mut placed: BTreeMap<u64, u64> = BTreeMap::new();
        while order.len() < src.lvols.len() {
            let before = order.len();
            for (id, l) in &src.lvols {
                if order.contains(id) {
                    continue;
                }
                if l.parent.is_none_or(|p| order.contains(&p)) {
                    order.push(*id);
                }
            }
            if order.len() == before {
                return Err(LvolError::CorruptMetadata(
                    "SPDK lvstore: parent links loop".into(),
                ));
            }
        }
        let mut sio = SyncIo::new(&**src.device())?;
        let mut buf = vec![0u8; cs as usize];
        for sid in order {
            let l = &src.lvols[&sid];
            let mut st = lvs.shared.md();
            st.check_ok()?;
            let allocated = l.allocated();
            if allocated > st.free_clusters() {
                return Err(LvolError::NoSpace {
                    needed: allocated,
                    free: st.free_clusters(),
                });
            }
            let mut clusters = vec![0u32; l.clusters.len()];
            let mut prev = None;
            let mut taken = Vec::new();
            let mut r: Result<()> = Ok(());
            for (c, &p) in l.clusters.iter().enumerate() {
                if p == 0 {
                    continue;
                }
                let n = match st.alloc_cluster(prev) {
                    Ok(n) => n,
                    Err(e) => {
                        r = Err(e);
                        break;
                    }
                };
                taken.push(n);
                prev = Some(u64::from(n) + 1);
                r = sio
                    .read_at(u64::from(p) * cs, &mut buf)
                    .map_err(LvolError::from)
                    .and_then(|()| {
                        st.io
                            .write_at(u64::from(n) * cs, &buf)
                            .map_err(LvolError::from)
                    });
                if r.is_err() {
                    break;
                }
                clusters[c] = n;
            }
            if r.is_ok() {
                r = st.flush();
            }
            let id = st.new_id();
            let b = BlobMd {
                id,
                name: l.name.clone(),
                uuid: l.uuid,
                clusters,
                thin: l.thin,
                read_only: l.read_only,
                snapshot: src.has_clones(sid),
                parent: l.parent.and_then(|p| placed.get(&p).copied()),
                clear: l.clear,
            };
            if r.is_ok() {
                r = st.commit(vec![b], &[]);
            }
            if let Err(e) = r {
                for n in taken {
                    st.clusters.clear(u64::from(n));
                }
                return Err(e);
            }
            st.add_vol(&lvs.shared, id);
            placed.insert(sid, id);
            report.clusters_copied += allocated;
            report.lvols.push((l.name.clone(), id));
        }
        Ok((lvs, report))
    }
}
