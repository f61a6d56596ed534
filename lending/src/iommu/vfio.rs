//! Hardware IOMMU domain through VFIO: one container per lent device, the borrower's windows
//! programmed with `VFIO_IOMMU_MAP_DMA` at IOVA = guest-physical base.
//!
//! `vfio-ioctls` has no mockable constructor (it opens `/dev/vfio/vfio`), so the domain talks
//! to [`VfioContainerOps`]; [`vfio_ioctls::VfioContainer`] implements it for real and
//! [`fake::FakeVfioContainer`] records calls for tests. Untested on hardware here (no
//! `/dev/vfio` on the development host).

use std::sync::{Arc, Mutex};

use super::{lock, DmaBacking, IommuDomain, IommuError, MapTable, MappingInfo};

/// The container operations the domain needs.
pub trait VfioContainerOps: Send + Sync {
    /// Programs the IOMMU so that `[iova, iova + size)` reaches `[host_addr, host_addr + size)`.
    ///
    /// # Safety
    ///
    /// The host range must stay mapped in this process until [`Self::dma_unmap`] of the same
    /// range succeeds — or, see [`VfioDomain`]'s `rebind`, be replaced by another mapping of
    /// the same file range — and no Rust references to it may exist while it is mapped (the
    /// device reads and writes it concurrently).
    unsafe fn dma_map(&self, iova: u64, size: u64, host_addr: *mut u8) -> Result<(), String>;
    /// Removes a mapping made by [`Self::dma_map`].
    fn dma_unmap(&self, iova: u64, size: u64) -> Result<(), String>;
}

impl VfioContainerOps for vfio_ioctls::VfioContainer {
    unsafe fn dma_map(&self, iova: u64, size: u64, host_addr: *mut u8) -> Result<(), String> {
        let size = usize::try_from(size).map_err(|e| e.to_string())?;
        // SAFETY: the caller upholds this function's contract, which is the contract of
        // `VfioContainer::vfio_dma_map`.
        unsafe { self.vfio_dma_map(iova, size, host_addr) }.map_err(|e| e.to_string())
    }

    fn dma_unmap(&self, iova: u64, size: u64) -> Result<(), String> {
        let size = usize::try_from(size).map_err(|e| e.to_string())?;
        self.vfio_dma_unmap(iova, size).map_err(|e| e.to_string())
    }
}

impl<T: VfioContainerOps + ?Sized> VfioContainerOps for Arc<T> {
    unsafe fn dma_map(&self, iova: u64, size: u64, host_addr: *mut u8) -> Result<(), String> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { (**self).dma_map(iova, size, host_addr) }
    }

    fn dma_unmap(&self, iova: u64, size: u64) -> Result<(), String> {
        (**self).dma_unmap(iova, size)
    }
}

/// An IOMMU domain backed by a VFIO container. Dropping it unmaps every window.
pub struct VfioDomain<C: VfioContainerOps> {
    name: String,
    ops: C,
    table: Mutex<MapTable>,
}

impl<C: VfioContainerOps> VfioDomain<C> {
    /// A domain over `ops`; `name` identifies the device in log lines.
    pub fn new(name: impl Into<String>, ops: C) -> Self {
        VfioDomain {
            name: name.into(),
            ops,
            table: Mutex::new(MapTable::default()),
        }
    }

    /// The container operations (tests inspect the fake through this).
    pub fn ops(&self) -> &C {
        &self.ops
    }
}

