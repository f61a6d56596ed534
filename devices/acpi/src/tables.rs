//! ACPI tables for an x86_64 guest: RSDP, XSDT, FADT (hardware-reduced), MADT, MCFG, DSDT,
//! and, for a guest with NUMA nodes ([`AcpiConfig::numa`]), SRAT and SLIT.
//!
//! [`create_acpi_tables`] builds every table for an [`AcpiConfig`] and returns them with their
//! guest physical addresses ([`AcpiTables`]); [`AcpiTables::write_to`] hands each blob to a
//! closure `write(gpa, bytes)`, so this crate needs no guest-memory dependency. The RSDP sits
//! at [`ACPI_TABLES_START`] (0xE_0000) where Linux's BIOS-area scan finds it; the VMM may also
//! put [`AcpiTables::rsdp_addr`] into `boot_params.acpi_rsdp_addr`.
//!
//! The DSDT describes `\_SB_.PCI0` (ECAM host bridge with hotpluggable slots `S00_`..`S31_`,
//! or fewer: [`AcpiConfig::pci_slots`],
//! `PCNT`/`PCEJ`/`DVNT` methods over the hotplug controller registers), `\_SB_.MBRD`
//! (motherboard resources: ECAM, GED and hotplug MMIO, so the OS reserves them), `\_SB_.GED_`
//! (`ACPI0013`, `_EVT` → `\_SB_.PCI0.PCNT`), `\_SB_.COM1` and `\_S5_`.
//!
//! The GED's `_CRS` holds only its interrupt: Linux's GED driver (`drivers/acpi/evged.c`) fails
//! to probe when `_CRS` contains any non-interrupt resource, so the GED MMIO range is reserved by
//! `\_SB_.MBRD` and accessed through the GED's `OperationRegion`.

use acpi_tables::aml::{
    self, AddressSpace, AddressSpaceCacheable, Device, EISAName, Field, FieldAccessType,
    FieldEntry, FieldLockRule, FieldUpdateRule, Interrupt, Memory32Fixed, Method, MethodCall, Name,
    OpRegion, OpRegionSpace, Package, Path, ResourceTemplate, IO,
};
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::madt::{EnabledStatus, IoApic, ProcessorLocalApic};
use acpi_tables::mcfg::MCFG;
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::slit::SLIT;
use acpi_tables::srat::MemoryAffinity;
use acpi_tables::xsdt::XSDT;
use acpi_tables::Aml;

use crate::ged::{GED_EVENT_PCI_HOTPLUG, GED_GSI, GED_SIZE, GED_START};
use crate::hotplug::{PCI_HOTPLUG_SIZE, PCI_HOTPLUG_SLOTS, PCI_HOTPLUG_START};

/// Guest physical address of the RSDP; the other tables follow it.
pub const ACPI_TABLES_START: u64 = 0xe_0000;
/// End (exclusive) of the area the tables may use (start of the 1 MiB kernel area).
pub const ACPI_TABLES_END: u64 = 0x10_0000;

const OEM_ID: [u8; 6] = *b"LENDVM";
const OEM_REVISION: u32 = 1;
/// Largest vCPU count representable with xAPIC ids (0xff is the broadcast id).
pub const MAX_VCPUS: u32 = 254;

/// UUID of the PCI Host Bridge `_OSC` interface.
const PCI_HOST_BRIDGE_OSC_UUID: &str = "33DB4D5B-1FF7-401C-9657-7441C03DD766";
/// `_OSC` control bits granted to the OS: PME (2), AER (3), PCIe capability (4).
/// Native PCIe hotplug (0) and SHPC hotplug (1) stay with the firmware: we use ACPI hotplug.
const OSC_GRANTED_CONTROL: u8 = 0x1c;

/// FADT IA-PC boot architecture flags.
const IAPC_BOOT_ARCH_NO_VGA: u16 = 1 << 2;
const IAPC_BOOT_ARCH_NO_ASPM: u16 = 1 << 4;
const IAPC_BOOT_ARCH_NO_CMOS_RTC: u16 = 1 << 5;

/// MADT flag: the platform also has dual 8259 PICs (KVM's in-kernel irqchip does).
const MADT_PCAT_COMPAT: u32 = 1;

/// Errors from building the tables.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AcpiTableError {
    #[error("vcpu count {0} is out of range (1..={MAX_VCPUS})")]
    VcpuCount(u32),
    #[error("pci bus range {start}..={end} is empty")]
    BusRange { start: u8, end: u8 },
    #[error("pci window {base:#x}+{size:#x} is empty or does not fit its address width")]
    Window { base: u64, size: u64 },
    #[error("ecam base {0:#x} is not 1 MiB aligned or not below 4 GiB")]
    Ecam(u64),
    #[error("platform mmio address {0:#x} is not below 4 GiB")]
    PlatformMmio(u64),
    #[error("{0} pci slots for devices: a root bus has 1 to 31 (slot 0 is the host bridge's)")]
    PciSlots(u8),
    #[error("acpi tables end at {end:#x}, past the limit {limit:#x}")]
    TooLarge { end: u64, limit: u64 },
    #[error("numa node {node}: {what}")]
    Numa { node: usize, what: String },
    #[error("root bus {bus}: {what}")]
    RootBus { bus: u8, what: String },
    #[error("vcpu {0} is in no numa node")]
    NumaCpu(usize),
    #[error("{0} numa nodes: at most {MAX_NUMA_NODES}")]
    NumaNodes(usize),
}

/// Most NUMA nodes a guest may have (Linux's default `CONFIG_NODES_SHIFT` of 6 on x86_64).
pub const MAX_NUMA_NODES: usize = 64;

/// The local distance of SLIT (a node to itself), and the range of the others
/// (255 is "unreachable").
pub const NUMA_LOCAL_DISTANCE: u8 = 10;
pub const NUMA_MAX_DISTANCE: u8 = 254;

/// One NUMA node of the guest: proximity domain `i` of SRAT for `numa[i]`, row `i` of SLIT.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NumaNode {
    /// Its vCPUs (their local APIC ids).
    pub cpus: Vec<u32>,
    /// Its RAM, as (guest physical base, length) ranges.
    pub memory: Vec<(u64, u64)>,
    /// Its distance to every node, indexed by node ([`NUMA_LOCAL_DISTANCE`] to itself).
    pub distances: Vec<u8>,
}

/// A root bus of its own for one NUMA node's devices: a host bridge `\_SB_.PCnn` in the
/// DSDT with `_BBN` and `_PXM` (x86 Linux gives a PCI function its root bus's node), its
/// slots and their hot-plug methods (the controller's PSEG selects the bus).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootBus {
    /// Its bus number, 1 to [`crate::hotplug::PCI_HOTPLUG_BUSES`] - 1 (`_BBN`).
    pub bus: u8,
    /// Its bus index (`\_SB_.PCnn`, `_UID`, the hot-plug controller's PSEG): its number
    /// unless switches sit on root buses before it.
    pub index: u8,
    /// The last bus number under it (its switches'), the end of its `_CRS` bus range.
    pub last_bus: u8,
    /// The proximity domain of its devices (`_PXM`): an index of [`AcpiConfig::numa`].
    pub node: u32,
    /// Its slices of the I/O, 32-bit and 64-bit windows, `(base, size)` each (its `_CRS`);
    /// a size of 0 leaves that window out.
    pub io: (u64, u64),
    pub mmio32: (u64, u64),
    pub mmio64: (u64, u64),
}

/// A switch: a PCI-to-PCI bridge in slot `device` of root bus `root` (an index), its
/// secondary bus `number` with hot-plug slots 0..`ports`. In the DSDT the bridge's slot
/// device holds the slots and their hot-plug methods (PSEG = `index`), as QEMU describes
/// its bridges for ACPI hot-plug; acpiphp finds them under the bridge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Switch {
    pub index: u8,
    pub number: u8,
    pub root: u8,
    pub device: u8,
    pub ports: u8,
}

