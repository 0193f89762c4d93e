//! `--metrics ADDR`: I/O counters per bdev and per controller in the Prometheus text format,
//! served over plain HTTP (`GET /metrics`).

use std::fmt::Write;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tracing::{info, warn};

use crate::state::Target;

/// One counter: name suffix, help text and how to read it from the stats.
type Series = (
    &'static str,
    &'static str,
    fn(&katablk_vhost::StatsSnapshot) -> u64,
);

/// Renders the metrics page.
pub fn render(target: &Target) -> String {
    let mut out = String::new();
    let series: [Series; 8] = [
        ("read_ops_total", "Completed reads", |s| s.read_ops),
        ("read_bytes_total", "Bytes read", |s| s.read_bytes),
        ("write_ops_total", "Completed writes", |s| s.write_ops),
        ("write_bytes_total", "Bytes written", |s| s.write_bytes),
        ("flush_ops_total", "Completed flushes", |s| s.flush_ops),
        (
            "unmap_ops_total",
            "Completed discard and write-zeroes requests",
            |s| s.unmap_ops,
        ),
        ("io_errors_total", "Requests failed by the device", |s| {
            s.io_errors
        }),
        ("bad_requests_total", "Malformed requests rejected", |s| {
            s.bad_requests
        }),
    ];
    let bdevs = target.iostat().unwrap_or_default();
    let ctrlrs = target.controller_stats().unwrap_or_default();
    for (name, help, get) in series {
        let _ = writeln!(out, "# HELP katablk_bdev_{name} {help} (per bdev).");
        let _ = writeln!(out, "# TYPE katablk_bdev_{name} counter");
        for (b, s) in &bdevs {
            let _ = writeln!(out, "katablk_bdev_{name}{{bdev=\"{}\"}} {}", esc(b), get(s));
        }
        let _ = writeln!(
            out,
            "# HELP katablk_controller_{name} {help} (per controller)."
        );
        let _ = writeln!(out, "# TYPE katablk_controller_{name} counter");
        for (c, b, s) in &ctrlrs {
            let _ = writeln!(
                out,
                "katablk_controller_{name}{{ctrlr=\"{}\",bdev=\"{}\"}} {}",
                esc(c),
                esc(b),
                get(s)
            );
        }
    }
    let qos = target.qos_stats().unwrap_or_default();
    let _ = writeln!(
        out,
        "# HELP katablk_bdev_qos_throttled_requests_total Requests that waited for the bdev's rate limits (per bdev)."
    );
    let _ = writeln!(
        out,
        "# TYPE katablk_bdev_qos_throttled_requests_total counter"
    );
    for (b, q) in &qos {
        let _ = writeln!(
            out,
            "katablk_bdev_qos_throttled_requests_total{{bdev=\"{}\"}} {}",
            esc(b),
            q.throttled_requests
        );
    }
    let _ = writeln!(
        out,
        "# HELP katablk_bdev_qos_throttled_seconds_total Time the bdev's queues held requests back for its rate limits (per bdev, summed over queues)."
    );
    let _ = writeln!(
        out,
        "# TYPE katablk_bdev_qos_throttled_seconds_total counter"
    );
    for (b, q) in &qos {
        let _ = writeln!(
            out,
            "katablk_bdev_qos_throttled_seconds_total{{bdev=\"{}\"}} {:.9}",
            esc(b),
            q.throttled_ns as f64 / 1e9
        );
    }
    let _ = writeln!(
        out,
        "# HELP katablk_controllers Number of vhost-user-blk controllers."
    );
    let _ = writeln!(out, "# TYPE katablk_controllers gauge");
    let _ = writeln!(out, "katablk_controllers {}", ctrlrs.len());
    let _ = writeln!(
        out,
        "# HELP katablk_unrestored_entries Saved configuration entries not restored (see katablk_get_unrestored)."
    );
    let _ = writeln!(out, "# TYPE katablk_unrestored_entries gauge");
    let _ = writeln!(
        out,
        "katablk_unrestored_entries {}",
        target.unrestored_count()
    );
    out
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Serves the metrics on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, target: Arc<Target>) {
    if let Ok(a) = listener.local_addr() {
        info!(addr = %a, "metrics endpoint listening");
    }
    loop {
        let (mut sock, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                warn!("metrics accept: {e}");
                continue;
            }
        };
        let target = target.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let n =
                match tokio::time::timeout(std::time::Duration::from_secs(5), sock.read(&mut buf))
                    .await
                {
                    Ok(Ok(n)) => n,
                    _ => return,
                };
            let req = String::from_utf8_lossy(&buf[..n]);
            let (status, body) = if req.starts_with("GET /metrics") || req.starts_with("GET / ") {
                let t = target.clone();
                let body = tokio::task::spawn_blocking(move || render(&t))
                    .await
                    .unwrap_or_default();
                ("200 OK", body)
            } else {
                ("404 Not Found", "not found\n".to_string())
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
        });
    }
}
