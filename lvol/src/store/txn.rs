//! The metadata transaction engine: super block and mask writes, metadata page and cluster
//! allocation, atomic commits of blob metadata, and the volume table.

use super::*;

impl MdState {
    pub(crate) fn page_off(&self, p: u32) -> u64 {
        (u64::from(self.sb.md_start) + u64::from(p)) * PAGE
    }

    pub(crate) fn cs(&self) -> u64 {
        u64::from(self.sb.cluster_size)
    }

    pub(crate) fn check_ok(&self) -> Result<()> {
        if self.closed {
            return Err(LvolError::Closed);
        }
        if self.poisoned {
            return Err(LvolError::CorruptMetadata(
                "an earlier metadata write failed; reopen the store".into(),
            ));
        }
        Ok(())
    }

    /// Writes a new generation of the super block to the other slot and flushes.
    pub(crate) fn write_sb(&mut self, mut sb: SuperBlock) -> Result<()> {
        sb.generation = self.sb.generation + 1;
        let page = sb.encode();
        self.io.write_at(sb.slot() * PAGE, &page)?;
        self.flush()?;
        self.sb = sb;
        Ok(())
    }

    /// Writes the used-page and used-cluster masks to their regions, stamped with the
    /// generation the next super block write gets, and flushes (clean shutdown, before the
    /// super block says `clean`).
    pub(super) fn write_masks(&mut self) -> Result<()> {
        if !self.sb.has_masks() {
            return Ok(());
        }
        let generation = self.sb.generation + 1;
        let r = encode_mask(
            MASK_TYPE_PAGES,
            generation,
            &self.md_used,
            self.sb.pmask_len,
        );
        self.io
            .write_at(u64::from(self.sb.pmask_start) * PAGE, &r)?;
        if self.sb.cmask_len != 0 {
            let r = encode_mask(
                MASK_TYPE_CLUSTERS,
                generation,
                &self.clusters,
                self.sb.cmask_len,
            );
            self.io
                .write_at(u64::from(self.sb.cmask_start) * PAGE, &r)?;
        }
        self.flush()
    }

    pub(crate) fn check_ok_pub(&self) -> Result<()> {
        self.check_ok()
    }

    pub(crate) fn clusters_mut(&mut self) -> &mut Bitmap {
        &mut self.clusters
    }

    fn alloc_md_page(&mut self) -> Option<u32> {
        let p = self.md_used.find_clear(self.md_hint)?;
        self.md_used.set(p);
        self.md_hint = p + 1;
        Some(p as u32)
    }

    /// Allocates one data cluster near `hint`.
    pub(crate) fn alloc_cluster(&mut self, hint: Option<u64>) -> Result<u32> {
        let h = hint.unwrap_or(self.cluster_hint);
        let c = self
            .clusters
            .find_clear(h)
            .ok_or(LvolError::NoSpace { needed: 1, free: 0 })?;
        self.clusters.set(c);
        self.cluster_hint = c + 1;
        Ok(c as u32)
    }

    pub(crate) fn free_clusters(&self) -> u64 {
        self.clusters.count_clear()
    }

