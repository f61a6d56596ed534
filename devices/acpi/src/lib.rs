//! ACPI tables (RSDP/XSDT/FADT/MADT/MCFG/DSDT), the Generic Event Device and the PCI hotplug controller.
//!
//! Wiring in the VMM (addresses from `docs/CONTRACTS.md`):
//!
//! ```text
//! let irqfd = EventFd::new(EFD_NONBLOCK)?;            // KVM_IRQFD on GSI 5, no resample
//! let ged = GedDevice::new(GedInterrupt::IrqFd(irqfd.try_clone()?));
//! let (eject_tx, eject_rx) = eject_channel()?;         // poll eject_rx.eventfd() in the VMM loop
//! let hotplug = Arc::new(Mutex::new(PciHotplugController::new(ged.notifier(), Box::new(eject_tx))));
//! mmio_bus.insert(Arc::new(Mutex::new(ged)), GED_START, GED_SIZE)?;
//! mmio_bus.insert(hotplug.clone(), PCI_HOTPLUG_START, PCI_HOTPLUG_SIZE)?;
//! let tables = create_acpi_tables(&AcpiConfig { num_vcpus, mmio64_base, mmio64_size, ..Default::default() })?;
//! tables.write_to(|gpa, bytes| guest_memory.write_slice(bytes, GuestAddress(gpa)))?;
//! ```

pub mod ged;
pub mod hotplug;
pub mod tables;

pub use ged::{
    GedDevice, GedError, GedInterrupt, GedNotifier, GedState, GED_EVENT_PCI_HOTPLUG, GED_GSI,
    GED_SIZE, GED_START,
};
pub use hotplug::{
    eject_channel, BusBits, EjectHandler, EjectReceiver, EjectSender, HotplugError, HotplugState,
    PciHotplugController, RemovalRequest, PCI_HOTPLUG_BUSES, PCI_HOTPLUG_SIZE, PCI_HOTPLUG_SLOTS,
    PCI_HOTPLUG_START,
};
pub use tables::{
    create_acpi_tables, create_dsdt, dsdt_aml, root_bus_path, AcpiConfig, AcpiTable,
    AcpiTableError, AcpiTables, NumaNode, RootBus, Switch, ACPI_TABLES_END, ACPI_TABLES_START,
    MAX_NUMA_NODES, NUMA_LOCAL_DISTANCE, NUMA_MAX_DISTANCE,
};
