//! Strict walking of split-ring descriptor chains.
//!
//! Every descriptor of a chain is read from guest memory and checked: the chain must end within
//! the queue size (no loops), an indirect descriptor must be the only descriptor of its chain,
//! point to a whole table inside guest memory and contain no nested indirect descriptors, and
//! every buffer must lie in guest memory. Readable buffers come before writable ones.

use std::ptr::NonNull;

use thiserror::Error;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::GuestMem;

const VIRTQ_DESC_F_NEXT: u16 = 1;
const VIRTQ_DESC_F_WRITE: u16 = 2;
const VIRTQ_DESC_F_INDIRECT: u16 = 4;
const DESC_SIZE: u64 = 16;

/// One buffer of a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seg {
    /// Guest physical address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// The device writes this buffer.
    pub writable: bool,
}

/// Why a chain is malformed.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum ChainError {
    /// The head or a `next` index is not below the queue size.
    #[error("descriptor index {0} out of range")]
    IndexOutOfRange(u16),
    /// The chain is longer than the queue (or indirect table) allows: a loop or a runaway chain.
    #[error("descriptor chain too long")]
    TooLong,
    /// The chain has more buffers than the request may carry.
    #[error("too many segments (more than {0})")]
    TooManySegments(usize),
    /// A descriptor could not be read from guest memory.
    #[error("descriptor at {0:#x} is not in guest memory")]
    DescUnreadable(u64),
    /// An indirect descriptor is malformed.
    #[error("bad indirect descriptor (table at {addr:#x}, length {len})")]
    BadIndirect {
        /// Table address.
        addr: u64,
        /// Table length in bytes.
        len: u32,
    },
    /// A buffer is outside guest memory.
    #[error("buffer {addr:#x}+{len} is not in guest memory")]
    BadBuffer {
        /// Buffer address.
        addr: u64,
        /// Buffer length.
        len: u32,
    },
    /// A readable buffer follows a writable one.
    #[error("readable descriptor after a writable one")]
    BadOrder,
}

/// A descriptor table: of a queue (`size` entries) or an indirect one, with its host address
/// when it lies inside one mapped region (then each descriptor is one volatile load, not a
/// region lookup).
#[derive(Clone, Copy)]
pub(crate) struct DescTable<'m> {
    mem: &'m GuestMem,
    addr: GuestAddress,
    size: u16,
    host: Option<NonNull<u8>>,
}

impl<'m> DescTable<'m> {
    /// The table of `size` descriptors at `addr`, translated here.
    pub fn new(mem: &'m GuestMem, addr: GuestAddress, size: u16) -> Self {
        let host = crate::host_range(mem, addr.0, usize::from(size) * DESC_SIZE as usize)
            .and_then(NonNull::new);
        DescTable {
            mem,
            addr,
            size,
            host,
        }
    }

    /// The table of `size` descriptors at `addr`, already translated to `host`.
    ///
    /// # Safety
    /// `host` must be the host address of the table's `size * 16` bytes in a region of `mem`.
    pub unsafe fn translated(
        mem: &'m GuestMem,
        addr: GuestAddress,
        size: u16,
        host: NonNull<u8>,
    ) -> Self {
        DescTable {
            mem,
            addr,
            size,
            host: Some(host),
        }
    }

    /// Starts loading descriptor `idx` into the cache (see [`crate::prefetch`]); nothing when
    /// it is out of range or the table is not translated.
    pub fn prefetch(&self, idx: u16) {
        if let Some(p) = self.host.filter(|_| idx < self.size) {
            crate::prefetch(
                p.as_ptr()
                    .wrapping_add(usize::from(idx) * DESC_SIZE as usize),
            );
        }
    }

    /// Starts loading the first buffer of the chain at `idx` (a request's header, or the
    /// chain's indirect table): reads the descriptor, so it is best called once its line has
    /// been prefetched. Nothing when the descriptor or its buffer is not readable.
    pub fn prefetch_first_buffer(&self, idx: u16) {
        if self.host.is_none() {
            return;
        }
        if let Ok((addr, len, _, _)) = self.read(idx) {
            if len > 0 {
                if let Some(h) = crate::host_range(self.mem, addr, 1) {
                    crate::prefetch(h);
                }
            }
        }
    }

