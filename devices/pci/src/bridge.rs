//! A PCI-to-PCI bridge: the upstream end of a switch (`topology.rs`), with one lender's
//! devices on its secondary bus.
//!
//! lendvm assigns everything as firmware would: the bus numbers (read-only here: the VMM
//! decodes configuration cycles by the numbers it chose, so a guest that renumbered would
//! lose its devices) and the I/O, memory and 64-bit prefetchable windows, which cover the
//! part of the root bus's windows that the devices behind the bridge take their BARs from.
//! Linux keeps firmware windows that hold their devices' BARs; it may write them (a
//! resource reassignment), and they read back as written. Forwarding is not modelled: the
//! VMM places every BAR on its buses directly, so a window only tells the guest's resource
//! code where the devices behind it live.

use std::any::Any;

use crate::configuration::class;
use crate::device::{ConfigWriteEffects, PciDevice};

/// Vendor and device id of the bridge: Red Hat's PCI-PCI bridge (`1b36:0001`, QEMU's
/// `pci-bridge`), which guest kernels bind no driver to beyond the PCI core's.
pub const BRIDGE_VENDOR_ID: u16 = 0x1b36;
pub const BRIDGE_DEVICE_ID: u16 = 0x0001;

/// The bridge's windows, `(base, size)` each; a size of 0 (or a part that does not meet the
/// window's granularity: 4 KiB for I/O, 1 MiB for memory) leaves the window closed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BridgeWindows {
    pub io: (u64, u64),
    pub mem32: (u64, u64),
    pub pref64: (u64, u64),
}

const IO_GRANULE: u64 = 0x1000;
const MEM_GRANULE: u64 = 0x10_0000;

/// Registers (dword index).
const REG_ID: usize = 0;
const REG_COMMAND: usize = 1;
const REG_CLASS: usize = 2;
const REG_HEADER: usize = 3;
const REG_BUS_NUMBERS: usize = 6;
const REG_IO: usize = 7;
const REG_MEM: usize = 8;
const REG_PREF: usize = 9;
const REG_PREF_BASE_UPPER: usize = 10;
const REG_PREF_LIMIT_UPPER: usize = 11;
const REG_IO_UPPER: usize = 12;
const REG_BRIDGE_CONTROL: usize = 15;

/// Bits of the Command register a bridge implements: I/O, memory, bus master, parity
/// error response, SERR#.
const COMMAND_MASK: u32 = 0x0147;
/// Bridge Control: parity error response, SERR#, ISA, VGA, master abort mode, secondary
/// bus reset; the rest read 0.
const BRIDGE_CONTROL_MASK: u32 = 0x005f << 16;

/// A type 1 configuration header with fixed bus numbers and guest-writable windows.
#[derive(Debug)]
pub struct PciBridge {
    regs: [u32; 64],
    /// Which bits of each register the guest may write.
    writable: [u32; 64],
}

fn window_ok((base, size): (u64, u64), granule: u64, limit: u64) -> bool {
    size >= granule
        && base % granule == 0
        && size % granule == 0
        && base.checked_add(size).is_some_and(|end| end - 1 <= limit)
}

