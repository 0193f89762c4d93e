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
        let dst = &mut buf[pos..pos + n];
        match crate::host_range(mem, addr, n) {
            // The common case (a request header inside one region) without vm-memory's
            // generic slice walk.
            // SAFETY: the `n` bytes at `p` lie inside a guest region `mem` keeps mapped.
            Some(p) => unsafe { crate::read_volatile_bytes(p, dst) },
            None => mem
                .read_slice(dst, GuestAddress(addr))
                .map_err(|_| RequestError::Memory)?,
        }
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
        if let Some(p) = crate::host_range(mem, addr, n as usize) {
            if iov.len() >= max_iov {
                return Err(RequestError::TooManySegments);
            }
            iov.push(iovec {
                iov_base: p.cast(),
                iov_len: n as usize,
            });
            return Ok(());
        }
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
    if let Some(p) = crate::host_range(mem, addr.0, 1) {
        // SAFETY: the byte lies inside a mapped guest region that `mem` keeps mapped.
        unsafe { std::ptr::write_volatile(p, status as u8) };
        return true;
    }
    mem.write_obj(status as u8, addr).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::{walk, ChainError};
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;

    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;
    const F_INDIRECT: u16 = 4;
    const HDR: u64 = 0x10_0000;
    const DATA: u64 = 0x20_0000;
    const STATUS: u64 = 0x30_0000;

    fn mem() -> GuestMem {
        GuestMem::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap()
    }

    fn d(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
        RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
    }

    fn header(m: &GuestMem, ty: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&ty.to_le_bytes());
        h[8..].copy_from_slice(&sector.to_le_bytes());
        m.write_slice(&h, GuestAddress(HDR)).unwrap();
    }

    /// Stores `descs` at the start of the table of a 16-entry mock queue and parses head 0.
    fn parse_chain(
        m: &GuestMem,
        descs: &[RawDescriptor],
    ) -> Result<(Request, Vec<iovec>, Vec<Range>), String> {
        let q = MockSplitQueue::new(m, 16);
        for (i, desc) in descs.iter().enumerate() {
            q.desc_table().store(i as u16, *desc).unwrap();
        }
        let mut segs = Vec::new();
        walk(m, q.desc_table_addr(), 16, 0, &mut segs, 64).map_err(|e| e.to_string())?;
        let mut iov = Vec::new();
        let mut ranges = Vec::new();
        let r = parse(m, &segs, &mut iov, &mut ranges, 64).map_err(|e| e.to_string())?;
        Ok((r, iov, ranges))
    }

    #[test]
    fn read_request() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 8);
        let (r, iov, _) = parse_chain(
            &m,
            &[
                d(HDR, 16, F_NEXT, 1),
                d(DATA, 4096, F_NEXT | F_WRITE, 2),
                d(DATA + 8192, 512, F_NEXT | F_WRITE, 3),
                d(STATUS, 1, F_WRITE, 0),
            ],
        )
        .unwrap();
        assert_eq!(r.kind, Kind::In);
        assert_eq!(r.sector, 8);
        assert_eq!(r.data_len, 4608);
        assert_eq!(r.used_len, 4609);
        assert_eq!(r.status, GuestAddress(STATUS));
        assert_eq!(iov.len(), 2);
        let host = m.get_host_address(GuestAddress(DATA)).unwrap();
        assert_eq!(
            iov[0].iov_base as usize, host as usize,
            "zero copy: points into guest RAM"
        );
    }

    #[test]
    fn write_with_header_and_data_in_one_descriptor() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_OUT, 0);
        // Header, 1024 bytes of data and then the status, framed as one readable + one writable
        // descriptor (no framing is assumed).
        let (r, iov, _) = parse_chain(
            &m,
            &[d(HDR, 16 + 1024, F_NEXT, 1), d(STATUS, 1, F_WRITE, 0)],
        )
        .unwrap();
        assert_eq!(r.kind, Kind::Out);
        assert_eq!(r.data_len, 1024);
        assert_eq!(iov.len(), 1);
        let host = m.get_host_address(GuestAddress(HDR + 16)).unwrap();
        assert_eq!(iov[0].iov_base as usize, host as usize);
    }

    #[test]
    fn read_with_status_in_data_descriptor() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let (r, iov, _) =
            parse_chain(&m, &[d(HDR, 16, F_NEXT, 1), d(DATA, 513, F_WRITE, 0)]).unwrap();
        assert_eq!(r.data_len, 512);
        assert_eq!(r.status, GuestAddress(DATA + 512));
        assert_eq!(iov[0].iov_len, 512);
    }

    #[test]
    fn flush_get_id_discard() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_FLUSH, 0);
        let (r, _, _) =
            parse_chain(&m, &[d(HDR, 16, F_NEXT, 1), d(STATUS, 1, F_WRITE, 0)]).unwrap();
        assert_eq!(r.kind, Kind::Flush);

        header(&m, VIRTIO_BLK_T_GET_ID, 0);
        let descs = [
            d(HDR, 16, F_NEXT, 1),
            d(DATA, 20, F_NEXT | F_WRITE, 2),
            d(STATUS, 1, F_WRITE, 0),
        ];
        let (r, _, _) = parse_chain(&m, &descs).unwrap();
        assert_eq!(r.kind, Kind::GetId);
        assert_eq!(r.used_len, 21);
        let segs = [
            Seg {
                addr: HDR,
                len: 16,
                writable: false,
            },
            Seg {
                addr: DATA,
                len: 20,
                writable: true,
            },
            Seg {
                addr: STATUS,
                len: 1,
                writable: true,
            },
        ];
        write_id(&m, &segs, "katablk-serial-0001").unwrap();
        let mut id = [0u8; 20];
        m.read_slice(&mut id, GuestAddress(DATA)).unwrap();
        assert_eq!(&id[..19], b"katablk-serial-0001");
        assert_eq!(id[19], 0);

        header(&m, VIRTIO_BLK_T_WRITE_ZEROES, 0);
        let mut rng = [0u8; 32];
        rng[..8].copy_from_slice(&16u64.to_le_bytes());
        rng[8..12].copy_from_slice(&8u32.to_le_bytes());
        rng[12..16].copy_from_slice(&VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP.to_le_bytes());
        rng[16..24].copy_from_slice(&64u64.to_le_bytes());
        rng[24..28].copy_from_slice(&1u32.to_le_bytes());
        m.write_slice(&rng, GuestAddress(DATA)).unwrap();
        let descs = [
            d(HDR, 16, F_NEXT, 1),
            d(DATA, 32, F_NEXT, 2),
            d(STATUS, 1, F_WRITE, 0),
        ];
        let (r, _, ranges) = parse_chain(&m, &descs).unwrap();
        assert_eq!(r.kind, Kind::WriteZeroes);
        assert_eq!(
            ranges,
            vec![
                Range {
                    sector: 16,
                    num_sectors: 8,
                    unmap: true
                },
                Range {
                    sector: 64,
                    num_sectors: 1,
                    unmap: false
                }
            ]
        );
        // The unmap flag is not valid for discard.
        header(&m, VIRTIO_BLK_T_DISCARD, 0);
        assert!(parse_chain(&m, &descs).unwrap_err().contains("flags"));
    }

    #[test]
    fn malformed_chains() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let bad = |descs: &[RawDescriptor]| parse_chain(&m, descs).unwrap_err();
        // No status byte.
        assert!(bad(&[d(HDR, 16, F_NEXT, 1), d(DATA, 512, 0, 0)]).contains("status"));
        // Short header.
        assert!(bad(&[d(HDR, 8, F_NEXT, 1), d(STATUS, 1, F_WRITE, 0)]).contains("header"));
        // Data not a multiple of the sector size.
        assert!(bad(&[
            d(HDR, 16, F_NEXT, 1),
            d(DATA, 100, F_NEXT | F_WRITE, 2),
            d(STATUS, 1, F_WRITE, 0)
        ])
        .contains("multiple of 512"));
        // Read with readable data.
        assert!(
            bad(&[d(HDR, 16 + 512, F_NEXT, 1), d(STATUS, 1, F_WRITE, 0)]).contains("unexpected")
        );
        // Readable after writable.
        assert!(bad(&[d(HDR, 16, F_NEXT | F_WRITE, 1), d(DATA, 512, 0, 0)]).contains("readable"));
        // A loop.
        assert!(bad(&[d(HDR, 16, F_NEXT, 1), d(DATA, 512, F_NEXT, 0)]).contains("too long"));
        // Next index out of range.
        assert!(bad(&[d(HDR, 16, F_NEXT, 40)]).contains("out of range"));
        // Buffer outside guest memory.
        assert!(
            bad(&[d(HDR, 16, F_NEXT, 1), d(0x4000_0000, 512, F_WRITE, 0)])
                .contains("not in guest memory")
        );
        // Buffer that runs off the end of guest memory.
        assert!(bad(&[d(HDR, 16, F_NEXT, 1), d(0x3f_ff00, 512, F_WRITE, 0)])
            .contains("not in guest memory"));
        // Unknown type gets UNSUPP.
        header(&m, 0x77, 0);
        let segs = [
            Seg {
                addr: HDR,
                len: 16,
                writable: false,
            },
            Seg {
                addr: STATUS,
                len: 1,
                writable: true,
            },
        ];
        let e = parse(&m, &segs, &mut Vec::new(), &mut Vec::new(), 64).unwrap_err();
        assert_eq!(e, RequestError::Unsupported(0x77));
        assert_eq!(e.status(), Status::Unsupp);
    }

    #[test]
    fn unaligned_tables_and_headers_parse_like_aligned_ones() {
        // An indirect table and a header at odd addresses take the byte-wise paths.
        let m = mem();
        for (table, hdr) in [(0x38_0000u64, HDR), (0x38_0003, HDR + 5)] {
            let mut h = [0u8; 16];
            h[..4].copy_from_slice(&VIRTIO_BLK_T_OUT.to_le_bytes());
            h[8..].copy_from_slice(&0x1234_5678_9abc_u64.to_le_bytes());
            m.write_slice(&h, GuestAddress(hdr)).unwrap();
            let entries = [
                SplitDescriptor::new(hdr, 16, F_NEXT, 1),
                SplitDescriptor::new(DATA, 4096, F_NEXT, 2),
                SplitDescriptor::new(STATUS, 1, F_WRITE, 0),
            ];
            for (i, e) in entries.iter().enumerate() {
                m.write_obj(*e, GuestAddress(table + 16 * i as u64))
                    .unwrap();
            }
            let (r, iov, _) = parse_chain(&m, &[d(table, 48, F_INDIRECT, 0)]).unwrap();
            assert_eq!(
                (r.kind, r.sector, r.data_len),
                (Kind::Out, 0x1234_5678_9abc, 4096)
            );
            assert_eq!(r.status, GuestAddress(STATUS));
            assert_eq!(iov.len(), 1);
        }
    }

    #[test]
    fn indirect_tables() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let table = 0x38_0000u64;
        let entries = [
            SplitDescriptor::new(HDR, 16, F_NEXT, 1),
            SplitDescriptor::new(DATA, 4096, F_NEXT | F_WRITE, 2),
            SplitDescriptor::new(STATUS, 1, F_WRITE, 0),
        ];
        for (i, e) in entries.iter().enumerate() {
            m.write_obj(*e, GuestAddress(table + 16 * i as u64))
                .unwrap();
        }
        let (r, _, _) = parse_chain(&m, &[d(table, 48, F_INDIRECT, 0)]).unwrap();
        assert_eq!(r.data_len, 4096);
        // Indirect with NEXT set, ragged length, nested indirect: all refused.
        assert!(parse_chain(
            &m,
            &[
                d(table, 48, F_INDIRECT | F_NEXT, 1),
                d(STATUS, 1, F_WRITE, 0)
            ]
        )
        .unwrap_err()
        .contains("indirect"));
        assert!(parse_chain(&m, &[d(table, 40, F_INDIRECT, 0)])
            .unwrap_err()
            .contains("indirect"));
        m.write_obj(
            SplitDescriptor::new(table, 48, F_INDIRECT, 0),
            GuestAddress(table + 16),
        )
        .unwrap();
        assert!(parse_chain(&m, &[d(table, 48, F_INDIRECT, 0)])
            .unwrap_err()
            .contains("indirect"));
        // Indirect table loop.
        m.write_obj(
            SplitDescriptor::new(DATA, 512, F_NEXT | F_WRITE, 0),
            GuestAddress(table + 16),
        )
        .unwrap();
        m.write_obj(
            SplitDescriptor::new(HDR, 16, F_NEXT, 1),
            GuestAddress(table),
        )
        .unwrap();
        let e = parse_chain(&m, &[d(table, 32, F_INDIRECT, 0)]).unwrap_err();
        assert!(e.contains("too long") || e.contains("readable"), "{e}");
        let _ = ChainError::TooLong;
    }

    #[test]
    fn segment_limit() {
        let m = mem();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let mut descs = vec![d(HDR, 16, F_NEXT, 1)];
        for i in 1..15u16 {
            descs.push(d(DATA + u64::from(i) * 512, 512, F_NEXT | F_WRITE, i + 1));
        }
        descs.push(d(STATUS, 1, F_WRITE, 0));
        let q = MockSplitQueue::new(&m, 16);
        for (i, desc) in descs.iter().enumerate() {
            q.desc_table().store(i as u16, *desc).unwrap();
        }
        let mut segs = Vec::new();
        assert_eq!(
            walk(&m, q.desc_table_addr(), 16, 0, &mut segs, 8),
            Err(ChainError::TooManySegments(8))
        );
        walk(&m, q.desc_table_addr(), 16, 0, &mut segs, 16).unwrap();
        let e = parse(&m, &segs, &mut Vec::new(), &mut Vec::new(), 4).unwrap_err();
        assert_eq!(e, RequestError::TooManySegments);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        /// Random descriptor tables and headers: walking and parsing never panic, and every
        /// iovec produced lies inside guest memory.
        #[test]
        fn fuzz_parser(
            descs in proptest::collection::vec((0u64..0x41_0000, 0u32..0x2_0000, 0u16..8, 0u16..20), 1..16),
            ty in proptest::prelude::prop_oneof![0u32..12, proptest::prelude::any::<u32>()],
            sector in proptest::prelude::any::<u64>(),
            payload in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
        ) {
            let m = mem();
            header(&m, ty, sector);
            m.write_slice(&payload, GuestAddress(DATA)).unwrap();
            let q = MockSplitQueue::new(&m, 16);
            for (i, (a, l, f, n)) in descs.iter().enumerate() {
                q.desc_table().store(i as u16, d(*a, *l, *f, *n)).unwrap();
            }
            let mut segs = Vec::new();
            if walk(&m, q.desc_table_addr(), 16, 0, &mut segs, 32).is_ok() {
                let mut iov = Vec::new();
                let mut ranges = Vec::new();
                if let Ok(r) = parse(&m, &segs, &mut iov, &mut ranges, 32) {
                    let total: usize = iov.iter().map(|v| v.iov_len).sum();
                    if matches!(r.kind, Kind::In | Kind::Out) {
                        proptest::prop_assert_eq!(total as u64, r.data_len);
                    }
                    let base = m.get_host_address(GuestAddress(0)).unwrap() as usize;
                    for v in &iov {
                        let p = v.iov_base as usize;
                        proptest::prop_assert!(p >= base && p + v.iov_len <= base + 0x40_0000);
                    }
                }
            }
        }
    }
}