    /// Descriptor `idx` (below `size`): address, length, flags, next.
    fn read(&self, idx: u16) -> Result<(u64, u32, u16, u16), ChainError> {
        if idx >= self.size {
            return Err(ChainError::IndexOutOfRange(idx));
        }
        let off = u64::from(idx) * DESC_SIZE;
        let mut raw = [0u8; DESC_SIZE as usize];
        match self.host {
            Some(p) if (p.as_ptr() as usize) % 8 == 0 => {
                // The usual case: two aligned loads, decoded in registers (byte loads stored
                // to the stack and read back as words stall on store forwarding).
                // SAFETY: `idx` is below the table's size, so the 16 bytes lie inside the
                // translated table, which `mem` keeps mapped for 'm; both words are 8-aligned
                // (the table is, and descriptors are 16 bytes); volatile loads tolerate the
                // guest changing the bytes meanwhile.
                let (w0, w1) = unsafe {
                    let d = p.as_ptr().add(off as usize).cast::<u64>();
                    (
                        std::ptr::read_volatile(d),
                        std::ptr::read_volatile(d.add(1)),
                    )
                };
                let w1 = u64::from_le(w1);
                return Ok((
                    u64::from_le(w0),
                    w1 as u32,
                    (w1 >> 32) as u16,
                    (w1 >> 48) as u16,
                ));
            }
            Some(p) => {
                // SAFETY: as above, with a volatile byte-array read (no alignment needed).
                raw = unsafe {
                    std::ptr::read_volatile(
                        p.as_ptr()
                            .add(off as usize)
                            .cast::<[u8; DESC_SIZE as usize]>(),
                    )
                }
            }
            None => self
                .mem
                .read_slice(&mut raw, GuestAddress(self.addr.0 + off))
                .map_err(|_| ChainError::DescUnreadable(self.addr.0 + off))?,
        }
        let a = u64::from_le_bytes([
            raw[0], raw[1], raw[2], raw[3], raw[4], raw[5], raw[6], raw[7],
        ]);
        let l = u32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]);
        let f = u16::from_le_bytes([raw[12], raw[13]]);
        let n = u16::from_le_bytes([raw[14], raw[15]]);
        Ok((a, l, f, n))
    }
}

fn push_seg(
    mem: &GuestMem,
    out: &mut Vec<Seg>,
    max: usize,
    addr: u64,
    len: u32,
    flags: u16,
    bad: &mut Option<ChainError>,
) -> Result<(), ChainError> {
    let writable = flags & VIRTQ_DESC_F_WRITE != 0;
    if !writable && out.last().is_some_and(|s| s.writable) {
        return Err(ChainError::BadOrder);
    }
    if len > 0
        && crate::host_range(mem, addr, len as usize).is_none()
        && !mem.check_range(GuestAddress(addr), len as usize)
    {
        // Keep walking so that the status byte can still be found and the request failed
        // with IOERR; the bad buffer itself is left out.
        bad.get_or_insert(ChainError::BadBuffer { addr, len });
        return Ok(());
    }
    if out.len() >= max {
        return Err(ChainError::TooManySegments(max));
    }
    out.push(Seg {
        addr,
        len,
        writable,
    });
    Ok(())
}

/// Walks the chain starting at `head` of the descriptor table at `desc_table` (of a queue of
/// `queue_size` entries), appending its buffers to `out` (cleared first), at most `max`.
///
/// A buffer outside guest memory makes the walk fail, but only after the rest of the chain was
/// walked, so that `out` still ends with the status byte where the chain has one.
pub fn walk(
    mem: &GuestMem,
    desc_table: GuestAddress,
    queue_size: u16,
    head: u16,
    out: &mut Vec<Seg>,
    max: usize,
) -> Result<(), ChainError> {
    walk_table(DescTable::new(mem, desc_table, queue_size), head, out, max)
}

/// [`walk`] in a table translated beforehand.
pub(crate) fn walk_table(
    table: DescTable<'_>,
    head: u16,
    out: &mut Vec<Seg>,
    max: usize,
) -> Result<(), ChainError> {
    walk_in(table, head, false, out, max)
}

/// Walks from `head` of `table`; in an indirect table (`indirect`), an indirect descriptor is
/// an error, else it must be the only descriptor of its chain.
fn walk_in(
    table: DescTable<'_>,
    head: u16,
    indirect: bool,
    out: &mut Vec<Seg>,
    max: usize,
) -> Result<(), ChainError> {
    let mem = table.mem;
    if !indirect {
        out.clear();
    }
    let mut bad = None;
    let mut idx = head;
    let mut seen = 0u32;
    loop {
        if idx >= table.size {
            return Err(ChainError::IndexOutOfRange(idx));
        }
        seen += 1;
        if seen > u32::from(table.size) {
            return Err(ChainError::TooLong);
        }
        let (addr, len, flags, next) = table.read(idx)?;
        if flags & VIRTQ_DESC_F_INDIRECT != 0 {
            // An indirect descriptor must be alone in the chain (VIRTIO 1.2, 2.7.5.3.1), and
            // an indirect table holds none.
            if indirect
                || flags & VIRTQ_DESC_F_NEXT != 0
                || !out.is_empty()
                || len == 0
                || u64::from(len) % DESC_SIZE != 0
                || !mem.check_range(GuestAddress(addr), len as usize)
            {
                return Err(ChainError::BadIndirect {
                    addr: if indirect { table.addr.0 } else { addr },
                    len: if indirect {
                        u32::from(table.size) * DESC_SIZE as u32
                    } else {
                        len
                    },
                });
            }
            let count = u16::try_from(u64::from(len) / DESC_SIZE)
                .map_err(|_| ChainError::BadIndirect { addr, len })?;
            return walk_in(
                DescTable::new(mem, GuestAddress(addr), count),
                0,
                true,
                out,
                max,
            );
        }
        push_seg(mem, out, max, addr, len, flags, &mut bad)?;
        if flags & VIRTQ_DESC_F_NEXT == 0 {
            return bad.map_or(Ok(()), Err);
        }
        idx = next;
    }
}
