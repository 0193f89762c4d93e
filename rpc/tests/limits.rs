//! Server resource limits (issue 18 R1, R3, R4): notifications count against the in-flight
//! limit, connections are capped and time out when idle, partial messages share one memory
//! budget; and ids are echoed exactly. Limits are set small so nothing here needs many fds or
//! much memory; waits are bounded but generous.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use katablk_rpc::server::{Router, RpcServer, ServerConfig};
use katablk_rpc::RpcClient;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::Semaphore;

/// Counters of the `gate` method: calls that started, and the most running at once.
struct Gate {
    started: AtomicU64,
    running: AtomicU64,
    max_running: AtomicU64,
    done: AtomicU64,
    /// `gate` calls wait for a permit of this (closed: let everything through).
    open: Semaphore,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            started: AtomicU64::new(0),
            running: AtomicU64::new(0),
            max_running: AtomicU64::new(0),
            done: AtomicU64::new(0),
            open: Semaphore::new(0),
        }
    }
}

fn router(g: Arc<Gate>) -> Router {
    Router::new()
        .route("echo", |p| async move { Ok(p.unwrap_or(Value::Null)) })
        .route("ping", |_| async { Ok(json!("pong")) })
        .route("sleep", |p| async move {
            let ms = p.as_ref().and_then(|p| p["ms"].as_u64()).unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok(json!(ms))
        })
        .route("gate", move |_| {
            let g = Arc::clone(&g);
            async move {
                g.started.fetch_add(1, Ordering::SeqCst);
                let now = g.running.fetch_add(1, Ordering::SeqCst) + 1;
                g.max_running.fetch_max(now, Ordering::SeqCst);
                let _ = g.open.acquire().await;
                g.running.fetch_sub(1, Ordering::SeqCst);
                g.done.fetch_add(1, Ordering::SeqCst);
                Ok(Value::Null)
            }
        })
}

struct Srv {
    _dir: tempfile::TempDir,
    path: PathBuf,
    gate: Arc<Gate>,
}

fn start(cfg: impl FnOnce(ServerConfig) -> ServerConfig) -> Srv {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("spdk.sock");
    let gate = Arc::new(Gate::default());
    let server = RpcServer::bind(cfg(ServerConfig::new(&path))).unwrap();
    tokio::spawn(server.serve(Arc::new(router(Arc::clone(&gate)))));
    Srv {
        _dir: dir,
        path,
        gate,
    }
}

/// Wait (up to 20 s) for `cond`.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..2000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

/// Read one newline-terminated reply.
async fn reply(s: &mut UnixStream) -> Value {
    let mut buf = Vec::new();
    let mut b = [0u8; 1];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "EOF after {:?}", String::from_utf8_lossy(&buf));
        if b[0] == b'\n' {
            return serde_json::from_slice(&buf).unwrap();
        }
        buf.push(b[0]);
    }
}

/// Everything until EOF (up to 20 s).
async fn until_eof(s: &mut UnixStream) -> Vec<u8> {
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out))
        .await
        .expect("the server did not close the connection")
        .unwrap();
    out
}

