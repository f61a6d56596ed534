//! Register memory: the BAR that holds a device's register file.
//!
//! On the shm fabric the guest's loads land directly in this memory (a KVM memslot over the
//! lender's fabric window), so the device keeps read-only registers current in it. Stores to
//! the model's [`crate::DoorbellRange`] are stored here by the borrower and announced with the
//! doorbell eventfd; the device discovers them by diffing against the values it last saw.
//! Stores elsewhere reach the device through its exact `bar_write`.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// A region of 32/64-bit registers shared with the borrower. Offsets are bytes; accesses are
/// naturally aligned. Out-of-range or misaligned reads return all ones and writes are ignored.
pub trait RegisterMemory: Send + Sync {
    /// Size in bytes.
    fn len(&self) -> usize;
    /// True when the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Load 32 bits.
    fn read32(&self, offset: u64) -> u32;
    /// Store 32 bits.
    fn write32(&self, offset: u64, value: u32);
    /// Load 64 bits (one access when the implementation can, else low then high half).
    fn read64(&self, offset: u64) -> u64 {
        u64::from(self.read32(offset)) | (u64::from(self.read32(offset + 4)) << 32)
    }
    /// Store 64 bits.
    fn write64(&self, offset: u64, value: u64) {
        self.write32(offset, value as u32);
        self.write32(offset + 4, (value >> 32) as u32);
    }
    /// Store `value` and return what was there, in one atomic step where the implementation
    /// can (a command register the device reads and clears: a store landing between a
    /// separate load and clear would be lost). Default: load, then store.
    fn swap32(&self, offset: u64, value: u32) -> u32 {
        let old = self.read32(offset);
        self.write32(offset, value);
        old
    }
    /// Copy `out.len()` bytes at `offset` out of plain memory inside the region (a device's
    /// data buffer, not its registers), in one bulk copy where the implementation can: a
    /// copy engine moves its buffer as a DMA engine does, not a register at a time. `false`
    /// (nothing read) unless `offset` and the length are multiples of 8 and the range lies
    /// inside the region. Default: 64-bit loads.
    fn read_bytes(&self, offset: u64, out: &mut [u8]) -> bool {
        if !bytes_fit(self.len(), offset, out.len()) {
            return false;
        }
        for (i, c) in out.chunks_mut(8).enumerate() {
            c.copy_from_slice(&self.read64(offset + 8 * i as u64).to_le_bytes());
        }
        true
    }
    /// Copy `data` into plain memory at `offset` (see [`RegisterMemory::read_bytes`]).
    /// Default: 64-bit stores.
    fn write_bytes(&self, offset: u64, data: &[u8]) -> bool {
        if !bytes_fit(self.len(), offset, data.len()) {
            return false;
        }
        for (i, c) in data.chunks(8).enumerate() {
            let mut v = [0u8; 8];
            v.copy_from_slice(c);
            self.write64(offset + 8 * i as u64, u64::from_le_bytes(v));
        }
        true
    }
    /// `len` bytes of plain memory at `offset` as a span a DMA can copy to or from directly
    /// (same alignment rules as [`RegisterMemory::read_bytes`]), when the region is memory
    /// of this process. `None` (the default): the bytes are reached only through
    /// `read_bytes`/`write_bytes`.
    fn raw_span(&self, offset: u64, len: usize) -> Option<crate::RawSpan<'_>> {
        let _ = (offset, len);
        None
    }
    /// Zero `len` bytes of plain memory at `offset` (a data buffer at reset), with the same
    /// alignment rules as [`RegisterMemory::read_bytes`]. Default: 64-bit stores. Memory
    /// shared from a file gives its pages back instead (a 64 GiB buffer must not be written
    /// through to be cleared: that would cost its size in time and in memory).
    fn zero_bytes(&self, offset: u64, len: u64) -> bool {
        let Ok(n) = usize::try_from(len) else {
            return false;
        };
        if !bytes_fit(self.len(), offset, n) {
            return false;
        }
        for i in (0..len).step_by(8) {
            self.write64(offset + i, 0);
        }
        true
    }
}