/// Inputs of the tables. [`AcpiConfig::default`] follows `docs/CONTRACTS.md`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcpiConfig {
    /// Number of vCPUs (LAPIC ids 0..n).
    pub num_vcpus: u32,
    /// PCI ECAM base (segment 0).
    pub ecam_base: u64,
    /// First and last PCI bus number decoded by the host bridge (and in MCFG). With
    /// [`AcpiConfig::root_buses`], `\_SB_.PCI0` decodes only `pci_bus_start` and MCFG reaches
    /// the last root bus.
    pub pci_bus_start: u8,
    pub pci_bus_end: u8,
    /// The I/O window of bus 0 (`_CRS` of `\_SB_.PCI0`).
    pub io_base: u16,
    pub io_size: u32,
    /// 32-bit PCI BAR window (bus 0's slice of it, with root buses).
    pub mmio32_base: u64,
    pub mmio32_size: u64,
    /// 64-bit PCI BAR window (bus 0's slice of it, with root buses); size 0 leaves it out.
    pub mmio64_base: u64,
    pub mmio64_size: u64,
    /// Root buses beyond bus 0, one per NUMA node that holds devices.
    pub root_buses: Vec<RootBus>,
    /// Switches on the root buses (bus 0's and the others').
    pub switches: Vec<Switch>,
    /// IOAPIC MMIO base, id and first GSI.
    pub ioapic_addr: u32,
    pub ioapic_id: u8,
    /// Local APIC MMIO base.
    pub lapic_addr: u32,
    /// GED MMIO base and GSI.
    pub ged_addr: u64,
    pub ged_gsi: u32,
    /// PCI hotplug controller MMIO base.
    pub hotplug_addr: u64,
    /// COM1 port and IRQ; `None` leaves the device out.
    pub serial: Option<(u16, u32)>,
    /// Whether a CMOS RTC is emulated at ports 0x70/0x71 (otherwise the FADT says none).
    pub cmos_rtc: bool,
    /// INTx routing: GSI for INTA..INTD of every slot (emits `_PRT`); `None` omits `_PRT`.
    pub pci_slot_gsis: Option<[u32; 32]>,
    /// The root bus's slots for devices, 1..=`pci_slots` (at most 31): slot devices (with
    /// `_EJ0`), `_PRT` entries and hot-plug notifications are described for slots
    /// 0..=`pci_slots` only. Each described slot costs a guest kernel some AML interpretation
    /// at boot (its namespace node, `_ADR`, `_SUN`, `_EJ0`, acpiphp's slot): about half a
    /// second each in an emulated guest, docs/linux-guest-on-pvm.md.
    pub pci_slots: u8,
    /// Where the tables go: RSDP at `tables_start`, all tables below `tables_end`.
    pub tables_start: u64,
    pub tables_end: u64,
    /// NUMA nodes; empty: no SRAT or SLIT (the guest sees one node). When given, every vCPU
    /// is in exactly one node and the distances form a symmetric matrix.
    pub numa: Vec<NumaNode>,
}

impl Default for AcpiConfig {
    fn default() -> Self {
        Self {
            num_vcpus: 1,
            ecam_base: 0xe000_0000,
            pci_bus_start: 0,
            pci_bus_end: 0,
            io_base: 0x1000,
            io_size: 0xf000,
            mmio32_base: 0xc000_0000,
            mmio32_size: 0x2000_0000,
            mmio64_base: 0,
            mmio64_size: 0,
            root_buses: Vec::new(),
            switches: Vec::new(),
            ioapic_addr: 0xfec0_0000,
            ioapic_id: 0,
            lapic_addr: 0xfee0_0000,
            ged_addr: GED_START,
            ged_gsi: GED_GSI,
            hotplug_addr: PCI_HOTPLUG_START,
            serial: Some((0x3f8, 4)),
            cmos_rtc: false,
            pci_slot_gsis: None,
            pci_slots: (PCI_HOTPLUG_SLOTS - 1) as u8,
            tables_start: ACPI_TABLES_START,
            tables_end: ACPI_TABLES_END,
            numa: Vec::new(),
        }
    }
}

impl AcpiConfig {
    fn validate(&self) -> Result<(), AcpiTableError> {
        if self.num_vcpus == 0 || self.num_vcpus > MAX_VCPUS {
            return Err(AcpiTableError::VcpuCount(self.num_vcpus));
        }
        if self.pci_bus_end < self.pci_bus_start {
            return Err(AcpiTableError::BusRange {
                start: self.pci_bus_start,
                end: self.pci_bus_end,
            });
        }
        if self.ecam_base & ((1 << 20) - 1) != 0 || self.ecam_end() > 1 << 32 {
            return Err(AcpiTableError::Ecam(self.ecam_base));
        }
        let end32 = self.mmio32_base.checked_add(self.mmio32_size);
        if self.mmio32_size == 0 || end32.is_none_or(|e| e > 1 << 32) {
            return Err(AcpiTableError::Window {
                base: self.mmio32_base,
                size: self.mmio32_size,
            });
        }
        for addr in [self.ged_addr, self.hotplug_addr] {
            if addr.saturating_add(PCI_HOTPLUG_SIZE) > 1 << 32 {
                return Err(AcpiTableError::PlatformMmio(addr));
            }
        }
        if self.mmio64_size != 0 && self.mmio64_base.checked_add(self.mmio64_size).is_none() {
            return Err(AcpiTableError::Window {
                base: self.mmio64_base,
                size: self.mmio64_size,
            });
        }
        if self.pci_slots == 0 || u32::from(self.pci_slots) >= PCI_HOTPLUG_SLOTS {
            return Err(AcpiTableError::PciSlots(self.pci_slots));
        }
        if self.io_size == 0 || u32::from(self.io_base) + self.io_size > 0x1_0000 {
            return Err(AcpiTableError::Window {
                base: u64::from(self.io_base),
                size: u64::from(self.io_size),
            });
        }
        self.validate_numa()?;
        for (i, r) in self.root_buses.iter().enumerate() {
            let bad = |what: String| Err(AcpiTableError::RootBus { bus: r.bus, what });
            if r.bus <= self.pci_bus_start
                || r.bus > self.pci_bus_end
                || u32::from(r.bus) >= crate::hotplug::PCI_HOTPLUG_BUSES
            {
                return bad(format!(
                    "bus number outside {}..={} (MCFG) or past the hot-plug controller's {} buses",
                    self.pci_bus_start + 1,
                    self.pci_bus_end,
                    crate::hotplug::PCI_HOTPLUG_BUSES
                ));
            }
            if self.root_buses[..i]
                .iter()
                .any(|o| o.bus == r.bus || o.index == r.index)
            {
                return bad("described twice".into());
            }
            if r.index == 0
                || u32::from(r.index) >= crate::hotplug::PCI_HOTPLUG_BUSES
                || r.last_bus < r.bus
                || r.last_bus > self.pci_bus_end
            {
                return bad(format!(
                    "index {} or last bus {} out of range",
                    r.index, r.last_bus
                ));
            }
            if r.node as usize >= self.numa.len() {
                return bad(format!(
                    "node {} does not exist ({} NUMA nodes)",
                    r.node,
                    self.numa.len()
                ));
            }
            let fits =
                |(b, z): (u64, u64), limit: u64| b.checked_add(z).is_some_and(|e| e <= limit);
            if !fits(r.io, 0x1_0000) || !fits(r.mmio32, 1 << 32) || !fits(r.mmio64, u64::MAX) {
                return bad("a window does not fit its address space".into());
            }
        }
        for w in &self.switches {
            let root_ok = w.root == 0 || self.root_buses.iter().any(|r| r.index == w.root);
            if !root_ok
                || u32::from(w.index) >= crate::hotplug::PCI_HOTPLUG_BUSES
                || w.device == 0
                || w.device > self.pci_slots
                || w.ports == 0
                || u32::from(w.ports) > PCI_HOTPLUG_SLOTS
                || w.number > self.pci_bus_end
            {
                return Err(AcpiTableError::RootBus {
                    bus: w.number,
                    what: format!("switch {w:?} does not fit the buses and slots described"),
                });
            }
        }
        Ok(())
    }

    /// The NUMA nodes describe a machine: each vCPU in exactly one node, memory in every
    /// node, a full symmetric distance matrix (SLIT is read as one by Linux, which refuses
    /// the table otherwise and falls back to one node without saying much).
    fn validate_numa(&self) -> Result<(), AcpiTableError> {
        let n = self.numa.len();
        if n > MAX_NUMA_NODES {
            return Err(AcpiTableError::NumaNodes(n));
        }
        let err = |node: usize, what: String| Err(AcpiTableError::Numa { node, what });
        let mut owner = vec![None; self.num_vcpus as usize];
        for (i, node) in self.numa.iter().enumerate() {
            for &cpu in &node.cpus {
                match owner.get_mut(cpu as usize) {
                    None => return err(i, format!("vcpu {cpu} does not exist")),
                    Some(Some(other)) => {
                        return err(i, format!("vcpu {cpu} is in node {other} too"))
                    }
                    Some(slot) => *slot = Some(i),
                }
            }
            if node.memory.iter().all(|&(_, len)| len == 0) {
                return err(i, "has no memory".into());
            }
            if node.distances.len() != n {
                return err(
                    i,
                    format!("{} distances for {n} nodes", node.distances.len()),
                );
            }
            for (j, &d) in node.distances.iter().enumerate() {
                let ok = if i == j {
                    d == NUMA_LOCAL_DISTANCE
                } else {
                    (NUMA_LOCAL_DISTANCE + 1..=NUMA_MAX_DISTANCE).contains(&d)
                        && self.numa[j].distances.get(i) == Some(&d)
                };
                if !ok {
                    return err(i, format!("distance {d} to node {j}"));
                }
            }
        }
        if n > 0 {
            if let Some(cpu) = owner.iter().position(Option::is_none) {
                return Err(AcpiTableError::NumaCpu(cpu));
            }
        }
        Ok(())
    }

