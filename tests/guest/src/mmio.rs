//! Volatile MMIO accessors and the unclaimed-MMIO test.

use crate::Results;

pub fn read32(addr: u64) -> u32 {
    // SAFETY: the guest identity-maps the first 4 GiB; MMIO addresses are device registers.
    unsafe { core::ptr::read_volatile(addr as *const u32) }
}

pub fn write32(addr: u64, v: u32) {
    // SAFETY: as above.
    unsafe { core::ptr::write_volatile(addr as *mut u32, v) }
}

#[allow(dead_code)]
pub fn read16(addr: u64) -> u16 {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(addr as *const u16) }
}

#[allow(dead_code)]
pub fn read8(addr: u64) -> u8 {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(addr as *const u8) }
}

/// An address in the 32-bit BAR window that no device claims.
const UNCLAIMED: u64 = 0xdff0_0000;

/// A read from unclaimed MMIO exits to the VMM and returns all ones.
pub fn test(r: &mut Results) {
    write32(UNCLAIMED, 0x1234_5678);
    let v = read32(UNCLAIMED);
    r.report("mmio-unclaimed", v == 0xffff_ffff)
        .s("read ")
        .hex(v as u64)
        .nl();
}
