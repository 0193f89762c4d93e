//! A deterministic random-sequence fuzzer of the vhost-user message handler, run as a test.
//!
//! Each sequence opens a fresh connection to a `katablk-vhost` child process, checks that the
//! server answers (GET_FEATURES), then sends a random sequence of messages: valid headers with
//! random request codes (inside and outside the protocol's range), random flags, sizes and
//! payloads, well-formed-looking payloads with plausible but wrong values (memory tables,
//! vring setup, config space, inflight regions, memory slots), random descriptors of every kind
//! (memfds of random sizes, eventfds, pipes, sockets, directories, /dev/null), and, on a queue
//! that really runs, random descriptor chains, crafted inflight files and guest memory shrunk
//! under the queue. After every sequence the child must still be running and must not have
//! panicked; the next sequence's first request checks that it still accepts and answers new
//! connections. At the end a libblkio client does verified I/O and the server shuts down
//! cleanly.
//!
//! `KATABLK_FUZZ_SEED` (decimal or 0x-hex) and `KATABLK_FUZZ_ITERS` (number of sequences)
//! override the defaults; `KATABLK_FUZZ_ONLY=<n>` replays sequence `n` of the seed alone and
//! prints its steps. A crash is minimised (steps removed while it still reproduces on a fresh
//! server) and the test fails with the minimised sequence.
#![allow(clippy::unwrap_used)]

mod common;

use std::fmt;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{pattern, Client};
use katablk_test_support::raw::*;
use katablk_test_support::Daemon;

const DEFAULT_SEED: u64 = 0x6b61_7461_626c_6b31;
const DEFAULT_ITERS: u64 = 6000;

/// Guest memory of every sequence: a 1 MiB memfd that the frontend calls `UADDR`.
const GUEST_LEN: u64 = MIB;
/// The frontend's (made-up) address of its guest memory: the backend only uses it to translate
/// vring addresses, so it need not be where the test mapped the memfd.
const UADDR: u64 = 0x7f00_0000_0000;
/// Queues and largest queue size offered by the fuzzed server.
const NQ: u16 = 2;
const QMAX: u16 = 256;
/// Where queue `q`'s rings live in guest memory: descriptors, available ring, used ring.
fn ring(q: u16) -> (u64, u64, u64) {
    let b = u64::from(q) * 0x1000;
    (b, b + 0x400, b + 0x800)
}

/// A descriptor to attach to a message, opened when the step runs.
#[derive(Debug, Clone)]
enum Fd {
    Kind(FdKind),
    /// The sequence's guest memory file.
    Guest,
    /// The kick / call eventfd of queue 0 or 1.
    Kick(u8),
    Call(u8),
    /// A memfd of `len` bytes with `writes` written into it (a crafted inflight file).
    Filled {
        len: u64,
        writes: Vec<(u64, Vec<u8>)>,
    },
}

#[derive(Clone)]
enum Step {
    /// One `sendmsg`: `bytes` (a header and payload, or garbage) with `fds`.
    Msg {
        what: &'static str,
        bytes: Vec<u8>,
        fds: Vec<Fd>,
    },
    /// GET_FEATURES, then wait (up to 5 s) for its reply: everything before it was handled.
    Sync,
    /// The frontend writes its guest memory (skipped where the file no longer reaches).
    Guest {
        off: u64,
        data: Vec<u8>,
    },
    /// The frontend resizes its guest memory file.
    Resize(u64),
    /// The frontend kicks queue 0 or 1.
    Kick(u8),
    Sleep(u64),
}

impl fmt::Debug for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hex = |b: &[u8]| {
            let s: String = b.iter().take(64).map(|x| format!("{x:02x}")).collect();
            if b.len() > 64 {
                format!("{s}..({} bytes)", b.len())
            } else {
                s
            }
        };
        match self {
            Step::Msg { what, bytes, fds } => {
                let word = |i: usize| {
                    bytes
                        .get(i * 4..i * 4 + 4)
                        .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
                };
                match (word(0), word(1), word(2)) {
                    (Some(r), Some(fl), Some(sz)) => write!(
                        f,
                        "{what}: req {r} flags {fl:#x} size {sz} payload {} fds {fds:?}",
                        hex(&bytes[12..])
                    ),
                    _ => write!(f, "{what}: raw {} fds {fds:?}", hex(bytes)),
                }
            }
            Step::Sync => write!(f, "sync"),
            Step::Guest { off, data } => write!(f, "guest write {off:#x}: {}", hex(data)),
            Step::Resize(n) => write!(f, "resize guest memory to {n:#x}"),
            Step::Kick(q) => write!(f, "kick queue {q}"),
            Step::Sleep(ms) => write!(f, "sleep {ms} ms"),
        }
    }
}

fn msg(what: &'static str, req: u32, flags: u32, payload: &[u8], fds: Vec<Fd>) -> Step {
    Step::Msg {
        what,
        bytes: encode(req, flags, payload.len() as u32, payload),
        fds,
    }
}

/// Mostly `VERSION | NEED_REPLY`; sometimes without NEED_REPLY, with REPLY, a wrong version or
/// anything.
fn flags(rng: &mut Rng) -> u32 {
    match rng.below(60) {
        0 => 0,
        1 | 2 => VERSION,
        3 => VERSION | REPLY | NEED_REPLY,
        4 => rng.next_u32(),
        5 => 2 | NEED_REPLY,
        6 => VERSION | NEED_REPLY | (1 << rng.range(4, 31)),
        _ => VERSION | NEED_REPLY,
    }
}

fn random_fd(rng: &mut Rng) -> Fd {
    match rng.below(10) {
        0 => Fd::Guest,
        1 => Fd::Kick(rng.below(2) as u8),
        2 => Fd::Call(rng.below(2) as u8),
        _ => Fd::Kind(FdKind::random(rng)),
    }
}

