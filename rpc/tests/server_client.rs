//! Client ⇄ server over real unix sockets.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::Duration;

use common::TestServer;
use katablk_rpc::methods::*;
use katablk_rpc::server::{RpcServer, ServerConfig};
use katablk_rpc::{codes, RpcClient, RpcError, ServerError};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Read newline-terminated replies until `n` have arrived.
async fn read_replies(s: &mut UnixStream, n: usize) -> Vec<Value> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while buf.iter().filter(|b| **b == b'\n').count() < n {
        let k = tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk))
            .await
            .unwrap()
            .unwrap();
        assert!(k > 0, "EOF after {:?}", String::from_utf8_lossy(&buf));
        buf.extend_from_slice(&chunk[..k]);
    }
    buf.split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect()
}

/// Read to EOF (with a timeout), returning everything.
async fn read_to_eof(s: &mut UnixStream) -> Vec<u8> {
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    out
}

#[tokio::test]
async fn typed_calls() {
    let srv = TestServer::start();
    let c = RpcClient::connect(srv.path()).await.unwrap();
    assert_eq!(c.spdk_get_version().await.unwrap(), common::version());
    let bdevs = c.bdev_get_bdevs(None).await.unwrap();
    assert_eq!(bdevs[0].name, "Malloc0");
    assert!(c.bdev_get_bdev("nosuch").await.unwrap().is_none());
    let e = c.bdev_get_bdevs(Some("nosuch")).await.unwrap_err();
    assert!(e.is_not_found(), "{e}");
    assert_eq!(e.code(), Some(-19));
    let lvs = c
        .bdev_lvol_get_lvstores(&LvstoreSelector::by_name("lvs0"))
        .await
        .unwrap();
    assert_eq!(lvs[0].cluster_size, 4194304);
    let p = BdevLvolCreateParams {
        lvol_name: "lvol0".into(),
        size_in_mib: 64,
        thin_provision: Some(false),
        clear_method: None,
        uuid: None,
        lvs_name: Some("lvs0".into()),
    };
    c.bdev_lvol_create(&p).await.unwrap();
    let e = c.bdev_lvol_create(&p).await.unwrap_err();
    assert!(e.is_exists(), "{e}");
    let e = c.vhost_delete_controller("nosuch").await.unwrap_err();
    assert!(e.is_not_found());
    assert_eq!(e.code(), Some(codes::INVALID_PARAMS));
    let methods = c
        .rpc_get_methods(&RpcGetMethodsParams::default())
        .await
        .unwrap();
    assert!(methods.contains(&"spdk_get_version".to_owned()));
    assert!(methods.contains(&"rpc_get_methods".to_owned()));
    let echoed: Value = c.call("echo", &json!({"a": [1, 2]})).await.unwrap();
    assert_eq!(echoed, json!({"a": [1, 2]}));
}

#[tokio::test]
async fn save_and_load_config() {
    let srv = TestServer::start();
    let c = RpcClient::new(srv.path());
    let cfg = c.save_config().await.unwrap();
    assert_eq!(cfg.subsystems.len(), 1);
    assert_eq!(
        cfg.subsystems[0].config.as_ref().unwrap()[0].method,
        "bdev_malloc_create"
    );
    let skipped = c.load_config(&cfg).await.unwrap();
    assert!(skipped.is_empty());
}

#[tokio::test]
async fn pipelined_requests_answered_in_order() {
    let srv = TestServer::start();
    let mut s = UnixStream::connect(srv.path()).await.unwrap();
    // Three requests in one write, no separators; the first is the slowest.
    s.write_all(
        br#"{"jsonrpc":"2.0","id":1,"method":"sleep","params":{"ms":300}}{"jsonrpc":"2.0","id":2,"method":"sleep","params":{"ms":0}}{"jsonrpc":"2.0","id":"three","method":"spdk_get_version"}"#,
    )
    .await
    .unwrap();
    let r = read_replies(&mut s, 3).await;
    assert_eq!(r[0], json!({"jsonrpc":"2.0","id":1,"result":300}));
    assert_eq!(r[1], json!({"jsonrpc":"2.0","id":2,"result":0}));
    assert_eq!(r[2]["id"], "three");
    assert_eq!(r[2]["result"]["version"], "SPDK v26.09-pre");
}

