//! PCI configuration-space helper: 256-byte conventional or 4 KiB extended space with
//! per-register writable masks, RW1C status bits, BARs (with the sizing protocol), the
//! Command register with change reporting, and capability / extended capability lists.
//!
//! BAR registers hold what the guest reads. Each BAR also has a *committed* address, which
//! only changes on writes that are not the all-ones sizing pattern; a change of the committed
//! address is reported as a [`BarMove`], so sizing (write `0xffff_ffff`, read the mask, write
//! the old value back) never produces moves. A 64-bit BAR reports a move for each half that
//! changes the address (the low half first, as guests write it).

use std::fmt;

use crate::device::{BarMove, CommandChange, ConfigWriteEffects};

/// Registers (dwords) of the conventional 256-byte space.
pub const NUM_CONFIGURATION_REGISTERS: usize = 64;
/// Registers (dwords) of the 4 KiB PCIe extended space.
pub const NUM_EXTENDED_CONFIGURATION_REGISTERS: usize = 1024;
/// Size in bytes of the conventional space.
pub const CONFIG_SPACE_SIZE: usize = 256;
/// Size in bytes of the PCIe extended space.
pub const EXTENDED_CONFIG_SPACE_SIZE: usize = 4096;
/// Number of BAR registers of a type 0 header.
pub const NUM_BAR_REGS: usize = 6;

/// Register index of Command (low 16 bits) / Status (high 16 bits).
pub const COMMAND_REG: usize = 1;
/// Register index of Class code / revision.
pub const CLASS_REG: usize = 2;
/// Register index of Cache line size / latency / header type / BIST.
pub const HEADER_TYPE_REG: usize = 3;
/// Register index of BAR0.
pub const BAR0_REG: usize = 4;
/// Register index of the subsystem ids (type 0).
pub const SUBSYSTEM_REG: usize = 11;
/// Register index of the expansion ROM BAR (type 0).
pub const ROM_BAR_REG: usize = 12;
/// Register index of the expansion ROM BAR (type 1).
pub const BRIDGE_ROM_BAR_REG: usize = 14;
/// Register index of Interrupt line / pin.
pub const INTERRUPT_REG: usize = 15;
/// Byte offset of the Capabilities Pointer.
pub const CAPABILITY_LIST_HEAD_OFFSET: usize = 0x34;
/// Byte offset of the first capability this helper places.
pub const FIRST_CAPABILITY_OFFSET: usize = 0x40;
/// Byte offset of the first extended capability.
pub const FIRST_EXTENDED_CAPABILITY_OFFSET: usize = 0x100;

/// Command register bits.
pub mod command {
    pub const IO_SPACE: u16 = 1 << 0;
    pub const MEMORY_SPACE: u16 = 1 << 1;
    pub const BUS_MASTER: u16 = 1 << 2;
    pub const MEMORY_WRITE_INVALIDATE: u16 = 1 << 4;
    pub const PARITY_ERROR_RESPONSE: u16 = 1 << 6;
    pub const SERR_ENABLE: u16 = 1 << 8;
    pub const INTX_DISABLE: u16 = 1 << 10;
    /// Bits a guest can change.
    pub const WRITABLE: u16 = IO_SPACE
        | MEMORY_SPACE
        | BUS_MASTER
        | MEMORY_WRITE_INVALIDATE
        | PARITY_ERROR_RESPONSE
        | SERR_ENABLE
        | INTX_DISABLE;
}

/// Status register bits.
pub mod status {
    pub const INTERRUPT: u16 = 1 << 3;
    pub const CAPABILITIES_LIST: u16 = 1 << 4;
    pub const MASTER_DATA_PARITY_ERROR: u16 = 1 << 8;
    pub const SIGNALED_TARGET_ABORT: u16 = 1 << 11;
    pub const RECEIVED_TARGET_ABORT: u16 = 1 << 12;
    pub const RECEIVED_MASTER_ABORT: u16 = 1 << 13;
    pub const SIGNALED_SYSTEM_ERROR: u16 = 1 << 14;
    pub const DETECTED_PARITY_ERROR: u16 = 1 << 15;
    /// Write-1-to-clear bits.
    pub const RW1C: u16 = MASTER_DATA_PARITY_ERROR
        | SIGNALED_TARGET_ABORT
        | RECEIVED_TARGET_ABORT
        | RECEIVED_MASTER_ABORT
        | SIGNALED_SYSTEM_ERROR
        | DETECTED_PARITY_ERROR;
}

/// A few class codes used in this project.
pub mod class {
    pub const MASS_STORAGE: u8 = 0x01;
    pub const NVM_SUBCLASS: u8 = 0x08;
    pub const NVME_PROG_IF: u8 = 0x02;
    pub const BRIDGE: u8 = 0x06;
    pub const HOST_BRIDGE_SUBCLASS: u8 = 0x00;
    pub const PCI_BRIDGE_SUBCLASS: u8 = 0x04;
    pub const OTHER: u8 = 0xff;
}

/// Capability ids.
pub mod cap_id {
    pub const POWER_MANAGEMENT: u8 = 0x01;
    pub const MSI: u8 = 0x05;
    pub const VENDOR_SPECIFIC: u8 = 0x09;
    pub const SUBSYSTEM_VENDOR: u8 = 0x0d;
    pub const PCI_EXPRESS: u8 = 0x10;
    pub const MSIX: u8 = 0x11;
    pub const SATA: u8 = 0x12;
    pub const ADVANCED_FEATURES: u8 = 0x13;
}

/// Errors of configuration-space construction.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("bar index {0} is out of range for this header")]
    BarIndexInvalid(usize),
    #[error("bar {0} is already in use")]
    BarInUse(usize),
    #[error("bar {idx} size {size:#x} is not a power of two of at least {min:#x}")]
    BarSizeInvalid { idx: usize, size: u64, min: u64 },
    #[error("bar {idx} address {addr:#x} is not aligned to its size {size:#x}")]
    BarAddressUnaligned { idx: usize, addr: u64, size: u64 },
    #[error("bar {idx} of type {region_type:?} cannot hold address {addr:#x} size {size:#x}")]
    BarAddressTooLarge {
        idx: usize,
        addr: u64,
        size: u64,
        region_type: PciBarRegionType,
    },
    #[error("capability of {len} bytes is invalid (needs id and next bytes, at most {max})")]
    CapabilityLengthInvalid { len: usize, max: usize },
    #[error("capability writable mask has {mask} bytes but the capability has {len}")]
    CapabilityMaskLength { mask: usize, len: usize },
    #[error("no room for a capability of {len:#x} bytes at {offset:#x}")]
    CapabilitySpaceFull { offset: usize, len: usize },
    #[error("extended capabilities need a 4 KiB configuration space")]
    NoExtendedSpace,
    #[error("capability pointer {ptr:#x} is invalid")]
    CapabilityPointerInvalid { ptr: usize },
    #[error("capability list loops at {ptr:#x}")]
    CapabilityLoop { ptr: usize },
    #[error("configuration snapshot of {0} bytes is neither 256 nor 4096 bytes")]
    SnapshotSize(usize),
    #[error("header type {0:#x} is not supported")]
    HeaderTypeUnsupported(u8),
}

/// Header layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PciHeaderType {
    /// Type 0: endpoint (also used for the host bridge, as Cloud Hypervisor does).
    Device,
    /// Type 1: PCI-to-PCI bridge.
    Bridge,
}

