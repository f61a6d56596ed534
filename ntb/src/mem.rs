//! Shared memory: memfd regions and owned `mmap`s.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// Errors of shared-memory handling.
#[derive(Debug, thiserror::Error)]
pub enum MemError {
    #[error("memfd_create {name:?} of {size:#x} bytes: {source}")]
    Create {
        name: String,
        size: u64,
        #[source]
        source: io::Error,
    },
    #[error("mmap of {len:#x} bytes at file offset {offset:#x}: {source}")]
    Map {
        offset: u64,
        len: u64,
        #[source]
        source: io::Error,
    },
    #[error("fstat: {0}")]
    Stat(#[source] io::Error),
    #[error("access {offset:#x}+{len:#x} is outside the {size:#x}-byte region")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("length {0:#x} does not fit the address space")]
    TooLong(u64),
    #[error("sealing memfd {name:?}: {source}")]
    Seal {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("F_GET_SEALS: {0}")]
    GetSeals(#[source] io::Error),
}

/// Seals every [`SharedMemory`] carries: its size is fixed (a peer that maps it can never hit
/// SIGBUS past a shrunken end) and no further seals can be added (a peer that receives the fd
/// cannot, e.g., forbid future writable mappings of our memory with `F_SEAL_FUTURE_WRITE`).
pub const WINDOW_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// The seals (`F_SEAL_*`) of `fd`, or `None` if the file cannot carry seals (not shmem/memfd,
/// e.g. a VFIO device fd or a file on disk).
pub fn fd_seals(fd: BorrowedFd<'_>) -> Result<Option<libc::c_int>, MemError> {
    // SAFETY: F_GET_SEALS takes no argument and only reads the borrowed, live fd's state.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if r >= 0 {
        return Ok(Some(r));
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EINVAL) {
        Ok(None)
    } else {
        Err(MemError::GetSeals(e))
    }
}

/// What is behind an fd, as far as a mapping of it is concerned.
fn is_device_file(fd: BorrowedFd<'_>) -> Result<bool, MemError> {
    const ANON_INODE_FS_MAGIC: i64 = 0x0904_1934;
    const SYSFS_MAGIC: i64 = 0x6265_6572;
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: fstat writes into the valid, properly sized stat buffer; the fd is borrowed live.
    if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } < 0 {
        return Err(MemError::Stat(io::Error::last_os_error()));
    }
    // SAFETY: fstat succeeded, so the buffer is initialised.
    let st = unsafe { st.assume_init() };
    if st.st_mode & libc::S_IFMT == libc::S_IFCHR {
        return Ok(true);
    }
    let mut sfs = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: fstatfs writes into the valid, properly sized statfs buffer; the fd is live.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), sfs.as_mut_ptr()) } < 0 {
        return Err(MemError::Stat(io::Error::last_os_error()));
    }
    // SAFETY: fstatfs succeeded, so the buffer is initialised.
    let sfs = unsafe { sfs.assume_init() };
    #[allow(clippy::unnecessary_cast)] // f_type's integer type differs between libcs
    Ok(matches!(
        sfs.f_type as i64,
        ANON_INODE_FS_MAGIC | SYSFS_MAGIC
    ))
}

/// Whether `fd` is a file whose size cannot change under a mapping even though it carries no
/// seals: character devices, anonymous-inode files, and sysfs files (a lender exports a VFIO
/// device's BAR as its sysfs `resourceN` file, whose size is the BAR's and which kernfs never
/// truncates). Regular files (on disk, tmpfs without seals) can be truncated by whoever holds
/// them, so they are not. (This only answers "can it shrink": a window must still be as large
/// as the file's `st_size` says, which a VFIO device fd, of size 0, never is.)
pub fn fd_has_fixed_extent(fd: BorrowedFd<'_>) -> Result<bool, MemError> {
    is_device_file(fd)
}