    /// ECAM bytes for the configured bus range.
    fn ecam_size(&self) -> u64 {
        (u64::from(self.pci_bus_end) + 1) << 20
    }

    fn ecam_end(&self) -> u64 {
        self.ecam_base.saturating_add(self.ecam_size())
    }
}

/// One table blob and where it goes in guest memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcpiTable {
    /// Signature (`b"RSD "` for the RSDP, which has an 8-byte one).
    pub signature: [u8; 4],
    /// Guest physical address.
    pub gpa: u64,
    pub bytes: Vec<u8>,
}

/// The complete table set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcpiTables {
    /// Guest physical address of the RSDP (for `boot_params.acpi_rsdp_addr`).
    pub rsdp_addr: u64,
    /// All blobs, RSDP first.
    pub tables: Vec<AcpiTable>,
}

impl AcpiTables {
    /// Hands every blob to `write(gpa, bytes)`; stops at the first error.
    pub fn write_to<E>(&self, mut write: impl FnMut(u64, &[u8]) -> Result<(), E>) -> Result<(), E> {
        for t in &self.tables {
            write(t.gpa, &t.bytes)?;
        }
        Ok(())
    }

    /// The table with `signature`, if present.
    pub fn get(&self, signature: &[u8; 4]) -> Option<&AcpiTable> {
        self.tables.iter().find(|t| &t.signature == signature)
    }

    /// First byte after the last table.
    pub fn end(&self) -> u64 {
        self.tables
            .iter()
            .map(|t| t.gpa + t.bytes.len() as u64)
            .max()
            .unwrap_or(self.rsdp_addr)
    }
}

fn oem_table_id(signature: &[u8; 4]) -> [u8; 8] {
    let mut id = *b"LVM     ";
    id[3..7].copy_from_slice(signature);
    id
}

fn to_bytes(aml: &dyn Aml) -> Vec<u8> {
    let mut v = Vec::new();
    aml.to_aml_bytes(&mut v);
    v
}

fn slot_name(slot: u32) -> String {
    format!("S{slot:02}_")
}

/// The PCI host bridge `_OSC`: grants PME/AER/PCIe-capability control, never native hotplug.
fn pci_osc() -> Vec<u8> {
    let cdw1 = Path::new("CDW1");
    let cdw3 = Path::new("CDW3");
    let arg0 = aml::Arg(0);
    let arg1 = aml::Arg(1);
    let arg3 = aml::Arg(3);
    let local0 = aml::Local(0);
    let uuid = aml::Uuid::new(PCI_HOST_BRIDGE_OSC_UUID);

    let create_cdw1 = aml::CreateDWordField::new(&cdw1, &arg3, &aml::ZERO);
    let create_cdw3 = aml::CreateDWordField::new(&cdw3, &arg3, &8u8);
    let granted = OSC_GRANTED_CONTROL;
    let mask = aml::And::new(&local0, &cdw3, &granted);
    let bad_rev = aml::NotEqual::new(&arg1, &aml::ONE);
    let rev_err_bits = 0x08u8;
    let set_rev_err = aml::Or::new(&cdw1, &cdw1, &rev_err_bits);
    let if_bad_rev = aml::If::new(&bad_rev, vec![&set_rev_err]);
    let masked = aml::NotEqual::new(&cdw3, &local0);
    let masked_bits = 0x10u8;
    let set_masked = aml::Or::new(&cdw1, &cdw1, &masked_bits);
    let if_masked = aml::If::new(&masked, vec![&set_masked]);
    let store_cdw3 = aml::Store::new(&cdw3, &local0);
    let is_pci = aml::Equal::new(&arg0, &uuid);
    let if_pci = aml::If::new(
        &is_pci,
        vec![&create_cdw3, &mask, &if_bad_rev, &if_masked, &store_cdw3],
    );
    let uuid_err_bits = 0x04u8;
    let set_uuid_err = aml::Or::new(&cdw1, &cdw1, &uuid_err_bits);
    let else_err = aml::Else::new(vec![&set_uuid_err]);
    let ret = aml::Return::new(&arg3);
    to_bytes(&Method::new(
        "_OSC".into(),
        4,
        false,
        vec![&create_cdw1, &if_pci, &else_err, &ret],
    ))
}

/// Raw-bytes AML node (for pieces built separately).
struct Raw(Vec<u8>);

impl Aml for Raw {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        sink.vec(&self.0);
    }
}

/// The DSDT path of root bus `bus`'s host bridge: `\_SB_.PCI0` for bus 0, `\_SB_.PCnn`
/// (hexadecimal) for the others.
pub fn root_bus_path(bus: u8) -> String {
    if bus == 0 {
        "\\_SB_.PCI0".into()
    } else {
        format!("\\_SB_.PC{bus:02X}")
    }
}

/// Slot `slot` of the bus at `scope`, with `_SUN` `sun` (unique across buses: the guest
/// names its hot-plug slots by it).
fn slot_device(scope: &str, slot: u32, sun: u32) -> Vec<u8> {
    let adr = slot << 16;
    let eject = MethodCall::new(format!("{scope}.PCEJ").as_str().into(), vec![&slot]);
    let ej0 = Method::new("_EJ0".into(), 1, false, vec![&eject]);
    to_bytes(&Device::new(
        slot_name(slot).as_str().into(),
        vec![
            &Name::new("_ADR".into(), &adr),
            &Name::new("_SUN".into(), &sun),
            &ej0,
        ],
    ))
}

/// The slots the DSDT describes: 0 (the host bridge's) to `pci_slots`.
fn described_slots(cfg: &AcpiConfig) -> std::ops::Range<u32> {
    0..(u32::from(cfg.pci_slots) + 1).min(PCI_HOTPLUG_SLOTS)
}

/// The slot devices of root bus `root` (an index) at `scope`: a switch's slot holds its
/// bridge's bus (see [`switch_device`]), the others take devices.
fn root_slots(cfg: &AcpiConfig, root: u8, scope: &str) -> Vec<Raw> {
    described_slots(cfg)
        .map(|s| {
            match cfg
                .switches
                .iter()
                .find(|w| w.root == root && u32::from(w.device) == s)
            {
                Some(w) => Raw(switch_device(w, scope)),
                None => Raw(slot_device(scope, s, s)),
            }
        })
        .collect()
}

/// A switch's bridge in its root bus's slot: `_ADR`, the hot-plug methods of its secondary
/// bus (PSEG = its index) and a slot per port (`_SUN` = its slot number, index * 32 + port).
/// No `_EJ0` of its own: the bridge stays.
fn switch_device(w: &Switch, root_scope: &str) -> Vec<u8> {
    let scope = format!("{root_scope}.{}", slot_name(u32::from(w.device)));
    let ports = 0..u32::from(w.ports);
    let adr = u32::from(w.device) << 16;
    let adr_name = Name::new("_ADR".into(), &adr);
    let methods = Raw(hotplug_methods(w.index, &scope, ports.clone()));
    let slots: Vec<Raw> = ports
        .map(|p| Raw(slot_device(&scope, p, u32::from(w.index) * 32 + p)))
        .collect();
    let mut children: Vec<&dyn Aml> = vec![&adr_name, &methods];
    for s in &slots {
        children.push(s);
    }
    to_bytes(&Device::new(
        slot_name(u32::from(w.device)).as_str().into(),
        children,
    ))
}

/// `DVNT(bitmap, event)`: `Notify(Sxx_, event)` for every slot bit set in `bitmap`.
fn dvnt_method(slots: std::ops::Range<u32>, scope: &str) -> Vec<u8> {
    let mut body = Vec::new();
    let arg0 = aml::Arg(0);
    let arg1 = aml::Arg(1);
    for slot in slots {
        let bit = 1u32 << slot;
        let test = aml::And::new(&aml::ZERO, &arg0, &bit);
        let path = Path::new(&format!("{scope}.{}", slot_name(slot)));
        let notify = aml::Notify::new(&path, &arg1);
        body.extend(to_bytes(&aml::If::new(&test, vec![&notify])));
    }
    to_bytes(&Method::new("DVNT".into(), 2, false, vec![&Raw(body)]))
}

fn pci_prt(cfg: &AcpiConfig, gsis: &[u32; 32]) -> Vec<u8> {
    let mut entries: Vec<Vec<u8>> = Vec::new();
    for (slot, gsi) in described_slots(cfg).zip(gsis.iter()) {
        let adr = (slot << 16) | 0xffff;
        for pin in 0u8..4 {
            entries.push(to_bytes(&Package::new(vec![&adr, &pin, &aml::ZERO, gsi])));
        }
    }
    let raws: Vec<Raw> = entries.into_iter().map(Raw).collect();
    let refs: Vec<&dyn Aml> = raws.iter().map(|r| r as &dyn Aml).collect();
    // Package holds at most 255 elements in its count byte; 128 entries fit.
    to_bytes(&Name::new("_PRT".into(), &Package::new(refs)))
}

