//! The `PciDevice` trait, the effects a config write reports, BAR allocation and the
//! `DeviceRelocation` seam through which the root complex asks the VMM to move BARs.
//!
//! Flow of a guest config write: `PciConfigIo`/`PciConfigMmio` -> `PciBus::write_config`
//! -> `PciDevice::write_config_register` returns [`ConfigWriteEffects`]; the device has
//! already reacted to its own Command change (e.g. pinning guest RAM on BME 0->1). For
//! every [`BarMove`], the bus calls [`DeviceRelocation::move_bar`] (the VMM moves the
//! MMIO/PIO bus range and swaps the BAR's [`BarAllocation`]) and then
//! [`PciDevice::move_bar`] (the device moves its memslots/ioeventfds). Command changes
//! are passed to [`DeviceRelocation::command_changed`] for bookkeeping.

use std::any::Any;
use std::sync::{Arc, Mutex, MutexGuard};

use vm_allocator::{AddressAllocator, AllocPolicy, RangeInclusive};

use crate::configuration::{command, PciBarConfiguration, PciBarRegionType};
use crate::root::PciBdf;

/// Start of the 32-bit PCI MMIO window (CONTRACTS.md).
pub const MMIO32_BASE: u64 = 0xC000_0000;
/// Size of the 32-bit PCI MMIO window.
pub const MMIO32_SIZE: u64 = 0x2000_0000;
/// Start of the ECAM window.
pub const ECAM_BASE: u64 = 0xE000_0000;
/// Size of the ECAM window (buses 0..=255).
pub const ECAM_SIZE: u64 = 0x1000_0000;
/// Default PCI I/O port window (above the legacy ISA ports).
pub const PCI_IO_BASE: u64 = 0x1000;
/// Size of the default PCI I/O port window.
pub const PCI_IO_SIZE: u64 = 0xf000;

/// A BAR address change caused by a guest config write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarMove {
    pub bar_idx: usize,
    pub old: u64,
    pub new: u64,
    pub len: u64,
    pub region_type: PciBarRegionType,
}

impl BarMove {
    /// The error for this move failing because of `reason`.
    pub fn failed(&self, reason: impl ToString) -> PciDeviceError {
        PciDeviceError::MoveBar {
            old: self.old,
            new: self.new,
            reason: reason.to_string(),
        }
    }
}

/// A Command register change caused by a guest config write (or reset).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommandChange {
    pub old: u16,
    pub new: u16,
}

impl CommandChange {
    fn flip(&self, bit: u16) -> Option<bool> {
        ((self.old ^ self.new) & bit != 0).then_some(self.new & bit != 0)
    }

    /// `Some(new state)` if Bus Master Enable changed.
    pub fn bus_master(&self) -> Option<bool> {
        self.flip(command::BUS_MASTER)
    }

    /// `Some(new state)` if Memory Space Enable changed.
    pub fn memory(&self) -> Option<bool> {
        self.flip(command::MEMORY_SPACE)
    }

    /// `Some(new state)` if I/O Space Enable changed.
    pub fn io(&self) -> Option<bool> {
        self.flip(command::IO_SPACE)
    }

    /// `Some(new state)` if INTx Disable changed.
    pub fn intx_disable(&self) -> Option<bool> {
        self.flip(command::INTX_DISABLE)
    }
}

/// A BAR size change the function accepted (a driver wrote a Resizable BAR control
/// register): the VMM must make the BAR's bus range and reservation `new_len` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarResize {
    pub bar_idx: usize,
    /// Where the BAR decodes now.
    pub base: u64,
    pub old_len: u64,
    pub new_len: u64,
    pub region_type: PciBarRegionType,
}

/// What a config write changed, for the device manager.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConfigWriteEffects {
    pub bar_moves: Vec<BarMove>,
    pub command: Option<CommandChange>,
    pub bar_resizes: Vec<BarResize>,
}

impl ConfigWriteEffects {
    /// True if nothing needs the VMM's attention.
    pub fn is_empty(&self) -> bool {
        self.bar_moves.is_empty() && self.command.is_none() && self.bar_resizes.is_empty()
    }

    /// Appends `other`'s effects (a Command change keeps the first `old`).
    pub fn merge(&mut self, other: ConfigWriteEffects) {
        self.bar_moves.extend(other.bar_moves);
        self.bar_resizes.extend(other.bar_resizes);
        self.command = match (self.command, other.command) {
            (Some(a), Some(b)) => Some(CommandChange {
                old: a.old,
                new: b.new,
            }),
            (a, b) => b.or(a),
        };
    }
}