impl<C: VfioContainerOps> IommuDomain for VfioDomain<C> {
    fn map(&self, iova: u64, size: u64, backing: Arc<dyn DmaBacking>) -> Result<(), IommuError> {
        let mut t = lock(&self.table);
        t.check_new(iova, size, backing.size())?;
        let host = backing.host_addr().ok_or(IommuError::NotHostMapped(iova))?;
        // SAFETY: `backing` owns a live host mapping of at least `size` bytes (checked above);
        // the table entry keeps the Arc — and so the mapping — alive until the IOMMU mapping is
        // removed (unmap keeps the entry if VFIO refuses to unmap). Accesses to the memory go
        // through raw-pointer copies only.
        unsafe { self.ops.dma_map(iova, size, host.as_ptr()) }.map_err(|msg| IommuError::Vfio {
            op: "map",
            iova,
            size,
            msg,
        })?;
        t.map.insert(
            iova,
            super::Entry {
                size,
                backing,
                dirty: None,
            },
        );
        log::info!(
            "{}: vfio mapped dma window iova {iova:#x} size {size:#x}",
            self.name
        );
        Ok(())
    }

    fn unmap(&self, iova: u64, size: u64) -> Result<(), IommuError> {
        let mut t = lock(&self.table);
        match t.map.get(&iova) {
            Some(e) if e.size == size => {}
            _ => return Err(IommuError::NotMapped { iova, size }),
        }
        // Keep the entry (and the host mapping) if the IOMMU still points at it.
        self.ops
            .dma_unmap(iova, size)
            .map_err(|msg| IommuError::Vfio {
                op: "unmap",
                iova,
                size,
                msg,
            })?;
        t.remove_exact(iova, size)?;
        log::info!(
            "{}: vfio unmapped dma window iova {iova:#x} size {size:#x}",
            self.name
        );
        Ok(())
    }

    /// No VFIO call: the IOMMU mapping stays. Sound because VFIO_IOMMU_MAP_DMA pinned the
    /// physical pages behind the old host range and the IOMMU translates the IOVAs to those
    /// pages, not to our virtual addresses; the new backing maps the very same pages (equal
    /// [`DmaBacking::backing_id`]: the same file — memfd — and range, whose pages stay put
    /// while any mapping of them lives; a window's memfd is sealed against shrinking). So
    /// the device keeps reaching exactly the memory the new backing shows, and the pages stay
    /// pinned until `dma_unmap`, which finds them by IOVA. What the kernel still records is
    /// the old virtual address, used only to pin again when another group joins the
    /// container (never: one container per device, its group attached once) and for
    /// mediated devices (not used); `VFIO_DMA_MAP_FLAG_VADDR` would update it should either
    /// change. Only the held backing (and so which host mapping is kept alive) changes.
    fn rebind(&self, iova: u64, size: u64, backing: Arc<dyn DmaBacking>) -> Result<(), IommuError> {
        if backing.host_addr().is_none() {
            return Err(IommuError::NotHostMapped(iova));
        }
        let old = lock(&self.table).swap_backing(iova, size, backing)?;
        drop(old);
        log::info!(
            "{}: vfio dma window iova {iova:#x} size {size:#x} kept (same memory; no iommu \
             unmap/map)",
            self.name
        );
        Ok(())
    }

    fn unmap_all(&self) -> usize {
        let all = lock(&self.table).list();
        let mut n = 0;
        for m in all {
            match self.unmap(m.iova, m.size) {
                Ok(()) => n += 1,
                Err(e) => log::error!("{}: {e}", self.name),
            }
        }
        n
    }

    fn mappings(&self) -> Vec<MappingInfo> {
        lock(&self.table).list()
    }

    // Dirty logging: the container API has no IOMMU dirty tracking (iommufd's
    // IOMMU_HWPT_GET_DIRTY_BITMAP would be the way where the kernel and IOMMU offer it), so
    // this domain keeps the trait's fallback: every fetch reports each mapped page, flagged
    // `whole_window`, and the VMM copies the whole window at the final pass.

    /// Hardware IOMMU faults are reported by the host kernel (DMAR/AMD-Vi log), not through
    /// VFIO, so this domain cannot count them.
    fn fault_count(&self) -> u64 {
        0
    }
}

impl<C: VfioContainerOps> Drop for VfioDomain<C> {
    fn drop(&mut self) {
        self.unmap_all();
    }
}

/// A recording stand-in for a VFIO container. Built for tests and with the `testing` feature only.
#[cfg(any(test, feature = "testing"))]
pub mod fake {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    use super::VfioContainerOps;

