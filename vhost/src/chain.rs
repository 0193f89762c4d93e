//! Strict walking of split-ring descriptor chains.
//!
//! Every descriptor of a chain is read from guest memory and checked: the chain must end within
//! the queue size (no loops), an indirect descriptor must be the only descriptor of its chain,
//! point to a whole table inside guest memory and contain no nested indirect descriptors, and
//! every buffer must lie in guest memory. Readable buffers come before writable ones.

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

fn read_desc(mem: &GuestMem, addr: u64) -> Result<(u64, u32, u16, u16), ChainError> {
    let mut raw = [0u8; DESC_SIZE as usize];
    match crate::host_range(mem, addr, DESC_SIZE as usize) {
        // SAFETY: the 16 bytes lie inside a mapped guest region that `mem` keeps mapped; a
        // volatile read of a byte array has no alignment requirement and tolerates the guest
        // changing the bytes meanwhile.
        Some(p) => raw = unsafe { std::ptr::read_volatile(p.cast::<[u8; DESC_SIZE as usize]>()) },
        None => mem
            .read_slice(&mut raw, GuestAddress(addr))
            .map_err(|_| ChainError::DescUnreadable(addr))?,
    }
    let a = u64::from_le_bytes([
        raw[0], raw[1], raw[2], raw[3], raw[4], raw[5], raw[6], raw[7],
    ]);
    let l = u32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]);
    let f = u16::from_le_bytes([raw[12], raw[13]]);
    let n = u16::from_le_bytes([raw[14], raw[15]]);
    Ok((a, l, f, n))
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
    out.clear();
    let mut bad = None;
    let mut idx = head;
    let mut seen = 0u32;
    loop {
        if idx >= queue_size {
            return Err(ChainError::IndexOutOfRange(idx));
        }
        seen += 1;
        if seen > u32::from(queue_size) {
            return Err(ChainError::TooLong);
        }
        let (addr, len, flags, next) = read_desc(mem, desc_table.0 + u64::from(idx) * DESC_SIZE)?;
        if flags & VIRTQ_DESC_F_INDIRECT != 0 {
            // An indirect descriptor must be alone in the chain (VIRTIO 1.2, 2.7.5.3.1).
            if flags & VIRTQ_DESC_F_NEXT != 0
                || !out.is_empty()
                || len == 0
                || u64::from(len) % DESC_SIZE != 0
                || !mem.check_range(GuestAddress(addr), len as usize)
            {
                return Err(ChainError::BadIndirect { addr, len });
            }
            return walk_indirect(mem, addr, len, out, max);
        }
        push_seg(mem, out, max, addr, len, flags, &mut bad)?;
        if flags & VIRTQ_DESC_F_NEXT == 0 {
            return bad.map_or(Ok(()), Err);
        }
        idx = next;
    }
}

fn walk_indirect(
    mem: &GuestMem,
    table: u64,
    table_len: u32,
    out: &mut Vec<Seg>,
    max: usize,
) -> Result<(), ChainError> {
    let count = u64::from(table_len) / DESC_SIZE;
    let count = u16::try_from(count).map_err(|_| ChainError::BadIndirect {
        addr: table,
        len: table_len,
    })?;
    let mut bad = None;
    let mut idx = 0u16;
    let mut seen = 0u32;
    loop {
        if idx >= count {
            return Err(ChainError::IndexOutOfRange(idx));
        }
        seen += 1;
        if seen > u32::from(count) {
            return Err(ChainError::TooLong);
        }
        let (addr, len, flags, next) = read_desc(mem, table + u64::from(idx) * DESC_SIZE)?;
        if flags & VIRTQ_DESC_F_INDIRECT != 0 {
            return Err(ChainError::BadIndirect {
                addr: table,
                len: table_len,
            });
        }
        push_seg(mem, out, max, addr, len, flags, &mut bad)?;
        if flags & VIRTQ_DESC_F_NEXT == 0 {
            return bad.map_or(Ok(()), Err);
        }
        idx = next;
    }
}
