//! Prometheus metrics: per-method operation counts by result code, error counts and latency.
//! Served in the text exposition format on `--metrics ADDR` at any path.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

#[derive(Debug, Default)]
struct Inner {
    /// (method, grpc code) → count.
    ops: BTreeMap<(&'static str, String), u64>,
    /// method → (count, sum of seconds).
    latency: BTreeMap<&'static str, (u64, f64)>,
    /// Reconciliation actions by kind.
    reconcile: BTreeMap<&'static str, u64>,
    /// Published volumes by hand-over (see [`Metrics::set_published`]).
    published: BTreeMap<&'static str, u64>,
    /// Block publications that prepared kubelet's loop-device lock.
    kubelet_locks: u64,
    /// Volume id → rate-limit counters the target reported at the last scrape.
    volume_qos: BTreeMap<String, VolumeQos>,
}

/// Rate-limit counters of one published volume, as its target reports them
/// (`bdev_get_iostat`'s `katablk_qos_throttled_*`; SPDK's target has no such counters).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct VolumeQos {
    /// Requests that waited for the volume's (or its group's) limits.
    pub throttled_requests: u64,
    /// Time spent waiting, in nanoseconds summed over the volume's queues.
    pub throttled_ns: u64,
}

/// Counters shared by all services.
#[derive(Debug, Default, Clone)]
pub struct Metrics {
    inner: Arc<Mutex<Inner>>,
}

