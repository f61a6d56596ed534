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

/// Command register bits.
pub const CMD_MEM: u16 = 1 << 1;
pub const CMD_BUS_MASTER: u16 = 1 << 2;
pub const CMD_INTX_DISABLE: u16 = 1 << 10;
/// Capability ids.
pub const CAP_MSIX: u8 = 0x11;

/// One PCI function on segment 0, reached through ECAM.
#[derive(Clone, Copy)]
pub struct Func {
    pub bus: u8,
    pub dev: u8,
    pub func: u8,
}

impl Func {
    pub fn new(bus: u8, dev: u8, func: u8) -> Self {
        Func { bus, dev, func }
    }

    pub fn read32(&self, off: u16) -> u32 {
        ecam_read32(self.bus, self.dev, self.func, off)
    }

    pub fn write32(&self, off: u16, v: u32) {
        ecam_write32(self.bus, self.dev, self.func, off, v)
    }

    /// `device << 16 | vendor`; all ones if nothing answers.
    pub fn id(&self) -> u32 {
        self.read32(0)
    }

    pub fn present(&self) -> bool {
        self.id() & 0xffff != 0xffff
    }

    /// Class code `0xBBSSPP`.
    pub fn class(&self) -> u32 {
        self.read32(8) >> 8
    }

    pub fn command(&self) -> u16 {
        self.read32(4) as u16
    }

    /// Writes Command; the Status half is written as 0 (its RW1C bits stay untouched).
    pub fn set_command(&self, cmd: u16) {
        self.write32(4, cmd as u32)
    }

    /// The address of memory BAR `index` as the VMM assigned it (64-bit BARs combined).
    pub fn bar(&self, index: u8) -> u64 {
        let off = 0x10 + 4 * index as u16;
        let lo = self.read32(off);
        if lo & 1 != 0 {
            return 0; // I/O BAR
        }
        let mut addr = (lo & !0xf) as u64;
        if lo & 0b110 == 0b100 && index < 5 {
            addr |= (self.read32(off + 4) as u64) << 32;
        }
        addr
    }

    /// Offset of capability `id` in the standard list (bounded walk).
    pub fn find_cap(&self, id: u8) -> Option<u16> {
        if self.read32(4) >> 16 & 0x10 == 0 {
            return None;
        }
        let mut p = (self.read32(0x34) & 0xfc) as u16;
        let mut steps = 0;
        while p >= 0x40 && steps < 48 {
            let hdr = self.read32(p);
            if hdr as u8 == id {
                return Some(p);
            }
            p = ((hdr >> 8) & 0xfc) as u16;
            steps += 1;
        }
        None
    }

    /// Prints `BB:DD.F`.
    pub fn print(&self, o: Out) -> Out {
        bdf(o, self.bus, self.dev, self.func)
    }

    /// Prints `vvvv:dddd`.
    pub fn print_id(&self, o: Out) -> Out {
        let id = self.id();
        o.hex_digits((id & 0xffff) as u64, 4)
            .s(":")
            .hex_digits((id >> 16) as u64, 4)
    }
}

/// The first function for which `pred` holds, on bus 0 and behind the PCI-to-PCI bridges
/// found there (a lender's switch: class 0x0604, its secondary bus in config byte 0x19),
/// bus 0 first.
pub fn find(pred: impl Fn(&Func) -> bool) -> Option<Func> {
    // Buses still to scan, as bits (lendvm numbers fewer than 32); a bitmap, not an array:
    // array code here compiles to vector instructions the emulator cannot run.
    let mut pending: u32 = 1;
    while pending != 0 {
        let bus = pending.trailing_zeros() as u8;
        pending &= !(1u32 << bus);
        for dev in 0..32u8 {
            let f0 = Func::new(bus, dev, 0);
            if !f0.present() {
                continue;
            }
            let funcs = if (f0.read32(0xc) >> 16) & 0x80 != 0 {
                8
            } else {
                1
            };
            for func in 0..funcs {
                let f = Func::new(bus, dev, func);
                if !f.present() {
                    continue;
                }
                if pred(&f) {
                    return Some(f);
                }
                let secondary = (f.read32(0x18) >> 8) & 0xff;
                if f.class() >> 8 == 0x0604 && secondary > u32::from(bus) && secondary < 32 {
                    pending |= 1u32 << secondary;
                }
            }
        }
    }
    None
}

/// MSI-X of one function: table location and the capability.
pub struct Msix {
    f: Func,
    cap: u16,
    table: u64,
    pub vectors: u16,
}

impl Msix {
    /// Reads the capability; the table BAR must already hold its address.
    pub fn probe(f: Func) -> Option<Msix> {
        let cap = f.find_cap(CAP_MSIX)?;
        let ctl = f.read32(cap) >> 16;
        let tbl = f.read32(cap + 4);
        let bar = f.bar((tbl & 7) as u8);
        if bar == 0 {
            return None;
        }
        Some(Msix {
            f,
            cap,
            table: bar + (tbl & !7) as u64,
            vectors: ((ctl & 0x7ff) + 1) as u16,
        })
    }

    pub fn table(&self) -> u64 {
        self.table
    }

    /// Points table entry `entry` at `vector` on this CPU (fixed, edge) and unmasks it.
    pub fn route(&self, entry: u16, vector: u8) {
        let e = self.table + 16 * entry as u64;
        mmio::write32(e + 12, 1); // masked while it changes
        mmio::write32(e, 0xfee0_0000 | crate::interrupts::apic_id() << 12);
        mmio::write32(e + 4, 0);
        mmio::write32(e + 8, vector as u32);
        mmio::write32(e + 12, 0);
    }

    /// Sets MSI-X Enable (and clears Function Mask), or clears both.
    pub fn enable(&self, on: bool) {
        let hdr = self.f.read32(self.cap) & 0x3fff_ffff;
        self.f
            .write32(self.cap, if on { hdr | 1 << 31 } else { hdr });
    }
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
