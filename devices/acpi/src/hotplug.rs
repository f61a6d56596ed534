//! ACPI PCI hotplug controller (Cloud Hypervisor-style register block, PCI segment 0, every
//! root bus).
//!
//! MMIO at [`PCI_HOTPLUG_START`], 16 bytes, all registers 32-bit little endian:
//!
//! | offset | name | guest read | guest write |
//! |---|---|---|---|
//! | 0 | PCIU | slot-up bitmap, cleared by the read | ignored |
//! | 4 | PCID | slot-down (eject request) bitmap, cleared by the read | ignored |
//! | 8 | B0EJ | 0 | `1 << slot`: the guest has released the device, tear it down |
//! | 12 | PSEG | selected root bus | root bus select (0 to [`PCI_HOTPLUG_BUSES`] - 1) |
//!
//! PSEG selects the root bus the other registers are about, as QEMU's `BNUM` does for its
//! expander buses (Cloud Hypervisor selects PCI segments with it; lendvm's extra root buses
//! are in segment 0, one per guest NUMA node). While it selects a bus that does not exist,
//! PCIU/PCID read as 0 (and are not cleared) and B0EJ writes are ignored. A slot is named by
//! its number across buses, `bus * 32 + device`, as `pci::root` names it.
//!
//! # Flow
//!
//! * Hot-add: the VMM puts the device on the PCI bus, then calls
//!   [`PciHotplugController::slot_added`], which sets the PCIU bit and raises the GED event
//!   [`GED_EVENT_PCI_HOTPLUG`]; the guest's `PCNT` sends `Notify(Sxx, 1)` and rescans.
//! * Hot-remove: the VMM calls [`PciHotplugController::slot_removal_requested`] (PCID bit +
//!   GED event). Nothing is torn down yet. The guest unbinds its driver and runs `Sxx._EJ0`,
//!   which writes `1 << slot` to B0EJ; only then is the slot handed to the [`EjectHandler`] and
//!   the VMM removes the device (lease, BAR mappings, interrupts). A second removal request for
//!   a slot already waiting for its eject is a no-op ([`RemovalRequest::AlreadyPending`]).
//!
//! # Eject delivery
//!
//! The B0EJ write runs on a vCPU thread with the controller's bus lock held, so the
//! [`EjectHandler`] must only queue the slot and return (no lender round trips, no waiting).
//! [`eject_channel`] gives a ready-made handler: an `mpsc` channel plus an `EventFd` that the
//! VMM's event loop polls; the loop drains [`EjectReceiver::drain`] and tears the devices down.

use std::sync::mpsc;

use log::{debug, info, warn};
use pci::{BusDevice, RestoreError, Snapshottable};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::ged::GED_EVENT_PCI_HOTPLUG;
use crate::ged::{access_mask, read_bytes, write_value, GedError, GedNotifier};

/// Guest physical address of the hotplug register block.
pub const PCI_HOTPLUG_START: u64 = 0xfe00_1000;
/// Size of the hotplug register block.
pub const PCI_HOTPLUG_SIZE: u64 = 16;
/// Number of slots (PCI devices) on each root bus.
pub const PCI_HOTPLUG_SLOTS: u32 = 32;
/// Root buses the controller serves (`pci::root::MAX_ROOT_BUSES`).
pub const PCI_HOTPLUG_BUSES: u32 = 8;

/// Register offsets.
pub const PCIU_OFFSET: u64 = 0;
pub const PCID_OFFSET: u64 = 4;
pub const B0EJ_OFFSET: u64 = 8;
pub const PSEG_OFFSET: u64 = 12;

