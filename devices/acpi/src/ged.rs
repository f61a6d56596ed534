//! ACPI Generic Event Device (GED, `ACPI0013`) for a hardware-reduced ACPI platform.
//!
//! One 32-bit event status register at MMIO [`GED_START`]. The VMM (or the PCI hotplug
//! controller) calls [`GedNotifier::notify`] with event bits; the bits are ORed into the status
//! register and the GED interrupt (IOAPIC GSI [`GED_GSI`], edge, active high) is raised. The
//! guest's `_EVT` method reads the register, which returns the pending bits and clears them.
//!
//! # Interrupt choice
//!
//! The GED interrupt is edge-triggered (see `docs/CONTRACTS.md` and the `_CRS` in the DSDT).
//! The recommended wiring is [`GedInterrupt::IrqFd`]: an `EventFd` the VMM registers with
//! `KVM_IRQFD` on GSI 5 **without** `KVM_IRQFD_FLAG_RESAMPLE`. Every write to such an irqfd
//! makes KVM pulse the line (assert then de-assert), i.e. one edge per notification.
//!
//! [`GedInterrupt::Group`] accepts a `pci::interrupt::InterruptSourceGroup` whose
//! `trigger(0)` raises the interrupt. It must produce an edge (pulse) per trigger. Do **not**
//! pass a group from `InterruptManager::create_intx_group`: that one is level-triggered with
//! a resample eventfd, and on an edge-configured IOAPIC pin the local APIC never broadcasts the
//! EOI, so the line would stay asserted and every later notification would be lost.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use log::{debug, warn};
use pci::interrupt::{InterruptError, InterruptSourceGroup};
use pci::{BusDevice, RestoreError, Snapshottable};
use vmm_sys_util::eventfd::EventFd;

/// Guest physical address of the GED event status register.
pub const GED_START: u64 = 0xfe00_0000;
/// Size of the GED MMIO range (one 32-bit register).
pub const GED_SIZE: u64 = 4;
/// IOAPIC GSI of the GED interrupt.
pub const GED_GSI: u32 = 5;
/// GED status bit: a PCI hotplug event is pending (`_EVT` calls `\_SB_.PCI0.PCNT`).
pub const GED_EVENT_PCI_HOTPLUG: u32 = 1 << 1;

/// Errors of the GED.
#[derive(Debug, thiserror::Error)]
pub enum GedError {
    #[error("failed to signal the ged irqfd")]
    IrqFd(#[source] std::io::Error),
    #[error("failed to trigger the ged interrupt group")]
    Group(#[source] InterruptError),
}

/// How the GED raises its interrupt (see the module docs for which to choose).
pub enum GedInterrupt {
    /// A KVM irqfd on the GED GSI, registered without resample: one write = one edge.
    IrqFd(EventFd),
    /// An interrupt group whose source 0 is the GED GSI; `trigger(0)` must pulse the line.
    Group(Arc<dyn InterruptSourceGroup>),
}

impl GedInterrupt {
    fn trigger(&self) -> Result<(), GedError> {
        match self {
            GedInterrupt::IrqFd(fd) => fd.write(1).map_err(GedError::IrqFd),
            GedInterrupt::Group(group) => group.trigger(0).map_err(GedError::Group),
        }
    }
}

struct GedShared {
    status: AtomicU32,
    interrupt: GedInterrupt,
}

/// Cloneable handle that posts events to a [`GedDevice`] (lock-free, usable from any thread).
#[derive(Clone)]
pub struct GedNotifier {
    shared: Arc<GedShared>,
}

impl GedNotifier {
    /// ORs `event_bits` into the status register and raises the GED interrupt.
    ///
    /// The bits stay set even if raising the interrupt fails, so a later notification still
    /// reports them. `event_bits == 0` does nothing.
    pub fn notify(&self, event_bits: u32) -> Result<(), GedError> {
        if event_bits == 0 {
            return Ok(());
        }
        self.shared.status.fetch_or(event_bits, Ordering::SeqCst);
        debug!("ged: event {event_bits:#x}");
        self.shared.interrupt.trigger()
    }

    /// Current (not yet read by the guest) event bits.
    pub fn pending(&self) -> u32 {
        self.shared.status.load(Ordering::SeqCst)
    }
}

/// Saved state of the GED: the event bits the guest has not read yet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GedState {
    pub status: u32,
}

impl Snapshottable for GedNotifier {
    type State = GedState;

    fn snapshot(&self) -> GedState {
        GedState {
            status: self.pending(),
        }
    }

    /// Sets the unread event bits without raising the interrupt again: an edge raised before
    /// the snapshot is part of the in-kernel IOAPIC's saved state.
    fn restore(&mut self, state: &GedState) -> Result<(), RestoreError> {
        self.shared.status.store(state.status, Ordering::SeqCst);
        Ok(())
    }
}

/// The GED MMIO device; put it on the MMIO bus at [`GED_START`], length [`GED_SIZE`].
pub struct GedDevice {
    shared: Arc<GedShared>,
}

impl GedDevice {
    /// Creates a GED that raises `interrupt` on every notification.
    pub fn new(interrupt: GedInterrupt) -> Self {
        Self {
            shared: Arc::new(GedShared {
                status: AtomicU32::new(0),
                interrupt,
            }),
        }
    }

    /// A handle for posting events (give one to the hotplug controller, keep one in the VMM).
    pub fn notifier(&self) -> GedNotifier {
        GedNotifier {
            shared: self.shared.clone(),
        }
    }

