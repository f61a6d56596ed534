//! lendvm's VMM: a KVM VM with guest RAM in a memfd, vCPU threads, legacy devices, the PCI root
//! complex and the interrupt / VM-operation services that PCI device models (the remote PCI
//! device in particular) plug into.

pub mod arch;
pub mod cmdline;
pub mod config;
pub mod control;
pub mod cpuid;
pub mod device_events;
pub mod device_manager;
pub mod dma;
pub mod event_loop;
pub mod exit;
pub mod id_alloc;
pub mod interrupt;
pub mod layout;
pub mod legacy;
pub mod loader;
pub mod memory;
pub mod metrics;
pub mod migration;
pub mod numa;
pub mod platform;
pub mod remote;
pub mod snapshot;
pub mod stats;
pub mod vcpu;
pub mod vm;
pub mod vm_ops;

#[cfg(test)]
mod doorbell_tests;

pub use config::{SerialConfig, VmConfig};
pub use exit::VmExit;
pub use vm::{Vm, VmError};