impl Metrics {
    /// Empty counters.
    pub fn new() -> Self {
        Self::default()
    }

    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        f(&mut self.inner.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Records one finished CSI call.
    pub fn observe(&self, method: &'static str, code: tonic::Code, took: Duration) {
        self.with(|i| {
            *i.ops.entry((method, format!("{code:?}"))).or_default() += 1;
            let l = i.latency.entry(method).or_default();
            l.0 += 1;
            l.1 += took.as_secs_f64();
        });
    }

    /// Records one reconciliation action (`controller_restored`, `orphan_removed`, ...).
    pub fn reconciled(&self, what: &'static str) {
        self.with(|i| *i.reconcile.entry(what).or_default() += 1);
    }

    /// Sets the gauges of what this node has published: volumes by hand-over
    /// (`block_device_node`, `direct_go`, `direct_rs`, `direct_rs_raw`) and kubelet locks.
    pub fn set_published(&self, by_handoff: BTreeMap<&'static str, u64>, kubelet_locks: u64) {
        self.with(|i| {
            i.published = by_handoff;
            i.kubelet_locks = kubelet_locks;
        });
    }

    /// Replaces the per-volume rate-limit counters (see [`VolumeQos`]).
    pub fn set_volume_qos(&self, v: BTreeMap<String, VolumeQos>) {
        self.with(|i| i.volume_qos = v);
    }

    /// The count of calls of `method` that ended with `code`.
    pub fn count(&self, method: &str, code: tonic::Code) -> u64 {
        let code = format!("{code:?}");
        self.with(|i| {
            i.ops
                .iter()
                .filter(|((m, c), _)| *m == method && *c == code)
                .map(|(_, n)| *n)
                .sum()
        })
    }

    /// The metrics in Prometheus text format.
    pub fn render(&self) -> String {
        self.with(|i| {
            let mut s = String::new();
            s.push_str("# HELP katablk_csi_operations_total CSI calls by method and gRPC code.\n");
            s.push_str("# TYPE katablk_csi_operations_total counter\n");
            for ((m, c), n) in &i.ops {
                let _ = writeln!(
                    s,
                    "katablk_csi_operations_total{{method=\"{m}\",code=\"{c}\"}} {n}"
                );
            }
            s.push_str("# HELP katablk_csi_operation_errors_total CSI calls that failed.\n");
            s.push_str("# TYPE katablk_csi_operation_errors_total counter\n");
            let mut errs: BTreeMap<&str, u64> = BTreeMap::new();
            for ((m, c), n) in &i.ops {
                if c != "Ok" {
                    *errs.entry(m).or_default() += n;
                }
            }
            for (m, n) in errs {
                let _ = writeln!(
                    s,
                    "katablk_csi_operation_errors_total{{method=\"{m}\"}} {n}"
                );
            }
            s.push_str("# HELP katablk_csi_operation_duration_seconds CSI call latency.\n");
            s.push_str("# TYPE katablk_csi_operation_duration_seconds summary\n");
            for (m, (n, sum)) in &i.latency {
                let _ = writeln!(
                    s,
                    "katablk_csi_operation_duration_seconds_sum{{method=\"{m}\"}} {sum}"
                );
                let _ = writeln!(
                    s,
                    "katablk_csi_operation_duration_seconds_count{{method=\"{m}\"}} {n}"
                );
            }
            s.push_str("# HELP katablk_csi_reconcile_actions_total Reconciliation repairs.\n");
            s.push_str("# TYPE katablk_csi_reconcile_actions_total counter\n");
            for (w, n) in &i.reconcile {
                let _ = writeln!(
                    s,
                    "katablk_csi_reconcile_actions_total{{action=\"{w}\"}} {n}"
                );
            }
            s.push_str(
                "# HELP katablk_csi_published_volumes Volumes published on this node, by how \
                 they are handed to Kata.\n",
            );
            s.push_str("# TYPE katablk_csi_published_volumes gauge\n");
            for h in [
                "block_device_node",
                "direct_go",
                "direct_rs",
                "direct_rs_raw",
            ] {
                let n = i.published.get(h).copied().unwrap_or(0);
                let _ = writeln!(s, "katablk_csi_published_volumes{{handoff=\"{h}\"}} {n}");
            }
            s.push_str(
                "# HELP katablk_csi_kubelet_locks Block volumes whose kubelet loop-device lock \
                 this driver prepared.\n",
            );
            s.push_str("# TYPE katablk_csi_kubelet_locks gauge\n");
            let _ = writeln!(s, "katablk_csi_kubelet_locks {}", i.kubelet_locks);
            s.push_str(
                "# HELP katablk_csi_volume_qos_throttled_seconds_total Time a published volume's \
                 requests waited for its rate limits.\n",
            );
            s.push_str("# TYPE katablk_csi_volume_qos_throttled_seconds_total counter\n");
            for (v, q) in &i.volume_qos {
                let _ = writeln!(
                    s,
                    "katablk_csi_volume_qos_throttled_seconds_total{{volume_id=\"{}\"}} {}",
                    label(v),
                    q.throttled_ns as f64 / 1e9
                );
            }
            s.push_str(
                "# HELP katablk_csi_volume_qos_throttled_requests_total Requests of a published \
                 volume that waited for its rate limits.\n",
            );
            s.push_str("# TYPE katablk_csi_volume_qos_throttled_requests_total counter\n");
            for (v, q) in &i.volume_qos {
                let _ = writeln!(
                    s,
                    "katablk_csi_volume_qos_throttled_requests_total{{volume_id=\"{}\"}} {}",
                    label(v),
                    q.throttled_requests
                );
            }
            s
        })
    }

    /// Serves the metrics over HTTP/1.0 on `addr` until the task is dropped; `refresh` runs
    /// before each scrape is rendered (it updates what is read from elsewhere).
    pub async fn serve<F, Fut>(self, addr: SocketAddr, refresh: F) -> std::io::Result<()>
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let l = TcpListener::bind(addr).await?;
        tracing::info!(%addr, "metrics endpoint listening");
        let refresh = Arc::new(refresh);
        loop {
            let (mut sock, _) = l.accept().await?;
            let m = self.clone();
            let refresh = refresh.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = tokio::time::timeout(Duration::from_secs(5), sock.read(&mut buf)).await;
                refresh().await;
                let body = m.render();
                let resp = format!(
                    "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
            });
        }
    }
}

/// Escapes a Prometheus label value.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters() {
        let m = Metrics::new();
        m.observe("CreateVolume", tonic::Code::Ok, Duration::from_millis(3));
        m.observe(
            "CreateVolume",
            tonic::Code::NotFound,
            Duration::from_millis(1),
        );
        m.reconciled("controller_restored");
        let t = m.render();
        assert!(t.contains("katablk_csi_operations_total{method=\"CreateVolume\",code=\"Ok\"} 1"));
        assert!(t.contains("katablk_csi_operation_errors_total{method=\"CreateVolume\"} 1"));
        assert!(t.contains("katablk_csi_reconcile_actions_total{action=\"controller_restored\"} 1"));
        assert_eq!(m.count("CreateVolume", tonic::Code::NotFound), 1);
        m.set_volume_qos(
            [(
                "lvs/a\"b".to_owned(),
                VolumeQos {
                    throttled_requests: 7,
                    throttled_ns: 1_500_000_000,
                },
            )]
            .into(),
        );
        let t = m.render();
        assert!(t.contains(
            "katablk_csi_volume_qos_throttled_seconds_total{volume_id=\"lvs/a\\\"b\"} 1.5"
        ));
        assert!(t.contains(
            "katablk_csi_volume_qos_throttled_requests_total{volume_id=\"lvs/a\\\"b\"} 7"
        ));
    }
}
