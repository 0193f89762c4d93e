//! virtio-blk requests: parsing a walked descriptor chain into a typed [`Request`] whose data
//! buffers are host `iovec`s pointing straight into guest memory.
//!
//! No framing is assumed beyond what the virtio spec requires: the 16-byte header is the first 16
//! readable bytes (possibly spread over descriptors), the status is the last writable byte, and
//! the data is what lies between them.

use katablk_bdev::iovec;
use thiserror::Error;
use virtio_bindings::virtio_blk::*;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::chain::Seg;
use crate::config::{MAX_DISCARD_SEG, SECTOR_SIZE};
use crate::GuestMem;

/// Size of the request header (`type`, `reserved`, `sector`).
pub const HEADER_LEN: u64 = 16;
/// Size of one discard / write-zeroes range.
pub const RANGE_LEN: u64 = 16;

/// The operation of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Read (`VIRTIO_BLK_T_IN`).
    In,
    /// Write (`VIRTIO_BLK_T_OUT`).
    Out,
    /// Flush (`VIRTIO_BLK_T_FLUSH`).
    Flush,
    /// Device id (`VIRTIO_BLK_T_GET_ID`).
    GetId,
    /// Discard (`VIRTIO_BLK_T_DISCARD`).
    Discard,
    /// Write zeroes (`VIRTIO_BLK_T_WRITE_ZEROES`).
    WriteZeroes,
}

/// One discard or write-zeroes range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// First sector.
    pub sector: u64,
    /// Number of sectors.
    pub num_sectors: u32,
    /// `VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP` for write-zeroes.
    pub unmap: bool,
}

/// A parsed, well-formed request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Operation.
    pub kind: Kind,
    /// Sector from the header (reads and writes).
    pub sector: u64,
    /// Bytes of data (reads, writes and GET_ID).
    pub data_len: u64,
    /// Guest address of the status byte.
    pub status: GuestAddress,
    /// Bytes the device writes into the chain on success, status included (the used length).
    pub used_len: u32,
}

/// Status to report for a failed request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// `VIRTIO_BLK_S_OK`.
    Ok = VIRTIO_BLK_S_OK as isize,
    /// `VIRTIO_BLK_S_IOERR`.
    IoErr = VIRTIO_BLK_S_IOERR as isize,
    /// `VIRTIO_BLK_S_UNSUPP`.
    Unsupp = VIRTIO_BLK_S_UNSUPP as isize,
}

/// Why a chain is not a valid request.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum RequestError {
    /// Fewer than 16 readable bytes.
    #[error("no request header")]
    NoHeader,
    /// No writable byte for the status.
    #[error("no status byte")]
    NoStatus,
    /// Unknown request type.
    #[error("unsupported request type {0}")]
    Unsupported(u32),
    /// Data of a read or write is not a whole number of sectors.
    #[error("data length {0} is not a multiple of 512")]
    BadDataLength(u64),
    /// Data of the wrong direction (writable data for a write, readable data for a read, ...).
    #[error("unexpected data buffers for this request type")]
    UnexpectedData,
    /// The discard / write-zeroes payload is empty, ragged or too long.
    #[error("bad discard/write-zeroes payload of {0} bytes")]
    BadRanges(u64),
    /// A range has unknown flags.
    #[error("bad discard/write-zeroes flags {0:#x}")]
    BadRangeFlags(u32),
    /// GET_ID buffer is too small.
    #[error("GET_ID buffer of {0} bytes is too small")]
    ShortId(u64),
    /// The request has more data buffers than the device accepts.
    #[error("too many data segments")]
    TooManySegments,
    /// Guest memory could not be accessed.
    #[error("guest memory access failed")]
    Memory,
}

impl RequestError {
    /// The status the guest gets for this error.
    pub fn status(&self) -> Status {
        match self {
            RequestError::Unsupported(_) => Status::Unsupp,
            _ => Status::IoErr,
        }
    }
}