/// Whether a mapping of `fd` may be device registers rather than memory: the same files as
/// [`fd_has_fixed_extent`] (a VFIO device fd, a sysfs `resourceN`, a character device).
/// Such a mapping is copied in naturally aligned accesses of at most 8 bytes, in address
/// order ([`Mapping::is_io`]), never by `memcpy` or the kernel's copy to user space, whose
/// widths (byte stores of `rep movsb`, 16-byte vector moves) a device's registers may take
/// as other writes: QEMU's e1000e turns each byte store into a whole 32-bit register write.
pub fn fd_may_be_io(fd: BorrowedFd<'_>) -> Result<bool, MemError> {
    is_device_file(fd)
}

/// The width of the access at `addr` with `left` bytes to go: the largest of 8, 4, 2 and 1
/// that `addr` is aligned to and that fits.
fn io_width(addr: usize, left: usize) -> usize {
    [8, 4, 2]
        .into_iter()
        .find(|w| addr.is_multiple_of(*w) && left >= *w)
        .unwrap_or(1)
}

/// Copies `src` to device memory at `dst` in [`io_width`] accesses, in address order.
///
/// # Safety
/// `dst..dst + src.len()` must be a live, writable mapping.
unsafe fn copy_to_io(dst: *mut u8, src: &[u8]) {
    let mut i = 0;
    while i < src.len() {
        let at = dst.wrapping_add(i);
        let w = io_width(at as usize, src.len() - i);
        let b = &src[i..i + w];
        // SAFETY: `i + w <= src.len()`, so the access lies inside the caller's live range,
        // and `io_width` chose `w` so that `at` is aligned to it.
        unsafe {
            match w {
                8 => std::ptr::write_volatile(at.cast::<u64>(), u64::from_ne_bytes(bytes(b))),
                4 => std::ptr::write_volatile(at.cast::<u32>(), u32::from_ne_bytes(bytes(b))),
                2 => std::ptr::write_volatile(at.cast::<u16>(), u16::from_ne_bytes(bytes(b))),
                _ => std::ptr::write_volatile(at, b[0]),
            }
        }
        i += w;
    }
}

/// Copies device memory at `src` into `dst` in [`io_width`] accesses, in address order.
///
/// # Safety
/// `src..src + dst.len()` must be a live, readable mapping.
unsafe fn copy_from_io(dst: &mut [u8], src: *const u8) {
    let mut i = 0;
    while i < dst.len() {
        let at = src.wrapping_add(i);
        let w = io_width(at as usize, dst.len() - i);
        let d = &mut dst[i..i + w];
        // SAFETY: as in `copy_to_io`: inside the caller's live range, aligned to `w`.
        unsafe {
            match w {
                8 => d.copy_from_slice(&std::ptr::read_volatile(at.cast::<u64>()).to_ne_bytes()),
                4 => d.copy_from_slice(&std::ptr::read_volatile(at.cast::<u32>()).to_ne_bytes()),
                2 => d.copy_from_slice(&std::ptr::read_volatile(at.cast::<u16>()).to_ne_bytes()),
                _ => d[0] = std::ptr::read_volatile(at),
            }
        }
        i += w;
    }
}

/// The first `N` bytes of `b` (which has exactly `N`) as an array.
fn bytes<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[..N]);
    a
}

/// Checks that `offset..offset+len` lies within `size`.
pub fn check_range(offset: u64, len: u64, size: u64) -> Result<(), MemError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(MemError::OutOfRange { offset, len, size }),
    }
}

/// Size of the file behind `fd`.
pub fn fd_size(fd: BorrowedFd<'_>) -> Result<u64, MemError> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: fstat writes into the valid, properly sized stat buffer; the fd is borrowed live.
    let r = unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) };
    if r < 0 {
        return Err(MemError::Stat(io::Error::last_os_error()));
    }
    // SAFETY: fstat succeeded, so the buffer is initialised.
    let st = unsafe { st.assume_init() };
    Ok(st.st_size.max(0) as u64)
}