/// The hot-plug methods of root bus `bus` at `scope` over the controller's registers (the
/// field and mutex are `\_SB_.PCI0`'s; PSEG selects the bus):
/// - `PCEJ(slot)`: the guest released the device: write `1 << slot` to B0EJ;
/// - `PCNT()`: read (and so clear) PCIU/PCID once, then notify the slots;
/// - `DVNT(bitmap, event)`.
fn hotplug_methods(bus: u8, scope: &str, slots: std::ops::Range<u32>) -> Vec<u8> {
    let pseg = Path::new("\\_SB_.PCI0.PSEG");
    let b0ej = Path::new("\\_SB_.PCI0.B0EJ");
    let acquire = aml::Acquire::new("\\_SB_.PCI0.BLCK".into(), 0xffff);
    let release = aml::Release::new("\\_SB_.PCI0.BLCK".into());
    let bus_number = u32::from(bus);
    let sel_bus = aml::Store::new(&pseg, &bus_number);
    let arg0 = aml::Arg(0);
    let eject = aml::ShiftLeft::new(&b0ej, &aml::ONE, &arg0);
    let pcej = Method::new(
        "PCEJ".into(),
        1,
        true,
        vec![&acquire, &sel_bus, &eject, &release],
    );

    let local0 = aml::Local(0);
    let local1 = aml::Local(1);
    let pciu = Path::new("\\_SB_.PCI0.PCIU");
    let pcid = Path::new("\\_SB_.PCI0.PCID");
    let read_up = aml::Store::new(&local0, &pciu);
    let read_down = aml::Store::new(&local1, &pcid);
    let device_check = 1u8;
    let eject_request = 3u8;
    let notify_up = MethodCall::new("DVNT".into(), vec![&local0, &device_check]);
    let notify_down = MethodCall::new("DVNT".into(), vec![&local1, &eject_request]);
    let pcnt = Method::new(
        "PCNT".into(),
        0,
        true,
        vec![
            &acquire,
            &sel_bus,
            &read_up,
            &read_down,
            &release,
            &notify_up,
            &notify_down,
        ],
    );
    let mut v = to_bytes(&pcej);
    v.extend(to_bytes(&pcnt));
    v.extend(dvnt_method(slots, scope));
    v
}

fn pci0_device(cfg: &AcpiConfig) -> Vec<u8> {
    // With root buses of their own, bus 0's host bridge decodes bus 0 and its switches'.
    let last_bus = if cfg.root_buses.is_empty() {
        cfg.pci_bus_end
    } else {
        cfg.switches
            .iter()
            .filter(|w| w.root == 0)
            .map(|w| w.number)
            .fold(cfg.pci_bus_start, u8::max)
    };
    let bus =
        AddressSpace::<u16>::new_bus_number(u16::from(cfg.pci_bus_start), u16::from(last_bus));
    let cf8 = IO::new(0xcf8, 0xcf8, 1, 8);
    let windows = Windows::new(
        (u64::from(cfg.io_base), u64::from(cfg.io_size)),
        (cfg.mmio32_base, cfg.mmio32_size),
        (cfg.mmio64_base, cfg.mmio64_size),
    );
    let mut resources: Vec<&dyn Aml> = vec![&bus, &cf8];
    windows.push_to(&mut resources);
    let crs = ResourceTemplate::new(resources);

    let hid = EISAName::new("PNP0A08");
    let cid = EISAName::new("PNP0A03");
    let bbn = u32::from(cfg.pci_bus_start);
    let osc = Raw(pci_osc());

    // Hotplug register block, for every root bus (PSEG selects one).
    let region = OpRegion::new(
        "PCST".into(),
        OpRegionSpace::SystemMemory,
        &cfg.hotplug_addr,
        &PCI_HOTPLUG_SIZE,
    );
    let field = Field::new(
        "PCST".into(),
        FieldAccessType::DWord,
        FieldLockRule::NoLock,
        FieldUpdateRule::WriteAsZeroes,
        vec![
            FieldEntry::Named(*b"PCIU", 32),
            FieldEntry::Named(*b"PCID", 32),
            FieldEntry::Named(*b"B0EJ", 32),
            FieldEntry::Named(*b"PSEG", 32),
        ],
    );
    let mutex = aml::Mutex::new("BLCK".into(), 0);
    let methods = Raw(hotplug_methods(0, &root_bus_path(0), described_slots(cfg)));

    let scope = root_bus_path(0);
    let slots = root_slots(cfg, 0, &scope);
    let prt = cfg.pci_slot_gsis.as_ref().map(|g| Raw(pci_prt(cfg, g)));

    let hid_name = Name::new("_HID".into(), &hid);
    let cid_name = Name::new("_CID".into(), &cid);
    let seg_name = Name::new("_SEG".into(), &aml::ZERO);
    let uid_name = Name::new("_UID".into(), &aml::ZERO);
    let bbn_name = Name::new("_BBN".into(), &bbn);
    let crs_name = Name::new("_CRS".into(), &crs);
    let mut children: Vec<&dyn Aml> = vec![
        &hid_name, &cid_name, &seg_name, &uid_name, &bbn_name, &crs_name, &osc, &region, &field,
        &mutex, &methods,
    ];
    if let Some(prt) = &prt {
        children.push(prt);
    }
    // With NUMA nodes the host bridge is in node 0, as the first socket's root complex is:
    // without `_PXM` Linux leaves its devices' node unknown ("Unknown NUMA node;
    // performance will be reduced"). Devices in other nodes are on root buses of their own.
    let pxm_name = Name::new("_PXM".into(), &aml::ZERO);
    if !cfg.numa.is_empty() {
        children.push(&pxm_name);
    }
    for s in &slots {
        children.push(s);
    }
    to_bytes(&Device::new(scope.as_str().into(), children))
}

/// A host bridge's I/O, 32-bit and 64-bit windows as `_CRS` descriptors, `(base, size)`
/// each (validated to fit their address spaces); a size of 0 leaves a window out.
struct Windows {
    io: Option<AddressSpace<u16>>,
    mem32: Option<AddressSpace<u32>>,
    mem64: Option<AddressSpace<u64>>,
}

impl Windows {
    fn new(io: (u64, u64), mmio32: (u64, u64), mmio64: (u64, u64)) -> Self {
        let last = |(base, size): (u64, u64)| base.wrapping_add(size).wrapping_sub(1);
        let mem = |w: (u64, u64)| (AddressSpaceCacheable::NotCacheable, true, w.0, last(w));
        Self {
            io: (io.1 != 0)
                .then(|| AddressSpace::<u16>::new_io(io.0 as u16, last(io) as u16, None)),
            mem32: (mmio32.1 != 0).then(|| {
                let (c, rw, b, e) = mem(mmio32);
                AddressSpace::<u32>::new_memory(c, rw, b as u32, e as u32, None)
            }),
            mem64: (mmio64.1 != 0).then(|| {
                let (c, rw, b, e) = mem(mmio64);
                AddressSpace::<u64>::new_memory(c, rw, b, e, None)
            }),
        }
    }

    fn push_to<'a>(&'a self, resources: &mut Vec<&'a dyn Aml>) {
        if let Some(w) = &self.io {
            resources.push(w);
        }
        if let Some(w) = &self.mem32 {
            resources.push(w);
        }
        if let Some(w) = &self.mem64 {
            resources.push(w);
        }
    }
}

/// The host bridge of a root bus of its own (`pxb`-like): `_BBN`, `_PXM`, its slice of the
/// windows, its slots with `_EJ0`, `_PRT` and hot-plug methods.
fn root_bus_device(cfg: &AcpiConfig, r: &RootBus) -> Vec<u8> {
    let bus = AddressSpace::<u16>::new_bus_number(u16::from(r.bus), u16::from(r.last_bus));
    let windows = Windows::new(r.io, r.mmio32, r.mmio64);
    let mut resources: Vec<&dyn Aml> = vec![&bus];
    windows.push_to(&mut resources);
    let crs = ResourceTemplate::new(resources);
    let hid = EISAName::new("PNP0A08");
    let cid = EISAName::new("PNP0A03");
    let number = u32::from(r.bus);
    let index = u32::from(r.index);
    let scope = root_bus_path(r.index);
    let osc = Raw(pci_osc());
    let methods = Raw(hotplug_methods(r.index, &scope, described_slots(cfg)));
    let slots = root_slots(cfg, r.index, &scope);
    let prt = cfg.pci_slot_gsis.as_ref().map(|g| Raw(pci_prt(cfg, g)));
    let hid_name = Name::new("_HID".into(), &hid);
    let cid_name = Name::new("_CID".into(), &cid);
    let seg_name = Name::new("_SEG".into(), &aml::ZERO);
    let uid_name = Name::new("_UID".into(), &index);
    let bbn_name = Name::new("_BBN".into(), &number);
    let pxm_name = Name::new("_PXM".into(), &r.node);
    let crs_name = Name::new("_CRS".into(), &crs);
    let mut children: Vec<&dyn Aml> = vec![
        &hid_name, &cid_name, &seg_name, &uid_name, &bbn_name, &pxm_name, &crs_name, &osc, &methods,
    ];
    if let Some(prt) = &prt {
        children.push(prt);
    }
    for s in &slots {
        children.push(s);
    }
    to_bytes(&Device::new(scope.as_str().into(), children))
}