/// Errors of PCI devices and BAR allocation.
#[derive(Debug, thiserror::Error)]
pub enum PciDeviceError {
    #[error(
        "no room for a {} {region_type:?} BAR in the guest's window of {} at {window_base:#x} \
         ({} already taken)",
        human(*size),
        human(*window_size),
        human(*taken)
    )]
    BarAllocation {
        region_type: PciBarRegionType,
        size: u64,
        /// The window the BAR had to fit in.
        window_base: u64,
        window_size: u64,
        /// Bytes of the window other BARs hold.
        taken: u64,
        #[source]
        source: vm_allocator::Error,
    },
    #[error("freeing {region_type:?} bar {base:#x}+{size:#x} failed")]
    BarFree {
        region_type: PciBarRegionType,
        base: u64,
        size: u64,
        #[source]
        source: vm_allocator::Error,
    },
    #[error("invalid allocator window {base:#x}+{size:#x}")]
    AllocatorWindow {
        base: u64,
        size: u64,
        #[source]
        source: vm_allocator::Error,
    },
    #[error("configuration space: {0}")]
    Config(#[from] crate::configuration::ConfigError),
    #[error("moving bar {old:#x} -> {new:#x} failed: {reason}")]
    MoveBar { old: u64, new: u64, reason: String },
    #[error("device error: {0}")]
    Device(String),
}

/// A BAR a device wants, before an address is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarRequest {
    pub idx: usize,
    pub size: u64,
    pub region_type: PciBarRegionType,
    pub prefetchable: bool,
}

/// The VMM's PCI address allocators (I/O ports, 32-bit MMIO, 64-bit MMIO).
#[derive(Clone, Debug)]
pub struct PciBarAllocators {
    pub io: AddressAllocator,
    pub mmio32: AddressAllocator,
    pub mmio64: AddressAllocator,
    /// `(base, size, bytes taken)` of the I/O, 32-bit and 64-bit windows, for errors.
    windows: [(u64, u64, u64); 3],
    /// Non-prefetchable 64-bit BARs come from the 32-bit window: set for a bus behind a
    /// bridge, whose only 64-bit window is prefetchable (a firmware places them so too;
    /// Linux would not claim them in the prefetchable window and would move them).
    nonpref64_low: bool,
}

/// The window a BAR of `region_type` takes its range from: I/O, 32-bit, or 64-bit unless
/// it is placed `low` (below 4 GiB: the 32-bit window).
fn pool(region_type: PciBarRegionType, low: bool) -> usize {
    match region_type {
        PciBarRegionType::Io => 0,
        PciBarRegionType::Memory32 => 1,
        PciBarRegionType::Memory64 if low => 1,
        PciBarRegionType::Memory64 => 2,
    }
}

/// `size` bytes as the largest binary unit that divides it (`512 MiB`, `64 GiB`, `0x1800 bytes`).
pub fn human(size: u64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (1 << 40, "TiB"),
        (1 << 30, "GiB"),
        (1 << 20, "MiB"),
        (1 << 10, "KiB"),
    ];
    UNITS
        .iter()
        .find(|(u, _)| size >= *u && size % *u == 0)
        .map(|(u, name)| format!("{} {name}", size / u))
        .unwrap_or_else(|| match size {
            0 => "0 bytes".into(),
            _ => format!("{size:#x} bytes"),
        })
}

fn allocator(base: u64, size: u64) -> Result<AddressAllocator, PciDeviceError> {
    AddressAllocator::new(base, size).map_err(|source| PciDeviceError::AllocatorWindow {
        base,
        size,
        source,
    })
}

/// Root bus `bus`'s windows of `buses` root buses: `[io, mmio32, mmio64]`, `(base, size)`
/// each, over the x86_64 I/O and 32-bit windows and the 64-bit window `mmio64`. One bus has
/// them whole. With more, bus 0 keeps the lower half of each and the others share the upper
/// half in equal parts, each the largest power of two that fits (so that a part's large BARs
/// align within it). Each bus's host bridge offers only its part (`_CRS`): Linux moves a BAR
/// that lies outside its root bus's windows.
pub fn root_bus_windows(bus: u8, buses: u8, mmio64: (u64, u64)) -> [(u64, u64); 3] {
    let whole = [
        (PCI_IO_BASE, PCI_IO_SIZE),
        (MMIO32_BASE, MMIO32_SIZE),
        mmio64,
    ];
    if buses <= 1 {
        return whole;
    }
    let others = u64::from(buses - 1);
    whole.map(|(base, size)| {
        let half = size / 2;
        if bus == 0 {
            return (base, half);
        }
        let share = half / others;
        let part = if share == 0 {
            0
        } else {
            1u64 << (63 - share.leading_zeros())
        };
        (base + half + u64::from(bus - 1) * part, part)
    })
}

