//! What a device model needs from the VM, without depending on the `vmm` crate.
//!
//! Quick reference (the VMM implements [`VmOps`] with KVM; `remote_pci` consumes it):
//!
//! ```text
//! pub trait VmOps: Send + Sync {
//!     fn map_guest_region(&self, gpa: u64, size: u64, host_addr: u64, readonly: bool)
//!         -> Result<MemslotGuard, VmOpsError>;          // KVM memslot; guard Drop removes it
//!     fn register_ioevent(&self, fd: &EventFd, addr: IoEventAddress,
//!                         datamatch: Option<IoEventDatamatch>)
//!         -> Result<IoEventGuard, VmOpsError>;          // KVM ioeventfd; guard Drop unregisters
//!     fn guest_ram_regions(&self) -> Vec<GuestRamRegion>;   // for pinning / fabric export
//!     fn read_guest(&self, gpa: u64, data: &mut [u8]) -> Result<(), VmOpsError>;
//!     fn write_guest(&self, gpa: u64, data: &[u8]) -> Result<(), VmOpsError>;
//! }
//! MemslotGuard::new(gpa, size, slot, release: impl FnOnce() + Send + 'static)
//! IoEventGuard::new(addr, datamatch, release: impl FnOnce() + Send + 'static)
//! ```
//!
//! The guards are concrete types owned by this crate: the VMM builds them with a release
//! closure (capturing e.g. its `Arc<VmFd>` and the slot number) that undoes the operation.
//! The device model keeps the guard for as long as the mapping must live and drops it on
//! BAR move, reset or hot-unplug, so nothing can leak.

use std::fmt;
use std::fs::File;
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

/// Errors of VM operations.
#[derive(Debug, thiserror::Error)]
pub enum VmOpsError {
    #[error("guest region {gpa:#x}+{size:#x} is invalid: {reason}")]
    InvalidRegion {
        gpa: u64,
        size: u64,
        reason: &'static str,
    },
    #[error("guest address {gpa:#x}+{len:#x} is not backed by guest RAM")]
    NotRam { gpa: u64, len: u64 },
    #[error("vm resource exhausted: {0}")]
    Exhausted(String),
    #[error("vm operation {op} failed")]
    Backend {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// Address space + address of an ioeventfd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoEventAddress {
    /// Port I/O address.
    Pio(u64),
    /// Guest physical MMIO address.
    Mmio(u64),
}

/// Value (and implied access width) an ioeventfd matches; `None` matches any write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoEventDatamatch {
    U8(u8),
    U16(u16),
    U32(u32),
    U64(u64),
}

/// One region of guest RAM, as seen by the VMM process.
#[derive(Clone, Debug)]
pub struct GuestRamRegion {
    /// Guest physical start.
    pub gpa: u64,
    /// Length in bytes.
    pub size: u64,
    /// Start of the VMM's mapping of this region.
    pub host_addr: u64,
    /// Backing file (the guest RAM memfd) and offset of `gpa` in it, if file backed.
    pub file: Option<(Arc<File>, u64)>,
}

type Release = Box<dyn FnOnce() + Send>;

/// A KVM memslot mapping guest physical `[gpa, gpa+size)`; dropping it removes the slot.
pub struct MemslotGuard {
    gpa: u64,
    size: u64,
    slot: u32,
    release: Option<Release>,
}

impl MemslotGuard {
    /// Wraps an installed memslot; `release` is run exactly once, on drop.
    pub fn new(gpa: u64, size: u64, slot: u32, release: impl FnOnce() + Send + 'static) -> Self {
        Self {
            gpa,
            size,
            slot,
            release: Some(Box::new(release)),
        }
    }

    pub fn gpa(&self) -> u64 {
        self.gpa
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn slot(&self) -> u32 {
        self.slot
    }
}

impl fmt::Debug for MemslotGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemslotGuard")
            .field("gpa", &format_args!("{:#x}", self.gpa))
            .field("size", &format_args!("{:#x}", self.size))
            .field("slot", &self.slot)
            .finish()
    }
}

impl Drop for MemslotGuard {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release();
        }
    }
}

/// A registered ioeventfd; dropping it unregisters it.
pub struct IoEventGuard {
    addr: IoEventAddress,
    datamatch: Option<IoEventDatamatch>,
    release: Option<Release>,
}

impl IoEventGuard {
    /// Wraps a registered ioeventfd; `release` is run exactly once, on drop.
    pub fn new(
        addr: IoEventAddress,
        datamatch: Option<IoEventDatamatch>,
        release: impl FnOnce() + Send + 'static,
    ) -> Self {
        Self {
            addr,
            datamatch,
            release: Some(Box::new(release)),
        }
    }

    pub fn addr(&self) -> IoEventAddress {
        self.addr
    }

    pub fn datamatch(&self) -> Option<IoEventDatamatch> {
        self.datamatch
    }
}

impl fmt::Debug for IoEventGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoEventGuard")
            .field("addr", &self.addr)
            .field("datamatch", &self.datamatch)
            .finish()
    }
}

impl Drop for IoEventGuard {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release();
        }
    }
}

/// VM services for device models (object safe; the VMM implements it with KVM).
pub trait VmOps: Send + Sync {
    /// Maps host memory at `host_addr` into the guest at `[gpa, gpa+size)` as a KVM memslot
    /// (e.g. a lender BAR window reached through the fabric, for direct guest access).
    /// `gpa`, `size` and `host_addr` must be page aligned.
    fn map_guest_region(
        &self,
        gpa: u64,
        size: u64,
        host_addr: u64,
        readonly: bool,
    ) -> Result<MemslotGuard, VmOpsError>;

    /// Registers `fd` as an ioeventfd for guest writes to `addr` (matching `datamatch`).
    fn register_ioevent(
        &self,
        fd: &EventFd,
        addr: IoEventAddress,
        datamatch: Option<IoEventDatamatch>,
    ) -> Result<IoEventGuard, VmOpsError>;

    /// The guest RAM regions (for pinning and for exporting guest RAM to a lender).
    fn guest_ram_regions(&self) -> Vec<GuestRamRegion>;

    /// Copies guest RAM at `gpa` into `data`.
    fn read_guest(&self, gpa: u64, data: &mut [u8]) -> Result<(), VmOpsError>;

    /// Copies `data` into guest RAM at `gpa`.
    fn write_guest(&self, gpa: u64, data: &[u8]) -> Result<(), VmOpsError>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn guards_release_once_on_drop() {
        let count = Arc::new(AtomicUsize::new(0));
        let c = count.clone();
        let g = MemslotGuard::new(0x1000, 0x2000, 7, move || {
            c.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!((g.gpa(), g.size(), g.slot()), (0x1000, 0x2000, 7));
        drop(g);
        let c = count.clone();
        let g = IoEventGuard::new(IoEventAddress::Mmio(0x10), None, move || {
            c.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(g.addr(), IoEventAddress::Mmio(0x10));
        drop(g);
        assert_eq!(count.load(Ordering::SeqCst), 2);
    }
}