/// Motherboard resources: reserves ECAM and the platform MMIO so the OS never reuses them.
fn mbrd_device(cfg: &AcpiConfig) -> Vec<u8> {
    let ecam_start = cfg.ecam_base + (u64::from(cfg.pci_bus_start) << 20);
    let ecam_len = cfg.ecam_size() - (u64::from(cfg.pci_bus_start) << 20);
    // Validated to fit below 4 GiB.
    let ecam = Memory32Fixed::new(true, ecam_start as u32, ecam_len as u32);
    let ged = Memory32Fixed::new(true, cfg.ged_addr as u32, GED_SIZE as u32);
    let hp = Memory32Fixed::new(true, cfg.hotplug_addr as u32, PCI_HOTPLUG_SIZE as u32);
    let crs = ResourceTemplate::new(vec![&ecam, &ged, &hp]);
    let hid = EISAName::new("PNP0C02");
    to_bytes(&Device::new(
        "\\_SB_.MBRD".into(),
        vec![
            &Name::new("_HID".into(), &hid),
            &Name::new("_UID".into(), &aml::ZERO),
            &Name::new("_CRS".into(), &crs),
        ],
    ))
}

fn ged_device(cfg: &AcpiConfig) -> Vec<u8> {
    let irq = Interrupt::new(true, true, false, false, cfg.ged_gsi);
    let crs = ResourceTemplate::new(vec![&irq]);
    let region = OpRegion::new(
        "GDST".into(),
        OpRegionSpace::SystemMemory,
        &cfg.ged_addr,
        &GED_SIZE,
    );
    let field = Field::new(
        "GDST".into(),
        FieldAccessType::DWord,
        FieldLockRule::NoLock,
        FieldUpdateRule::WriteAsZeroes,
        vec![FieldEntry::Named(*b"GDAT", 32)],
    );
    let local0 = aml::Local(0);
    let gdat = Path::new("GDAT");
    let read = aml::Store::new(&local0, &gdat);
    let bit = GED_EVENT_PCI_HOTPLUG;
    let and = aml::And::new(&aml::ZERO, &local0, &bit);
    let is_hotplug = aml::Equal::new(&and, &bit);
    // Every root bus's and switch's PCNT: a hot-plug event may be about any of them.
    let calls: Vec<MethodCall> = std::iter::once(0)
        .chain(cfg.root_buses.iter().map(|r| r.index))
        .map(|b| format!("{}.PCNT", root_bus_path(b)))
        .chain(cfg.switches.iter().map(|w| {
            format!(
                "{}.{}.PCNT",
                root_bus_path(w.root),
                slot_name(u32::from(w.device))
            )
        }))
        .map(|path| MethodCall::new(path.as_str().into(), vec![]))
        .collect();
    let pcnts: Vec<&dyn Aml> = calls.iter().map(|c| c as &dyn Aml).collect();
    let if_hotplug = aml::If::new(&is_hotplug, pcnts);
    let evt = Method::new("_EVT".into(), 1, true, vec![&read, &if_hotplug]);
    to_bytes(&Device::new(
        "\\_SB_.GED_".into(),
        vec![
            &Name::new("_HID".into(), &"ACPI0013"),
            &Name::new("_UID".into(), &aml::ZERO),
            &Name::new("_CRS".into(), &crs),
            &region,
            &field,
            &evt,
        ],
    ))
}

fn serial_device(port: u16, irq: u32) -> Vec<u8> {
    let io = IO::new(port, port, 1, 8);
    let int = Interrupt::new(true, true, false, false, irq);
    let crs = ResourceTemplate::new(vec![&io, &int]);
    let hid = EISAName::new("PNP0501");
    to_bytes(&Device::new(
        "\\_SB_.COM1".into(),
        vec![
            &Name::new("_HID".into(), &hid),
            &Name::new("_UID".into(), &aml::ONE),
            &Name::new("_CRS".into(), &crs),
        ],
    ))
}

/// The DSDT's AML body (definition block contents without the table header).
pub fn dsdt_aml(cfg: &AcpiConfig) -> Vec<u8> {
    let mut body = pci0_device(cfg);
    for r in &cfg.root_buses {
        body.extend(root_bus_device(cfg, r));
    }
    body.extend(mbrd_device(cfg));
    body.extend(ged_device(cfg));
    if let Some((port, irq)) = cfg.serial {
        body.extend(serial_device(port, irq));
    }
    let s5_value = 5u8;
    body.extend(to_bytes(&Name::new(
        "_S5_".into(),
        &Package::new(vec![&s5_value]),
    )));
    body
}

/// The complete DSDT (revision 2+: 64-bit integers).
pub fn create_dsdt(cfg: &AcpiConfig) -> Vec<u8> {
    let mut dsdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, oem_table_id(b"DSDT"), OEM_REVISION);
    dsdt.append_slice(&dsdt_aml(cfg));
    dsdt.as_slice().to_vec()
}