/// Errors of the hotplug controller API.
#[derive(Debug, thiserror::Error)]
pub enum HotplugError {
    #[error("pci slot {0} is out of range (0..256: 32 on each of 8 root buses)")]
    SlotOutOfRange(u32),
    #[error("pci slot {0} already holds a device")]
    SlotOccupied(u32),
    #[error("pci slot {0} holds no device")]
    NoDevice(u32),
    #[error("failed to raise the ged hotplug event")]
    Ged(#[from] GedError),
    #[error("failed to create the eject eventfd")]
    EventFd(#[source] std::io::Error),
}

/// Receives slots the guest has ejected (written to B0EJ).
pub trait EjectHandler: Send {
    /// Called on a vCPU thread with the controller locked: queue `slot` and return at once.
    fn slot_ejected(&self, slot: u32);
}

/// Outcome of [`PciHotplugController::slot_removal_requested`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemovalRequest {
    /// The guest was asked to release the slot.
    Requested,
    /// A request for this slot is already waiting for the guest's eject; nothing was done.
    AlreadyPending,
}

/// The [`EjectHandler`] half of [`eject_channel`].
pub struct EjectSender {
    tx: mpsc::Sender<u32>,
    evt: EventFd,
}

impl EjectHandler for EjectSender {
    fn slot_ejected(&self, slot: u32) {
        if self.tx.send(slot).is_err() {
            warn!("pci hotplug: eject of slot {slot} lost, the receiver is gone");
            return;
        }
        if let Err(e) = self.evt.write(1) {
            warn!("pci hotplug: failed to signal the eject eventfd: {e}");
        }
    }
}

/// The VMM half of [`eject_channel`]: poll [`EjectReceiver::eventfd`], then [`drain`](Self::drain).
pub struct EjectReceiver {
    rx: mpsc::Receiver<u32>,
    evt: EventFd,
}

impl EjectReceiver {
    /// Non-blocking eventfd that becomes readable when slots were ejected.
    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }

    /// Resets the eventfd and returns every ejected slot queued so far, oldest first.
    pub fn drain(&self) -> Vec<u32> {
        // The counter only wakes the loop; the channel is the source of truth.
        let _ = self.evt.read();
        self.rx.try_iter().collect()
    }
}

/// Creates an eject channel: give the sender to [`PciHotplugController::new`].
pub fn eject_channel() -> Result<(EjectSender, EjectReceiver), HotplugError> {
    let evt = EventFd::new(EFD_NONBLOCK).map_err(HotplugError::EventFd)?;
    let evt_tx = evt.try_clone().map_err(HotplugError::EventFd)?;
    let (tx, rx) = mpsc::channel();
    Ok((EjectSender { tx, evt: evt_tx }, EjectReceiver { rx, evt }))
}

/// One root bus's slot bitmaps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BusBits {
    /// Slot-up bits not yet read by the guest.
    pub pciu: u32,
    /// Slot-down bits not yet read by the guest.
    pub pcid: u32,
    /// Slots that hold a device (cold- or hot-plugged, not yet ejected).
    pub present: u32,
    /// Slots whose removal was requested and whose eject has not come yet.
    pub pending_removal: u32,
}

/// Saved state of the hotplug controller (its registers and slot bookkeeping): bus 0's
/// bitmaps in the first fields (the format of a VM without NUMA buses), the other buses'
/// in `more_buses`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HotplugState {
    pub pciu: u32,
    pub pcid: u32,
    pub pseg: u32,
    pub present: u32,
    pub pending_removal: u32,
    /// Buses 1.. (only up to the last one with a bit set).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub more_buses: Vec<BusBits>,
}

/// The hotplug register block; put it on the MMIO bus at [`PCI_HOTPLUG_START`] and keep an
/// `Arc<Mutex<PciHotplugController>>` in the VMM for the hotplug API.
pub struct PciHotplugController {
    ged: GedNotifier,
    eject: Box<dyn EjectHandler>,
    /// Root bus selected by the guest.
    pseg: u32,
    /// Each root bus's bitmaps.
    buses: [BusBits; PCI_HOTPLUG_BUSES as usize],
}

/// The root bus and the bit of slot number `slot`.
fn slot_bit(slot: u32) -> Result<(usize, u32), HotplugError> {
    if slot >= PCI_HOTPLUG_SLOTS * PCI_HOTPLUG_BUSES {
        return Err(HotplugError::SlotOutOfRange(slot));
    }
    Ok((
        (slot / PCI_HOTPLUG_SLOTS) as usize,
        1 << (slot % PCI_HOTPLUG_SLOTS),
    ))
}