/// A bus's I/O, 32-bit and 64-bit windows, `(base, size)` each.
pub type BusWindows = [(u64, u64); 3];

/// The windows of a root bus (`[io, mmio32, mmio64]`) shared with its `switches`: each
/// switch gets a power-of-two part of half of each window, at least the bridge window's
/// granularity (4 KiB for I/O, 1 MiB for memory), and the root bus keeps the other half for
/// its own devices. The I/O and 32-bit parts come from the upper half, aligned to their
/// size; the 64-bit parts from the lower half, one after the other from the window's start
/// (granule-aligned; the allocator aligns each BAR to its size within them), so that the
/// first switch's apertures sit at the start of the 64-bit window, where a bare-metal
/// guest's boot mapping reaches. A window too small for that stays whole with the root bus
/// and closed on the switches (`(0, 0)`). Returns the root bus's part and each switch's.
pub fn switch_windows(root: BusWindows, switches: usize) -> (BusWindows, Vec<BusWindows>) {
    let mut keep = root;
    let mut parts = vec![[(0u64, 0u64); 3]; switches];
    if switches == 0 {
        return (keep, parts);
    }
    const GRANULES: [u64; 3] = [0x1000, 0x10_0000, 0x10_0000];
    let n = switches as u64;
    for (w, &(base, size)) in root.iter().enumerate() {
        let granule = GRANULES[w];
        let half = size / 2;
        let end = base + size;
        if w == 2 {
            let start = base.div_ceil(granule) * granule;
            let share = (base + half).saturating_sub(start) / n;
            if share < granule {
                continue;
            }
            let part = 1u64 << (63 - share.leading_zeros());
            keep[w] = (base + half, size - half);
            for (i, p) in parts.iter_mut().enumerate() {
                p[w] = (start + i as u64 * part, part);
            }
            continue;
        }
        let share = end.saturating_sub(base + half) / n;
        if share < granule {
            continue;
        }
        let mut part = 1u64 << (63 - share.leading_zeros());
        let start = loop {
            let start = (base + half).div_ceil(part) * part;
            if start + n * part <= end {
                break Some(start);
            }
            part /= 2;
            if part < granule {
                break None;
            }
        };
        let Some(start) = start else { continue };
        keep[w] = (base, half);
        for (i, p) in parts.iter_mut().enumerate() {
            p[w] = (start + i as u64 * part, part);
        }
    }
    (keep, parts)
}

impl PciBarAllocators {
    /// Allocators for root bus `bus` of `buses` (see [`root_bus_windows`]).
    pub fn for_root_bus(bus: u8, buses: u8, mmio64: (u64, u64)) -> Result<Self, PciDeviceError> {
        let [io, mmio32, mmio64] = root_bus_windows(bus, buses, mmio64);
        Self::new(io, mmio32, mmio64)
    }

    /// Allocators over the given windows (`(base, size)` each).
    pub fn new(
        io: (u64, u64),
        mmio32: (u64, u64),
        mmio64: (u64, u64),
    ) -> Result<Self, PciDeviceError> {
        Ok(Self {
            io: allocator(io.0, io.1)?,
            mmio32: allocator(mmio32.0, mmio32.1)?,
            mmio64: allocator(mmio64.0, mmio64.1)?,
            windows: [
                (io.0, io.1, 0),
                (mmio32.0, mmio32.1, 0),
                (mmio64.0, mmio64.1, 0),
            ],
            nonpref64_low: false,
        })
    }

    /// Allocators for a bus behind a bridge: as [`PciBarAllocators::new`], with
    /// non-prefetchable 64-bit BARs placed in the 32-bit window.
    pub fn behind_bridge(
        io: (u64, u64),
        mmio32: (u64, u64),
        mmio64: (u64, u64),
    ) -> Result<Self, PciDeviceError> {
        let mut a = Self::new(io, mmio32, mmio64)?;
        a.nonpref64_low = true;
        Ok(a)
    }

