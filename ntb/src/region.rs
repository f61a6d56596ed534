//! The shared region of a `bar` link: memory that both ends of a link map, the lender through
//! a PCI BAR and the borrower through the file behind it.
//!
//! On NTB hardware a lender reaches a borrower's memory through a BAR of its NTB function
//! (Linux `ntb_hw_*` memory windows, a Switchtec or Dolphin adapter): the BAR is translated
//! onto the borrower's RAM. Here an ivshmem-plain device of a QEMU guest ("L1") plays that BAR:
//! its memory is a file in `/dev/shm` on the outer machine, which the borrower maps and puts
//! its guest RAM into, and L1 maps the same memory from sysfs (`resource2`). A window on such a
//! link is an offset and a size inside the region; no fd crosses the link.
//!
//! The region's last [`RegionSpec::ring_area`] bytes hold the links' control rings
//! ([`crate::ring`]): [`RegionSpec::rings`] slots of [`RING_SLOT_SIZE`] bytes, one per link
//! whose control path is a ring. Windows may not reach into them ([`Region::check_range`]).

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::fabric::FabricError;

/// Bytes of one link's control rings in the region: a 4 KiB header and two rings of 14 KiB,
/// one per direction ([`crate::ring`]). Control messages are small (a trapped register access
/// is ~60 bytes on the wire); a larger frame streams through in pieces.
pub const RING_SLOT_SIZE: u64 = 32 << 10;
/// Ring slots a bar node reserves at its region's end unless the cluster file says otherwise
/// (`control_rings`): links beyond that many at once run their control on tcp.
pub const DEFAULT_RING_SLOTS: u32 = 8;
/// Most ring slots a region may reserve (8 MiB of it).
pub const MAX_RING_SLOTS: u32 = 256;

/// Where a node's shared region is found (`region`, or `region_device` with `region_bar`, in
/// the cluster file), and how many control-ring slots its end holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSpec {
    path: PathBuf,
    /// Control-ring slots at the region's end; 0: the links' control stays on tcp
    /// (`control_path = "tcp"`).
    rings: u32,
}

impl RegionSpec {
    /// A file: the borrower's backing file (`/dev/shm/NAME`), or a sysfs `resourceN` path.
    pub fn file(path: impl Into<PathBuf>) -> Result<RegionSpec, String> {
        let path = path.into();
        if !path.is_absolute() {
            return Err(format!(
                "shared region {} must be an absolute path",
                path.display()
            ));
        }
        Ok(RegionSpec {
            path,
            rings: DEFAULT_RING_SLOTS,
        })
    }

    /// BAR `bar` of the PCI function `bdf` (`0000:00:03.0`), mapped from sysfs.
    pub fn pci_bar(bdf: &str, bar: u8) -> Result<RegionSpec, String> {
        if !is_bdf(bdf) {
            return Err(format!(
                "region_device {bdf:?} is not a PCI address like 0000:00:03.0"
            ));
        }
        if bar > 5 {
            return Err(format!("region_bar {bar} is not a BAR index (0..=5)"));
        }
        Ok(RegionSpec {
            path: Path::new("/sys/bus/pci/devices")
                .join(bdf)
                .join(format!("resource{bar}")),
            rings: DEFAULT_RING_SLOTS,
        })
    }

    /// The same region with `slots` control-ring slots at its end (0: control on tcp).
    pub fn with_rings(mut self, slots: u32) -> Result<RegionSpec, String> {
        if slots > MAX_RING_SLOTS {
            return Err(format!(
                "control_rings {slots} is more than {MAX_RING_SLOTS} ring slots"
            ));
        }
        self.rings = slots;
        Ok(self)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Control-ring slots at the region's end (0: control on tcp).
    pub fn rings(&self) -> u32 {
        self.rings
    }

    /// Bytes the control rings take at the region's end.
    pub fn ring_area(&self) -> u64 {
        u64::from(self.rings) * RING_SLOT_SIZE
    }
}

/// `DDDD:BB:DD.F` with hex digits.
fn is_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b.iter().enumerate().all(|(i, &c)| match i {
            4 | 7 => c == b':',
            10 => c == b'.',
            11 => (b'0'..=b'7').contains(&c),
            _ => c.is_ascii_hexdigit(),
        })
}