/// Whether `len` bytes at `offset` are a bulk access [`RegisterMemory::read_bytes`] takes: 8-byte
/// aligned, a multiple of 8 long, inside a region of `region` bytes.
fn bytes_fit(region: usize, offset: u64, len: usize) -> bool {
    offset.is_multiple_of(8)
        && len.is_multiple_of(8)
        && offset
            .checked_add(len as u64)
            .is_some_and(|e| e <= region as u64)
}

/// Register memory over a raw pointer (an mmap of a fabric window). All accesses are atomic
/// (so also volatile with respect to other processes mapping the same pages).
pub struct RawRegisters {
    base: *mut u8,
    len: usize,
}

// SAFETY: all accesses go through atomics; the creator of the value guarantees the mapping
// stays valid for its lifetime (see `RawRegisters::new`).
unsafe impl Send for RawRegisters {}
// SAFETY: as above, concurrent access is through atomics only.
unsafe impl Sync for RawRegisters {}

impl RawRegisters {
    /// Wrap `len` bytes at `base`.
    ///
    /// # Safety
    /// `base` must be 8-byte aligned, valid for reads and writes of `len` bytes for the whole
    /// lifetime of the returned value, and only ever accessed atomically by others.
    pub unsafe fn new(base: *mut u8, len: usize) -> Self {
        RawRegisters { base, len }
    }

    fn ok(&self, offset: u64, size: u64) -> bool {
        offset & (size - 1) == 0
            && offset
                .checked_add(size)
                .is_some_and(|e| e <= self.len as u64)
    }
}

impl RegisterMemory for RawRegisters {
    fn len(&self) -> usize {
        self.len
    }

    fn read32(&self, offset: u64) -> u32 {
        if !self.ok(offset, 4) {
            return u32::MAX;
        }
        // SAFETY: in bounds and 4-aligned (base is 8-aligned), valid per `new`'s contract.
        let a = unsafe { AtomicU32::from_ptr(self.base.add(offset as usize).cast::<u32>()) };
        a.load(Ordering::Acquire)
    }

    fn write32(&self, offset: u64, value: u32) {
        if !self.ok(offset, 4) {
            return;
        }
        // SAFETY: in bounds and 4-aligned, valid per `new`'s contract.
        let a = unsafe { AtomicU32::from_ptr(self.base.add(offset as usize).cast::<u32>()) };
        a.store(value, Ordering::Release);
    }

    fn swap32(&self, offset: u64, value: u32) -> u32 {
        if !self.ok(offset, 4) {
            return u32::MAX;
        }
        // SAFETY: in bounds and 4-aligned, valid per `new`'s contract.
        let a = unsafe { AtomicU32::from_ptr(self.base.add(offset as usize).cast::<u32>()) };
        a.swap(value, Ordering::AcqRel)
    }

    fn read64(&self, offset: u64) -> u64 {
        if !self.ok(offset, 8) {
            return u64::MAX;
        }
        // SAFETY: in bounds and 8-aligned, valid per `new`'s contract.
        let a = unsafe { AtomicU64::from_ptr(self.base.add(offset as usize).cast::<u64>()) };
        a.load(Ordering::Acquire)
    }

    fn write64(&self, offset: u64, value: u64) {
        if !self.ok(offset, 8) {
            return;
        }
        // SAFETY: in bounds and 8-aligned, valid per `new`'s contract.
        let a = unsafe { AtomicU64::from_ptr(self.base.add(offset as usize).cast::<u64>()) };
        a.store(value, Ordering::Release);
    }

