//! A frontend that stops in the middle of a message (half a header, or a header announcing a
//! payload it never sends) must not keep the server from shutting down: SIGTERM ends
//! `katablk-vhost` promptly, with a clean exit, while that frontend is still connected. And a
//! frontend whose request the server refuses is never left waiting for a reply.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::{image, Server};

fn sigterm_exits_promptly(stall: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 16 << 20);
    let sock = dir.path().join("s.sock");
    let mut srv = Server::start(&sock, &["--file", img.to_str().unwrap()]);
    let mut s = UnixStream::connect(&sock).unwrap();
    s.write_all(stall).unwrap();
    // Let the server start reading the message.
    std::thread::sleep(Duration::from_millis(300));
    let status = srv
        .daemon
        .term_within(Duration::from_secs(20))
        .expect("katablk-vhost ignored SIGTERM with a stalled frontend connected");
    assert!(status.success(), "{status}");
    drop(s);
}

#[test]
fn half_a_header_does_not_block_shutdown() {
    // GET_FEATURES (1), flags: version 1 — then nothing.
    sigterm_exits_promptly(&[1, 0, 0, 0, 1, 0]);
}

#[test]
fn a_missing_payload_does_not_block_shutdown() {
    // SET_FEATURES (2), version 1, 8 payload bytes announced, 3 sent.
    sigterm_exits_promptly(&[2, 0, 0, 0, 1, 0, 0, 0, 8, 0, 0, 0, 1, 2, 3]);
}

#[test]
fn a_refused_request_that_wants_a_reply_is_answered_by_closing() {
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 16 << 20);
    let sock = dir.path().join("s.sock");
    let mut srv = Server::start(&sock, &["--file", img.to_str().unwrap()]);
    for (code, payload) in [
        // GET_VRING_BASE of a queue that does not exist.
        (11u32, [99u32.to_le_bytes(), 0u32.to_le_bytes()].concat()),
        // GET_CONFIG far outside the config space.
        (
            24,
            [
                0x1000u32.to_le_bytes(),
                60u32.to_le_bytes(),
                0u32.to_le_bytes(),
            ]
            .concat()
            .into_iter()
            .chain([0u8; 60])
            .collect(),
        ),
    ] {
        let mut s = UnixStream::connect(&sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut msg = code.to_le_bytes().to_vec();
        msg.extend_from_slice(&1u32.to_le_bytes());
        msg.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        msg.extend_from_slice(&payload);
        s.write_all(&msg).unwrap();
        let mut buf = [0u8; 256];
        // A reply or EOF; a timeout means the frontend would wait forever.
        let _reply_or_eof = s
            .read(&mut buf)
            .unwrap_or_else(|e| panic!("request {code}: no reply and no close: {e}"));
    }
    // The server goes on serving.
    let mut c = common::Client::connect(&sock, 1, false).unwrap();
    assert_eq!(c.write(0, 0, &[5u8; 4096]), 0);
    drop(c);
    assert!(srv.stop().success());
}
