//! Logical volume store and logical volume methods (`bdev_lvol_*`).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::method;
use crate::error::SpdkError;

/// How an lvstore clears its data region at creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LvsClearMethod {
    /// Do not clear.
    None,
    /// Unmap (SPDK's default).
    Unmap,
    /// Write zeroes.
    WriteZeroes,
}

/// How an lvol's clusters are cleared when freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LvolClearMethod {
    /// The blobstore default (unmap).
    Default,
    /// Do not clear.
    None,
    /// Unmap.
    Unmap,
    /// Write zeroes.
    WriteZeroes,
}

/// Params of `bdev_lvol_create_lvstore`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BdevLvolCreateLvstoreParams {
    /// Base bdev.
    pub bdev_name: String,
    /// Name of the new lvstore.
    pub lvs_name: String,
    /// Cluster size in bytes (default 4 MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_sz: Option<u32>,
    /// Clear method for the data region.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clear_method: Option<LvsClearMethod>,
    /// Reserved metadata pages per cluster, in percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_md_pages_per_cluster_ratio: Option<u32>,
    /// Metadata page size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub md_page_size: Option<u32>,
}

method!(
    /// `bdev_lvol_create_lvstore` → lvstore UUID.
    BdevLvolCreateLvstore = "bdev_lvol_create_lvstore", BdevLvolCreateLvstoreParams => String, idempotent: false
);

/// Selects one lvstore by `uuid` or `lvs_name` (exactly one; both absent = all, for listing).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LvstoreSelector {
    /// Lvstore UUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Lvstore name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lvs_name: Option<String>,
}

impl LvstoreSelector {
    /// Select by name.
    pub fn by_name(name: impl Into<String>) -> Self {
        Self {
            uuid: None,
            lvs_name: Some(name.into()),
        }
    }

    /// Select by UUID.
    pub fn by_uuid(uuid: impl Into<String>) -> Self {
        Self {
            uuid: Some(uuid.into()),
            lvs_name: None,
        }
    }
}

/// How a request names an lvstore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LvstoreKey<'a> {
    /// By UUID.
    Uuid(&'a str),
    /// By name.
    Name(&'a str),
}

/// SPDK's rule for `uuid` / `lvs_name` pairs: exactly one must be given, else `-22 EINVAL`.
fn uuid_xor_name<'a>(
    uuid: Option<&'a str>,
    name: Option<&'a str>,
) -> Result<LvstoreKey<'a>, SpdkError> {
    match (uuid, name) {
        (Some(u), None) => Ok(LvstoreKey::Uuid(u)),
        (None, Some(n)) => Ok(LvstoreKey::Name(n)),
        _ => Err(SpdkError::einval()),
    }
}

impl LvstoreSelector {
    /// The selected lvstore: exactly one of `uuid`/`lvs_name` (`-22` otherwise), as
    /// `bdev_lvol_delete_lvstore` and `bdev_lvol_grow_lvstore` require.
    pub fn key(&self) -> Result<LvstoreKey<'_>, SpdkError> {
        uuid_xor_name(self.uuid.as_deref(), self.lvs_name.as_deref())
    }

    /// For listing: `None` when neither is given (all lvstores), else as [`key`](Self::key).
    pub fn filter(&self) -> Result<Option<LvstoreKey<'_>>, SpdkError> {
        if self.uuid.is_none() && self.lvs_name.is_none() {
            return Ok(None);
        }
        self.key().map(Some)
    }
}

/// One entry of `bdev_lvol_get_lvstores`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LvstoreInfo {
    /// Lvstore UUID.
    pub uuid: String,
    /// Lvstore name.
    pub name: String,
    /// Base bdev name.
    pub base_bdev: String,
    /// Clusters available for data.
    pub total_data_clusters: u64,
    /// Free clusters.
    pub free_clusters: u64,
    /// Block size of the base bdev.
    pub block_size: u32,
    /// Cluster size in bytes.
    pub cluster_size: u64,
    /// Largest size `bdev_lvol_grow_lvstore` can reach with the reserved metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_growable_size: Option<u64>,
    /// Members not modelled here.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

