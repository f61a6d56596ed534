//! Root complex: bus 0 with 32 slots (function 0 each), the host bridge at 00:00.0, and the
//! two configuration access mechanisms as [`BusDevice`]s: [`PciConfigIo`] (ports
//! 0xcf8..0xcff, mechanism #1) and [`PciConfigMmio`] (ECAM at 0xE000_0000).
//!
//! A guest with NUMA nodes has more root buses, 1 to [`MAX_ROOT_BUSES`] - 1, one per node
//! that holds devices: each is a host bridge of its own in the guest's ACPI tables (`_BBN`,
//! `_PXM`), as QEMU's `pxb` expanders are, because x86 Linux gives a PCI function the NUMA
//! node of its root bus. Their slot 0 stays empty (no host bridge function there). A lender's
//! *switch* adds a bus behind a PCI-to-PCI bridge (`bridge.rs`) in a root bus's slot. A
//! device is named by a *slot number* across all buses: `index * 32 + device`, so that bus
//! 0's slots keep their numbers; configuration cycles name the bus by the number the guest
//! sees, which [`BusLayout`] maps to the index (`topology.rs`).
//!
//! Effects of config writes (BAR moves, Command changes) go to the [`DeviceRelocation`]
//! given to [`PciBus::new`]; see `device.rs` for the order of calls.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, RwLock};

use crate::bus::BusDevice;
use crate::configuration::{class, PciConfiguration, PciConfigurationParams, PciHeaderType};
use crate::device::{ConfigWriteEffects, DeviceRelocation, PciDevice};
use crate::topology::{BusKind, BusLayout};

/// Slots on bus 0.
pub const NUM_DEVICE_SLOTS: u8 = 32;
/// The most slots for devices a bus has: all but the host bridge's.
pub const MAX_DEVICE_SLOTS: u8 = NUM_DEVICE_SLOTS - 1;
/// The most root buses (bus 0 and one per NUMA node with devices): their slot numbers
/// (`bus * 32 + device`) fit a `u8`.
pub const MAX_ROOT_BUSES: u8 = 8;

/// The root bus of slot number `slot` (`bus * 32 + device`).
pub fn slot_bus(slot: u8) -> u8 {
    slot / NUM_DEVICE_SLOTS
}

/// The device number on its bus of slot number `slot`.
pub fn slot_device(slot: u8) -> u8 {
    slot % NUM_DEVICE_SLOTS
}

/// The slot number of `device` on root bus `bus`.
pub fn slot_number(bus: u8, device: u8) -> u8 {
    bus.wrapping_mul(NUM_DEVICE_SLOTS)
        .wrapping_add(device % NUM_DEVICE_SLOTS)
}
/// Host bridge vendor id (Intel, as Cloud Hypervisor).
pub const HOST_BRIDGE_VENDOR_ID: u16 = 0x8086;
/// Host bridge device id (as Cloud Hypervisor).
pub const HOST_BRIDGE_DEVICE_ID: u16 = 0x0d57;
/// First port of configuration mechanism #1 (CONFIG_ADDRESS); the device spans 8 ports.
pub const PCI_CONFIG_IO_PORT: u64 = 0xcf8;
/// Number of ports of [`PciConfigIo`].
pub const PCI_CONFIG_IO_PORT_SIZE: u64 = 8;

const CONFIG_ADDRESS_ENABLE: u32 = 1 << 31;
const CONFIG_ADDRESS_MASK: u32 = 0x80ff_fffc;

/// Shared handle to a PCI function.
pub type SharedPciDevice = Arc<Mutex<dyn PciDevice>>;

/// Bus/device/function (segment 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciBdf(u32);

impl PciBdf {
    pub fn new(bus: u8, device: u8, function: u8) -> Self {
        Self(u32::from(bus) << 8 | u32::from(device & 0x1f) << 3 | u32::from(function & 0x7))
    }

    pub fn bus(&self) -> u8 {
        (self.0 >> 8) as u8
    }

    pub fn device(&self) -> u8 {
        ((self.0 >> 3) & 0x1f) as u8
    }

    pub fn function(&self) -> u8 {
        (self.0 & 0x7) as u8
    }

    /// Requester id (bus << 8 | devfn), e.g. for MSI `devid`.
    pub fn requester_id(&self) -> u32 {
        self.0
    }
}

impl fmt::Display for PciBdf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "0000:{:02x}:{:02x}.{}",
            self.bus(),
            self.device(),
            self.function()
        )
    }
}

/// Errors of the root bus.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PciRootError {
    #[error("pci slot {0} is out of range: this bus has slots 1 to {1} for devices (--pci-slots)")]
    SlotInvalid(u8, u8),
    #[error("pci slot {0} is already in use")]
    SlotInUse(u8),
    #[error("pci slot {0} is empty")]
    SlotEmpty(u8),
    #[error("pci slot 0 holds the host bridge and cannot be changed")]
    HostBridgeSlot,
    #[error("no free pci slot on bus 0: all {0} slots for devices are in use (--pci-slots)")]
    NoFreeSlot(u8),
    #[error(
        "pci slot {slot} is on root bus {bus}, which does not exist: this VM has {buses} root \
         bus(es) (one per NUMA node with devices)"
    )]
    NoSuchBus { slot: u8, bus: u8, buses: u8 },
    #[error("no free pci slot on root bus {bus}: all {slots} slots for devices are in use (--pci-slots)")]
    NoFreeSlotOn { bus: u8, slots: u8 },
    #[error(
        "pci slot {slot} is port {port} of a switch with ports 0 to {}",
        ports - 1
    )]
    NoSuchPort { slot: u8, port: u8, ports: u8 },
}