fn random_fds(rng: &mut Rng, max: u64) -> Vec<Fd> {
    (0..rng.range(1, max)).map(|_| random_fd(rng)).collect()
}

/// Usually nothing; sometimes descriptors where none belong.
fn stray_fds(rng: &mut Rng) -> Vec<Fd> {
    if rng.chance(1, 40) {
        random_fds(rng, 3)
    } else {
        Vec::new()
    }
}

fn region_fd(rng: &mut Rng) -> Fd {
    match rng.below(10) {
        0..=5 => Fd::Guest,
        6..=8 => Fd::Kind(FdKind::Memfd(rng.pick(&[
            0,
            4096,
            GUEST_LEN / 2,
            GUEST_LEN,
            2 * GUEST_LEN,
        ]))),
        _ => random_fd(rng),
    }
}

fn gpa(rng: &mut Rng) -> u64 {
    match rng.below(8) {
        0..=2 => 0,
        3 => GUEST_LEN,
        4 => GUEST_LEN / 2,
        5 => 1 << 32,
        _ => rng.edgy_u64(),
    }
}

fn mem_size(rng: &mut Rng) -> u64 {
    match rng.below(10) {
        0..=3 => GUEST_LEN,
        4 => GUEST_LEN + 4096,
        5 => 4096,
        6 => 2 * GUEST_LEN,
        7 => 64 << 40,
        _ => rng.edgy_u64(),
    }
}

fn uaddr(rng: &mut Rng) -> u64 {
    match rng.below(8) {
        0..=4 => UADDR,
        5 => UADDR + GUEST_LEN,
        6 => UADDR - 4096,
        _ => rng.edgy_u64(),
    }
}

fn mmap_offset(rng: &mut Rng) -> u64 {
    match rng.below(8) {
        0..=4 => 0,
        5 => 4096,
        6 => GUEST_LEN,
        _ => rng.edgy_u64(),
    }
}

fn random_region(rng: &mut Rng) -> Vec<u8> {
    region(gpa(rng), mem_size(rng), uaddr(rng), mmap_offset(rng))
}

fn vq_index(rng: &mut Rng) -> u32 {
    match rng.below(10) {
        0..=4 => 0,
        5 | 6 => 1,
        7 => 2,
        8 => 255,
        _ => rng.edgy_u32(),
    }
}

fn vq_num(rng: &mut Rng) -> u32 {
    match rng.below(10) {
        0..=2 => 16,
        3 => 64,
        4 => 0,
        5 => 1,
        6 => 3,
        7 => rng.pick(&[128, 256, 1024, 32768, 65536]),
        _ => rng.edgy_u32(),
    }
}

/// A vring address: mostly inside guest memory (at the rings, anywhere, at the very end),
/// sometimes anywhere.
fn ring_addr(rng: &mut Rng) -> u64 {
    match rng.below(10) {
        0..=6 => {
            UADDR
                + match rng.below(5) {
                    0 => rng.pick(&[0, 0x400, 0x800, 0x1000, 0x1400, 0x1800]),
                    1 => GUEST_LEN - 2,
                    2 => GUEST_LEN - 16,
                    3 => rng.below(GUEST_LEN) & !1,
                    _ => rng.below(GUEST_LEN),
                }
        }
        _ => rng.edgy_u64(),
    }
}

/// A guest address for a descriptor buffer: mostly in guest memory, sometimes at or past its
/// end, sometimes anywhere.
fn buf_addr(rng: &mut Rng) -> u64 {
    match rng.below(10) {
        0..=5 => 0x10000 + rng.below(GUEST_LEN - 0x20000),
        6 => GUEST_LEN - rng.range(1, 600),
        7 => rng.pick(&[0, 0x400, 0x800, 0x1000]),
        8 => GUEST_LEN + rng.below(4096),
        _ => rng.edgy_u64(),
    }
}

fn desc_bytes(addr: u64, len: u32, flags: u16, next: u16) -> Vec<u8> {
    let mut d = addr.to_le_bytes().to_vec();
    d.extend_from_slice(&len.to_le_bytes());
    d.extend_from_slice(&flags.to_le_bytes());
    d.extend_from_slice(&next.to_le_bytes());
    d
}

/// Per-sequence generator state: what the generated frontend believes about its rings.
struct Gen {
    rng: Rng,
    /// The avail index last published on each queue's ring.
    avail: [u16; 2],
    /// Ring size each queue was last set up with.
    size: [u16; 2],
    /// False once a step may have desynchronised the stream (a partial header): no more syncs.
    in_sync: bool,
    steps: Vec<Step>,
}

impl Gen {
    fn push(&mut self, s: Step) {
        self.steps.push(s);
    }

    fn m(&mut self, what: &'static str, req: u32, payload: &[u8], fds: Vec<Fd>) {
        let fl = flags(&mut self.rng);
        let mut s = msg(what, req, fl, payload, fds);
        // Now and then the size field lies, or descriptors come along uninvited.
        if let Step::Msg { bytes, fds, .. } = &mut s {
            if self.rng.chance(1, 50) {
                let sz = match self.rng.below(4) {
                    0 => 0,
                    1 => MAX_MSG_SIZE as u32,
                    2 => (payload.len() as u32).wrapping_add(self.rng.range(1, 16) as u32),
                    _ => self.rng.edgy_u32(),
                };
                bytes[8..12].copy_from_slice(&sz.to_le_bytes());
                // A size larger than what follows may swallow the next message: resync no more.
                self.in_sync = false;
            }
            if self.rng.chance(1, 50) && bytes.len() > 12 {
                let keep = 12 + self.rng.below((bytes.len() - 12) as u64) as usize;
                bytes.truncate(keep);
                self.in_sync = false;
            }
            if fds.is_empty() {
                fds.extend(stray_fds(&mut self.rng));
            }
        }
        self.push(s);
    }