#[tokio::test]
async fn handlers_run_concurrently_on_one_connection() {
    let srv = TestServer::start();
    let mut s = UnixStream::connect(srv.path()).await.unwrap();
    let mut req = Vec::new();
    for id in 0..10 {
        req.extend_from_slice(
            format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"sleep","params":{{"ms":300}}}}"#)
                .as_bytes(),
        );
    }
    let t = std::time::Instant::now();
    s.write_all(&req).await.unwrap();
    let r = read_replies(&mut s, 10).await;
    assert!(
        t.elapsed() < Duration::from_millis(2500),
        "handlers serialized: {:?}",
        t.elapsed()
    );
    for (i, v) in r.iter().enumerate() {
        assert_eq!(v["id"], i);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_pipelined_on_one_connection() {
    let srv = TestServer::start();
    let s = UnixStream::connect(srv.path()).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    let n = 5000;
    let writer = tokio::spawn(async move {
        let mut req = Vec::new();
        for id in 0..n {
            req.extend_from_slice(
                format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"echo","params":{{"i":{id}}}}}"#)
                    .as_bytes(),
            );
        }
        wr.write_all(&req).await.unwrap();
        wr
    });
    let mut dec = katablk_rpc::wire::StreamDecoder::default();
    let mut buf = vec![0u8; 65536];
    let mut next = 0u64;
    while next < n {
        let k = tokio::time::timeout(Duration::from_secs(20), rd.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(k > 0);
        dec.feed(&buf[..k]);
        while let Some(v) = dec.next_value().unwrap() {
            assert_eq!(v["id"], next);
            assert_eq!(v["result"]["i"], next);
            next += 1;
        }
    }
    drop(writer.await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_clients() {
    let srv = TestServer::start();
    let mut tasks = Vec::new();
    for client in 0..20 {
        let path = srv.path().to_owned();
        tasks.push(tokio::spawn(async move {
            let c = RpcClient::new(path);
            // Each client also pipelines: 10 tasks share it.
            let mut inner = Vec::new();
            for t in 0..10 {
                let c = c.clone();
                inner.push(tokio::spawn(async move {
                    for i in 0..10 {
                        let v = json!({"client": client, "task": t, "i": i});
                        let back: Value = c.call("echo", &v).await.unwrap();
                        assert_eq!(back, v);
                    }
                }));
            }
            for t in inner {
                t.await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test]
async fn large_request_and_response() {
    let srv = TestServer::start();
    let c = RpcClient::new(srv.path());
    let n = 8 * 1024 * 1024;
    let s: String = c.call("big", &json!({"bytes": n})).await.unwrap();
    assert_eq!(s.len(), n);
    let payload = "y".repeat(5 * 1024 * 1024);
    let back: Value = c.call("echo", &json!({"s": payload})).await.unwrap();
    assert_eq!(back["s"].as_str().unwrap().len(), payload.len());
}

#[tokio::test]
async fn request_written_byte_by_byte() {
    let srv = TestServer::start();
    let mut s = UnixStream::connect(srv.path()).await.unwrap();
    // SPDK's python client pretty-prints requests over several lines.
    let req = "{\n  \"jsonrpc\": \"2.0\",\n  \"method\": \"echo\",\n  \"id\": 7,\n  \"params\": {\"s\": \"}{\\\"\"}\n}";
    for b in req.as_bytes() {
        s.write_all(&[*b]).await.unwrap();
        s.flush().await.unwrap();
        tokio::task::yield_now().await;
    }
    let r = read_replies(&mut s, 1).await;
    assert_eq!(r[0], json!({"jsonrpc":"2.0","id":7,"result":{"s":"}{\""}}));
}

#[tokio::test]
async fn bad_json_gets_parse_error_then_close() {
    let srv = TestServer::start();
    let mut s = UnixStream::connect(srv.path()).await.unwrap();
    s.write_all(br#"{"jsonrpc":"2.0","id":1,"method":"spdk_get_version"}{"jsonrpc":"2.0","id":3,"method":]}"#)
        .await
        .unwrap();
    let out = read_to_eof(&mut s).await;
    let lines: Vec<Value> = out
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{}", String::from_utf8_lossy(&out));
    assert_eq!(lines[0]["id"], 1);
    assert_eq!(lines[1]["id"], Value::Null);
    assert_eq!(lines[1]["error"]["code"], codes::PARSE_ERROR);
}

#[tokio::test]
async fn truncated_request_at_eof() {
    let srv = TestServer::start();
    let mut s = UnixStream::connect(srv.path()).await.unwrap();
    s.write_all(br#"{"jsonrpc":"2.0","id":3,"meth"#)
        .await
        .unwrap();
    s.shutdown().await.unwrap();
    let out = read_to_eof(&mut s).await;
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["error"]["code"], codes::PARSE_ERROR);
}

#[tokio::test]
async fn request_without_jsonrpc_member_is_accepted() {
    // SPDK answers it (err_malformed_json.json "no_jsonrpc_field").
    let srv = TestServer::start();
    let mut s = UnixStream::connect(srv.path()).await.unwrap();
    s.write_all(br#"{"id":4,"method":"spdk_get_version"}"#)
        .await
        .unwrap();
    let r = read_replies(&mut s, 1).await;
    assert_eq!(
        r[0],
        json!({"jsonrpc":"2.0","id":4,"result":{"version":"SPDK v26.09-pre","fields":{"major":26,"minor":9,"patch":0,"suffix":"-pre"}}})
    );
}

#[tokio::test]
async fn wrong_types_unknown_params_unknown_method() {
    let srv = TestServer::start();
    let c = RpcClient::new(srv.path());
    let e = c
        .call::<_, Value>("bdev_get_bdevs", &json!({"name": 7}))
        .await
        .unwrap_err();
    match &e {
        RpcError::Spdk { code, message } => {
            assert_eq!(*code, codes::INVALID_PARAMS);
            assert!(
                message.contains("name") && message.contains("invalid type"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    let e = c
        .call::<_, Value>("bdev_get_bdevs", &json!({"nam": "Malloc0"}))
        .await
        .unwrap_err();
    match &e {
        RpcError::Spdk { code, message } => {
            assert_eq!(*code, codes::INVALID_PARAMS);
            assert!(message.contains("unknown field `nam`"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    let e = c
        .call::<_, Value>("spdk_get_version", &json!({"x": 1}))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(codes::INVALID_PARAMS));
    let e = c.call::<_, Value>("no_such_method", &()).await.unwrap_err();
    match e {
        RpcError::Spdk { code, message } => {
            assert_eq!(code, codes::METHOD_NOT_FOUND);
            assert_eq!(message, "Method not found");
        }
        other => panic!("{other:?}"),
    }
    // Result of the wrong type on the client side.
    let e = c.call::<_, u64>("spdk_get_version", &()).await.unwrap_err();
    assert!(matches!(e, RpcError::Decode { .. }), "{e:?}");
}

#[tokio::test]
async fn oversized_message_rejected_then_closed() {
    let srv = TestServer::start_with(|c| c.max_message_size(1024));
    let mut s = UnixStream::connect(srv.path()).await.unwrap();
    let big = format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"echo","params":{{"s":"{}"}}}}"#,
        "z".repeat(4096)
    );
    s.write_all(br#"{"jsonrpc":"2.0","id":0,"method":"spdk_get_version"}"#)
        .await
        .unwrap();
    // The server may close before it has read everything: ignore EPIPE.
    let _ = s.write_all(big.as_bytes()).await;
    let out = read_to_eof(&mut s).await;
    let lines: Vec<Value> = out
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["id"], 0);
    assert_eq!(lines[1]["error"]["code"], codes::INVALID_REQUEST);
    assert!(lines[1]["error"]["message"]
        .as_str()
        .unwrap()
        .contains("1024"));
}

#[tokio::test]
async fn client_rejects_oversized_reply() {
    let srv = TestServer::start();
    let c = RpcClient::builder(srv.path())
        .max_message_size(1000)
        .build();
    let e = c
        .call::<_, String>("big", &json!({"bytes": 5000}))
        .await
        .unwrap_err();
    assert!(
        matches!(e, RpcError::Disconnected(ref m) if m.contains("maximum size")),
        "{e:?}"
    );
    // Small replies still work (on a new connection).
    assert!(c
        .call::<_, String>("big", &json!({"bytes": 10}))
        .await
        .is_ok());
}

#[tokio::test]
async fn notification_gets_no_reply() {
    let srv = TestServer::start();
    let mut s = UnixStream::connect(srv.path()).await.unwrap();
    s.write_all(
        br#"{"jsonrpc":"2.0","method":"notify"}{"jsonrpc":"2.0","method":"notify","params":{}}"#,
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.write_all(br#"{"jsonrpc":"2.0","id":9,"method":"notified"}"#)
        .await
        .unwrap();
    s.shutdown().await.unwrap();
    let out = read_to_eof(&mut s).await;
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v, json!({"jsonrpc":"2.0","id":9,"result":2}));
}

#[tokio::test]
async fn batch_array_is_invalid_request() {
    let srv = TestServer::start();
    let mut s = UnixStream::connect(srv.path()).await.unwrap();
    s.write_all(br#"[{"jsonrpc":"2.0","id":1,"method":"spdk_get_version"},{"jsonrpc":"2.0","id":2,"method":"spdk_get_version"}]"#)
        .await
        .unwrap();
    s.write_all(br#" 42 "not a request" {"jsonrpc":"2.0","id":5,"method":"spdk_get_version"}"#)
        .await
        .unwrap();
    let r = read_replies(&mut s, 4).await;
    for v in &r[..3] {
        assert_eq!(v["error"]["code"], codes::INVALID_REQUEST, "{v}");
        assert_eq!(v["id"], Value::Null);
    }
    assert_eq!(r[3]["id"], 5);
    assert!(r[3]["result"].is_object());
}

#[tokio::test]
async fn handler_panic_is_internal_error() {
    let srv = TestServer::start();
    let c = RpcClient::new(srv.path());
    let e = c.call::<_, Value>("panic", &()).await.unwrap_err();
    assert_eq!(e.code(), Some(codes::INTERNAL_ERROR));
    // Same connection, server alive.
    assert!(c.spdk_get_version().await.is_ok());
}

#[tokio::test]
async fn client_timeout_then_recovers() {
    let srv = TestServer::start();
    let c = RpcClient::builder(srv.path())
        .timeout(Duration::from_millis(200))
        .build();
    let e = c
        .call::<_, Value>("sleep", &json!({"ms": 1000}))
        .await
        .unwrap_err();
    assert!(matches!(e, RpcError::Timeout { .. }), "{e:?}");
    assert!(e.is_transport());
    // The late reply is dropped; later calls on the same connection still match up.
    let v: u64 = c
        .call_with("sleep", &json!({"ms": 1}), false, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(v, 1);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(c.spdk_get_version().await.is_ok());
}

#[tokio::test]
async fn connect_error_without_server() {
    let dir = tempfile::tempdir().unwrap();
    let c = RpcClient::new(dir.path().join("none.sock"));
    let e = c.spdk_get_version().await.unwrap_err();
    assert!(matches!(e, RpcError::Connect { .. }), "{e:?}");
    assert!(RpcClient::connect(dir.path().join("none.sock"))
        .await
        .is_err());
}

#[tokio::test]
async fn server_restart_client_reconnects() {
    let mut srv = TestServer::start();
    let c = RpcClient::new(srv.path());
    assert!(c.spdk_get_version().await.is_ok());
    srv.stop().await;
    assert!(!srv.path().exists(), "socket file removed on shutdown");
    srv.spawn(|c| c);
    // The old connection is dead; the client reconnects transparently.
    assert!(c.spdk_get_version().await.is_ok());
    let p = BdevMallocCreateParams {
        num_blocks: 8,
        block_size: 512,
        name: Some("M".into()),
        ..Default::default()
    };
    assert_eq!(c.bdev_malloc_create(&p).await.unwrap(), "M");
}

#[tokio::test]
async fn in_flight_call_when_server_dies() {
    let mut srv = TestServer::start();
    let c = RpcClient::new(srv.path());
    let c2 = c.clone();
    let idem = tokio::spawn(async move {
        c2.call_with::<_, u64>("sleep", &json!({"ms": 400}), true, Duration::from_secs(10))
            .await
    });
    let c3 = c.clone();
    let mutation = tokio::spawn(async move {
        c3.call_with::<_, u64>("sleep", &json!({"ms": 400}), false, Duration::from_secs(10))
            .await
    });
    srv.wait_sleeping(2).await;
    // Bring up the replacement first (a new socket at the same path), then kill the old one.
    std::fs::remove_file(srv.path()).unwrap();
    let old = srv.task.take().unwrap();
    srv.spawn(|c| c);
    old.abort();
    let _ = old.await;
    // Idempotent: retried once on the new server. Mutation: reported as lost.
    assert_eq!(idem.await.unwrap().unwrap(), 400);
    let e = mutation.await.unwrap().unwrap_err();
    assert!(matches!(e, RpcError::Disconnected(_)), "{e:?}");
    // The old server's shutdown did not remove the new server's socket.
    assert!(c.spdk_get_version().await.is_ok());
}

#[tokio::test]
async fn graceful_shutdown_finishes_in_flight() {
    let mut srv = TestServer::start();
    let c = RpcClient::new(srv.path());
    let c2 = c.clone();
    let call = tokio::spawn(async move { c2.call::<_, u64>("sleep", &json!({"ms": 300})).await });
    srv.wait_sleeping(1).await;
    srv.stop().await;
    assert_eq!(call.await.unwrap().unwrap(), 300);
    assert!(!srv.path().exists());
    let e = c.spdk_get_version().await.unwrap_err();
    assert!(matches!(e, RpcError::Connect { .. }), "{e:?}");
}

#[tokio::test]
async fn socket_setup() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    // Mode 0600 by default.
    let server = RpcServer::bind(ServerConfig::new(&path)).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // A live server's socket is not stolen.
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let h = Arc::new(common::router(Arc::default()));
    let task = tokio::spawn(server.serve_until(h, async {
        let _ = rx.await;
    }));
    assert!(matches!(
        RpcServer::bind(ServerConfig::new(&path)),
        Err(ServerError::InUse(_))
    ));
    tx.send(()).unwrap();
    task.await.unwrap().unwrap();
    // A stale socket (nobody listening) is replaced.
    let stale = std::os::unix::net::UnixListener::bind(&path).unwrap();
    drop(stale);
    assert!(path.exists());
    let gid = nix_getgid();
    let server = RpcServer::bind(ServerConfig::new(&path).mode(0o660).gid(gid)).unwrap();
    let md = std::fs::metadata(&path).unwrap();
    assert_eq!(md.permissions().mode() & 0o777, 0o660);
    assert_eq!(std::os::unix::fs::MetadataExt::gid(&md), gid);
    drop(server);
    assert!(
        !path.exists(),
        "dropping an unserved server removes its socket"
    );
    // Regular files are never removed.
    let file = dir.path().join("file");
    std::fs::write(&file, b"data").unwrap();
    assert!(matches!(
        RpcServer::bind(ServerConfig::new(&file)),
        Err(ServerError::NotASocket(_))
    ));
    assert_eq!(std::fs::read(&file).unwrap(), b"data");
    // sun_path limit.
    let long = dir.path().join("x".repeat(120));
    let e = RpcServer::bind(ServerConfig::new(&long)).unwrap_err();
    assert!(
        matches!(e, ServerError::PathTooLong { max: 107, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("107"));
}

/// The current process's gid, from /proc (no libc dependency).
fn nix_getgid() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("Gid:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A handler written as a plain `async fn`, the way the target daemon may implement it.
struct Plain;

impl katablk_rpc::Handler for Plain {
    async fn call(
        &self,
        method: &str,
        params: Option<Value>,
    ) -> Result<Value, katablk_rpc::SpdkError> {
        match method {
            "spdk_get_version" => {
                let _: NoParams = katablk_rpc::wire::typed(params)?;
                tokio::task::yield_now().await;
                Ok(serde_json::to_value(common::version()).unwrap())
            }
            _ => Err(katablk_rpc::SpdkError::method_not_found()),
        }
    }
}

#[tokio::test]
async fn async_fn_handler() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plain.sock");
    let server = RpcServer::bind(ServerConfig::new(&path)).unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.serve_until(Arc::new(Plain), async {
        let _ = rx.await;
    }));
    let c = RpcClient::new(&path);
    assert_eq!(c.spdk_get_version().await.unwrap(), common::version());
    assert_eq!(
        c.rpc_get_methods(&Default::default())
            .await
            .unwrap_err()
            .code(),
        Some(codes::METHOD_NOT_FOUND)
    );
    tx.send(()).unwrap();
    task.await.unwrap().unwrap();
}

#[test]
fn group_by_name() {
    let c = ServerConfig::new("/tmp/x.sock").group("root").unwrap();
    assert_eq!(c.gid, Some(0));
    assert!(matches!(
        ServerConfig::new("/tmp/x.sock").group("no-such-group-katablk"),
        Err(ServerError::UnknownGroup(_))
    ));
}

#[tokio::test]
async fn cancelled_calls_leave_the_connection_usable() {
    let srv = TestServer::start();
    let c = RpcClient::new(srv.path());
    for _ in 0..20 {
        let c2 = c.clone();
        let t = tokio::spawn(async move {
            c2.call::<_, String>("big", &json!({"bytes": 1 << 16}))
                .await
        });
        tokio::task::yield_now().await;
        t.abort();
        // Dropped mid-flight, with the request possibly half queued: the stream stays in sync.
        let _ = tokio::time::timeout(
            Duration::from_millis(1),
            c.call::<_, Value>("sleep", &json!({"ms": 50})),
        )
        .await;
    }
    let v: Value = c.call("echo", &json!({"after": "cancel"})).await.unwrap();
    assert_eq!(v, json!({"after": "cancel"}));
}

/// Replay SPDK's recorded raw-socket cases (`samples/err_malformed_json.json`).
#[tokio::test]
async fn spdk_malformed_json_cases() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/samples/err_malformed_json.json"
    ))
    .unwrap();
    let cases: Value = serde_json::from_str(&text).unwrap();
    let srv = TestServer::start();
    for (name, case) in cases.as_object().unwrap() {
        let sent = case["sent"].as_str().unwrap();
        let mut s = UnixStream::connect(srv.path()).await.unwrap();
        s.write_all(sent.as_bytes()).await.unwrap();
        let spdk_closed = case["server_closed"].as_bool().unwrap();
        if !spdk_closed {
            // SPDK kept the connection open: so do we, and give the same answer if any.
            let mut buf = vec![0u8; 4096];
            let expected = case["response"].as_str().unwrap();
            if expected.is_empty() {
                let r = tokio::time::timeout(Duration::from_millis(300), s.read(&mut buf)).await;
                assert!(r.is_err(), "{name}: server answered or closed early: {r:?}");
            } else {
                // Byte for byte: SPDK's reply is one line ending in '\n'.
                let mut got = Vec::new();
                while !got.ends_with(b"\n") {
                    let k = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
                        .await
                        .unwrap()
                        .unwrap();
                    assert!(k > 0, "{name}: EOF");
                    got.extend_from_slice(&buf[..k]);
                }
                assert_eq!(String::from_utf8(got).unwrap(), expected, "{name}");
                continue;
            }
            // Then SPDK saw the half-close and closed without a word; we also close, with a
            // -32700 reply first.
            s.shutdown().await.unwrap();
        }
        let out = read_to_eof(&mut s).await;
        let v: Value = serde_json::from_slice(&out).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(v["error"]["code"], codes::PARSE_ERROR, "{name}");
        assert_eq!(v["id"], Value::Null, "{name}");
    }
}

/// The client against SPDK's recorded replies: a fake server answers each call with the
/// sample for it, and checks the params the typed client sent are the recorded ones.
#[tokio::test]
async fn typed_client_decodes_every_spdk_sample() {
    use katablk_rpc::server::Router;
    use katablk_rpc::wire::{typed, Response};
    use katablk_rpc::SpdkError;
    use std::sync::Mutex;

    type Expect = Option<(String, Option<Value>, Result<Value, SpdkError>)>;
    let samples = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/samples");
    let reqs: serde_json::Map<String, Value> = serde_json::from_str(
        &std::fs::read_to_string(format!("{samples}/_requests.json")).unwrap(),
    )
    .unwrap();
    let expect: Arc<Mutex<Expect>> = Arc::default();

    let mut router = Router::new();
    for m in katablk_rpc::methods::METHOD_NAMES {
        let expect = Arc::clone(&expect);
        router = router.route(*m, move |params| {
            let e = expect.lock().unwrap().take();
            async move {
                let (method, want_params, reply) = e.unwrap();
                assert_eq!(
                    params, want_params,
                    "{method}: params sent differ from SPDK's client"
                );
                reply
            }
        });
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fake-spdk.sock");
    let server = RpcServer::bind(ServerConfig::new(&path)).unwrap();
    tokio::spawn(server.serve(Arc::new(router)));
    let c = RpcClient::new(&path);

    async fn check<M: Method>(
        c: &RpcClient,
        params: Option<Value>,
        reply: &Result<Value, SpdkError>,
    ) {
        let p: M::Params = typed(params).unwrap();
        match (c.call_method::<M>(&p).await, reply) {
            (Ok(got), Ok(want)) => {
                assert_eq!(&serde_json::to_value(got).unwrap(), want, "{}", M::NAME)
            }
            (Err(RpcError::Spdk { code, message }), Err(want)) => {
                assert_eq!(
                    (code, message.as_str()),
                    (want.code, want.message.as_str()),
                    "{}",
                    M::NAME
                )
            }
            (got, want) => panic!("{}: got {got:?}, want {want:?}", M::NAME),
        }
    }

    let mut checked = 0;
    for (name, req) in &reqs {
        let Some(method) = req.get("method").and_then(Value::as_str) else {
            continue;
        };
        if matches!(
            name.as_str(),
            "err_bdev_get_bdevs_unknown_param"
                | "err_bdev_get_bdevs_wrong_type"
                | "err_unknown_method"
        ) {
            continue; // not expressible with typed params
        }
        let body = std::fs::read(format!("{samples}/{name}.json")).unwrap();
        let reply: Response = serde_json::from_slice(&body).unwrap();
        let params = req.get("params").cloned();
        *expect.lock().unwrap() = Some((method.to_owned(), params.clone(), reply.payload.clone()));
        match method {
            "spdk_get_version" => check::<SpdkGetVersion>(&c, params, &reply.payload).await,
            "rpc_get_methods" => check::<RpcGetMethods>(&c, params, &reply.payload).await,
            "framework_get_subsystems" => {
                check::<FrameworkGetSubsystems>(&c, params, &reply.payload).await
            }
            "spdk_kill_instance" => check::<SpdkKillInstance>(&c, params, &reply.payload).await,
            "bdev_get_bdevs" => check::<BdevGetBdevs>(&c, params, &reply.payload).await,
            "bdev_get_iostat" => check::<BdevGetIostat>(&c, params, &reply.payload).await,
            "bdev_wait_for_examine" => {
                check::<BdevWaitForExamine>(&c, params, &reply.payload).await
            }
            "bdev_aio_create" => check::<BdevAioCreate>(&c, params, &reply.payload).await,
            "bdev_aio_delete" => check::<BdevAioDelete>(&c, params, &reply.payload).await,
            "bdev_malloc_create" => check::<BdevMallocCreate>(&c, params, &reply.payload).await,
            "bdev_null_create" => check::<BdevNullCreate>(&c, params, &reply.payload).await,
            "bdev_lvol_create_lvstore" => {
                check::<BdevLvolCreateLvstore>(&c, params, &reply.payload).await
            }
            "bdev_lvol_get_lvstores" => {
                check::<BdevLvolGetLvstores>(&c, params, &reply.payload).await
            }
            "bdev_lvol_create" => check::<BdevLvolCreate>(&c, params, &reply.payload).await,
            "bdev_lvol_get_lvols" => check::<BdevLvolGetLvols>(&c, params, &reply.payload).await,
            "bdev_lvol_delete" => check::<BdevLvolDelete>(&c, params, &reply.payload).await,
            "bdev_lvol_resize" => check::<BdevLvolResize>(&c, params, &reply.payload).await,
            "bdev_lvol_snapshot" => check::<BdevLvolSnapshot>(&c, params, &reply.payload).await,
            "bdev_lvol_clone" => check::<BdevLvolClone>(&c, params, &reply.payload).await,
            "vhost_create_blk_controller" => {
                check::<VhostCreateBlkController>(&c, params, &reply.payload).await
            }
            "vhost_delete_controller" => {
                check::<VhostDeleteController>(&c, params, &reply.payload).await
            }
            "vhost_get_controllers" => {
                check::<VhostGetControllers>(&c, params, &reply.payload).await
            }
            other => panic!("no typed check for {other}"),
        }
        checked += 1;
    }
    assert!(checked >= 50, "{checked}");
}