impl PciBridge {
    /// A bridge on bus `primary` whose secondary (and subordinate) bus is `secondary`,
    /// with `windows` open.
    pub fn new(primary: u8, secondary: u8, windows: BridgeWindows) -> Self {
        let mut regs = [0u32; 64];
        let mut writable = [0u32; 64];
        regs[REG_ID] = u32::from(BRIDGE_DEVICE_ID) << 16 | u32::from(BRIDGE_VENDOR_ID);
        writable[REG_COMMAND] = COMMAND_MASK;
        regs[REG_CLASS] =
            u32::from(class::BRIDGE) << 24 | u32::from(class::PCI_BRIDGE_SUBCLASS) << 16;
        // Header type 1, single function.
        regs[REG_HEADER] = 0x01 << 16;
        // Secondary latency timer 0; primary, secondary, subordinate.
        regs[REG_BUS_NUMBERS] =
            u32::from(secondary) << 16 | u32::from(secondary) << 8 | u32::from(primary);

        // I/O base and limit: bits 15:12 of a 16-bit address in the upper nibble of each
        // byte; closed is base > limit.
        writable[REG_IO] = 0xf0f0;
        regs[REG_IO] = if window_ok(windows.io, IO_GRANULE, 0xffff) {
            let (base, size) = windows.io;
            let last = base + size - 1;
            (((last >> 8) & 0xf0) as u32) << 8 | ((base >> 8) & 0xf0) as u32
        } else {
            0x00f0
        };
        // Memory base and limit: bits 31:20 in bits 15:4 of each half.
        writable[REG_MEM] = 0xfff0_fff0;
        regs[REG_MEM] = if window_ok(windows.mem32, MEM_GRANULE, u64::from(u32::MAX)) {
            let (base, size) = windows.mem32;
            let last = base + size - 1;
            (((last >> 16) & 0xfff0) as u32) << 16 | ((base >> 16) & 0xfff0) as u32
        } else {
            0x0000_fff0
        };
        // Prefetchable: 64-bit (low nibble 1 in both halves), upper 32 bits apart.
        writable[REG_PREF] = 0xfff0_fff0;
        writable[REG_PREF_BASE_UPPER] = u32::MAX;
        writable[REG_PREF_LIMIT_UPPER] = u32::MAX;
        if window_ok(windows.pref64, MEM_GRANULE, u64::MAX) {
            let (base, size) = windows.pref64;
            let last = base + size - 1;
            regs[REG_PREF] =
                (((last >> 16) & 0xfff0) as u32 | 1) << 16 | ((base >> 16) & 0xfff0) as u32 | 1;
            regs[REG_PREF_BASE_UPPER] = (base >> 32) as u32;
            regs[REG_PREF_LIMIT_UPPER] = (last >> 32) as u32;
        } else {
            regs[REG_PREF] = 0x0001_fff1;
        }
        writable[REG_IO_UPPER] = 0;
        writable[REG_BRIDGE_CONTROL] = BRIDGE_CONTROL_MASK;
        Self { regs, writable }
    }

    /// Secondary bus number.
    pub fn secondary_bus(&self) -> u8 {
        (self.regs[REG_BUS_NUMBERS] >> 8) as u8
    }

    /// The memory window as programmed now, `(base, last)`; `None` when closed.
    pub fn mem32_window(&self) -> Option<(u64, u64)> {
        let r = self.regs[REG_MEM];
        let base = u64::from(r & 0xfff0) << 16;
        let last = (u64::from(r >> 16 & 0xfff0) << 16) | 0xf_ffff;
        (base <= last).then_some((base, last))
    }

    /// The prefetchable window as programmed now, `(base, last)`; `None` when closed.
    pub fn pref64_window(&self) -> Option<(u64, u64)> {
        let r = self.regs[REG_PREF];
        let base = u64::from(self.regs[REG_PREF_BASE_UPPER]) << 32 | u64::from(r & 0xfff0) << 16;
        let last = u64::from(self.regs[REG_PREF_LIMIT_UPPER]) << 32
            | u64::from(r >> 16 & 0xfff0) << 16
            | 0xf_ffff;
        (base <= last).then_some((base, last))
    }

    /// The I/O window as programmed now, `(base, last)`; `None` when closed.
    pub fn io_window(&self) -> Option<(u64, u64)> {
        let r = self.regs[REG_IO];
        let base = u64::from(r & 0xf0) << 8;
        let last = u64::from(r >> 8 & 0xf0) << 8 | 0xfff;
        (base <= last).then_some((base, last))
    }
}

impl PciDevice for PciBridge {
    fn id(&self) -> Option<String> {
        Some("pci-bridge".into())
    }

    fn read_config_register(&mut self, reg_idx: usize) -> u32 {
        // Past the header: no capabilities, and no extended ones (0 at 0x100).
        self.regs.get(reg_idx).copied().unwrap_or(0)
    }

