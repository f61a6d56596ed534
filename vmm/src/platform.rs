//! Hotplug platform: ACPI tables in guest RAM, the ACPI GED (MMIO 0xFE00_0000, GSI 5 through a
//! KVM irqfd without resample: one write = one edge) and the PCI hotplug controller
//! (MMIO 0xFE00_1000), per `docs/CONTRACTS.md`.
//!
//! INTx: slot `s` of bus 0 uses IOAPIC GSI `16 + s % 8` for all of INTA..INTD (the DSDT's
//! `_PRT` says so); remote devices with an interrupt pin get that GSI.

use std::sync::{Arc, Mutex};

use acpi::{
    create_acpi_tables, eject_channel, AcpiConfig, EjectReceiver, GedDevice, GedInterrupt,
    PciHotplugController, GED_GSI, GED_SIZE, GED_START, PCI_HOTPLUG_SIZE, PCI_HOTPLUG_START,
};
use kvm_ioctls::VmFd;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::memory::GuestMemory;

/// First IOAPIC GSI used for PCI INTx.
pub const PCI_INTX_GSI_BASE: u32 = 16;

/// Errors of the platform set-up.
#[derive(Debug, thiserror::Error)]
pub enum PlatformError {
    #[error("cannot create the {what} eventfd")]
    EventFd {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot register the GED irqfd on GSI {gsi}")]
    Irqfd {
        gsi: u32,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("cannot place the {what} on the MMIO bus")]
    Bus {
        what: &'static str,
        #[source]
        source: pci::BusError,
    },
    #[error("acpi tables")]
    Tables(#[from] acpi::AcpiTableError),
    #[error("acpi hotplug")]
    Hotplug(#[from] acpi::HotplugError),
    #[error("cannot write the acpi tables to guest memory at {0:#x}")]
    GuestWrite(u64),
}

/// IOAPIC GSI of INTx for slot number `slot` (any root bus: every bus's `_PRT` routes its
/// device `d` to the GSI of `d`).
pub fn slot_intx_gsi(slot: u8) -> u32 {
    PCI_INTX_GSI_BASE + u32::from(slot % 8)
}

/// An irqfd registered with KVM; unregistered on drop.
pub struct IrqFd {
    vm: Arc<VmFd>,
    evt: EventFd,
    gsi: u32,
}

impl IrqFd {
    /// Registers a new eventfd on `gsi` (no resample: each write is one edge).
    pub fn new(vm: Arc<VmFd>, gsi: u32) -> Result<Self, PlatformError> {
        let evt = EventFd::new(libc::EFD_NONBLOCK).map_err(|source| PlatformError::EventFd {
            what: "GED",
            source,
        })?;
        vm.register_irqfd(&evt, gsi)
            .map_err(|source| PlatformError::Irqfd { gsi, source })?;
        Ok(Self { vm, evt, gsi })
    }

    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }
}

impl Drop for IrqFd {
    fn drop(&mut self) {
        if let Err(e) = self.vm.unregister_irqfd(&self.evt, self.gsi) {
            log::warn!("unregistering the irqfd of GSI {}: {e}", self.gsi);
        }
    }
}

/// GED, hotplug controller and the eject channel.
pub struct Platform {
    hotplug: Arc<Mutex<PciHotplugController>>,
    ejects: Option<EjectReceiver>,
    rsdp: u64,
    _ged_irq: IrqFd,
}

impl Platform {
    /// Creates GED + hotplug controller on the devices' MMIO bus, and writes the ACPI tables
    /// for `cpus` vCPUs and the devices' PCI tree (its buses, their slots and windows within
    /// the 64-bit BAR window) into `mem`.
    pub fn new(
        vm: &Arc<VmFd>,
        devices: &crate::device_manager::DeviceManager,
        mem: &GuestMemory,
        cpus: u8,
        numa: Vec<acpi::NumaNode>,
    ) -> Result<Self, PlatformError> {
        let mmio = devices.mmio_bus();
        let mmio64 = devices.mmio64();
        let pci_slots = devices.pci_bus().slots();
        let layout = devices.pci_bus().layout();
        let irq = IrqFd::new(vm.clone(), GED_GSI)?;
        let ged_evt = irq
            .eventfd()
            .try_clone()
            .map_err(|source| PlatformError::EventFd {
                what: "GED clone",
                source,
            })?;
        let ged = GedDevice::new(GedInterrupt::IrqFd(ged_evt));
        let (eject_tx, eject_rx) = eject_channel()?;
        let hotplug = Arc::new(Mutex::new(PciHotplugController::new(
            ged.notifier(),
            Box::new(eject_tx),
        )));
        mmio.insert(Arc::new(Mutex::new(ged)), GED_START, GED_SIZE)
            .map_err(|source| PlatformError::Bus {
                what: "ACPI GED",
                source,
            })?;
        mmio.insert(hotplug.clone(), PCI_HOTPLUG_START, PCI_HOTPLUG_SIZE)
            .map_err(|source| PlatformError::Bus {
                what: "PCI hotplug controller",
                source,
            })?;
        let mut gsis = [0u32; 32];
        for (slot, g) in gsis.iter_mut().enumerate() {
            *g = slot_intx_gsi(slot as u8);
        }
        // A root bus per NUMA node (node n on bus index n), each with its slice of the
        // windows (its switches' parts included: their bridges forward from it); bus 0
        // (node 0) keeps `\_SB_.PCI0`. Switches take the bus numbers after their root bus.
        let buses = layout.root_count();
        let windows = |b| pci::device::root_bus_windows(b, buses, mmio64);
        let [io0, mmio32_0, mmio64_0] = windows(0);
        let root_buses = (1..buses)
            .map(|b| {
                let [io, mmio32, mmio64] = windows(b);
                acpi::RootBus {
                    bus: layout.entry(b).map_or(b, |e| e.number),
                    index: b,
                    last_bus: layout.last_number_under(b),
                    node: u32::from(b),
                    io,
                    mmio32,
                    mmio64,
                }
            })
            .collect();
        let switches = layout
            .switches()
            .filter_map(|(index, e)| match e.kind {
                pci::BusKind::Switch {
                    root,
                    bridge_slot,
                    ports,
                } => Some(acpi::Switch {
                    index,
                    number: e.number,
                    root,
                    device: pci::root::slot_device(bridge_slot),
                    ports,
                }),
                pci::BusKind::Root => None,
            })
            .collect();
        let tables = create_acpi_tables(&AcpiConfig {
            num_vcpus: u32::from(cpus),
            pci_bus_end: layout.last_number(),
            switches,
            io_base: io0.0 as u16,
            io_size: io0.1 as u32,
            mmio32_base: mmio32_0.0,
            mmio32_size: mmio32_0.1,
            mmio64_base: mmio64_0.0,
            mmio64_size: mmio64_0.1,
            root_buses,
            pci_slot_gsis: Some(gsis),
            pci_slots,
            numa,
            ..Default::default()
        })?;
        tables.write_to(|gpa, bytes| {
            mem.write_slice(bytes, GuestAddress(gpa))
                .map_err(|_| PlatformError::GuestWrite(gpa))
        })?;
        let rsdp = tables.rsdp_addr;
        log::debug!(
            "acpi tables at {rsdp:#x}..{:#x}; GED on GSI {GED_GSI}",
            tables.end()
        );
        Ok(Self {
            hotplug,
            ejects: Some(eject_rx),
            rsdp,
            _ged_irq: irq,
        })
    }

    /// The hotplug controller (also on the MMIO bus).
    pub fn hotplug(&self) -> &Arc<Mutex<PciHotplugController>> {
        &self.hotplug
    }

    /// The eject channel's receiving end (taken once by the VMM loop).
    pub fn take_ejects(&mut self) -> Option<EjectReceiver> {
        self.ejects.take()
    }

    /// Guest physical address of the RSDP.
    pub fn rsdp_addr(&self) -> u64 {
        self.rsdp
    }
}
