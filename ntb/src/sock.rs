//! Unix listening sockets that are private from the first instant and never steal a live
//! listener's path.
//!
//! A socket file gets its mode from the process umask at `bind`, and `fchmod` before `bind`
//! does not apply to sockets; `chmod` after `bind` leaves a window in which anyone may
//! connect, and changing the umask races with every other thread. So [`bind_private`] binds
//! inside a fresh 0700 directory next to the target (nobody else can reach the socket
//! there), sets the socket's mode to 0600, and renames it onto the target path, which also
//! replaces a stale socket file atomically. A path where a listener still accepts
//! connections is refused, as is a path that is not a socket.
//!
//! [`bind_shared`] does the same for a socket that the members of one group may reach (a
//! lender's shm control socket, which VMs running as users of their own connect to): the
//! group and mode 0660 are set while the socket is still in the private directory, so it is
//! never reachable by anyone else.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// Errors of [`bind_private`].
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("{0} exists and is not a socket")]
    NotASocket(PathBuf),
    #[error("{0} is in use by a live listener")]
    InUse(PathBuf),
    #[error("group {0:?} (the socket's control_group) does not exist")]
    NoSuchGroup(String),
    #[error("{op} for socket {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Identity of the socket file a listener created, so it removes only its own file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketFile {
    dev: u64,
    ino: u64,
}