    fn write_config_register(
        &mut self,
        reg_idx: usize,
        offset: u64,
        data: &[u8],
    ) -> ConfigWriteEffects {
        let (Some(reg), Some(&mask)) = (self.regs.get_mut(reg_idx), self.writable.get(reg_idx))
        else {
            return ConfigWriteEffects::default();
        };
        let shift = offset * 8;
        if shift >= 32 || data.is_empty() || data.len() > 4 || offset as usize + data.len() > 4 {
            return ConfigWriteEffects::default();
        }
        let mut value = [0u8; 4];
        value[..data.len()].copy_from_slice(data);
        let bytes_mask = (u64::from(u32::MAX) >> (32 - 8 * data.len() as u64)) as u32;
        let value = (u32::from_le_bytes(value) & bytes_mask) << shift;
        let mask = mask & (bytes_mask << shift);
        *reg = (*reg & !mask) | (value & mask);
        ConfigWriteEffects::default()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn windows() -> BridgeWindows {
        BridgeWindows {
            io: (0xc000, 0x2000),
            mem32: (0xd000_0000, 0x0800_0000),
            pref64: (0x80_0000_0000, 0x40_0000_0000),
        }
    }

    #[test]
    fn a_bridge_reads_as_type_1_with_its_buses_and_windows() {
        let mut b = PciBridge::new(0, 3, windows());
        assert_eq!(b.read_config_register(0), 0x0001_1b36);
        assert_eq!(b.read_config_register(2) >> 8, 0x06_0400);
        assert_eq!(b.read_config_register(3) >> 16 & 0x7f, 1);
        assert_eq!(b.read_config_register(6) & 0xff_ffff, 0x03_0300);
        assert_eq!(b.io_window(), Some((0xc000, 0xdfff)));
        assert_eq!(b.mem32_window(), Some((0xd000_0000, 0xd7ff_ffff)));
        assert_eq!(b.pref64_window(), Some((0x80_0000_0000, 0xbf_ffff_ffff)));
        // 64-bit prefetchable: the low nibble of both halves says so.
        assert_eq!(b.read_config_register(9) & 0x000f_000f, 0x0001_0001);
        assert_eq!(b.read_config_register(0x40), 0, "no extended capabilities");
        assert_eq!(b.secondary_bus(), 3);
    }

    #[test]
    fn bus_numbers_stay_and_windows_read_back_as_written() {
        let mut b = PciBridge::new(0, 1, windows());
        // A guest renumbering the bridge changes nothing: the VMM decodes by its numbers.
        b.write_config_register(6, 0, &[0, 9, 9, 0]);
        assert_eq!(b.read_config_register(6) & 0xff_ffff, 0x01_0100);
        // Closing the memory window (base above limit), then a 16-bit write of its base.
        b.write_config_register(8, 0, &0x0000_fff0u32.to_le_bytes());
        assert_eq!(b.mem32_window(), None);
        b.write_config_register(8, 0, &0xd000u16.to_le_bytes());
        b.write_config_register(8, 2, &0xd7f0u16.to_le_bytes());
        assert_eq!(b.mem32_window(), Some((0xd000_0000, 0xd7ff_ffff)));
        // The 64-bit flag nibble and the reserved bits are not writable.
        b.write_config_register(9, 0, &0u32.to_le_bytes());
        assert_eq!(b.read_config_register(9) & 0xf, 1);
        // Command: memory and bus master stick, reserved bits do not.
        b.write_config_register(1, 0, &0xffffu16.to_le_bytes());
        assert_eq!(b.read_config_register(1) & 0xffff, 0x0147);
        // Writes past the header or of odd shapes are ignored.
        b.write_config_register(200, 0, &[1]);
        b.write_config_register(8, 3, &[1, 2]);
        assert_eq!(b.mem32_window(), Some((0xd000_0000, 0xd7ff_ffff)));
    }

    #[test]
    fn windows_that_miss_their_granularity_stay_closed() {
        let mut b = PciBridge::new(
            0,
            1,
            BridgeWindows {
                io: (0x8800, 0x800),
                mem32: (0xd000_0000, 0x8_0000),
                pref64: (0, 0),
            },
        );
        assert_eq!(
            (b.io_window(), b.mem32_window(), b.pref64_window()),
            (None, None, None)
        );
        assert_eq!(b.read_config_register(7) & 0xffff, 0x00f0);
        assert_eq!(b.read_config_register(9), 0x0001_fff1);
    }
}