    fn handshake(&mut self) {
        let r = &mut self.rng;
        let features = if r.chance(9, 10) {
            F_VERSION_1 | F_PROTOCOL_FEATURES | (r.below(2) << 29)
        } else {
            r.edgy_u64()
        };
        let pf = if r.chance(9, 10) {
            PF_MQ
                | PF_REPLY_ACK
                | PF_INFLIGHT_SHMFD
                | PF_CONFIGURE_MEM_SLOTS
                | PF_CONFIG
                | PF_RESET_DEVICE
                | (r.below(2) * PF_BACKEND_REQ)
        } else {
            r.edgy_u64()
        };
        let skip_owner = r.chance(1, 20);
        self.push(msg(
            "SET_FEATURES",
            SET_FEATURES,
            VERSION,
            &features.to_le_bytes(),
            vec![],
        ));
        self.push(msg(
            "GET_PROTOCOL_FEATURES",
            GET_PROTOCOL_FEATURES,
            VERSION,
            &[],
            vec![],
        ));
        self.push(msg(
            "SET_PROTOCOL_FEATURES",
            SET_PROTOCOL_FEATURES,
            VERSION,
            &pf.to_le_bytes(),
            vec![],
        ));
        if !skip_owner {
            self.push(msg(
                "SET_OWNER",
                SET_OWNER,
                VERSION | NEED_REPLY,
                &[],
                vec![],
            ));
        }
    }

    /// The memory table, then queue `q` set up properly on its rings in guest memory.
    fn setup_queue(&mut self, q: u16) {
        let size = self.rng.pick(&[16u16, 32, 64]);
        let (d, a, u) = ring(q);
        let i = u32::from(q);
        let ok = VERSION | NEED_REPLY;
        self.push(msg(
            "SET_MEM_TABLE",
            SET_MEM_TABLE,
            ok,
            &mem_table(&[region(0, GUEST_LEN, UADDR, 0)]),
            vec![Fd::Guest],
        ));
        if self.rng.chance(1, 4) {
            self.inflight_filled();
        }
        self.push(msg(
            "SET_VRING_NUM",
            SET_VRING_NUM,
            ok,
            &vring_state(i, u32::from(size)),
            vec![],
        ));
        let base = if self.rng.chance(4, 5) {
            0
        } else {
            self.rng.edgy_u32()
        };
        self.push(msg(
            "SET_VRING_BASE",
            SET_VRING_BASE,
            ok,
            &vring_state(i, base),
            vec![],
        ));
        self.push(msg(
            "SET_VRING_ADDR",
            SET_VRING_ADDR,
            ok,
            &vring_addr(i, 0, UADDR + d, UADDR + u, UADDR + a, 0),
            vec![],
        ));
        let idx = u64::from(q).to_le_bytes();
        self.push(msg(
            "SET_VRING_CALL",
            SET_VRING_CALL,
            ok,
            &idx,
            vec![Fd::Call(q as u8)],
        ));
        self.push(msg(
            "SET_VRING_KICK",
            SET_VRING_KICK,
            ok,
            &idx,
            vec![Fd::Kick(q as u8)],
        ));
        self.push(msg(
            "SET_VRING_ENABLE",
            SET_VRING_ENABLE,
            ok,
            &vring_state(i, 1),
            vec![],
        ));
        self.size[usize::from(q)] = size;
        self.avail[usize::from(q)] = (base & 0xffff) as u16;
        if self.in_sync {
            self.push(Step::Sync);
        }
    }

    /// SET_INFLIGHT_FD with a crafted inflight file: right or wrong version and sizes, random
    /// in-flight entries, last batch head and used index.
    fn inflight_filled(&mut self) {
        let r = &mut self.rng;
        let nq = r.pick(&[1u16, 2, 2, 3, 0]);
        let qs = r.pick(&[16u16, 32, 64, 64, 128, 8]);
        let per = (16 + 16 * u64::from(qs)).div_ceil(64) * 64;
        let len = u64::from(nq.max(1)) * per;
        let mut writes = Vec::new();
        for q in 0..u64::from(nq) {
            let base = q * per;
            let mut h = Vec::new();
            h.extend_from_slice(&r.below(4).to_le_bytes()); // features
            h.extend_from_slice(&r.pick(&[1u16, 1, 1, 0, 2]).to_le_bytes()); // version
            let dn = if r.chance(4, 5) {
                qs
            } else {
                r.next_u32() as u16
            };
            h.extend_from_slice(&dn.to_le_bytes()); // desc_num
            h.extend_from_slice(&(r.below(u64::from(qs) + 4) as u16).to_le_bytes()); // last batch head
            h.extend_from_slice(&(r.next_u32() as u16 & 0x1f).to_le_bytes()); // used idx
            writes.push((base, h));
            for _ in 0..r.below(u64::from(qs).min(20)) {
                let head = r.below(u64::from(qs));
                let mut e = vec![r.pick(&[1u8, 1, 1, 0, 2]), 0, 0, 0, 0, 0, 0, 0];
                e.extend_from_slice(&r.edgy_u64().to_le_bytes()); // counter
                writes.push((base + 16 + 16 * head, e));
            }
        }
        let size = if r.chance(4, 5) { len } else { r.edgy_u64() };
        let off = if r.chance(9, 10) { 0 } else { r.edgy_u64() };
        let fd = Fd::Filled { len, writes };
        self.m(
            "SET_INFLIGHT_FD crafted",
            SET_INFLIGHT_FD,
            &inflight(size, off, nq, qs),
            vec![fd],
        );
    }

