//! `epftest`: the register interface of Linux's PCI endpoint test function (`pci-epf-test`,
//! driven by the guest's `pci_endpoint_test` driver and its `PCITEST_*` ioctls), with an
//! MSI-X table of up to [`MAX_VECTORS`] vectors. It exists so that a stock guest driver
//! enables every vector a function offers (`pci_alloc_irq_vectors(1, 2048, MSIX)`, not one
//! per CPU as NVMe and NIC drivers do) and can raise any one of them: the interrupt count of
//! a GPU, checked end to end. Only interrupts are implemented; the data commands (READ,
//! WRITE, COPY) complete with their error bits set.
//!
//! BAR0 (4 KiB, register memory; every store is exact):
//!
//! | offset | register | |
//! |---|---|---|
//! | 0x00 | MAGIC | RW (the driver's BAR test writes patterns) |
//! | 0x04 | COMMAND: bit 2 raises MSI-X vector IRQ_NUMBER - 1 | W |
//! | 0x08 | STATUS: bit 6 IRQ raised (the driver's handler clears it) | RW |
//! | 0x24 | IRQ_TYPE (2: MSI-X) | RW |
//! | 0x28 | IRQ_NUMBER (1-based) | RW |
//!
//! BAR1: the MSI-X table and PBA (emulated by the borrower).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use crate::irq::{InterruptMode, InterruptSink};
use crate::model::{build_config_space, BarInfo, DeviceError, DeviceModel, MsixInfo, PciIdentity};
use crate::regs::RegisterMemory;

/// BAR0 size.
pub const BAR0_SIZE: u64 = 0x1000;
/// COMMAND register.
pub const REG_COMMAND: u64 = 0x04;
/// STATUS register.
pub const REG_STATUS: u64 = 0x08;
/// IRQ_TYPE register.
pub const REG_IRQ_TYPE: u64 = 0x24;
/// IRQ_NUMBER register (1-based).
pub const REG_IRQ_NUMBER: u64 = 0x28;
/// End of the registers the driver uses (FLAGS is the last, at 0x2c).
const REGS_END: u64 = 0x30;
/// COMMAND: raise the MSI-X vector IRQ_NUMBER - 1.
pub const COMMAND_RAISE_MSIX_IRQ: u32 = 1 << 2;
/// COMMAND: the data commands this model does not implement.
const COMMAND_DATA: u32 = 0b111 << 3;
/// STATUS: an interrupt was raised.
pub const STATUS_IRQ_RAISED: u32 = 1 << 6;
/// STATUS: the error bits a refused data command sets (read, write, copy fail).
const STATUS_DATA_FAIL: u32 = (1 << 1) | (1 << 3) | (1 << 5);
/// Most MSI-X vectors: the PCI limit, and what the guest driver asks for at most.
pub const MAX_VECTORS: u16 = 2048;
/// Default vectors: a GPU's order of magnitude.
pub const DEFAULT_VECTORS: u16 = 128;

/// BAR1's size for `vectors`: the table (16 bytes a vector), then the PBA on its own page.
pub fn msix_bar_size(vectors: u16) -> u64 {
    let table = u64::from(vectors) * 16;
    let pba_offset = table.next_multiple_of(0x1000);
    let pba = u64::from(vectors).div_ceil(64) * 8;
    (pba_offset + pba).next_power_of_two().max(0x1000)
}

/// The endpoint test function.
pub struct EpfTest {
    regs: Arc<dyn RegisterMemory>,
    irq: Arc<dyn InterruptSink>,
    vectors: u16,
    /// Never signalled: every store is exact (the model reacts inside `bar_write`).
    doorbell: EventFd,
    /// Raises refused (a vector past the table, MSI-X off): counted for the log limit.
    refused: AtomicU64,
}

impl EpfTest {
    /// A function of `vectors` MSI-X vectors (1..=[`MAX_VECTORS`]) over `regs` (at least
    /// [`BAR0_SIZE`] bytes).
    pub fn new(
        regs: Arc<dyn RegisterMemory>,
        irq: Arc<dyn InterruptSink>,
        vectors: u16,
    ) -> Result<Self, DeviceError> {
        if !(1..=MAX_VECTORS).contains(&vectors) {
            return Err(DeviceError::InvalidConfig(format!(
                "epftest with {vectors} msi-x vectors: 1 to {MAX_VECTORS}"
            )));
        }
        if (regs.len() as u64) < BAR0_SIZE {
            return Err(DeviceError::RegisterMemoryTooSmall {
                got: regs.len(),
                need: BAR0_SIZE as usize,
            });
        }
        Ok(EpfTest {
            regs,
            irq,
            vectors,
            doorbell: EventFd::new(libc::EFD_NONBLOCK).map_err(|source| DeviceError::Os {
                what: "epftest doorbell eventfd",
                source,
            })?,
            refused: AtomicU64::new(0),
        })
    }

