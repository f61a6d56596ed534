//! Device manager: the PIO and MMIO buses, legacy devices and the PCI root complex.
//!
//! PCI: bus 0 (`pci::PciBus`, host bridge at 00:00.0) is reachable through config mechanism
//! #1 (ports 0xcf8..0xcff) and ECAM (0xE000_0000). [`DeviceManager::add_pci_device`] gives a
//! device its BARs from the VM's windows, puts every BAR on the MMIO (or PIO) bus so trapped
//! accesses reach `PciDevice::read_bar`/`write_bar`, and plugs it into a slot;
//! [`DeviceManager::remove_pci_device`] undoes all of it. Guest BAR moves arrive through
//! [`BarRelocator`] (the root complex's `DeviceRelocation`).
//!
//! Release is by drop only: a device keeps its BARs' `BarAllocation`s (freed when the device
//! is dropped), and the manager keeps each slot's `BusRange` guards (dropped on unplug). No
//! path frees a BAR by address.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Mutex};

use kvm_ioctls::VmFd;
use pci::device::{
    BarAllocation, BarMove, BarResize, DeviceRelocation, PciBarAllocators, PciDeviceError,
    SharedBarAllocators,
};
use pci::root::{PciRootError, MAX_DEVICE_SLOTS, MAX_ROOT_BUSES};
use pci::{
    Bus, BusDevice, BusError, BusRange, PciBarRegionType, PciBdf, PciBus, PciConfigIo,
    PciConfigMmio, PciDevice, SharedPciDevice,
};
use vmm_sys_util::eventfd::EventFd;

use crate::config::SerialConfig;
use crate::exit::ExitNotifier;
use crate::layout::{
    DEBUG_EXIT_PORT, PCI_CONFIG_IO_PORT, PCI_CONFIG_IO_PORT_SIZE, PCI_ECAM_SIZE, PCI_ECAM_START,
    SERIAL_IRQ, SERIAL_PORT,
};
use crate::legacy::{DebugExit, SerialDevice};

/// Size of the 64-bit PCI BAR window of a VM whose snapshot or migration document does not
/// say (lendvms before `--pci-mmio64-size` had this one), and of the unit tests' VMs. New
/// VMs get `--pci-mmio64-size` (`auto` by default: see `config::MMIO64_AUTO_MAX`).
pub const PCI_MMIO64_SIZE: u64 = 64 << 30;

