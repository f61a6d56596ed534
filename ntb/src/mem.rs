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

/// Whether `fd` is a file whose size cannot change under a mapping even though it carries no
/// seals: character devices, anonymous-inode files, and sysfs files (a lender exports a VFIO
/// device's BAR as its sysfs `resourceN` file, whose size is the BAR's and which kernfs never
/// truncates). Regular files (on disk, tmpfs without seals) can be truncated by whoever holds
/// them, so they are not. (This only answers "can it shrink": a window must still be as large
/// as the file's `st_size` says, which a VFIO device fd, of size 0, never is.)
pub fn fd_has_fixed_extent(fd: BorrowedFd<'_>) -> Result<bool, MemError> {
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

    /// Copies out of the mapping.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), MemError> {
        check_range(offset, buf.len() as u64, self.len as u64)?;
        // SAFETY: the range was checked against the live mapping; buf is a distinct allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.add(offset as usize),
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        Ok(())
    }

    /// Copies into the mapping.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), MemError> {
        check_range(offset, data.len() as u64, self.len as u64)?;
        // SAFETY: the range was checked against the live mapping; data is a distinct allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset as usize), data.len())
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
