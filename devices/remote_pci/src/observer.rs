//! What the VMM wants to hear from a device model: DMA mapped and unmapped (the
//! `dma-mapped` / `dma-unmapped` events). Called on the thread that made the change (a vCPU
//! for a guest's Bus Master Enable write), so implementations must not block.

use std::time::Duration;

/// Observer of a [`RemotePciDevice`](crate::RemotePciDevice)'s DMA state.
pub trait DeviceObserver: Send + Sync {
    /// Guest RAM was pinned (`pinned` bytes) and mapped for the device (`bytes` at IOVA =
    /// GPA) in `took`.
    fn dma_mapped(&self, id: &str, bytes: u64, pinned: u64, took: Duration);
    /// The mapping of `bytes` was removed and the pins released in `took`.
    fn dma_unmapped(&self, id: &str, bytes: u64, took: Duration);
}