/// Errors of device set-up.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("cannot open serial output file {path}")]
    SerialFile {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot create the {what} eventfd")]
    EventFd {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot register the irqfd of GSI {gsi}")]
    Irqfd {
        gsi: u32,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("cannot place {what} on the bus")]
    Bus {
        what: &'static str,
        #[source]
        source: BusError,
    },
    #[error(
        "no room for a {} 64-bit BAR in the guest's 64-bit PCI window of {} at {base:#x} ({} \
         already taken): a VM started with a larger --pci-mmio64-size has room for it",
        pci::device::human(*size),
        pci::device::human(*window),
        pci::device::human(*taken)
    )]
    Mmio64Full {
        size: u64,
        base: u64,
        window: u64,
        taken: u64,
        #[source]
        source: vm_allocator::Error,
    },
    #[error(transparent)]
    Pci(#[from] PciDeviceError),
    #[error("the guest's PCI tree")]
    Topology(#[from] TopologyError),
    #[error(transparent)]
    Slot(#[from] PciRootError),
}

/// Routes trapped BAR accesses on a bus range to the device's `read_bar`/`write_bar`.
pub struct BarBusDevice {
    device: SharedPciDevice,
}

impl BusDevice for BarBusDevice {
    fn read(&mut self, base: u64, offset: u64, data: &mut [u8]) {
        self.device
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .read_bar(base, offset, data)
    }

    fn write(&mut self, base: u64, offset: u64, data: &[u8]) {
        self.device
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .write_bar(base, offset, data)
    }
}

/// The bus ranges of each plugged device's BARs, per slot: dropping a slot's entry takes
/// its ranges off the buses.
/// Each range is keyed by its BAR index, so a move finds the BAR wherever it really is.
type BarRanges = Arc<Mutex<BTreeMap<u8, Vec<(usize, BusRange)>>>>;

/// Moves bus ranges and swaps allocator reservations when the guest reprograms a BAR.
///
/// A guest may write any address into a BAR. The move is refused (the BAR keeps decoding
/// where it was placed last; the device maps nothing at the new address) when the new range
/// is not inside the PCI windows the VMM gives the guest — the 32-bit window
/// 0xC000_0000..0xE000_0000 or the 64-bit window after RAM for memory BARs, the I/O window
/// for I/O BARs — or overlaps another bus range (another BAR, this device's included, or
/// the ECAM). Guest RAM, the ECAM, the platform devices, the IOAPIC and the LAPIC/MSI
/// window all lie outside those windows, so no BAR is ever mapped over them.
pub struct BarRelocator {
    ranges: BarRanges,
    /// The 64-bit BAR window (base, size).
    mmio64: (u64, u64),
    /// The buses: a function's address names its bus by number, its ranges are kept by
    /// slot number (bus index).
    layout: pci::BusLayout,
}

impl BarRelocator {
    /// The slot number of the function at `bdf`.
    fn slot(&self, bdf: PciBdf) -> Option<u8> {
        let bus = self.layout.index_of(bdf.bus())?;
        Some(pci::root::slot_number(bus, bdf.device()))
    }

    /// The windows a BAR of `region_type` may be placed in.
    fn windows(&self, region_type: PciBarRegionType) -> Vec<(u64, u64)> {
        match region_type {
            PciBarRegionType::Io => vec![(pci::device::PCI_IO_BASE, pci::device::PCI_IO_SIZE)],
            _ => vec![
                (pci::device::MMIO32_BASE, pci::device::MMIO32_SIZE),
                self.mmio64,
            ],
        }
    }

    fn inside_windows(&self, region_type: PciBarRegionType, base: u64, len: u64) -> bool {
        base.checked_add(len).is_some_and(|end| {
            self.windows(region_type)
                .iter()
                .any(|&(w, size)| base >= w && end <= w + size)
        })
    }
}

impl DeviceRelocation for BarRelocator {
    fn move_bar(
        &self,
        bdf: PciBdf,
        mv: &BarMove,
        device: &mut dyn PciDevice,
    ) -> Result<(), PciDeviceError> {
        if !self.inside_windows(mv.region_type, mv.new, mv.len) {
            return Err(mv.failed(format!(
                "{:#x}+{:#x} is outside the pci windows (guest ram, platform mmio or unbacked)",
                mv.new, mv.len
            )));
        }
        // Where the BAR is on the bus now: its last accepted address, which differs from
        // `mv.old` (the guest's previous value) after a refused move.
        let from = {
            let mut ranges = self.ranges.lock().unwrap_or_else(|e| e.into_inner());
            let range = self
                .slot(bdf)
                .and_then(|slot| ranges.get_mut(&slot))
                .and_then(|v| v.iter_mut().find(|(idx, _)| *idx == mv.bar_idx))
                .map(|(_, r)| r)
                .ok_or_else(|| mv.failed("no bus range for this bar"))?;
            let from = range.base();
            range.relocate(mv.new).map_err(|e| mv.failed(e))?;
            from
        };
        match device
            .bar_allocations()
            .iter_mut()
            .find(|a| a.base() == from)
        {
            Some(a) => {
                if let Err(e) = a.relocate(mv.new) {
                    log::warn!(
                        "{bdf}: bar moved to {:#x} outside the managed window: {e}",
                        mv.new
                    );
                }
            }
            None => log::warn!("{bdf}: no reservation for the bar at {from:#x}"),
        }
        log::debug!("{bdf}: bar {} moved {from:#x} -> {:#x}", mv.bar_idx, mv.new);
        Ok(())
    }

    fn resize_bar(
        &self,
        bdf: PciBdf,
        rs: &BarResize,
        device: &mut dyn PciDevice,
    ) -> Result<u64, PciDeviceError> {
        let fail = |reason: String| PciDeviceError::MoveBar {
            old: rs.base,
            new: rs.base,
            reason,
        };
        let mut ranges = self.ranges.lock().unwrap_or_else(|e| e.into_inner());
        let range = self
            .slot(bdf)
            .and_then(|slot| ranges.get_mut(&slot))
            .and_then(|v| v.iter_mut().find(|(idx, _)| *idx == rs.bar_idx))
            .map(|(_, r)| r)
            .ok_or_else(|| fail("no bus range for this bar".into()))?;
        let from = range.base();
        let alloc = device
            .bar_allocations()
            .iter_mut()
            .find(|a| a.base() == from)
            .ok_or_else(|| fail(format!("no reservation for the bar at {from:#x}")))?;
        // The reservation first: it names the window when there is no room.
        let old_len = alloc.config().size;
        let base = alloc.resize(rs.new_len)?;
        if !self.inside_windows(rs.region_type, base, rs.new_len) {
            undo_resize(alloc, old_len, from);
            return Err(fail(format!(
                "{base:#x}+{:#x} is outside the pci windows",
                rs.new_len
            )));
        }
        if let Err(e) = range.resize(base, rs.new_len) {
            undo_resize(alloc, old_len, from);
            return Err(fail(e.to_string()));
        }
        log::info!(
            "{bdf}: bar {} resized {} -> {} at {base:#x}",
            rs.bar_idx,
            pci::device::human(rs.old_len),
            pci::device::human(rs.new_len)
        );
        Ok(base)
    }
}

/// Puts a BAR's reservation back to `len` bytes at `base` (where its bus range stayed).
fn undo_resize(alloc: &mut BarAllocation, len: u64, base: u64) {
    let r = alloc.resize(len).and_then(|_| alloc.relocate(base));
    if let Err(e) = r {
        log::warn!("bar {base:#x}: reserving its old {len:#x} bytes again: {e}");
    }
}

/// The root buses of a guest with `numa_nodes` NUMA nodes: one per node (node `n` has bus
/// `n`, node 0 bus 0), at most [`MAX_ROOT_BUSES`]; one without NUMA.
pub fn root_buses(numa_nodes: usize) -> u8 {
    numa_nodes.clamp(1, usize::from(MAX_ROOT_BUSES)) as u8
}

/// A switch for one lender's devices (`pci::topology`): a PCI-to-PCI bridge on root bus
/// `root` with `ports` device numbers behind it. Made at launch, kept by snapshots and
/// migrations (the guest's bus numbers and ACPI tables depend on it).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LenderSwitch {
    /// The lender (cluster node) whose devices go behind it.
    pub lender: String,
    /// The root bus it sits on (a bus index: node `n`'s root bus is `n`).
    pub root: u8,
    /// Its ports: device numbers 0..ports of its secondary bus.
    pub ports: u8,
}

/// Ports a switch has beyond its lender's launch devices: room to hot-add there (each port
/// is a slot the guest's ACPI tables describe, which costs an emulated guest's boot about
/// half a second).
pub const SWITCH_SPARE_PORTS: u8 = 2;

/// The switches a VM gets at launch: one per lender and root bus holding two or more of
/// its launch devices, in the order the lenders first appear (`devices`: each launch
/// device's lender and root bus). A lender with one device keeps it on the root bus: it
/// has no peer to show. At most as many as fit beside `roots` root buses
/// ([`MAX_ROOT_BUSES`] in all); the lenders past that keep their devices on the root bus,
/// which is logged.
pub fn plan_switches(devices: &[(String, u8)], roots: u8) -> Vec<LenderSwitch> {
    let mut groups: Vec<(String, u8, usize)> = Vec::new();
    for (lender, root) in devices {
        match groups.iter_mut().find(|(l, r, _)| l == lender && r == root) {
            Some(g) => g.2 += 1,
            None => groups.push((lender.clone(), *root, 1)),
        }
    }
    let room = usize::from(MAX_ROOT_BUSES.saturating_sub(roots.max(1)));
    let mut switches = Vec::new();
    for (lender, root, n) in groups.into_iter().filter(|g| g.2 >= 2) {
        if switches.len() == room {
            log::warn!(
                "lender {lender}: no switch for its {n} devices on root bus {root} ({roots} root                  buses and {room} switches make the {MAX_ROOT_BUSES} buses a VM has): they sit                  on the root bus"
            );
            continue;
        }
        let ports = u8::try_from(n)
            .unwrap_or(u8::MAX)
            .saturating_add(SWITCH_SPARE_PORTS)
            .min(pci::root::NUM_DEVICE_SLOTS);
        switches.push(LenderSwitch {
            lender,
            root,
            ports,
        });
    }
    switches
}

/// Owns the buses and the devices on them.
pub struct DeviceManager {
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
    serial: Option<Arc<Mutex<SerialDevice>>>,
    pci_bus: Arc<PciBus>,
    /// Each bus's BAR allocators, indexed by bus index: a root bus's over its slice of the
    /// windows ([`pci::device::root_bus_windows`]), less what its switches take
    /// ([`pci::device::switch_windows`]); a switch's over its bridge's windows.
    allocators: Vec<SharedBarAllocators>,
    /// Each bus's windows, `[io, mmio32, mmio64]`, as `allocators` (by bus index).
    windows: Vec<[(u64, u64); 3]>,
    /// The switches, with their bus index.
    switches: Vec<(LenderSwitch, u8)>,
    /// The guest's NUMA nodes (`--numa`; 0 without): node `n` < [`MAX_ROOT_BUSES`] has root
    /// bus `n`.
    numa_nodes: usize,
    /// The whole 64-bit BAR window (base, size).
    mmio64: (u64, u64),
    ranges: BarRanges,
}

/// Why a NUMA node cannot take a device.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NodeError {
    #[error("numa_node={0}: this VM has no NUMA nodes (lendvm --numa)")]
    NoNuma(u32),
    #[error("numa_node={node}: this VM has NUMA nodes 0 to {} (lendvm --numa)", .nodes - 1)]
    NoSuchNode { node: u32, nodes: usize },
    #[error(
        "numa_node={0}: devices sit in nodes 0 to {max} only (one root bus each)",
        max = MAX_ROOT_BUSES - 1
    )]
    NoRootBus(u32),
}

