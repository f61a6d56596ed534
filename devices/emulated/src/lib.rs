//! Lender-side emulated PCI device models.
//!
//! Two devices live here: an NVMe 1.4 controller backed by a file ([`nvme::NvmeController`])
//! and a small `dmatest` copy engine ([`dmatest::DmaTest`]). Both implement [`DeviceModel`] so
//! the lender can host them generically.
//!
//! The seams every device uses, and nothing else:
//!
//! * [`DmaMemory`]: all device DMA (queue entries, PRP lists, data). The lender implements it
//!   with a bounds-checking software IOMMU over the borrower's RAM window.
//! * [`InterruptSink`]: signal an MSI-X vector or drive INTx.
//! * [`RegisterMemory`]: the BAR holding the register file lives in caller-provided memory
//!   (a fabric window on shm, a heap buffer in tests). Each model names, per BAR, the
//!   [`DoorbellRange`] whose writes may be stored straight into that memory followed by a
//!   [`DeviceModel::doorbell_event`] signal; every other write must go through the exact
//!   [`DeviceModel::bar_write`] (the worker only finds stored writes by diffing, which cannot
//!   see a write of the value already there).
//!
//! `testing` (feature `testing`, which only dev-dependencies turn on) holds reusable test
//! doubles and a guest-side NVMe driver used by this crate's tests and benchmark, and by the
//! lender's "lent" tests.

pub mod dma;
pub mod dmatest;
pub mod engine;
pub mod epftest;
pub mod irq;
pub mod model;
pub mod nvme;
pub mod rebar;
pub mod regs;
pub mod sriov;
#[cfg(feature = "testing")]
pub mod testing;
mod waiter;
/// The NVMe bench workload (on `testing`'s driver).
#[cfg(feature = "testing")]
pub mod workload;

pub use dma::{DmaFault, DmaMemory, RawSpan};
pub use irq::{InterruptMode, InterruptSink};
pub use model::{
    BarInfo, DeviceError, DeviceModel, DoorbellRange, KickDoorbells, KickListener, MsixInfo,
    PciIdentity, ResizableBar,
};
pub use regs::{HeapRegisters, MappedRegisters, RawRegisters, RegisterMemory};

/// How a device's worker thread learns about register writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NotifyMode {
    /// The worker sleeps on its doorbell [`vmm_sys_util::eventfd::EventFd`]; whoever stores a
    /// register write (the VMM trap, KVM ioeventfd, or `bar_write`) signals it.
    #[default]
    Interrupt,
    /// The worker polls the register memory with adaptive backoff (spin, yield, then sleep up
    /// to ~1 ms); the doorbell eventfd still wakes it early.
    Polling,
}