    /// The x86_64 layout of CONTRACTS.md: I/O 0x1000..0x10000, 32-bit MMIO
    /// 0xC000_0000..0xE000_0000, and the given 64-bit window.
    pub fn x86_64(mmio64_base: u64, mmio64_size: u64) -> Result<Self, PciDeviceError> {
        Self::new(
            (PCI_IO_BASE, PCI_IO_SIZE),
            (MMIO32_BASE, MMIO32_SIZE),
            (mmio64_base, mmio64_size),
        )
    }

    #[cfg(test)]
    fn window(&mut self, region_type: PciBarRegionType) -> &mut (u64, u64, u64) {
        &mut self.windows[pool(region_type, false)]
    }

    fn no_room(&mut self, pool: usize, size: u64, source: vm_allocator::Error) -> PciDeviceError {
        let (window_base, window_size, taken) = self.windows[pool];
        PciDeviceError::BarAllocation {
            region_type: match pool {
                0 => PciBarRegionType::Io,
                1 => PciBarRegionType::Memory32,
                _ => PciBarRegionType::Memory64,
            },
            size,
            window_base,
            window_size,
            taken,
            source,
        }
    }

    fn allocator(&mut self, pool: usize) -> &mut AddressAllocator {
        match pool {
            0 => &mut self.io,
            1 => &mut self.mmio32,
            _ => &mut self.mmio64,
        }
    }

    /// Allocates a naturally aligned range for `req`; returns the BAR with its address.
    pub(crate) fn allocate(
        &mut self,
        req: &BarRequest,
    ) -> Result<PciBarConfiguration, PciDeviceError> {
        let low = self.nonpref64_low && !req.prefetchable;
        let pool = pool(req.region_type, low);
        let range = match self
            .allocator(pool)
            .allocate(req.size, req.size, AllocPolicy::FirstMatch)
        {
            Ok(r) => r,
            Err(source) => return Err(self.no_room(pool, req.size, source)),
        };
        self.windows[pool].2 += req.size;
        Ok(PciBarConfiguration::new(
            req.idx,
            range.start(),
            req.size,
            req.region_type,
            req.prefetchable,
        ))
    }

    /// Reserves exactly `[base, base+size)` (e.g. when the guest moves a BAR).
    pub(crate) fn allocate_at(
        &mut self,
        region_type: PciBarRegionType,
        base: u64,
        size: u64,
    ) -> Result<(), PciDeviceError> {
        // A 64-bit BAR below 4 GiB is in the 32-bit window (a non-prefetchable one behind a
        // bridge, or one the guest moved there).
        let pool = pool(region_type, base < 1 << 32);
        match self
            .allocator(pool)
            .allocate(size, size, AllocPolicy::ExactMatch(base))
        {
            Ok(_) => {
                self.windows[pool].2 += size;
                Ok(())
            }
            Err(source) => Err(self.no_room(pool, size, source)),
        }
    }

    /// Frees `[base, base+size)`. Only [`BarAllocation`]'s drop calls this: a reservation
    /// is released by dropping the value that holds it, never by bookkeeping elsewhere.
    fn free(
        &mut self,
        region_type: PciBarRegionType,
        base: u64,
        size: u64,
    ) -> Result<(), PciDeviceError> {
        let err = |source| PciDeviceError::BarFree {
            region_type,
            base,
            size,
            source,
        };
        let end = base.saturating_add(size.saturating_sub(1));
        let range = RangeInclusive::new(base, end).map_err(err)?;
        let pool = pool(region_type, base < 1 << 32);
        self.allocator(pool).free(&range).map_err(err)?;
        let w = &mut self.windows[pool];
        w.2 = w.2.saturating_sub(size);
        Ok(())
    }
}

/// The VMM's BAR allocators, shared by every [`BarAllocation`] (each holds a handle so its
/// drop can give the range back; Cloud Hypervisor shares its allocators the same way).
pub type SharedBarAllocators = Arc<Mutex<PciBarAllocators>>;

/// One BAR's reservation in the VMM's address windows: dropping it frees the range, so
/// a device returns its BAR addresses when it is dropped, whoever drops it. A guest BAR
/// move swaps the reservation for one at the new address ([`BarAllocation::relocate`]).
pub struct BarAllocation {
    allocators: SharedBarAllocators,
    bar: PciBarConfiguration,
    /// False after the guest moved the BAR to an address the windows do not manage (or that
    /// is already reserved): there is nothing to free then.
    reserved: bool,
}

fn lock(a: &SharedBarAllocators) -> MutexGuard<'_, PciBarAllocators> {
    a.lock().unwrap_or_else(|e| e.into_inner())
}