    fn command(&self, cmd: u32) {
        let status = self.regs.read32(REG_STATUS);
        if cmd & COMMAND_DATA != 0 {
            self.regs.write32(REG_STATUS, status | STATUS_DATA_FAIL);
        }
        if cmd & COMMAND_RAISE_MSIX_IRQ == 0 {
            return;
        }
        let n = self.regs.read32(REG_IRQ_NUMBER);
        let on = matches!(self.irq.mode(), InterruptMode::MsiX { .. });
        match u16::try_from(n) {
            Ok(n) if on && (1..=self.vectors).contains(&n) => {
                // The status first: the handler reads it to know the raise was ours.
                self.regs.write32(REG_STATUS, status | STATUS_IRQ_RAISED);
                self.irq.signal_msix(n - 1);
            }
            _ => {
                // A guest may repeat this at will: first 16, then one in 1024.
                let k = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
                if k <= 16 || k.is_multiple_of(1024) {
                    log::warn!(
                        "epftest: raise of msi-x vector {n} refused (the table has {}, msi-x \
                         {}; refused raise #{k})",
                        self.vectors,
                        if on { "on" } else { "off" }
                    );
                }
            }
        }
    }
}

impl DeviceModel for EpfTest {
    fn name(&self) -> &str {
        "epftest"
    }

    fn identity(&self) -> PciIdentity {
        PciIdentity {
            vendor_id: 0x1b36,
            device_id: 0x1106,
            subsystem_vendor_id: 0x1b36,
            subsystem_id: 0x1106,
            class: 0xff,
            subclass: 0x00,
            prog_if: 0,
            revision: 1,
        }
    }

    fn bars(&self) -> Vec<BarInfo> {
        vec![
            BarInfo {
                index: 0,
                size: BAR0_SIZE,
                is_64bit: false,
                prefetchable: false,
                register_memory: true,
                // No store may be a plain store + notify: COMMAND acts inside `bar_write`,
                // so every store takes the exact path (the model sees it at once, in order).
                doorbells: None,
            },
            BarInfo {
                index: 1,
                size: msix_bar_size(self.vectors),
                is_64bit: false,
                prefetchable: false,
                register_memory: false,
                doorbells: None,
            },
        ]
    }

    fn msix(&self) -> Option<MsixInfo> {
        Some(MsixInfo {
            vectors: self.vectors,
            table_bar: 1,
            table_offset: 0,
            pba_bar: 1,
            pba_offset: (u32::from(self.vectors) * 16).next_multiple_of(0x1000),
        })
    }

    fn intx_pin(&self) -> u8 {
        0
    }

    fn config_space(&self) -> [u8; 256] {
        build_config_space(&self.identity(), &self.bars(), self.msix().as_ref(), 0)
    }

    fn doorbell_event(&self) -> &EventFd {
        &self.doorbell
    }

    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if bar != 0 {
            return;
        }
        match data.len() {
            8 => data.copy_from_slice(&self.regs.read64(offset).to_le_bytes()),
            4 => data.copy_from_slice(&self.regs.read32(offset).to_le_bytes()),
            _ => {}
        }
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) {
        if bar != 0 {
            return;
        }
        if let Ok(v) = <[u8; 8]>::try_from(data) {
            // A 64-bit store is two register stores, low first.
            self.bar_write(bar, offset, &v[..4]);
            self.bar_write(bar, offset + 4, &v[4..]);
            return;
        }
        let Ok(v) = <[u8; 4]>::try_from(data) else {
            return;
        };
        let v = u32::from_le_bytes(v);
        if offset == REG_COMMAND {
            self.command(v);
        } else {
            self.regs.write32(offset, v);
        }
    }

    fn start(&self) -> Result<(), DeviceError> {
        Ok(())
    }

    fn reset(&self) {
        for r in (0..REGS_END).step_by(4) {
            self.regs.write32(r, 0);
        }
    }
}