impl PciHotplugController {
    /// Creates the controller; hotplug events are raised through `ged`, ejects go to `eject`.
    pub fn new(ged: GedNotifier, eject: Box<dyn EjectHandler>) -> Self {
        Self {
            ged,
            eject,
            pseg: 0,
            buses: [BusBits::default(); PCI_HOTPLUG_BUSES as usize],
        }
    }

    /// Records a device that is present at boot (cold-plugged); no guest notification.
    pub fn mark_present(&mut self, slot: u32) -> Result<(), HotplugError> {
        let (bus, bit) = slot_bit(slot)?;
        let b = &mut self.buses[bus];
        if b.present & bit != 0 {
            return Err(HotplugError::SlotOccupied(slot));
        }
        b.present |= bit;
        Ok(())
    }

    /// A device was hot-added at `slot` (already on the PCI bus): tell the guest.
    pub fn slot_added(&mut self, slot: u32) -> Result<(), HotplugError> {
        let (bus, bit) = slot_bit(slot)?;
        let b = &mut self.buses[bus];
        if b.present & bit != 0 {
            return Err(HotplugError::SlotOccupied(slot));
        }
        b.present |= bit;
        b.pciu |= bit;
        // A stale slot-down bit would make PCNT eject the new device right after adding it.
        b.pcid &= !bit;
        info!("pci hotplug: slot {slot} added");
        self.ged.notify(GED_EVENT_PCI_HOTPLUG)?;
        Ok(())
    }

    /// Asks the guest to release the device at `slot`. Teardown waits for the guest's eject.
    pub fn slot_removal_requested(&mut self, slot: u32) -> Result<RemovalRequest, HotplugError> {
        let (bus, bit) = slot_bit(slot)?;
        let b = &mut self.buses[bus];
        if b.present & bit == 0 {
            return Err(HotplugError::NoDevice(slot));
        }
        if b.pending_removal & bit != 0 {
            debug!("pci hotplug: removal of slot {slot} already pending");
            return Ok(RemovalRequest::AlreadyPending);
        }
        b.pending_removal |= bit;
        b.pcid |= bit;
        info!("pci hotplug: removal of slot {slot} requested");
        self.ged.notify(GED_EVENT_PCI_HOTPLUG)?;
        Ok(RemovalRequest::Requested)
    }

    /// The GED this controller raises (its state is saved with the controller's).
    pub fn ged(&self) -> &GedNotifier {
        &self.ged
    }

    /// The GED, to restore its state.
    pub fn ged_mut(&mut self) -> &mut GedNotifier {
        &mut self.ged
    }

    /// Whether `slot` holds a device that has not been ejected.
    pub fn is_present(&self, slot: u32) -> bool {
        slot_bit(slot).is_ok_and(|(bus, bit)| self.buses[bus].present & bit != 0)
    }

    /// Whether a removal of `slot` is waiting for the guest's eject.
    pub fn is_removal_pending(&self, slot: u32) -> bool {
        slot_bit(slot).is_ok_and(|(bus, bit)| self.buses[bus].pending_removal & bit != 0)
    }

    /// Completes the eject of slot number `slot` as if the guest had written it to B0EJ
    /// (for a slot the guest never ejected after a forced removal), without touching the
    /// guest's PSEG selection.
    pub fn complete_eject(&mut self, slot: u32) -> Result<(), HotplugError> {
        let (bus, bit) = slot_bit(slot)?;
        self.eject(bus, bit);
        Ok(())
    }

    /// The guest ejected the slots of `bitmap` on root bus `bus`.
    fn eject(&mut self, bus: usize, bitmap: u32) {
        let b = &mut self.buses[bus];
        for dev in 0..PCI_HOTPLUG_SLOTS {
            let bit = 1u32 << dev;
            if bitmap & bit == 0 {
                continue;
            }
            let slot = bus as u32 * PCI_HOTPLUG_SLOTS + dev;
            if b.present & bit == 0 {
                warn!("pci hotplug: guest ejected empty slot {slot}, ignored");
                continue;
            }
            if b.pending_removal & bit == 0 {
                info!("pci hotplug: guest-initiated eject of slot {slot}");
            }
            b.present &= !bit;
            b.pending_removal &= !bit;
            b.pciu &= !bit;
            b.pcid &= !bit;
            info!("pci hotplug: slot {slot} ejected by the guest");
            self.eject.slot_ejected(slot);
        }
    }
}

