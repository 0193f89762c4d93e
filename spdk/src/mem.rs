//! Registering client (guest) memory with SPDK's memory map, so bdevs that DMA (NVMe) can
//! translate the addresses of guest buffers without a bounce copy.
//!
//! SPDK only registers whole 2 MiB pages: `spdk_mem_register` fails (and SPDK's own vhost
//! target has crashed) on regions whose address or length is not 2 MiB aligned, as libblkio's
//! memfd regions often are. katablk registers the 2 MiB-aligned interior of each region and
//! leaves the rest unregistered: AIO, malloc, null and lvol-on-AIO bdevs never need it, and an
//! NVMe request into an unregistered part fails with an I/O error instead of crashing.

#[cfg(feature = "spdk")]
use std::sync::Mutex;

#[cfg(feature = "spdk")]
use tracing::{debug, warn};

/// SPDK's registration granularity.
pub const REGISTRATION_ALIGN: usize = 2 << 20;

#[cfg(feature = "spdk")]
/// What we registered: (address, length) pairs, so unregistration matches exactly.
static REGISTERED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// The 2 MiB-aligned interior `[start, start + len)` of `[addr, addr + len)`, if any.
pub fn aligned_interior(addr: usize, len: usize) -> Option<(usize, usize)> {
    let start = addr.checked_add(REGISTRATION_ALIGN - 1)? & !(REGISTRATION_ALIGN - 1);
    let end = addr.checked_add(len)? & !(REGISTRATION_ALIGN - 1);
    (end > start).then(|| (start, end - start))
}

/// Registers the aligned interior of a region (idempotent per region).
#[cfg(feature = "spdk")]
pub fn register(addr: *mut u8, len: usize) {
    let Some((start, n)) = aligned_interior(addr as usize, len) else {
        debug!(
            ?addr,
            len, "memory region has no 2 MiB-aligned part: not registered"
        );
        return;
    };
    let Ok(mut reg) = REGISTERED.lock() else {
        return;
    };
    if reg.contains(&(start, n)) {
        return;
    }
    // SAFETY: [start, start + n) lies inside a mapping the caller keeps alive until it calls
    // `unregister`; spdk_mem_register is thread-safe.
    let rc = unsafe { crate::ffi::spdk_mem_register(start as *mut _, n) };
    if rc != 0 {
        warn!(
            rc,
            start, n, "spdk_mem_register failed: DMA bdevs cannot use this memory"
        );
        return;
    }
    if start != addr as usize || n != len {
        debug!(
            ?addr,
            len, start, n, "registered the 2 MiB-aligned part of a region"
        );
    }
    reg.push((start, n));
}

/// Unregisters what [`register`] registered for this region.
#[cfg(feature = "spdk")]
pub fn unregister(addr: *mut u8, len: usize) {
    let Some((start, n)) = aligned_interior(addr as usize, len) else {
        return;
    };
    let Ok(mut reg) = REGISTERED.lock() else {
        return;
    };
    if let Some(pos) = reg.iter().position(|&r| r == (start, n)) {
        reg.swap_remove(pos);
        // SAFETY: exactly a range registered by `register`, still mapped.
        let rc = unsafe { crate::ffi::spdk_mem_unregister(start as *mut _, n) };
        if rc != 0 {
            warn!(rc, start, n, "spdk_mem_unregister failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_interiors() {
        const M: usize = 1 << 20;
        assert_eq!(aligned_interior(0, 4 * M), Some((0, 4 * M)));
        assert_eq!(aligned_interior(M, 4 * M), Some((2 * M, 2 * M)));
        assert_eq!(aligned_interior(M, 2 * M), None);
        assert_eq!(aligned_interior(2 * M, 3 * M), Some((2 * M, 2 * M)));
        assert_eq!(aligned_interior(4096, 64 * M), Some((2 * M, 62 * M)));
        assert_eq!(aligned_interior(usize::MAX - M, 4 * M), None);
        assert_eq!(aligned_interior(0, 0), None);
    }
}