/// Why the PCI tree cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error("the switches of lenders {lenders}")]
    Layout {
        lenders: String,
        #[source]
        source: pci::TopologyError,
    },
    #[error("the bridge of lender {lender}'s switch")]
    Bridge {
        lender: String,
        #[source]
        source: PciRootError,
    },
}

/// Where the UART writes. A file is always written in append mode, even one this VM
/// starts (and empties): a VM that migrated away and the one that took over may both write
/// to it, and each write must land at its end, never over the other's.
fn open_serial(serial: &SerialConfig) -> Result<Option<Box<dyn Write + Send>>, DeviceError> {
    let appending = |path: &std::path::PathBuf, truncate: bool| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|f| {
                if truncate {
                    f.set_len(0).map(|()| f)
                } else {
                    Ok(f)
                }
            })
            .map_err(|source| DeviceError::SerialFile {
                path: path.clone(),
                source,
            })
    };
    Ok(match serial {
        SerialConfig::Stdout => Some(Box::new(std::io::stdout())),
        SerialConfig::File(path) => Some(Box::new(appending(path, true)?)),
        SerialConfig::Append(path) => Some(Box::new(appending(path, false)?)),
        SerialConfig::Off => None,
    })
}

impl DeviceManager {
    /// Creates the buses with COM1, the debug-exit port and the PCI root complex; the
    /// 64-bit BAR window is `mmio64` (base, size).
    /// `pci_slots`: the slots of bus 0 that take devices, 1..=`pci_slots` (`--pci-slots`).
    pub fn new(
        vm: &VmFd,
        serial: &SerialConfig,
        exit: Arc<ExitNotifier>,
        mmio64: (u64, u64),
        pci_slots: u8,
        numa_nodes: usize,
        switches: &[LenderSwitch],
    ) -> Result<Self, DeviceError> {
        let pio = Arc::new(Bus::new());
        let mmio = Arc::new(Bus::new());
        let out = open_serial(serial)?;
        let serial = match out {
            Some(out) => {
                let evt =
                    EventFd::new(libc::EFD_NONBLOCK).map_err(|source| DeviceError::EventFd {
                        what: "serial IRQ",
                        source,
                    })?;
                vm.register_irqfd(&evt, SERIAL_IRQ)
                    .map_err(|source| DeviceError::Irqfd {
                        gsi: SERIAL_IRQ,
                        source,
                    })?;
                let dev = Arc::new(Mutex::new(SerialDevice::new(evt, out)));
                pio.insert(dev.clone(), SERIAL_PORT, 8)
                    .map_err(|source| DeviceError::Bus {
                        what: "COM1",
                        source,
                    })?;
                Some(dev)
            }
            None => None,
        };
        pio.insert(
            Arc::new(Mutex::new(DebugExit::new(exit))),
            DEBUG_EXIT_PORT,
            4,
        )
        .map_err(|source| DeviceError::Bus {
            what: "debug exit port",
            source,
        })?;
        let buses = root_buses(numa_nodes);
        let specs: Vec<pci::SwitchSpec> = switches
            .iter()
            .map(|s| pci::SwitchSpec {
                root: s.root,
                ports: s.ports,
            })
            .collect();
        let layout = pci::BusLayout::new(buses, &specs, pci_slots.clamp(1, MAX_DEVICE_SLOTS))
            .map_err(|source| TopologyError::Layout {
                lenders: switches
                    .iter()
                    .map(|s| s.lender.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                source,
            })?;
        // Each root bus's windows, split with its switches (bus indexes past the roots).
        let mut windows = vec![[(0u64, 0u64); 3]; layout.entries().len()];
        for root in 0..buses {
            let whole = pci::device::root_bus_windows(root, buses, mmio64);
            let own: Vec<u8> = layout.switches_of(root).map(|(i, _)| i).collect();
            let (keep, parts) = pci::device::switch_windows(whole, own.len());
            windows[usize::from(root)] = keep;
            for (i, part) in own.iter().zip(parts) {
                windows[usize::from(*i)] = part;
            }
        }
        let allocators = windows
            .iter()
            .enumerate()
            .map(|(i, [io, m32, m64])| {
                if i < usize::from(buses) {
                    PciBarAllocators::new(*io, *m32, *m64)
                } else {
                    PciBarAllocators::behind_bridge(*io, *m32, *m64)
                }
                .map(|a| Arc::new(Mutex::new(a)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let ranges: BarRanges = Arc::default();
        let pci_bus = Arc::new(PciBus::with_layout(
            Arc::new(BarRelocator {
                ranges: ranges.clone(),
                mmio64,
                layout: layout.clone(),
            }),
            pci_slots,
            layout.clone(),
        ));
        // The switches' bridges, in their root buses' lowest slots.
        let mut placed = Vec::with_capacity(switches.len());
        for ((index, entry), s) in layout.switches().zip(switches) {
            let pci::BusKind::Switch {
                root, bridge_slot, ..
            } = entry.kind
            else {
                continue;
            };
            let [io, mem32, pref64] = windows[usize::from(index)];
            let primary = layout.entry(root).map_or(0, |e| e.number);
            let bridge = pci::bridge::PciBridge::new(
                primary,
                entry.number,
                pci::bridge::BridgeWindows { io, mem32, pref64 },
            );
            pci_bus
                .add_device(Some(bridge_slot), Arc::new(Mutex::new(bridge)))
                .map_err(|source| TopologyError::Bridge {
                    lender: s.lender.clone(),
                    source,
                })?;
            log::info!(
                "pci: switch of lender {} at {} (bus {:02x}, {} ports): windows {io:x?} \
                 {mem32:x?} {pref64:x?}",
                s.lender,
                pci_bus.bdf_of(bridge_slot),
                entry.number,
                s.ports
            );
            placed.push((s.clone(), index));
        }
        pio.insert(
            Arc::new(Mutex::new(PciConfigIo::new(pci_bus.clone()))),
            PCI_CONFIG_IO_PORT,
            PCI_CONFIG_IO_PORT_SIZE,
        )
        .map_err(|source| DeviceError::Bus {
            what: "PCI config ports",
            source,
        })?;
        mmio.insert(
            Arc::new(Mutex::new(PciConfigMmio::new(pci_bus.clone()))),
            PCI_ECAM_START,
            PCI_ECAM_SIZE,
        )
        .map_err(|source| DeviceError::Bus {
            what: "PCI ECAM",
            source,
        })?;
        Ok(Self {
            pio,
            mmio,
            serial,
            pci_bus,
            allocators,
            windows,
            switches: placed,
            numa_nodes,
            mmio64,
            ranges,
        })
    }

    /// The switch bus (its index) of `lender`'s devices on root bus `root`, if it has one.
    pub fn switch_for(&self, lender: &str, root: u8) -> Option<u8> {
        self.switches
            .iter()
            .find(|(s, _)| s.lender == lender && s.root == root)
            .map(|(_, i)| *i)
    }

    /// The switches made at launch.
    pub fn switches(&self) -> impl Iterator<Item = &LenderSwitch> {
        self.switches.iter().map(|(s, _)| s)
    }

    /// The switches as `vm.info` reports them: lender, bridge address, bus, ports.
    pub fn switch_info(&self) -> Vec<api::types::SwitchInfo> {
        let layout = self.pci_bus.layout();
        self.switches
            .iter()
            .filter_map(|(s, index)| {
                let e = layout.entry(*index)?;
                let pci::BusKind::Switch { bridge_slot, .. } = e.kind else {
                    return None;
                };
                Some(api::types::SwitchInfo {
                    lender: s.lender.clone(),
                    bridge: self.pci_bus.bdf_of(bridge_slot).to_string(),
                    bus: e.number,
                    ports: s.ports,
                })
            })
            .collect()
    }

    /// The whole 64-bit BAR window, `(base, size)`.
    pub fn mmio64(&self) -> (u64, u64) {
        self.mmio64
    }

    /// Bus index `bus`'s windows, `[io, mmio32, mmio64]`: what its devices' BARs come from.
    pub fn bus_windows(&self, bus: u8) -> Option<[(u64, u64); 3]> {
        self.windows.get(usize::from(bus)).copied()
    }

    /// The root buses (bus 0 and one per NUMA node with a number below [`MAX_ROOT_BUSES`]).
    pub fn pci_bus(&self) -> &Arc<PciBus> {
        &self.pci_bus
    }

    /// Bus 0's BAR allocators (I/O, 32-bit and 64-bit MMIO windows).
    pub fn bar_allocators(&self) -> &SharedBarAllocators {
        &self.allocators[0]
    }

    /// Root bus `bus`'s windows, `[io, mmio32, mmio64]` (see
    /// [`pci::device::root_bus_windows`]).
    pub fn root_bus_windows(&self, bus: u8) -> [(u64, u64); 3] {
        pci::device::root_bus_windows(bus, self.pci_bus.buses(), self.mmio64)
    }

    /// The root bus of NUMA node `node` (`numa_node=`): node `n` is on bus `n`.
    pub fn bus_of_node(&self, node: u32) -> Result<u8, NodeError> {
        if self.numa_nodes == 0 {
            return Err(NodeError::NoNuma(node));
        }
        if node as usize >= self.numa_nodes {
            return Err(NodeError::NoSuchNode {
                node,
                nodes: self.numa_nodes,
            });
        }
        u8::try_from(node)
            .ok()
            .filter(|&b| b < self.pci_bus.buses())
            .ok_or(NodeError::NoRootBus(node))
    }

    /// Gives `device` its BARs, puts them on the buses and plugs it into `slot` (or the lowest
    /// free one). On failure the bus ranges placed so far are dropped (removed); the BAR
    /// reservations stay with the device and go when the caller drops it.
    pub fn add_pci_device(
        &self,
        device: SharedPciDevice,
        slot: Option<u8>,
    ) -> Result<PciBdf, DeviceError> {
        let slot = match slot {
            Some(s) => s,
            None => self
                .pci_bus
                .next_free_slot()
                .ok_or(PciRootError::NoFreeSlot(self.pci_bus.slots()))?,
        };
        self.pci_bus.check_slot(slot)?;
        if self.pci_bus.device(slot).is_some() {
            return Err(PciRootError::SlotInUse(slot).into());
        }
        let allocators = self
            .allocators
            .get(usize::from(pci::root::slot_bus(slot)))
            .ok_or(PciRootError::NoSuchBus {
                slot,
                bus: pci::root::slot_bus(slot),
                buses: self.pci_bus.buses(),
            })?;
        let bars = device
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .allocate_bars(allocators)
            .map_err(|e| match e {
                PciDeviceError::BarAllocation {
                    region_type: PciBarRegionType::Memory64,
                    size,
                    window_base,
                    window_size,
                    taken,
                    source,
                } => DeviceError::Mmio64Full {
                    size,
                    base: window_base,
                    window: window_size,
                    taken,
                    source,
                },
                e => e.into(),
            })?;
        let mut placed: Vec<(usize, BusRange)> = Vec::with_capacity(bars.len());
        for bar in &bars {
            let dev = Arc::new(Mutex::new(BarBusDevice {
                device: device.clone(),
            }));
            let range = self
                .bus_for(bar.region_type)
                .insert_range(dev, bar.addr, bar.size)
                .map_err(|source| DeviceError::Bus {
                    what: "a PCI BAR",
                    source,
                })?;
            placed.push((bar.idx, range));
        }
        let bdf = self.pci_bus.add_device(Some(slot), device)?;
        self.ranges
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(slot, placed);
        Ok(bdf)
    }

    /// Unplugs the device in `slot`: its BAR ranges leave the buses here; its BAR
    /// reservations are freed when the returned device is dropped.
    pub fn remove_pci_device(&self, slot: u8) -> Result<SharedPciDevice, DeviceError> {
        let device = self.pci_bus.remove_device(slot)?;
        let ranges = self
            .ranges
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&slot);
        drop(ranges);
        Ok(device)
    }

    fn bus_for(&self, t: PciBarRegionType) -> &Arc<Bus> {
        if t == PciBarRegionType::Io {
            &self.pio
        } else {
            &self.mmio
        }
    }

    /// The port I/O bus.
    pub fn pio_bus(&self) -> &Arc<Bus> {
        &self.pio
    }

    /// The MMIO bus (guest-physical addresses not backed by a memslot).
    pub fn mmio_bus(&self) -> &Arc<Bus> {
        &self.mmio
    }

    /// COM1, if the VM has one (`--serial off` has none); its state goes into snapshots.
    pub fn serial(&self) -> Option<&Arc<Mutex<SerialDevice>>> {
        self.serial.as_ref()
    }

    /// Writes out buffered serial output.
    pub fn flush_serial(&self) {
        if let Some(s) = &self.serial {
            s.lock().unwrap_or_else(|e| e.into_inner()).flush();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pci::device::{BarAllocation, BarRequest, ConfigWriteEffects};
    use pci::{PciBarConfiguration, PciConfiguration, PciConfigurationParams};
    use std::any::Any;

    struct TestDev {
        config: PciConfiguration,
        bar: Vec<BarAllocation>,
    }

    impl PciDevice for TestDev {
        fn allocate_bars(
            &mut self,
            alloc: &SharedBarAllocators,
        ) -> Result<Vec<PciBarConfiguration>, PciDeviceError> {
            let bar = BarAllocation::allocate(
                alloc,
                &BarRequest {
                    idx: 0,
                    size: 0x4000,
                    region_type: PciBarRegionType::Memory32,
                    prefetchable: false,
                },
            )?;
            let config = bar.config();
            self.config.add_pci_bar(&config)?;
            self.bar = vec![bar];
            Ok(vec![config])
        }
        fn bar_allocations(&mut self) -> &mut [BarAllocation] {
            &mut self.bar
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
        fn read_bar(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8 ^ 0xa5);
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn Any {
            self
        }
    }

    fn test_dev() -> SharedPciDevice {
        Arc::new(Mutex::new(TestDev {
            config: PciConfiguration::new(&PciConfigurationParams {
                vendor_id: 0x1b36,
                device_id: 0x0010,
                ..Default::default()
            }),
            bar: Vec::new(),
        }))
    }

    /// A console file is emptied at start and then only appended to: what another writer
    /// (the VM this one took over from, or the one that took it over) appended meanwhile
    /// is never overwritten.
    #[test]
    fn a_console_file_is_emptied_then_only_appended_to() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        std::fs::write(&path, "old run\n").unwrap();
        let mut ours = open_serial(&SerialConfig::File(path.clone()))
            .unwrap()
            .unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
        ours.write_all(b"TICK 1\n").unwrap();
        let mut other = open_serial(&SerialConfig::Append(path.clone()))
            .unwrap()
            .unwrap();
        other.write_all(b"TICK 2\n").unwrap();
        ours.write_all(b"TICK 3\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "TICK 1\nTICK 2\nTICK 3\n"
        );
        let bad = dir.path().join("no/such/dir/console.log");
        let e = open_serial(&SerialConfig::File(bad)).err().unwrap();
        assert!(e.to_string().contains("no/such/dir"), "{e}");
    }

    /// A device manager on `vm` without a serial port.
    fn test_dm(vm: &VmFd, mmio64: (u64, u64), slots: u8, numa_nodes: usize) -> DeviceManager {
        DeviceManager::new(
            vm,
            &SerialConfig::Off,
            Arc::new(ExitNotifier::new()),
            mmio64,
            slots,
            numa_nodes,
            &[],
        )
        .unwrap()
    }

    fn switch(lender: &str, root: u8, ports: u8) -> LenderSwitch {
        LenderSwitch {
            lender: lender.into(),
            root,
            ports,
        }
    }

    #[test]
    fn switches_go_to_lenders_with_two_launch_devices_on_one_root_bus() {
        let d = |l: &str, r: u8| (l.to_string(), r);
        let plan = plan_switches(
            &[
                d("a", 0),
                d("b", 0),
                d("a", 0),
                d("c", 1),
                d("a", 1),
                d("c", 1),
                d("a", 0),
            ],
            2,
        );
        // a: three on bus 0 (a switch of 3 + 2 ports), one on bus 1 (none); b: one (none);
        // c: two on bus 1.
        assert_eq!(plan, vec![switch("a", 0, 5), switch("c", 1, 4)]);
        // Eight buses in all: with 7 root buses one switch fits, and the second lender's
        // devices stay on their root bus.
        let plan = plan_switches(&[d("a", 0), d("a", 0), d("b", 0), d("b", 0)], 7);
        assert_eq!(plan, vec![switch("a", 0, 4)]);
        assert!(plan_switches(&[d("a", 0), d("a", 0)], 8).is_empty());
        // 31 devices of one lender: 32 ports at most.
        let many: Vec<_> = (0..31).map(|_| d("a", 0)).collect();
        assert_eq!(plan_switches(&many, 1), vec![switch("a", 0, 32)]);
    }

    #[test]
    fn a_switch_holds_a_slot_a_bus_number_and_a_part_of_its_root_buses_windows() {
        let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm is required by the vmm tests");
        let vm = kvm.create_vm().unwrap();
        let mmio64 = (1 << 40, 1 << 40);
        // Two NUMA nodes; lender a's switch on node 0's root bus, lender b's on node 1's.
        let dm = DeviceManager::new(
            &vm,
            &SerialConfig::Off,
            Arc::new(ExitNotifier::new()),
            mmio64,
            4,
            2,
            &[switch("a", 0, 3), switch("b", 1, 2)],
        )
        .unwrap();
        let bus = dm.pci_bus();
        // Indexes: roots 0 and 1, switches 2 (a) and 3 (b); numbers 0, 2, 1, 3.
        assert_eq!(
            (dm.switch_for("a", 0), dm.switch_for("b", 1)),
            (Some(2), Some(3))
        );
        assert_eq!((dm.switch_for("a", 1), dm.switch_for("c", 0)), (None, None));
        let info: Vec<String> = dm
            .switch_info()
            .iter()
            .map(|s| format!("{} {} {} {}", s.lender, s.bridge, s.bus, s.ports))
            .collect();
        assert_eq!(info, ["a 0000:00:01.0 1 3", "b 0000:02:01.0 3 2"]);
        // The bridges: type 1 headers in their root buses' slot 1, bus numbers as laid out.
        let cfg = |b: u8, d: u8, reg: usize| bus.read_config(PciBdf::new(b, d, 0), reg);
        assert_eq!(cfg(0, 1, 0), 0x0001_1b36);
        assert_eq!(cfg(0, 1, 6) & 0xff_ffff, 0x01_0100);
        assert_eq!(cfg(2, 1, 6) & 0xff_ffff, 0x03_0302);
        // A device behind a's switch: bus 1 (index 2), port 0; its BAR in the switch's part
        // of the windows, which the bridge's memory window says.
        let bdf = dm
            .add_pci_device(test_dev(), Some(pci::root::slot_number(2, 0)))
            .unwrap();
        assert_eq!(bdf.to_string(), "0000:01:00.0");
        assert_eq!(cfg(1, 0, 0), 0x0010_1b36, "config cycles to bus 1 reach it");
        let bar = u64::from(cfg(1, 0, 4) & !0xf);
        let [_, m32, _] = dm.bus_windows(2).unwrap();
        let mem = cfg(0, 1, 8);
        let (base, last) = (
            u64::from(mem & 0xfff0) << 16,
            (u64::from(mem >> 16 & 0xfff0) << 16) | 0xf_ffff,
        );
        assert_eq!((base, last + 1 - base), m32);
        assert!(
            bar >= base && bar + 0x4000 <= last + 1,
            "{bar:#x} in {base:#x}..{last:#x}"
        );
        // Node 0's root bus keeps the rest: a device there gets none of the switch's part.
        let bdf0 = dm.add_pci_device(test_dev(), Some(2)).unwrap();
        assert_eq!(bdf0.to_string(), "0000:00:02.0");
        let bar0 = u64::from(cfg(0, 2, 4) & !0xf);
        let [_, keep, _] = dm.bus_windows(0).unwrap();
        assert!(bar0 >= keep.0 && bar0 < keep.0 + keep.1 && !(base..=last).contains(&bar0));
        // Node 1's root bus is bus 2, its switch bus 3.
        let bdf1 = dm
            .add_pci_device(test_dev(), Some(pci::root::slot_number(3, 1)))
            .unwrap();
        assert_eq!(bdf1.to_string(), "0000:03:01.0");
        let bdf2 = dm
            .add_pci_device(test_dev(), Some(pci::root::slot_number(1, 3)))
            .unwrap();
        assert_eq!(bdf2.to_string(), "0000:02:03.0");
        // Guest BAR moves find each function's ranges by its bus number: behind the switch
        // (bus 1 = index 2) and on node 1's root bus (bus 2 = index 1).
        let refused = bus.refused_bar_moves();
        for (b, d) in [(1u8, 0u8), (2, 3)] {
            let at = PciBdf::new(b, d, 0);
            let old = u64::from(bus.read_config(at, 4) & !0xf);
            let new = old + 0x10000;
            bus.write_config(at, 4, 0, &(new as u32).to_le_bytes());
            assert_eq!(u64::from(bus.read_config(at, 4) & !0xf), new, "{at}");
            let mut byte = [0u8; 1];
            dm.mmio_bus().read(new, &mut byte).unwrap();
            assert_eq!(byte[0], 0xa5, "{at}: the bar answers at its new address");
        }
        assert_eq!(bus.refused_bar_moves(), refused);
        // A switch has its ports only; the bridge's slot is taken.
        assert!(matches!(
            dm.add_pci_device(test_dev(), Some(pci::root::slot_number(3, 2))),
            Err(DeviceError::Slot(PciRootError::NoSuchPort {
                port: 2,
                ports: 2,
                ..
            }))
        ));
        assert!(matches!(
            dm.add_pci_device(test_dev(), Some(1)),
            Err(DeviceError::Slot(PciRootError::SlotInUse(1)))
        ));
        assert_eq!(bus.next_free_slot_on(2), Some(pci::root::slot_number(2, 1)));
        // Removing the device behind the switch frees its port.
        dm.remove_pci_device(pci::root::slot_number(2, 0)).unwrap();
        assert_eq!(cfg(1, 0, 0), u32::MAX);
        assert_eq!(bus.next_free_slot_on(2), Some(pci::root::slot_number(2, 0)));
    }

    #[test]
    fn a_layout_that_cannot_be_made_is_refused_naming_the_lenders() {
        let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm is required by the vmm tests");
        let vm = kvm.create_vm().unwrap();
        let e = DeviceManager::new(
            &vm,
            &SerialConfig::Off,
            Arc::new(ExitNotifier::new()),
            (1 << 40, 1 << 40),
            4,
            0,
            &[switch("a", 1, 3)],
        )
        .err()
        .unwrap();
        let text = format!(
            "{e}: {}",
            std::error::Error::source(&e)
                .map(|s| s.to_string())
                .unwrap_or_default()
        );
        assert!(text.contains("lenders a"), "{text}");
    }

    #[test]
    fn numa_nodes_get_a_root_bus_each_up_to_the_limit() {
        let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm is required by the vmm tests");
        let vm = kvm.create_vm().unwrap();
        let dm = test_dm(&vm, (1 << 40, 1 << 40), 4, 10);
        assert_eq!(dm.pci_bus().buses(), MAX_ROOT_BUSES);
        assert_eq!(dm.bus_of_node(0), Ok(0));
        assert_eq!(dm.bus_of_node(7), Ok(7));
        let e = dm.bus_of_node(9).unwrap_err();
        assert_eq!(e, NodeError::NoRootBus(9));
        assert!(e.to_string().contains("nodes 0 to 7"), "{e}");
        let e = dm.bus_of_node(10).unwrap_err().to_string();
        assert!(e.contains("NUMA nodes 0 to 9"), "{e}");
        // A device on bus 7 gets its BARs from bus 7's windows.
        let bdf = dm
            .add_pci_device(test_dev(), Some(pci::root::slot_number(7, 2)))
            .unwrap();
        assert_eq!(bdf.to_string(), "0000:07:02.0");
        let [_, m32, m64] = dm.root_bus_windows(7);
        let dev = dm.pci_bus().device(pci::root::slot_number(7, 2)).unwrap();
        let bars: Vec<u64> = dev
            .lock()
            .unwrap()
            .bar_allocations()
            .iter()
            .map(|a| a.base())
            .collect();
        assert!(!bars.is_empty());
        for b in bars {
            assert!(
                [m32, m64].iter().any(|&(w, z)| b >= w && b < w + z),
                "bar at {b:#x} outside bus 7's {m32:x?} {m64:x?}"
            );
        }
    }

    /// Hot-add and remove a device through the hooks other crates use (skips without KVM).
    #[test]
    fn add_and_remove_pci_device() {
        let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm is required by the vmm tests");
        let vm = kvm.create_vm().unwrap();
        let dm = test_dm(
            &vm,
            (1 << 32, PCI_MMIO64_SIZE),
            pci::root::MAX_DEVICE_SLOTS,
            0,
        );
        let ranges = dm.mmio_bus().len();
        let bdf = dm.add_pci_device(test_dev(), None).unwrap();
        assert_eq!((bdf.bus(), bdf.device(), bdf.function()), (0, 1, 0));
        // Config space through ECAM, as the guest sees it.
        let mut id = [0u8; 4];
        dm.mmio_bus()
            .read(PCI_ECAM_START | (1 << 15), &mut id)
            .unwrap();
        assert_eq!(u32::from_le_bytes(id), 0x0010_1b36);
        let mut bar0 = [0u8; 4];
        dm.mmio_bus()
            .read(PCI_ECAM_START | (1 << 15) | 0x10, &mut bar0)
            .unwrap();
        let base = u64::from(u32::from_le_bytes(bar0) & !0xf);
        assert_eq!(base, crate::layout::PCI_MMIO32_START);
        let mut b = [0u8; 1];
        dm.mmio_bus().read(base + 3, &mut b).unwrap();
        assert_eq!(b[0], 3 ^ 0xa5, "BAR access reaches read_bar");
        assert!(
            dm.add_pci_device(test_dev(), Some(1)).is_err(),
            "slot in use"
        );
        assert!(
            dm.add_pci_device(test_dev(), Some(0)).is_err(),
            "host bridge slot"
        );
        dm.remove_pci_device(1).unwrap();
        assert_eq!(dm.mmio_bus().len(), ranges, "BAR range removed");
        assert!(
            dm.remove_pci_device(1).is_err(),
            "double remove is an error"
        );
        // The BAR window was freed: the next device gets the same address.
        dm.add_pci_device(test_dev(), Some(2)).unwrap();
        let mut bar0 = [0u8; 4];
        dm.mmio_bus()
            .read(PCI_ECAM_START | (2 << 15) | 0x10, &mut bar0)
            .unwrap();
        assert_eq!(u64::from(u32::from_le_bytes(bar0) & !0xf), base);
    }

    /// A guest writes BAR addresses over RAM, over the ECAM / LAPIC, over another device's
    /// BAR and outside every window: each move is refused and the BAR keeps decoding where it
    /// was; a later valid move still works (it used to be looked up by the refused address
    /// and fail for good), and removal frees the range the BAR really occupies.
    #[test]
    fn bar_moves_outside_the_windows_or_over_other_bars_are_refused() {
        let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm is required by the vmm tests");
        let vm = kvm.create_vm().unwrap();
        let dm = test_dm(
            &vm,
            (1 << 32, PCI_MMIO64_SIZE),
            pci::root::MAX_DEVICE_SLOTS,
            0,
        );
        let ranges = dm.mmio_bus().len();
        dm.add_pci_device(test_dev(), Some(1)).unwrap();
        dm.add_pci_device(test_dev(), Some(2)).unwrap();
        let cfg = |slot: u64, off: u64| PCI_ECAM_START | (slot << 15) | off;
        let bar = |slot: u64| {
            let mut b = [0u8; 4];
            dm.mmio_bus().read(cfg(slot, 0x10), &mut b).unwrap();
            u64::from(u32::from_le_bytes(b) & !0xf)
        };
        let set_bar = |slot: u64, addr: u32| {
            dm.mmio_bus()
                .write(cfg(slot, 0x10), &addr.to_le_bytes())
                .unwrap();
        };
        // Reaches slot 1's read_bar at `addr`.
        let decodes = |addr: u64| {
            let mut b = [0u8; 1];
            dm.mmio_bus().read(addr + 3, &mut b).is_ok() && b[0] == 3 ^ 0xa5
        };
        let (one, two) = (bar(1), bar(2));
        assert_ne!(one, two);
        let refused = dm.pci_bus().refused_bar_moves();
        for bad in [
            0x10_0000u32,          // guest RAM
            0x0u32,                // address 0
            PCI_ECAM_START as u32, // ECAM
            0xfee0_0000,           // LAPIC / MSI window
            0xfec0_0000,           // IOAPIC
            two as u32,            // the other device's BAR
            0xf000_0000,           // between the ECAM and the platform devices
        ] {
            set_bar(1, bad);
            assert!(decodes(one), "bar left its place for {bad:#x}");
            if bad as u64 != two {
                let mut b = [0u8; 1];
                assert!(
                    dm.mmio_bus().read(u64::from(bad) + 3, &mut b).is_err() || b[0] != 3 ^ 0xa5,
                    "slot 1 decodes at {bad:#x}"
                );
            }
        }
        assert_eq!(dm.pci_bus().refused_bar_moves(), refused + 7);
        // A valid move after the refused ones: from where the BAR really is.
        let free = (crate::layout::PCI_MMIO32_START + 0x100_0000) as u32;
        set_bar(1, free);
        assert!(decodes(u64::from(free)), "valid move after refusals");
        assert!(!decodes(one));
        // And back, then removal frees exactly what is on the bus.
        set_bar(1, 0x10_0000);
        set_bar(1, one as u32);
        assert!(decodes(one));
        dm.remove_pci_device(1).unwrap();
        dm.remove_pci_device(2).unwrap();
        assert_eq!(dm.mmio_bus().len(), ranges, "bar ranges removed");
        // Both windows were freed: new devices get the first two addresses again.
        dm.add_pci_device(test_dev(), Some(3)).unwrap();
        dm.add_pci_device(test_dev(), Some(4)).unwrap();
        assert_eq!((bar(3), bar(4)), (one, two));
    }

    /// Guest BAR moves and unplugs through the real relocator: after many cycles every
    /// range is back (the whole 32-bit window can be reserved in one piece), nothing is
    /// left on the MMIO bus, and no range was freed twice (a double free would error).
    #[test]
    fn bar_moves_and_unplugs_return_every_range() {
        let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm is required by the vmm tests");
        let vm = kvm.create_vm().unwrap();
        let dm = test_dm(
            &vm,
            (1 << 32, PCI_MMIO64_SIZE),
            pci::root::MAX_DEVICE_SLOTS,
            0,
        );
        let ranges = dm.mmio_bus().len();
        let bar0 = |slot: u8| PCI_ECAM_START | u64::from(slot) << 15 | 0x10;
        for cycle in 0..50u64 {
            let dev = test_dev();
            let bdf = dm.add_pci_device(dev.clone(), None).unwrap();
            let base = {
                let mut b = [0u8; 4];
                dm.mmio_bus().read(bar0(bdf.device()), &mut b).unwrap();
                u64::from(u32::from_le_bytes(b) & !0xf)
            };
            // The guest moves BAR0 up; the old address is free at once.
            let new = base + 0x10_0000 + cycle * 0x4000;
            dm.mmio_bus()
                .write(bar0(bdf.device()), &(new as u32).to_le_bytes())
                .unwrap();
            let mut b = [0u8; 1];
            dm.mmio_bus().read(new + 1, &mut b).unwrap();
            assert_eq!(
                b[0],
                1 ^ 0xa5,
                "cycle {cycle}: bar answers at its new address"
            );
            assert!(dm.mmio_bus().read(base + 1, &mut b).is_err());
            let probe = BarAllocation::allocate(
                dm.bar_allocators(),
                &BarRequest {
                    idx: 0,
                    size: 0x4000,
                    region_type: PciBarRegionType::Memory32,
                    prefetchable: false,
                },
            )
            .unwrap();
            assert_eq!(
                probe.base(),
                base,
                "cycle {cycle}: old range freed by the move"
            );
            drop(probe);
            let removed = dm.remove_pci_device(bdf.device()).unwrap();
            assert_eq!(dm.mmio_bus().len(), ranges, "cycle {cycle}: bus range left");
            drop(removed);
            drop(dev);
        }
        let whole = BarAllocation::allocate(
            dm.bar_allocators(),
            &BarRequest {
                idx: 0,
                size: crate::layout::PCI_MMIO32_SIZE,
                region_type: PciBarRegionType::Memory32,
                prefetchable: false,
            },
        )
        .expect("a bar reservation leaked");
        assert_eq!(whole.base(), crate::layout::PCI_MMIO32_START);
    }
}