/// The file `fd` refers to, as `(st_dev, st_ino)`: equal for every descriptor of the same
/// file, in any process of this host (a memfd passed over SCM_RIGHTS keeps its inode).
pub fn fd_file_id(fd: BorrowedFd<'_>) -> Result<(u64, u64), MemError> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: fstat writes into the valid, properly sized stat buffer; the fd is borrowed live.
    let r = unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) };
    if r < 0 {
        return Err(MemError::Stat(io::Error::last_os_error()));
    }
    // SAFETY: fstat succeeded, so the buffer is initialised.
    let st = unsafe { st.assume_init() };
    Ok((st.st_dev, st.st_ino))
}

/// An owned `MAP_SHARED` mapping; unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
    severed: AtomicBool,
    /// Device registers, maybe ([`fd_may_be_io`]): copied in aligned accesses.
    io: bool,
}

// SAFETY: the mapping is plain memory owned by this value; access goes through raw-pointer
// copies that tolerate concurrent writers (like guest memory in a VMM).
unsafe impl Send for Mapping {}
// SAFETY: see above; no interior references are handed out.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` at `offset`, read/write, shared.
    pub fn map_shared(fd: BorrowedFd<'_>, offset: u64, len: u64) -> Result<Mapping, MemError> {
        let ulen = usize::try_from(len).map_err(|_| MemError::TooLong(len))?;
        let off = libc::off_t::try_from(offset).map_err(|_| MemError::TooLong(offset))?;
        let io = fd_may_be_io(fd)?;
        if ulen == 0 {
            return Err(MemError::Map {
                offset,
                len,
                source: io::Error::from_raw_os_error(libc::EINVAL),
            });
        }
        // SAFETY: a fresh mapping at a kernel-chosen address; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                ulen,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                off,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(MemError::Map {
                offset,
                len,
                source: io::Error::last_os_error(),
            });
        }
        Ok(Mapping {
            ptr: p.cast(),
            len: ulen,
            severed: AtomicBool::new(false),
            io,
        })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the mapping may be a device's registers ([`fd_may_be_io`]): `read_at` and
    /// `write_at` then copy in aligned accesses of at most 8 bytes, and nothing may copy into
    /// it by other means (a socket read straight into it, `memcpy`).
    pub fn is_io(&self) -> bool {
        self.io
    }

    /// Whether [`Mapping::sever`] has run.
    pub fn is_severed(&self) -> bool {
        self.severed.load(Ordering::Acquire)
    }

    /// Detaches the range from the shared memory: replaces it in place with private
    /// anonymous zero pages, so the address stays valid but no longer reaches the peer.
    pub fn sever(&self) {
        if self.severed.swap(true, Ordering::AcqRel) {
            return;
        }
        // SAFETY: MAP_FIXED over our own mapping of exactly our range; nothing else owns it.
        let p = unsafe {
            libc::mmap(
                self.ptr.cast(),
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            log::error!(
                "cannot sever mapping at {:p}: {}",
                self.ptr,
                io::Error::last_os_error()
            );
        }
    }

    /// Copies out of the mapping (in aligned accesses if it [`is_io`](Self::is_io)).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), MemError> {
        check_range(offset, buf.len() as u64, self.len as u64)?;
        // SAFETY: the range was checked against the live mapping; buf is a distinct allocation.
        unsafe {
            let src = self.ptr.add(offset as usize);
            if self.io {
                copy_from_io(buf, src);
            } else {
                std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr(), buf.len());
            }
        };
        Ok(())
    }

    /// Copies into the mapping (in aligned accesses if it [`is_io`](Self::is_io)).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), MemError> {
        check_range(offset, data.len() as u64, self.len as u64)?;
        // SAFETY: the range was checked against the live mapping; data is a distinct allocation.
        unsafe {
            let dst = self.ptr.add(offset as usize);
            if self.io {
                copy_to_io(dst, data);
            } else {
                std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len());
            }
        };
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the range this value mapped.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A memfd of a fixed size, mapped into this process. The memfd is sealed with
/// [`WINDOW_SEALS`], so it can be exported as a fabric window that peers map safely.
#[derive(Debug)]
pub struct SharedMemory {
    fd: OwnedFd,
    map: Mapping,
    /// The memfd's name (`/proc/PID/fd` shows `/memfd:NAME`), kept for a renewal in place.
    name: String,
}