/// Bytes in readable and writable segments.
fn totals(segs: &[Seg]) -> (u64, u64, usize) {
    let nr = segs.iter().take_while(|s| !s.writable).count();
    let r = segs[..nr].iter().map(|s| u64::from(s.len)).sum();
    let w = segs[nr..].iter().map(|s| u64::from(s.len)).sum();
    (r, w, nr)
}

/// Visits the guest ranges covering bytes `[start, start+len)` of the concatenation of `segs`.
fn for_range(
    segs: &[Seg],
    mut start: u64,
    mut len: u64,
    mut f: impl FnMut(u64, u64) -> Result<(), RequestError>,
) -> Result<(), RequestError> {
    for s in segs {
        if len == 0 {
            break;
        }
        let sl = u64::from(s.len);
        if start >= sl {
            start -= sl;
            continue;
        }
        let n = (sl - start).min(len);
        f(s.addr + start, n)?;
        len -= n;
        start = 0;
    }
    if len == 0 {
        Ok(())
    } else {
        Err(RequestError::Memory)
    }
}

fn read_bytes(
    mem: &GuestMem,
    segs: &[Seg],
    start: u64,
    buf: &mut [u8],
) -> Result<(), RequestError> {
    let mut pos = 0usize;
    for_range(segs, start, buf.len() as u64, |addr, n| {
        let n = n as usize;
        mem.read_slice(&mut buf[pos..pos + n], GuestAddress(addr))
            .map_err(|_| RequestError::Memory)?;
        pos += n;
        Ok(())
    })
}

/// Writes `data` at byte `start` of the concatenation of `segs`.
pub fn write_bytes(
    mem: &GuestMem,
    segs: &[Seg],
    start: u64,
    data: &[u8],
) -> Result<(), RequestError> {
    let mut pos = 0usize;
    for_range(segs, start, data.len() as u64, |addr, n| {
        let n = n as usize;
        mem.write_slice(&data[pos..pos + n], GuestAddress(addr))
            .map_err(|_| RequestError::Memory)?;
        pos += n;
        Ok(())
    })
}

/// Appends host iovecs for bytes `[start, start+len)` of `segs`.
fn map_iov(
    mem: &GuestMem,
    segs: &[Seg],
    start: u64,
    len: u64,
    iov: &mut Vec<iovec>,
    max_iov: usize,
) -> Result<(), RequestError> {
    for_range(segs, start, len, |addr, n| {
        for slice in mem.get_slices(GuestAddress(addr), n as usize) {
            let slice = slice.map_err(|_| RequestError::Memory)?;
            if iov.len() >= max_iov {
                return Err(RequestError::TooManySegments);
            }
            iov.push(iovec {
                iov_base: slice.ptr_guard_mut().as_ptr().cast(),
                iov_len: slice.len(),
            });
        }
        Ok(())
    })
}

/// The status byte's address: the last byte of the last non-empty writable segment.
pub fn status_addr(segs: &[Seg]) -> Option<GuestAddress> {
    segs.iter()
        .rev()
        .take_while(|s| s.writable)
        .find(|s| s.len > 0)
        .map(|s| GuestAddress(s.addr + u64::from(s.len) - 1))
}