impl BarAllocation {
    /// Reserves a naturally aligned range for `req`.
    pub fn allocate(
        allocators: &SharedBarAllocators,
        req: &BarRequest,
    ) -> Result<Self, PciDeviceError> {
        let bar = lock(allocators).allocate(req)?;
        Ok(Self {
            allocators: Arc::clone(allocators),
            bar,
            reserved: true,
        })
    }

    /// Reserves every request; on failure the ones already reserved are dropped (freed).
    pub fn allocate_all(
        allocators: &SharedBarAllocators,
        requests: &[BarRequest],
    ) -> Result<Vec<Self>, PciDeviceError> {
        requests
            .iter()
            .map(|req| Self::allocate(allocators, req))
            .collect()
    }

    /// The BAR with its current address.
    pub fn config(&self) -> PciBarConfiguration {
        self.bar
    }

    /// Current address of the BAR.
    pub fn base(&self) -> u64 {
        self.bar.addr
    }

    /// Whether the range is reserved in the allocators (false after a move outside them).
    pub fn is_reserved(&self) -> bool {
        self.reserved
    }

    /// Swaps the reservation for one at `new_base`: the new range is reserved first, then
    /// the old one is freed by dropping its guard. If `new_base` cannot be reserved (outside
    /// the managed windows, or taken), the old range is still freed (the BAR is no longer
    /// there), the BAR is recorded at `new_base` unreserved, and the error is returned.
    pub fn relocate(&mut self, new_base: u64) -> Result<(), PciDeviceError> {
        if new_base == self.bar.addr {
            return Ok(());
        }
        // The old range goes first: a BAR may move to a range overlapping its own old one
        // (a resized BAR placed again by the guest does).
        self.release();
        self.bar.addr = new_base;
        lock(&self.allocators).allocate_at(self.bar.region_type, new_base, self.bar.size)?;
        self.reserved = true;
        Ok(())
    }

    /// Makes the reservation `new_size` bytes (the BAR was resized): at the same address
    /// when it is aligned for the new size and free, else wherever the window has room.
    /// Returns the BAR's address. When nothing fits, the old range is reserved again
    /// and the error names the size and the window.
    pub fn resize(&mut self, new_size: u64) -> Result<u64, PciDeviceError> {
        if new_size == self.bar.size {
            return Ok(self.bar.addr);
        }
        let was_reserved = self.reserved;
        self.release();
        let mut a = lock(&self.allocators);
        let region_type = self.bar.region_type;
        let base = self.bar.addr;
        let placed = if base % new_size == 0 && a.allocate_at(region_type, base, new_size).is_ok() {
            Ok(base)
        } else {
            a.allocate(&BarRequest {
                idx: self.bar.idx,
                size: new_size,
                region_type,
                prefetchable: self.bar.prefetchable,
            })
            .map(|b| b.addr)
        };
        match placed {
            Ok(addr) => {
                self.bar.addr = addr;
                self.bar.size = new_size;
                self.reserved = true;
                Ok(addr)
            }
            Err(e) => {
                if was_reserved {
                    // Freed just above under the same lock: it fits again.
                    self.reserved = a.allocate_at(region_type, base, self.bar.size).is_ok();
                }
                Err(e)
            }
        }
    }

    fn release(&mut self) {
        if !std::mem::replace(&mut self.reserved, false) {
            return;
        }
        let b = &self.bar;
        if let Err(e) = lock(&self.allocators).free(b.region_type, b.addr, b.size) {
            // Cannot happen while only guards free ranges; logged rather than lost.
            log::error!("bar {}: {e}", b.idx);
        }
    }
}

impl std::fmt::Debug for BarAllocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BarAllocation")
            .field("bar", &self.bar)
            .field("reserved", &self.reserved)
            .finish()
    }
}

impl Drop for BarAllocation {
    fn drop(&mut self) {
        self.release();
    }
}

/// A PCI function on the root bus.
pub trait PciDevice: Send {
    /// Device id (as used by the API), if any.
    fn id(&self) -> Option<String> {
        None
    }

    /// Reserves addresses for the device's BARs from `allocators` (as [`BarAllocation`]s the
    /// device keeps: dropping the device frees them) and programs them into its
    /// configuration space. Returns the BARs so the VMM can insert bus ranges.
    fn allocate_bars(
        &mut self,
        _allocators: &SharedBarAllocators,
    ) -> Result<Vec<PciBarConfiguration>, PciDeviceError> {
        Ok(Vec::new())
    }