impl Snapshottable for PciHotplugController {
    type State = HotplugState;

    fn snapshot(&self) -> HotplugState {
        let b0 = self.buses[0];
        let used = self
            .buses
            .iter()
            .rposition(|b| *b != BusBits::default())
            .unwrap_or(0);
        HotplugState {
            pciu: b0.pciu,
            pcid: b0.pcid,
            pseg: self.pseg,
            present: b0.present,
            pending_removal: b0.pending_removal,
            more_buses: self.buses[1..=used].to_vec(),
        }
    }

    /// Puts the registers back; no guest notification (a raised GED edge is in the saved
    /// irqchip state).
    fn restore(&mut self, s: &HotplugState) -> Result<(), RestoreError> {
        if s.more_buses.len() >= PCI_HOTPLUG_BUSES as usize {
            return Err(RestoreError::Invalid {
                device: "pci hotplug",
                why: format!(
                    "{} root buses saved, at most {PCI_HOTPLUG_BUSES} exist",
                    s.more_buses.len() + 1
                ),
            });
        }
        let mut buses = [BusBits::default(); PCI_HOTPLUG_BUSES as usize];
        buses[0] = BusBits {
            pciu: s.pciu,
            pcid: s.pcid,
            present: s.present,
            pending_removal: s.pending_removal,
        };
        buses[1..=s.more_buses.len()].copy_from_slice(&s.more_buses);
        for (bus, b) in buses.iter().enumerate() {
            if b.pending_removal & !b.present != 0 {
                return Err(RestoreError::Invalid {
                    device: "pci hotplug",
                    why: format!(
                        "removal pending for slots {:#x} of root bus {bus} that hold no device \
                         (present {:#x})",
                        b.pending_removal, b.present
                    ),
                });
            }
        }
        self.pseg = s.pseg;
        self.buses = buses;
        Ok(())
    }
}