    /// Writes into queue `q`'s rings: random descriptors and virtio-blk headers, some
    /// well-formed requests, new available entries (or a wild available index), then a kick.
    fn ring_traffic(&mut self, q: u16) {
        let qi = usize::from(q);
        let size = self.size[qi].max(16);
        let (d, a, _u) = ring(q);
        let n = self.rng.range(1, 6);
        for _ in 0..n {
            let head = self.rng.below(u64::from(size)) as u16;
            match self.rng.below(6) {
                // A well-formed 3-descriptor request (read, write, flush, get id, discard...)
                0..=2 => {
                    let h1 = (head + 1) % size;
                    let h2 = (head + 2) % size;
                    let hdr = 0x8000 + 0x20 * u64::from(head);
                    let ty = self.rng.pick(&[0u32, 1, 1, 4, 8, 11, 13, 16, 99]);
                    let sector = match self.rng.below(4) {
                        0 => u64::MAX - self.rng.below(4),
                        1 => (16 * MIB / 512) - self.rng.below(4),
                        _ => self.rng.below(16 * MIB / 512),
                    };
                    let mut h = ty.to_le_bytes().to_vec();
                    h.extend_from_slice(&0u32.to_le_bytes());
                    h.extend_from_slice(&sector.to_le_bytes());
                    h.push(0xff);
                    self.push(Step::Guest { off: hdr, data: h });
                    let len = self.rng.pick(&[512u32, 4096, 16, 513, 0, 65536, 1 << 20]);
                    let write = u16::from(ty == 0 || ty == 8);
                    let data = buf_addr(&mut self.rng);
                    if ty == 11 || ty == 13 {
                        let mut seg = self.rng.edgy_u64().to_le_bytes().to_vec();
                        seg.extend_from_slice(&self.rng.edgy_u32().to_le_bytes());
                        seg.extend_from_slice(&self.rng.below(4).to_le_bytes()[..4]);
                        if data.checked_add(16).is_some_and(|e| e <= GUEST_LEN) {
                            self.push(Step::Guest {
                                off: data,
                                data: seg,
                            });
                        }
                    }
                    let mut t = desc_bytes(hdr, 16, 1, h1);
                    self.push(Step::Guest {
                        off: d + 16 * u64::from(head),
                        data: t.clone(),
                    });
                    t = desc_bytes(data, len, 1 | (write << 1), h2);
                    self.push(Step::Guest {
                        off: d + 16 * u64::from(h1),
                        data: t.clone(),
                    });
                    t = desc_bytes(hdr + 0x10, 1, 2, 0);
                    self.push(Step::Guest {
                        off: d + 16 * u64::from(h2),
                        data: t,
                    });
                }
                // Random descriptors: wild addresses, lengths, flags (indirect, loops), next.
                3 | 4 => {
                    for k in 0..self.rng.range(1, 4) {
                        let at = (head + k as u16) % size;
                        let fl = match self.rng.below(5) {
                            0 => 4,
                            1 => 1,
                            2 => 3,
                            3 => 5,
                            _ => self.rng.next_u32() as u16,
                        };
                        let len = match self.rng.below(4) {
                            0 => 16 * self.rng.range(1, 70) as u32,
                            1 => 1,
                            2 => 0,
                            _ => self.rng.edgy_u32(),
                        };
                        let next = if self.rng.chance(3, 4) {
                            self.rng.below(u64::from(size)) as u16
                        } else {
                            self.rng.next_u32() as u16
                        };
                        let t = desc_bytes(buf_addr(&mut self.rng), len, fl, next);
                        self.push(Step::Guest {
                            off: d + 16 * u64::from(at),
                            data: t,
                        });
                    }
                }
                // Random bytes over the rings.
                _ => {
                    let off = ring(q).0 + self.rng.below(0xa00);
                    let len = self.rng.range(1, 64);
                    let data = self.rng.bytes(len as usize);
                    self.push(Step::Guest { off, data });
                }
            }
            // Publish the head (or set the index to anything).
            let idx = self.avail[qi];
            if self.rng.chance(9, 10) {
                let slot = a + 4 + 2 * u64::from(idx % size);
                self.push(Step::Guest {
                    off: slot,
                    data: head.to_le_bytes().to_vec(),
                });
                let ni = idx.wrapping_add(1);
                self.avail[qi] = ni;
                self.push(Step::Guest {
                    off: a + 2,
                    data: ni.to_le_bytes().to_vec(),
                });
            } else {
                let wild = self.rng.next_u32() as u16;
                self.avail[qi] = wild;
                self.push(Step::Guest {
                    off: a + 2,
                    data: wild.to_le_bytes().to_vec(),
                });
            }
        }
        self.push(Step::Kick(q as u8));
        if self.rng.chance(1, 2) {
            let ms = self.rng.range(0, 3);
            self.push(Step::Sleep(ms));
        }
    }