    /// The device's BAR reservations, so a guest BAR move can swap the moved BAR's
    /// reservation ([`BarAllocation::relocate`]). Devices without BARs keep the default.
    fn bar_allocations(&mut self) -> &mut [BarAllocation] {
        &mut []
    }

    /// Reads configuration register `reg_idx` (dword index; 0..64 or 0..1024).
    fn read_config_register(&mut self, reg_idx: usize) -> u32;

    /// Writes `data` (1, 2 or 4 bytes) at byte `offset` of register `reg_idx`.
    fn write_config_register(
        &mut self,
        reg_idx: usize,
        offset: u64,
        data: &[u8],
    ) -> ConfigWriteEffects;

    /// Trapped read of a BAR: `base` is the BAR's address, `offset` within it.
    fn read_bar(&mut self, _base: u64, _offset: u64, data: &mut [u8]) {
        data.fill(0xff);
    }

    /// Trapped write of a BAR.
    fn write_bar(&mut self, _base: u64, _offset: u64, _data: &[u8]) {}

    /// Called after the VMM has moved the bus range of the BAR at `old_base` to
    /// `new_base`, so the device can move memslots, ioeventfds, etc.
    fn move_bar(&mut self, _old_base: u64, _new_base: u64) -> Result<(), PciDeviceError> {
        Ok(())
    }

    /// Called instead of [`PciDevice::move_bar`] when the VMM refused the guest's new
    /// address for a BAR (it overlaps another BAR, guest RAM or platform MMIO, or lies
    /// outside the PCI windows): the BAR keeps decoding where it was placed last, so the
    /// device must not map anything at `mv.new`.
    fn bar_move_refused(&mut self, _mv: &BarMove) {}

    /// The VMM made the BAR of a [`BarResize`] `len` bytes at `base` (its bus range and
    /// reservation): the device now decodes and maps it there.
    fn bar_resized(&mut self, _rs: &BarResize, _base: u64) {}

    /// The VMM could not make room for a [`BarResize`] (`why`): the device must go back
    /// to the old size (on the function too), so that what it decodes matches the bus.
    fn bar_resize_refused(&mut self, _rs: &BarResize, _why: &PciDeviceError) {}

    /// Function reset (e.g. FLR or VM reset). Devices drop DMA pins and mappings here.
    fn reset(&mut self) -> Result<(), PciDeviceError> {
        Ok(())
    }

    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// Implemented by the device manager: applies BAR moves to the MMIO/PIO buses (and the
/// allocators), and observes Command changes.
pub trait DeviceRelocation: Send + Sync {
    /// Move the bus range `[mv.old, mv.old + mv.len)` to `mv.new`. Called with the device
    /// locked (it is passed in) before the device's own [`PciDevice::move_bar`].
    fn move_bar(
        &self,
        bdf: PciBdf,
        mv: &BarMove,
        device: &mut dyn PciDevice,
    ) -> Result<(), PciDeviceError>;

    /// Makes the bus range and reservation of a resized BAR `rs.new_len` bytes; returns
    /// where the BAR now is (the same base when it is aligned and free, else a new one
    /// the guest is expected to move anyway). Default: refused.
    fn resize_bar(
        &self,
        bdf: PciBdf,
        rs: &BarResize,
        _device: &mut dyn PciDevice,
    ) -> Result<u64, PciDeviceError> {
        log::warn!("{bdf}: bar {} resize not supported", rs.bar_idx);
        Err(PciDeviceError::MoveBar {
            old: rs.base,
            new: rs.base,
            reason: "bar resizing not supported".into(),
        })
    }