method!(
    /// `bdev_lvol_get_lvstores` → lvstores (one if selected; `-19` if the selected one is missing).
    BdevLvolGetLvstores = "bdev_lvol_get_lvstores", LvstoreSelector => Vec<LvstoreInfo>, idempotent: true
);

method!(
    /// `bdev_lvol_delete_lvstore` → `true`.
    BdevLvolDeleteLvstore = "bdev_lvol_delete_lvstore", LvstoreSelector => bool, idempotent: false
);

/// Params of the rename methods: `{"old_name", "new_name"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RenameParams {
    /// Current name (for lvols: UUID or `lvs/lvol` alias).
    pub old_name: String,
    /// New name (for lvols: the lvol part only).
    pub new_name: String,
}

method!(
    /// `bdev_lvol_rename_lvstore` → `true`.
    BdevLvolRenameLvstore = "bdev_lvol_rename_lvstore", RenameParams => bool, idempotent: false
);

method!(
    /// `bdev_lvol_grow_lvstore` → `true`.
    BdevLvolGrowLvstore = "bdev_lvol_grow_lvstore", LvstoreSelector => bool, idempotent: false
);

/// Params of `bdev_lvol_create`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BdevLvolCreateParams {
    /// Name of the new lvol.
    pub lvol_name: String,
    /// Size in MiB.
    pub size_in_mib: u64,
    /// Thin provisioning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thin_provision: Option<bool>,
    /// Per-cluster clear method.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clear_method: Option<LvolClearMethod>,
    /// Lvstore UUID (this or `lvs_name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Lvstore name (this or `uuid`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lvs_name: Option<String>,
}

impl BdevLvolCreateParams {
    /// The lvstore to create in: exactly one of `uuid`/`lvs_name` (`-22` otherwise).
    pub fn lvstore(&self) -> Result<LvstoreKey<'_>, SpdkError> {
        uuid_xor_name(self.uuid.as_deref(), self.lvs_name.as_deref())
    }
}

method!(
    /// `bdev_lvol_create` → lvol UUID (also its bdev name; alias `lvs/lvol`).
    BdevLvolCreate = "bdev_lvol_create", BdevLvolCreateParams => String, idempotent: false
);

/// Params of `bdev_lvol_get_lvols`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BdevLvolGetLvolsParams {
    /// Only lvols of the lvstore with this UUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lvs_uuid: Option<String>,
    /// Only lvols of the lvstore with this name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lvs_name: Option<String>,
}

/// `lvs` member of [`LvolInfo`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LvsRef {
    /// Lvstore name.
    pub name: String,
    /// Lvstore UUID.
    pub uuid: String,
}

/// One entry of `bdev_lvol_get_lvols`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LvolInfo {
    /// `lvs/lvol`.
    pub alias: String,
    /// Lvol UUID.
    pub uuid: String,
    /// Lvol name.
    pub name: String,
    /// Thin provisioned.
    pub is_thin_provisioned: bool,
    /// Is a snapshot.
    pub is_snapshot: bool,
    /// Is a clone.
    pub is_clone: bool,
    /// Is a clone of an external snapshot.
    pub is_esnap_clone: bool,
    /// Missing its external snapshot.
    pub is_degraded: bool,
    /// Allocated clusters.
    pub num_allocated_clusters: u64,
    /// The lvstore holding it.
    pub lvs: LvsRef,
    /// Members not modelled here.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

method!(
    /// `bdev_lvol_get_lvols` → lvols.
    BdevLvolGetLvols = "bdev_lvol_get_lvols", BdevLvolGetLvolsParams => Vec<LvolInfo>, idempotent: true
);

/// Params of the methods naming one lvol: `{"name": UUID or "lvs/lvol"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LvolNameParams {
    /// UUID or alias of the lvol.
    pub name: String,
}