impl SharedMemory {
    /// Creates a zeroed memfd of `size` bytes, seals its size ([`WINDOW_SEALS`]) and maps it.
    pub fn new(name: &str, size: u64) -> Result<SharedMemory, MemError> {
        let create_err = |source| MemError::Create {
            name: name.to_string(),
            size,
            source,
        };
        let cname = CString::new(name.replace('\0', "_"))
            .map_err(|_| create_err(io::Error::from_raw_os_error(libc::EINVAL)))?;
        // SAFETY: valid NUL-terminated name; the result is checked.
        let raw = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(create_err(io::Error::last_os_error()));
        }
        // SAFETY: memfd_create returned a new fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let len = libc::off_t::try_from(size).map_err(|_| MemError::TooLong(size))?;
        // SAFETY: ftruncate on our own fd; checked.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } < 0 {
            return Err(create_err(io::Error::last_os_error()));
        }
        // SAFETY: F_ADD_SEALS on our own memfd with an integer argument; checked.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, WINDOW_SEALS) } < 0 {
            return Err(MemError::Seal {
                name: name.to_string(),
                source: io::Error::last_os_error(),
            });
        }
        let map = Mapping::map_shared(fd.as_fd(), 0, size)?;
        Ok(SharedMemory {
            fd,
            map,
            name: name.to_string(),
        })
    }

    /// The name the memfd was created with.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), MemError> {
        self.map.read_at(offset, buf)
    }

    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), MemError> {
        self.map.write_at(offset, data)
    }

    /// Volatile 32-bit load (for scratchpad-like registers).
    pub fn load_u32(&self, offset: u64) -> Result<u32, MemError> {
        check_range(offset, 4, self.len())?;
        if !offset.is_multiple_of(4) {
            return Err(MemError::OutOfRange {
                offset,
                len: 4,
                size: self.len(),
            });
        }
        // SAFETY: in range and 4-byte aligned (mmap base is page aligned).
        Ok(unsafe { std::ptr::read_volatile(self.as_ptr().add(offset as usize).cast::<u32>()) })
    }
}

impl AsFd for SharedMemory {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_two_mappings_see_each_other() {
        let m = SharedMemory::new("t", 8192).unwrap();
        let other = Mapping::map_shared(m.fd(), 4096, 4096).unwrap();
        other.write_at(10, b"abc").unwrap();
        let mut b = [0u8; 3];
        m.read_at(4096 + 10, &mut b).unwrap();
        assert_eq!(&b, b"abc");
        assert!(other.write_at(4095, b"ab").is_err());
        assert_eq!(fd_size(m.fd()).unwrap(), 8192);
    }

    /// The accesses `copy_to_io` makes for `len` bytes at `addr`: (offset, width).
    fn io_accesses(addr: usize, len: usize) -> Vec<(usize, usize)> {
        let mut v = Vec::new();
        let mut i = 0;
        while i < len {
            let w = io_width(addr + i, len - i);
            v.push((i, w));
            i += w;
        }
        v
    }

    #[test]
    fn io_copies_use_aligned_register_widths() {
        // A 32-byte write at a register-aligned offset: four 8-byte stores, none split.
        assert_eq!(
            io_accesses(0x5200, 32),
            vec![(0, 8), (8, 8), (16, 8), (24, 8)]
        );
        // A guest's 4-byte register write stays one 4-byte store; a 2-byte one one 2-byte.
        assert_eq!(io_accesses(0x5204, 4), vec![(0, 4)]);
        assert_eq!(io_accesses(0x10, 2), vec![(0, 2)]);
        // Unaligned edges narrow down to what the address allows, then widen again.
        assert_eq!(
            io_accesses(0x1001, 14),
            vec![(0, 1), (1, 2), (3, 4), (7, 4), (11, 2), (13, 1)]
        );
    }

