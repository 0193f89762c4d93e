//! The JSON-RPC method table: SPDK's method names and parameters, each run on a blocking thread
//! against the [`Target`], with the configuration saved after every successful change.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use katablk_rpc::methods::*;
use katablk_rpc::{Router, SpdkError};
use tokio::sync::Notify;

use crate::persist::{StateDir, SUBSYSTEMS};
use crate::state::{LvolOp, Target};

/// Shared by every handler.
#[derive(Clone)]
pub struct Ctx {
    /// The target.
    pub target: Arc<Target>,
    /// Where the configuration is saved, if anywhere.
    pub state: Option<StateDir>,
    /// Signalled by `spdk_kill_instance`.
    pub kill: Arc<Notify>,
}

impl Ctx {
    async fn run<R: Send + 'static>(
        &self,
        mutates: bool,
        f: impl FnOnce(&Target) -> Result<R, SpdkError> + Send + 'static,
    ) -> Result<R, SpdkError> {
        let t = self.target.clone();
        let state = self.state.clone();
        tokio::task::spawn_blocking(move || {
            let r = f(&t)?;
            if mutates {
                if let Some(s) = &state {
                    if let Err(e) = s.save(&t) {
                        tracing::error!("cannot save the configuration: {e}");
                        return Err(SpdkError::internal(format!(
                            "done, but the configuration could not be saved: {e}"
                        )));
                    }
                }
            }
            Ok(r)
        })
        .await
        .map_err(|e| SpdkError::internal(format!("handler failed: {e}")))?
    }
}

macro_rules! route {
    ($router:ident, $ctx:ident, $m:ty, $mutates:expr, |$t:ident, $p:ident| $body:expr) => {{
        let c = $ctx.clone();
        $router.method::<$m, _, _>(move |$p| {
            let c = c.clone();
            async move { c.run($mutates, move |$t| $body).await }
        })
    }};
}

fn version() -> VersionInfo {
    let v = env!("CARGO_PKG_VERSION");
    let mut it = v.split('.').map(|x| x.parse::<u32>().unwrap_or(0));
    VersionInfo {
        version: format!("katablk-target v{v}"),
        fields: VersionFields {
            major: it.next().unwrap_or(0),
            minor: it.next().unwrap_or(0),
            patch: it.next().unwrap_or(0),
            suffix: String::new(),
            commit: None,
        },
    }
}