impl PciHeaderType {
    fn num_bars(self) -> usize {
        match self {
            PciHeaderType::Device => NUM_BAR_REGS,
            PciHeaderType::Bridge => 2,
        }
    }
}

/// Legacy interrupt pin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PciInterruptPin {
    IntA = 1,
    IntB = 2,
    IntC = 3,
    IntD = 4,
}

/// Address space a BAR decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PciBarRegionType {
    /// Port I/O.
    Io,
    /// 32-bit memory.
    Memory32,
    /// 64-bit memory (uses two BAR registers).
    Memory64,
}

impl PciBarRegionType {
    /// True for the memory types.
    pub fn is_memory(self) -> bool {
        !matches!(self, PciBarRegionType::Io)
    }
}

/// A BAR a device exposes, with its VMM-assigned address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PciBarConfiguration {
    /// BAR index (0..=5); a 64-bit BAR also uses `idx + 1`.
    pub idx: usize,
    /// Guest address (port for I/O BARs).
    pub addr: u64,
    /// Size in bytes (power of two; at least 16 for memory, 4 for I/O).
    pub size: u64,
    pub region_type: PciBarRegionType,
    pub prefetchable: bool,
}

impl PciBarConfiguration {
    pub fn new(
        idx: usize,
        addr: u64,
        size: u64,
        region_type: PciBarRegionType,
        prefetchable: bool,
    ) -> Self {
        Self {
            idx,
            addr,
            size,
            region_type,
            prefetchable,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BarSlot {
    Unused,
    Bar(PciBarConfiguration),
    /// Upper half of the 64-bit BAR at the previous index.
    Upper,
}

/// Identity of a function, for [`PciConfiguration::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PciConfigurationParams {
    pub vendor_id: u16,
    pub device_id: u16,
    pub revision_id: u8,
    pub class_code: u8,
    pub subclass: u8,
    pub prog_if: u8,
    pub subsystem_vendor_id: u16,
    pub subsystem_id: u16,
    pub header_type: PciHeaderType,
    /// Multi-function bit in the header type byte.
    pub multi_function: bool,
    /// 4 KiB PCIe extended space instead of 256 bytes.
    pub extended: bool,
    pub interrupt_pin: Option<PciInterruptPin>,
}

impl Default for PciConfigurationParams {
    fn default() -> Self {
        Self {
            vendor_id: 0xffff,
            device_id: 0xffff,
            revision_id: 0,
            class_code: class::OTHER,
            subclass: 0,
            prog_if: 0,
            subsystem_vendor_id: 0,
            subsystem_id: 0,
            header_type: PciHeaderType::Device,
            multi_function: false,
            extended: false,
            interrupt_pin: None,
        }
    }
}

/// A capability found by walking a capability list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CapabilityInfo {
    pub id: u8,
    /// Byte offset of the capability header.
    pub offset: usize,
}

/// An extended capability found by walking the extended list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtCapabilityInfo {
    pub id: u16,
    pub version: u8,
    /// Byte offset of the extended capability header.
    pub offset: usize,
}

fn read_u32_le(space: &[u8], offset: usize) -> u32 {
    let mut b = [0u8; 4];
    if let Some(s) = space.get(offset..offset + 4) {
        b.copy_from_slice(s);
    }
    u32::from_le_bytes(b)
}

/// Walks the capability list of a raw configuration space (256 or 4096 bytes) from the
/// Capabilities Pointer at 0x34. Returns an empty list when the Status register's
/// Capabilities List bit is clear. Rejects pointers into the header and loops.
pub fn walk_capabilities(space: &[u8]) -> Result<Vec<CapabilityInfo>, ConfigError> {
    let mut caps = Vec::new();
    if space.len() < CONFIG_SPACE_SIZE {
        return Err(ConfigError::SnapshotSize(space.len()));
    }
    let status = u16::from_le_bytes([space[6], space[7]]);
    if status & status::CAPABILITIES_LIST == 0 {
        return Ok(caps);
    }
    let mut seen = [false; CONFIG_SPACE_SIZE / 4];
    let mut ptr = usize::from(space[CAPABILITY_LIST_HEAD_OFFSET] & !3);
    while ptr != 0 {
        if !(FIRST_CAPABILITY_OFFSET..CONFIG_SPACE_SIZE - 1).contains(&ptr) {
            return Err(ConfigError::CapabilityPointerInvalid { ptr });
        }
        if seen[ptr / 4] {
            return Err(ConfigError::CapabilityLoop { ptr });
        }
        seen[ptr / 4] = true;
        caps.push(CapabilityInfo {
            id: space[ptr],
            offset: ptr,
        });
        ptr = usize::from(space[ptr + 1] & !3);
    }
    Ok(caps)
}

/// Walks the extended capability list of a 4 KiB configuration space from 0x100.
/// A 256-byte space, or a header of 0 or all-ones at 0x100, has no extended capabilities.
pub fn walk_extended_capabilities(space: &[u8]) -> Result<Vec<ExtCapabilityInfo>, ConfigError> {
    let mut caps = Vec::new();
    if space.len() < EXTENDED_CONFIG_SPACE_SIZE {
        return Ok(caps);
    }
    let mut seen = vec![false; EXTENDED_CONFIG_SPACE_SIZE / 4];
    let mut ptr = FIRST_EXTENDED_CAPABILITY_OFFSET;
    loop {
        let header = read_u32_le(space, ptr);
        if header == 0 || header == u32::MAX {
            break;
        }
        if seen[ptr / 4] {
            return Err(ConfigError::CapabilityLoop { ptr });
        }
        seen[ptr / 4] = true;
        caps.push(ExtCapabilityInfo {
            id: (header & 0xffff) as u16,
            version: ((header >> 16) & 0xf) as u8,
            offset: ptr,
        });
        let next = ((header >> 20) & 0xffc) as usize;
        if next == 0 {
            break;
        }
        if next < FIRST_EXTENDED_CAPABILITY_OFFSET {
            return Err(ConfigError::CapabilityPointerInvalid { ptr: next });
        }
        ptr = next;
    }
    Ok(caps)
}

/// Best-effort length of a standard capability, used to append after snapshot capabilities.
fn capability_len(space: &[u8], cap: &CapabilityInfo) -> usize {
    let at = |o: usize| space.get(cap.offset + o).copied().unwrap_or(0);
    match cap.id {
        cap_id::POWER_MANAGEMENT => 8,
        cap_id::MSI => {
            let ctl = u16::from_le_bytes([at(2), at(3)]);
            let base = if ctl & crate::msi::MSI_CTL_64_BIT != 0 {
                14
            } else {
                10
            };
            if ctl & crate::msi::MSI_CTL_PER_VECTOR_MASK != 0 {
                base + 10
            } else {
                base
            }
        }
        cap_id::VENDOR_SPECIFIC => usize::from(at(2)).max(3),
        cap_id::SUBSYSTEM_VENDOR | cap_id::SATA => 8,
        cap_id::PCI_EXPRESS => 0x3c,
        cap_id::MSIX => 12,
        cap_id::ADVANCED_FEATURES => 6,
        _ => 4,
    }
}

/// A function's configuration space.
#[derive(Clone)]
pub struct PciConfiguration {
    registers: Vec<u32>,
    writable_bits: Vec<u32>,
    rw1c_bits: Vec<u32>,
    header_type: PciHeaderType,
    bars: [BarSlot; NUM_BAR_REGS],
    /// Committed addresses (see module docs), per BAR index.
    bar_addrs: [u64; NUM_BAR_REGS],
    /// (offset, len) of the last standard capability.
    last_capability: Option<(usize, usize)>,
    /// (offset, len) of the last extended capability.
    last_ext_capability: Option<(usize, usize)>,
}