    /// One random step.
    fn random_step(&mut self) {
        match self.rng.below(30) {
            // Any request code, inside the protocol's range or past it, random payload.
            0..=4 => {
                let req = match self.rng.below(6) {
                    0..=3 => self.rng.below(u64::from(LAST_REQUEST) + 8) as u32,
                    4 => self.rng.range(LAST_REQUEST as u64 + 1, 1000) as u32,
                    _ => self.rng.next_u32(),
                };
                let len = match self.rng.below(8) {
                    0 => 0,
                    1 => 8,
                    2 => 12,
                    3 => 40,
                    4 => self.rng.range(1, 300) as usize,
                    5 => self.rng.range(0, MAX_MSG_SIZE as u64 + 64) as usize,
                    _ => self.rng.pick(&[16usize, 24, 32, 48]),
                };
                let payload = self.rng.bytes(len);
                let fds = if self.rng.chance(1, 5) {
                    random_fds(&mut self.rng, 4)
                } else {
                    vec![]
                };
                self.m("random request", req, &payload, fds);
            }
            // Memory tables: plausible but wrong regions, wrong descriptor counts.
            5 | 6 => {
                let n = self.rng.pick(&[1usize, 1, 2, 3, 8]);
                let regions: Vec<Vec<u8>> = (0..n).map(|_| random_region(&mut self.rng)).collect();
                let mut p = mem_table(&regions);
                if self.rng.chance(1, 8) {
                    let lie = self.rng.pick(&[0u32, 2, 9, 32, 33, u32::MAX]);
                    p[..4].copy_from_slice(&lie.to_le_bytes());
                }
                let nfds = if self.rng.chance(7, 8) {
                    n
                } else {
                    self.rng.below(5) as usize
                };
                let fds = (0..nfds).map(|_| region_fd(&mut self.rng)).collect();
                self.m("SET_MEM_TABLE", SET_MEM_TABLE, &p, fds);
            }
            7 => {
                let p = add_mem_reg(&random_region(&mut self.rng));
                let fds = if self.rng.chance(9, 10) {
                    vec![region_fd(&mut self.rng)]
                } else {
                    vec![]
                };
                self.m("ADD_MEM_REG", ADD_MEM_REG, &p, fds);
            }
            8 => {
                let p = add_mem_reg(&random_region(&mut self.rng));
                self.m("REM_MEM_REG", REM_MEM_REG, &p, vec![]);
            }
            9 => {
                let p = vring_state(vq_index(&mut self.rng), vq_num(&mut self.rng));
                self.m("SET_VRING_NUM", SET_VRING_NUM, &p, vec![]);
            }
            10 => {
                let num = if self.rng.chance(1, 2) {
                    self.rng.below(3) as u32
                } else {
                    self.rng.edgy_u32()
                };
                let p = vring_state(vq_index(&mut self.rng), num);
                self.m("SET_VRING_BASE", SET_VRING_BASE, &p, vec![]);
            }
            11 => {
                let p = vring_state(vq_index(&mut self.rng), self.rng.next_u32());
                self.m("GET_VRING_BASE", GET_VRING_BASE, &p, vec![]);
            }
            12 => {
                let fl = if self.rng.chance(4, 5) {
                    self.rng.below(2) as u32
                } else {
                    self.rng.next_u32()
                };
                let i = vq_index(&mut self.rng);
                let (d, u, a, l) = (
                    ring_addr(&mut self.rng),
                    ring_addr(&mut self.rng),
                    ring_addr(&mut self.rng),
                    ring_addr(&mut self.rng),
                );
                self.m(
                    "SET_VRING_ADDR",
                    SET_VRING_ADDR,
                    &vring_addr(i, fl, d, u, a, l),
                    vec![],
                );
            }
            13 => {
                let num = if self.rng.chance(5, 6) {
                    self.rng.below(2) as u32
                } else {
                    self.rng.edgy_u32()
                };
                let p = vring_state(vq_index(&mut self.rng), num);
                self.m("SET_VRING_ENABLE", SET_VRING_ENABLE, &p, vec![]);
            }
            14 | 15 => {
                let req = self
                    .rng
                    .pick(&[SET_VRING_KICK, SET_VRING_CALL, SET_VRING_ERR]);
                let mut v = u64::from(vq_index(&mut self.rng) & 0xff);
                let nofd = self.rng.chance(1, 4);
                if nofd {
                    v |= 0x100;
                }
                if self.rng.chance(1, 10) {
                    v |= self.rng.next_u64() & !0x1ff;
                }
                let fds = match (nofd, self.rng.below(4)) {
                    (true, 0) => vec![random_fd(&mut self.rng)],
                    (true, _) => vec![],
                    (false, 0) => vec![],
                    (false, 1) => vec![random_fd(&mut self.rng)],
                    (false, _) => {
                        let q = (v & 1) as u8;
                        vec![if req == SET_VRING_KICK {
                            Fd::Kick(q)
                        } else {
                            Fd::Call(q)
                        }]
                    }
                };
                self.m("SET_VRING_KICK/CALL/ERR", req, &v.to_le_bytes(), fds);
            }
            16 | 17 => {
                let req = self.rng.pick(&[GET_CONFIG, SET_CONFIG]);
                let off = match self.rng.below(6) {
                    0 => 0,
                    1 => self.rng.pick(&[20u32, 32, 33, 59, 60]),
                    2 => 0x100 + self.rng.pick(&[0u32, 20, 32, 60]),
                    3 => self.rng.pick(&[0xff0u32, 0xfff, 0x1000]),
                    _ => self.rng.edgy_u32(),
                };
                let size = match self.rng.below(5) {
                    0 => 60,
                    1 => self.rng.pick(&[1u32, 4, 8, 256]),
                    2 => (MAX_MSG_SIZE - 12) as u32,
                    3 => 0,
                    _ => self.rng.edgy_u32(),
                };
                let dlen = if self.rng.chance(4, 5) {
                    (size as usize).min(MAX_MSG_SIZE - 12)
                } else {
                    self.rng.below(300) as usize
                };
                let fl = if self.rng.chance(4, 5) {
                    self.rng.below(2) as u32
                } else {
                    self.rng.next_u32()
                };
                let data = self.rng.bytes(dlen);
                self.m(
                    "GET/SET_CONFIG",
                    req,
                    &config_msg(off, size, fl, &data),
                    vec![],
                );
            }
            18 => {
                let p = inflight(
                    self.rng.edgy_u64(),
                    self.rng.edgy_u64(),
                    self.rng.pick(&[0u16, 1, 2, 3, u16::MAX]),
                    self.rng.pick(&[0u16, 1, 16, 64, 65, 128, u16::MAX]),
                );
                self.m("GET_INFLIGHT_FD", GET_INFLIGHT_FD, &p, vec![]);
            }
            19 => {
                let p = inflight(
                    {
                        let e = self.rng.edgy_u64();
                        self.rng.pick(&[0, 4096, 8192, 2112, e])
                    },
                    mmap_offset(&mut self.rng),
                    self.rng.pick(&[0u16, 1, 2, 3, u16::MAX]),
                    self.rng.pick(&[0u16, 1, 16, 64, 128, u16::MAX]),
                );
                let fds = if self.rng.chance(9, 10) {
                    vec![region_fd(&mut self.rng)]
                } else {
                    vec![]
                };
                self.m("SET_INFLIGHT_FD", SET_INFLIGHT_FD, &p, fds);
            }
            20 => self.inflight_filled(),
            21 => {
                let req = self.rng.pick(&[
                    SET_OWNER,
                    RESET_OWNER,
                    RESET_DEVICE,
                    GET_QUEUE_NUM,
                    GET_MAX_MEM_SLOTS,
                    GET_FEATURES,
                    GET_PROTOCOL_FEATURES,
                    GET_STATUS,
                    CHECK_DEVICE_STATE,
                    GET_SHMEM_CONFIG,
                    NOOP,
                ]);
                self.m("no-payload request", req, &[], vec![]);
            }
            22 => {
                let req = self.rng.pick(&[
                    SET_FEATURES,
                    SET_PROTOCOL_FEATURES,
                    SET_STATUS,
                    SET_LOG_BASE,
                ]);
                let v = self.rng.edgy_u64();
                self.m("u64 request", req, &v.to_le_bytes(), vec![]);
            }
            23 => {
                let fd = if self.rng.chance(3, 4) {
                    Fd::Kind(FdKind::Socket)
                } else {
                    random_fd(&mut self.rng)
                };
                self.m("SET_BACKEND_REQ_FD", SET_BACKEND_REQ_FD, &[], vec![fd]);
            }
            24..=26 => {
                let q = self.rng.below(u64::from(NQ)) as u16;
                self.ring_traffic(q);
            }
            27 => {
                let n = self
                    .rng
                    .pick(&[0, 4096, 0x2000, GUEST_LEN / 2, GUEST_LEN, 2 * GUEST_LEN]);
                self.push(Step::Resize(n));
                let q = self.rng.below(u64::from(NQ)) as u8;
                self.push(Step::Kick(q));
            }
            28 => {
                if self.in_sync {
                    self.push(Step::Sync);
                } else {
                    let ms = self.rng.range(0, 5);
                    self.push(Step::Sleep(ms));
                }
            }
            _ => {
                // Garbage: random bytes, or half a header.
                let n = if self.rng.chance(1, 2) {
                    self.rng.range(1, 11)
                } else {
                    self.rng.range(12, 200)
                };
                let bytes = self.rng.bytes(n as usize);
                let fds = if self.rng.chance(1, 4) {
                    random_fds(&mut self.rng, 3)
                } else {
                    vec![]
                };
                self.push(Step::Msg {
                    what: "garbage",
                    bytes,
                    fds,
                });
                self.in_sync = false;
            }
        }
    }
}

