//! Hardware IOMMU domain through VFIO: one container per lent device, the borrower's windows
//! programmed with `VFIO_IOMMU_MAP_DMA` at IOVA = guest-physical base.
//!
//! `vfio-ioctls` has no mockable constructor (it opens `/dev/vfio/vfio`), so the domain talks
//! to [`VfioContainerOps`]; [`vfio_ioctls::VfioContainer`] implements it for real and
//! [`fake::FakeVfioContainer`] records calls for tests. The real container ran against
//! Linux 6.1's type1 IOMMU with QEMU's intel-iommu (docs/VFIO.md, `tests/vfio_kernel.rs`).
//!
//! Every map is checked against the IOVA ranges the IOMMU can translate
//! (`VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE`): the kernel refuses a map that reaches into a
//! reserved range (on x86 the MSI window 0xfee00000-0xfeefffff) with a bare `EINVAL`; the
//! domain refuses it first with an error that names the range.

use std::sync::{Arc, Mutex};

use super::{lock, DmaBacking, IommuDomain, IommuError, MapTable, MappingInfo};

/// IOVAs the IOMMU can translate, `start..=end` (inclusive, as the kernel reports them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IovaRange {
    /// First IOVA.
    pub start: u64,
    /// Last IOVA (inclusive).
    pub end: u64,
}

/// The first reserved range (a gap between the usable `ranges`, or below or above them)
/// that `[iova, iova + size)` reaches into, as `start..=end`.
pub fn reserved_overlap(ranges: &[IovaRange], iova: u64, size: u64) -> Option<(u64, u64)> {
    let last = iova.checked_add(size.checked_sub(1)?)?;
    let mut sorted = ranges.to_vec();
    sorted.sort_by_key(|r| r.start);
    let mut gaps = Vec::new();
    let mut next = 0u64; // first IOVA not yet covered
    let mut covered_to_end = false;
    for r in &sorted {
        if r.start > next {
            gaps.push((next, r.start - 1));
        }
        match r.end.checked_add(1) {
            Some(n) => next = next.max(n),
            None => covered_to_end = true,
        }
    }
    if !covered_to_end {
        gaps.push((next, u64::MAX));
    }
    gaps.into_iter().find(|&(s, e)| s <= last && iova <= e)
}

/// `VFIO_IOMMU_GET_INFO` (`_IO(VFIO_TYPE, VFIO_BASE + 12)`): vfio-ioctls does not expose it.
mod get_info {
    use vfio_bindings::bindings::vfio::{VFIO_BASE, VFIO_TYPE};
    vmm_sys_util::ioctl_io_nr!(VFIO_IOMMU_GET_INFO, u32::from(VFIO_TYPE), VFIO_BASE + 12);
}

