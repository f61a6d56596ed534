//! Guest RAM: one memfd (MAP_SHARED) split into a low and an optional high region.
//!
//! Low RAM covers `[0, min(size, 0xC000_0000))` at file offset = GPA; whatever does not fit
//! below the 32-bit PCI hole goes to `[4 GiB, 4 GiB + rest)` at file offset 0xC000_0000. The
//! memfd and the region table are public so the fabric can export guest RAM to a lender.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Arc;

use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap};

use crate::config::{RamBacking, SharedRam};
use crate::layout::{MEM_32BIT_GAP_START, RAM_64BIT_START};

/// Guest memory type used across the VMM.
pub type GuestMemory = GuestMemoryMmap<()>;

/// Smallest guest the VMM builds (the fixed boot structures live below 1 MiB, the kernel above).
pub const MIN_RAM_SIZE: u64 = 16 << 20;

/// Errors of guest memory set-up.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("guest memory size {size:#x} is below the minimum of {min:#x}")]
    TooSmall { size: u64, min: u64 },
    #[error("guest memory size {0:#x} is not a multiple of 4 KiB")]
    Unaligned(u64),
    #[error("memfd_create failed")]
    Memfd(#[source] std::io::Error),
    #[error("cannot size the guest memfd to {size:#x} bytes")]
    Truncate {
        size: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot seal the guest memfd (seals {seals:#x})")]
    Seal {
        seals: libc::c_int,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot map guest memory")]
    Map(#[source] vm_memory::mmap::FromRangesError),
    #[error(
        "the guest ram memfd handed over is {got:#x} bytes (or cannot be measured), the vm \
         has {want:#x}"
    )]
    MemfdSize { got: u64, want: u64 },
    #[error("the guest ram memfd handed over lacks the size seals {want:#x} (it has {got:#x})")]
    MemfdSeals { got: libc::c_int, want: libc::c_int },
    #[error(
        "hugepages=on needs {size:#x} bytes of guest ram in {page_size:#x}-byte huge pages \
         ({needed} pages) but only {free} are free (HugePages_Free in /proc/meminfo); reserve \
         them (echo {needed} > /proc/sys/vm/nr_hugepages) or drop hugepages=on"
    )]
    NoHugepages {
        size: u64,
        page_size: u64,
        needed: u64,
        free: u64,
    },
    #[error("hugepages=on: guest memory size {size:#x} is not a multiple of the huge page size {page_size:#x}")]
    HugepageUnaligned { size: u64, page_size: u64 },
    #[error("hugepages=on: cannot read the huge page pool from /proc/meminfo")]
    HugepageInfo(#[source] std::io::Error),
    #[error("shared={path}: cannot open it read-write (it must exist: the file behind the shared window)")]
    SharedOpen {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "shared={path}: the region is {size:#x} bytes, not a power of two, so it cannot be the \
         memory behind a PCI BAR"
    )]
    SharedNotPowerOfTwo { path: String, size: u64 },
    #[error(
        "shared={path}: guest RAM of {ram:#x} bytes at offset {offset:#x} does not fit in the \
         {size:#x}-byte region (guest RAM must lie inside the shared region)"
    )]
    SharedTooSmall {
        path: String,
        ram: u64,
        offset: u64,
        size: u64,
    },
    #[error("shared=: offset {0:#x} is not a multiple of 4 KiB")]
    SharedUnaligned(u64),
    #[error("thp=on: madvise(MADV_HUGEPAGE) of {addr:#x}+{len:#x} failed")]
    Thp {
        addr: u64,
        len: u64,
        #[source]
        source: std::io::Error,
    },
}

/// (free huge pages, huge page size in bytes) of the default pool from /proc/meminfo text.
pub fn hugepage_pool(meminfo: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
    };
    Some((field("HugePages_Free:")?, field("Hugepagesize:")? * 1024))
}

/// Checks up front that `size` bytes of huge pages are free, so a missing reservation is an
/// error naming it rather than an `ENOMEM` from mmap (or a SIGBUS on first touch).
fn check_hugepages(size: u64, meminfo: &str) -> Result<(), MemoryError> {
    let (free, page_size) = hugepage_pool(meminfo).ok_or_else(|| {
        MemoryError::HugepageInfo(std::io::Error::other(
            "no HugePages_Free / Hugepagesize lines",
        ))
    })?;
    if page_size == 0 || !size.is_multiple_of(page_size) {
        return Err(MemoryError::HugepageUnaligned { size, page_size });
    }
    let needed = size / page_size;
    if free < needed {
        return Err(MemoryError::NoHugepages {
            size,
            page_size,
            needed,
            free,
        });
    }
    Ok(())
}