    /// A Command register change (informational; the device has already reacted).
    fn command_changed(&self, _bdf: PciBdf, _change: &CommandChange) {}
}

/// A [`DeviceRelocation`] that refuses moves (tests and VMs without relocation support).
#[derive(Debug, Default)]
pub struct NoRelocation;

impl DeviceRelocation for NoRelocation {
    fn move_bar(
        &self,
        bdf: PciBdf,
        mv: &BarMove,
        _device: &mut dyn PciDevice,
    ) -> Result<(), PciDeviceError> {
        log::warn!(
            "{bdf}: bar move {:#x} -> {:#x} not supported",
            mv.old,
            mv.new
        );
        Err(mv.failed("relocation not supported"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_buses_share_the_windows_in_aligned_parts() {
        let m64 = (0x100_0000_0000u64, 1u64 << 40);
        // One bus has everything.
        assert_eq!(
            root_bus_windows(0, 1, m64),
            [(PCI_IO_BASE, PCI_IO_SIZE), (MMIO32_BASE, MMIO32_SIZE), m64]
        );
        // Two: bus 0 the lower half, bus 1 the upper half.
        assert_eq!(root_bus_windows(0, 2, m64)[2], (m64.0, 1 << 39));
        assert_eq!(root_bus_windows(1, 2, m64)[2], (m64.0 + (1 << 39), 1 << 39));
        assert_eq!(root_bus_windows(1, 2, m64)[1], (0xd000_0000, 0x1000_0000));
        // Four: three parts of the upper half, each a power of two, none overlapping, all
        // inside the window.
        let parts: Vec<_> = (0..4).map(|b| root_bus_windows(b, 4, m64)).collect();
        for w in 0..3 {
            let mut all: Vec<(u64, u64)> = parts.iter().map(|p| p[w]).collect();
            all.sort();
            let whole = root_bus_windows(0, 1, m64)[w];
            for pair in all.windows(2) {
                assert!(pair[0].0 + pair[0].1 <= pair[1].0, "{w}: {all:x?}");
            }
            for &(base, size) in &all {
                assert!(size > 0 && base >= whole.0 && base + size <= whole.0 + whole.1);
            }
            for &(_, size) in &all[1..] {
                assert!(size.is_power_of_two(), "{w}: {all:x?}");
            }
        }
        assert_eq!(
            parts[1][2].1,
            1 << 37,
            "512 GiB shared by three: 128 GiB each"
        );
        // Eight buses still each get I/O ports.
        assert!((0..8).all(|b| root_bus_windows(b, 8, m64)[0].1 >= 0x1000));
    }

    #[test]
    fn switches_share_half_of_their_root_buses_windows_in_power_of_two_parts() {
        let m64 = (0x100_0000_0000u64, 1u64 << 40);
        let root = root_bus_windows(0, 1, m64);
        let (keep, parts) = switch_windows(root, 1);
        assert_eq!(
            keep,
            [
                (0x1000, 0x7800),
                (0xc000_0000, 0x1000_0000),
                (m64.0 + (1 << 39), 1 << 39)
            ]
        );
        assert_eq!(
            parts,
            vec![[
                (0xc000, 0x4000),
                (0xd000_0000, 0x1000_0000),
                (m64.0, 1 << 39)
            ]]
        );
        // Three switches on node 0's root bus of two: disjoint, powers of two; the I/O and
        // 32-bit parts aligned in the root's upper half, the 64-bit ones one after the other
        // from the window's start, the root keeping the upper half there.
        let root = root_bus_windows(0, 2, m64);
        let (keep, parts) = switch_windows(root, 3);
        for w in 0..3 {
            let (base, size) = root[w];
            let (lo, hi) = if w == 2 {
                assert_eq!(keep[w], (base + size / 2, size / 2));
                (base, base + size / 2)
            } else {
                assert_eq!(keep[w], (base, size / 2));
                (base + size / 2, base + size)
            };
            let mut prev_end = lo;
            for p in &parts {
                let (b, s) = p[w];
                assert!(s.is_power_of_two(), "{w}: {parts:x?}");
                assert!(w == 2 || b % s == 0, "{w}: {parts:x?}");
                assert!(b >= prev_end && b + s <= hi, "{w}: {parts:x?}");
                prev_end = b + s;
            }
        }
        assert_eq!(
            parts[0][2].0, m64.0,
            "the first switch's apertures start the window"
        );
        assert_eq!(
            parts[0][2].1,
            1 << 36,
            "256 GiB shared by three: 64 GiB each"
        );
        // No switches: the root keeps everything.
        assert_eq!(switch_windows(root, 0), (root, vec![]));
        // An I/O window too small for a 4 KiB part each stays with the root bus.
        let (keep, parts) = switch_windows([(0x1000, 0x1000), root[1], root[2]], 2);
        assert_eq!((keep[0], parts[1][0]), ((0x1000, 0x1000), (0, 0)));
    }

    #[test]
    fn behind_a_bridge_non_prefetchable_64_bit_bars_are_placed_below_4g() {
        let alloc: SharedBarAllocators = Arc::new(Mutex::new(
            PciBarAllocators::behind_bridge(
                (0xc000, 0x4000),
                (0xd000_0000, 0x1000_0000),
                (0x80_0000_0000, 0x40_0000_0000),
            )
            .unwrap(),
        ));
        let req = |idx, prefetchable| BarRequest {
            idx,
            size: 0x10_0000,
            region_type: PciBarRegionType::Memory64,
            prefetchable,
        };
        let mut np = BarAllocation::allocate(&alloc, &req(0, false)).unwrap();
        let p = BarAllocation::allocate(&alloc, &req(2, true)).unwrap();
        assert_eq!((np.base(), p.base()), (0xd000_0000, 0x80_0000_0000));
        // Moved and freed in the 32-bit window too: the range comes back for the next.
        np.relocate(0xd800_0000).unwrap();
        assert_eq!(lock(&alloc).windows[1].2, 0x10_0000);
        drop(np);
        assert_eq!(lock(&alloc).windows[1].2, 0);
        let again = BarAllocation::allocate(&alloc, &req(0, false)).unwrap();
        assert_eq!(again.base(), 0xd000_0000);
        // On a root bus a 64-bit BAR keeps the 64-bit window.
        let root: SharedBarAllocators = Arc::new(Mutex::new(
            PciBarAllocators::x86_64(0x80_0000_0000, 0x40_0000_0000).unwrap(),
        ));
        let r = BarAllocation::allocate(&root, &req(0, false)).unwrap();
        assert_eq!(r.base(), 0x80_0000_0000);
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(human(64 << 30), "64 GiB");
        assert_eq!(human(512 << 20), "512 MiB");
        assert_eq!(human(1 << 40), "1 TiB");
        assert_eq!(human(4096), "4 KiB");
        assert_eq!(human(1536 << 20), "1536 MiB");
        assert_eq!(human(0x1800), "6 KiB");
        assert_eq!(human(0x1801), "0x1801 bytes");
        assert_eq!(human(0), "0 bytes");
    }

    #[test]
    fn a_bar_that_does_not_fit_names_its_size_and_the_window() {
        let alloc = Arc::new(Mutex::new(
            PciBarAllocators::x86_64(1 << 32, 8 << 20).unwrap(),
        ));
        let req = |size| BarRequest {
            idx: 0,
            size,
            region_type: PciBarRegionType::Memory64,
            prefetchable: true,
        };
        let first = BarAllocation::allocate(&alloc, &req(4 << 20)).unwrap();
        let e = BarAllocation::allocate(&alloc, &req(8 << 20))
            .err()
            .unwrap()
            .to_string();
        assert_eq!(
            e,
            "no room for a 8 MiB Memory64 BAR in the guest's window of 8 MiB at 0x100000000 \
             (4 MiB already taken)"
        );
        // Dropping the reservation gives its room back, and the count with it.
        drop(first);
        let whole = BarAllocation::allocate(&alloc, &req(8 << 20)).unwrap();
        assert_eq!(whole.base(), 1 << 32);
    }

    /// A resized BAR keeps its address when it is aligned for the new size and free,
    /// moves where there is room otherwise, and keeps its old range when nothing fits.
    #[test]
    fn a_resized_bar_keeps_its_place_when_it_can_and_its_range_when_nothing_fits() {
        let alloc = Arc::new(Mutex::new(
            PciBarAllocators::x86_64(1 << 32, 64 << 20).unwrap(),
        ));
        let req = |size| BarRequest {
            idx: 0,
            size,
            region_type: PciBarRegionType::Memory64,
            prefetchable: true,
        };
        let mut a = BarAllocation::allocate(&alloc, &req(4 << 20)).unwrap();
        let mut b = BarAllocation::allocate(&alloc, &req(4 << 20)).unwrap();
        assert_eq!((a.base(), b.base()), (1 << 32, (1 << 32) + (4 << 20)));
        // Shrinking stays in place.
        assert_eq!(a.resize(1 << 20).unwrap(), 1 << 32);
        assert_eq!(a.config().size, 1 << 20);
        // Growing b past its alignment moves it (to the next 16 MiB boundary).
        assert_eq!(b.resize(16 << 20).unwrap(), (1 << 32) + (16 << 20));
        // 64 MiB cannot fit beside the others: refused by name, the old range kept.
        let e = a.resize(64 << 20).unwrap_err().to_string();
        assert!(e.contains("no room for a 64 MiB Memory64 BAR"), "{e}");
        assert_eq!((a.base(), a.config().size), (1 << 32, 1 << 20));
        assert!(a.is_reserved());
        // Its old range is still taken: a BAR of that place does not fit there.
        assert!(lock(&alloc)
            .allocate_at(PciBarRegionType::Memory64, 1 << 32, 1 << 20)
            .is_err());
        drop((a, b));
        assert_eq!(
            lock(&alloc).window(PciBarRegionType::Memory64).2,
            0,
            "all given back"
        );
    }
}