/// Builds the router for `ctx`.
pub fn router(ctx: Ctx) -> Router {
    let r = Router::new();
    let r = r.method::<SpdkGetVersion, _, _>(|_: NoParams| async { Ok(version()) });
    let r = r.method::<FrameworkWaitInit, _, _>(|_: NoParams| async { Ok(true) });
    let r = r.method::<BdevWaitForExamine, _, _>(|_: NoParams| async { Ok(true) });
    let r = r.method::<FrameworkGetSubsystems, _, _>(|_: NoParams| async {
        Ok(SUBSYSTEMS
            .iter()
            .map(|s| SubsystemInfo {
                subsystem: s.to_string(),
                depends_on: if *s == "vhost_blk" {
                    vec!["bdev".to_string()]
                } else {
                    Vec::new()
                },
            })
            .collect())
    });
    let r = route!(r, ctx, FrameworkGetConfig, false, |t, p| t
        .config(&p.name)
        .map(Some));
    let kill = ctx.kill.clone();
    let r = r.method::<SpdkKillInstance, _, _>(move |p| {
        let kill = kill.clone();
        async move {
            match p.sig_name.as_str() {
                "SIGINT" | "SIGTERM" | "SIGQUIT" | "SIGKILL" | "2" | "15" | "3" | "9" => {
                    kill.notify_one();
                    Ok(true)
                }
                _ => Err(SpdkError::einval()),
            }
        }
    });
    let r = route!(r, ctx, KatablkGetUnrestored, false, |t, _p| t.unrestored());
    let r = route!(r, ctx, BdevGetBdevs, false, |t, p| t
        .get_bdevs(p.name.as_deref()));
    let r = route!(r, ctx, BdevGetIostat, false, |t, p| {
        let ticks = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let want: Option<Vec<String>> = match (&p.name, &p.names) {
            (Some(n), _) => Some(vec![n.clone()]),
            (None, Some(ns)) => Some(ns.clone()),
            _ => None,
        };
        let all = t.iostat()?;
        let qos = t.qos_stats()?;
        let entry = |k: &str, s: &katablk_vhost::StatsSnapshot| iostat_entry(k, s, qos.get(k));
        let pick = |n: &str| -> Result<Vec<BdevIostat>, SpdkError> {
            let info = t.get_bdevs(Some(n))?;
            let canon = info.first().map(|b| b.name.clone()).unwrap_or_default();
            Ok(all
                .iter()
                .filter(|(k, _)| *k == canon)
                .map(|(k, s)| entry(k, s))
                .collect())
        };
        let bdevs = match want {
            Some(names) => {
                let mut v = Vec::new();
                for n in names {
                    v.extend(pick(&n)?);
                }
                v
            }
            None => all.iter().map(|(k, s)| entry(k, s)).collect(),
        };
        Ok(IostatResult {
            tick_rate: 1_000_000_000,
            ticks,
            bdevs,
        })
    });
    let r = route!(r, ctx, BdevSetQosLimit, true, |t, p| t.set_qos_limit(&p));
    let r = route!(r, ctx, KatablkSetQosGroup, true, |t, p| t.set_qos_group(&p));
    let r = route!(r, ctx, KatablkDeleteQosGroup, true, |t, p| t
        .delete_qos_group(&p.name));
    let r = route!(r, ctx, KatablkGetQosGroups, false, |t, _p| t.qos_groups());
    let r = route!(r, ctx, BdevAioCreate, true, |t, p| t.aio_create(&p));
    let r = route!(r, ctx, BdevAioDelete, true, |t, p| t
        .base_delete(&p.name, "aio"));
    let r = route!(r, ctx, BdevMallocCreate, true, |t, p| t.malloc_create(&p));
    let r = route!(r, ctx, BdevMallocDelete, true, |t, p| t
        .base_delete(&p.name, "malloc"));
    let r = route!(r, ctx, BdevNullCreate, true, |t, p| t.null_create(&p));
    let r = route!(r, ctx, BdevNullDelete, true, |t, p| t
        .base_delete(&p.name, "null"));
    let r = route!(r, ctx, BdevLvolCreateLvstore, true, |t, p| t
        .create_lvstore(&p));
    let r = route!(r, ctx, BdevLvolGetLvstores, false, |t, p| t
        .get_lvstores(&p));
    let r = route!(r, ctx, BdevLvolDeleteLvstore, true, |t, p| t
        .delete_lvstore(&p));
    let r = route!(r, ctx, BdevLvolRenameLvstore, true, |t, p| t
        .rename_lvstore(&p));

    let r = route!(r, ctx, BdevLvolGrowLvstore, true, |t, p| t.grow_lvstore(&p));
    let r = route!(r, ctx, BdevLvolCreate, true, |t, p| t.create_lvol(&p));
    let r = route!(r, ctx, BdevLvolGetLvols, false, |t, p| t.get_lvols(&p));
    let r = route!(r, ctx, BdevLvolDelete, true, |t, p| t.delete_lvol(&p.name));
    let r = route!(r, ctx, BdevLvolResize, true, |t, p| t.resize_lvol(&p));
    let r = route!(r, ctx, BdevLvolRename, true, |t, p| t.rename_lvol(&p));
    let r = route!(r, ctx, BdevLvolSnapshot, true, |t, p| t.snapshot(&p));
    let r = route!(r, ctx, BdevLvolClone, true, |t, p| t.clone_lvol(&p));
    let r = route!(r, ctx, BdevLvolInflate, true, |t, p| t
        .lvol_op(&p.name, LvolOp::Inflate));
    let r = route!(r, ctx, BdevLvolDecoupleParent, true, |t, p| t
        .lvol_op(&p.name, LvolOp::DecoupleParent));
    let r = route!(r, ctx, BdevLvolSetReadOnly, true, |t, p| t
        .lvol_op(&p.name, LvolOp::SetReadOnly));
    let r = route!(r, ctx, VhostCreateBlkController, true, |t, p| t
        .create_controller(&p));
    let r = route!(r, ctx, VhostDeleteController, true, |t, p| t
        .delete_controller(&p.ctrlr));
    let r = route!(r, ctx, VhostGetControllers, false, |t, p| t
        .get_controllers(p.name.as_deref()));
    route!(r, ctx, VhostControllerSetCoalescing, true, |t, p| t
        .set_coalescing(&p))
}

fn iostat_entry(
    name: &str,
    s: &katablk_vhost::StatsSnapshot,
    qos: Option<&katablk_bdev::qos::QosStats>,
) -> BdevIostat {
    BdevIostat {
        katablk_qos_throttled_requests: qos.map(|q| q.throttled_requests),
        katablk_qos_throttled_ns: qos.map(|q| q.throttled_ns),
        name: name.to_string(),
        bytes_read: s.read_bytes,
        num_read_ops: s.read_ops,
        bytes_written: s.write_bytes,
        num_write_ops: s.write_ops,
        num_unmap_ops: s.unmap_ops,
        ..Default::default()
    }
}