    pub(super) fn zero_range(&mut self, off: u64, len: u64) -> Result<()> {
        if self.write_zeroes {
            if self.io.write_zeroes(off, len, false).is_ok() {
                return Ok(());
            }
            self.write_zeroes = false;
        }
        let zeroes = vec![0u8; ZERO_CHUNK.min(len as usize)];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(zeroes.len() as u64) as usize;
            self.io.write_at(off + done, &zeroes[..n])?;
            done += n as u64;
        }
        Ok(())
    }

    /// Fills physical cluster `dst` with a copy of cluster `src`, or zeroes.
    pub(crate) fn fill_cluster(&mut self, dst: u32, src: Option<u32>) -> Result<()> {
        let cs = self.cs();
        match src {
            Some(s) => {
                if self.bounce.len() != cs as usize {
                    self.bounce = vec![0u8; cs as usize];
                }
                let mut buf = std::mem::take(&mut self.bounce);
                let r = self
                    .io
                    .read_at(u64::from(s) * cs, &mut buf)
                    .and_then(|_| self.io.write_at(u64::from(dst) * cs, &buf));
                self.bounce = buf;
                r?;
                Ok(())
            }
            None => self.zero_range(u64::from(dst) * cs, cs),
        }
    }

    pub(crate) fn flush(&mut self) -> Result<()> {
        Ok(self.io.flush()?)
    }

    /// Releases clusters (after the metadata no longer references them), clearing them.
    pub(crate) fn release_clusters(&mut self, phys: &[u32], how: ClearMethod) {
        let cs = self.cs();
        for &p in phys {
            let off = u64::from(p) * cs;
            let r = match how {
                ClearMethod::None => Ok(()),
                ClearMethod::Unmap if self.discard => {
                    self.io.discard(off, cs).map_err(LvolError::from)
                }
                ClearMethod::Unmap => Ok(()),
                ClearMethod::WriteZeroes => self.zero_range(off, cs),
            };
            if let Err(e) = r {
                tracing::warn!("clearing cluster {p}: {e}");
            }
            self.clusters.clear(u64::from(p));
        }
    }

    /// Physical cluster of logical cluster `c` in the ancestors starting at `parent`.
    pub(crate) fn ancestor_cluster(&self, mut parent: Option<u64>, c: u64) -> Option<u32> {
        let mut hops = 0;
        while let Some(pid) = parent {
            let b = self.blobs.get(&pid)?;
            match b.clusters.get(c as usize) {
                Some(&x) if x != 0 => return Some(x),
                Some(_) => {}
                None => return None,
            }
            parent = b.parent;
            hops += 1;
            if hops > self.blobs.len() {
                return None;
            }
        }
        None
    }

    /// Writes `updates` and tombstones for `deletes` as one atomic transaction and applies
    /// them to the in-memory state. On error nothing is applied.
    pub(crate) fn commit(&mut self, updates: Vec<BlobMd>, deletes: &[u64]) -> Result<()> {
        self.check_ok()?;
        let new_ids = updates
            .iter()
            .filter(|b| !self.blobs.contains_key(&b.id))
            .count();
        let live = (self.blobs.len() + new_ids - deletes.len()) as u32;
        let members = (updates.len() + deletes.len()) as u32;
        if members == 0 {
            return Ok(());
        }
        let txn = self.next_txn;
        self.next_txn += 1;
        // Build and place every page before writing any.
        let mut placed: Vec<(u32, Vec<u8>)> = Vec::new();
        let mut chains: Vec<(u64, Vec<u32>)> = Vec::new();
        let mut tombs: Vec<u32> = Vec::new();
        let mut failed = false;
        let mut jobs: Vec<(u64, Vec<Vec<u8>>, u32)> =
            updates.iter().map(|b| (b.id, encode_blob(b), 0)).collect();
        jobs.extend(
            deletes
                .iter()
                .map(|&id| (id, vec![Vec::new()], PAGE_TOMBSTONE)),
        );
        'outer: for (id, bodies, flags) in &jobs {
            let mut idx = Vec::with_capacity(bodies.len());
            for _ in 0..bodies.len() {
                match self.alloc_md_page() {
                    Some(p) => idx.push(p),
                    None => {
                        for p in idx {
                            self.md_used.clear(u64::from(p));
                        }
                        failed = true;
                        break 'outer;
                    }
                }
            }
            let n = bodies.len() as u32;
            for (i, body) in bodies.iter().enumerate() {
                let h = PageHdr {
                    blob_id: *id,
                    seq_num: i as u32,
                    flags: *flags,
                    txn,
                    members,
                    chain_len: n,
                    live,
                    next: idx.get(i + 1).copied().unwrap_or(NO_PAGE),
                };
                placed.push((idx[i], build_page(&h, body)));
            }
            if *flags & PAGE_TOMBSTONE != 0 {
                tombs.extend_from_slice(&idx);
            } else {
                chains.push((*id, idx));
            }
        }
        let undo_pages = |s: &mut MdState, placed: &[(u32, Vec<u8>)]| {
            for (p, _) in placed {
                s.md_used.clear(u64::from(*p));
            }
        };
        // Keep a few pages back for deletions, so a full metadata region can always be
        // relieved by deleting volumes.
        let freed_after: usize = self.deferred_zero.len()
            + updates
                .iter()
                .map(|b| self.pages.get(&b.id).map_or(0, |p| p.len()))
                .sum::<usize>();
        if deletes.is_empty() && self.md_used.count_clear() + (freed_after as u64) < MD_RESERVE {
            failed = true;
        }
        if failed {
            undo_pages(self, &placed);
            return Err(LvolError::MdFull(self.sb.md_len));
        }
        let mut res = Ok(());
        for (p, page) in &placed {
            let off = self.page_off(*p);
            if let Err(e) = self.io.write_at(off, page) {
                res = Err(e);
                break;
            }
        }
        if res.is_ok() {
            res = self.io.flush();
        }
        if let Err(e) = res {
            // Make sure the partial transaction can never be mistaken for a committed one.
            let zero = vec![0u8; PAGE_SIZE];
            let mut ok = true;
            for (p, _) in &placed {
                let off = self.page_off(*p);
                ok &= self.io.write_at(off, &zero).is_ok();
            }
            ok &= self.io.flush().is_ok();
            if !ok {
                self.poisoned = true;
            }
            undo_pages(self, &placed);
            return Err(e.into());
        }
        // Committed. Release what it superseded.
        self.last_committed = txn;
        let zero = vec![0u8; PAGE_SIZE];
        let mut to_zero: Vec<u32> = std::mem::take(&mut self.deferred_zero);
        for (id, idx) in chains {
            if let Some(old) = self.pages.insert(id, idx) {
                to_zero.extend(old);
            }
        }
        for &id in deletes {
            if let Some(old) = self.pages.remove(&id) {
                to_zero.extend(old);
            }
            self.blobs.remove(&id);
        }
        for p in to_zero {
            let off = self.page_off(p);
            if self.io.write_at(off, &zero).is_err() {
                self.poisoned = true;
            }
            self.md_used.clear(u64::from(p));
        }
        self.deferred_zero = tombs;
        for b in updates {
            self.next_id = self.next_id.max((b.id & 0xffff_ffff) + 1);
            self.blobs.insert(b.id, b);
        }
        Ok(())
    }

    /// Copies a blob's persistent state to its live volume handle.
    pub(crate) fn publish(&self, id: u64) {
        let Some(v) = self.vols.get(&id) else { return };
        let Some(b) = self.blobs.get(&id) else { return };
        let parent = b.parent.and_then(|p| self.vols.get(&p).cloned());
        let mut st = v.st_mut();
        st.name = b.name.clone();
        st.map = b.clusters.clone();
        st.parent = parent;
        st.read_only = b.read_only;
        st.thin = b.thin;
    }

    /// Registers a live handle for a new blob.
    pub(crate) fn add_vol(&mut self, shared: &Arc<Shared>, id: u64) -> Arc<Lvol> {
        let uuid = self.blobs.get(&id).map(|b| b.uuid).unwrap_or_default();
        let v = Arc::new_cyclic(|me| Lvol {
            me: me.clone(),
            shared: shared.clone(),
            id,
            uuid,
            state: RwLock::new(VolState {
                name: String::new(),
                map: Vec::new(),
                parent: None,
                read_only: false,
                deleted: false,
                thin: false,
            }),
            frozen: std::sync::atomic::AtomicU32::new(0),
            inflight: AtomicU64::new(0),
            io_epoch: AtomicU64::new(0),
            io_count: [AtomicU64::new(0), AtomicU64::new(0)],
        });
        self.vols.insert(id, v.clone());
        self.publish(id);
        v
    }

    pub(crate) fn remove_vol(&mut self, id: u64) {
        if let Some(v) = self.vols.remove(&id) {
            let mut st = v.st_mut();
            st.deleted = true;
            st.parent = None;
        }
    }

    pub(crate) fn new_id(&mut self) -> u64 {
        let id = (1u64 << 32) | self.next_id;
        self.next_id += 1;
        id
    }

    /// Finds a blob by name, alias or UUID.
    pub(crate) fn find(&self, key: &str) -> Result<u64> {
        let name = match key.split_once('/') {
            Some((lvs, n)) if lvs == self.sb.name => n,
            Some(_) => return Err(LvolError::NotFound(key.to_string())),
            None => key,
        };
        let uuid = Uuid::parse_str(key).ok();
        self.blobs
            .values()
            .find(|b| b.name == name || Some(b.uuid) == uuid)
            .map(|b| b.id)
            .ok_or_else(|| LvolError::NotFound(key.to_string()))
    }

    pub(crate) fn blob(&self, id: u64) -> Result<&BlobMd> {
        self.blobs
            .get(&id)
            .ok_or_else(|| LvolError::NotFound(format!("{id:#x}")))
    }

    pub(crate) fn clones_of(&self, id: u64) -> Vec<u64> {
        self.blobs
            .values()
            .filter(|b| b.parent == Some(id))
            .map(|b| b.id)
            .collect()
    }

    pub(crate) fn name_taken(&self, name: &str) -> bool {
        self.blobs.values().any(|b| b.name == name)
    }

    pub(crate) fn info_of_pub(&self, b: &BlobMd, shared: &Shared) -> LvolInfo {
        self.info_of(b, shared)
    }

    pub(super) fn info_of(&self, b: &BlobMd, shared: &Shared) -> LvolInfo {
        let cs = self.cs();
        let clones: Vec<String> = self
            .clones_of(b.id)
            .iter()
            .filter_map(|c| self.blobs.get(c).map(|x| x.name.clone()))
            .collect();
        let bs = self.sb.block_size;
        LvolInfo {
            name: b.name.clone(),
            uuid: b.uuid,
            alias: format!("{}/{}", shared.name(), b.name),
            lvs_name: shared.name(),
            lvs_uuid: shared.uuid,
            size_bytes: b.clusters.len() as u64 * cs,
            block_size: bs,
            num_blocks: b.clusters.len() as u64 * cs / u64::from(bs),
            num_allocated_clusters: b.clusters.iter().filter(|&&c| c != 0).count() as u64,
            thin: b.thin,
            snapshot: b.snapshot || !clones.is_empty(),
            clone: b.parent.is_some(),
            base_snapshot: b
                .parent
                .and_then(|p| self.blobs.get(&p).map(|x| x.name.clone())),
            clones,
            read_only: b.read_only,
            clear_method: b.clear,
        }
    }
}