/// An opened shared region: its file, size and identity.
#[derive(Debug)]
pub struct Region {
    fd: Arc<OwnedFd>,
    size: u64,
    /// Control-ring slots at the end (see [`RegionSpec::rings`]).
    rings: u32,
    dev: u64,
    ino: u64,
    path: PathBuf,
}

impl Region {
    /// Opens the region read-write. Its size must be a power of two, as any PCI BAR's is
    /// (QEMU refuses an ivshmem memory of another size): a file of another size cannot be
    /// the memory behind a BAR. It must hold its control rings and leave at least as much
    /// again for windows.
    pub fn open(spec: &RegionSpec) -> Result<Region, FabricError> {
        let bad = |problem: String| FabricError::BadRegion {
            path: spec.path.display().to_string(),
            problem,
        };
        let file: File = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&spec.path)
            .map_err(|e| bad(format!("cannot open it read-write: {e}")))?;
        let meta = file
            .metadata()
            .map_err(|e| bad(format!("cannot stat it: {e}")))?;
        let size = meta.len();
        if size == 0 || !size.is_power_of_two() {
            return Err(bad(format!(
                "its size {size:#x} is not a power of two (a PCI BAR's always is)"
            )));
        }
        let rings = spec.ring_area();
        if rings > 0 && size < 2 * rings {
            return Err(bad(format!(
                "its {size:#x} bytes are too small for its {} control rings: they take the \
                 last {rings:#x} bytes ({} KiB each), and windows need at least as much \
                 again; make the region larger, set control_rings lower, or control_path = \
                 \"tcp\"",
                spec.rings(),
                RING_SLOT_SIZE >> 10
            )));
        }
        Ok(Region {
            fd: Arc::new(OwnedFd::from(file)),
            size,
            rings: spec.rings(),
            dev: meta.dev(),
            ino: meta.ino(),
            path: spec.path.clone(),
        })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Control-ring slots at the region's end (0: control on tcp).
    pub fn ring_slots(&self) -> u32 {
        self.rings
    }

    /// Bytes at the region's start that windows may use: all but the control rings.
    pub fn window_size(&self) -> u64 {
        self.size - u64::from(self.rings) * RING_SLOT_SIZE
    }

    /// Offset of control-ring slot `slot` (`None` past the last one).
    pub fn ring_slot_offset(&self, slot: u32) -> Option<u64> {
        (slot < self.rings).then(|| self.window_size() + u64::from(slot) * RING_SLOT_SIZE)
    }

    pub(crate) fn fd(&self) -> &Arc<OwnedFd> {
        &self.fd
    }