    /// One recorded call.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum FakeOp {
        /// `dma_map(iova, size)`.
        Map(u64, u64),
        /// `dma_unmap(iova, size)`.
        Unmap(u64, u64),
    }

    /// Records calls, keeps the IOVA→host table, and can be told to fail.
    #[derive(Debug, Default)]
    pub struct FakeVfioContainer {
        /// Calls in order.
        pub calls: Mutex<Vec<FakeOp>>,
        /// Live mappings: iova -> (size, host address).
        pub live: Mutex<BTreeMap<u64, (u64, usize)>>,
        /// Make the next call fail.
        pub fail_next: AtomicBool,
    }

    impl FakeVfioContainer {
        fn record(&self, op: FakeOp) -> Result<(), String> {
            if let Ok(mut c) = self.calls.lock() {
                c.push(op);
            }
            if self.fail_next.swap(false, Ordering::SeqCst) {
                return Err("injected failure".into());
            }
            Ok(())
        }

        /// Recorded calls so far.
        pub fn calls(&self) -> Vec<FakeOp> {
            self.calls.lock().map(|c| c.clone()).unwrap_or_default()
        }

        /// Live mappings (iova, size).
        pub fn live(&self) -> Vec<(u64, u64)> {
            self.live
                .lock()
                .map(|l| l.iter().map(|(&i, &(s, _))| (i, s)).collect())
                .unwrap_or_default()
        }
    }

    impl VfioContainerOps for FakeVfioContainer {
        unsafe fn dma_map(&self, iova: u64, size: u64, host_addr: *mut u8) -> Result<(), String> {
            self.record(FakeOp::Map(iova, size))?;
            let mut l = self.live.lock().map_err(|e| e.to_string())?;
            if l.contains_key(&iova) {
                return Err(format!("iova {iova:#x} already mapped (EEXIST)"));
            }
            l.insert(iova, (size, host_addr as usize));
            Ok(())
        }

        fn dma_unmap(&self, iova: u64, size: u64) -> Result<(), String> {
            self.record(FakeOp::Unmap(iova, size))?;
            let mut l = self.live.lock().map_err(|e| e.to_string())?;
            match l.get(&iova) {
                Some(&(s, _)) if s == size => {
                    l.remove(&iova);
                    Ok(())
                }
                _ => Err(format!("iova {iova:#x} size {size:#x} not mapped (ENOENT)")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::fake::{FakeOp, FakeVfioContainer};
    use super::*;
    use crate::iommu::{MmapBacking, VecBacking};

    #[test]
    fn maps_host_address_of_backing_and_unmaps_on_drop() {
        let fake = Arc::new(FakeVfioContainer::default());
        let dom = VfioDomain::new("vfio-test", Arc::clone(&fake));
        let b = Arc::new(MmapBacking::anonymous(0x4000).unwrap());
        let host = b.host_addr().unwrap().as_ptr() as usize;
        dom.map(0x8000_0000, 0x4000, b.clone()).unwrap();
        assert_eq!(fake.live.lock().unwrap()[&0x8000_0000], (0x4000, host));
        // Overlap rejected before reaching VFIO.
        assert!(dom.map(0x8000_1000, 0x1000, b.clone()).is_err());
        assert_eq!(fake.calls(), vec![FakeOp::Map(0x8000_0000, 0x4000)]);
        drop(dom);
        assert!(fake.live().is_empty());
        assert_eq!(
            fake.calls(),
            vec![
                FakeOp::Map(0x8000_0000, 0x4000),
                FakeOp::Unmap(0x8000_0000, 0x4000)
            ]
        );
    }

    #[test]
    fn rebind_to_the_same_memory_makes_no_vfio_call() {
        let mem = ntb::SharedMemory::new("ram", 0x4000).unwrap();
        let other = ntb::SharedMemory::new("other", 0x4000).unwrap();
        let view = |m: &ntb::SharedMemory| {
            let fd = m.fd().try_clone_to_owned().unwrap();
            Arc::new(MmapBacking::new(fd, 0, 0x4000).unwrap())
        };
        let fake = Arc::new(FakeVfioContainer::default());
        let dom = VfioDomain::new("vfio-test", Arc::clone(&fake));
        let old = view(&mem);
        dom.map(0x8000_0000, 0x4000, old.clone()).unwrap();
        let live = fake.live.lock().unwrap().clone();
        assert!(matches!(
            dom.rebind(0x8000_0000, 0x4000, view(&other)),
            Err(IommuError::NotSameMemory { .. })
        ));
        assert!(matches!(
            dom.rebind(0x8000_1000, 0x3000, view(&mem)),
            Err(IommuError::NotMapped { .. })
        ));
        dom.rebind(0x8000_0000, 0x4000, view(&mem)).unwrap();
        assert_eq!(Arc::strong_count(&old), 1, "the old host mapping is let go");
        // The IOMMU mapping was never removed or made again.
        assert_eq!(fake.calls(), vec![FakeOp::Map(0x8000_0000, 0x4000)]);
        assert_eq!(*fake.live.lock().unwrap(), live);
        assert_eq!(dom.mappings().len(), 1);
        drop(dom);
        assert_eq!(
            fake.calls(),
            vec![
                FakeOp::Map(0x8000_0000, 0x4000),
                FakeOp::Unmap(0x8000_0000, 0x4000)
            ]
        );
    }

    #[test]
    fn dirty_log_without_hardware_tracking_reports_the_whole_window() {
        let fake = Arc::new(FakeVfioContainer::default());
        let dom = VfioDomain::new("vfio-test", Arc::clone(&fake));
        let b = Arc::new(MmapBacking::anonymous(0x3000).unwrap());
        dom.map(0x10000, 0x3000, b).unwrap();
        assert!(
            !dom.start_dirty_log(),
            "no exact tracking through the container API"
        );
        // Every mapped page of the range, every time (nothing is cleared), flagged.
        for _ in 0..2 {
            let d = dom.fetch_dirty(0xe000, 0x8000).unwrap();
            assert!(d.whole_window);
            assert_eq!(d.iovas(), vec![0x10000, 0x11000, 0x12000]);
        }
        assert!(dom.fetch_dirty(0x10001, 0x1000).is_err());
        dom.stop_dirty_log();
        // The fake saw only the mapping: dirty logging touches no container state.
        assert_eq!(fake.calls(), vec![FakeOp::Map(0x10000, 0x3000)]);
    }

    #[test]
    fn message_backed_windows_cannot_go_to_hardware() {
        let fake = Arc::new(FakeVfioContainer::default());
        let dom = VfioDomain::new("vfio-test", Arc::clone(&fake));
        let e = dom
            .map(0x1000, 0x1000, Arc::new(VecBacking::new(0x1000)))
            .unwrap_err();
        assert!(matches!(e, IommuError::NotHostMapped(0x1000)));
        assert!(fake.calls().is_empty());
    }

    #[test]
    fn vfio_failures_are_reported_and_keep_state_consistent() {
        let fake = Arc::new(FakeVfioContainer::default());
        let dom = VfioDomain::new("vfio-test", Arc::clone(&fake));
        let b = Arc::new(MmapBacking::anonymous(0x1000).unwrap());
        fake.fail_next.store(true, Ordering::SeqCst);
        assert!(matches!(
            dom.map(0x1000, 0x1000, b.clone()),
            Err(IommuError::Vfio { op: "map", .. })
        ));
        assert!(dom.mappings().is_empty());
        dom.map(0x1000, 0x1000, b.clone()).unwrap();
        fake.fail_next.store(true, Ordering::SeqCst);
        assert!(dom.unmap(0x1000, 0x1000).is_err());
        // Still mapped in hardware, so still listed.
        assert_eq!(dom.mappings().len(), 1);
        assert_eq!(dom.unmap_all(), 1);
        assert!(fake.live().is_empty());
        assert_eq!(dom.fault_count(), 0);
    }
}
