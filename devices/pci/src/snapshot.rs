//! The seam between device models and the VMM's snapshot code (`vmm::snapshot`): a device
//! hands out its guest-visible state as a plain value and takes it back on restore, so the
//! VMM never reaches into a device's internals. The value is whatever the device chooses;
//! the VMM serialises it (devices that live in crates with serde derive it there).

/// Why a device refused a saved state.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("{device}: saved {what} {value:#x} is out of range")]
    OutOfRange {
        device: &'static str,
        what: &'static str,
        value: u64,
    },
    #[error("{device}: {why}")]
    Invalid { device: &'static str, why: String },
}

/// A device whose state can be saved and restored.
pub trait Snapshottable {
    /// The saved state.
    type State;

    /// The device's state now. The VM is paused, so nothing changes it meanwhile.
    fn snapshot(&self) -> Self::State;

    /// Puts the device back into `state` (on a freshly built device, before the vCPUs run).
    fn restore(&mut self, state: &Self::State) -> Result<(), RestoreError>;
}