    #[test]
    fn device_files_map_as_io_and_memory_does_not() {
        let m = SharedMemory::new("t", 4096).unwrap();
        assert!(!Mapping::map_shared(m.fd(), 0, 4096).unwrap().is_io());
        // A character device (a shared mapping of /dev/zero is shared anonymous memory, so
        // the bytes are checkable): copied in aligned accesses, and they still land whole.
        let zero = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/zero")
            .unwrap();
        let dev = Mapping::map_shared(zero.as_fd(), 0, 4096).unwrap();
        assert!(dev.is_io());
        let data: Vec<u8> = (0..=200u8).collect();
        for at in [0u64, 1, 3, 0x5f, 0x100] {
            dev.write_at(at, &data).unwrap();
            let mut back = vec![0u8; data.len()];
            dev.read_at(at, &mut back).unwrap();
            assert_eq!(back, data, "at {at:#x}");
        }
        assert!(dev.write_at(4000, &data).is_err());
    }

    #[test]
    fn shared_memory_is_sealed_against_resizing() {
        let m = SharedMemory::new("t", 8192).unwrap();
        let seals = fd_seals(m.fd()).unwrap().unwrap();
        assert_eq!(seals & WINDOW_SEALS, WINDOW_SEALS, "{seals:#x}");
        for len in [4096, 0, 16384] {
            // SAFETY: ftruncate on the test's own memfd.
            let r = unsafe { libc::ftruncate(m.fd().as_raw_fd(), len) };
            assert_eq!(r, -1, "resize to {len} must fail");
            assert_eq!(io::Error::last_os_error().raw_os_error(), Some(libc::EPERM));
        }
        // SAFETY: F_ADD_SEALS on the test's own memfd.
        let r = unsafe { libc::fcntl(m.fd().as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
        assert_eq!(r, -1, "F_SEAL_SEAL forbids more seals");
        assert_eq!(fd_size(m.fd()).unwrap(), 8192);
        m.write_at(8190, b"ok").unwrap();
    }

    #[test]
    fn unsealable_files_report_no_seals() {
        let f = tempfile::tempfile().unwrap();
        assert_eq!(fd_seals(f.as_fd()).unwrap(), None);
        assert!(!fd_has_fixed_extent(f.as_fd()).unwrap());
        let null = std::fs::File::open("/dev/null").unwrap();
        assert!(fd_has_fixed_extent(null.as_fd()).unwrap());
        let e = vmm_sys_util::eventfd::EventFd::new(0).unwrap();
        // SAFETY: the eventfd outlives the borrow.
        let b = unsafe { BorrowedFd::borrow_raw(e.as_raw_fd()) };
        assert!(fd_has_fixed_extent(b).unwrap(), "anon inode");
        // A sysfs file (what a VFIO BAR is exported as): fixed, and not sealable.
        let sys = std::fs::File::open("/sys/kernel/mm/transparent_hugepage/enabled")
            .or_else(|_| std::fs::File::open("/sys/devices/system/cpu/online"))
            .expect("a sysfs file (is /sys mounted?)");
        assert_eq!(fd_seals(sys.as_fd()).unwrap(), None);
        assert!(fd_has_fixed_extent(sys.as_fd()).unwrap(), "sysfs");
    }

    #[test]
    fn severed_mapping_stays_valid_and_detached() {
        let m = SharedMemory::new("t", 4096).unwrap();
        let other = Mapping::map_shared(m.fd(), 0, 4096).unwrap();
        other.sever();
        assert!(other.is_severed());
        other.write_at(0, b"zz").unwrap();
        let mut b = [9u8; 2];
        m.read_at(0, &mut b).unwrap();
        assert_eq!(b, [0, 0]);
    }
}