    fn read_bytes(&self, offset: u64, out: &mut [u8]) -> bool {
        if !bytes_fit(self.len, offset, out.len()) {
            return false;
        }
        // SAFETY: the range lies inside the mapping `new`'s contract keeps valid; the copy
        // goes through raw pointers (no reference to the shared bytes is made). These bytes
        // are a device's data, not registers: a store the borrower makes meanwhile races
        // with the copy as it would with a real device's DMA engine.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            );
        }
        true
    }

    fn write_bytes(&self, offset: u64, data: &[u8]) -> bool {
        if !bytes_fit(self.len, offset, data.len()) {
            return false;
        }
        // SAFETY: as in read_bytes; the mapping is writable per `new`'s contract.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.base.add(offset as usize),
                data.len(),
            );
        }
        true
    }

    fn raw_span(&self, offset: u64, len: usize) -> Option<crate::RawSpan<'_>> {
        if !bytes_fit(self.len, offset, len) {
            return None;
        }
        // SAFETY: `offset` lies inside the mapping (checked above), so the sum stays in it.
        let ptr = std::ptr::NonNull::new(unsafe { self.base.add(offset as usize) })?;
        // SAFETY: the range lies inside the mapping that `new`'s contract keeps valid for as
        // long as `self` lives (the span borrows `self`), and accessed only by raw copies.
        Some(unsafe { crate::RawSpan::new(ptr, len) })
    }

    fn zero_bytes(&self, offset: u64, len: u64) -> bool {
        let Ok(n) = usize::try_from(len) else {
            return false;
        };
        if !bytes_fit(self.len, offset, n) {
            return false;
        }
        let start = offset as usize;
        let page = 4096usize;
        // The whole pages inside the range go back to the file they are shared from
        // (MADV_REMOVE punches a hole: later reads see zeroes, and the memory is freed).
        // Private memory (a heap buffer) refuses it with EINVAL; then, and for the partial
        // pages at either end, zero stores.
        let (lo, hi) = (start.next_multiple_of(page), (start + n) / page * page);
        let removed = lo < hi && {
            // SAFETY: [lo, hi) lies inside the mapping `new`'s contract keeps valid; MADV_REMOVE
            // changes no mapping, only the pages' contents (to zeroes), as a DMA would.
            let r = unsafe {
                libc::madvise(
                    self.base.add(lo).cast::<libc::c_void>(),
                    hi - lo,
                    libc::MADV_REMOVE,
                )
            };
            r == 0
        };
        let zero = |from: usize, to: usize| {
            // SAFETY: [from, to) lies inside the range checked above, in the writable mapping
            // of `new`'s contract; written through a raw pointer as in write_bytes.
            unsafe { std::ptr::write_bytes(self.base.add(from), 0, to - from) };
        };
        if removed {
            zero(start, lo);
            zero(hi, start + n);
        } else {
            zero(start, start + n);
        }
        true
    }
}

/// Register memory in a mapping that `backing` owns and keeps alive (a heap buffer, a memfd,
/// a mapped fabric window).
pub struct MappedRegisters<B> {
    raw: RawRegisters,
    backing: B,
}

impl<B> MappedRegisters<B> {
    /// Wrap `len` bytes at `base`, which belong to `backing`.
    ///
    /// # Safety
    /// As for [`RawRegisters::new`], for as long as `backing` lives: the memory must not move
    /// when `backing` does.
    pub unsafe fn with_backing(backing: B, base: *mut u8, len: usize) -> Self {
        // SAFETY: the caller guarantees `RawRegisters::new`'s contract while `backing` lives,
        // and `raw` lives in the same value.
        let raw = unsafe { RawRegisters::new(base, len) };
        MappedRegisters { raw, backing }
    }

    /// What owns the memory.
    pub fn backing(&self) -> &B {
        &self.backing
    }
}

impl<B: Send + Sync> RegisterMemory for MappedRegisters<B> {
    fn len(&self) -> usize {
        self.raw.len()
    }
    fn read32(&self, offset: u64) -> u32 {
        self.raw.read32(offset)
    }
    fn write32(&self, offset: u64, value: u32) {
        self.raw.write32(offset, value)
    }
    fn read64(&self, offset: u64) -> u64 {
        self.raw.read64(offset)
    }
    fn write64(&self, offset: u64, value: u64) {
        self.raw.write64(offset, value)
    }
    fn swap32(&self, offset: u64, value: u32) -> u32 {
        self.raw.swap32(offset, value)
    }
    fn read_bytes(&self, offset: u64, out: &mut [u8]) -> bool {
        self.raw.read_bytes(offset, out)
    }
    fn raw_span(&self, offset: u64, len: usize) -> Option<crate::RawSpan<'_>> {
        self.raw.raw_span(offset, len)
    }
    fn write_bytes(&self, offset: u64, data: &[u8]) -> bool {
        self.raw.write_bytes(offset, data)
    }
    fn zero_bytes(&self, offset: u64, len: u64) -> bool {
        self.raw.zero_bytes(offset, len)
    }
}

/// Heap-backed register memory (tests, the tcp fabric).
pub type HeapRegisters = MappedRegisters<Box<[AtomicU64]>>;

