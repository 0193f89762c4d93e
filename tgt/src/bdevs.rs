//! Base bdevs (aio, malloc, null) and how every bdev is reported (`bdev_get_bdevs`).

use std::sync::Arc;

use katablk_bdev::BlockDevice;
use katablk_rpc::methods::{
    AioDriverSpecific, BdevInfo, DriverSpecific, LvolDriverSpecific, SupportedIoTypes,
};
use uuid::Uuid;

/// What a base bdev is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BaseKind {
    /// A file or block device (`bdev_aio_create`).
    Aio {
        /// Path.
        filename: String,
        /// Opened read-only.
        readonly: bool,
        /// A block size was given explicitly.
        block_size_override: bool,
    },
    /// RAM (`bdev_malloc_create`).
    Malloc,
    /// Null (`bdev_null_create`).
    Null,
}

/// A base bdev.
pub struct BaseBdev {
    /// Name.
    pub name: String,
    /// UUID (also its alias).
    pub uuid: Uuid,
    /// Kind and creation parameters.
    pub kind: BaseKind,
    /// The device.
    pub dev: Arc<dyn BlockDevice>,
}

fn io_types(dev: &dyn BlockDevice, flush: bool) -> SupportedIoTypes {
    let i = dev.info();
    SupportedIoTypes {
        read: true,
        write: !i.read_only,
        unmap: i.discard && !i.read_only,
        flush,
        reset: true,
        write_zeroes: i.write_zeroes && !i.read_only,
        ..Default::default()
    }
}

impl BaseBdev {
    /// SPDK's `bdev_get_bdevs` entry; `claimed` when an lvstore sits on it.
    pub fn info(&self, claimed: bool) -> BdevInfo {
        let i = self.dev.info();
        let (product, driver_specific, numa, flush) = match &self.kind {
            BaseKind::Aio {
                filename,
                readonly,
                block_size_override,
            } => (
                "AIO disk",
                DriverSpecific {
                    aio: Some(AioDriverSpecific {
                        filename: filename.clone(),
                        block_size_override: *block_size_override,
                        readonly: *readonly,
                        fallocate: false,
                        nowait: false,
                    }),
                    ..Default::default()
                },
                None,
                true,
            ),
            BaseKind::Malloc => ("Malloc disk", DriverSpecific::default(), Some(-1), true),
            BaseKind::Null => ("Null disk", DriverSpecific::default(), None, false),
        };
        BdevInfo {
            name: self.name.clone(),
            aliases: vec![self.uuid.to_string()],
            product_name: product.into(),
            block_size: i.block_size,
            num_blocks: i.num_blocks,
            uuid: Some(self.uuid.to_string()),
            numa_id: numa,
            claimed,
            claim_type: claimed.then(|| "read_many_write_one".to_string()),
            supported_io_types: io_types(&*self.dev, flush),
            driver_specific,
            ..Default::default()
        }
    }
}

/// SPDK's `bdev_get_bdevs` entry for an lvol.
pub fn lvol_bdev_info(
    info: &katablk_lvol::LvolInfo,
    base_bdev: &str,
    dev: &dyn BlockDevice,
    claimed: bool,
) -> BdevInfo {
    let mut t = io_types(dev, false);
    t.write = !info.read_only;
    t.seek_hole = true;
    t.seek_data = true;
    BdevInfo {
        name: info.uuid.to_string(),
        aliases: vec![info.alias.clone()],
        product_name: "Logical Volume".into(),
        block_size: info.block_size,
        num_blocks: info.num_blocks,
        uuid: Some(info.uuid.to_string()),
        claimed,
        claim_type: claimed.then(|| "read_many_write_one".to_string()),
        supported_io_types: t,
        driver_specific: DriverSpecific {
            lvol: Some(LvolDriverSpecific {
                lvol_store_uuid: info.lvs_uuid.to_string(),
                base_bdev: base_bdev.to_string(),
                thin_provision: info.thin,
                num_allocated_clusters: info.num_allocated_clusters,
                snapshot: info.snapshot,
                clone: info.clone,
                base_snapshot: info.base_snapshot.clone(),
                clones: (!info.clones.is_empty()).then(|| info.clones.clone()),
                esnap_clone: false,
                external_snapshot_name: None,
            }),
            ..Default::default()
        },
        ..Default::default()
    }
}