    /// Same as `self.notifier().notify(event_bits)`.
    pub fn notify(&self, event_bits: u32) -> Result<(), GedError> {
        self.notifier().notify(event_bits)
    }
}

/// Mask of the register bits covered by an access of `len` bytes at byte `offset` of a 32-bit
/// register, or `None` if the access is not inside the register.
pub(crate) fn access_mask(offset: u64, len: usize) -> Option<u32> {
    let end = offset.checked_add(len as u64)?;
    if len == 0 || end > 4 {
        return None;
    }
    let bits = (len as u32) * 8;
    let mask = if bits >= 32 {
        u32::MAX
    } else {
        (1u32 << bits) - 1
    };
    Some(mask << (offset as u32 * 8))
}

/// Copies the bytes of `value` selected by an access at `offset` into `data`.
pub(crate) fn read_bytes(value: u32, offset: u64, data: &mut [u8]) {
    let bytes = value.to_le_bytes();
    for (i, b) in data.iter_mut().enumerate() {
        *b = bytes.get(offset as usize + i).copied().unwrap_or(0);
    }
}

/// Assembles the bytes of a write at `offset` into a register-aligned value.
pub(crate) fn write_value(offset: u64, data: &[u8]) -> u32 {
    let mut bytes = [0u8; 4];
    for (i, b) in data.iter().enumerate() {
        if let Some(slot) = bytes.get_mut(offset as usize + i) {
            *slot = *b;
        }
    }
    u32::from_le_bytes(bytes)
}

impl BusDevice for GedDevice {
    /// Returns the status bytes read and clears exactly the bits that were returned.
    fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
        let Some(mask) = access_mask(offset, data.len()) else {
            warn!(
                "ged: read of {} bytes at offset {offset:#x} outside the status register",
                data.len()
            );
            data.fill(0);
            return;
        };
        let value = self.shared.status.fetch_and(!mask, Ordering::SeqCst) & mask;
        read_bytes(value, offset, data);
    }

    fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
        debug!(
            "ged: ignoring guest write of {} bytes at offset {offset:#x}",
            data.len()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pci::interrupt::{InterruptIndex, MsiIrqSourceConfig};
    use std::sync::atomic::AtomicUsize;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    fn read_status(ged: &mut GedDevice) -> u32 {
        let mut data = [0u8; 4];
        ged.read(GED_START, 0, &mut data);
        u32::from_le_bytes(data)
    }

    #[test]
    fn status_read_clears_and_irqfd_is_signalled() {
        let fd = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut ged = GedDevice::new(GedInterrupt::IrqFd(fd.try_clone().unwrap()));
        assert_eq!(read_status(&mut ged), 0);
        assert!(fd.read().is_err(), "no interrupt before any event");

        ged.notify(GED_EVENT_PCI_HOTPLUG).unwrap();
        ged.notifier().notify(1 << 4).unwrap();
        assert_eq!(fd.read().unwrap(), 2, "one edge per notification");
        assert_eq!(ged.notifier().pending(), GED_EVENT_PCI_HOTPLUG | (1 << 4));

        assert_eq!(read_status(&mut ged), GED_EVENT_PCI_HOTPLUG | (1 << 4));
        assert_eq!(read_status(&mut ged), 0, "read clears");

        // notify(0) is a no-op and raises nothing.
        ged.notify(0).unwrap();
        assert!(fd.read().is_err());
    }

    #[test]
    fn partial_reads_clear_only_returned_bits_and_writes_are_ignored() {
        let fd = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut ged = GedDevice::new(GedInterrupt::IrqFd(fd));
        ged.notify(0x0102).unwrap();
        let mut b = [0u8; 1];
        ged.read(GED_START, 1, &mut b);
        assert_eq!(b, [0x01]);
        assert_eq!(ged.notifier().pending(), 0x02);
        ged.write(GED_START, 0, &[0xff, 0xff, 0xff, 0xff]);
        assert_eq!(ged.notifier().pending(), 0x02);
        let mut out = [0xaau8; 8];
        ged.read(GED_START, 0, &mut out);
        assert_eq!(out, [0; 8], "out-of-range access reads zero");
        assert_eq!(read_status(&mut ged), 0x02);
    }

    struct CountingGroup {
        triggers: AtomicUsize,
    }

    impl InterruptSourceGroup for CountingGroup {
        fn trigger(&self, index: InterruptIndex) -> Result<(), InterruptError> {
            assert_eq!(index, 0);
            self.triggers.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn notifier(&self, _index: InterruptIndex) -> Option<&EventFd> {
            None
        }
        fn update(
            &self,
            _index: InterruptIndex,
            _config: MsiIrqSourceConfig,
            _masked: bool,
        ) -> Result<(), InterruptError> {
            Err(InterruptError::Unsupported("update"))
        }
        fn enable(&self) -> Result<(), InterruptError> {
            Ok(())
        }
        fn disable(&self) -> Result<(), InterruptError> {
            Ok(())
        }
        fn count(&self) -> InterruptIndex {
            1
        }
    }

    #[test]
    fn interrupt_group_is_triggered() {
        let group = Arc::new(CountingGroup {
            triggers: AtomicUsize::new(0),
        });
        let mut ged = GedDevice::new(GedInterrupt::Group(group.clone()));
        ged.notify(GED_EVENT_PCI_HOTPLUG).unwrap();
        assert_eq!(group.triggers.load(Ordering::SeqCst), 1);
        assert_eq!(read_status(&mut ged), GED_EVENT_PCI_HOTPLUG);
    }

    #[test]
    fn access_mask_covers_bytes() {
        assert_eq!(access_mask(0, 4), Some(u32::MAX));
        assert_eq!(access_mask(1, 1), Some(0xff00));
        assert_eq!(access_mask(2, 2), Some(0xffff_0000));
        assert_eq!(access_mask(3, 2), None);
        assert_eq!(access_mask(0, 0), None);
        assert_eq!(write_value(2, &[0x34, 0x12]), 0x1234_0000);
    }
}
