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

use crate::configuration::{class, PciConfiguration, PciConfigurationParams, PciHeaderType};
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
const REG_COMMAND: usize = 1;
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
/// bus reset; the rest read 0. Interrupt Line stays writable beside it.
const BRIDGE_CONTROL_MASK: u32 = 0x005f << 16 | 0xff;

/// A type 1 configuration header ([`PciConfiguration`] with the bridge's masks) with fixed
/// bus numbers and guest-writable windows.
#[derive(Debug)]
pub struct PciBridge {
    config: PciConfiguration,
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
        let mut config = PciConfiguration::new(&PciConfigurationParams {
            vendor_id: BRIDGE_VENDOR_ID,
            device_id: BRIDGE_DEVICE_ID,
            class_code: class::BRIDGE,
            subclass: class::PCI_BRIDGE_SUBCLASS,
            header_type: PciHeaderType::Bridge,
            // Reads of 0x100 and past see 0: no extended capabilities.
            extended: true,
            ..Default::default()
        });
        let mut set =
            |reg: usize, value: u32| config.write_bytes_raw(reg * 4, &value.to_le_bytes());
        // Primary, secondary, subordinate; secondary latency timer 0.
        set(
            REG_BUS_NUMBERS,
            u32::from(secondary) << 16 | u32::from(secondary) << 8 | u32::from(primary),
        );
        // I/O base and limit: bits 15:12 of a 16-bit address in the upper nibble of each
        // byte; closed is base > limit.
        set(
            REG_IO,
            if window_ok(windows.io, IO_GRANULE, 0xffff) {
                let (base, size) = windows.io;
                let last = base + size - 1;
                (((last >> 8) & 0xf0) as u32) << 8 | ((base >> 8) & 0xf0) as u32
            } else {
                0x00f0
            },
        );
        // Memory base and limit: bits 31:20 in bits 15:4 of each half.
        set(
            REG_MEM,
            if window_ok(windows.mem32, MEM_GRANULE, u64::from(u32::MAX)) {
                let (base, size) = windows.mem32;
                let last = base + size - 1;
                (((last >> 16) & 0xfff0) as u32) << 16 | ((base >> 16) & 0xfff0) as u32
            } else {
                0x0000_fff0
            },
        );
        // Prefetchable: 64-bit (low nibble 1 in both halves, read-only), upper 32 bits apart.
        if window_ok(windows.pref64, MEM_GRANULE, u64::MAX) {
            let (base, size) = windows.pref64;
            let last = base + size - 1;
            set(
                REG_PREF,
                (((last >> 16) & 0xfff0) as u32 | 1) << 16 | ((base >> 16) & 0xfff0) as u32 | 1,
            );
            set(REG_PREF_BASE_UPPER, (base >> 32) as u32);
            set(REG_PREF_LIMIT_UPPER, (last >> 32) as u32);
        } else {
            set(REG_PREF, 0x0001_fff1);
        }
        // The masks PciConfiguration gives a type 1 header, less what lendvm fixes: the bus
        // numbers (the VMM decodes configuration cycles by them) and the I/O upper halves
        // (16-bit I/O decode); Command and Bridge Control to the bits a bridge implements.
        config.set_writable_bits(REG_BUS_NUMBERS, 0);
        config.set_writable_bits(REG_IO_UPPER, 0);
        config.set_writable_bits(REG_COMMAND, COMMAND_MASK);
        config.set_writable_bits(REG_BRIDGE_CONTROL, BRIDGE_CONTROL_MASK);
        Self { config }
    }

    fn reg(&self, reg: usize) -> u32 {
        self.config.read_reg(reg)
    }

    /// Secondary bus number.
    pub fn secondary_bus(&self) -> u8 {
        (self.reg(REG_BUS_NUMBERS) >> 8) as u8
    }

    /// The memory window as programmed now, `(base, last)`; `None` when closed.
    pub fn mem32_window(&self) -> Option<(u64, u64)> {
        let r = self.reg(REG_MEM);
        let base = u64::from(r & 0xfff0) << 16;
        let last = (u64::from(r >> 16 & 0xfff0) << 16) | 0xf_ffff;
        (base <= last).then_some((base, last))
    }

    /// The prefetchable window as programmed now, `(base, last)`; `None` when closed.
    pub fn pref64_window(&self) -> Option<(u64, u64)> {
        let r = self.reg(REG_PREF);
        let base = u64::from(self.reg(REG_PREF_BASE_UPPER)) << 32 | u64::from(r & 0xfff0) << 16;
        let last = u64::from(self.reg(REG_PREF_LIMIT_UPPER)) << 32
            | u64::from(r >> 16 & 0xfff0) << 16
            | 0xf_ffff;
        (base <= last).then_some((base, last))
    }

    /// The I/O window as programmed now, `(base, last)`; `None` when closed.
    pub fn io_window(&self) -> Option<(u64, u64)> {
        let r = self.reg(REG_IO);
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
        self.config.read_reg(reg_idx)
    }

    fn write_config_register(
        &mut self,
        reg_idx: usize,
        offset: u64,
        data: &[u8],
    ) -> ConfigWriteEffects {
        self.config.write_config_register(reg_idx, offset, data)
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
