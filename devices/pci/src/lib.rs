//! PCI building blocks shared by the VMM and device models: address buses, the `PciDevice`
//! trait, a configuration-space helper, MSI/MSI-X emulation, the interrupt and VM-ops seams
//! the VMM implements, and the root complex (config mechanism #1 and ECAM).

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod bridge;
pub mod bus;
pub mod configuration;
pub mod device;
pub mod interrupt;
pub mod msi;
pub mod msix;
pub mod root;
pub mod snapshot;
pub mod topology;
pub mod vm_ops;

pub use bus::{Bus, BusDevice, BusError, BusRange, SharedBusDevice};
pub use configuration::{
    ConfigError, PciBarConfiguration, PciBarRegionType, PciConfiguration, PciConfigurationParams,
    PciHeaderType, PciInterruptPin,
};
pub use device::{
    BarAllocation, BarMove, BarRequest, BarResize, CommandChange, ConfigWriteEffects,
    DeviceRelocation, PciBarAllocators, PciDevice, PciDeviceError, SharedBarAllocators,
};
pub use interrupt::{
    InterruptError, InterruptIndex, InterruptManager, InterruptSourceGroup, MsiIrqSourceConfig,
};
pub use msi::{MsiCap, MsiConfig};
pub use msix::{MsixCap, MsixConfig};
pub use root::{PciBdf, PciBus, PciConfigIo, PciConfigMmio, PciHostBridge, SharedPciDevice};
pub use snapshot::{RestoreError, Snapshottable};
pub use topology::{BusEntry, BusKind, BusLayout, SwitchSpec, TopologyError};
pub use vm_ops::{IoEventGuard, MemslotGuard, VmOps};

#[cfg(any(test, feature = "testing"))]
pub mod testing;