/// Reads the IOVA ranges of the container `fd` (its IOMMU set, i.e. a group attached)
/// from `VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE`; `None` if the kernel reports none (before
/// Linux 5.4).
pub fn read_iova_ranges(
    fd: std::os::fd::BorrowedFd<'_>,
) -> std::io::Result<Option<Vec<IovaRange>>> {
    use std::os::fd::AsRawFd;
    use vfio_bindings::bindings::vfio::{
        vfio_info_cap_header, vfio_iommu_type1_info, VFIO_IOMMU_INFO_CAPS,
        VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE,
    };
    const HDR: usize = std::mem::size_of::<vfio_iommu_type1_info>();
    const CAP_HDR: usize = std::mem::size_of::<vfio_info_cap_header>();
    let call = |buf: &mut Vec<u64>| -> std::io::Result<(u32, u32, u32)> {
        let argsz = (buf.len() * 8) as u32;
        // argsz (low half), flags 0 (high half).
        buf[0] = u64::from(argsz);
        // SAFETY: VFIO_IOMMU_GET_INFO reads `argsz` and writes at most `argsz` bytes into
        // the buffer, which is that long and 8-byte aligned (u64 elements), as the kernel's
        // struct vfio_iommu_type1_info and its capability chain need.
        let r = unsafe {
            libc::ioctl(
                fd.as_raw_fd(),
                get_info::VFIO_IOMMU_GET_INFO() as _,
                buf.as_mut_ptr(),
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let argsz = (buf[0] & 0xffff_ffff) as u32;
        let flags = (buf[0] >> 32) as u32;
        let cap_offset = (buf[2] & 0xffff_ffff) as u32;
        Ok((argsz, flags, cap_offset))
    };
    let mut buf = vec![0u64; HDR.div_ceil(8)];
    let (need, flags, _) = call(&mut buf)?;
    if flags & VFIO_IOMMU_INFO_CAPS == 0 || need as usize <= HDR {
        return Ok(None);
    }
    buf = vec![0u64; (need as usize).div_ceil(8)];
    let (_, _, mut off) = call(&mut buf)?;
    let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_le_bytes()).collect();
    let u32_at = |o: usize| {
        bytes
            .get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |o: usize| {
        bytes
            .get(o..o + 8)
            .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
    };
    // Walk the capability chain (offsets from the start of the buffer; 0 ends it), at most
    // as many steps as the buffer has headers.
    for _ in 0..bytes.len() / CAP_HDR {
        let o = off as usize;
        if o == 0 || o + CAP_HDR > bytes.len() {
            break;
        }
        let id = u32::from(u16::from_le_bytes([bytes[o], bytes[o + 1]]));
        let next = u32_at(o + 4).unwrap_or(0);
        if id == VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE {
            // struct vfio_iommu_type1_info_cap_iova_range: header, nr_iovas, reserved,
            // then nr_iovas × { start, end }.
            let n = u32_at(o + CAP_HDR).unwrap_or(0) as usize;
            let mut out = Vec::with_capacity(n.min(64));
            for i in 0..n {
                let at = o + CAP_HDR + 8 + 16 * i;
                match (u64_at(at), u64_at(at + 8)) {
                    (Some(start), Some(end)) => out.push(IovaRange { start, end }),
                    _ => break,
                }
            }
            return Ok(Some(out));
        }
        off = next;
    }
    Ok(None)
}

/// The container operations the domain needs.
/// Why an operation on a VFIO container failed: the typed error of the seam between the
/// lender and the kernel's VFIO (and of its test double, which answers as the kernel does).
#[derive(Debug, thiserror::Error)]
pub enum VfioOpError {
    /// The size does not fit this host's address space.
    #[error("size {0:#x} does not fit this host's address space")]
    TooLarge(u64),
    /// `VFIO_IOMMU_MAP_DMA` or `VFIO_IOMMU_UNMAP_DMA` failed; the kernel's errno is the
    /// source's ([`VfioOpError::errno`]).
    #[error("{0}")]
    Container(#[source] vfio_ioctls::VfioError),
    /// `VFIO_IOMMU_GET_INFO` failed.
    #[error("VFIO_IOMMU_GET_INFO: {0}")]
    Info(#[source] std::io::Error),
}

impl VfioOpError {
    /// The kernel's errno, where the kernel answered.
    pub fn errno(&self) -> Option<i32> {
        match self {
            VfioOpError::TooLarge(_) => None,
            VfioOpError::Container(
                vfio_ioctls::VfioError::IommuDmaMap(e) | vfio_ioctls::VfioError::IommuDmaUnmap(e),
            ) => Some(e.errno()),
            VfioOpError::Container(_) => None,
            VfioOpError::Info(e) => e.raw_os_error(),
        }
    }
}

pub trait VfioContainerOps: Send + Sync {
    /// Programs the IOMMU so that `[iova, iova + size)` reaches `[host_addr, host_addr + size)`.
    ///
    /// # Safety
    ///
    /// The host range must stay mapped in this process until [`Self::dma_unmap`] of the same
    /// range succeeds — or, see [`VfioDomain`]'s `rebind`, be replaced by another mapping of
    /// the same file range — and no Rust references to it may exist while it is mapped (the
    /// device reads and writes it concurrently).
    unsafe fn dma_map(&self, iova: u64, size: u64, host_addr: *mut u8) -> Result<(), VfioOpError>;
    /// Removes a mapping made by [`Self::dma_map`].
    fn dma_unmap(&self, iova: u64, size: u64) -> Result<(), VfioOpError>;
    /// The IOVA ranges the IOMMU can map (`VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE`); `None`
    /// when the kernel does not say.
    fn iova_ranges(&self) -> Result<Option<Vec<IovaRange>>, VfioOpError>;
}

impl VfioContainerOps for vfio_ioctls::VfioContainer {
    // SAFETY (contract): the caller keeps the range mapped as the trait's `dma_map` says.
    unsafe fn dma_map(&self, iova: u64, size: u64, host_addr: *mut u8) -> Result<(), VfioOpError> {
        let size = usize::try_from(size).map_err(|_| VfioOpError::TooLarge(size))?;
        // SAFETY: the caller upholds this function's contract, which is the contract of
        // `VfioContainer::vfio_dma_map`.
        unsafe { self.vfio_dma_map(iova, size, host_addr) }.map_err(VfioOpError::Container)
    }

    fn dma_unmap(&self, iova: u64, size: u64) -> Result<(), VfioOpError> {
        let size = usize::try_from(size).map_err(|_| VfioOpError::TooLarge(size))?;
        self.vfio_dma_unmap(iova, size)
            .map_err(VfioOpError::Container)
    }

    fn iova_ranges(&self) -> Result<Option<Vec<IovaRange>>, VfioOpError> {
        use std::os::fd::AsRawFd;
        // SAFETY: the container's fd is open for as long as `self`, which outlives the borrow.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.as_raw_fd()) };
        read_iova_ranges(fd).map_err(VfioOpError::Info)
    }
}

impl<T: VfioContainerOps + ?Sized> VfioContainerOps for Arc<T> {
    // SAFETY (contract): as the trait's `dma_map`, passed on unchanged.
    unsafe fn dma_map(&self, iova: u64, size: u64, host_addr: *mut u8) -> Result<(), VfioOpError> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { (**self).dma_map(iova, size, host_addr) }
    }

    fn dma_unmap(&self, iova: u64, size: u64) -> Result<(), VfioOpError> {
        (**self).dma_unmap(iova, size)
    }

    fn iova_ranges(&self) -> Result<Option<Vec<IovaRange>>, VfioOpError> {
        (**self).iova_ranges()
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
        // The kernel refuses a map into a reserved range with a bare EINVAL: say which.
        match self.ops.iova_ranges() {
            Ok(Some(ranges)) => {
                if let Some((start, end)) = reserved_overlap(&ranges, iova, size) {
                    return Err(IommuError::ReservedIova {
                        iova,
                        size,
                        start,
                        end,
                    });
                }
            }
            Ok(None) => {}
            Err(e) => log::warn!(
                "{}: cannot read the iommu's iova ranges ({e}); mapping {iova:#x}+{size:#x} \
                 unchecked",
                self.name
            ),
        }
        // SAFETY: `backing` owns a live host mapping of at least `size` bytes (checked above);
        // the table entry keeps the Arc — and so the mapping — alive until the IOMMU mapping is
        // removed (unmap keeps the entry if VFIO refuses to unmap). Accesses to the memory go
        // through raw-pointer copies only.
        unsafe { self.ops.dma_map(iova, size, host.as_ptr()) }.map_err(|source| {
            IommuError::Vfio {
                op: "map",
                iova,
                size,
                source,
            }
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
            .map_err(|source| IommuError::Vfio {
                op: "unmap",
                iova,
                size,
                source,
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

    use vfio_ioctls::VfioError;
    use vmm_sys_util::errno::Error as Errno;

    use super::{VfioContainerOps, VfioOpError};

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
        /// Usable IOVA ranges; `None` (the default): x86's with intel-iommu, as Linux 6.1
        /// reports them ([`X86_IOVA_RANGES`]).
        pub ranges: Mutex<Option<Vec<super::IovaRange>>>,
    }

    /// What Linux 6.1's type1 reported under QEMU's intel-iommu (39-bit address width): all
    /// but the MSI window 0xfee00000-0xfeefffff.
    pub const X86_IOVA_RANGES: [super::IovaRange; 2] = [
        super::IovaRange {
            start: 0,
            end: 0xfedf_ffff,
        },
        super::IovaRange {
            start: 0xfef0_0000,
            end: 0x7f_ffff_ffff,
        },
    ];

    impl FakeVfioContainer {
        fn record(&self, op: FakeOp) -> Result<(), VfioOpError> {
            let failed = |e| match op {
                FakeOp::Map(..) => VfioOpError::Container(VfioError::IommuDmaMap(e)),
                FakeOp::Unmap(..) => VfioOpError::Container(VfioError::IommuDmaUnmap(e)),
            };
            if let Ok(mut c) = self.calls.lock() {
                c.push(op.clone());
            }
            if self.fail_next.swap(false, Ordering::SeqCst) {
                // An injected failure: what the kernel answers when it cannot pin or
                // allocate.
                return Err(failed(Errno::new(libc::ENOMEM)));
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
        // SAFETY (contract): as the trait's `dma_map`; the fake only records the range.
        unsafe fn dma_map(
            &self,
            iova: u64,
            size: u64,
            host_addr: *mut u8,
        ) -> Result<(), VfioOpError> {
            self.record(FakeOp::Map(iova, size))?;
            // As the kernel: EINVAL for a range outside the usable IOVAs, EEXIST for any
            // overlap with a live mapping (not only one that starts at the same IOVA).
            let refused = |errno| {
                Err(VfioOpError::Container(VfioError::IommuDmaMap(Errno::new(
                    errno,
                ))))
            };
            let ranges = self.iova_ranges()?.unwrap_or_default();
            if super::reserved_overlap(&ranges, iova, size).is_some() {
                return refused(libc::EINVAL);
            }
            let mut l = self.live.lock().unwrap_or_else(|e| e.into_inner());
            let end = iova.saturating_add(size);
            if l.iter()
                .any(|(&i, &(s, _))| i < end && iova < i.saturating_add(s))
            {
                return refused(libc::EEXIST);
            }
            l.insert(iova, (size, host_addr as usize));
            Ok(())
        }

        fn dma_unmap(&self, iova: u64, size: u64) -> Result<(), VfioOpError> {
            self.record(FakeOp::Unmap(iova, size))?;
            let mut l = self.live.lock().unwrap_or_else(|e| e.into_inner());
            match l.get(&iova) {
                Some(&(s, _)) if s == size => {
                    l.remove(&iova);
                    Ok(())
                }
                // The kernel's type1 answers an unmap of nothing with success and 0 bytes
                // unmapped, which vfio-ioctls turns into this error.
                _ => Err(VfioOpError::Container(VfioError::InvalidDmaUnmapSize)),
            }
        }

        fn iova_ranges(&self) -> Result<Option<Vec<super::IovaRange>>, VfioOpError> {
            let r = self.ranges.lock().unwrap_or_else(|e| e.into_inner());
            Ok(Some(r.clone().unwrap_or_else(|| X86_IOVA_RANGES.to_vec())))
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
    fn maps_into_the_msi_window_are_refused_naming_the_range() {
        let fake = Arc::new(FakeVfioContainer::default());
        let dom = VfioDomain::new("vfio-test", Arc::clone(&fake));
        let b = Arc::new(MmapBacking::anonymous(0x20_0000).unwrap());
        // Below, straddling and inside the MSI window.
        dom.map(0xfea0_0000, 0x20_0000, b.clone()).unwrap();
        for iova in [0xfed0_0000u64, 0xfee0_0000] {
            let e = dom.map(iova, 0x20_0000, b.clone()).unwrap_err();
            assert!(
                matches!(
                    e,
                    IommuError::ReservedIova {
                        start: 0xfee0_0000,
                        end: 0xfeef_ffff,
                        ..
                    }
                ),
                "{e}"
            );
            assert!(e.to_string().contains("0xfee00000-0xfeefffff"), "{e}");
        }
        // Refused before VFIO saw it; the kernel (and the fake) would say only EINVAL.
        assert_eq!(fake.calls(), vec![FakeOp::Map(0xfea0_0000, 0x20_0000)]);
        // SAFETY: the fake records the address only.
        let raw = unsafe { fake.dma_map(0xfee0_0000, 0x1000, std::ptr::null_mut()) };
        assert_eq!(raw.unwrap_err().errno(), Some(libc::EINVAL));
        // Above the IOMMU's address width.
        let e = dom.map(0x80_0000_0000, 0x1000, b).unwrap_err();
        assert!(
            matches!(
                e,
                IommuError::ReservedIova {
                    start: 0x80_0000_0000,
                    end: u64::MAX,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn reserved_overlap_finds_the_gaps() {
        let r = fake::X86_IOVA_RANGES;
        assert_eq!(reserved_overlap(&r, 0, 0x1000), None);
        assert_eq!(reserved_overlap(&r, 0xfedf_f000, 0x1000), None);
        assert_eq!(
            reserved_overlap(&r, 0xfedf_f000, 0x2000),
            Some((0xfee0_0000, 0xfeef_ffff))
        );
        assert_eq!(reserved_overlap(&r, 0xfef0_0000, 0x1000), None);
        let all = [IovaRange {
            start: 0,
            end: u64::MAX,
        }];
        assert_eq!(reserved_overlap(&all, u64::MAX - 0xfff, 0x1000), None);
        let hi = [IovaRange {
            start: 0x1000,
            end: u64::MAX,
        }];
        assert_eq!(reserved_overlap(&hi, 0, 0x2000), Some((0, 0xfff)));
    }

    #[test]
    fn the_fake_refuses_any_overlap_as_the_kernel_does() {
        let fake = FakeVfioContainer::default();
        // SAFETY: the fake records the address only.
        unsafe {
            fake.dma_map(0x10_0000, 0x4000, std::ptr::null_mut())
                .unwrap();
            let e = fake
                .dma_map(0x10_2000, 0x4000, std::ptr::null_mut())
                .unwrap_err();
            assert_eq!(e.errno(), Some(libc::EEXIST), "{e}");
            let e = fake
                .dma_map(0x0f_f000, 0x2000, std::ptr::null_mut())
                .unwrap_err();
            assert_eq!(e.errno(), Some(libc::EEXIST), "{e}");
            fake.dma_map(0x10_4000, 0x1000, std::ptr::null_mut())
                .unwrap();
        }
    }

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
