//! Interrupt seams between PCI device models and the VMM's KVM interrupt code.
//!
//! Quick reference (the VMM implements these with KVM irqfds + GSI routing; `remote_pci` and
//! the MSI/MSI-X emulation in this crate consume them):
//!
//! ```text
//! pub type InterruptIndex = u32;
//! pub struct MsiIrqSourceConfig { pub high_addr: u32, pub low_addr: u32, pub data: u32, pub devid: u32 }
//!
//! pub trait InterruptSourceGroup: Send + Sync {
//!     fn trigger(&self, index: InterruptIndex) -> Result<(), InterruptError>;
//!     fn notifier(&self, index: InterruptIndex) -> Option<&EventFd>;          // irqfd eventfd
//!     fn update(&self, index: InterruptIndex, config: MsiIrqSourceConfig,
//!               masked: bool) -> Result<(), InterruptError>;                 // MSI groups
//!     fn enable(&self) -> Result<(), InterruptError>;
//!     fn disable(&self) -> Result<(), InterruptError>;
//!     fn count(&self) -> InterruptIndex;
//!     fn resample_notifier(&self, index) -> Option<&EventFd> { None }        // INTx groups
//! }
//!
//! pub trait InterruptManager: Send + Sync {
//!     fn create_msi_group(&self, count: InterruptIndex)
//!         -> Result<Arc<dyn InterruptSourceGroup>, InterruptError>;
//!     fn create_intx_group(&self, irq: u32)
//!         -> Result<Arc<dyn InterruptSourceGroup>, InterruptError>;
//! }
//! ```
//!
//! Semantics (shape of Cloud Hypervisor's `vm-device::interrupt`, without `set_gsi`):
//! * An MSI group owns `count` vectors, each with its own irqfd `EventFd`. GSIs and irqfds are
//!   allocated by the implementation (lazily on the first unmasked `update` is fine) and are
//!   released when the group is dropped (`Drop` on the implementing type).
//! * A vector is delivered iff the group is enabled and the vector is unmasked.
//! * `update(index, cfg, masked)` records the MSI address/data of vector `index` and its
//!   mask. Unmasked (and group enabled): the route is installed and the irqfd registered, so
//!   a write to `notifier(index)` (by anyone, e.g. a lender relay thread) injects the MSI
//!   directly in KVM. Masked: the irqfd is unregistered (eventfd writes stay in its counter
//!   and KVM delivers them when the irqfd is registered again); the PCI layer keeps the PBA.
//! * `enable()` registers the irqfds of all unmasked vectors; `disable()` unregisters all.
//!   The PCI layer calls `enable()` *before* unmasking vectors when MSI(-X) Enable is set,
//!   and masks vectors *before* calling `disable()` when it is cleared.
//! * `trigger(index)` injects vector `index` now (writes its eventfd or uses KVM_SIGNAL_MSI).
//! * An INTx group has exactly one source (index 0) bound to IOAPIC pin `irq`; `trigger(0)`
//!   asserts the level-triggered line (irqfd with resample); `resample_notifier(0)` is the
//!   resample eventfd KVM signals after the guest's EOI, at which point the device must
//!   re-`trigger` if its interrupt condition still holds. `update` on an INTx group returns
//!   [`InterruptError::Unsupported`].

use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

/// Index of an interrupt source (vector) inside a group.
pub type InterruptIndex = u32;

/// MSI message of one vector, as programmed by the guest into MSI/MSI-X registers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MsiIrqSourceConfig {
    /// Message Address bits 63:32.
    pub high_addr: u32,
    /// Message Address bits 31:0.
    pub low_addr: u32,
    /// Message Data.
    pub data: u32,
    /// Requester id (bus << 8 | devfn); only used where KVM needs `KVM_MSI_VALID_DEVID`.
    pub devid: u32,
}

/// Errors of interrupt groups and managers.
#[derive(Debug, thiserror::Error)]
pub enum InterruptError {
    #[error("interrupt index {index} is out of range for a group of {count}")]
    InvalidIndex {
        index: InterruptIndex,
        count: InterruptIndex,
    },
    #[error("operation not supported by this interrupt group: {0}")]
    Unsupported(&'static str),
    #[error("interrupt resources exhausted: {0}")]
    Exhausted(String),
    #[error("interrupt backend operation {op} failed")]
    Backend {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// A set of interrupt sources of one device (all MSI/MSI-X vectors, or one INTx pin).
///
/// Implementations free their GSIs and irqfds in `Drop`.
pub trait InterruptSourceGroup: Send + Sync {
    /// Injects interrupt `index` now.
    fn trigger(&self, index: InterruptIndex) -> Result<(), InterruptError>;

    /// The irqfd eventfd of source `index`: writing 1 to it injects the interrupt when the
    /// source is enabled and unmasked. `None` if `index` is out of range.
    fn notifier(&self, index: InterruptIndex) -> Option<&EventFd>;

    /// Sets the MSI message of vector `index` and whether it is masked (see module docs).
    fn update(
        &self,
        index: InterruptIndex,
        config: MsiIrqSourceConfig,
        masked: bool,
    ) -> Result<(), InterruptError>;

    /// Enables delivery of all unmasked sources (registers irqfds).
    fn enable(&self) -> Result<(), InterruptError>;

    /// Disables delivery of all sources (unregisters irqfds; routes may stay allocated).
    fn disable(&self) -> Result<(), InterruptError>;

    /// Number of sources in the group.
    fn count(&self) -> InterruptIndex;

    /// INTx only: the resample eventfd KVM signals after the guest's EOI of source `index`.
    fn resample_notifier(&self, _index: InterruptIndex) -> Option<&EventFd> {
        None
    }

    /// Whether the destination of an MSI message exists on the platform (on x86: a local
    /// APIC that some vCPU has). The PCI layer routes no message whose destination does not
    /// exist, as it routes no message outside the LAPIC window
    /// ([`crate::msix::msi_message_valid`]). Default: every destination exists.
    fn destination_exists(&self, _config: &MsiIrqSourceConfig) -> bool {
        true
    }
}

/// Factory for interrupt groups, implemented by the VMM.
pub trait InterruptManager: Send + Sync {
    /// Creates a group of `count` MSI / MSI-X vectors, all initially masked and disabled.
    fn create_msi_group(
        &self,
        count: InterruptIndex,
    ) -> Result<Arc<dyn InterruptSourceGroup>, InterruptError>;

    /// Creates a one-source, level-triggered INTx group on IOAPIC pin / GSI `irq`, with an
    /// irqfd and a resample eventfd.
    fn create_intx_group(&self, irq: u32) -> Result<Arc<dyn InterruptSourceGroup>, InterruptError>;
}