impl HeapRegisters {
    /// `len` bytes (rounded up to 8) of zeroed registers.
    pub fn new(len: usize) -> Self {
        let words = len.div_ceil(8);
        let buf: Box<[AtomicU64]> = (0..words).map(|_| AtomicU64::new(0)).collect();
        let base = buf.as_ptr() as *mut u8;
        // SAFETY: the boxed slice is 8-aligned, `words * 8` bytes long, owned by the value
        // (moving the box never moves its heap allocation) and only accessed atomically.
        unsafe { MappedRegisters::with_backing(buf, base, words * 8) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swap_returns_the_old_value_atomically() {
        let r = HeapRegisters::new(16);
        r.write32(4, 7);
        assert_eq!(r.swap32(4, 0), 7);
        assert_eq!(r.read32(4), 0);
        assert_eq!(r.swap32(4, 3), 0);
        assert_eq!(r.read32(4), 3);
        assert_eq!(r.swap32(16, 1), u32::MAX, "out of range");
        assert_eq!(r.swap32(2, 1), u32::MAX, "misaligned");
    }

    /// `zero_bytes` clears exactly its range (private memory: by stores) and refuses what
    /// `read_bytes` refuses.
    #[test]
    fn zero_bytes_clears_exactly_its_range() {
        let r = HeapRegisters::new(3 * 4096);
        for o in (0..3 * 4096).step_by(8) {
            r.write64(o, u64::MAX);
        }
        assert!(r.zero_bytes(8, 2 * 4096));
        assert_eq!(r.read64(0), u64::MAX);
        assert!((8..8 + 2 * 4096).step_by(8).all(|o| r.read64(o) == 0));
        assert_eq!(r.read64(8 + 2 * 4096), u64::MAX);
        assert!(!r.zero_bytes(4, 8), "misaligned");
        assert!(!r.zero_bytes(0, 3 * 4096 + 8), "past the end");
    }

    #[test]
    fn heap_registers_roundtrip_and_bounds() {
        let r = HeapRegisters::new(16);
        r.write32(4, 0xdead_beef);
        assert_eq!(r.read32(4), 0xdead_beef);
        r.write64(8, 0x1122_3344_5566_7788);
        assert_eq!(r.read32(8), 0x5566_7788);
        assert_eq!(r.read64(8), 0x1122_3344_5566_7788);
        assert_eq!(r.read32(16), u32::MAX);
        assert_eq!(r.read32(2), u32::MAX);
        r.write32(16, 1); // ignored
        assert_eq!(r.len(), 16);
    }

    /// Register memory with only the required methods: the trait's default bulk copies.
    struct Plain(HeapRegisters);
    impl RegisterMemory for Plain {
        fn len(&self) -> usize {
            self.0.len()
        }
        fn read32(&self, offset: u64) -> u32 {
            self.0.read32(offset)
        }
        fn write32(&self, offset: u64, value: u32) {
            self.0.write32(offset, value)
        }
    }

    #[test]
    fn bulk_copies_match_word_accesses_and_refuse_what_does_not_fit() {
        let fast = HeapRegisters::new(64);
        let slow = Plain(HeapRegisters::new(64));
        let data: Vec<u8> = (1..=32).collect();
        for r in [&fast as &dyn RegisterMemory, &slow] {
            assert!(r.write_bytes(16, &data));
            assert_eq!(r.read64(16), u64::from_le_bytes([1, 2, 3, 4, 5, 6, 7, 8]));
            assert_eq!(r.read32(44), u32::from_le_bytes([29, 30, 31, 32]));
            let mut back = [0u8; 32];
            assert!(r.read_bytes(16, &mut back));
            assert_eq!(back.as_slice(), data.as_slice());
            // Past the end, unaligned offset or length: refused, nothing touched.
            assert!(!r.write_bytes(40, &data));
            assert!(!r.write_bytes(4, &data[..8]));
            assert!(!r.write_bytes(0, &data[..12]));
            let mut out = [0xaau8; 8];
            assert!(!r.read_bytes(60, &mut out));
            assert!(!r.read_bytes(u64::MAX - 7, &mut out));
            assert_eq!(out, [0xaa; 8]);
            assert_eq!(r.read64(0), 0);
            assert!(r.read_bytes(56, &mut out));
        }
    }
}
