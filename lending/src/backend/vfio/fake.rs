//! A scripted VFIO device for tests. Built for tests and with the `testing` feature only.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Mutex;

use vmm_sys_util::eventfd::EventFd;

use super::{RegionInfo, VfioDeviceOps, VfioOpError};
use vfio_bindings::bindings::vfio::VFIO_PCI_CONFIG_REGION_INDEX;

/// How long the fake holds Device Status "Transactions Pending" set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransactionsPending {
    /// Clear (the default).
    #[default]
    Clear,
    /// Set for the next `n` reads of Device Status, clear after.
    Reads(u32),
    /// Set on every read (a function that never completes its requests).
    Forever,
}

/// Region contents in memory; records IRQ and reset calls, config writes and reads of
/// the PCI Express Device Status, whose Transactions Pending bit it can hold set.
pub struct FakeVfioDevice {
    /// index -> (info, bytes)
    pub regions: Mutex<HashMap<u32, (RegionInfo, Vec<u8>)>>,
    /// index -> vector count
    pub irq_counts: HashMap<u32, u32>,
    /// index -> eventfds currently enabled (duplicates)
    pub enabled: Mutex<HashMap<u32, Vec<EventFd>>>,
    /// Resets so far.
    pub resets: Mutex<u32>,
    /// Every config region write, in order: (offset, bytes).
    pub config_writes: Mutex<Vec<(u64, Vec<u8>)>>,
    /// Transactions Pending as Device Status reads show it.
    pub pending: Mutex<TransactionsPending>,
    /// Reads of Device Status so far: whether Bus Master Enable was set at each.
    pub devsta_reads: Mutex<Vec<bool>>,
    fd: OwnedFd,
}

impl FakeVfioDevice {
    /// A device with the given regions and IRQ counts.
    pub fn new(
        regions: Vec<(u32, RegionInfo, Vec<u8>)>,
        irq_counts: &[(u32, u32)],
    ) -> std::io::Result<Self> {
        // Only a handle is needed; /dev/null stands in for the device fd.
        let fd = OwnedFd::from(std::fs::File::open("/dev/null")?);
        Ok(FakeVfioDevice {
            regions: Mutex::new(regions.into_iter().map(|(i, r, b)| (i, (r, b))).collect()),
            irq_counts: irq_counts.iter().copied().collect(),
            enabled: Mutex::new(HashMap::new()),
            resets: Mutex::new(0),
            config_writes: Mutex::new(Vec::new()),
            pending: Mutex::new(TransactionsPending::Clear),
            devsta_reads: Mutex::new(Vec::new()),
            fd,
        })
    }

    /// Whether a BAR region may be accessed: vfio-pci refuses BAR reads and writes (EIO)
    /// while the function's Memory Space bit is clear (`__vfio_pci_memory_enabled`; found
    /// in L1, docs/VFIO.md). Config and other regions always may.
    fn decodes(regions: &HashMap<u32, (RegionInfo, Vec<u8>)>, index: u32) -> bool {
        if index > vfio_bindings::bindings::vfio::VFIO_PCI_BAR5_REGION_INDEX {
            return true;
        }
        regions
            .get(&VFIO_PCI_CONFIG_REGION_INDEX)
            .and_then(|(_, c)| c.get(4))
            .is_none_or(|cmd| cmd & crate::backend::config::CMD_MEMORY as u8 != 0)
    }

    /// Holds Transactions Pending as `p` says from now on.
    pub fn hold_pending(&self, p: TransactionsPending) {
        if let Ok(mut g) = self.pending.lock() {
            *g = p;
        }
    }

    /// The values written to the command register (offset 4, 2 or 4 bytes), in order.
    pub fn command_writes(&self) -> Vec<u16> {
        self.config_writes.lock().map_or_else(
            |_| Vec::new(),
            |w| {
                w.iter()
                    .filter(|(o, d)| *o == 4 && d.len() >= 2)
                    .map(|(_, d)| u16::from_le_bytes([d[0], d[1]]))
                    .collect()
            },
        )
    }

    /// Reads of Device Status so far: whether Bus Master Enable was set at each.
    pub fn devsta_reads(&self) -> Vec<bool> {
        self.devsta_reads
            .lock()
            .map_or_else(|_| Vec::new(), |g| g.clone())
    }

    /// Offset of Device Status in `cfg` (its PCI Express capability's), if any.
    fn devsta_in(cfg: &[u8]) -> Option<u64> {
        crate::backend::capabilities(cfg)
            .into_iter()
            .find(|c| !c.extended && c.id == u16::from(super::CAP_ID_PCIE))
            .map(|c| u64::from(c.offset) + super::PCIE_DEVSTA)
    }

    /// A config read covering Device Status: counted, and Transactions Pending set in
    /// `buf` while held.
    fn on_config_read(&self, cfg: &[u8], offset: u64, buf: &mut [u8]) {
        let Some(at) = Self::devsta_in(cfg) else {
            return;
        };
        if offset > at || offset + buf.len() as u64 <= at {
            return;
        }
        if let Ok(mut n) = self.devsta_reads.lock() {
            n.push(cfg.get(4).is_some_and(|c| c & 4 != 0));
        }
        let set = match self.pending.lock() {
            Ok(mut p) => match *p {
                TransactionsPending::Forever => true,
                TransactionsPending::Reads(n) if n > 0 => {
                    *p = if n == 1 {
                        TransactionsPending::Clear
                    } else {
                        TransactionsPending::Reads(n - 1)
                    };
                    true
                }
                _ => false,
            },
            Err(_) => false,
        };
        if set {
            // Bit 5 of the register's low byte.
            buf[(at - offset) as usize] |= super::DEVSTA_TRANSACTIONS_PENDING as u8;
        }
    }
}