/// Opens the shared region of `--memory ...,shared=PATH` and checks that `size` bytes of RAM
/// fit in it at the offset. The region is not sealed (a file in `/dev/shm` behind a QEMU
/// ivshmem device, or an NTB window, cannot be): it must not be truncated while the VM runs,
/// like any memory-backend file.
fn open_shared(shared: &SharedRam, size: u64) -> Result<File, MemoryError> {
    let path = shared.path.display().to_string();
    if !shared.offset.is_multiple_of(4096) {
        return Err(MemoryError::SharedUnaligned(shared.offset));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&shared.path)
        .map_err(|source| MemoryError::SharedOpen {
            path: path.clone(),
            source,
        })?;
    let region = file
        .metadata()
        .map_err(|source| MemoryError::SharedOpen {
            path: path.clone(),
            source,
        })?
        .len();
    if region == 0 || !region.is_power_of_two() {
        return Err(MemoryError::SharedNotPowerOfTwo { path, size: region });
    }
    if shared
        .offset
        .checked_add(size)
        .is_none_or(|end| end > region)
    {
        return Err(MemoryError::SharedTooSmall {
            path,
            ram: size,
            offset: shared.offset,
            size: region,
        });
    }
    Ok(file)
}

/// One contiguous piece of guest RAM and where it lives in the memfd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RamRegion {
    /// Guest physical start.
    pub gpa: u64,
    /// Length in bytes.
    pub size: u64,
    /// Offset of `gpa` inside the memfd.
    pub file_offset: u64,
}

/// Splits `size` bytes of RAM around the 32-bit PCI hole (pure; unit-tested).
pub fn ram_regions(size: u64) -> Vec<RamRegion> {
    let low = size.min(MEM_32BIT_GAP_START);
    let mut regions = vec![RamRegion {
        gpa: 0,
        size: low,
        file_offset: 0,
    }];
    if size > low {
        regions.push(RamRegion {
            gpa: RAM_64BIT_START,
            size: size - low,
            file_offset: low,
        });
    }
    regions
}

/// Seals of the guest RAM memfd: its size is fixed once sized (`F_SEAL_SHRINK | F_SEAL_GROW`),
/// so a lender that maps it as a fabric window can never fault past a shrunken end, and no
/// further seals can be added (`F_SEAL_SEAL`): a peer that receives the fd cannot, e.g., stop
/// the VMM from mapping its own RAM writable with `F_SEAL_FUTURE_WRITE`. Lenders refuse
/// unsealed windows by default (`ntb::LinkConfig::require_sealed_windows`).
pub const GUEST_RAM_SEALS: libc::c_int = ntb::mem::WINDOW_SEALS;

/// The guest's RAM: memfd, mapping and region table.
pub struct GuestRam {
    memfd: Arc<File>,
    memory: GuestMemory,
    regions: Vec<RamRegion>,
}

impl GuestRam {
    /// Creates a memfd of `size` bytes, seals its size ([`GUEST_RAM_SEALS`]) and maps it per
    /// the memory map.
    pub fn new(size: u64) -> Result<Self, MemoryError> {
        Self::with_backing(size, RamBacking::default())
    }

    /// [`GuestRam::new`] with huge pages: `hugepages` makes the memfd a hugetlbfs one
    /// (`MFD_HUGETLB`, after checking the pool has `size` bytes free), `thp` advises
    /// transparent huge pages on the mapping (pinning then faults 2 MiB at a time).
    pub fn with_backing(size: u64, backing: RamBacking) -> Result<Self, MemoryError> {
        if size < MIN_RAM_SIZE {
            return Err(MemoryError::TooSmall {
                size,
                min: MIN_RAM_SIZE,
            });
        }
        if !size.is_multiple_of(4096) {
            return Err(MemoryError::Unaligned(size));
        }
        if let Some(shared) = &backing.shared {
            let file = open_shared(shared, size)?;
            return Self::map_at(Arc::new(file), size, shared.offset, backing.thp);
        }
        let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
        if backing.hugepages {
            let meminfo =
                std::fs::read_to_string("/proc/meminfo").map_err(MemoryError::HugepageInfo)?;
            check_hugepages(size, &meminfo)?;
            flags |= libc::MFD_HUGETLB;
        }
        let name = CString::new("lendvm-guest-ram").unwrap_or_default();
        // SAFETY: `name` is a valid NUL-terminated string; the return value is checked.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
        if fd < 0 {
            return Err(MemoryError::Memfd(std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size)
            .map_err(|source| MemoryError::Truncate { size, source })?;
        // SAFETY: F_ADD_SEALS on the memfd this function owns, with an integer argument; the
        // return value is checked.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, GUEST_RAM_SEALS) } < 0 {
            return Err(MemoryError::Seal {
                seals: GUEST_RAM_SEALS,
                source: std::io::Error::last_os_error(),
            });
        }
        Self::map(Arc::new(file), size, backing.thp)
    }

    /// Guest RAM on an existing memfd: another lendvm's on the same host (live migration's
    /// memfd fast path: the RAM is shared, not copied). The memfd must be `size` bytes and
    /// carry [`GUEST_RAM_SEALS`].
    pub fn from_memfd(file: File, size: u64) -> Result<Self, MemoryError> {
        let got = file.metadata().map(|m| m.len()).unwrap_or(0);
        if got != size {
            return Err(MemoryError::MemfdSize { got, want: size });
        }
        // SAFETY: F_GET_SEALS on an fd we own; no memory is involved; the result is checked.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & GUEST_RAM_SEALS != GUEST_RAM_SEALS {
            return Err(MemoryError::MemfdSeals {
                got: seals,
                want: GUEST_RAM_SEALS,
            });
        }
        Self::map(Arc::new(file), size, false)
    }

