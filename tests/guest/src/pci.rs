//! PCI enumeration through ECAM (and a cross-check through config mechanism #1).

use crate::io::{inl, outl};
use crate::mmio;
use crate::serial::Out;
use crate::Results;

/// ECAM base, segment 0 (`docs/CONTRACTS.md`).
pub const ECAM_BASE: u64 = 0xe000_0000;

pub fn ecam_addr(bus: u8, dev: u8, func: u8, off: u16) -> u64 {
    ECAM_BASE | (bus as u64) << 20 | (dev as u64) << 15 | (func as u64) << 12 | (off as u64 & 0xfff)
}

pub fn ecam_read32(bus: u8, dev: u8, func: u8, off: u16) -> u32 {
    mmio::read32(ecam_addr(bus, dev, func, off))
}

#[allow(dead_code)]
pub fn ecam_write32(bus: u8, dev: u8, func: u8, off: u16, v: u32) {
    mmio::write32(ecam_addr(bus, dev, func, off), v)
}

pub fn cf8_read32(bus: u8, dev: u8, func: u8, off: u8) -> u32 {
    let addr = 0x8000_0000u32
        | (bus as u32) << 16
        | (dev as u32) << 11
        | (func as u32) << 8
        | (off as u32 & 0xfc);
    outl(0xcf8, addr);
    inl(0xcfc)
}

fn bdf(o: Out, bus: u8, dev: u8, func: u8) -> Out {
    o.hex_digits(bus as u64, 2)
        .s(":")
        .hex_digits(dev as u64, 2)
        .s(".")
        .hex_digits(func as u64, 1)
}

/// Lists bus 0 through ECAM and checks the host bridge at 00:00.0.
pub fn test(r: &mut Results) {
    let mut found = 0u32;
    let mut bridge: Option<u32> = None;
    for dev in 0..32u8 {
        let id = ecam_read32(0, dev, 0, 0);
        if id & 0xffff == 0xffff {
            continue;
        }
        let header = (ecam_read32(0, dev, 0, 0xc) >> 16) as u8;
        let funcs = if header & 0x80 != 0 { 8 } else { 1 };
        for func in 0..funcs {
            let id = ecam_read32(0, dev, func, 0);
            if id & 0xffff == 0xffff {
                continue;
            }
            found += 1;
            let class = ecam_read32(0, dev, func, 8) >> 8;
            bdf(Out.s("PCI "), 0, dev, func)
                .s(" ")
                .hex_digits((id & 0xffff) as u64, 4)
                .s(":")
                .hex_digits((id >> 16) as u64, 4)
                .s(" class ")
                .hex_digits(class as u64, 6)
                .nl();
            if dev == 0 && func == 0 {
                bridge = Some(id);
            }
        }
    }
    let ok = bridge == Some(0x0d57_8086);
    let id = bridge.unwrap_or(0xffff_ffff);
    bdf(r.report("pci-ecam", ok), 0, 0, 0)
        .s(" ")
        .hex_digits((id & 0xffff) as u64, 4)
        .s(":")
        .hex_digits((id >> 16) as u64, 4)
        .s(" functions ")
        .dec(found as u64)
        .nl();
    let via_cf8 = cf8_read32(0, 0, 0, 0);
    r.report("pci-cf8", via_cf8 == id && ok)
        .s("00:00.0 ")
        .hex(via_cf8 as u64)
        .nl();
}