/// A directory standing in for `/sys/bus/pci/devices`: `<bdf>/resourceN` files are plain
/// files of the BAR's size (sized and mmap-able like the kernel's).
#[cfg(any(test, feature = "testing"))]
pub struct FakeSysfs {
    dir: tempfile::TempDir,
}

#[cfg(any(test, feature = "testing"))]
impl FakeSysfs {
    /// An empty root (no device has resource files).
    pub fn new() -> std::io::Result<Self> {
        Ok(FakeSysfs {
            dir: tempfile::tempdir()?,
        })
    }

    /// The root to pass to [`super::VfioBackend::with_parts`].
    pub fn root(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Creates `<bdf>/resource<bar>` of `size` bytes.
    pub fn add_resource(
        &self,
        bdf: &str,
        bar: u8,
        size: u64,
    ) -> std::io::Result<std::path::PathBuf> {
        let d = self.dir.path().join(bdf);
        std::fs::create_dir_all(&d)?;
        let p = d.join(format!("resource{bar}"));
        std::fs::File::create(&p)?.set_len(size)?;
        Ok(p)
    }
}

/// vfio-pci's answer to a BAR access while Memory Space is off.
fn eio(op: &'static str, index: u32, offset: u64, len: usize) -> VfioOpError {
    VfioOpError::Region {
        op,
        index,
        offset,
        len,
        source: std::io::Error::from_raw_os_error(libc::EIO),
    }
}

fn poisoned(op: &'static str, index: u32, offset: u64, len: usize) -> VfioOpError {
    VfioOpError::Region {
        op,
        index,
        offset,
        len,
        source: std::io::Error::other("the fake's region lock is poisoned"),
    }
}

impl FakeVfioDevice {
    /// Runs `f(region bytes, offset)` for an access of `len` bytes at `offset` of region
    /// `index` that vfio-pci would carry out; otherwise its error (`EIO` while Memory Space
    /// is off, as vfio-pci).
    fn with_bytes(
        &self,
        op: &'static str,
        index: u32,
        offset: u64,
        len: usize,
        f: impl FnOnce(&mut Vec<u8>, usize),
    ) -> Result<(), VfioOpError> {
        let mut r = self
            .regions
            .lock()
            .map_err(|_| poisoned(op, index, offset, len))?;
        if !Self::decodes(&r, index) {
            return Err(eio(op, index, offset, len));
        }
        let (_, bytes) = r.get_mut(&index).ok_or(VfioOpError::NoRegion { index })?;
        let at = offset as usize;
        if at.checked_add(len).is_none_or(|end| end > bytes.len()) {
            return Err(VfioOpError::OutOfRegion {
                index,
                offset,
                len,
                size: bytes.len() as u64,
            });
        }
        f(bytes, at);
        Ok(())
    }
}

impl VfioDeviceOps for FakeVfioDevice {
    fn region(&self, index: u32) -> Option<RegionInfo> {
        self.regions.lock().ok()?.get(&index).map(|(r, _)| *r)
    }

    fn region_read(&self, index: u32, offset: u64, buf: &mut [u8]) -> Result<(), VfioOpError> {
        self.with_bytes("read", index, offset, buf.len(), |bytes, at| {
            buf.copy_from_slice(&bytes[at..at + buf.len()]);
            if index == VFIO_PCI_CONFIG_REGION_INDEX {
                self.on_config_read(bytes, offset, buf);
            }
        })
    }

    fn region_write(&self, index: u32, offset: u64, data: &[u8]) -> Result<(), VfioOpError> {
        if index == VFIO_PCI_CONFIG_REGION_INDEX {
            if let Ok(mut w) = self.config_writes.lock() {
                w.push((offset, data.to_vec()));
            }
        }
        self.with_bytes("write", index, offset, data.len(), |bytes, at| {
            bytes[at..at + data.len()].copy_from_slice(data);
        })
    }

    fn irq_count(&self, index: u32) -> u32 {
        self.irq_counts.get(&index).copied().unwrap_or(0)
    }

    fn enable_irq(&self, index: u32, fds: &[&EventFd]) -> Result<(), VfioOpError> {
        let irq_err = || VfioOpError::Irqs {
            index,
            source: vfio_ioctls::VfioError::VfioDeviceEnableIrq,
        };
        let dups = fds
            .iter()
            .map(|f| f.try_clone().map_err(|_| irq_err()))
            .collect::<Result<Vec<_>, _>>()?;
        self.enabled
            .lock()
            .map_err(|_| irq_err())?
            .insert(index, dups);
        Ok(())
    }

    fn disable_irq(&self, index: u32) -> Result<(), VfioOpError> {
        self.enabled
            .lock()
            .map_err(|_| VfioOpError::Irqs {
                index,
                source: vfio_ioctls::VfioError::VfioDeviceDisableIrq,
            })?
            .remove(&index);
        Ok(())
    }

    fn reset(&self) -> Result<(), VfioOpError> {
        if let Ok(mut r) = self.resets.lock() {
            *r += 1;
        }
        Ok(())
    }

    fn device_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