    fn map(memfd: Arc<File>, size: u64, thp: bool) -> Result<Self, MemoryError> {
        Self::map_at(memfd, size, 0, thp)
    }

    /// Maps guest RAM from `base` bytes into `memfd` on.
    fn map_at(memfd: Arc<File>, size: u64, base: u64, thp: bool) -> Result<Self, MemoryError> {
        let mut regions = ram_regions(size);
        for r in &mut regions {
            r.file_offset += base;
        }
        let ranges = regions.iter().map(|r| {
            (
                GuestAddress(r.gpa),
                r.size as usize,
                Some(FileOffset::from_arc(memfd.clone(), r.file_offset)),
            )
        });
        let memory = GuestMemory::from_ranges_with_files(ranges).map_err(MemoryError::Map)?;
        if thp {
            advise_thp(&memory)?;
        }
        log::debug!(
            "guest RAM {size:#x} bytes in memfd {}: {regions:x?}",
            memfd.as_raw_fd()
        );
        Ok(Self {
            memfd,
            memory,
            regions,
        })
    }

    /// Faults every page of guest RAM into this process's page tables
    /// (`MADV_POPULATE_WRITE`), so that pinning it later (`mlock` when a lent device sets Bus
    /// Master Enable) only walks them. A migration destination does it before the source
    /// pauses, keeping it out of the downtime. A kernel without `MADV_POPULATE_WRITE`
    /// (before 5.14) leaves it to the pin; that is logged, not an error.
    pub fn populate(&self) {
        use vm_memory::GuestMemoryBackend;
        let t0 = std::time::Instant::now();
        for r in &self.regions {
            let Ok(host) = self.memory.get_host_address(GuestAddress(r.gpa)) else {
                continue;
            };
            // SAFETY: `[host, host + size)` is this region's live mapping (owned by
            // `self.memory`); MADV_POPULATE_WRITE only faults pages in, changing no data.
            let rc = unsafe {
                libc::madvise(
                    host.cast::<libc::c_void>(),
                    r.size as usize,
                    libc::MADV_POPULATE_WRITE,
                )
            };
            if rc != 0 {
                log::info!(
                    "populating guest ram at {:#x}: {}; the pin will fault it in",
                    r.gpa,
                    std::io::Error::last_os_error()
                );
                return;
            }
        }
        log::info!(
            "guest ram populated ({:#x} bytes) in {:.1} ms",
            self.size(),
            t0.elapsed().as_secs_f64() * 1e3
        );
    }

    /// The guest memory map (cheap to clone: regions are reference counted).
    pub fn memory(&self) -> &GuestMemory {
        &self.memory
    }

    /// The memfd backing all guest RAM (for exporting RAM over the fabric).
    pub fn memfd(&self) -> &Arc<File> {
        &self.memfd
    }

    /// The RAM regions with their memfd offsets.
    pub fn regions(&self) -> &[RamRegion] {
        &self.regions
    }

    /// Total RAM size.
    pub fn size(&self) -> u64 {
        self.regions.iter().map(|r| r.size).sum()
    }

    /// First guest physical address after the highest RAM byte.
    pub fn end(&self) -> u64 {
        self.regions
            .iter()
            .map(|r| r.gpa + r.size)
            .max()
            .unwrap_or(0)
    }
}