impl SocketFile {
    /// Removes `path` if it is still this socket file (not one a later listener put there).
    pub fn remove_if_ours(&self, path: &Path) {
        if let Ok(m) = std::fs::symlink_metadata(path) {
            if m.dev() == self.dev && m.ino() == self.ino {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

/// Checks what is at `path`: nothing or a stale socket is fine (the rename replaces it).
fn check_target(path: &Path) -> Result<(), BindError> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        return Err(BindError::NotASocket(path.to_path_buf()));
    }
    if UnixStream::connect(path).is_ok() {
        return Err(BindError::InUse(path.to_path_buf()));
    }
    Ok(())
}

/// A directory made by `mkdtemp` (mode 0700), removed on drop.
struct PrivateDir(PathBuf);

impl PrivateDir {
    fn new(parent: &Path, path: &Path) -> Result<PrivateDir, BindError> {
        let io = |op, source| BindError::Io {
            op,
            path: path.to_path_buf(),
            source,
        };
        let template = parent.join(".lvXXXXXX");
        let mut buf = CString::new(template.as_os_str().as_bytes())
            .map_err(|e| io("name the private directory", std::io::Error::other(e)))?
            .into_bytes_with_nul();
        // SAFETY: `buf` is a NUL-terminated template that mkdtemp edits in place.
        let r = unsafe { libc::mkdtemp(buf.as_mut_ptr().cast()) };
        if r.is_null() {
            return Err(io(
                "create a private directory",
                std::io::Error::last_os_error(),
            ));
        }
        buf.pop();
        Ok(PrivateDir(PathBuf::from(std::ffi::OsStr::from_bytes(&buf))))
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Binds a Unix listener at `path` with mode 0600 from the start (see the module doc).
/// Returns the listener and the identity of its socket file.
pub fn bind_private(path: &Path) -> Result<(UnixListener, SocketFile), BindError> {
    bind_with(path, None)
}

/// Binds a Unix listener at `path` that this user and the members of `group` may connect
/// to (mode 0660, the file's group `group`), and nobody else at any instant (see the module
/// doc). The process must be a member of `group` (the kernel refuses the `chown`
/// otherwise).
pub fn bind_shared(path: &Path, group: &str) -> Result<(UnixListener, SocketFile), BindError> {
    let gid = group_id(group)?;
    bind_with(path, Some(gid))
}

/// The id of the group called `name` (`getgrnam_r`).
pub fn group_id(name: &str) -> Result<u32, BindError> {
    let missing = || BindError::NoSuchGroup(name.to_string());
    let cname = CString::new(name).map_err(|_| missing())?;
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: `group` is plain old data that getgrnam_r fills in.
    let mut group: libc::group = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call: the name is NUL-terminated, `buf` is
    // writable for `buf.len()` bytes and outlives `group`'s string pointers, which are not
    // kept.
    let r = unsafe {
        libc::getgrnam_r(
            cname.as_ptr(),
            &mut group,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut found,
        )
    };
    if r != 0 || found.is_null() {
        return Err(missing());
    }
    Ok(group.gr_gid)
}

fn bind_with(path: &Path, group: Option<u32>) -> Result<(UnixListener, SocketFile), BindError> {
    let io = |op, source| BindError::Io {
        op,
        path: path.to_path_buf(),
        source,
    };
    check_target(path)?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = PrivateDir::new(parent, path)?;
    let tmp = dir.0.join("s");
    let listener = UnixListener::bind(&tmp).map_err(|e| io("bind", e))?;
    let mode = match group {
        None => 0o600,
        Some(gid) => {
            // A socket is created with the process's group (or the directory's, if setgid):
            // lenderd.service runs with the control group as its primary group, and its
            // system call filter refuses chown (@privileged), so it is called only when the
            // group differs.
            let m = std::fs::symlink_metadata(&tmp).map_err(|e| io("stat", e))?;
            if m.gid() != gid {
                std::os::unix::fs::chown(&tmp, None, Some(gid))
                    .map_err(|e| io("give the socket to its control_group", e))?;
            }
            0o660
        }
    };
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
        .map_err(|e| io("set the socket's mode", e))?;
    // Again just before the rename: a listener may have started meanwhile.
    check_target(path)?;
    std::fs::rename(&tmp, path).map_err(|e| io("move into place", e))?;
    let m = std::fs::symlink_metadata(path).map_err(|e| io("stat", e))?;
    Ok((
        listener,
        SocketFile {
            dev: m.dev(),
            ino: m.ino(),
        },
    ))
}

/// The credentials of the process at the other end of `s` (`SO_PEERCRED`: who connected,
/// or who listens, as the kernel recorded it at `connect`; the peer cannot choose them).
pub fn peer_cred(s: &UnixStream) -> std::io::Result<libc::ucred> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, a ucred we own.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred)
}

/// The uid of the process at the other end of `s` ([`peer_cred`]).
pub fn peer_uid(s: &UnixStream) -> std::io::Result<u32> {
    peer_cred(s).map(|c| c.uid)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn private_from_the_start_and_never_steals_a_live_path() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.sock");
        let (l, f) = bind_private(&p).unwrap();
        let m = std::fs::symlink_metadata(&p).unwrap();
        assert!(m.file_type().is_socket());
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
        // Only the socket is left in the parent: the private directory is gone.
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
        assert!(matches!(bind_private(&p), Err(BindError::InUse(_))));
        assert!(
            UnixStream::connect(&p).is_ok(),
            "the live listener keeps its path"
        );
        drop(l);
        // Stale now: replaced.
        let (_l2, f2) = bind_private(&p).unwrap();
        assert_ne!(f, f2);
        f.remove_if_ours(&p);
        assert!(
            p.exists(),
            "an old listener does not remove the new one's socket"
        );
        f2.remove_if_ours(&p);
        assert!(!p.exists());
        std::fs::write(&p, b"data").unwrap();
        assert!(matches!(bind_private(&p), Err(BindError::NotASocket(_))));
    }

    /// The name of this process's effective group, so the test works for any user.
    fn own_group() -> String {
        // SAFETY: getgrgid returns a pointer into static storage or null; it is read at once
        // and no other thread of this test calls it.
        let g = unsafe { libc::getgrgid(libc::getegid()) };
        assert!(!g.is_null(), "this process's group has no name");
        // SAFETY: gr_name of a non-null entry is a NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr((*g).gr_name) }
            .to_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn a_shared_socket_is_its_groups_and_no_one_elses() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.sock");
        let group = own_group();
        let (_l, _f) = bind_shared(&p, &group).unwrap();
        let m = std::fs::symlink_metadata(&p).unwrap();
        assert!(m.file_type().is_socket());
        assert_eq!(m.permissions().mode() & 0o777, 0o660);
        // SAFETY: getegid cannot fail.
        assert_eq!(m.gid(), unsafe { libc::getegid() });
        assert!(UnixStream::connect(&p).is_ok());
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
        let e = bind_shared(&d.path().join("y.sock"), "no-such-group-lendvm").unwrap_err();
        assert_eq!(
            e.to_string(),
            "group \"no-such-group-lendvm\" (the socket's control_group) does not exist"
        );
        assert!(!d.path().join("y.sock").exists());
    }
}