impl BusDevice for PciHotplugController {
    fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
        let reg = offset & !3;
        let Some(mask) = access_mask(offset - reg, data.len()) else {
            warn!(
                "pci hotplug: unaligned read of {} bytes at offset {offset:#x}",
                data.len()
            );
            data.fill(0);
            return;
        };
        let bus = self.buses.get_mut(self.pseg as usize);
        let value = match (reg, bus) {
            (PCIU_OFFSET | PCID_OFFSET, None) => 0,
            (PCIU_OFFSET, Some(b)) => {
                let v = b.pciu & mask;
                b.pciu &= !mask;
                v
            }
            (PCID_OFFSET, Some(b)) => {
                let v = b.pcid & mask;
                b.pcid &= !mask;
                v
            }
            (B0EJ_OFFSET, _) => 0,
            (PSEG_OFFSET, _) => self.pseg,
            _ => {
                warn!("pci hotplug: read at offset {offset:#x} outside the registers");
                0
            }
        };
        read_bytes(value, offset - reg, data);
    }

    fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
        let reg = offset & !3;
        let Some(mask) = access_mask(offset - reg, data.len()) else {
            warn!(
                "pci hotplug: unaligned write of {} bytes at offset {offset:#x}",
                data.len()
            );
            return;
        };
        let value = write_value(offset - reg, data);
        match reg {
            B0EJ_OFFSET if self.pseg >= PCI_HOTPLUG_BUSES => {
                warn!(
                    "pci hotplug: eject {value:#x} on root bus {} ignored (0 to {} exist)",
                    self.pseg,
                    PCI_HOTPLUG_BUSES - 1
                );
            }
            B0EJ_OFFSET => self.eject(self.pseg as usize, value),
            PSEG_OFFSET => {
                self.pseg = (self.pseg & !mask) | value;
                if self.pseg >= PCI_HOTPLUG_BUSES {
                    warn!(
                        "pci hotplug: guest selected root bus {}; 0 to {} exist",
                        self.pseg,
                        PCI_HOTPLUG_BUSES - 1
                    );
                }
            }
            _ => debug!("pci hotplug: ignoring write {value:#x} at offset {offset:#x}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ged::{GedDevice, GedInterrupt};

    struct Rig {
        ctl: PciHotplugController,
        ged: GedDevice,
        irq: EventFd,
        ejects: EjectReceiver,
    }

    fn rig() -> Rig {
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let ged = GedDevice::new(GedInterrupt::IrqFd(irq.try_clone().unwrap()));
        let (tx, ejects) = eject_channel().unwrap();
        let ctl = PciHotplugController::new(ged.notifier(), Box::new(tx));
        Rig {
            ctl,
            ged,
            irq,
            ejects,
        }
    }

    fn rd(ctl: &mut PciHotplugController, offset: u64) -> u32 {
        let mut data = [0u8; 4];
        ctl.read(PCI_HOTPLUG_START, offset, &mut data);
        u32::from_le_bytes(data)
    }

    fn wr(ctl: &mut PciHotplugController, offset: u64, value: u32) {
        ctl.write(PCI_HOTPLUG_START, offset, &value.to_le_bytes());
    }

    fn ged_status(ged: &mut GedDevice) -> u32 {
        let mut data = [0u8; 4];
        ged.read(crate::ged::GED_START, 0, &mut data);
        u32::from_le_bytes(data)
    }

    #[test]
    fn state_round_trips_into_a_fresh_controller_without_a_new_interrupt() {
        let mut r = rig();
        r.ctl.mark_present(1).unwrap();
        r.ctl.slot_added(4).unwrap();
        r.ctl.slot_removal_requested(1).unwrap();
        assert_eq!(r.irq.read().unwrap(), 2);
        let saved = r.ctl.snapshot();
        let ged_saved = r.ctl.ged().snapshot();
        assert_eq!(ged_saved.status, GED_EVENT_PCI_HOTPLUG);

        let mut fresh = rig();
        fresh.ctl.restore(&saved).unwrap();
        fresh.ctl.ged_mut().restore(&ged_saved).unwrap();
        assert!(fresh.irq.read().is_err(), "restoring raised the GED again");
        assert_eq!(fresh.ctl.snapshot(), saved);
        assert!(fresh.ctl.is_present(1) && fresh.ctl.is_present(4));
        assert!(fresh.ctl.is_removal_pending(1));
        assert_eq!(ged_status(&mut fresh.ged), GED_EVENT_PCI_HOTPLUG);
        assert_eq!(rd(&mut fresh.ctl, PCIU_OFFSET), 1 << 4);
        assert_eq!(rd(&mut fresh.ctl, PCID_OFFSET), 1 << 1);
        // The guest's eject of the pending slot still reaches the VMM.
        wr(&mut fresh.ctl, B0EJ_OFFSET, 1 << 1);
        assert_eq!(fresh.ejects.drain(), vec![1]);

        let bad = HotplugState {
            pending_removal: 1 << 7,
            ..saved
        };
        let e = fresh.ctl.restore(&bad).unwrap_err().to_string();
        assert!(e.contains("0x80"), "{e}");
    }

    #[test]
    fn slot_up_bitmap_reads_clear_and_raise_ged() {
        let mut r = rig();
        r.ctl.slot_added(3).unwrap();
        r.ctl.slot_added(5).unwrap();
        assert_eq!(r.irq.read().unwrap(), 2);
        assert_eq!(ged_status(&mut r.ged), GED_EVENT_PCI_HOTPLUG);
        assert_eq!(rd(&mut r.ctl, PCIU_OFFSET), (1 << 3) | (1 << 5));
        assert_eq!(rd(&mut r.ctl, PCIU_OFFSET), 0, "PCIU read clears");
        assert_eq!(rd(&mut r.ctl, PCID_OFFSET), 0);
        assert!(r.ctl.is_present(5));
        assert!(matches!(
            r.ctl.slot_added(5),
            Err(HotplugError::SlotOccupied(5))
        ));
        assert!(matches!(
            r.ctl.slot_added(256),
            Err(HotplugError::SlotOutOfRange(256))
        ));
    }

    #[test]
    fn removal_sets_slot_down_and_b0ej_delivers_the_slot() {
        let mut r = rig();
        r.ctl.mark_present(7).unwrap();
        assert!(r.irq.read().is_err(), "cold plug raises nothing");
        assert_eq!(
            r.ctl.slot_removal_requested(7).unwrap(),
            RemovalRequest::Requested
        );
        assert_eq!(r.irq.read().unwrap(), 1);
        assert!(r.ejects.drain().is_empty(), "no teardown before the eject");
        assert!(r.ctl.is_present(7) && r.ctl.is_removal_pending(7));
        assert_eq!(rd(&mut r.ctl, PCID_OFFSET), 1 << 7);
        assert_eq!(rd(&mut r.ctl, PCID_OFFSET), 0, "PCID read clears");

        wr(&mut r.ctl, PSEG_OFFSET, 0);
        wr(&mut r.ctl, B0EJ_OFFSET, 1 << 7);
        assert_eq!(r.ejects.eventfd().read().unwrap(), 1);
        assert_eq!(r.ejects.drain(), vec![7]);
        assert!(!r.ctl.is_present(7) && !r.ctl.is_removal_pending(7));
        assert_eq!(rd(&mut r.ctl, B0EJ_OFFSET), 0);

        // The slot can be reused after the eject.
        r.ctl.slot_added(7).unwrap();
        assert_eq!(rd(&mut r.ctl, PCIU_OFFSET), 1 << 7);
    }

    #[test]
    fn double_removal_is_idempotent() {
        let mut r = rig();
        r.ctl.slot_added(2).unwrap();
        assert_eq!(r.irq.read().unwrap(), 1);
        assert_eq!(
            r.ctl.slot_removal_requested(2).unwrap(),
            RemovalRequest::Requested
        );
        assert_eq!(
            r.ctl.slot_removal_requested(2).unwrap(),
            RemovalRequest::AlreadyPending
        );
        assert_eq!(r.irq.read().unwrap(), 1, "second request raises nothing");
        assert_eq!(rd(&mut r.ctl, PCID_OFFSET), 1 << 2);
        wr(&mut r.ctl, B0EJ_OFFSET, 1 << 2);
        wr(&mut r.ctl, B0EJ_OFFSET, 1 << 2);
        assert_eq!(r.ejects.drain(), vec![2], "delivered exactly once");
        assert!(matches!(
            r.ctl.slot_removal_requested(2),
            Err(HotplugError::NoDevice(2))
        ));
    }

    #[test]
    fn eject_of_empty_slot_is_ignored() {
        let mut r = rig();
        r.ctl.mark_present(4).unwrap();
        wr(&mut r.ctl, B0EJ_OFFSET, (1 << 9) | (1 << 4));
        assert_eq!(r.ejects.drain(), vec![4]);
        wr(&mut r.ctl, B0EJ_OFFSET, 1 << 9);
        assert!(r.ejects.drain().is_empty());
    }

    #[test]
    fn each_root_bus_has_its_own_bits_and_a_bus_that_does_not_exist_is_ignored() {
        let mut r = rig();
        r.ctl.slot_added(1).unwrap();
        r.ctl.mark_present(6).unwrap();
        // Slot number 35: root bus 1, device 3.
        r.ctl.slot_added(35).unwrap();
        assert!(r.ctl.is_present(35) && !r.ctl.is_present(3));
        wr(&mut r.ctl, PSEG_OFFSET, 1);
        assert_eq!(rd(&mut r.ctl, PSEG_OFFSET), 1);
        assert_eq!(rd(&mut r.ctl, PCIU_OFFSET), 1 << 3, "bus 1's bits");
        // Device 6 of bus 1 is empty: bus 0's device 6 stays.
        wr(&mut r.ctl, B0EJ_OFFSET, 1 << 6);
        assert!(r.ejects.drain().is_empty());
        assert!(r.ctl.is_present(6));
        wr(&mut r.ctl, B0EJ_OFFSET, 1 << 3);
        assert_eq!(r.ejects.drain(), vec![35]);
        // A bus past the controller's: nothing read, nothing ejected.
        wr(&mut r.ctl, PSEG_OFFSET, PCI_HOTPLUG_BUSES);
        assert_eq!(rd(&mut r.ctl, PCIU_OFFSET), 0);
        wr(&mut r.ctl, B0EJ_OFFSET, 1 << 6);
        assert!(r.ejects.drain().is_empty());
        wr(&mut r.ctl, PSEG_OFFSET, 0);
        assert_eq!(rd(&mut r.ctl, PCIU_OFFSET), 1 << 1, "bits kept for bus 0");
        // A forced removal's eject, completed by the VMM, leaves PSEG as the guest set it.
        wr(&mut r.ctl, PSEG_OFFSET, 2);
        r.ctl.complete_eject(6).unwrap();
        assert_eq!(r.ejects.drain(), vec![6]);
        assert_eq!(rd(&mut r.ctl, PSEG_OFFSET), 2);
    }

    #[test]
    fn other_buses_state_round_trips_and_an_old_state_still_restores() {
        let mut r = rig();
        r.ctl.mark_present(1).unwrap();
        r.ctl.slot_added(2 * 32 + 4).unwrap();
        r.ctl.slot_removal_requested(2 * 32 + 4).unwrap();
        let saved = r.ctl.snapshot();
        assert_eq!(saved.more_buses.len(), 2, "{saved:?}");
        let mut fresh = rig();
        fresh.ctl.restore(&saved).unwrap();
        assert_eq!(fresh.ctl.snapshot(), saved);
        assert!(fresh.ctl.is_removal_pending(68));
        // A state saved before root buses existed has no `more_buses`.
        let old: HotplugState =
            serde_json::from_str(r#"{"pciu":0,"pcid":0,"pseg":0,"present":2,"pending_removal":0}"#)
                .unwrap();
        let mut fresh = rig();
        fresh.ctl.restore(&old).unwrap();
        assert!(fresh.ctl.is_present(1) && !fresh.ctl.is_present(33));
        // Too many buses, or a removal pending on an empty slot of bus 1, are refused.
        let mut bad = old.clone();
        bad.more_buses = vec![BusBits::default(); PCI_HOTPLUG_BUSES as usize];
        assert!(fresh.ctl.restore(&bad).is_err());
        bad.more_buses = vec![BusBits {
            pending_removal: 1 << 4,
            ..Default::default()
        }];
        let e = fresh.ctl.restore(&bad).unwrap_err().to_string();
        assert!(e.contains("root bus 1"), "{e}");
    }

    #[test]
    fn add_clears_stale_slot_down_and_partial_access_works() {
        let mut r = rig();
        r.ctl.mark_present(8).unwrap();
        r.ctl.slot_removal_requested(8).unwrap();
        // Guest ejects without having read PCID (e.g. user-initiated eject).
        wr(&mut r.ctl, B0EJ_OFFSET, 1 << 8);
        assert_eq!(r.ejects.drain(), vec![8]);
        r.ctl.slot_added(8).unwrap();
        assert_eq!(rd(&mut r.ctl, PCID_OFFSET), 0);
        // Byte read of PCIU byte 1 returns and clears only that byte.
        let mut b = [0u8; 1];
        r.ctl.read(PCI_HOTPLUG_START, PCIU_OFFSET + 1, &mut b);
        assert_eq!(b, [1]);
        assert_eq!(rd(&mut r.ctl, PCIU_OFFSET), 0);
        // Byte write of B0EJ byte 1 = slot 8 .. 15.
        r.ctl.write(PCI_HOTPLUG_START, B0EJ_OFFSET + 1, &[0x01]);
        assert_eq!(r.ejects.drain(), vec![8]);
        // Access straddling two registers is dropped.
        let mut w = [0u8; 4];
        r.ctl.read(PCI_HOTPLUG_START, 2, &mut w);
        assert_eq!(w, [0; 4]);
    }

    #[test]
    fn dropped_receiver_does_not_break_the_vcpu() {
        let mut r = rig();
        r.ctl.mark_present(0).unwrap();
        drop(r.ejects);
        wr(&mut r.ctl, B0EJ_OFFSET, 1);
        assert!(!r.ctl.is_present(0));
    }
}
