//! `remote_pci`: the VMM-side model of a PCI device borrowed from a lender over the NTB
//! fabric (device lending). [`RemotePciDevice`] implements [`pci::PciDevice`] against three
//! seams: the lender ([`RemoteDeviceLink`]), the VM ([`pci::VmOps`]) and the interrupt
//! controller ([`pci::InterruptManager`]). [`lending_link::LendingLink`] implements the
//! link over `lending::client`.

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod device;
pub mod lending_link;
pub mod link;
pub mod observer;
pub mod p2p;
pub mod pin;

#[cfg(test)]
mod device_tests;
#[cfg(test)]
mod testing;

pub use device::{
    DeviceCounters, DeviceCountersSnapshot, RemoteDeviceStatus, RemotePciDevice,
    RemotePciDeviceParams, RemotePciError,
};
pub use link::{
    BarAccess, BarKind, DeviceDirtyPages, DirectWindow, DmaMapping, HandoverState,
    IommuFaultReport, IrqKind, IrqTargets, KickCell, KickDoorbells, LeaseMigration, LeaseState,
    LeaseTicket, LenderCounters, LinkError, LinkEventHook, RemoteBar, RemoteDeviceInfo,
    RemoteDeviceLink, RemoteIoEvent, RemoteMsix,
};
pub use observer::DeviceObserver;
pub use p2p::{P2pMapError, P2pMember, P2pPort, P2pRouter, PeerGrant, PeerMapping};
pub use pin::{
    split_range, DmaPin, DmaPinSource, MlockPinner, ParallelPinner, PinError, PinStats,
    PinnedRange, Pinner, PrivatePins,
};
