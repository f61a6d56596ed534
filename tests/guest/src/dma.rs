//! The DMA arena: page-aligned guest RAM that device drivers hand to devices (queues, PRP
//! lists, data buffers). The guest is identity mapped, so an arena address is both the
//! pointer and the bus address (the VMM maps guest RAM at IOVA = GPA on Bus Master Enable).
//!
//! Layout (pages): 0..8 control pages (queues, identify data, PRP list, dmatest source and
//! destination), [`DATA_A`] and [`DATA_B`] two 64-page data buffers.

use core::ptr::{addr_of, read_volatile, write_volatile};

pub const PAGE: u64 = 4096;
const CONTROL_PAGES: u64 = 8;
/// Pages per data buffer: 64 LBAs of up to 4 KiB.
pub const DATA_PAGES: u64 = 64;
const ARENA_PAGES: u64 = CONTROL_PAGES + 2 * DATA_PAGES;

#[repr(C, align(4096))]
struct Arena([u8; ARENA_PAGES as usize * PAGE as usize]);

static mut ARENA: Arena = Arena([0; ARENA_PAGES as usize * PAGE as usize]);

/// Address of control page `n` (0..8).
pub fn page(n: u64) -> u64 {
    addr_of!(ARENA) as u64 + (n % CONTROL_PAGES) * PAGE
}

/// First data buffer ([`DATA_PAGES`] pages).
pub fn data_a() -> u64 {
    addr_of!(ARENA) as u64 + CONTROL_PAGES * PAGE
}

/// Second data buffer ([`DATA_PAGES`] pages).
pub fn data_b() -> u64 {
    data_a() + DATA_PAGES * PAGE
}

/// Zeroes `len` bytes at `addr` (`rep stosb`).
pub fn zero(addr: u64, len: u64) {
    // SAFETY: callers pass arena ranges.
    unsafe { crate::mem::memset(addr as *mut u8, 0, len as usize) };
}

pub fn read64(addr: u64) -> u64 {
    // SAFETY: arena memory; volatile because devices write it behind the compiler's back.
    unsafe { read_volatile(addr as *const u64) }
}

pub fn write64(addr: u64, v: u64) {
    // SAFETY: arena memory.
    unsafe { write_volatile(addr as *mut u64, v) }
}

pub fn read32(addr: u64) -> u32 {
    // SAFETY: as above.
    unsafe { read_volatile(addr as *const u32) }
}

pub fn write32(addr: u64, v: u32) {
    // SAFETY: as above.
    unsafe { write_volatile(addr as *mut u32, v) }
}

/// Word `w` of the test pattern (the host recomputes it to check a backing file):
/// `seed << 32 | w` for the little-endian u64 at byte offset `8 * w` of the region.
pub fn pattern_word(seed: u32, w: u64) -> u64 {
    (seed as u64) << 32 | (w & 0xffff_ffff)
}

/// Fills `len` bytes (a multiple of 8) at `addr` with the pattern.
pub fn fill_pattern(addr: u64, len: u64, seed: u32) {
    let mut w = 0;
    while w < len / 8 {
        write64(addr + 8 * w, pattern_word(seed, w));
        w += 1;
    }
}

/// Byte offset of the first word that differs from the pattern, if any.
pub fn check_pattern(addr: u64, len: u64, seed: u32) -> Option<u64> {
    let mut w = 0;
    while w < len / 8 {
        if read64(addr + 8 * w) != pattern_word(seed, w) {
            return Some(8 * w);
        }
        w += 1;
    }
    None
}