/// The host bridge at 00:00.0.
#[derive(Debug)]
pub struct PciHostBridge {
    config: PciConfiguration,
}

impl Default for PciHostBridge {
    fn default() -> Self {
        Self::new()
    }
}

impl PciHostBridge {
    pub fn new() -> Self {
        Self {
            config: PciConfiguration::new(&PciConfigurationParams {
                vendor_id: HOST_BRIDGE_VENDOR_ID,
                device_id: HOST_BRIDGE_DEVICE_ID,
                class_code: class::BRIDGE,
                subclass: class::HOST_BRIDGE_SUBCLASS,
                prog_if: 0,
                header_type: PciHeaderType::Device,
                ..Default::default()
            }),
        }
    }
}

impl PciDevice for PciHostBridge {
    fn id(&self) -> Option<String> {
        Some("pci-host-bridge".into())
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

/// The root buses: slot number (`bus * 32 + device`) -> function 0 device. Thread safe;
/// share it as `Arc<PciBus>`.
pub struct PciBus {
    devices: RwLock<BTreeMap<u8, SharedPciDevice>>,
    /// Slots 1..=`slots` of each bus take devices (bus 0's slot 0 is the host bridge's).
    slots: u8,
    /// Root buses and switches, by index (slot numbers are `index * 32 + device`).
    layout: BusLayout,
    relocation: Arc<dyn DeviceRelocation>,
    /// BAR moves the relocation refused (a guest can loop on them: logged rate-limited).
    refused_moves: std::sync::atomic::AtomicU64,
}

impl PciBus {
    /// A bus with the host bridge in slot 0 and every other slot for devices; `relocation`
    /// receives config-write effects.
    pub fn new(relocation: Arc<dyn DeviceRelocation>) -> Self {
        Self::with_slots(relocation, MAX_DEVICE_SLOTS)
    }

    /// A bus whose devices go in slots 1..=`slots` only (clamped to 1..=[`MAX_DEVICE_SLOTS`]):
    /// the slots the guest's ACPI tables describe (`--pci-slots`).
    pub fn with_slots(relocation: Arc<dyn DeviceRelocation>, slots: u8) -> Self {
        Self::with_buses(relocation, slots, 1)
    }

    /// Root buses 0..`buses` (clamped to 1..=[`MAX_ROOT_BUSES`]), each with slots
    /// 1..=`slots` for devices.
    pub fn with_buses(relocation: Arc<dyn DeviceRelocation>, slots: u8, buses: u8) -> Self {
        Self::with_layout(relocation, slots, BusLayout::roots(buses))
    }

    /// The buses of `layout`, each root bus with slots 1..=`slots` for devices (clamped to
    /// 1..=[`MAX_DEVICE_SLOTS`]). The switches' bridges are plugged by the caller.
    pub fn with_layout(
        relocation: Arc<dyn DeviceRelocation>,
        slots: u8,
        layout: BusLayout,
    ) -> Self {
        let mut devices: BTreeMap<u8, SharedPciDevice> = BTreeMap::new();
        devices.insert(0, Arc::new(Mutex::new(PciHostBridge::new())));
        Self {
            devices: RwLock::new(devices),
            slots: slots.clamp(1, MAX_DEVICE_SLOTS),
            layout,
            relocation,
            refused_moves: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// BAR moves refused so far, all devices.
    pub fn refused_bar_moves(&self) -> u64 {
        self.refused_moves
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn devices_read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<u8, SharedPciDevice>> {
        self.devices.read().unwrap_or_else(|e| e.into_inner())
    }

    fn devices_write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<u8, SharedPciDevice>> {
        self.devices.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The slots for devices of each bus: 1..=this.
    pub fn slots(&self) -> u8 {
        self.slots
    }

    /// The root buses: 0..this.
    pub fn buses(&self) -> u8 {
        self.layout.root_count()
    }

    /// Root buses and switches.
    pub fn layout(&self) -> &BusLayout {
        &self.layout
    }

    /// The device numbers of bus index `bus` that take devices: 1..=slots on a root bus,
    /// 0..ports on a switch.
    pub fn device_numbers(&self, bus: u8) -> std::ops::RangeInclusive<u8> {
        match self.layout.entry(bus).map(|e| e.kind) {
            Some(BusKind::Switch { ports, .. }) => 0..=ports.saturating_sub(1),
            _ => 1..=self.slots,
        }
    }

    /// Lowest free slot of bus 0.
    pub fn next_free_slot(&self) -> Option<u8> {
        self.next_free_slot_on(0)
    }

    /// Lowest free slot number of bus index `bus` (a root bus or a switch).
    pub fn next_free_slot_on(&self, bus: u8) -> Option<u8> {
        self.layout.entry(bus)?;
        let devices = self.devices_read();
        self.device_numbers(bus)
            .map(|d| slot_number(bus, d))
            .find(|s| !devices.contains_key(s))
    }

    /// Why slot number `slot` cannot take a device, if it cannot (occupancy aside).
    pub fn check_slot(&self, slot: u8) -> Result<(), PciRootError> {
        let (bus, dev) = (slot_bus(slot), slot_device(slot));
        let Some(entry) = self.layout.entry(bus) else {
            return Err(PciRootError::NoSuchBus {
                slot,
                bus,
                buses: self.layout.root_count(),
            });
        };
        if slot == 0 {
            return Err(PciRootError::HostBridgeSlot);
        }
        if let BusKind::Switch { ports, .. } = entry.kind {
            if dev >= ports {
                return Err(PciRootError::NoSuchPort {
                    slot,
                    port: dev,
                    ports,
                });
            }
            return Ok(());
        }
        if dev == 0 || dev > self.slots {
            return Err(PciRootError::SlotInvalid(slot, self.slots));
        }
        Ok(())
    }

    /// The guest's address of slot number `slot` (its bus's number, which differs from the
    /// bus index where switches are: `topology.rs`).
    pub fn bdf_of(&self, slot: u8) -> PciBdf {
        self.layout
            .bdf_of(slot)
            .unwrap_or_else(|| PciBdf::new(slot_bus(slot), slot_device(slot), 0))
    }

    /// Plugs `device` into `slot` (or the lowest free slot); returns its address.
    pub fn add_device(
        &self,
        slot: Option<u8>,
        device: SharedPciDevice,
    ) -> Result<PciBdf, PciRootError> {
        if let Some(s) = slot {
            self.check_slot(s)?;
        }
        let mut devices = self.devices_write();
        let slot = match slot {
            Some(s) if devices.contains_key(&s) => return Err(PciRootError::SlotInUse(s)),
            Some(s) => s,
            None => (1..=self.slots)
                .find(|s| !devices.contains_key(s))
                .ok_or(PciRootError::NoFreeSlot(self.slots))?,
        };
        devices.insert(slot, device);
        let bdf = self.bdf_of(slot);
        log::info!("pci device added at {bdf}");
        Ok(bdf)
    }

    /// Unplugs the device in `slot` and returns it (the caller frees its BARs and bus ranges).
    pub fn remove_device(&self, slot: u8) -> Result<SharedPciDevice, PciRootError> {
        self.check_slot(slot)?;
        let dev = self
            .devices_write()
            .remove(&slot)
            .ok_or(PciRootError::SlotEmpty(slot))?;
        log::info!("pci device removed from {}", self.bdf_of(slot));
        Ok(dev)
    }

    /// The device in `slot`.
    pub fn device(&self, slot: u8) -> Option<SharedPciDevice> {
        self.devices_read().get(&slot).cloned()
    }

    /// Occupied slot numbers, host bridge included.
    pub fn used_slots(&self) -> Vec<u8> {
        self.devices_read().keys().copied().collect()
    }

    fn lookup(&self, bdf: PciBdf) -> Option<SharedPciDevice> {
        if bdf.function() != 0 {
            return None;
        }
        let bus = self.layout.index_of(bdf.bus())?;
        self.device(slot_number(bus, bdf.device()))
    }

    /// Reads register `reg_idx` of `bdf`; all-ones if nothing is there.
    pub fn read_config(&self, bdf: PciBdf, reg_idx: usize) -> u32 {
        match self.lookup(bdf) {
            Some(dev) => dev
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .read_config_register(reg_idx),
            None => u32::MAX,
        }
    }

    /// Counts a refused BAR move or resize; returns how many there have been.
    fn count_refused(&self) -> u64 {
        self.refused_moves
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1
    }

    /// Writes config register `reg_idx` of `bdf` and applies the effects (see module docs).
    pub fn write_config(&self, bdf: PciBdf, reg_idx: usize, offset: u64, data: &[u8]) {
        let Some(dev) = self.lookup(bdf) else {
            return;
        };
        let mut dev = dev.lock().unwrap_or_else(|e| e.into_inner());
        let effects = dev.write_config_register(reg_idx, offset, data);
        for mv in &effects.bar_moves {
            if let Err(e) = self.relocation.move_bar(bdf, mv, &mut *dev) {
                // A guest may ask again and again: first 16, then one in 1024.
                let n = self.count_refused();
                if n <= 16 || n % 1024 == 0 {
                    log::warn!(
                        "{bdf}: bar {} move {:#x} -> {:#x} refused: {e}; it stays where it was \
                         (refused move #{n})",
                        mv.bar_idx,
                        mv.old,
                        mv.new
                    );
                }
                dev.bar_move_refused(mv);
                continue;
            }
            if let Err(e) = dev.move_bar(mv.old, mv.new) {
                log::error!("{bdf}: device move of bar {}: {e}", mv.bar_idx);
            }
        }
        for rs in &effects.bar_resizes {
            match self.relocation.resize_bar(bdf, rs, &mut *dev) {
                Ok(base) => dev.bar_resized(rs, base),
                Err(e) => {
                    let n = self.count_refused();
                    if n <= 16 || n % 1024 == 0 {
                        log::warn!(
                            "{bdf}: bar {} resize {:#x} -> {:#x} bytes refused: {e} (refused \
                             move or resize #{n})",
                            rs.bar_idx,
                            rs.old_len,
                            rs.new_len
                        );
                    }
                    dev.bar_resize_refused(rs, &e);
                }
            }
        }
        if let Some(change) = &effects.command {
            self.relocation.command_changed(bdf, change);
        }
    }
}

fn read_dword_part(value: u32, byte: usize, data: &mut [u8]) {
    let bytes = value.to_le_bytes();
    for (i, b) in data.iter_mut().enumerate() {
        *b = bytes.get(byte + i).copied().unwrap_or(0xff);
    }
}

fn access_ok(byte: usize, len: usize) -> bool {
    matches!(len, 1 | 2 | 4) && byte + len <= 4
}

/// Configuration mechanism #1 at ports 0xcf8..0xcff (insert at 0xcf8 with length 8).
pub struct PciConfigIo {
    bus: Arc<PciBus>,
    config_address: u32,
}

impl PciConfigIo {
    pub fn new(bus: Arc<PciBus>) -> Self {
        Self {
            bus,
            config_address: 0,
        }
    }

    fn target(&self) -> Option<(PciBdf, usize)> {
        if self.config_address & CONFIG_ADDRESS_ENABLE == 0 {
            return None;
        }
        let a = self.config_address;
        let bdf = PciBdf::new(
            (a >> 16) as u8,
            ((a >> 11) & 0x1f) as u8,
            ((a >> 8) & 7) as u8,
        );
        Some((bdf, ((a >> 2) & 0x3f) as usize))
    }
}

impl BusDevice for PciConfigIo {
    fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
        match offset {
            0 if data.len() == 4 => data.copy_from_slice(&self.config_address.to_le_bytes()),
            4..=7 => {
                let byte = (offset - 4) as usize;
                let value = match self.target() {
                    Some((bdf, reg)) if access_ok(byte, data.len()) => {
                        self.bus.read_config(bdf, reg)
                    }
                    _ => u32::MAX,
                };
                read_dword_part(value, byte, data);
            }
            _ => data.fill(0xff),
        }
    }

    fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
        match offset {
            0 if data.len() == 4 => {
                let mut b = [0u8; 4];
                b.copy_from_slice(data);
                self.config_address = u32::from_le_bytes(b) & CONFIG_ADDRESS_MASK;
            }
            4..=7 => {
                let byte = (offset - 4) as usize;
                if !access_ok(byte, data.len()) {
                    log::debug!("pci cfc write of {} bytes at {byte} ignored", data.len());
                    return;
                }
                if let Some((bdf, reg)) = self.target() {
                    self.bus.write_config(bdf, reg, byte as u64, data);
                }
            }
            _ => log::debug!("pci config port write at {offset:#x} ignored"),
        }
    }
}

/// ECAM (MMCONFIG) window: offset = bus << 20 | device << 15 | function << 12 | register.
pub struct PciConfigMmio {
    bus: Arc<PciBus>,
}

impl PciConfigMmio {
    pub fn new(bus: Arc<PciBus>) -> Self {
        Self { bus }
    }

    fn decode(offset: u64) -> (PciBdf, usize, usize) {
        let bdf = PciBdf::new(
            ((offset >> 20) & 0xff) as u8,
            ((offset >> 15) & 0x1f) as u8,
            ((offset >> 12) & 0x7) as u8,
        );
        let reg = ((offset & 0xfff) >> 2) as usize;
        (bdf, reg, (offset & 3) as usize)
    }
}

impl BusDevice for PciConfigMmio {
    fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
        let (bdf, reg, byte) = Self::decode(offset);
        let value = if access_ok(byte, data.len()) && offset < crate::device::ECAM_SIZE {
            self.bus.read_config(bdf, reg)
        } else {
            u32::MAX
        };
        read_dword_part(value, byte, data);
    }

    fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
        let (bdf, reg, byte) = Self::decode(offset);
        if !access_ok(byte, data.len()) || offset >= crate::device::ECAM_SIZE {
            log::debug!("ecam write of {} bytes at {offset:#x} ignored", data.len());
            return;
        }
        self.bus.write_config(bdf, reg, byte as u64, data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::Bus;
    use crate::configuration::{command, PciBarConfiguration, PciBarRegionType, BAR0_REG};
    use crate::device::{
        BarAllocation, BarMove, BarRequest, CommandChange, NoRelocation, PciBarAllocators,
        PciDeviceError, SharedBarAllocators, ECAM_BASE, ECAM_SIZE,
    };

    struct TestDev {
        config: PciConfiguration,
        moved: Vec<(u64, u64)>,
        bme: bool,
        bars: Vec<BarAllocation>,
    }

    impl TestDev {
        fn new() -> Self {
            Self {
                config: PciConfiguration::new(&PciConfigurationParams {
                    vendor_id: 0x1af4,
                    device_id: 0x1000,
                    ..Default::default()
                }),
                moved: Vec::new(),
                bme: false,
                bars: Vec::new(),
            }
        }
    }

    impl PciDevice for TestDev {
        fn allocate_bars(
            &mut self,
            allocators: &SharedBarAllocators,
        ) -> Result<Vec<PciBarConfiguration>, PciDeviceError> {
            let bars = BarAllocation::allocate_all(
                allocators,
                &[
                    BarRequest {
                        idx: 0,
                        size: 0x4000,
                        region_type: PciBarRegionType::Memory32,
                        prefetchable: false,
                    },
                    BarRequest {
                        idx: 2,
                        size: 0x10_0000,
                        region_type: PciBarRegionType::Memory64,
                        prefetchable: true,
                    },
                    BarRequest {
                        idx: 4,
                        size: 0x40,
                        region_type: PciBarRegionType::Io,
                        prefetchable: false,
                    },
                ],
            )?;
            for b in &bars {
                self.config.add_pci_bar(&b.config())?;
            }
            let configs = bars.iter().map(BarAllocation::config).collect();
            self.bars = bars;
            Ok(configs)
        }
        fn bar_allocations(&mut self) -> &mut [BarAllocation] {
            &mut self.bars
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
            let e = self.config.write_config_register(reg_idx, offset, data);
            if let Some(b) = e.command.and_then(|c| c.bus_master()) {
                self.bme = b;
            }
            e
        }
        fn move_bar(&mut self, old: u64, new: u64) -> Result<(), PciDeviceError> {
            self.moved.push((old, new));
            Ok(())
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn Any {
            self
        }
    }

    /// Moves ranges on a real `Bus`, records command changes.
    #[derive(Default)]
    struct Relocator {
        mmio: Bus,
        commands: Mutex<Vec<(PciBdf, CommandChange)>>,
        moves: Mutex<Vec<(PciBdf, BarMove)>>,
    }

    impl DeviceRelocation for Relocator {
        fn move_bar(
            &self,
            bdf: PciBdf,
            mv: &BarMove,
            device: &mut dyn PciDevice,
        ) -> Result<(), PciDeviceError> {
            self.moves.lock().unwrap().push((bdf, *mv));
            self.mmio
                .relocate(mv.old, mv.new)
                .map_err(|e| mv.failed(e))?;
            if let Some(a) = device
                .bar_allocations()
                .iter_mut()
                .find(|a| a.base() == mv.old)
            {
                // Outside the windows is allowed here (the test moves BAR2 to 0).
                let _ = a.relocate(mv.new);
            }
            Ok(())
        }
        fn command_changed(&self, bdf: PciBdf, change: &CommandChange) {
            self.commands.lock().unwrap().push((bdf, *change));
        }
    }

    struct Null;
    impl BusDevice for Null {
        fn read(&mut self, _b: u64, _o: u64, _d: &mut [u8]) {}
        fn write(&mut self, _b: u64, _o: u64, _d: &[u8]) {}
    }

    fn io_read(pio: &Bus, port: u64, len: usize) -> u32 {
        let mut b = [0u8; 4];
        pio.read(port, &mut b[..len]).unwrap();
        u32::from_le_bytes(b)
    }

    fn pio_bus(bus: Arc<PciBus>) -> Bus {
        let pio = Bus::new();
        pio.insert(
            Arc::new(Mutex::new(PciConfigIo::new(bus))),
            PCI_CONFIG_IO_PORT,
            PCI_CONFIG_IO_PORT_SIZE,
        )
        .unwrap();
        pio
    }

    fn ecam_bus(bus: Arc<PciBus>) -> Bus {
        let mmio = Bus::new();
        mmio.insert(
            Arc::new(Mutex::new(PciConfigMmio::new(bus))),
            ECAM_BASE,
            ECAM_SIZE,
        )
        .unwrap();
        mmio
    }

    fn cf8(bus: u32, dev: u32, func: u32, reg: u32) -> [u8; 4] {
        (1u32 << 31 | bus << 16 | dev << 11 | func << 8 | reg << 2).to_le_bytes()
    }

    #[test]
    fn bdf_format() {
        let bdf = PciBdf::new(0, 3, 0);
        assert_eq!(bdf.to_string(), "0000:00:03.0");
        assert_eq!(bdf.requester_id(), 0x18);
        let bdf = PciBdf::new(0x12, 0x1f, 7);
        assert_eq!((bdf.bus(), bdf.device(), bdf.function()), (0x12, 0x1f, 7));
    }

    #[test]
    fn config_mechanism_1_reaches_host_bridge() {
        let bus = Arc::new(PciBus::new(Arc::new(NoRelocation)));
        let pio = pio_bus(bus);
        // Enable bit clear: all-ones.
        pio.write(0xcf8, &0u32.to_le_bytes()).unwrap();
        assert_eq!(io_read(&pio, 0xcfc, 4), u32::MAX);
        pio.write(0xcf8, &cf8(0, 0, 0, 0)).unwrap();
        assert_eq!(io_read(&pio, 0xcf8, 4), 0x8000_0000);
        assert_eq!(io_read(&pio, 0xcfc, 4), 0x0d57_8086);
        assert_eq!(io_read(&pio, 0xcfc, 2), 0x8086);
        assert_eq!(io_read(&pio, 0xcfe, 2), 0x0d57);
        assert_eq!(io_read(&pio, 0xcff, 1), 0x0d);
        // Class code 06:00:00 in register 2.
        pio.write(0xcf8, &cf8(0, 0, 0, 2)).unwrap();
        assert_eq!(io_read(&pio, 0xcfc, 4) >> 8, 0x06_0000);
        assert_eq!(io_read(&pio, 0xcff, 1), 0x06);
        // Low two bits of CONFIG_ADDRESS are ignored.
        let mut a = cf8(0, 0, 0, 0);
        a[0] |= 3;
        pio.write(0xcf8, &a).unwrap();
        assert_eq!(io_read(&pio, 0xcf8, 4), 0x8000_0000);
        // Nonexistent device / function / bus read all-ones.
        for (b, d, f) in [(0, 5, 0), (0, 0, 1), (1, 0, 0), (0, 31, 0)] {
            pio.write(0xcf8, &cf8(b, d, f, 0)).unwrap();
            assert_eq!(io_read(&pio, 0xcfc, 4), u32::MAX, "{b}:{d}.{f}");
            assert_eq!(io_read(&pio, 0xcfd, 1), 0xff);
        }
        // Misaligned data access reads all-ones.
        pio.write(0xcf8, &cf8(0, 0, 0, 0)).unwrap();
        assert_eq!(io_read(&pio, 0xcfe, 4), u32::MAX);
    }

    #[test]
    fn ecam_reaches_host_bridge_and_devices() {
        let bus = Arc::new(PciBus::new(Arc::new(NoRelocation)));
        let mmio = ecam_bus(bus.clone());
        let read = |off: u64, len: usize| {
            let mut b = [0u8; 4];
            mmio.read(ECAM_BASE + off, &mut b[..len]).unwrap();
            u32::from_le_bytes(b)
        };
        assert_eq!(read(0, 4), 0x0d57_8086);
        assert_eq!(read(2, 2), 0x0d57);
        assert_eq!(read(0xb, 1), 0x06);
        // Extended space of a conventional function reads all-ones.
        assert_eq!(read(0x100, 4), u32::MAX);
        assert_eq!(read(3 << 15, 4), u32::MAX);
        assert_eq!(read(1 << 12, 4), u32::MAX);
        assert_eq!(read(1 << 20, 4), u32::MAX);
        assert_eq!(read(255 << 20 | 31 << 15 | 7 << 12 | 0xffc, 4), u32::MAX);
        bus.add_device(Some(3), Arc::new(Mutex::new(TestDev::new())))
            .unwrap();
        assert_eq!(read(3 << 15, 4), 0x1000_1af4);
        // Both mechanisms see the same device.
        let pio = pio_bus(bus);
        pio.write(0xcf8, &cf8(0, 3, 0, 0)).unwrap();
        assert_eq!(io_read(&pio, 0xcfc, 4), 0x1000_1af4);
    }

    #[test]
    fn a_bus_of_few_slots_refuses_the_others_by_name() {
        let bus = PciBus::with_slots(Arc::new(NoRelocation), 2);
        let dev = || -> SharedPciDevice { Arc::new(Mutex::new(TestDev::new())) };
        assert_eq!(bus.slots(), 2);
        assert_eq!(bus.add_device(None, dev()), Ok(PciBdf::new(0, 1, 0)));
        let err = bus.add_device(Some(3), dev()).unwrap_err();
        assert_eq!(err, PciRootError::SlotInvalid(3, 2));
        assert!(err.to_string().contains("slots 1 to 2"), "{err}");
        assert_eq!(bus.add_device(None, dev()), Ok(PciBdf::new(0, 2, 0)));
        let err = bus.add_device(None, dev()).unwrap_err();
        assert_eq!(err, PciRootError::NoFreeSlot(2));
        assert!(err.to_string().contains("--pci-slots"), "{err}");
        assert_eq!(bus.next_free_slot(), None);
        // Out of range either way.
        assert_eq!(PciBus::with_slots(Arc::new(NoRelocation), 0).slots(), 1);
        assert_eq!(PciBus::with_slots(Arc::new(NoRelocation), 200).slots(), 31);
    }

    #[test]
    fn root_buses_have_their_own_slots_and_config_space() {
        let bus = PciBus::with_buses(Arc::new(NoRelocation), 4, 3);
        let dev = || -> SharedPciDevice { Arc::new(Mutex::new(TestDev::new())) };
        assert_eq!((bus.buses(), bus.slots()), (3, 4));
        assert_eq!(
            PciBus::with_buses(Arc::new(NoRelocation), 4, 99).buses(),
            MAX_ROOT_BUSES
        );
        assert_eq!(bus.next_free_slot_on(2), Some(slot_number(2, 1)));
        assert_eq!(bus.next_free_slot_on(3), None);
        let at = bus.add_device(Some(slot_number(2, 1)), dev()).unwrap();
        assert_eq!(at, PciBdf::new(2, 1, 0));
        assert_eq!(at.to_string(), "0000:02:01.0");
        assert_eq!(bus.next_free_slot_on(2), Some(slot_number(2, 2)));
        // Bus 0's slot 1 is another slot.
        assert_eq!(bus.next_free_slot(), Some(1));
        // Device 0 of a NUMA bus holds no host bridge and takes no device; past `slots` is
        // out of range; a bus past the last does not exist.
        assert_eq!(
            bus.add_device(Some(slot_number(1, 0)), dev()),
            Err(PciRootError::SlotInvalid(32, 4))
        );
        assert_eq!(
            bus.add_device(Some(slot_number(1, 5)), dev()),
            Err(PciRootError::SlotInvalid(37, 4))
        );
        assert!(matches!(
            bus.add_device(Some(slot_number(3, 1)), dev()),
            Err(PciRootError::NoSuchBus { bus: 3, .. })
        ));
        // Both configuration mechanisms reach it at bus 2; nothing answers on bus 1.
        assert_eq!(bus.read_config(PciBdf::new(2, 1, 0), 0), 0x1000_1af4);
        assert_eq!(bus.read_config(PciBdf::new(1, 1, 0), 0), u32::MAX);
        assert_eq!(bus.read_config(PciBdf::new(2, 1, 1), 0), u32::MAX);
        let bus = Arc::new(bus);
        let mut ecam = PciConfigMmio::new(bus.clone());
        let mut d = [0u8; 4];
        ecam.read(ECAM_BASE, (2 << 20) | (1 << 15), &mut d);
        assert_eq!(u32::from_le_bytes(d), 0x1000_1af4);
        let mut io = PciConfigIo::new(bus.clone());
        io.write(0, 0, &(0x8000_0000u32 | 2 << 16 | 1 << 11).to_le_bytes());
        io.read(0, 4, &mut d);
        assert_eq!(u32::from_le_bytes(d), 0x1000_1af4);
        assert!(bus.remove_device(slot_number(2, 1)).is_ok());
        assert_eq!(bus.read_config(PciBdf::new(2, 1, 0), 0), u32::MAX);
    }

    #[test]
    fn hot_add_remove_slot_accounting() {
        let bus = PciBus::new(Arc::new(NoRelocation));
        let dev = || -> SharedPciDevice { Arc::new(Mutex::new(TestDev::new())) };
        assert_eq!(bus.used_slots(), vec![0]);
        assert_eq!(bus.add_device(Some(3), dev()), Ok(PciBdf::new(0, 3, 0)));
        assert_eq!(bus.add_device(None, dev()), Ok(PciBdf::new(0, 1, 0)));
        assert_eq!(
            bus.add_device(Some(3), dev()),
            Err(PciRootError::SlotInUse(3))
        );
        assert_eq!(
            bus.add_device(Some(0), dev()),
            Err(PciRootError::HostBridgeSlot)
        );
        // Slot number 32 is device 0 of root bus 1, which a bus without NUMA nodes lacks.
        let err = bus.add_device(Some(32), dev()).unwrap_err();
        assert_eq!(
            err,
            PciRootError::NoSuchBus {
                slot: 32,
                bus: 1,
                buses: 1
            }
        );
        assert!(err.to_string().contains("root bus 1"), "{err}");
        assert_eq!(bus.next_free_slot(), Some(2));
        for _ in 0..29 {
            bus.add_device(None, dev()).unwrap();
        }
        assert_eq!(bus.used_slots().len(), 32);
        assert_eq!(
            bus.add_device(None, dev()),
            Err(PciRootError::NoFreeSlot(31))
        );
        assert_eq!(bus.next_free_slot(), None);
        let removed = bus.remove_device(3).unwrap();
        assert!(removed
            .lock()
            .unwrap()
            .as_any()
            .downcast_ref::<TestDev>()
            .is_some());
        assert!(bus.device(3).is_none());
        assert_eq!(bus.read_config(PciBdf::new(0, 3, 0), 0), u32::MAX);
        assert_eq!(bus.remove_device(3).err(), Some(PciRootError::SlotEmpty(3)));
        assert_eq!(
            bus.remove_device(0).err(),
            Some(PciRootError::HostBridgeSlot)
        );
        assert_eq!(bus.next_free_slot(), Some(3));
        assert_eq!(bus.add_device(None, dev()), Ok(PciBdf::new(0, 3, 0)));
        // Host bridge is downcastable.
        let hb = bus.device(0).unwrap();
        assert!(hb
            .lock()
            .unwrap()
            .as_any()
            .downcast_ref::<PciHostBridge>()
            .is_some());
    }

    #[test]
    fn bar_allocation_and_guest_move_through_ecam() {
        let reloc = Arc::new(Relocator::default());
        let bus = Arc::new(PciBus::new(reloc.clone()));
        let alloc = shared(PciBarAllocators::x86_64(0x100_0000_0000, 0x10_0000_0000).unwrap());
        let dev = Arc::new(Mutex::new(TestDev::new()));
        let bars = dev.lock().unwrap().allocate_bars(&alloc).unwrap();
        assert_eq!(bars[0].addr, 0xc000_0000);
        assert_eq!(bars[1].addr, 0x100_0000_0000);
        assert_eq!(bars[2].addr, 0x1000);
        for b in &bars {
            if b.region_type.is_memory() {
                reloc
                    .mmio
                    .insert(Arc::new(Mutex::new(Null)), b.addr, b.size)
                    .unwrap();
            }
        }
        let bdf = bus.add_device(None, dev.clone()).unwrap();
        let mmio = ecam_bus(bus.clone());
        let cfg = |reg: u64| ECAM_BASE + (u64::from(bdf.device()) << 15) + reg * 4;

        // Sizing produces no moves.
        mmio.write(cfg(4), &u32::MAX.to_le_bytes()).unwrap();
        let mut b = [0u8; 4];
        mmio.read(cfg(4), &mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0xffff_c000);
        mmio.write(cfg(4), &0xc000_0000u32.to_le_bytes()).unwrap();
        assert!(reloc.moves.lock().unwrap().is_empty());

        // Guest moves BAR0: relocation moves the bus range, then the device is told.
        mmio.write(cfg(BAR0_REG as u64), &0xc010_0000u32.to_le_bytes())
            .unwrap();
        assert_eq!(reloc.moves.lock().unwrap().len(), 1);
        assert_eq!(dev.lock().unwrap().moved, vec![(0xc000_0000, 0xc010_0000)]);
        let mut probe = [0u8; 1];
        assert!(reloc.mmio.read(0xc010_0000, &mut probe).is_ok());
        assert!(reloc.mmio.read(0xc000_0000, &mut probe).is_err());
        // The reservation moved with it: the old range is free, the new one taken.
        assert!(alloc
            .lock()
            .unwrap()
            .allocate_at(PciBarRegionType::Memory32, 0xc010_0000, 0x4000)
            .is_err());
        let probe_old = BarAllocation::allocate(&alloc, &mem32(0x4000)).unwrap();
        assert_eq!(probe_old.base(), 0xc000_0000, "old bar range given back");
        drop(probe_old);

        // A failed relocation (overlap) is not forwarded to the device.
        mmio.write(cfg(BAR0_REG as u64), &0u32.to_le_bytes())
            .unwrap();
        mmio.write(cfg(6), &0u32.to_le_bytes()).unwrap(); // BAR2 (64-bit) low half: unchanged
        mmio.write(cfg(7), &0u32.to_le_bytes()).unwrap(); // high half: overlaps BAR0 at 0
        assert_eq!(
            reloc.moves.lock().unwrap().len(),
            3,
            "relocation was attempted"
        );
        assert_eq!(dev.lock().unwrap().moved.len(), 2);

        // Command: BME + MEM reported to the device and to the relocation hook.
        mmio.write(
            cfg(1),
            &(command::BUS_MASTER | command::MEMORY_SPACE).to_le_bytes(),
        )
        .unwrap();
        assert!(dev.lock().unwrap().bme);
        let cmds = reloc.commands.lock().unwrap().clone();
        assert_eq!(cmds.len(), 1);
        assert_eq!(cmds[0].0, bdf);
        assert_eq!(cmds[0].1.bus_master(), Some(true));
        mmio.write(cfg(1), &command::MEMORY_SPACE.to_le_bytes())
            .unwrap();
        assert!(!dev.lock().unwrap().bme);

        // Unplug returns the device; dropping it (the last reference) frees its BARs.
        let removed = bus.remove_device(bdf.device()).unwrap();
        assert_eq!(Arc::strong_count(&removed), 2);
        drop(removed);
        drop(dev);
        let again = TestDev::new().allocate_bars(&alloc);
        let again = again.unwrap();
        assert_eq!(again[0].addr, 0xc000_0000);
        assert_eq!(again[1].addr, 0x100_0000_0000);
        assert_eq!(again[2].addr, 0x1000);
    }

    fn shared(a: PciBarAllocators) -> SharedBarAllocators {
        Arc::new(Mutex::new(a))
    }

    fn mem32(size: u64) -> BarRequest {
        BarRequest {
            idx: 0,
            size,
            region_type: PciBarRegionType::Memory32,
            prefetchable: false,
        }
    }

    #[test]
    fn allocations_are_guards() {
        let alloc = shared(PciBarAllocators::x86_64(0x100_0000_0000, 0x1000_0000).unwrap());
        let req = BarRequest {
            idx: 0,
            size: 0x1000_0000,
            region_type: PciBarRegionType::Memory64,
            prefetchable: false,
        };
        let bar = BarAllocation::allocate(&alloc, &req).unwrap();
        assert!(
            BarAllocation::allocate(&alloc, &req).is_err(),
            "64-bit window is full"
        );
        // allocate_all rolls back on failure: the guards already made are dropped.
        assert!(BarAllocation::allocate_all(&alloc, &[mem32(0x1000), req]).is_err());
        let small = BarAllocation::allocate(&alloc, &mem32(0x1000)).unwrap();
        assert_eq!(small.base(), 0xc000_0000);
        drop(bar);
        let bar = BarAllocation::allocate(&alloc, &req).unwrap();
        assert_eq!(
            bar.base(),
            0x100_0000_0000,
            "the dropped range comes out again"
        );

        // A device's BARs go back when the device is dropped: the same addresses again.
        drop((bar, small));
        let alloc = shared(PciBarAllocators::x86_64(0x100_0000_0000, 0x10_0000_0000).unwrap());
        let mut d = TestDev::new();
        let first = d.allocate_bars(&alloc).unwrap();
        drop(d);
        let mut d2 = TestDev::new();
        let second = d2.allocate_bars(&alloc).unwrap();
        assert_eq!(first, second);
    }

    #[test]
    fn relocation_swaps_the_reservation() {
        let alloc = shared(PciBarAllocators::x86_64(0x100_0000_0000, 0x1000_0000).unwrap());
        let mut a = BarAllocation::allocate(&alloc, &mem32(0x1000)).unwrap();
        assert_eq!(a.base(), 0xc000_0000);
        a.relocate(0xc000_4000).unwrap();
        assert_eq!(a.base(), 0xc000_4000);
        assert!(a.is_reserved());
        // The old range is free again, the new one is not.
        let b = BarAllocation::allocate(&alloc, &mem32(0x1000)).unwrap();
        assert_eq!(b.base(), 0xc000_0000, "old range freed by the move");
        assert!(alloc
            .lock()
            .unwrap()
            .allocate_at(PciBarRegionType::Memory32, 0xc000_4000, 0x1000)
            .is_err());
        // Onto a taken range: the old range is freed, the BAR is recorded unreserved.
        assert!(a.relocate(0xc000_0000).is_err());
        assert!(!a.is_reserved());
        assert_eq!(a.base(), 0xc000_0000);
        // Dropping an unreserved allocation frees nothing (no double free of b's range).
        drop(a);
        assert!(alloc
            .lock()
            .unwrap()
            .allocate_at(PciBarRegionType::Memory32, 0xc000_0000, 0x1000)
            .is_err());
        // Moving outside the windows, then back in, reserves again.
        let mut c = BarAllocation::allocate(&alloc, &mem32(0x1000)).unwrap();
        let c0 = c.base();
        assert!(c.relocate(0x1_0000).is_err());
        assert!(!c.is_reserved());
        c.relocate(c0).unwrap();
        assert!(c.is_reserved());
        drop((b, c));
        // Everything is free: the whole 32-bit window fits in one allocation.
        let whole = BarAllocation::allocate(&alloc, &mem32(0x2000_0000)).unwrap();
        assert_eq!(whole.base(), 0xc000_0000);
    }

    /// A leaked guard would exhaust a window that holds only two devices' BARs.
    #[test]
    fn add_remove_cycles_do_not_exhaust_a_small_window() {
        let alloc = shared(
            PciBarAllocators::new(
                (0x1000, 0x80),
                (0xc000_0000, 0x8000),
                (0x1_0000_0000, 0x20_0000),
            )
            .unwrap(),
        );
        let reloc = Arc::new(Relocator::default());
        let bus = Arc::new(PciBus::new(reloc.clone()));
        let mmio = ecam_bus(bus.clone());
        for cycle in 0..100u32 {
            let dev = Arc::new(Mutex::new(TestDev::new()));
            let bars = dev
                .lock()
                .unwrap()
                .allocate_bars(&alloc)
                .unwrap_or_else(|e| panic!("cycle {cycle}: {e}"));
            for b in bars.iter().filter(|b| b.region_type.is_memory()) {
                reloc
                    .mmio
                    .insert(Arc::new(Mutex::new(Null)), b.addr, b.size)
                    .unwrap();
            }
            let bdf = bus.add_device(None, dev.clone()).unwrap();
            // Every other cycle the guest moves BAR0 within the window first.
            if cycle % 2 == 1 {
                let reg = ECAM_BASE + (u64::from(bdf.device()) << 15) + BAR0_REG as u64 * 4;
                mmio.write(reg, &0xc000_4000u32.to_le_bytes()).unwrap();
                assert_eq!(dev.lock().unwrap().moved.len(), 1, "cycle {cycle}");
            }
            let removed = bus.remove_device(bdf.device()).unwrap();
            let bars = removed
                .lock()
                .unwrap()
                .as_any()
                .downcast_ref::<TestDev>()
                .unwrap()
                .bars
                .iter()
                .map(|a| a.config())
                .collect::<Vec<_>>();
            for b in bars.iter().filter(|b| b.region_type.is_memory()) {
                reloc.mmio.remove(b.addr).unwrap();
            }
            drop(removed);
            drop(dev);
        }
    }
}