/// The steps of sequence `idx` of `seed`.
fn sequence(seed: u64, idx: u64) -> Vec<Step> {
    let mut g = Gen {
        rng: Rng::new(seed ^ idx.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(17)),
        avail: [0; 2],
        size: [16; 2],
        in_sync: true,
        steps: Vec::new(),
    };
    g.rng.next_u64();
    if g.rng.chance(6, 7) {
        g.handshake();
        if g.rng.chance(1, 2) {
            let q = g.rng.below(u64::from(NQ)) as u16;
            g.setup_queue(q);
            g.ring_traffic(q);
            if g.rng.chance(1, 3) {
                g.setup_queue(1 - q);
            }
        }
    }
    for _ in 0..g.rng.range(1, 24) {
        g.random_step();
    }
    if g.rng.chance(1, 20) {
        let n = g.rng.range(1, 11) as usize;
        let b = encode(g.rng.below(45) as u32, VERSION, 8, &[]);
        g.push(Step::Msg {
            what: "half a header, then close",
            bytes: b[..n].to_vec(),
            fds: vec![],
        });
    }
    g.steps
}

/// The fuzzed server: a `katablk-vhost` child with its stderr in a log file.
struct Backend {
    daemon: Daemon,
    socket: PathBuf,
    log: PathBuf,
    log_seen: u64,
    /// The end of the log read last time (a word may straddle two reads).
    tail: String,
}

impl Backend {
    fn start(dir: &Path, name: &str) -> Backend {
        let socket = dir.join(format!("{name}.sock"));
        let log = dir.join(format!("{name}.log"));
        let filter = std::env::var("KATABLK_FUZZ_LOG").unwrap_or_else(|_| "error".into());
        let daemon = Daemon::new(common::bin())
            .arg("--socket")
            .arg(&socket)
            .args(["--malloc", "16", "--num-queues", &NQ.to_string()])
            .args(["--queue-size", &QMAX.to_string()])
            .env("RUST_LOG", filter)
            .env("RUST_BACKTRACE", "1")
            .log(&log)
            .fresh_log()
            .wait_for_socket(&socket)
            .start();
        Backend {
            daemon,
            socket,
            log,
            log_seen: 0,
            tail: String::new(),
        }
    }

    /// The log since the last call (with the end of what was read then).
    fn new_log(&mut self) -> String {
        let mut f = File::open(&self.log).unwrap();
        f.seek(SeekFrom::Start(self.log_seen)).unwrap();
        let mut b = Vec::new();
        let _ = f.read_to_end(&mut b);
        self.log_seen += b.len() as u64;
        let s = format!("{}{}", self.tail, String::from_utf8_lossy(&b));
        let cut = s.char_indices().rev().nth(31).map(|(i, _)| i).unwrap_or(0);
        self.tail = s[cut..].to_string();
        s
    }