    /// Whether `fd` is this region's file (same device and inode).
    pub fn holds(&self, fd: BorrowedFd<'_>) -> Result<bool, FabricError> {
        let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
        // SAFETY: fstat writes into the valid, properly sized stat buffer; the fd is borrowed
        // live for the call.
        if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } < 0 {
            return Err(FabricError::Io {
                op: "fstat a window's file",
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: fstat succeeded, so the buffer is initialised.
        let st = unsafe { st.assume_init() };
        Ok(st.st_dev == self.dev && st.st_ino == self.ino)
    }

    /// Checks that `[offset, offset + size)` lies inside the part of the region that
    /// windows may use (not in the control rings at its end).
    pub fn check_range(&self, offset: u64, size: u64) -> Result<(), String> {
        match offset.checked_add(size) {
            Some(end) if end <= self.window_size() => Ok(()),
            Some(end) if end <= self.size => Err(format!(
                "range {offset:#x}+{size:#x} reaches into the control rings of shared region \
                 {} (its last {:#x} bytes, from {:#x}, hold {} link rings; windows and guest \
                 RAM must stay below)",
                self.path.display(),
                self.size - self.window_size(),
                self.window_size(),
                self.rings
            )),
            _ => Err(format!(
                "range {offset:#x}+{size:#x} is outside the {:#x}-byte shared region {}",
                self.size,
                self.path.display()
            )),
        }
    }
}

impl AsFd for Region {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_name_what_is_wrong() {
        assert!(RegionSpec::file("rel/path")
            .unwrap_err()
            .contains("absolute"));
        let s = RegionSpec::pci_bar("0000:00:03.0", 2).unwrap();
        assert_eq!(
            s.path(),
            Path::new("/sys/bus/pci/devices/0000:00:03.0/resource2")
        );
        assert!(RegionSpec::pci_bar("00:03.0", 2)
            .unwrap_err()
            .contains("not a PCI address"));
        assert!(RegionSpec::pci_bar("0000:00:03.0", 6)
            .unwrap_err()
            .contains("not a BAR index"));
    }

    #[test]
    fn a_region_must_be_a_power_of_two_and_ranges_stay_inside() {
        let dir = std::env::temp_dir().join(format!("ntb-region-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let odd = dir.join("odd");
        std::fs::write(&odd, vec![0u8; 3 * 4096]).unwrap();
        let e = Region::open(&RegionSpec::file(&odd).unwrap()).unwrap_err();
        assert!(e.to_string().contains("not a power of two"), "{e}");
        let missing = Region::open(&RegionSpec::file(dir.join("missing")).unwrap()).unwrap_err();
        assert!(missing.to_string().contains("cannot open"), "{missing}");
        let ok = dir.join("ok");
        let f = File::create(&ok).unwrap();
        f.set_len(1 << 20).unwrap();
        let r = Region::open(&RegionSpec::file(&ok).unwrap().with_rings(0).unwrap()).unwrap();
        assert_eq!(r.size(), 1 << 20);
        assert!(r.holds(File::open(&ok).unwrap().as_fd()).unwrap());
        assert!(!r.holds(File::open(&odd).unwrap().as_fd()).unwrap());
        r.check_range(0, 1 << 20).unwrap();
        assert!(r
            .check_range(4096, 1 << 20)
            .unwrap_err()
            .contains("outside"));
        assert!(r.check_range(u64::MAX, 2).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn control_rings_sit_at_the_end_and_windows_stay_below_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        File::create(&path).unwrap().set_len(1 << 20).unwrap();
        let spec = RegionSpec::file(&path).unwrap();
        assert_eq!(spec.rings(), DEFAULT_RING_SLOTS);
        let r = Region::open(&spec).unwrap();
        let area = u64::from(DEFAULT_RING_SLOTS) * RING_SLOT_SIZE;
        assert_eq!(r.window_size(), (1 << 20) - area);
        assert_eq!(r.ring_slot_offset(0), Some((1 << 20) - area));
        assert_eq!(
            r.ring_slot_offset(DEFAULT_RING_SLOTS - 1),
            Some((1 << 20) - RING_SLOT_SIZE)
        );
        assert_eq!(r.ring_slot_offset(DEFAULT_RING_SLOTS), None);
        r.check_range(0, r.window_size()).unwrap();
        let e = r.check_range(0, r.window_size() + 4096).unwrap_err();
        assert!(e.contains("reaches into the control rings"), "{e}");
        // Too small for its rings: a clear error when the link opens it.
        let e = Region::open(&spec.clone().with_rings(32).unwrap()).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("too small for its 32 control rings") && e.contains("control_rings"),
            "{e}"
        );
        assert!(spec
            .with_rings(MAX_RING_SLOTS + 1)
            .unwrap_err()
            .contains("control_rings"));
    }
}