method!(
    /// `bdev_lvol_delete` → `true`.
    BdevLvolDelete = "bdev_lvol_delete", LvolNameParams => bool, idempotent: false
);

/// Params of `bdev_lvol_resize`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BdevLvolResizeParams {
    /// UUID or alias of the lvol.
    pub name: String,
    /// New size in MiB.
    pub size_in_mib: u64,
}

method!(
    /// `bdev_lvol_resize` → `true`.
    BdevLvolResize = "bdev_lvol_resize", BdevLvolResizeParams => bool, idempotent: false
);

method!(
    /// `bdev_lvol_rename` → `true`.
    BdevLvolRename = "bdev_lvol_rename", RenameParams => bool, idempotent: false
);

/// Params of `bdev_lvol_snapshot`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BdevLvolSnapshotParams {
    /// UUID or alias of the lvol to snapshot.
    pub lvol_name: String,
    /// Name of the snapshot.
    pub snapshot_name: String,
}

method!(
    /// `bdev_lvol_snapshot` → snapshot UUID.
    BdevLvolSnapshot = "bdev_lvol_snapshot", BdevLvolSnapshotParams => String, idempotent: false
);

/// Params of `bdev_lvol_clone`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BdevLvolCloneParams {
    /// UUID or alias of the snapshot.
    pub snapshot_name: String,
    /// Name of the clone.
    pub clone_name: String,
}

method!(
    /// `bdev_lvol_clone` → clone UUID.
    BdevLvolClone = "bdev_lvol_clone", BdevLvolCloneParams => String, idempotent: false
);

method!(
    /// `bdev_lvol_inflate` → `true`.
    BdevLvolInflate = "bdev_lvol_inflate", LvolNameParams => bool, idempotent: false
);

method!(
    /// `bdev_lvol_decouple_parent` → `true`.
    BdevLvolDecoupleParent = "bdev_lvol_decouple_parent", LvolNameParams => bool, idempotent: false
);

method!(
    /// `bdev_lvol_set_read_only` → `true`.
    BdevLvolSetReadOnly = "bdev_lvol_set_read_only", LvolNameParams => bool, idempotent: false
);

/// Typed calls of the lvol methods.
mod calls {
    use crate::client::RpcClient;
    use crate::error::RpcError;
    use crate::methods::*;

    impl RpcClient {
        /// `bdev_lvol_create_lvstore` → lvstore UUID.
        pub async fn bdev_lvol_create_lvstore(
            &self,
            params: &BdevLvolCreateLvstoreParams,
        ) -> Result<String, RpcError> {
            self.call_method::<BdevLvolCreateLvstore>(params).await
        }

        /// `bdev_lvol_get_lvstores`.
        pub async fn bdev_lvol_get_lvstores(
            &self,
            select: &LvstoreSelector,
        ) -> Result<Vec<LvstoreInfo>, RpcError> {
            self.call_method::<BdevLvolGetLvstores>(select).await
        }

        /// `bdev_lvol_delete_lvstore`.
        pub async fn bdev_lvol_delete_lvstore(
            &self,
            select: &LvstoreSelector,
        ) -> Result<bool, RpcError> {
            self.call_method::<BdevLvolDeleteLvstore>(select).await
        }

        /// `bdev_lvol_rename_lvstore`.
        pub async fn bdev_lvol_rename_lvstore(
            &self,
            old_name: &str,
            new_name: &str,
        ) -> Result<bool, RpcError> {
            let p = RenameParams {
                old_name: old_name.to_owned(),
                new_name: new_name.to_owned(),
            };
            self.call_method::<BdevLvolRenameLvstore>(&p).await
        }

        /// `bdev_lvol_grow_lvstore`.
        pub async fn bdev_lvol_grow_lvstore(
            &self,
            select: &LvstoreSelector,
        ) -> Result<bool, RpcError> {
            self.call_method::<BdevLvolGrowLvstore>(select).await
        }

