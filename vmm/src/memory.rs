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
        if size < MIN_RAM_SIZE {
            return Err(MemoryError::TooSmall {
                size,
                min: MIN_RAM_SIZE,
            });
        }
        if !size.is_multiple_of(4096) {
            return Err(MemoryError::Unaligned(size));
        }
        let name = CString::new("lendvm-guest-ram").unwrap_or_default();
        // SAFETY: `name` is a valid NUL-terminated string; the return value is checked.
        let fd = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
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
        let memfd = Arc::new(file);
        let regions = ram_regions(size);
        let ranges = regions.iter().map(|r| {
            (
                GuestAddress(r.gpa),
                r.size as usize,
                Some(FileOffset::from_arc(memfd.clone(), r.file_offset)),
            )
        });
        let memory = GuestMemory::from_ranges_with_files(ranges).map_err(MemoryError::Map)?;
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
}
