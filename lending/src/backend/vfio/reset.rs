//! Reset and drain: Bus Master Enable, the PCI Express "Transactions Pending" drain of a
//! hand-over quiesce, and `VFIO_DEVICE_RESET`.

use std::time::{Duration, Instant};

use vfio_bindings::bindings::vfio::VFIO_PCI_CONFIG_REGION_INDEX;

use super::{VfioBackend, VfioDeviceOps, VfioOpError};
use crate::backend::config::{CMD_BUS_MASTER, CMD_IO, CMD_MEMORY};

/// Capability ID of the PCI Express capability.
pub const CAP_ID_PCIE: u8 = 0x10;
/// Offset of Device Status in the PCI Express capability.
pub const PCIE_DEVSTA: u64 = 0x0a;
/// Device Status bit 5: Transactions Pending (non-posted requests of the function still
/// waiting for their completions).
pub const DEVSTA_TRANSACTIONS_PENDING: u16 = 1 << 5;

/// Longest pause between two Device Status polls of a drain.
const DRAIN_POLL_MAX: Duration = Duration::from_millis(1);

impl<D: VfioDeviceOps> VfioBackend<D> {
    /// Sets or clears Bus Master Enable in the physical command register; returns whether
    /// it was set.
    pub(super) fn write_bme(&self, enable: bool) -> Result<bool, VfioOpError> {
        let cmd = self.config_u16(4)?;
        let new = if enable {
            cmd | CMD_BUS_MASTER
        } else {
            cmd & !CMD_BUS_MASTER
        };
        if new != cmd {
            self.dev
                .region_write(VFIO_PCI_CONFIG_REGION_INDEX, 4, &new.to_le_bytes())?;
        }
        Ok(cmd & CMD_BUS_MASTER != 0)
    }

    /// Turns the function's decoding on: Memory Space, and I/O Space if it has an I/O BAR.
    /// The lender owns these bits (the borrower's VMM decodes the guest's BAR addresses
    /// itself and never forwards them), and vfio-pci refuses the lender's BAR reads and
    /// writes with EIO while Memory Space is clear; a borrower's Command writes keep them
    /// ([`crate::backend::config::CMD_LENDER_OWNED`]).
    pub(super) fn enable_decode(&self) -> Result<(), VfioOpError> {
        let mut cfg = [0u8; 0x28];
        self.dev
            .region_read(VFIO_PCI_CONFIG_REGION_INDEX, 0, &mut cfg)?;
        let mut io = false;
        let mut at = 0x10;
        while at < 0x28 {
            let bar = u32::from_le_bytes([cfg[at], cfg[at + 1], cfg[at + 2], cfg[at + 3]]);
            io |= bar & 1 != 0;
            // A 64-bit memory BAR's upper half is not a BAR of its own.
            at += if bar & 0b111 == 0b100 { 8 } else { 4 };
        }
        let cmd = self.config_u16(4)?;
        let new = cmd | CMD_MEMORY | if io { CMD_IO } else { 0 };
        if new != cmd {
            self.dev
                .region_write(VFIO_PCI_CONFIG_REGION_INDEX, 4, &new.to_le_bytes())?;
        }
        Ok(())
    }

    pub(super) fn handover_bme(&self) -> std::sync::MutexGuard<'_, Option<bool>> {
        match self.handover_bme.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Offset of the PCI Express capability's Device Status register, if the function has
    /// the capability.
    pub(super) fn devsta_offset(&self) -> Option<u64> {
        let mut cfg = [0u8; 256];
        self.config_logged(0, &mut cfg);
        crate::backend::capabilities(&cfg)
            .into_iter()
            .find(|c| !c.extended && c.id == u16::from(CAP_ID_PCIE))
            .map(|c| u64::from(c.offset) + PCIE_DEVSTA)
    }

    /// Confirms that no DMA of the function is in flight, the way PCIe software does before
    /// a Function Level Reset: Bus Master Enable cleared (the function may start no new
    /// request), then Device Status polled until Transactions Pending clears (the requests
    /// it had started have completed), at most `timeout`. Returns whether it cleared.
    ///
    /// Every poll is a config read, a non-posted request to the function whose completion
    /// may not pass the function's earlier posted writes on their way upstream: once a
    /// read returns, every memory write the function made before has reached the root
    /// complex (and guest RAM). A function without a PCI Express capability has no
    /// Transactions Pending bit: it is a conventional PCI function. Only its writes change
    /// guest RAM, and a conventional PCI write is either finished on the bus or posted in a
    /// bridge's buffer; with Bus Master Enable clear it starts no new one, and the config
    /// read (whose completion pushes the bridges' posted writes ahead of it) flushes the
    /// posted ones. What may still be outstanding are reads, which write no guest RAM. So
    /// the cleared bit plus one config read is the drain.
    pub(super) fn drain(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let was = match self.write_bme(false) {
            Ok(was) => was,
            Err(e) => {
                log::warn!(
                    "{}: clearing bus master: {e}: drain not confirmed",
                    self.name
                );
                return false;
            }
        };
        self.handover_bme().get_or_insert(was);
        let Some(devsta) = self.devsta else {
            if let Err(e) = self.config_u16(4) {
                log::warn!(
                    "{}: the draining config read: {e}: drain not confirmed",
                    self.name
                );
                return false;
            }
            log::info!(
                "{}: bus master off; no pci express capability, drained by a config read",
                self.name
            );
            return true;
        };
        let mut pause = Duration::from_micros(10);
        let mut polls = 0u32;
        loop {
            polls += 1;
            let sta = match self.config_u16(devsta) {
                Ok(v) => v,
                Err(e) => {
                    log::warn!(
                        "{}: reading device status: {e}: drain not confirmed",
                        self.name
                    );
                    return false;
                }
            };
            if sta & DEVSTA_TRANSACTIONS_PENDING == 0 {
                log::info!(
                    "{}: bus master off, no transaction pending ({polls} polls)",
                    self.name
                );
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                log::warn!(
                    "{}: transactions still pending {timeout:?} after bus master was \
                     cleared ({polls} polls): drain not confirmed",
                    self.name
                );
                return false;
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(DRAIN_POLL_MAX);
        }
    }
}