    /// Err if the child died or panicked.
    fn check(&mut self) -> Result<(), String> {
        let log = self.new_log();
        if let Some(st) = self.daemon.try_wait() {
            return Err(format!("katablk-vhost exited: {st}; log: {log}"));
        }
        if let Some(i) = log.find("panicked") {
            let from = log[..i].rfind('\n').map_or(0, |n| n + 1);
            let to = log[i..]
                .find("stack backtrace")
                .map_or(log.len(), |n| i + n);
            return Err(format!("katablk-vhost panicked: {}", &log[from..to]));
        }
        Ok(())
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    messages: u64,
    dropped: u64,
    sync_timeouts: u64,
}

/// Replies read so far on one connection, parsed message by message.
struct Replies {
    buf: Vec<u8>,
}

impl Replies {
    /// Reads what is there (waiting up to `timeout` for something) and returns the request
    /// codes of the complete replies now parsed. Err once the backend closed the connection.
    fn read(&mut self, raw: &mut Raw, timeout: Duration) -> Result<Vec<u32>, ()> {
        // Appends what arrived (waiting up to `timeout` for the first bytes), closing the
        // descriptors that came along.
        raw.wait_some_into(timeout, &mut self.buf).map_err(|_| ())?;
        let mut codes = Vec::new();
        while self.buf.len() >= 12 {
            let code = u32::from_le_bytes(self.buf[0..4].try_into().unwrap());
            let size = u32::from_le_bytes(self.buf[8..12].try_into().unwrap()) as usize;
            assert!(size <= MAX_MSG_SIZE, "reply {code} announces {size} bytes");
            if self.buf.len() < 12 + size {
                break;
            }
            self.buf.drain(..12 + size);
            codes.push(code);
        }
        Ok(codes)
    }
}

/// How probe failures start.
const PROBE: &str = "probe: ";

/// Connects and checks that the server answers GET_FEATURES (within 20 s).
fn probe(socket: &Path) -> Result<(Raw, Replies), String> {
    let mut raw = Raw::connect(socket);
    let mut rep = Replies { buf: Vec::new() };
    raw.send(GET_FEATURES, VERSION, &[], &[])
        .map_err(|e| format!("{PROBE}send: {e}"))?;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(20) {
        match rep.read(&mut raw, Duration::from_millis(100)) {
            Ok(codes) if codes.contains(&GET_FEATURES) => return Ok((raw, rep)),
            Ok(_) => {}
            Err(()) => return Err(format!("{PROBE}the server closed a fresh connection")),
        }
    }
    Err(format!(
        "{PROBE}the server did not answer GET_FEATURES within 20 s"
    ))
}

/// Runs one sequence on a fresh connection.
fn run(socket: &Path, scratch: &Path, steps: &[Step], counts: &mut Counts) -> Result<(), String> {
    let (mut raw, mut rep) = probe(socket)?;
    let guest = Guest::new(GUEST_LEN);
    let mut guest_len = GUEST_LEN;
    let kicks = [eventfd(), eventfd()];
    let calls = [eventfd(), eventfd()];
    for s in steps {
        match s {
            Step::Msg { bytes, fds, .. } => {
                let mut keep: Vec<OwnedFd> = Vec::new();
                let mut raw_fds = Vec::new();
                for f in fds {
                    let fd = match f {
                        Fd::Kind(k) => {
                            let o = k.open(scratch, &mut keep);
                            let r = o.as_raw_fd();
                            keep.push(o);
                            r
                        }
                        Fd::Guest => guest.file.as_raw_fd(),
                        Fd::Kick(q) => kicks[usize::from(*q)].as_raw_fd(),
                        Fd::Call(q) => calls[usize::from(*q)].as_raw_fd(),
                        Fd::Filled { len, writes } => {
                            let m = memfd(*len);
                            for (at, data) in writes {
                                if at + data.len() as u64 <= *len {
                                    std::os::unix::fs::FileExt::write_all_at(&m, data, *at)
                                        .unwrap();
                                }
                            }
                            let o = OwnedFd::from(m);
                            let r = o.as_raw_fd();
                            keep.push(o);
                            r
                        }
                    };
                    raw_fds.push(fd);
                }
                if raw.send_bytes(bytes, &raw_fds).is_err() {
                    counts.dropped += 1;
                    return Ok(());
                }
                counts.messages += 1;
                if rep.read(&mut raw, Duration::ZERO).is_err() {
                    counts.dropped += 1;
                    return Ok(());
                }
            }
            Step::Sync => {
                if raw.send(GET_FEATURES, VERSION, &[], &[]).is_err() {
                    counts.dropped += 1;
                    return Ok(());
                }
                counts.messages += 1;
                let t = Instant::now();
                loop {
                    match rep.read(&mut raw, Duration::from_millis(50)) {
                        Ok(c) if c.contains(&GET_FEATURES) => break,
                        Ok(_) if t.elapsed() > Duration::from_secs(5) => {
                            counts.sync_timeouts += 1;
                            break;
                        }
                        Ok(_) => {}
                        Err(()) => {
                            counts.dropped += 1;
                            return Ok(());
                        }
                    }
                }
            }
            Step::Guest { off, data } => {
                if off + data.len() as u64 <= guest_len {
                    guest.write(*off, data);
                }
            }
            Step::Resize(n) => {
                guest.file.set_len(*n).unwrap();
                // What lies past the smallest size the file had is never touched again.
                guest_len = guest_len.min(*n);
            }
            Step::Kick(q) => kick(&kicks[usize::from(*q)]),
            Step::Sleep(ms) => std::thread::sleep(Duration::from_millis(*ms)),
        }
    }
    Ok(())
}

/// Runs `steps` on a fresh server: Some(reason) if it crashed, panicked or stopped answering.
fn reproduces(dir: &Path, steps: &[Step]) -> Option<String> {
    let mut b = Backend::start(dir, "minimise");
    let mut c = Counts::default();
    let r = run(&b.socket, dir, steps, &mut c).and_then(|()| probe(&b.socket).map(|_| ()));
    let r = r.and_then(|()| b.check());
    r.err()
}

/// Removes steps while the failure still reproduces (bounded number of attempts).
fn minimise(dir: &Path, mut steps: Vec<Step>) -> Vec<Step> {
    let mut attempts = 0;
    let mut chunk = steps.len().div_ceil(2).max(1);
    while chunk >= 1 && attempts < 150 {
        let mut i = 0;
        let mut removed = false;
        while i < steps.len() && attempts < 150 {
            let mut cand = steps.clone();
            cand.drain(i..(i + chunk).min(steps.len()));
            attempts += 1;
            if reproduces(dir, &cand).is_some() {
                steps = cand;
                removed = true;
            } else {
                i += chunk;
            }
        }
        if chunk == 1 && !removed {
            break;
        }
        if !removed {
            chunk /= 2;
        }
        chunk = chunk.min(steps.len()).max(1);
    }
    steps
}

/// Minimises sequence `idx` of `seed` and fails the test with it.
fn fail(dir: &Path, seed: u64, idx: u64, e: &str) -> ! {
    eprintln!("sequence {idx} of seed {seed:#x} failed: {e}; minimising");
    let mini = minimise(dir, sequence(seed, idx));
    let mut s = String::new();
    for st in &mini {
        s.push_str(&format!("\n  {st:?}"));
    }
    panic!(
        "sequence {idx} of seed {seed:#x} broke the backend: {e}\nminimised to {} steps \
         (on a fresh server: {:?}):{s}",
        mini.len(),
        reproduces(dir, &mini)
    );
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    Some(match v.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).unwrap(),
        None => v.parse().unwrap(),
    })
}