        /// `bdev_lvol_create` → lvol UUID.
        pub async fn bdev_lvol_create(
            &self,
            params: &BdevLvolCreateParams,
        ) -> Result<String, RpcError> {
            self.call_method::<BdevLvolCreate>(params).await
        }

        /// `bdev_lvol_get_lvols`.
        pub async fn bdev_lvol_get_lvols(
            &self,
            params: &BdevLvolGetLvolsParams,
        ) -> Result<Vec<LvolInfo>, RpcError> {
            self.call_method::<BdevLvolGetLvols>(params).await
        }

        /// `bdev_lvol_delete` (UUID or `lvs/lvol`).
        pub async fn bdev_lvol_delete(&self, name: &str) -> Result<bool, RpcError> {
            self.call_method::<BdevLvolDelete>(&LvolNameParams {
                name: name.to_owned(),
            })
            .await
        }

        /// `bdev_lvol_resize`.
        pub async fn bdev_lvol_resize(
            &self,
            name: &str,
            size_in_mib: u64,
        ) -> Result<bool, RpcError> {
            self.call_method::<BdevLvolResize>(&BdevLvolResizeParams {
                name: name.to_owned(),
                size_in_mib,
            })
            .await
        }

        /// `bdev_lvol_rename` (`new_name` is the lvol part only).
        pub async fn bdev_lvol_rename(
            &self,
            old_name: &str,
            new_name: &str,
        ) -> Result<bool, RpcError> {
            let p = RenameParams {
                old_name: old_name.to_owned(),
                new_name: new_name.to_owned(),
            };
            self.call_method::<BdevLvolRename>(&p).await
        }

        /// `bdev_lvol_snapshot` → snapshot UUID.
        pub async fn bdev_lvol_snapshot(
            &self,
            lvol_name: &str,
            snapshot_name: &str,
        ) -> Result<String, RpcError> {
            let p = BdevLvolSnapshotParams {
                lvol_name: lvol_name.to_owned(),
                snapshot_name: snapshot_name.to_owned(),
            };
            self.call_method::<BdevLvolSnapshot>(&p).await
        }

        /// `bdev_lvol_clone` → clone UUID.
        pub async fn bdev_lvol_clone(
            &self,
            snapshot_name: &str,
            clone_name: &str,
        ) -> Result<String, RpcError> {
            let p = BdevLvolCloneParams {
                snapshot_name: snapshot_name.to_owned(),
                clone_name: clone_name.to_owned(),
            };
            self.call_method::<BdevLvolClone>(&p).await
        }

        /// `bdev_lvol_inflate`.
        pub async fn bdev_lvol_inflate(&self, name: &str) -> Result<bool, RpcError> {
            self.call_method::<BdevLvolInflate>(&LvolNameParams {
                name: name.to_owned(),
            })
            .await
        }

        /// `bdev_lvol_decouple_parent`.
        pub async fn bdev_lvol_decouple_parent(&self, name: &str) -> Result<bool, RpcError> {
            self.call_method::<BdevLvolDecoupleParent>(&LvolNameParams {
                name: name.to_owned(),
            })
            .await
        }

        /// `bdev_lvol_set_read_only`.
        pub async fn bdev_lvol_set_read_only(&self, name: &str) -> Result<bool, RpcError> {
            self.call_method::<BdevLvolSetReadOnly>(&LvolNameParams {
                name: name.to_owned(),
            })
            .await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lvstore_selection() {
        assert_eq!(
            LvstoreSelector::by_name("lvs0").key(),
            Ok(LvstoreKey::Name("lvs0"))
        );
        assert_eq!(
            LvstoreSelector::by_uuid("u").filter(),
            Ok(Some(LvstoreKey::Uuid("u")))
        );
        assert_eq!(LvstoreSelector::default().filter(), Ok(None));
        assert_eq!(LvstoreSelector::default().key().unwrap_err().code, -22);
        let both = LvstoreSelector {
            uuid: Some("u".into()),
            lvs_name: Some("n".into()),
        };
        assert!(both.filter().is_err());
    }
}