fn create_fadt(cfg: &AcpiConfig, dsdt_addr: u64) -> Vec<u8> {
    let mut boot_arch = IAPC_BOOT_ARCH_NO_VGA | IAPC_BOOT_ARCH_NO_ASPM;
    if !cfg.cmos_rtc {
        boot_arch |= IAPC_BOOT_ARCH_NO_CMOS_RTC;
    }
    let mut builder = FADTBuilder::new(OEM_ID, oem_table_id(b"FACP"), OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    builder.iapc_boot_arch = boot_arch.into();
    // Also fill the 32-bit DSDT pointer (same value) for OSes that read only that one.
    if let Ok(dsdt32) = u32::try_from(dsdt_addr) {
        builder.dsdt = dsdt32.into();
    }
    to_bytes(&builder.finalize())
}

fn madt_entry_lapic_nmi() -> [u8; 6] {
    // Type 4, length 6, ACPI processor UID 0xff (all), flags 0 (bus default), LINT1.
    [4, 6, 0xff, 0, 0, 1]
}

fn madt_entry_iso(source: u8, gsi: u32, flags: u16) -> [u8; 10] {
    // Type 2, length 10, bus 0 (ISA), source IRQ, GSI, MPS INTI flags.
    let mut e = [0u8; 10];
    e[0] = 2;
    e[1] = 10;
    e[3] = source;
    e[4..8].copy_from_slice(&gsi.to_le_bytes());
    e[8..10].copy_from_slice(&flags.to_le_bytes());
    e
}

fn create_madt(cfg: &AcpiConfig) -> Vec<u8> {
    let mut madt = Sdt::new(*b"APIC", 44, 5, OEM_ID, oem_table_id(b"APIC"), OEM_REVISION);
    madt.write_u32(36, cfg.lapic_addr);
    madt.write_u32(40, MADT_PCAT_COMPAT);
    for cpu in 0..cfg.num_vcpus {
        // Validated: num_vcpus <= MAX_VCPUS < 256.
        let id = cpu as u8;
        madt.append_slice(&to_bytes(&ProcessorLocalApic::new(
            id,
            id,
            EnabledStatus::Enabled,
        )));
    }
    madt.append_slice(&to_bytes(&IoApic::new(cfg.ioapic_id, cfg.ioapic_addr, 0)));
    // ISA IRQ 0 (PIT) is wired to IOAPIC pin 2, as on PC hardware.
    madt.append_slice(&madt_entry_iso(0, 2, 0));
    madt.append_slice(&madt_entry_lapic_nmi());
    madt.as_slice().to_vec()
}

/// SRAT (revision 3): a Processor Local APIC Affinity structure per vCPU and a Memory
/// Affinity structure per RAM range, each naming its node as the proximity domain.
/// acpi_tables' `SRAT` has no x86 processor structure, so the table is laid out here on its
/// `Sdt`, with the crate's `MemoryAffinity` for the memory ranges.
fn create_srat(cfg: &AcpiConfig) -> Vec<u8> {
    // Header (36), then a reserved dword that must be 1 and a reserved qword.
    let mut srat = Sdt::new(*b"SRAT", 48, 3, OEM_ID, oem_table_id(b"SRAT"), OEM_REVISION);
    srat.write_u32(36, 1);
    for (domain, node) in cfg.numa.iter().enumerate() {
        // Validated: at most MAX_NUMA_NODES (64) nodes.
        let domain = domain as u32;
        for &cpu in &node.cpus {
            // Type 0, length 16: proximity domain [7:0], APIC id, flags (enabled), local
            // SAPIC EID, proximity domain [31:8], clock domain.
            let mut e = [0u8; 16];
            e[0] = 0;
            e[1] = 16;
            e[2] = domain as u8;
            e[3] = cpu as u8;
            e[4..8].copy_from_slice(&1u32.to_le_bytes());
            e[9..12].copy_from_slice(&(domain >> 8).to_le_bytes()[..3]);
            srat.append_slice(&e);
        }
        for &(base, len) in node.memory.iter().filter(|(_, len)| *len != 0) {
            srat.append_slice(&to_bytes(&MemoryAffinity::new(domain, base, len).enabled()));
        }
    }
    srat.as_slice().to_vec()
}

/// SLIT: the nodes' distance matrix.
fn create_slit(cfg: &AcpiConfig) -> Vec<u8> {
    let n = cfg.numa.len();
    let mut slit = SLIT::new(OEM_ID, oem_table_id(b"SLIT"), OEM_REVISION, n as u32);
    for (i, node) in cfg.numa.iter().enumerate() {
        for (j, &d) in node.distances.iter().enumerate().skip(i + 1) {
            slit.set_distance(i, j, d);
        }
    }
    to_bytes(&slit)
}

fn create_mcfg(cfg: &AcpiConfig) -> Vec<u8> {
    let mut mcfg = MCFG::new(OEM_ID, oem_table_id(b"MCFG"), OEM_REVISION);
    mcfg.add_ecam(cfg.ecam_base, 0, cfg.pci_bus_start, cfg.pci_bus_end);
    to_bytes(&mcfg)
}

fn align_up(v: u64, align: u64) -> u64 {
    v.div_ceil(align) * align
}

/// Table alignment in guest memory.
const ALIGN: u64 = 16;

struct Layout {
    next: u64,
    tables: Vec<AcpiTable>,
}

impl Layout {
    fn place(&mut self, signature: [u8; 4], bytes: Vec<u8>) -> u64 {
        let gpa = self.next;
        self.next = align_up(gpa + bytes.len() as u64, ALIGN);
        self.tables.push(AcpiTable {
            signature,
            gpa,
            bytes,
        });
        gpa
    }
}

/// Builds every table and lays them out from `cfg.tables_start`.
pub fn create_acpi_tables(cfg: &AcpiConfig) -> Result<AcpiTables, AcpiTableError> {
    cfg.validate()?;
    let rsdp_addr = cfg.tables_start;
    let mut layout = Layout {
        next: align_up(rsdp_addr + Rsdp::len() as u64, ALIGN),
        tables: Vec::new(),
    };
    let dsdt_addr = layout.place(*b"DSDT", create_dsdt(cfg));
    let fadt_addr = layout.place(*b"FACP", create_fadt(cfg, dsdt_addr));
    let madt_addr = layout.place(*b"APIC", create_madt(cfg));
    let mcfg_addr = layout.place(*b"MCFG", create_mcfg(cfg));
    let mut xsdt = XSDT::new(OEM_ID, oem_table_id(b"XSDT"), OEM_REVISION);
    for addr in [fadt_addr, madt_addr, mcfg_addr] {
        xsdt.add_entry(addr);
    }
    if !cfg.numa.is_empty() {
        xsdt.add_entry(layout.place(*b"SRAT", create_srat(cfg)));
        xsdt.add_entry(layout.place(*b"SLIT", create_slit(cfg)));
    }
    let xsdt_addr = layout.place(*b"XSDT", to_bytes(&xsdt));
    let mut tables = layout.tables;

    let rsdp = to_bytes(&Rsdp::new(OEM_ID, xsdt_addr));
    tables.insert(
        0,
        AcpiTable {
            signature: *b"RSD ",
            gpa: rsdp_addr,
            bytes: rsdp,
        },
    );
    let out = AcpiTables { rsdp_addr, tables };
    if out.end() > cfg.tables_end {
        return Err(AcpiTableError::TooLarge {
            end: out.end(),
            limit: cfg.tables_end,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b))
    }

    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }

    fn u64_at(b: &[u8], off: usize) -> u64 {
        u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
    }

    fn contains(hay: &[u8], needle: &[u8]) -> bool {
        hay.windows(needle.len()).any(|w| w == needle)
    }

    fn config(vcpus: u32) -> AcpiConfig {
        AcpiConfig {
            num_vcpus: vcpus,
            mmio64_base: 0x1_4000_0000,
            mmio64_size: 0x40_0000_0000,
            ..Default::default()
        }
    }

    /// Two nodes: vCPU 0 and the first GiB on node 0; vCPU 1, the second GiB and 256 MiB
    /// above 4 GiB on node 1; distance 21 between them.
    fn two_nodes() -> Vec<NumaNode> {
        vec![
            NumaNode {
                cpus: vec![0],
                memory: vec![(0, 0x4000_0000)],
                distances: vec![10, 21],
            },
            NumaNode {
                cpus: vec![1],
                memory: vec![(0x4000_0000, 0x4000_0000), (0x1_0000_0000, 0x1000_0000)],
                distances: vec![21, 10],
            },
        ]
    }

    #[test]
    fn numa_nodes_become_srat_and_slit() {
        let plain = create_acpi_tables(&config(2)).unwrap();
        assert!(plain.get(b"SRAT").is_none() && plain.get(b"SLIT").is_none());
        let cfg = AcpiConfig {
            numa: two_nodes(),
            ..config(2)
        };
        let t = create_acpi_tables(&cfg).unwrap();
        let xsdt = t.get(b"XSDT").unwrap();
        let listed: Vec<u64> = (36..xsdt.bytes.len())
            .step_by(8)
            .map(|o| u64_at(&xsdt.bytes, o))
            .collect();
        let srat = t.get(b"SRAT").unwrap();
        let slit = t.get(b"SLIT").unwrap();
        assert!(listed.contains(&srat.gpa) && listed.contains(&slit.gpa));
        for table in [srat, slit] {
            assert_eq!(sum(&table.bytes), 0, "{:?} checksum", table.signature);
            assert_eq!(u32_at(&table.bytes, 4) as usize, table.bytes.len());
        }
        // SRAT: the reserved 1, then (type, domain, what) for every structure.
        assert_eq!(u32_at(&srat.bytes, 36), 1);
        let mut found = Vec::new();
        let mut off = 48;
        while off < srat.bytes.len() {
            let (kind, len) = (srat.bytes[off], srat.bytes[off + 1] as usize);
            let e = &srat.bytes[off..off + len];
            match (kind, len) {
                (0, 16) => {
                    assert_eq!(u32_at(e, 4) & 1, 1, "lapic affinity enabled");
                    found.push(format!("cpu {} node {}", e[3], e[2]));
                }
                (1, 40) => {
                    assert_eq!(u32_at(e, 28) & 1, 1, "memory affinity enabled");
                    let (base, size) = (u64_at(e, 8), u64_at(e, 16));
                    found.push(format!("mem {base:#x}+{size:#x} node {}", u32_at(e, 2)));
                }
                other => panic!("unexpected SRAT structure {other:?}"),
            }
            off += len;
        }
        assert_eq!(
            found,
            [
                "cpu 0 node 0",
                "mem 0x0+0x40000000 node 0",
                "cpu 1 node 1",
                "mem 0x40000000+0x40000000 node 1",
                "mem 0x100000000+0x10000000 node 1",
            ]
        );
        // SLIT: the node count, then the matrix row by row.
        assert_eq!(u64_at(&slit.bytes, 36), 2);
        assert_eq!(&slit.bytes[44..], &[10, 21, 21, 10]);
    }

    #[test]
    fn numa_nodes_that_describe_no_machine_are_refused() {
        let with = |edit: fn(&mut Vec<NumaNode>)| {
            let mut numa = two_nodes();
            edit(&mut numa);
            create_acpi_tables(&AcpiConfig { numa, ..config(2) })
                .unwrap_err()
                .to_string()
        };
        for (edit, want) in [
            (
                (|n: &mut Vec<NumaNode>| n[1].cpus = vec![0]) as fn(&mut Vec<NumaNode>),
                "numa node 1: vcpu 0 is in node 0 too",
            ),
            (|n| n[1].cpus = vec![], "vcpu 1 is in no numa node"),
            (
                |n| n[1].cpus = vec![1, 7],
                "numa node 1: vcpu 7 does not exist",
            ),
            (|n| n[0].memory = vec![], "numa node 0: has no memory"),
            (
                |n| n[0].distances = vec![10],
                "numa node 0: 1 distances for 2 nodes",
            ),
            (
                |n| n[0].distances[1] = 30,
                "numa node 0: distance 30 to node 1",
            ),
            (
                |n| n[1].distances[1] = 11,
                "numa node 1: distance 11 to node 1",
            ),
            (
                |n| n[0].distances[1] = 10,
                "numa node 0: distance 10 to node 1",
            ),
        ] {
            assert_eq!(with(edit), want);
        }
        let many = AcpiConfig {
            numa: vec![NumaNode::default(); MAX_NUMA_NODES + 1],
            ..config(2)
        };
        assert_eq!(
            create_acpi_tables(&many).unwrap_err().to_string(),
            "65 numa nodes: at most 64"
        );
    }

    #[test]
    fn every_table_has_checksum_signature_and_length() {
        let t = create_acpi_tables(&config(2)).unwrap();
        let sigs: Vec<[u8; 4]> = t.tables.iter().map(|t| t.signature).collect();
        assert_eq!(
            sigs,
            vec![*b"RSD ", *b"DSDT", *b"FACP", *b"APIC", *b"MCFG", *b"XSDT"]
        );
        for table in &t.tables[1..] {
            let b = &table.bytes;
            assert_eq!(&b[0..4], &table.signature, "signature");
            assert_eq!(
                u32_at(b, 4) as usize,
                b.len(),
                "length of {:?}",
                table.signature
            );
            assert_eq!(sum(b), 0, "checksum of {:?}", table.signature);
            assert_eq!(&b[10..16], b"LENDVM");
            assert_eq!(table.gpa % 16, 0);
        }
    }

    #[test]
    fn rsdp_checksums_and_location() {
        let t = create_acpi_tables(&config(1)).unwrap();
        assert_eq!(t.rsdp_addr, 0xe_0000);
        let rsdp = &t.tables[0];
        assert_eq!(rsdp.gpa, 0xe_0000);
        let b = &rsdp.bytes;
        assert_eq!(b.len(), 36);
        assert_eq!(&b[0..8], b"RSD PTR ");
        assert_eq!(b[15], 2, "ACPI 2.0+ revision");
        assert_eq!(sum(&b[0..20]), 0, "ACPI 1.0 checksum");
        assert_eq!(sum(b), 0, "extended checksum");
        assert_eq!(u32_at(b, 20), 36);
        assert_eq!(u64_at(b, 24), t.get(b"XSDT").unwrap().gpa);
    }

    #[test]
    fn xsdt_points_at_fadt_madt_mcfg_and_fadt_at_dsdt() {
        let t = create_acpi_tables(&config(1)).unwrap();
        let xsdt = &t.get(b"XSDT").unwrap().bytes;
        let entries: Vec<u64> = (36..xsdt.len())
            .step_by(8)
            .map(|o| u64_at(xsdt, o))
            .collect();
        let want: Vec<u64> = [b"FACP", b"APIC", b"MCFG"]
            .iter()
            .map(|s| t.get(s).unwrap().gpa)
            .collect();
        assert_eq!(entries, want);

        let fadt = &t.get(b"FACP").unwrap().bytes;
        assert_eq!(fadt.len(), 276);
        let dsdt_gpa = t.get(b"DSDT").unwrap().gpa;
        assert_eq!(u64_at(fadt, 140), dsdt_gpa, "X_DSDT");
        assert_eq!(u64::from(u32_at(fadt, 40)), dsdt_gpa, "DSDT");
        let flags = u32_at(fadt, 112);
        assert_ne!(flags & (1 << 20), 0, "HW_REDUCED_ACPI");
        assert_eq!(u32_at(fadt, 76), 0, "no PM timer block");
        assert_eq!(fadt[91], 0, "PM_TMR_LEN 0");
        let boot_arch = u16::from_le_bytes([fadt[109], fadt[110]]);
        assert_eq!(boot_arch & (1 << 1), 0, "no 8042");
        assert_ne!(boot_arch & (1 << 2), 0, "no VGA");
        assert_eq!(boot_arch & (1 << 3), 0, "MSI supported");
    }

    #[test]
    fn madt_has_lapic_per_vcpu_ioapic_override_and_nmi() {
        let t = create_acpi_tables(&config(4)).unwrap();
        let madt = &t.get(b"APIC").unwrap().bytes;
        assert_eq!(u32_at(madt, 36), 0xfee0_0000);
        let mut off = 44;
        let mut by_type = [0usize; 16];
        let mut apic_ids = Vec::new();
        while off < madt.len() {
            let (ty, len) = (madt[off], madt[off + 1] as usize);
            assert!(len >= 2 && off + len <= madt.len());
            by_type[ty as usize] += 1;
            match ty {
                0 => {
                    apic_ids.push(madt[off + 3]);
                    assert_eq!(u32_at(madt, off + 4), 1, "enabled");
                }
                1 => {
                    assert_eq!(u32_at(madt, off + 4), 0xfec0_0000);
                    assert_eq!(u32_at(madt, off + 8), 0, "gsi base");
                }
                2 => {
                    assert_eq!(madt[off + 3], 0, "IRQ0");
                    assert_eq!(u32_at(madt, off + 4), 2, "-> GSI2");
                }
                4 => assert_eq!(madt[off + 5], 1, "LINT1"),
                _ => panic!("unexpected MADT entry type {ty}"),
            }
            off += len;
        }
        assert_eq!(apic_ids, vec![0, 1, 2, 3]);
        assert_eq!(by_type[0], 4);
        assert_eq!(by_type[1], 1);
        assert_eq!(by_type[2], 1);
        assert_eq!(by_type[4], 1);
        assert_eq!(by_type.iter().sum::<usize>(), 4 + 1 + 1 + 1);
    }

    #[test]
    fn mcfg_describes_ecam() {
        let t = create_acpi_tables(&config(1)).unwrap();
        let mcfg = &t.get(b"MCFG").unwrap().bytes;
        assert_eq!(mcfg.len(), 44 + 16);
        assert_eq!(u64_at(mcfg, 44), 0xe000_0000);
        assert_eq!(u16::from_le_bytes([mcfg[52], mcfg[53]]), 0, "segment");
        assert_eq!((mcfg[54], mcfg[55]), (0, 0), "bus range");
    }

    #[test]
    fn dsdt_describes_only_the_configured_slots() {
        let mut cfg = config(1);
        cfg.pci_slot_gsis = Some([10; 32]);
        let all = create_dsdt(&cfg);
        cfg.pci_slots = 3;
        let few = create_dsdt(&cfg);
        for name in [&b"S00_"[..], b"S01_", b"S03_"] {
            assert!(contains(&few, name), "{}", String::from_utf8_lossy(name));
        }
        for name in [&b"S04_"[..], b"S31_"] {
            assert!(!contains(&few, name), "{}", String::from_utf8_lossy(name));
            assert!(contains(&all, name), "{}", String::from_utf8_lossy(name));
        }
        assert!(
            few.len() * 3 < all.len(),
            "{} vs {} bytes",
            few.len(),
            all.len()
        );
        for bad in [0u8, 32, 255] {
            cfg.pci_slots = bad;
            let err = create_acpi_tables(&cfg).err().map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(|e| e.contains("1 to 31")),
                "pci_slots {bad}: {err:?}"
            );
        }
    }

    #[test]
    fn dsdt_contains_hotplug_objects() {
        let cfg = config(1);
        let dsdt = create_dsdt(&cfg);
        for name in [
            &b"PCI0"[..],
            b"PCNT",
            b"PCEJ",
            b"DVNT",
            b"S00_",
            b"S05_",
            b"S31_",
            b"_EJ0",
            b"_SUN",
            b"_ADR",
            b"_OSC",
            b"ACPI0013",
            b"GED_",
            b"_EVT",
            b"PCIU",
            b"PCID",
            b"B0EJ",
            b"PSEG",
            b"COM1",
            b"MBRD",
            b"_S5_",
        ] {
            assert!(contains(&dsdt, name), "{}", String::from_utf8_lossy(name));
        }
        assert!(!contains(&dsdt, b"_PRT"), "no _PRT unless configured");
        // Hotplug register block address as a DWord constant in the OperationRegion.
        let mut region = vec![0x0c];
        region.extend_from_slice(&0xfe00_1000u32.to_le_bytes());
        assert!(contains(&dsdt, &region));
        // Slot 5: Name(_ADR, 0x50000).
        let mut adr = b"_ADR".to_vec();
        adr.push(0x0c);
        adr.extend_from_slice(&0x5_0000u32.to_le_bytes());
        assert!(contains(&dsdt, &adr));

        let with_prt = AcpiConfig {
            pci_slot_gsis: Some([10; 32]),
            serial: None,
            ..cfg
        };
        let dsdt = create_dsdt(&with_prt);
        assert!(contains(&dsdt, b"_PRT"));
        assert!(!contains(&dsdt, b"COM1"));
    }

    #[test]
    fn write_to_places_a_walkable_table_set() {
        let t = create_acpi_tables(&config(2)).unwrap();
        let base = ACPI_TABLES_START;
        let mut mem = vec![0u8; (ACPI_TABLES_END - base) as usize];
        t.write_to(|gpa, bytes| -> Result<(), String> {
            let off = (gpa - base) as usize;
            mem.get_mut(off..off + bytes.len())
                .ok_or(format!("{gpa:#x} out of range"))?
                .copy_from_slice(bytes);
            Ok(())
        })
        .unwrap();
        assert!(t.end() <= ACPI_TABLES_END);
        // Walk like an OS: RSDP (found on a 16-byte boundary) -> XSDT -> FADT -> DSDT.
        let rd = |gpa: u64, len: usize| mem[(gpa - base) as usize..][..len].to_vec();
        let rsdp = rd(base, 36);
        let xsdt_addr = u64_at(&rsdp, 24);
        let xsdt_len = u32_at(&rd(xsdt_addr, 8), 4) as usize;
        let xsdt = rd(xsdt_addr, xsdt_len);
        let mut found = Vec::new();
        for off in (36..xsdt_len).step_by(8) {
            let addr = u64_at(&xsdt, off);
            let hdr = rd(addr, 8);
            let table = rd(addr, u32_at(&hdr, 4) as usize);
            assert_eq!(sum(&table), 0);
            found.push(String::from_utf8_lossy(&table[0..4]).to_string());
            if &table[0..4] == b"FACP" {
                let dsdt_addr = u64_at(&table, 140);
                let dsdt_hdr = rd(dsdt_addr, 8);
                assert_eq!(&dsdt_hdr[0..4], b"DSDT");
                assert_eq!(sum(&rd(dsdt_addr, u32_at(&dsdt_hdr, 4) as usize)), 0);
            }
        }
        assert_eq!(found, vec!["FACP", "APIC", "MCFG"]);
    }

    #[test]
    fn bad_configs_are_rejected() {
        for vcpus in [0, 255] {
            assert_eq!(
                create_acpi_tables(&config(vcpus)),
                Err(AcpiTableError::VcpuCount(vcpus))
            );
        }
        // A 32-bit window past 4 GiB, an I/O window past 64 KiB.
        for cfg in [
            AcpiConfig {
                mmio32_base: 0xf000_0000,
                mmio32_size: 0x2000_0000,
                ..config(1)
            },
            AcpiConfig {
                io_base: 0xf000,
                io_size: 0x2000,
                ..config(1)
            },
        ] {
            assert!(matches!(
                create_acpi_tables(&cfg),
                Err(AcpiTableError::Window { .. })
            ));
        }
        let cfg = AcpiConfig {
            pci_bus_start: 2,
            pci_bus_end: 1,
            ..config(1)
        };
        assert!(matches!(
            create_acpi_tables(&cfg),
            Err(AcpiTableError::BusRange { .. })
        ));
        let cfg = AcpiConfig {
            tables_end: ACPI_TABLES_START + 0x100,
            ..config(1)
        };
        assert!(matches!(
            create_acpi_tables(&cfg),
            Err(AcpiTableError::TooLarge { .. })
        ));
        let cfg = AcpiConfig {
            hotplug_addr: 1 << 32,
            ..config(1)
        };
        assert_eq!(
            create_acpi_tables(&cfg),
            Err(AcpiTableError::PlatformMmio(1 << 32))
        );
        assert!(create_acpi_tables(&config(MAX_VCPUS)).is_ok());
        // Root buses: in MCFG's range, once each, in a node that exists.
        let bus = |bus, node| RootBus {
            bus,
            index: bus,
            last_bus: bus,
            node,
            io: (0x8800, 0x1000),
            mmio32: (0xd000_0000, 0x100_0000),
            mmio64: (0, 0),
        };
        let with = |root_buses: Vec<RootBus>, end| AcpiConfig {
            numa: two_nodes(),
            pci_bus_end: end,
            root_buses,
            ..config(2)
        };
        assert!(create_acpi_tables(&with(vec![bus(1, 1)], 1)).is_ok());
        for (buses, end, what) in [
            (vec![bus(1, 1)], 0, "outside"),
            (vec![bus(0, 1)], 1, "outside"),
            (vec![bus(1, 1), bus(1, 0)], 1, "twice"),
            (vec![bus(1, 2)], 1, "node 2 does not exist"),
        ] {
            let e = create_acpi_tables(&with(buses, end)).unwrap_err();
            assert!(
                matches!(e, AcpiTableError::RootBus { .. }) && e.to_string().contains(what),
                "{e}"
            );
        }
    }

    fn iasl_available() -> bool {
        Command::new("iasl").arg("-v").output().is_ok()
    }

    /// Disassembles every table with `iasl -d` and recompiles the DSDT's ASL: the closest
    /// offline check that a Linux guest's ACPICA will accept the AML.
    #[test]
    fn iasl_accepts_the_tables() {
        if !iasl_available() {
            // CI installs acpica-tools (scripts/setup.sh): there a missing iasl is a failure.
            assert!(
                std::env::var_os("CI").is_none(),
                "iasl not found in CI (apt-get install acpica-tools)"
            );
            eprintln!(
                "SKIPPED iasl_accepts_the_tables: iasl not found (apt-get install acpica-tools)"
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        // Node 1's devices on a root bus of their own, with the upper halves of the windows;
        // a switch on each root bus (bus 0's takes bus 1, so node 1's root bus is bus 2).
        let cfg = AcpiConfig {
            pci_slot_gsis: Some([16; 32]),
            numa: two_nodes(),
            pci_bus_end: 3,
            io_size: 0x7800,
            mmio32_size: 0x1000_0000,
            mmio64_base: 1 << 40,
            mmio64_size: 1 << 39,
            root_buses: vec![RootBus {
                bus: 2,
                index: 1,
                last_bus: 3,
                node: 1,
                io: (0x8800, 0x4000),
                mmio32: (0xd000_0000, 0x1000_0000),
                mmio64: ((1 << 40) + (1 << 39), 1 << 39),
            }],
            switches: vec![
                Switch {
                    index: 2,
                    number: 1,
                    root: 0,
                    device: 1,
                    ports: 3,
                },
                Switch {
                    index: 3,
                    number: 3,
                    root: 1,
                    device: 1,
                    ports: 2,
                },
            ],
            ..config(2)
        };
        let t = create_acpi_tables(&cfg).unwrap();
        assert!(t.get(b"SRAT").is_some() && t.get(b"SLIT").is_some());
        // MCFG reaches bus 3 (its last byte is the end bus).
        let mcfg = &t.get(b"MCFG").unwrap().bytes;
        assert_eq!(mcfg[mcfg.len() - 5], 3, "{mcfg:x?}");
        assert!(contains(&t.get(b"DSDT").unwrap().bytes, b"_PXM"));
        assert!(
            !contains(&create_dsdt(&config(2)), b"_PXM"),
            "no _PXM without nodes"
        );
        for table in &t.tables[1..] {
            let name = String::from_utf8_lossy(&table.signature).to_lowercase();
            let path = dir.path().join(format!("{name}.dat"));
            std::fs::write(&path, &table.bytes).unwrap();
            let out = Command::new("iasl")
                .current_dir(dir.path())
                .args(["-d", path.to_str().unwrap()])
                .output()
                .unwrap();
            let log = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(out.status.success(), "iasl -d {name}:\n{log}");
            let dsl = std::fs::read_to_string(dir.path().join(format!("{name}.dsl"))).unwrap();
            if std::env::var_os("ACPI_DUMP").is_some() {
                eprintln!("{log}\n{dsl}");
            }
            for bad in ["Invalid", "**** ", "Error", "error"] {
                assert!(!dsl.contains(bad), "{name}.dsl contains {bad:?}:\n{dsl}");
            }
        }
        // Recompile the disassembled DSDT: any unresolved name or malformed object fails here.
        let out = Command::new("iasl")
            .current_dir(dir.path())
            .args(["-p", "recompiled", "dsdt.dsl"])
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "iasl dsdt.dsl:\n{log}");
        assert!(log.contains(" 0 Errors, 0 Warnings"), "{log}");
        eprintln!("iasl recompile of the DSDT:\n{log}");
        let dsl = std::fs::read_to_string(dir.path().join("dsdt.dsl")).unwrap();
        for needle in [
            "Device (\\_SB.PCI0)",
            "Method (PCNT",
            "Device (S05)",
            "Method (_EJ0",
            "\"ACPI0013\"",
            "Method (_EVT",
            "Notify (\\_SB.PCI0.S05, Arg1)",
            // Node 1's root bus: its number, node, slots and hot-plug methods, called by
            // the GED.
            "Device (\\_SB.PC01)",
            "Name (_BBN, 0x02)",
            "Name (_PXM, One)",
            "Notify (\\_SB.PC01.S05, Arg1)",
            "\\_SB.PC01.PCEJ (0x05)",
            "\\_SB.PC01.PCNT ()",
            // The switches: their bridges' slots hold their ports and hot-plug methods, and
            // the GED calls those too.
            "Notify (\\_SB.PCI0.S01.S02, Arg1)",
            "\\_SB.PCI0.S01.PCEJ (0x02)",
            "\\_SB.PCI0.S01.PCNT ()",
            "Notify (\\_SB.PC01.S01.S01, Arg1)",
            "\\_SB.PC01.S01.PCNT ()",
            "Name (_SUN, 0x61)",
        ] {
            assert!(dsl.contains(needle), "dsdt.dsl lacks {needle:?}:\n{dsl}");
        }
    }
}