async fn call(path: &Path, req: &str) -> Value {
    let mut s = UnixStream::connect(path).await.unwrap();
    s.write_all(req.as_bytes()).await.unwrap();
    reply(&mut s).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_count_against_the_in_flight_limit() {
    let srv = start(|c| c.max_in_flight(8));
    let mut flood = UnixStream::connect(&srv.path).await.unwrap();
    let writer = {
        let note = br#"{"jsonrpc":"2.0","method":"gate"}"#.repeat(500);
        tokio::spawn(async move {
            // Blocks once the server stops reading: that is the back-pressure under test.
            let _ = flood.write_all(&note).await;
            flood
        })
    };
    let g = Arc::clone(&srv.gate);
    eventually("8 notifications to start", || {
        g.started.load(Ordering::SeqCst) >= 8
    })
    .await;
    // A normal call on another connection is answered while the flood is stuck...
    let v = call(&srv.path, r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#).await;
    assert_eq!(v["result"], "pong");
    // ...and no more than the limit of the flood's notifications ever ran at once.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(g.started.load(Ordering::SeqCst), 8);
    assert!(g.max_running.load(Ordering::SeqCst) <= 8);
    // Open the gate: every notification runs, still at most 8 at a time.
    g.open.add_permits(Semaphore::MAX_PERMITS / 2);
    eventually("all 500 notifications to run", || {
        g.done.load(Ordering::SeqCst) == 500
    })
    .await;
    assert!(g.max_running.load(Ordering::SeqCst) <= 8);
    drop(writer.await.unwrap());
}

#[tokio::test]
async fn pipelined_calls_and_notifications_share_the_limit() {
    let srv = start(|c| c.max_in_flight(4));
    let mut s = UnixStream::connect(&srv.path).await.unwrap();
    let mut req = Vec::new();
    for i in 0..3 {
        req.extend_from_slice(format!(r#"{{"id":{i},"method":"gate"}}"#).as_bytes());
    }
    req.extend_from_slice(br#"{"method":"gate"}{"method":"gate"}{"id":9,"method":"ping"}"#);
    s.write_all(&req).await.unwrap();
    let g = Arc::clone(&srv.gate);
    eventually("4 gate calls", || g.started.load(Ordering::SeqCst) >= 4).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        g.started.load(Ordering::SeqCst),
        4,
        "3 calls + 1 notification"
    );
    g.open.add_permits(1000);
    for i in 0..3 {
        assert_eq!(reply(&mut s).await["id"], i);
    }
    assert_eq!(
        reply(&mut s).await,
        json!({"jsonrpc":"2.0","id":9,"result":"pong"})
    );
    eventually("both notifications", || g.done.load(Ordering::SeqCst) == 5).await;
}

#[tokio::test]
async fn connections_beyond_the_cap_are_refused_and_the_rest_keep_working() {
    let srv = start(|c| c.max_connections(3));
    let mut open = Vec::new();
    for _ in 0..3 {
        let mut s = UnixStream::connect(&srv.path).await.unwrap();
        // A round trip makes sure the server has accepted (and counted) the connection.
        s.write_all(br#"{"id":1,"method":"ping"}"#).await.unwrap();
        assert_eq!(reply(&mut s).await["result"], "pong");
        open.push(s);
    }
    let mut extra = UnixStream::connect(&srv.path).await.unwrap();
    let out = until_eof(&mut extra).await;
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["id"], Value::Null);
    assert_eq!(v["error"]["code"], -32603);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("too many RPC connections"),
        "{v}"
    );
    // The open connections are still served.
    for s in &mut open {
        s.write_all(br#"{"id":2,"method":"ping"}"#).await.unwrap();
        assert_eq!(reply(s).await["id"], 2);
    }
    // Closing one makes room for a new one.
    drop(open.pop());
    let path = srv.path.clone();
    let mut ok = false;
    for _ in 0..200 {
        let mut s = UnixStream::connect(&path).await.unwrap();
        s.write_all(br#"{"id":3,"method":"ping"}"#).await.unwrap();
        if reply_or_eof(&mut s).await.is_some_and(|v| v["id"] == 3) {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ok, "no connection accepted after one was closed");
}

async fn reply_or_eof(s: &mut UnixStream) -> Option<Value> {
    let mut out = Vec::new();
    let mut b = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut b))
            .await
            .unwrap()
            .unwrap();
        if n == 0 {
            return None;
        }
        out.extend_from_slice(&b[..n]);
        if out.ends_with(b"\n") {
            let v: Value = serde_json::from_slice(&out).unwrap();
            return (v["id"] != Value::Null).then_some(v);
        }
    }
}

#[tokio::test]
async fn idle_connections_are_closed_but_not_while_a_call_runs() {
    let srv = start(|c| c.idle_timeout(Some(Duration::from_millis(300))));
    // Silent: closed.
    let mut silent = UnixStream::connect(&srv.path).await.unwrap();
    assert!(until_eof(&mut silent).await.is_empty());
    // Half a message, then silence: closed too (no reply: nothing could be answered).
    let mut partial = UnixStream::connect(&srv.path).await.unwrap();
    partial.write_all(br#"{"id":1,"meth"#).await.unwrap();
    assert!(until_eof(&mut partial).await.is_empty());
    // A call that takes longer than the idle timeout still gets its reply.
    let mut busy = UnixStream::connect(&srv.path).await.unwrap();
    busy.write_all(br#"{"id":7,"method":"sleep","params":{"ms":1500}}"#)
        .await
        .unwrap();
    assert_eq!(reply(&mut busy).await["result"], 1500);
}

#[tokio::test]
async fn client_survives_the_server_idle_timeout() {
    let srv = start(|c| c.idle_timeout(Some(Duration::from_millis(200))));
    // Default client: the server closes its idle connection; the next call reconnects.
    let c = RpcClient::new(&srv.path);
    assert_eq!(c.call::<_, String>("ping", &()).await.unwrap(), "pong");
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(c.call::<_, String>("ping", &()).await.unwrap(), "pong");
    // A client that replaces idle connections itself never sends on a closing one.
    let c = RpcClient::builder(&srv.path)
        .idle_reconnect(Duration::from_millis(50))
        .build();
    for _ in 0..3 {
        assert_eq!(
            c.call::<_, Value>("echo", &json!({"a": 1})).await.unwrap(),
            json!({"a": 1})
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A partial `echo` request of about `len` bytes (no closing brackets).
fn partial_echo(len: usize) -> Vec<u8> {
    let mut m = br#"{"jsonrpc":"2.0","id":1,"method":"echo","params":{"s":""#.to_vec();
    m.resize(len, b'x');
    m
}

/// Bytes written on `s` that the peer has not read yet (`SIOCOUTQ`).
fn unread(s: &UnixStream) -> usize {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCOUTQ writes one int into `n`, a valid exclusive location; the fd is open.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::TIOCOUTQ, &mut n as *mut libc::c_int) };
    assert_eq!(r, 0, "SIOCOUTQ: {}", std::io::Error::last_os_error());
    usize::try_from(n).unwrap()
}

/// One reply that may be large: read until a chunk ends with a newline.
async fn big_reply(s: &mut UnixStream) -> Value {
    let mut out = Vec::new();
    let mut b = vec![0u8; 1 << 16];
    while !out.ends_with(b"\n") {
        let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "EOF");
        out.extend_from_slice(&b[..n]);
    }
    serde_json::from_slice(&out).unwrap()
}

/// Everything until EOF or a reset (a server closing with unread data resets the
/// connection after the bytes it wrote).
async fn until_closed(s: &mut UnixStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut b = vec![0u8; 1 << 16];
    loop {
        match tokio::time::timeout(Duration::from_secs(20), s.read(&mut b))
            .await
            .expect("the server did not close the connection")
        {
            Ok(0) | Err(_) => return out,
            Ok(n) => out.extend_from_slice(&b[..n]),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_messages_share_one_memory_budget() {
    const MIB: usize = 1 << 20;
    let srv = start(|c| {
        c.max_message_size(MIB * 5 / 2 + 4096)
            .max_buffered(3 * MIB, 0)
    });
    // A parks 1 MiB of a message: within the budget (its buffer is under 2 MiB). Wait until
    // the server has read all of it, so A is charged before B starts.
    let mut a = UnixStream::connect(&srv.path).await.unwrap();
    a.write_all(&partial_echo(MIB)).await.unwrap();
    eventually("the server to read A's bytes", || unread(&a) == 0).await;
    // B would need 2.5 MiB more: refused with ENOMEM and closed.
    let mut b = UnixStream::connect(&srv.path).await.unwrap();
    let w = tokio::spawn(async move {
        let _ = b.write_all(&partial_echo(MIB * 5 / 2)).await;
        b
    });
    let mut b = w.await.unwrap();
    let out = until_closed(&mut b).await;
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["error"]["code"], -12, "{v}");
    // A is unaffected: it finishes its message and gets the echo.
    a.write_all(br#""}}"#).await.unwrap();
    let v = big_reply(&mut a).await;
    assert!(v["result"]["s"].as_str().unwrap().len() > MIB - 100);
    // A round trip on A: its reader has given its large buffer back by now.
    a.write_all(br#"{"id":2,"method":"ping"}"#).await.unwrap();
    assert_eq!(reply(&mut a).await["id"], 2);
    // So a 2.5 MiB message fits.
    let mut msg = partial_echo(MIB * 5 / 2);
    msg.extend_from_slice(br#""}}"#);
    let mut c = UnixStream::connect(&srv.path).await.unwrap();
    let w = tokio::spawn(async move {
        c.write_all(&msg).await.unwrap();
        c
    });
    let mut c = w.await.unwrap();
    let v = big_reply(&mut c).await;
    assert!(v["result"]["s"].is_string(), "{v}");
}

#[tokio::test]
async fn per_message_limit_still_applies() {
    let srv = start(|c| c.max_message_size(4096).max_buffered(1 << 30, 0));
    let mut s = UnixStream::connect(&srv.path).await.unwrap();
    let _ = s.write_all(&partial_echo(10_000)).await;
    let out = until_closed(&mut s).await;
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["error"]["code"], -32600);
}

#[tokio::test]
async fn ids_are_echoed_exactly() {
    let srv = start(|c| c);
    for id in [
        "123456789012345678901234567890",
        "-98765432109876543210",
        "18446744073709551616",
        "1.50",
        "1e3",
        "18446744073709551615",
        "-9223372036854775808",
        "7",
        "\"s\"",
    ] {
        let mut s = UnixStream::connect(&srv.path).await.unwrap();
        s.write_all(format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"ping"}}"#).as_bytes())
            .await
            .unwrap();
        s.shutdown().await.unwrap();
        let out = String::from_utf8(until_eof(&mut s).await).unwrap();
        assert_eq!(
            out,
            format!("{{\"jsonrpc\":\"2.0\",\"id\":{id},\"result\":\"pong\"}}\n")
        );
    }
    // Invalid requests echo the exact id as well.
    let v = call(
        &srv.path,
        r#"{"id":123456789012345678901234567890,"method":5}"#,
    )
    .await;
    assert_eq!(v["error"]["code"], -32600);
    let mut s = UnixStream::connect(&srv.path).await.unwrap();
    s.write_all(br#"{"id":123456789012345678901234567890,"method":5}"#)
        .await
        .unwrap();
    s.shutdown().await.unwrap();
    let out = String::from_utf8(until_eof(&mut s).await).unwrap();
    assert!(
        out.starts_with("{\"jsonrpc\":\"2.0\",\"id\":123456789012345678901234567890,"),
        "{out}"
    );
}
