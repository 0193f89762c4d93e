//! Shared test server: a [`Router`] with a few SPDK methods and some test-only ones.
#![allow(clippy::unwrap_used, dead_code)]

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use katablk_rpc::methods::*;
use katablk_rpc::server::{Router, RpcServer, ServerConfig};
use katablk_rpc::SpdkError;
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Counters the test handler exposes.
#[derive(Default)]
pub struct State {
    pub notified: AtomicU64,
    /// `sleep` calls that have started.
    pub sleeping: AtomicU64,
    pub lvols: Mutex<HashSet<String>>,
}

pub fn version() -> VersionInfo {
    VersionInfo {
        version: "SPDK v26.09-pre".into(),
        fields: VersionFields {
            major: 26,
            minor: 9,
            patch: 0,
            suffix: "-pre".into(),
            commit: None,
        },
    }
}

pub fn router(state: Arc<State>) -> Router {
    let s1 = Arc::clone(&state);
    let s2 = Arc::clone(&state);
    let s3 = Arc::clone(&state);
    let s4 = Arc::clone(&state);
    Router::new()
        .method::<SpdkGetVersion, _, _>(|_| async { Ok(version()) })
        .method::<BdevGetBdevs, _, _>(|p| async move {
            match p.name.as_deref() {
                None | Some("Malloc0") => Ok(vec![BdevInfo {
                    name: "Malloc0".into(),
                    aliases: vec!["1805619a-ba2e-4045-a21e-46aa9deccde4".into()],
                    product_name: "Malloc disk".into(),
                    block_size: 512,
                    num_blocks: 131072,
                    uuid: Some("1805619a-ba2e-4045-a21e-46aa9deccde4".into()),
                    ..Default::default()
                }]),
                Some(_) => Err(SpdkError::no_such_device()),
            }
        })
        .method::<BdevLvolCreate, _, _>(move |p| {
            let s = Arc::clone(&s1);
            async move {
                if p.lvs_name.as_deref() != Some("lvs0") {
                    return Err(SpdkError::no_such_device());
                }
                if !s.lvols.lock().unwrap().insert(p.lvol_name.clone()) {
                    return Err(SpdkError::exists());
                }
                Ok("b2d02484-1cab-4fc6-a85b-181920650a35".to_owned())
            }
        })
        .method::<BdevLvolGetLvstores, _, _>(|_| async {
            Ok(vec![LvstoreInfo {
                uuid: "532b4df0-e7ee-4b98-872c-f55080724a0c".into(),
                name: "lvs0".into(),
                base_bdev: "aio0".into(),
                total_data_clusters: 63,
                free_clusters: 63,
                block_size: 512,
                cluster_size: 4194304,
                max_growable_size: Some(137271181312),
                ..Default::default()
            }])
        })
        .method::<VhostDeleteController, _, _>(|_| async {
            Err(SpdkError::invalid_params("No such device"))
        })
        .method::<FrameworkGetSubsystems, _, _>(|_| async {
            Ok(vec![SubsystemInfo {
                subsystem: "bdev".into(),
                depends_on: vec![],
            }])
        })
        .method::<FrameworkGetConfig, _, _>(|p| async move {
            if p.name != "bdev" {
                return Err(SpdkError::einval());
            }
            Ok(Some(vec![ConfigEntry {
                method: "bdev_malloc_create".into(),
                params: Some(json!({"name":"Malloc0","num_blocks":131072,"block_size":512})),
            }]))
        })
        .method::<BdevMallocCreate, _, _>(|p| async move {
            Ok(p.name.unwrap_or_else(|| "Malloc0".into()))
        })
        .method::<VhostCreateBlkController, _, _>(|p| async move {
            if p.dev_name == "lvs0/lvol0" || p.dev_name == "Malloc0" {
                Ok(true)
            } else {
                Err(SpdkError::invalid_params("No such device"))
            }
        })
        .method::<SpdkKillInstance, _, _>(|p| async move {
            match p.sig_name.as_str() {
                "SIGINT" | "SIGTERM" | "SIGQUIT" | "SIGHUP" | "SIGKILL" | "SIGUSR1" => Ok(true),
                _ => Err(SpdkError::einval()),
            }
        })
        .route("echo", |p| async move { Ok(p.unwrap_or(Value::Null)) })
        .route("sleep", move |p| {
            let s = Arc::clone(&s4);
            async move {
                s.sleeping.fetch_add(1, Ordering::SeqCst);
                let ms = p.as_ref().and_then(|p| p["ms"].as_u64()).unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(json!(ms))
            }
        })
        .route("big", |p| async move {
            let n = p.as_ref().and_then(|p| p["bytes"].as_u64()).unwrap_or(0) as usize;
            Ok(Value::String("x".repeat(n)))
        })
        .route("panic", |_| async move {
            if true {
                panic!("test handler panic");
            }
            Ok(Value::Null)
        })
        .route("notify", move |_| {
            let s = Arc::clone(&s2);
            async move {
                s.notified.fetch_add(1, Ordering::SeqCst);
                Ok(Value::Null)
            }
        })
        .route("notified", move |_| {
            let s = Arc::clone(&s3);
            async move { Ok(json!(s.notified.load(Ordering::SeqCst))) }
        })
}

/// A server running on a socket in a temp dir.
pub struct TestServer {
    pub dir: tempfile::TempDir,
    pub path: PathBuf,
    pub state: Arc<State>,
    stop: Option<oneshot::Sender<()>>,
    pub task: Option<JoinHandle<()>>,
}

impl TestServer {
    pub fn start() -> Self {
        Self::start_with(|c| c)
    }

    pub fn start_with(cfg: impl FnOnce(ServerConfig) -> ServerConfig) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spdk.sock");
        let mut s = Self {
            dir,
            path,
            state: Arc::new(State::default()),
            stop: None,
            task: None,
        };
        s.spawn(cfg);
        s
    }

    /// (Re)start serving on the same path.
    pub fn spawn(&mut self, cfg: impl FnOnce(ServerConfig) -> ServerConfig) {
        let server = RpcServer::bind(cfg(ServerConfig::new(&self.path))).unwrap();
        let (tx, rx) = oneshot::channel();
        let handler = Arc::new(router(Arc::clone(&self.state)));
        self.stop = Some(tx);
        self.task = Some(tokio::spawn(async move {
            server
                .serve_until(handler, async {
                    let _ = rx.await;
                })
                .await
                .unwrap();
        }));
    }

    /// Wait until `n` `sleep` calls have started on this server's state.
    pub async fn wait_sleeping(&self, n: u64) {
        for _ in 0..1000 {
            if self.state.sleeping.load(Ordering::SeqCst) >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("sleep calls did not start");
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Graceful shutdown; waits for it to finish.
    pub async fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            t.await.unwrap();
        }
    }

    /// Kill the server task: connections drop without replies.
    pub async fn kill(&mut self) {
        self.stop.take();
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }
}
