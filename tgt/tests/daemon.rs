//! Daemon properties: socket modes, the Prometheus endpoint, worker pinning from cpumasks.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;

use common::*;
use katablk_rpc::methods::*;
use katablk_rpc::RpcClient;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn sockets_metrics_and_pinning() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let t = Target::start(dir.path(), &["-m", "0x1", "--metrics", &addr]);
    // The RPC socket is 0600, controller sockets 0660.
    let mode = std::fs::metadata(&t.rpc).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let rpc = RpcClient::new(&t.rpc);
    let r = rt();
    r.block_on(rpc.bdev_malloc_create(&BdevMallocCreateParams {
        num_blocks: 16384,
        block_size: 512,
        name: Some("Malloc0".into()),
        ..Default::default()
    }))
    .unwrap();
    r.block_on(
        rpc.vhost_create_blk_controller(&VhostCreateBlkControllerParams {
            ctrlr: "m0".into(),
            dev_name: "Malloc0".into(),
            cpumask: Some("0x1".into()),
            ..Default::default()
        }),
    )
    .unwrap();
    // A cpumask outside -m is refused.
    let e = r
        .block_on(
            rpc.vhost_create_blk_controller(&VhostCreateBlkControllerParams {
                ctrlr: "m1".into(),
                dev_name: "Malloc0".into(),
                cpumask: Some("0x2".into()),
                ..Default::default()
            }),
        )
        .unwrap_err();
    assert!(e.to_string().contains("cpumask"), "{e}");
    let sock = t.ctrlr_socket("m0");
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);
    // The controller's workers run on CPU 0 only. A new worker names and pins itself as it
    // starts (std names a thread from inside it), so scan again until it shows both.
    let pid = t.daemon.pid();
    let mut seen = Vec::new();
    for _ in 0..300 {
        seen.clear();
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
            let task = task.unwrap().path();
            let comm = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
            if comm.starts_with("katablk-q") {
                let status = std::fs::read_to_string(task.join("status")).unwrap_or_default();
                let line = status
                    .lines()
                    .find(|l| l.starts_with("Cpus_allowed_list"))
                    .unwrap_or_default()
                    .to_string();
                seen.push(format!("{}: {line}", comm.trim()));
            }
        }
        if !seen.is_empty() && seen.iter().all(|l| l.ends_with("\t0")) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(!seen.is_empty(), "no queue workers found");
    assert!(seen.iter().all(|l| l.ends_with("\t0")), "{seen:?}");
    // I/O shows up in the metrics.
    let mut c = Client::connect(&sock, 1, false).unwrap();
    for i in 0..10u64 {
        assert_eq!(c.write(0, i * 4096, &fill(i, 4096)), 0);
    }
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
    let line = body
        .lines()
        .find(|l| l.starts_with("katablk_controller_write_ops_total{ctrlr=\"m0\""))
        .unwrap();
    assert!(line.ends_with(" 10"), "{line}");
    assert!(
        body.contains("katablk_bdev_write_ops_total{bdev=\"Malloc0\"} 10"),
        "{body}"
    );
    assert!(body.contains("katablk_controllers 1"));
}

#[test]
fn bad_json_rpc_input_gets_standard_errors() {
    let dir = tempfile::tempdir().unwrap();
    let t = Target::start(dir.path(), &[]);
    let ask = |req: &[u8]| -> String {
        let mut s = std::os::unix::net::UnixStream::connect(&t.rpc).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        s.write_all(req).unwrap();
        let mut buf = vec![0u8; 65536];
        let n = s.read(&mut buf).unwrap_or(0);
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    assert!(ask(br#"{"jsonrpc":"2.0","id":1,"method":]}"#).contains("-32700"));
    assert!(ask(br#"{"jsonrpc":"2.0","id":1,"method":"nope"}"#).contains("-32601"));
    assert!(
        ask(br#"{"jsonrpc":"2.0","id":1,"method":"bdev_get_bdevs","params":{"name":7}}"#)
            .contains("-32602")
    );
    assert!(
        ask(br#"{"jsonrpc":"2.0","id":1,"method":"bdev_get_bdevs","params":{"nam":"x"}}"#)
            .contains("-32602")
    );
    assert!(ask(br#"[{"jsonrpc":"2.0","id":1,"method":"spdk_get_version"}]"#).contains("-32600"));
    // Two pipelined requests in one write are answered in order.
    let mut s = std::os::unix::net::UnixStream::connect(&t.rpc).unwrap();
    s.write_all(br#"{"jsonrpc":"2.0","id":1,"method":"spdk_get_version"}{"jsonrpc":"2.0","id":2,"method":"bdev_get_bdevs"}"#)
        .unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let mut got = String::new();
    let mut buf = [0u8; 4096];
    while !got.contains("\"id\":2") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "connection closed: {got}");
        got.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(
        got.find("\"id\":1").unwrap() < got.find("\"id\":2").unwrap(),
        "{got}"
    );
    assert!(
        ask(br#"{"jsonrpc":"2.0","id":9,"method":"spdk_get_version"}"#).contains("katablk-target")
    );
}

#[test]
fn sessions_reported_and_delete_refused_while_connected() {
    let dir = tempfile::tempdir().unwrap();
    let t = Target::start(dir.path(), &[]);
    let rpc = RpcClient::new(&t.rpc);
    let r = rt();
    r.block_on(rpc.bdev_malloc_create(&BdevMallocCreateParams {
        num_blocks: 8192,
        block_size: 512,
        name: Some("M".into()),
        ..Default::default()
    }))
    .unwrap();
    r.block_on(
        rpc.vhost_create_blk_controller(&VhostCreateBlkControllerParams {
            ctrlr: "c".into(),
            dev_name: "M".into(),
            ..Default::default()
        }),
    )
    .unwrap();
    let c = Client::connect(&t.ctrlr_socket("c"), 1, false).unwrap();
    let list = r.block_on(rpc.vhost_get_controllers(Some("c"))).unwrap();
    assert_eq!(list[0].sessions.len(), 1);
    assert!(list[0].sessions[0].started);
    let e = r.block_on(rpc.vhost_delete_controller("c")).unwrap_err();
    assert!(e.is_busy(), "{e}");
    drop(c);
    // Once the frontend is gone the delete goes through.
    r.block_on(rpc.vhost_delete_controller("c")).unwrap();
    assert!(!t.ctrlr_socket("c").exists());
}
