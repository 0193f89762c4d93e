//! katablk-vhost driven by a real vhost-user client (libblkio's virtio-blk-vhost-user driver).
#![allow(clippy::unwrap_used)]

mod common;

use common::*;

#[test]
fn smoke_write_read() {
    let dir = tempfile::tempdir().unwrap();
    let img = temp_image(dir.path(), 64 << 20);
    let sock = dir.path().join("vhost.sock");
    let _srv = Server::start(&sock, &["--file", img.to_str().unwrap()]);
    let mut c = Client::connect(&sock, 1, false).unwrap();
    assert_eq!(c.capacity, 64 << 20);
    let data = pattern(4096, 65536, 7);
    assert_eq!(c.write(0, 4096, &data), 0);
    assert_eq!(c.read(0, 4096, 65536).unwrap(), data);
    assert_eq!(c.flush(0), 0);
}
