//! Bdev I/O through the safe layer against a real SPDK (built with `--features spdk`, SPDK
//! found through SPDK_DIR). One SPDK application per process (DPDK initialises once), so the
//! whole sequence is one test. Without the feature the test is reported as skipped with the
//! reason.
#![allow(clippy::unwrap_used)]

#[cfg(feature = "spdk")]
mod with_spdk {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use katablk_bdev::{iovec, BlockDevice, Completion, IoChannel, IoOp, IoRequest, SubmitError};
    use katablk_spdk::app::SpdkApp;
    use katablk_spdk::bdev::SpdkBdev;
    use katablk_spdk::dma::DmaBuf;
    use katablk_spdk::env::EnvOptions;
    use katablk_spdk::thread::{Poller, Thread};
    use katablk_spdk::Error;

    fn reap(ch: &mut dyn IoChannel, n: usize) -> Vec<Completion> {
        let mut out = Vec::new();
        let t0 = Instant::now();
        while out.len() < n {
            ch.clear_notify();
            ch.poll(&mut out);
            if out.len() < n {
                ch.wait(Some(Duration::from_millis(100))).unwrap();
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "I/O timed out");
        }
        out
    }

    fn io(ch: &mut dyn IoChannel, op: IoOp, off: u64, buf: &mut [u8]) -> Result<u64, String> {
        let iov = [iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        let req = IoRequest {
            op,
            offset: off,
            len: buf.len() as u64,
            iov: if matches!(op, IoOp::Read | IoOp::Write) {
                &iov
            } else {
                &[]
            },
            token: 7,
        };
        // SAFETY: `buf` outlives the request, which is reaped before returning.
        unsafe { ch.submit(&req) }.map_err(|e| e.to_string())?;
        ch.commit().unwrap();
        let c = reap(ch, 1);
        assert_eq!(c[0].token, 7);
        c[0].result.map_err(|e| e.to_string())
    }

    fn pattern(seed: u8, len: usize) -> Vec<u8> {
        katablk_test_support::pattern::seeded(u64::from(seed), len)
    }

    fn exercise(dev: &SpdkBdev, label: &str) {
        let info = dev.info();
        assert_eq!(info.block_size, 512, "{label}");
        let mut ch = dev.open_channel(64, 8).unwrap();
        // Deep queue: 64 writes of 4 KiB in flight, scatter-gather in two segments each.
        let mut bufs: Vec<Vec<u8>> = (0..64).map(|i| pattern(i as u8, 4096)).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            let (a, z) = b.split_at_mut(1024);
            let iov = [
                iovec {
                    iov_base: a.as_mut_ptr().cast(),
                    iov_len: a.len(),
                },
                iovec {
                    iov_base: z.as_mut_ptr().cast(),
                    iov_len: z.len(),
                },
            ];
            let req = IoRequest {
                op: IoOp::Write,
                offset: i as u64 * 4096,
                len: 4096,
                iov: &iov,
                token: i as u64,
            };
            // SAFETY: the buffers live until every completion is reaped below.
            unsafe { ch.submit(&req) }.unwrap();
        }
        // The 65th request does not fit.
        let mut extra = vec![0u8; 512];
        let iov = [iovec {
            iov_base: extra.as_mut_ptr().cast(),
            iov_len: 512,
        }];
        let req = IoRequest {
            op: IoOp::Read,
            offset: 0,
            len: 512,
            iov: &iov,
            token: 99,
        };
        // SAFETY: refused, so nothing refers to the buffer afterwards.
        assert_eq!(unsafe { ch.submit(&req) }, Err(SubmitError::Full));
        assert_eq!(ch.in_flight(), 64);
        ch.commit().unwrap();
        let done = reap(&mut *ch, 64);
        let mut tokens: Vec<u64> = done.iter().map(|c| c.token).collect();
        tokens.sort();
        assert_eq!(tokens, (0..64).collect::<Vec<_>>());
        assert!(
            done.iter().all(|c| c.result == Ok(4096)),
            "{label}: {done:?}"
        );
        for i in 0..64u64 {
            let mut r = vec![0u8; 4096];
            assert_eq!(io(&mut *ch, IoOp::Read, i * 4096, &mut r), Ok(4096));
            assert_eq!(r, pattern(i as u8, 4096), "{label}: block {i}");
        }
        assert_eq!(io(&mut *ch, IoOp::Flush, 0, &mut []), Ok(0));
        if info.write_zeroes {
            let mut z = vec![0u8; 8192];
            let req = IoRequest::no_data(IoOp::WriteZeroes { unmap: false }, 8192, 8192, 3);
            // SAFETY: no buffers.
            unsafe { ch.submit(&req) }.unwrap();
            ch.commit().unwrap();
            assert_eq!(reap(&mut *ch, 1)[0].result, Ok(0));
            assert_eq!(io(&mut *ch, IoOp::Read, 8192, &mut z), Ok(8192));
            assert!(z.iter().all(|&b| b == 0), "{label}: write zeroes");
        }
        // Bad requests are refused at submission and take no slot.
        let mut b = vec![0u8; 4096];
        assert!(io(&mut *ch, IoOp::Read, 100, &mut b)
            .unwrap_err()
            .contains("misaligned"));
        let end = info.size_bytes();
        assert!(io(&mut *ch, IoOp::Read, end, &mut b)
            .unwrap_err()
            .contains("beyond"));
        let req = IoRequest {
            op: IoOp::Read,
            offset: 0,
            len: 8192,
            iov: &[iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: 4096,
            }],
            token: 1,
        };
        // SAFETY: refused.
        assert_eq!(unsafe { ch.submit(&req) }, Err(SubmitError::BadBuffers));
        assert_eq!(ch.in_flight(), 0);
        // Dropping a channel with requests in flight waits for them.
        let mut big = vec![0u8; 1 << 20];
        let iov = [iovec {
            iov_base: big.as_mut_ptr().cast(),
            iov_len: big.len(),
        }];
        let req = IoRequest {
            op: IoOp::Read,
            offset: 0,
            len: big.len() as u64,
            iov: &iov,
            token: 5,
        };
        // SAFETY: `big` outlives the channel, whose drop waits for the read.
        unsafe { ch.submit(&req) }.unwrap();
        ch.commit().unwrap();
        drop(ch);
        assert_eq!(&big[..4096], &pattern(0, 4096)[..]);
    }

    /// The channel's eventfd: readable after completions, written once until cleared (a caller
    /// that polls without sleeping never clears it), and written again after a clear.
    fn notify_once_until_cleared(dev: &SpdkBdev) {
        let mut ch = dev.open_channel(4, 1).unwrap();
        let fd = ch.notify_fd().unwrap();
        let count = |fd: i32| {
            let mut v = 0u64;
            // SAFETY: reads 8 bytes from the non-blocking eventfd into a local u64.
            let n = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
            if n == 8 {
                // Put it back, so the channel's state is unchanged.
                // SAFETY: writes 8 bytes from a local u64 to the same eventfd.
                unsafe { libc::write(fd, (&v as *const u64).cast(), 8) };
                v
            } else {
                0
            }
        };
        let readable_within = |fd: i32, ms: i32| {
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut pfd, 1, ms) == 1 }
        };
        let mut buf = vec![0u8; 4096];
        let iov = [iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        let req = IoRequest {
            op: IoOp::Read,
            offset: 0,
            len: 4096,
            iov: &iov,
            token: 1,
        };
        for _ in 0..3 {
            // SAFETY: `buf` outlives the request, reaped below.
            unsafe { ch.submit(&req) }.unwrap();
            ch.commit().unwrap();
            assert!(readable_within(fd, 5000), "no signal for a completion");
            let mut out = Vec::new();
            while out.is_empty() {
                ch.poll(&mut out);
            }
        }
        assert_eq!(
            count(fd),
            1,
            "one write for three completions without a clear"
        );
        ch.clear_notify();
        assert_eq!(count(fd), 0);
        // SAFETY: as above.
        unsafe { ch.submit(&req) }.unwrap();
        ch.commit().unwrap();
        assert!(
            readable_within(fd, 5000),
            "not signalled again after the clear"
        );
        assert_eq!(reap(ch.as_mut(), 1)[0].result, Ok(4096));
    }

    pub fn run() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("aio.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(32 << 20)
            .unwrap();
        let cfg = dir.path().join("spdk.json");
        std::fs::write(
            &cfg,
            serde_json::json!({"subsystems": [{"subsystem": "bdev", "config": [
                {"method": "bdev_malloc_create",
                 "params": {"name": "Malloc0", "num_blocks": 32768, "block_size": 512}},
                {"method": "bdev_aio_create",
                 "params": {"name": "aio0", "filename": img.to_str().unwrap(), "block_size": 512}}
            ]}]})
            .to_string(),
        )
        .unwrap();
        let opts = EnvOptions {
            name: "katablk_test".into(),
            core_mask: "0x1".into(),
            mem_size_mib: Some(1024),
            no_huge: true,
            disable_cpumask_locks: true,
            json_config: Some(cfg.to_str().unwrap().into()),
            ..Default::default()
        };
        let app = SpdkApp::start(&opts).unwrap();
        assert!(matches!(SpdkApp::start(&opts), Err(Error::AlreadyStarted)));
        let t = app.thread();
        // Messages and blocking calls reach the app thread; pollers run there.
        assert_eq!(t.run(Thread::current).unwrap(), Some(t));
        let count = Arc::new(AtomicUsize::new(0));
        let c2 = count.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        t.send(move || {
            // A poller that unregisters itself (through a message) after 3 runs.
            let slot: std::rc::Rc<std::cell::RefCell<Option<Poller>>> = Default::default();
            let s2 = slot.clone();
            let p = Poller::register(
                move || {
                    if c2.fetch_add(1, Ordering::SeqCst) + 1 == 3 {
                        let s3 = s2.clone();
                        katablk_spdk::thread::send_to_current(move || {
                            s3.borrow_mut().take();
                        })
                        .unwrap();
                    }
                    true
                },
                0,
            )
            .unwrap();
            *slot.borrow_mut() = Some(p);
            tx.send(()).unwrap();
        })
        .unwrap();
        rx.recv().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            count.load(Ordering::SeqCst),
            3,
            "the poller ran until it unregistered"
        );
        // Not from a non-SPDK thread:
        assert!(matches!(
            Poller::register(|| false, 0),
            Err(Error::NotOnSpdkThread(_))
        ));

        let e = SpdkBdev::open(t, "nosuch", false).unwrap_err();
        assert!(e.to_string().contains("nosuch"), "{e}");

        let malloc = SpdkBdev::open(t, "Malloc0", false).unwrap();
        assert_eq!(malloc.name(), "Malloc0");
        assert_eq!(malloc.product(), "Malloc disk");
        assert_eq!(malloc.info().num_blocks, 32768);
        exercise(&malloc, "malloc");
        notify_once_until_cleared(&malloc);

        let aio = SpdkBdev::open(t, "aio0", false).unwrap();
        assert_eq!(aio.product(), "AIO disk");
        exercise(&aio, "aio");
        // The AIO bdev really wrote the file.
        let data = std::fs::read(&img).unwrap();
        assert_eq!(&data[4096..8192], &pattern(1, 4096)[..]);

        // Two channels on two OS threads at once.
        let handles: Vec<_> = (0..2u8)
            .map(|k| {
                let d = malloc.clone();
                std::thread::spawn(move || {
                    let mut ch = d.open_channel(16, 4).unwrap();
                    for i in 0..200u64 {
                        let off = (u64::from(k) * 2048 + i % 512) * 4096;
                        let mut w = pattern(k ^ i as u8, 4096);
                        assert_eq!(io(&mut *ch, IoOp::Write, off, &mut w), Ok(4096));
                        let mut r = vec![0u8; 4096];
                        assert_eq!(io(&mut *ch, IoOp::Read, off, &mut r), Ok(4096));
                        assert_eq!(r, pattern(k ^ i as u8, 4096));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }

        // A queue worker polled by a reactor (SpdkRuntime): its channel lives on its SPDK thread
        // (no eventfd, no hand-off), requests complete as the thread polls.
        {
            use katablk_vhost::{StepResult, WorkerRuntime};
            let rt = katablk_spdk::runtime::SpdkRuntime::new(t, app.cores().to_vec());
            let dev = malloc.clone();
            let (res_tx, res_rx) = std::sync::mpsc::channel::<Result<(), String>>();
            struct St {
                ch: Box<dyn IoChannel>,
                wbuf: Vec<u8>,
                rbuf: Vec<u8>,
                phase: u8,
                done: usize,
                out: Vec<Completion>,
            }
            let mut st: Option<St> = None;
            let step = Box::new(move || {
                let s = st.get_or_insert_with(|| St {
                    ch: dev.open_channel(16, 2).unwrap(),
                    wbuf: pattern(77, 65536),
                    rbuf: vec![0u8; 65536],
                    phase: 0,
                    done: 0,
                    out: Vec::new(),
                });
                let submit_all = |s: &mut St, op: IoOp| {
                    for k in 0..16usize {
                        let b = if op == IoOp::Write {
                            &mut s.wbuf
                        } else {
                            &mut s.rbuf
                        };
                        let iov = [iovec {
                            iov_base: b[k * 4096..].as_mut_ptr().cast(),
                            iov_len: 4096,
                        }];
                        let req = IoRequest {
                            op,
                            offset: (1 << 20) + k as u64 * 4096,
                            len: 4096,
                            iov: &iov,
                            token: k as u64,
                        };
                        // SAFETY: the buffers live in `st` until the completions are reaped.
                        unsafe { s.ch.submit(&req) }.unwrap();
                    }
                    s.ch.commit().unwrap();
                    s.done = 0;
                };
                match s.phase {
                    0 => {
                        assert!(s.ch.notify_fd().is_none(), "not a thread-local channel");
                        submit_all(s, IoOp::Write);
                        s.phase = 1;
                    }
                    1 | 2 => {
                        s.out.clear();
                        s.done += s.ch.poll(&mut s.out);
                        if s.out.iter().any(|c| c.result != Ok(4096)) {
                            let _ = res_tx.send(Err(format!("{:?}", s.out)));
                            return StepResult::Exited;
                        }
                        if s.done == 16 && s.phase == 1 {
                            submit_all(s, IoOp::Read);
                            s.phase = 2;
                        } else if s.done == 16 {
                            let ok = s.rbuf == s.wbuf;
                            let _ = res_tx.send(if ok { Ok(()) } else { Err("data".into()) });
                            return StepResult::Exited;
                        }
                    }
                    _ => return StepResult::Exited,
                }
                StepResult::Busy
            });
            let join = rt.spawn("test-worker".into(), Some(0), step).unwrap();
            let r = res_rx.recv_timeout(Duration::from_secs(30)).unwrap();
            join.join();
            assert_eq!(r, Ok(()));
        }

        // Read-only descriptors refuse writes before they reach SPDK.
        let ro = SpdkBdev::open(t, "Malloc0", true).unwrap();
        assert!(ro.info().read_only);
        let mut ch = ro.open_channel(4, 1).unwrap();
        let mut b = vec![0u8; 512];
        assert!(io(&mut *ch, IoOp::Write, 0, &mut b)
            .unwrap_err()
            .contains("read-only"));
        drop(ch);

        // DMA-able memory from SPDK's allocator.
        let mut buf = DmaBuf::new(1 << 20, 4096).unwrap();
        assert_eq!(buf.as_mut_ptr() as usize % 4096, 0);
        assert!(buf.iter().all(|&b| b == 0));
        buf[0] = 1;
        assert!(DmaBuf::new(0, 4096).is_err());
        drop(buf);

        drop((malloc, aio, ro));
        app.stop().unwrap();
    }
}

#[test]
#[cfg_attr(
    not(feature = "spdk"),
    ignore = "needs SPDK: build with --features spdk and SPDK_DIR=<an SPDK build tree>"
)]
fn spdk_bdev_io_through_the_safe_layer() {
    #[cfg(feature = "spdk")]
    with_spdk::run();
}