impl fmt::Debug for PciConfiguration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PciConfiguration")
            .field("vendor_id", &format_args!("{:#06x}", self.vendor_id()))
            .field("device_id", &format_args!("{:#06x}", self.device_id()))
            .field("header_type", &self.header_type)
            .field("size", &(self.registers.len() * 4))
            .finish()
    }
}

impl PciConfiguration {
    /// A fresh configuration space with the given identity, no BARs and no capabilities.
    pub fn new(params: &PciConfigurationParams) -> Self {
        let n = if params.extended {
            NUM_EXTENDED_CONFIGURATION_REGISTERS
        } else {
            NUM_CONFIGURATION_REGISTERS
        };
        let mut c = Self {
            registers: vec![0; n],
            writable_bits: vec![0; n],
            rw1c_bits: vec![0; n],
            header_type: params.header_type,
            bars: [BarSlot::Unused; NUM_BAR_REGS],
            bar_addrs: [0; NUM_BAR_REGS],
            last_capability: None,
            last_ext_capability: None,
        };
        c.registers[0] = u32::from(params.device_id) << 16 | u32::from(params.vendor_id);
        c.registers[CLASS_REG] = u32::from(params.class_code) << 24
            | u32::from(params.subclass) << 16
            | u32::from(params.prog_if) << 8
            | u32::from(params.revision_id);
        let mut header = match params.header_type {
            PciHeaderType::Device => 0u8,
            PciHeaderType::Bridge => 1u8,
        };
        if params.multi_function {
            header |= 0x80;
        }
        c.registers[HEADER_TYPE_REG] = u32::from(header) << 16;
        if params.header_type == PciHeaderType::Device {
            c.registers[SUBSYSTEM_REG] =
                u32::from(params.subsystem_id) << 16 | u32::from(params.subsystem_vendor_id);
        }
        if let Some(pin) = params.interrupt_pin {
            c.registers[INTERRUPT_REG] = (pin as u32) << 8;
        }
        c.init_masks();
        c
    }

    fn init_masks(&mut self) {
        self.writable_bits[COMMAND_REG] = u32::from(command::WRITABLE);
        self.rw1c_bits[COMMAND_REG] = u32::from(status::RW1C) << 16;
        // Cache line size and latency timer.
        self.writable_bits[HEADER_TYPE_REG] = 0x0000_ffff;
        match self.header_type {
            PciHeaderType::Device => {
                // Interrupt line only.
                self.writable_bits[INTERRUPT_REG] = 0xff;
            }
            PciHeaderType::Bridge => {
                // Bus numbers + secondary latency, I/O base/limit (secondary status RW1C),
                // memory and prefetchable windows, their upper halves.
                self.writable_bits[6] = 0xffff_ffff;
                self.writable_bits[7] = 0x0000_f0f0;
                self.rw1c_bits[7] = u32::from(status::RW1C) << 16;
                self.writable_bits[8] = 0xfff0_fff0;
                self.writable_bits[9] = 0xfff0_fff0;
                self.writable_bits[10] = 0xffff_ffff;
                self.writable_bits[11] = 0xffff_ffff;
                self.writable_bits[12] = 0xffff_ffff;
                // Interrupt line + bridge control.
                self.writable_bits[INTERRUPT_REG] = 0xffff_00ff;
            }
        }
    }

    /// Builds a configuration from a raw 256- or 4096-byte snapshot (e.g. a lender's device).
    ///
    /// Identity, class, capabilities and all other bytes are kept (read-only unless made
    /// writable with [`set_writable_bits`](Self::set_writable_bits)); BARs and the expansion
    /// ROM BAR are cleared so the VMM can add its own with [`add_pci_bar`](Self::add_pci_bar);
    /// Command is cleared (the guest starts with decoding and bus mastering off); the usual
    /// writable bits (Command, Status RW1C, cache line, latency, interrupt line) are set.
    pub fn from_snapshot(snapshot: &[u8]) -> Result<Self, ConfigError> {
        if snapshot.len() != CONFIG_SPACE_SIZE && snapshot.len() != EXTENDED_CONFIG_SPACE_SIZE {
            return Err(ConfigError::SnapshotSize(snapshot.len()));
        }
        let header_type = match snapshot[0x0e] & 0x7f {
            0 => PciHeaderType::Device,
            1 => PciHeaderType::Bridge,
            other => return Err(ConfigError::HeaderTypeUnsupported(other)),
        };
        let n = snapshot.len() / 4;
        let mut c = Self {
            registers: (0..n).map(|i| read_u32_le(snapshot, i * 4)).collect(),
            writable_bits: vec![0; n],
            rw1c_bits: vec![0; n],
            header_type,
            bars: [BarSlot::Unused; NUM_BAR_REGS],
            bar_addrs: [0; NUM_BAR_REGS],
            last_capability: None,
            last_ext_capability: None,
        };
        for i in 0..header_type.num_bars() {
            c.registers[BAR0_REG + i] = 0;
        }
        let rom = c.rom_bar_reg();
        c.registers[rom] = 0;
        c.registers[COMMAND_REG] &= 0xffff_0000;
        c.init_masks();
        let caps = walk_capabilities(snapshot)?;
        c.last_capability = caps
            .iter()
            .map(|cap| (cap.offset, capability_len(snapshot, cap)))
            .max_by_key(|(o, l)| o + l);
        let ext = walk_extended_capabilities(snapshot)?;
        // Extended capabilities have no generic length: append after the last one + 4.
        c.last_ext_capability = ext
            .iter()
            .map(|cap| (cap.offset, 4))
            .max_by_key(|(o, _)| *o);
        Ok(c)
    }

    fn rom_bar_reg(&self) -> usize {
        match self.header_type {
            PciHeaderType::Device => ROM_BAR_REG,
            PciHeaderType::Bridge => BRIDGE_ROM_BAR_REG,
        }
    }

    /// Header type of this function.
    pub fn header_type(&self) -> PciHeaderType {
        self.header_type
    }

    /// Size in bytes (256 or 4096).
    pub fn size(&self) -> usize {
        self.registers.len() * 4
    }

    pub fn vendor_id(&self) -> u16 {
        (self.registers[0] & 0xffff) as u16
    }

    pub fn device_id(&self) -> u16 {
        (self.registers[0] >> 16) as u16
    }

    /// Current Command register.
    pub fn command(&self) -> u16 {
        (self.registers[COMMAND_REG] & 0xffff) as u16
    }

    /// Current Status register.
    pub fn status(&self) -> u16 {
        (self.registers[COMMAND_REG] >> 16) as u16
    }

    /// Sets status bits from the device side (e.g. an error or Interrupt Status).
    pub fn set_status_bits(&mut self, bits: u16) {
        self.registers[COMMAND_REG] |= u32::from(bits) << 16;
    }

    /// Clears status bits from the device side.
    pub fn clear_status_bits(&mut self, bits: u16) {
        self.registers[COMMAND_REG] &= !(u32::from(bits) << 16);
    }

    /// True if Memory Space Enable is set.
    pub fn memory_enabled(&self) -> bool {
        self.command() & command::MEMORY_SPACE != 0
    }

    /// True if I/O Space Enable is set.
    pub fn io_enabled(&self) -> bool {
        self.command() & command::IO_SPACE != 0
    }

    /// True if Bus Master Enable is set.
    pub fn bus_master_enabled(&self) -> bool {
        self.command() & command::BUS_MASTER != 0
    }

