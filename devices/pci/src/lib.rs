//! PCI building blocks shared by the VMM and device models: address buses, the `PciDevice`
//! trait, a configuration-space helper and the root complex (config mechanism #1 and ECAM).

pub mod bus;
pub mod interrupt;
pub mod vm_ops;

pub use bus::{Bus, BusDevice, BusError, SharedBusDevice};