#[test]
fn random_message_sequences_never_crash_the_backend() {
    let seed = env_u64("KATABLK_FUZZ_SEED").unwrap_or(DEFAULT_SEED);
    let iters = env_u64("KATABLK_FUZZ_ITERS").unwrap_or(DEFAULT_ITERS);
    let only = env_u64("KATABLK_FUZZ_ONLY");
    eprintln!(
        "fuzz_messages: seed {seed:#x}, {iters} sequences (KATABLK_FUZZ_SEED / KATABLK_FUZZ_ITERS)"
    );
    let tmp = tempfile::tempdir().unwrap();
    let (_guard, dir) = if std::env::var_os("KATABLK_FUZZ_KEEP").is_some() {
        let p = tmp.keep();
        eprintln!("fuzz_messages: server logs kept in {}", p.display());
        (None, p)
    } else {
        let p = tmp.path().to_path_buf();
        (Some(tmp), p)
    };
    let scratch = dir.join("scratch");
    std::fs::create_dir(&scratch).unwrap();
    let mut b = Backend::start(&dir, "fuzz");
    let mut counts = Counts::default();
    let t0 = Instant::now();
    let range = match only {
        Some(n) => n..n + 1,
        None => 0..iters,
    };
    let mut sequences = 0;
    let mut last = 0;
    for idx in range {
        let steps = sequence(seed, idx);
        if only.is_some() {
            for s in &steps {
                eprintln!("  {s:?}");
            }
        }
        // A sequence's damage shows as it runs, in the child's state after it, or as the next
        // sequence's probe failing (the server no longer accepting or answering).
        let r = run(&b.socket, &scratch, &steps, &mut counts).and_then(|()| b.check());
        if let Err(e) = r {
            let culprit = if e.starts_with(PROBE) && idx > 0 {
                last
            } else {
                idx
            };
            fail(&dir, seed, culprit, &e);
        }
        sequences += 1;
        last = idx;
    }
    if let Err(e) = probe(&b.socket).map(|_| ()).and_then(|()| b.check()) {
        fail(&dir, seed, last, &e);
    }
    let elapsed = t0.elapsed();
    eprintln!(
        "fuzz_messages: {sequences} sequences, {} messages sent, {} connections dropped by the \
         backend, {} syncs timed out, 0 crashes, {:.1} s",
        counts.messages,
        counts.dropped,
        counts.sync_timeouts,
        elapsed.as_secs_f64()
    );

    // A well-behaved client still does verified I/O on the fuzzed server.
    let mut c = Client::connect(&b.socket, 2, false).unwrap();
    for q in 0..2 {
        let off = (1 + q as u64) * MIB;
        let data = pattern(off, 64 * KIB as usize, 7);
        assert_eq!(c.write(q, off, &data), 0);
        assert_eq!(c.read(q, off, data.len()).unwrap(), data);
    }
    drop(c);
    b.check().unwrap();
    // And it shuts down cleanly.
    let st = b.daemon.term();
    assert!(st.success(), "katablk-vhost exited with {st} after fuzzing");
}

/// Regression (found by this fuzzer, seed 0x6b617461626c6b31 sequence 107): the request
/// counter resumes from the highest counter in the inflight region, which the frontend writes.
/// At u64::MAX the next request overflowed it and the queue worker panicked (debug builds),
/// after which the server hung. Now the counter wraps and the request is served.
#[test]
fn inflight_counter_at_u64_max_wraps() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = Backend::start(dir.path(), "counter");
    let mut raw = Raw::connect(&b.socket);
    raw.handshake();
    // One queue of 16: header (version 1, 16 descriptors), descriptor 5 done at u64::MAX.
    let per = (16 + 16 * 16u64).div_ceil(64) * 64;
    let f = memfd(per);
    let mut hdr = [0u8; 16];
    hdr[8..10].copy_from_slice(&1u16.to_le_bytes());
    hdr[10..12].copy_from_slice(&16u16.to_le_bytes());
    std::os::unix::fs::FileExt::write_all_at(&f, &hdr, 0).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &u64::MAX.to_le_bytes(), 16 + 16 * 5 + 8).unwrap();
    assert_eq!(
        raw.request(SET_INFLIGHT_FD, &inflight(per, 0, 1, 16), &[f.as_raw_fd()]),
        Reply::Ack(0)
    );
    let g = Guest::new(GUEST_LEN);
    let r = Ring::new(16);
    // The first request gets counter u64::MAX + 1.
    let q = raw.start_queue(&g, &r, 0);
    let head = g.write_request(&r, 3, 0xc20, 0xe00, 16);
    g.push_avail(&r, head);
    kick(&q.kick);
    assert!(g.wait_used(&r, 2), "second request not completed");
    assert_eq!(g.read_u8(0xc30), 0);
    b.check().unwrap();
    drop(raw);
    probe(&b.socket).unwrap();
    b.check().unwrap();
}