/// Parses a walked chain. Data buffers are appended to `iov` (cleared first, at most `max_iov`
/// entries) and discard / write-zeroes ranges to `ranges` (cleared first).
pub fn parse(
    mem: &GuestMem,
    segs: &[Seg],
    iov: &mut Vec<iovec>,
    ranges: &mut Vec<Range>,
    max_iov: usize,
) -> Result<Request, RequestError> {
    iov.clear();
    ranges.clear();
    let (rlen, wlen, nr) = totals(segs);
    let (rsegs, wsegs) = segs.split_at(nr);
    let status = status_addr(segs).ok_or(RequestError::NoStatus)?;
    if rlen < HEADER_LEN {
        return Err(RequestError::NoHeader);
    }
    let mut hdr = [0u8; HEADER_LEN as usize];
    read_bytes(mem, rsegs, 0, &mut hdr)?;
    let ty = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let sector = u64::from_le_bytes([
        hdr[8], hdr[9], hdr[10], hdr[11], hdr[12], hdr[13], hdr[14], hdr[15],
    ]);
    let rdata = rlen - HEADER_LEN;
    let wdata = wlen - 1;
    let (kind, data_len) = match ty {
        VIRTIO_BLK_T_IN => {
            if rdata != 0 {
                return Err(RequestError::UnexpectedData);
            }
            if wdata % SECTOR_SIZE != 0 {
                return Err(RequestError::BadDataLength(wdata));
            }
            map_iov(mem, wsegs, 0, wdata, iov, max_iov)?;
            (Kind::In, wdata)
        }
        VIRTIO_BLK_T_OUT => {
            if wdata != 0 {
                return Err(RequestError::UnexpectedData);
            }
            if rdata % SECTOR_SIZE != 0 {
                return Err(RequestError::BadDataLength(rdata));
            }
            map_iov(mem, rsegs, HEADER_LEN, rdata, iov, max_iov)?;
            (Kind::Out, rdata)
        }
        VIRTIO_BLK_T_FLUSH => {
            if wdata != 0 || rdata != 0 {
                return Err(RequestError::UnexpectedData);
            }
            (Kind::Flush, 0)
        }
        VIRTIO_BLK_T_GET_ID => {
            if rdata != 0 {
                return Err(RequestError::UnexpectedData);
            }
            if wdata < u64::from(VIRTIO_BLK_ID_BYTES) {
                return Err(RequestError::ShortId(wdata));
            }
            (Kind::GetId, u64::from(VIRTIO_BLK_ID_BYTES))
        }
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            if wdata != 0 {
                return Err(RequestError::UnexpectedData);
            }
            if rdata == 0
                || rdata % RANGE_LEN != 0
                || rdata / RANGE_LEN > u64::from(MAX_DISCARD_SEG)
            {
                return Err(RequestError::BadRanges(rdata));
            }
            let wz = ty == VIRTIO_BLK_T_WRITE_ZEROES;
            for i in 0..rdata / RANGE_LEN {
                let mut r = [0u8; RANGE_LEN as usize];
                read_bytes(mem, rsegs, HEADER_LEN + i * RANGE_LEN, &mut r)?;
                let sector = u64::from_le_bytes([r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]]);
                let num_sectors = u32::from_le_bytes([r[8], r[9], r[10], r[11]]);
                let flags = u32::from_le_bytes([r[12], r[13], r[14], r[15]]);
                let allowed = if wz {
                    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
                } else {
                    0
                };
                if flags & !allowed != 0 {
                    return Err(RequestError::BadRangeFlags(flags));
                }
                ranges.push(Range {
                    sector,
                    num_sectors,
                    unmap: flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0,
                });
            }
            (if wz { Kind::WriteZeroes } else { Kind::Discard }, 0)
        }
        other => return Err(RequestError::Unsupported(other)),
    };
    let used_len = match kind {
        Kind::In | Kind::GetId => data_len + 1,
        _ => 1,
    };
    Ok(Request {
        kind,
        sector,
        data_len,
        status,
        used_len: u32::try_from(used_len).map_err(|_| RequestError::BadDataLength(data_len))?,
    })
}

/// Writes the device id (serial, NUL padded to 20 bytes) into a GET_ID request's buffer.
pub fn write_id(mem: &GuestMem, segs: &[Seg], serial: &str) -> Result<(), RequestError> {
    let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
    let n = serial.len().min(id.len());
    id[..n].copy_from_slice(&serial.as_bytes()[..n]);
    let nr = segs.iter().take_while(|s| !s.writable).count();
    write_bytes(mem, &segs[nr..], 0, &id)
}

/// Writes the status byte.
pub fn write_status(mem: &GuestMem, addr: GuestAddress, status: Status) -> bool {
    mem.write_obj(status as u8, addr).is_ok()
}