    /// Interrupt line as programmed by the guest.
    pub fn interrupt_line(&self) -> u8 {
        (self.registers[INTERRUPT_REG] & 0xff) as u8
    }

    /// Interrupt pin (1 = INTA#; 0 = none).
    pub fn interrupt_pin(&self) -> u8 {
        ((self.registers[INTERRUPT_REG] >> 8) & 0xff) as u8
    }

    /// Sets the interrupt pin.
    pub fn set_interrupt_pin(&mut self, pin: Option<PciInterruptPin>) {
        let v = pin.map_or(0, |p| p as u32);
        self.registers[INTERRUPT_REG] = (self.registers[INTERRUPT_REG] & !0xff00) | v << 8;
    }

    /// Reads register `reg_idx`; all-ones past the end of this space.
    pub fn read_reg(&self, reg_idx: usize) -> u32 {
        self.registers.get(reg_idx).copied().unwrap_or(u32::MAX)
    }

    /// Reads one byte (0 past the end).
    pub fn read_byte(&self, offset: usize) -> u8 {
        self.registers
            .get(offset / 4)
            .map_or(0, |r| (r >> ((offset % 4) * 8)) as u8)
    }

    /// Reads `data.len()` bytes at byte `offset` (bytes past the end read as 0).
    pub fn read_bytes(&self, offset: usize, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = self.read_byte(offset + i);
        }
    }

    /// The whole space as bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.registers
            .iter()
            .flat_map(|r| r.to_le_bytes())
            .collect()
    }

    /// Writes bytes at `offset` ignoring writable masks (device-side update). Out-of-range
    /// bytes are dropped.
    pub fn write_bytes_raw(&mut self, offset: usize, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            let o = offset + i;
            if let Some(r) = self.registers.get_mut(o / 4) {
                let shift = (o % 4) * 8;
                *r = (*r & !(0xff << shift)) | u32::from(*b) << shift;
            }
        }
    }

    /// Sets the guest-writable bits of register `reg_idx` (e.g. for a capability body).
    pub fn set_writable_bits(&mut self, reg_idx: usize, mask: u32) {
        if let Some(w) = self.writable_bits.get_mut(reg_idx) {
            *w = mask;
        }
    }

    /// Guest-writable bits of register `reg_idx`.
    pub fn writable_bits(&self, reg_idx: usize) -> u32 {
        self.writable_bits.get(reg_idx).copied().unwrap_or(0)
    }

    /// Sets the write-1-to-clear bits of register `reg_idx`.
    pub fn set_rw1c_bits(&mut self, reg_idx: usize, mask: u32) {
        if let Some(w) = self.rw1c_bits.get_mut(reg_idx) {
            *w = mask;
        }
    }

    fn bar_reg_index(&self, reg_idx: usize) -> Option<usize> {
        let n = self.header_type.num_bars();
        (BAR0_REG..BAR0_REG + n)
            .contains(&reg_idx)
            .then(|| reg_idx - BAR0_REG)
    }

    /// Adds a BAR with its VMM-assigned address.
    pub fn add_pci_bar(&mut self, bar: &PciBarConfiguration) -> Result<(), ConfigError> {
        let n = self.header_type.num_bars();
        let idx = bar.idx;
        let is64 = bar.region_type == PciBarRegionType::Memory64;
        if idx >= n || (is64 && idx + 1 >= n) {
            return Err(ConfigError::BarIndexInvalid(idx));
        }
        if self.bars[idx] != BarSlot::Unused || (is64 && self.bars[idx + 1] != BarSlot::Unused) {
            return Err(ConfigError::BarInUse(idx));
        }
        let min = if bar.region_type == PciBarRegionType::Io {
            4
        } else {
            16
        };
        if !bar.size.is_power_of_two() || bar.size < min {
            return Err(ConfigError::BarSizeInvalid {
                idx,
                size: bar.size,
                min,
            });
        }
        if bar.addr % bar.size != 0 {
            return Err(ConfigError::BarAddressUnaligned {
                idx,
                addr: bar.addr,
                size: bar.size,
            });
        }
        let limit: u64 = if is64 { u64::MAX } else { 1 << 32 };
        if bar.size > limit || bar.addr > limit - bar.size {
            return Err(ConfigError::BarAddressTooLarge {
                idx,
                addr: bar.addr,
                size: bar.size,
                region_type: bar.region_type,
            });
        }
        let size_mask = !(bar.size - 1);
        let reg = BAR0_REG + idx;
        match bar.region_type {
            PciBarRegionType::Io => {
                self.writable_bits[reg] = (size_mask as u32) & !0x3;
                self.registers[reg] = (bar.addr as u32) | 0x1;
            }
            PciBarRegionType::Memory32 | PciBarRegionType::Memory64 => {
                let mut flags = if bar.prefetchable { 0x8 } else { 0 };
                if is64 {
                    flags |= 0x4;
                }
                self.writable_bits[reg] = (size_mask as u32) & !0xf;
                self.registers[reg] = (bar.addr as u32) | flags;
                if is64 {
                    self.writable_bits[reg + 1] = (size_mask >> 32) as u32;
                    self.registers[reg + 1] = (bar.addr >> 32) as u32;
                    self.bars[idx + 1] = BarSlot::Upper;
                }
            }
        }
        self.bars[idx] = BarSlot::Bar(*bar);
        self.bar_addrs[idx] = bar.addr;
        Ok(())
    }

    /// Makes BAR `idx` `size` bytes at `addr` (a resized BAR): the size mask a driver's
    /// sizing reads and the decoded address follow. On an invalid size or address the BAR
    /// stays as it was.
    pub fn resize_pci_bar(&mut self, idx: usize, size: u64, addr: u64) -> Result<(), ConfigError> {
        let old = self.bar(idx).ok_or(ConfigError::BarIndexInvalid(idx))?;
        self.remove_pci_bar(idx);
        let new = PciBarConfiguration { size, addr, ..old };
        self.add_pci_bar(&new).inspect_err(|_| {
            // The old BAR fitted before: it fits again.
            let _ = self.add_pci_bar(&old);
        })
    }

    /// Removes BAR `idx` (and its upper half); returns what it was.
    pub fn remove_pci_bar(&mut self, idx: usize) -> Option<PciBarConfiguration> {
        let bar = self.bar(idx)?;
        let regs = if bar.region_type == PciBarRegionType::Memory64 {
            2
        } else {
            1
        };
        for i in idx..idx + regs {
            self.bars[i] = BarSlot::Unused;
            self.registers[BAR0_REG + i] = 0;
            self.writable_bits[BAR0_REG + i] = 0;
            self.bar_addrs[i] = 0;
        }
        Some(bar)
    }

    /// BAR `idx` with its current committed address.
    pub fn bar(&self, idx: usize) -> Option<PciBarConfiguration> {
        match self.bars.get(idx)? {
            BarSlot::Bar(b) => Some(PciBarConfiguration {
                addr: self.bar_addrs[idx],
                ..*b
            }),
            _ => None,
        }
    }

    /// All BARs with their committed addresses.
    pub fn bars(&self) -> Vec<PciBarConfiguration> {
        (0..NUM_BAR_REGS).filter_map(|i| self.bar(i)).collect()
    }

    /// The BAR whose committed range contains `addr` in `region_type`'s address space.
    pub fn bar_containing(&self, addr: u64, io: bool) -> Option<PciBarConfiguration> {
        self.bars().into_iter().find(|b| {
            (b.region_type == PciBarRegionType::Io) == io
                && addr >= b.addr
                && addr - b.addr < b.size
        })
    }

    /// Guest write of `data` (1, 2 or 4 bytes) at byte `offset` of register `reg_idx`.
    /// Applies writable masks, RW1C bits and the BAR protocol; returns the effects.
    pub fn write_config_register(
        &mut self,
        reg_idx: usize,
        offset: u64,
        data: &[u8],
    ) -> ConfigWriteEffects {
        let mut effects = ConfigWriteEffects::default();
        let offset = offset as usize;
        if !matches!(data.len(), 1 | 2 | 4) || offset + data.len() > 4 {
            log::warn!(
                "pci config write of {} bytes at register {reg_idx} offset {offset} ignored",
                data.len()
            );
            return effects;
        }
        if reg_idx >= self.registers.len() {
            log::debug!("pci config write to register {reg_idx} past the space ignored");
            return effects;
        }
        let mut bytes = [0u8; 4];
        bytes[offset..offset + data.len()].copy_from_slice(data);
        let val = u32::from_le_bytes(bytes);
        let bytemask: u32 = if data.len() == 4 {
            u32::MAX
        } else {
            ((1u32 << (data.len() * 8)) - 1) << (offset * 8)
        };
        let old = self.registers[reg_idx];
        if let Some(bar_idx) = self.bar_reg_index(reg_idx) {
            let merged = (old & !bytemask) | (val & bytemask);
            self.write_bar_register(bar_idx, merged, &mut effects);
            return effects;
        }
        if reg_idx == self.rom_bar_reg() {
            // No expansion ROM: the register stays 0, so sizing reads 0 (= no ROM).
            return effects;
        }
        let wmask = self.writable_bits[reg_idx] & bytemask;
        let mut new = (old & !wmask) | (val & wmask);
        new &= !(val & bytemask & self.rw1c_bits[reg_idx]);
        self.registers[reg_idx] = new;
        if reg_idx == COMMAND_REG {
            let (o, n) = ((old & 0xffff) as u16, (new & 0xffff) as u16);
            if o != n {
                effects.command = Some(CommandChange { old: o, new: n });
            }
        }
        effects
    }

    fn write_bar_register(&mut self, bar_idx: usize, value: u32, effects: &mut ConfigWriteEffects) {
        let reg = BAR0_REG + bar_idx;
        let mask = self.writable_bits[reg];
        let (base_idx, upper) = match self.bars[bar_idx] {
            BarSlot::Unused => return,
            BarSlot::Bar(_) => (bar_idx, false),
            BarSlot::Upper => (bar_idx - 1, true),
        };
        let BarSlot::Bar(bar) = self.bars[base_idx] else {
            return;
        };
        let flags = self.registers[reg] & !mask & if upper { 0 } else { 0xf };
        self.registers[reg] = (value & mask) | flags;
        if value == u32::MAX {
            // Sizing: the guest reads back the size mask; the decoded address is unchanged.
            return;
        }
        let old = self.bar_addrs[base_idx];
        let new = if upper {
            u64::from(value & mask) << 32 | (old & 0xffff_ffff)
        } else {
            (old & !0xffff_ffff) | u64::from(value & mask)
        };
        if new != old {
            self.bar_addrs[base_idx] = new;
            log::debug!(
                "bar {base_idx} moved {old:#x} -> {new:#x} ({:#x} bytes)",
                bar.size
            );
            effects.bar_moves.push(BarMove {
                bar_idx: base_idx,
                old,
                new,
                len: bar.size,
                region_type: bar.region_type,
            });
        }
    }

    /// Device-level reset: clears Command (decode and bus mastering off) and RW1C status
    /// bits. BAR addresses are kept so the VMM's bus ranges stay valid. Returns the Command
    /// change, if any, so the caller can react (e.g. unpin on BME 1->0).
    pub fn reset(&mut self) -> ConfigWriteEffects {
        let old = self.command();
        self.registers[COMMAND_REG] &= !(u32::from(status::RW1C) << 16 | 0xffff);
        let mut effects = ConfigWriteEffects::default();
        if old != 0 {
            effects.command = Some(CommandChange { old, new: 0 });
        }
        effects
    }

    /// Appends a read-only capability. `data[0]` is the id; `data[1]` (next) is filled in.
    /// Returns the capability's offset (4-byte aligned, from 0x40).
    pub fn add_capability(&mut self, data: &[u8]) -> Result<usize, ConfigError> {
        self.add_capability_with_mask(data, &vec![0; data.len()])
    }

    /// Appends a capability with per-byte guest-writable masks (`writable.len() ==
    /// data.len()`; the id and next bytes are never writable).
    pub fn add_capability_with_mask(
        &mut self,
        data: &[u8],
        writable: &[u8],
    ) -> Result<usize, ConfigError> {
        let max = CONFIG_SPACE_SIZE - FIRST_CAPABILITY_OFFSET;
        if data.len() < 2 || data.len() > max {
            return Err(ConfigError::CapabilityLengthInvalid {
                len: data.len(),
                max,
            });
        }
        if writable.len() != data.len() {
            return Err(ConfigError::CapabilityMaskLength {
                mask: writable.len(),
                len: data.len(),
            });
        }
        let offset = match self.last_capability {
            Some((o, l)) => (o + l + 3) & !3,
            None => FIRST_CAPABILITY_OFFSET,
        };
        if offset + data.len() > CONFIG_SPACE_SIZE {
            return Err(ConfigError::CapabilitySpaceFull {
                offset,
                len: data.len(),
            });
        }
        self.write_bytes_raw(offset, data);
        self.write_bytes_raw(offset + 1, &[0]);
        self.set_byte_masks(offset, writable, 2);
        match self.last_capability {
            Some((o, _)) => self.write_bytes_raw(o + 1, &[offset as u8]),
            None => self.write_bytes_raw(CAPABILITY_LIST_HEAD_OFFSET, &[offset as u8]),
        }
        self.set_status_bits(status::CAPABILITIES_LIST);
        self.last_capability = Some((offset, data.len()));
        Ok(offset)
    }

    fn set_byte_masks(&mut self, offset: usize, writable: &[u8], skip: usize) {
        for (i, m) in writable.iter().enumerate() {
            let m = if i < skip { 0 } else { *m };
            let o = offset + i;
            if let Some(w) = self.writable_bits.get_mut(o / 4) {
                let shift = (o % 4) * 8;
                *w = (*w & !(0xff << shift)) | u32::from(m) << shift;
            }
        }
    }

    /// Appends a read-only extended capability with the given id/version and `body` (the
    /// bytes after the 4-byte header). Returns its offset (from 0x100).
    pub fn add_extended_capability(
        &mut self,
        id: u16,
        version: u8,
        body: &[u8],
    ) -> Result<usize, ConfigError> {
        self.add_extended_capability_with_mask(id, version, body, &vec![0; body.len()])
    }

    /// Like [`add_extended_capability`](Self::add_extended_capability) with per-byte
    /// writable masks for `body`.
    pub fn add_extended_capability_with_mask(
        &mut self,
        id: u16,
        version: u8,
        body: &[u8],
        writable: &[u8],
    ) -> Result<usize, ConfigError> {
        if self.registers.len() < NUM_EXTENDED_CONFIGURATION_REGISTERS {
            return Err(ConfigError::NoExtendedSpace);
        }
        if writable.len() != body.len() {
            return Err(ConfigError::CapabilityMaskLength {
                mask: writable.len(),
                len: body.len(),
            });
        }
        let len = body.len() + 4;
        let offset = match self.last_ext_capability {
            Some((o, l)) => (o + l + 3) & !3,
            None => FIRST_EXTENDED_CAPABILITY_OFFSET,
        };
        if offset + len > EXTENDED_CONFIG_SPACE_SIZE {
            return Err(ConfigError::CapabilitySpaceFull { offset, len });
        }
        let header = u32::from(id) | u32::from(version & 0xf) << 16;
        self.registers[offset / 4] = header;
        self.write_bytes_raw(offset + 4, body);
        self.set_byte_masks(offset + 4, writable, 0);
        if let Some((o, _)) = self.last_ext_capability {
            let r = &mut self.registers[o / 4];
            *r = (*r & 0x000f_ffff) | (offset as u32) << 20;
        }
        self.last_ext_capability = Some((offset, len));
        Ok(offset)
    }

    /// Walks this space's capability list.
    pub fn capabilities(&self) -> Result<Vec<CapabilityInfo>, ConfigError> {
        walk_capabilities(&self.to_bytes())
    }

    /// Walks this space's extended capability list.
    pub fn extended_capabilities(&self) -> Result<Vec<ExtCapabilityInfo>, ConfigError> {
        walk_extended_capabilities(&self.to_bytes())
    }

    /// Offset of the first capability with `id`.
    pub fn find_capability(&self, id: u8) -> Option<usize> {
        self.capabilities()
            .ok()?
            .into_iter()
            .find(|c| c.id == id)
            .map(|c| c.offset)
    }

    /// Offset of the first extended capability with `id`.
    pub fn find_extended_capability(&self, id: u16) -> Option<usize> {
        self.extended_capabilities()
            .ok()?
            .into_iter()
            .find(|c| c.id == id)
            .map(|c| c.offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(extended: bool) -> PciConfiguration {
        PciConfiguration::new(&PciConfigurationParams {
            vendor_id: 0x1234,
            device_id: 0x5678,
            class_code: class::MASS_STORAGE,
            subclass: class::NVM_SUBCLASS,
            prog_if: class::NVME_PROG_IF,
            revision_id: 2,
            subsystem_vendor_id: 0xaaaa,
            subsystem_id: 0xbbbb,
            interrupt_pin: Some(PciInterruptPin::IntA),
            extended,
            ..Default::default()
        })
    }

    fn w32(c: &mut PciConfiguration, reg: usize, v: u32) -> ConfigWriteEffects {
        c.write_config_register(reg, 0, &v.to_le_bytes())
    }

    /// Runs the sizing protocol on `reg` and returns what the guest read back.
    fn size_probe(c: &mut PciConfiguration, reg: usize) -> u32 {
        let orig = c.read_reg(reg);
        assert!(w32(c, reg, u32::MAX).is_empty());
        let mask = c.read_reg(reg);
        assert!(w32(c, reg, orig).is_empty());
        assert_eq!(c.read_reg(reg), orig);
        mask
    }

    #[test]
    fn identity_and_read_only_registers() {
        let mut c = dev(false);
        assert_eq!(c.read_reg(0), 0x5678_1234);
        assert_eq!(c.read_reg(CLASS_REG), 0x0108_0202);
        assert_eq!(c.read_reg(SUBSYSTEM_REG), 0xbbbb_aaaa);
        for reg in [0, CLASS_REG, SUBSYSTEM_REG, ROM_BAR_REG] {
            let before = c.read_reg(reg);
            assert!(w32(&mut c, reg, 0xdead_beef).is_empty());
            assert_eq!(c.read_reg(reg), before, "register {reg} must be read-only");
        }
        // Header type byte is read-only, cache line size is writable.
        w32(&mut c, HEADER_TYPE_REG, 0xffff_ffff);
        assert_eq!(c.read_reg(HEADER_TYPE_REG), 0x0000_ffff);
        // Interrupt line writable, pin read-only.
        c.write_config_register(INTERRUPT_REG, 0, &[0x0b, 0x04]);
        assert_eq!(c.interrupt_line(), 0x0b);
        assert_eq!(c.interrupt_pin(), 1);
        // No ROM: sizing reads 0.
        assert_eq!(size_probe(&mut c, ROM_BAR_REG), 0);
        // Past the end reads all-ones; bad access sizes are ignored.
        assert_eq!(c.read_reg(64), u32::MAX);
        assert!(c.write_config_register(1, 3, &[1, 2]).is_empty());
        assert!(c.write_config_register(1, 0, &[1, 2, 3]).is_empty());
        assert_eq!(c.command(), 0);
    }

    #[test]
    fn a_resized_bar_sizes_and_decodes_at_its_new_size() {
        let mut c = dev(false);
        let bar = PciBarConfiguration::new(
            0,
            0x40_1000_0000,
            256 << 20,
            PciBarRegionType::Memory64,
            true,
        );
        c.add_pci_bar(&bar).unwrap();
        c.resize_pci_bar(0, 64 << 30, 0x50_0000_0000).unwrap();
        let b = c.bar(0).unwrap();
        assert_eq!(
            (b.addr, b.size, b.prefetchable),
            (0x50_0000_0000, 64 << 30, true)
        );
        // 64-bit prefetchable: the low half has the flags, the high half the mask.
        assert_eq!(size_probe(&mut c, BAR0_REG) & 0xf, 0xc);
        assert_eq!(size_probe(&mut c, BAR0_REG + 1), 0xffff_fff0);
        // An unaligned address is refused and the BAR stays as it was.
        assert!(c.resize_pci_bar(0, 128 << 30, 0x50_0000_0000).is_err());
        assert_eq!(c.bar(0).unwrap().size, 64 << 30);
        assert!(c.resize_pci_bar(3, 1 << 20, 0).is_err(), "no bar 3");
    }

    #[test]
    fn bar_sizing_32bit_64bit_and_io() {
        let mut c = dev(false);
        c.add_pci_bar(&PciBarConfiguration::new(
            0,
            0xc000_0000,
            0x4000,
            PciBarRegionType::Memory32,
            false,
        ))
        .unwrap();
        c.add_pci_bar(&PciBarConfiguration::new(
            2,
            0x40_0000_0000,
            0x2_0000_0000,
            PciBarRegionType::Memory64,
            true,
        ))
        .unwrap();
        c.add_pci_bar(&PciBarConfiguration::new(
            4,
            0x1_0010_0000,
            0x10_0000,
            PciBarRegionType::Memory64,
            false,
        ))
        .unwrap();
        c.add_pci_bar(&PciBarConfiguration::new(
            1,
            0x1020,
            0x20,
            PciBarRegionType::Io,
            false,
        ))
        .unwrap();

        // 32-bit memory: address, then the size mask with the type bits.
        assert_eq!(c.read_reg(BAR0_REG), 0xc000_0000);
        assert_eq!(size_probe(&mut c, BAR0_REG), 0xffff_c000);
        // I/O: bit 0 set.
        assert_eq!(c.read_reg(BAR0_REG + 1), 0x1021);
        assert_eq!(size_probe(&mut c, BAR0_REG + 1), 0xffff_ffe1);
        // 64-bit prefetchable, 8 GiB: low half has only flags, high half the mask.
        assert_eq!(c.read_reg(BAR0_REG + 2), 0x0000_000c);
        assert_eq!(c.read_reg(BAR0_REG + 3), 0x40);
        assert_eq!(size_probe(&mut c, BAR0_REG + 2), 0x0000_000c);
        assert_eq!(size_probe(&mut c, BAR0_REG + 3), 0xffff_fffe);
        // 64-bit, 1 MiB.
        assert_eq!(c.read_reg(BAR0_REG + 4), 0x0010_0004);
        assert_eq!(c.read_reg(BAR0_REG + 5), 0x1);
        assert_eq!(size_probe(&mut c, BAR0_REG + 4), 0xfff0_0004);
        assert_eq!(size_probe(&mut c, BAR0_REG + 5), 0xffff_ffff);
        // Unused BAR 3 is... the upper half of BAR 2; none left unused here, so check
        // the committed addresses survived all the sizing.
        let bars = c.bars();
        assert_eq!(bars.len(), 4);
        assert_eq!(c.bar(2).unwrap().addr, 0x40_0000_0000);
        assert_eq!(c.bar(4).unwrap().addr, 0x1_0010_0000);
        assert!(c.bar(3).is_none());
    }

    #[test]
    fn bar_moves_are_reported() {
        let mut c = dev(false);
        c.add_pci_bar(&PciBarConfiguration::new(
            0,
            0xc000_0000,
            0x1000,
            PciBarRegionType::Memory32,
            false,
        ))
        .unwrap();
        c.add_pci_bar(&PciBarConfiguration::new(
            2,
            0x1_0000_0000,
            0x1000,
            PciBarRegionType::Memory64,
            false,
        ))
        .unwrap();
        // Low bits written are masked; the move is reported with the BAR length.
        let e = w32(&mut c, BAR0_REG, 0xc010_0fff);
        assert_eq!(
            e.bar_moves,
            vec![BarMove {
                bar_idx: 0,
                old: 0xc000_0000,
                new: 0xc010_0000,
                len: 0x1000,
                region_type: PciBarRegionType::Memory32,
            }]
        );
        assert_eq!(c.read_reg(BAR0_REG), 0xc010_0000);
        // Same value again: nothing.
        assert!(w32(&mut c, BAR0_REG, 0xc010_0000).is_empty());
        // 64-bit: one move per half.
        let e = w32(&mut c, BAR0_REG + 2, 0x2000_0000);
        assert_eq!(e.bar_moves[0].new, 0x1_2000_0000);
        let e = w32(&mut c, BAR0_REG + 3, 0x2);
        assert_eq!(e.bar_moves[0].old, 0x1_2000_0000);
        assert_eq!(e.bar_moves[0].new, 0x2_2000_0000);
        assert_eq!(e.bar_moves[0].region_type, PciBarRegionType::Memory64);
        assert_eq!(c.bar(2).unwrap().addr, 0x2_2000_0000);
        // Unused BAR registers are read-only zero.
        assert!(w32(&mut c, BAR0_REG + 5, 0x1234_5000).is_empty());
        assert_eq!(c.read_reg(BAR0_REG + 5), 0);
    }

    #[test]
    fn bar_validation() {
        let mut c = dev(false);
        let bar = |idx, addr, size, t| PciBarConfiguration::new(idx, addr, size, t, false);
        assert_eq!(
            c.add_pci_bar(&bar(5, 0, 0x1000, PciBarRegionType::Memory64)),
            Err(ConfigError::BarIndexInvalid(5))
        );
        assert!(matches!(
            c.add_pci_bar(&bar(0, 0, 0x1800, PciBarRegionType::Memory32)),
            Err(ConfigError::BarSizeInvalid { .. })
        ));
        assert!(matches!(
            c.add_pci_bar(&bar(0, 0x800, 0x1000, PciBarRegionType::Memory32)),
            Err(ConfigError::BarAddressUnaligned { .. })
        ));
        assert!(matches!(
            c.add_pci_bar(&bar(0, 0x1_0000_0000, 0x1000, PciBarRegionType::Memory32)),
            Err(ConfigError::BarAddressTooLarge { .. })
        ));
        c.add_pci_bar(&bar(0, 0, 0x1000, PciBarRegionType::Memory64))
            .unwrap();
        assert_eq!(
            c.add_pci_bar(&bar(1, 0, 0x1000, PciBarRegionType::Memory32)),
            Err(ConfigError::BarInUse(1))
        );
        assert!(c.remove_pci_bar(0).is_some());
        c.add_pci_bar(&bar(1, 0, 0x1000, PciBarRegionType::Memory32))
            .unwrap();
    }

    #[test]
    fn status_rw1c_and_read_only_bits() {
        let mut c = dev(false);
        c.add_capability(&[cap_id::POWER_MANAGEMENT, 0, 3, 0, 0, 0, 0, 0])
            .unwrap();
        c.set_status_bits(
            status::RECEIVED_MASTER_ABORT | status::DETECTED_PARITY_ERROR | status::INTERRUPT,
        );
        // Writing zeros changes nothing.
        c.write_config_register(COMMAND_REG, 2, &[0, 0]);
        assert_eq!(
            c.status(),
            status::RECEIVED_MASTER_ABORT
                | status::DETECTED_PARITY_ERROR
                | status::INTERRUPT
                | status::CAPABILITIES_LIST
        );
        // Writing ones clears only RW1C bits that were written.
        c.write_config_register(
            COMMAND_REG,
            2,
            &(status::RECEIVED_MASTER_ABORT | status::INTERRUPT | status::CAPABILITIES_LIST)
                .to_le_bytes(),
        );
        assert_eq!(
            c.status(),
            status::DETECTED_PARITY_ERROR | status::INTERRUPT | status::CAPABILITIES_LIST
        );
        // A 32-bit write of all-ones clears every RW1C bit, leaves RO bits, sets command.
        let e = w32(&mut c, COMMAND_REG, u32::MAX);
        assert_eq!(c.status(), status::INTERRUPT | status::CAPABILITIES_LIST);
        assert_eq!(c.command(), command::WRITABLE);
        assert_eq!(
            e.command,
            Some(CommandChange {
                old: 0,
                new: command::WRITABLE
            })
        );
    }

    #[test]
    fn command_changes_are_reported() {
        let mut c = dev(false);
        let e = c.write_config_register(
            COMMAND_REG,
            0,
            &(command::MEMORY_SPACE | command::BUS_MASTER | 1 << 3).to_le_bytes(),
        );
        let ch = e.command.unwrap();
        assert_eq!(ch.bus_master(), Some(true));
        assert_eq!(ch.memory(), Some(true));
        assert_eq!(ch.io(), None);
        assert_eq!(
            c.command(),
            command::MEMORY_SPACE | command::BUS_MASTER,
            "special cycles bit is read-only"
        );
        assert!(c.memory_enabled() && c.bus_master_enabled() && !c.io_enabled());
        // Same value: no change.
        assert!(c
            .write_config_register(COMMAND_REG, 0, &[0x06])
            .command
            .is_none());
        // Clear BME only, with a byte write.
        let ch = c
            .write_config_register(COMMAND_REG, 0, &[0x02])
            .command
            .unwrap();
        assert_eq!(ch.bus_master(), Some(false));
        assert_eq!(ch.memory(), None);
        // Reset reports the remaining change and clears decode.
        let ch = c.reset().command.unwrap();
        assert_eq!(ch.memory(), Some(false));
        assert_eq!(c.command(), 0);
    }

    #[test]
    fn capability_list_building_and_walking() {
        let mut c = dev(true);
        assert!(c.capabilities().unwrap().is_empty());
        let pm = c
            .add_capability(&[cap_id::POWER_MANAGEMENT, 0xee, 3, 0, 0, 0, 0, 0])
            .unwrap();
        let msi = crate::msi::MsiCap::new(4, true, false).unwrap();
        let msi_off = c.add_capability(&msi.to_bytes()).unwrap();
        let vendor = c
            .add_capability(&[cap_id::VENDOR_SPECIFIC, 0, 5, 0xab, 0xcd])
            .unwrap();
        assert_eq!((pm, msi_off, vendor), (0x40, 0x48, 0x58));
        assert_ne!(c.status() & status::CAPABILITIES_LIST, 0);
        assert_eq!(c.read_byte(CAPABILITY_LIST_HEAD_OFFSET), 0x40);
        assert_eq!(c.read_byte(0x41), 0x48, "next pointer is filled in");
        let caps = c.capabilities().unwrap();
        assert_eq!(
            caps.iter().map(|x| (x.id, x.offset)).collect::<Vec<_>>(),
            vec![
                (cap_id::POWER_MANAGEMENT, 0x40),
                (cap_id::MSI, 0x48),
                (cap_id::VENDOR_SPECIFIC, 0x58)
            ]
        );
        assert_eq!(c.find_capability(cap_id::MSI), Some(0x48));
        assert_eq!(c.find_capability(cap_id::MSIX), None);
        // Capability bodies are read-only unless masked writable.
        w32(&mut c, 0x40 / 4, u32::MAX);
        assert_eq!(c.read_reg(0x40 / 4), 0x0003_4801);

        // Extended capabilities from 0x100.
        let aer = c.add_extended_capability(0x0001, 2, &[0; 0x44]).unwrap();
        let dsn = c
            .add_extended_capability(0x0003, 1, &[1, 2, 3, 4, 5, 6, 7, 8])
            .unwrap();
        assert_eq!((aer, dsn), (0x100, 0x148));
        let ext = c.extended_capabilities().unwrap();
        assert_eq!(
            ext,
            vec![
                ExtCapabilityInfo {
                    id: 1,
                    version: 2,
                    offset: 0x100
                },
                ExtCapabilityInfo {
                    id: 3,
                    version: 1,
                    offset: 0x148
                }
            ]
        );
        assert_eq!(c.find_extended_capability(3), Some(0x148));
        assert_eq!(c.read_reg(0x14c / 4), 0x0403_0201);
        // A conventional space has no room for extended capabilities.
        assert_eq!(
            dev(false).add_extended_capability(1, 1, &[]),
            Err(ConfigError::NoExtendedSpace)
        );
    }

    #[test]
    fn capability_space_limits_and_masks() {
        let mut c = dev(false);
        assert!(matches!(
            c.add_capability(&[1]),
            Err(ConfigError::CapabilityLengthInvalid { .. })
        ));
        // Writable mask: id/next never writable, body bytes as given.
        let off = c
            .add_capability_with_mask(&[0x09, 0, 4, 0], &[0xff, 0xff, 0, 0xff])
            .unwrap();
        w32(&mut c, off / 4, u32::MAX);
        assert_eq!(c.read_reg(off / 4), 0xff04_0009);
        // Fill the space.
        let mut n = 0;
        while c
            .add_capability(&[0x09, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
            .is_ok()
        {
            n += 1;
            assert!(n < 64, "capability space must run out");
        }
        assert_eq!(c.capabilities().unwrap().len(), n + 1);
    }

    #[test]
    fn walking_rejects_loops_and_bad_pointers() {
        let mut space = vec![0u8; 256];
        space[6] = status::CAPABILITIES_LIST as u8;
        space[0x34] = 0x40;
        space[0x40] = 0x01;
        space[0x41] = 0x50;
        space[0x50] = 0x05;
        space[0x51] = 0x40;
        assert_eq!(
            walk_capabilities(&space),
            Err(ConfigError::CapabilityLoop { ptr: 0x40 })
        );
        space[0x51] = 0x10;
        assert_eq!(
            walk_capabilities(&space),
            Err(ConfigError::CapabilityPointerInvalid { ptr: 0x10 })
        );
        // Low two pointer bits are ignored.
        space[0x51] = 0x63;
        space[0x60] = 0x11;
        let caps = walk_capabilities(&space).unwrap();
        assert_eq!(caps.last().unwrap().offset, 0x60);
        // Cap-list status bit clear: empty list.
        space[6] = 0;
        assert!(walk_capabilities(&space).unwrap().is_empty());
        assert!(walk_capabilities(&space[..64]).is_err());

        let mut ext = vec![0u8; 4096];
        ext[0x100..0x104].copy_from_slice(&(0x0001_0001u32 | 0x100 << 20).to_le_bytes());
        assert_eq!(
            walk_extended_capabilities(&ext),
            Err(ConfigError::CapabilityLoop { ptr: 0x100 })
        );
        ext[0x100..0x104].copy_from_slice(&(0x0001_0001u32 | 0x40 << 20).to_le_bytes());
        assert!(matches!(
            walk_extended_capabilities(&ext),
            Err(ConfigError::CapabilityPointerInvalid { .. })
        ));
        ext[0x100..0x104].fill(0xff);
        assert!(walk_extended_capabilities(&ext).unwrap().is_empty());
    }

    #[test]
    fn snapshot_keeps_identity_and_caps_but_replaces_bars() {
        let mut lender = dev(true);
        lender
            .add_pci_bar(&PciBarConfiguration::new(
                0,
                0xf000_0000,
                0x4000,
                PciBarRegionType::Memory64,
                false,
            ))
            .unwrap();
        lender
            .add_capability(&[cap_id::POWER_MANAGEMENT, 0, 3, 0, 0, 0, 0, 0])
            .unwrap();
        crate::msix::MsixCap::new(8, 0, 0x2000, 0, 0x3000)
            .unwrap()
            .add_to(&mut lender)
            .unwrap();
        lender.add_extended_capability(3, 1, &[0; 8]).unwrap();
        w32(&mut lender, COMMAND_REG, 0x6);
        let bytes = lender.to_bytes();

        let mut c = PciConfiguration::from_snapshot(&bytes).unwrap();
        assert_eq!(c.size(), 4096);
        assert_eq!(c.read_reg(0), 0x5678_1234);
        assert_eq!(c.read_reg(CLASS_REG), lender.read_reg(CLASS_REG));
        assert_eq!(c.read_reg(BAR0_REG), 0);
        assert_eq!(c.read_reg(BAR0_REG + 1), 0);
        assert_eq!(c.command(), 0);
        assert!(c.bars().is_empty());
        assert_eq!(c.capabilities().unwrap(), lender.capabilities().unwrap());
        assert_eq!(c.find_capability(cap_id::MSIX), Some(0x48));
        // VMM-owned BAR, then sizing works on it.
        c.add_pci_bar(&PciBarConfiguration::new(
            0,
            0xc000_0000,
            0x1_0000,
            PciBarRegionType::Memory32,
            false,
        ))
        .unwrap();
        assert_eq!(size_probe(&mut c, BAR0_REG), 0xffff_0000);
        // New capabilities go after the snapshot's (MSI-X at 0x48 is 12 bytes).
        assert_eq!(
            c.add_capability(&[cap_id::VENDOR_SPECIFIC, 0, 4, 0])
                .unwrap(),
            0x54
        );
        assert_eq!(c.capabilities().unwrap().len(), 3);
        assert_eq!(c.add_extended_capability(1, 1, &[]).unwrap(), 0x104);
        assert_eq!(c.extended_capabilities().unwrap().len(), 2);

        assert_eq!(
            PciConfiguration::from_snapshot(&bytes[..100]).unwrap_err(),
            ConfigError::SnapshotSize(100)
        );
    }
}