/// `MADV_HUGEPAGE` on every region of `memory`.
fn advise_thp(memory: &GuestMemory) -> Result<(), MemoryError> {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    let shmem = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .unwrap_or_default();
    if !shmem.contains("[advise]")
        && !shmem.contains("[always]")
        && !shmem.contains("[within_size]")
        && !shmem.contains("[force]")
    {
        log::warn!(
            "thp=on: /sys/kernel/mm/transparent_hugepage/shmem_enabled is '{}', so the kernel \
             ignores MADV_HUGEPAGE on guest ram (set it to advise)",
            shmem.trim()
        );
    }
    for region in memory.iter() {
        let addr = region.as_ptr() as u64;
        let len = region.len();
        // SAFETY: advice on a mapping the guest memory owns; it does not change contents.
        if unsafe { libc::madvise(addr as *mut libc::c_void, len as usize, libc::MADV_HUGEPAGE) }
            != 0
        {
            return Err(MemoryError::Thp {
                addr,
                len,
                source: std::io::Error::last_os_error(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemoryBackend};

    #[test]
    fn small_ram_is_one_low_region() {
        assert_eq!(
            ram_regions(512 << 20),
            vec![RamRegion {
                gpa: 0,
                size: 512 << 20,
                file_offset: 0
            }]
        );
    }

    #[test]
    fn large_ram_is_split_around_the_pci_hole() {
        let r = ram_regions(4 << 30);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].size, 0xc000_0000);
        assert_eq!(r[1].gpa, 1 << 32);
        assert_eq!(r[1].size, (4 << 30) - 0xc000_0000);
        assert_eq!(r[1].file_offset, 0xc000_0000);
    }

    #[test]
    fn memfd_backs_guest_memory() {
        use std::os::unix::fs::FileExt;
        let ram = GuestRam::new(MIN_RAM_SIZE).unwrap();
        ram.memory()
            .write_obj(0xdead_beefu32, GuestAddress(0x1234))
            .unwrap();
        let mut b = [0u8; 4];
        ram.memfd().read_exact_at(&mut b, 0x1234).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0xdead_beef);
        assert_eq!(ram.memory().num_regions(), 1);
        assert!(matches!(
            GuestRam::new(1 << 20),
            Err(MemoryError::TooSmall { .. })
        ));
    }

    #[test]
    fn guest_ram_memfd_is_sealed_against_resizing() {
        use std::os::fd::AsFd;
        let ram = GuestRam::new(MIN_RAM_SIZE).unwrap();
        let fd = ram.memfd().as_fd();
        let seals = ntb::mem::fd_seals(fd).unwrap().unwrap();
        for (seal, name) in [
            (libc::F_SEAL_SHRINK, "F_SEAL_SHRINK"),
            (libc::F_SEAL_GROW, "F_SEAL_GROW"),
            (libc::F_SEAL_SEAL, "F_SEAL_SEAL"),
        ] {
            assert_ne!(seals & seal, 0, "{name} missing from seals {seals:#x}");
        }
        // Writes (the guest's own RAM) stay allowed.
        assert_eq!(seals & (libc::F_SEAL_WRITE | libc::F_SEAL_FUTURE_WRITE), 0);
        // Nobody holding the fd can resize it or add seals.
        let e = ram.memfd().set_len(MIN_RAM_SIZE / 2).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        let e = ram.memfd().set_len(MIN_RAM_SIZE * 2).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        // SAFETY: F_ADD_SEALS on a live fd owned by `ram`; the result is checked.
        let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
        assert_eq!(r, -1, "F_SEAL_SEAL forbids more seals");
        assert_eq!(ram.size(), MIN_RAM_SIZE);
    }

    const MEMINFO: &str = "MemTotal:       24000000 kB\nHugePages_Total:       4\n\
                           HugePages_Free:        3\nHugepagesize:       2048 kB\n";

    #[test]
    fn hugepage_pool_is_checked_against_the_size() {
        assert_eq!(hugepage_pool(MEMINFO), Some((3, 2 << 20)));
        assert!(check_hugepages(6 << 20, MEMINFO).is_ok());
        let e = check_hugepages(8 << 20, MEMINFO).unwrap_err();
        let s = e.to_string();
        assert!(
            matches!(
                e,
                MemoryError::NoHugepages {
                    needed: 4,
                    free: 3,
                    ..
                }
            ),
            "{s}"
        );
        assert!(
            s.contains("HugePages_Free") && s.contains("nr_hugepages"),
            "{s}"
        );
        assert!(matches!(
            check_hugepages(3 << 20, MEMINFO),
            Err(MemoryError::HugepageUnaligned { .. })
        ));
        assert!(matches!(
            check_hugepages(2 << 20, "MemTotal: 1 kB\n"),
            Err(MemoryError::HugepageInfo(_))
        ));
    }

    /// This host's pool decides which path runs; both are asserted (CI hosts reserve none).
    #[test]
    fn hugepages_on_fails_clearly_or_maps_hugetlb_ram() {
        let size = 64 << 20;
        let (free, page) = hugepage_pool(&std::fs::read_to_string("/proc/meminfo").unwrap())
            .expect("/proc/meminfo has a huge page pool");
        let r = GuestRam::with_backing(
            size,
            RamBacking {
                hugepages: true,
                thp: false,
                shared: None,
            },
        );
        if free * page < size {
            let e = r
                .err()
                .expect("hugepages=on without reserved pages must fail");
            assert!(matches!(e, MemoryError::NoHugepages { .. }), "{e}");
            assert!(e.to_string().contains("hugepages=on"), "{e}");
        } else {
            let ram = r.unwrap();
            ram.memory()
                .write_obj(0x1234_5678u32, GuestAddress(0x1000))
                .unwrap();
            assert_eq!(
                ram.memory().read_obj::<u32>(GuestAddress(0x1000)).unwrap(),
                0x1234_5678
            );
        }
    }

    #[test]
    fn thp_backed_ram_works_and_is_advised() {
        let ram = GuestRam::with_backing(
            32 << 20,
            RamBacking {
                hugepages: false,
                thp: true,
                shared: None,
            },
        )
        .unwrap();
        ram.memory()
            .write_obj(7u64, GuestAddress(0x20_0000))
            .unwrap();
        assert_eq!(
            ram.memory()
                .read_obj::<u64>(GuestAddress(0x20_0000))
                .unwrap(),
            7
        );
        // The advice is on the vma: /proc/self/smaps marks it "hg".
        let host = ram.memory().get_host_address(GuestAddress(0)).unwrap() as u64;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut in_vma = false;
        let mut flags = None;
        for l in smaps.lines() {
            if let Some((range, _)) = l.split_once(' ') {
                if let Some((a, _)) = range.split_once('-') {
                    if let Ok(a) = u64::from_str_radix(a, 16) {
                        in_vma = a == host;
                        continue;
                    }
                }
            }
            if in_vma {
                if let Some(f) = l.strip_prefix("VmFlags:") {
                    flags = Some(f.to_string());
                    break;
                }
            }
        }
        let flags = flags.expect("guest ram vma in smaps");
        assert!(
            flags.split_whitespace().any(|f| f == "hg"),
            "VmFlags: {flags}"
        );
    }
}

#[cfg(test)]
mod shared_tests {
    use std::os::unix::fs::FileExt;

    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use crate::config::{RamBacking, SharedRam};

    fn backing(path: &std::path::Path, offset: u64) -> RamBacking {
        RamBacking {
            shared: Some(SharedRam {
                path: path.to_path_buf(),
                offset,
            }),
            ..RamBacking::default()
        }
    }

    #[test]
    fn guest_ram_lives_in_the_shared_region_at_its_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ivshmem");
        File::create(&path).unwrap().set_len(64 << 20).unwrap();
        let ram = GuestRam::with_backing(16 << 20, backing(&path, 32 << 20)).unwrap();
        assert_eq!(ram.regions()[0].file_offset, 32 << 20);
        ram.memory()
            .write_slice(b"dma", GuestAddress(0x1000))
            .unwrap();
        let mut b = [0u8; 3];
        File::open(&path)
            .unwrap()
            .read_exact_at(&mut b, (32 << 20) + 0x1000)
            .unwrap();
        assert_eq!(&b, b"dma");
    }

    #[test]
    fn a_region_that_cannot_hold_the_ram_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let odd = dir.path().join("odd");
        File::create(&odd).unwrap().set_len(48 << 20).unwrap();
        let e = GuestRam::with_backing(16 << 20, backing(&odd, 0))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not a power of two"), "{e}");
        let small = dir.path().join("small");
        File::create(&small).unwrap().set_len(32 << 20).unwrap();
        let e = GuestRam::with_backing(32 << 20, backing(&small, 4096))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("does not fit"), "{e}");
        let e = GuestRam::with_backing(16 << 20, backing(&small, 100))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("4 KiB"), "{e}");
        let e = GuestRam::with_backing(16 << 20, backing(&dir.path().join("none"), 0))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("cannot open"), "{e}");
    }
}
