//! DMA-able buffers from SPDK's hugepage memory (`spdk_dma_zmalloc`).

use std::ffi::c_void;

use crate::ffi;
use crate::Error;

/// A zeroed, aligned, DMA-able buffer, freed on drop. Usable from any thread.
#[derive(Debug)]
pub struct DmaBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by this value; SPDK's allocator is thread-safe.
unsafe impl Send for DmaBuf {}
// SAFETY: shared access only gives `&[u8]`.
unsafe impl Sync for DmaBuf {}

impl DmaBuf {
    /// Allocates `len` bytes aligned to `align` (a power of two). Needs a started application.
    pub fn new(len: usize, align: usize) -> Result<DmaBuf, Error> {
        if len == 0 || !align.is_power_of_two() {
            return Err(Error::InvalidName(format!(
                "DMA buffer of {len} bytes aligned to {align}"
            )));
        }
        // SAFETY: plain allocation; a NULL return is handled.
        let p = unsafe { ffi::spdk_dma_zmalloc(len, align, std::ptr::null_mut()) };
        if p.is_null() {
            return Err(Error::Call("spdk_dma_zmalloc", -libc::ENOMEM));
        }
        Ok(DmaBuf { ptr: p.cast(), len })
    }

    /// The buffer's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (empty buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer's address.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
}

impl std::ops::Deref for DmaBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for DmaBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for Deref, with exclusive access through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by spdk_dma_zmalloc, freed once.
        unsafe { ffi::spdk_free(self.ptr.cast::<c_void>()) };
    }
}
