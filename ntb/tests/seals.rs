//! Memfd seals on shm windows: exported windows are sealed against resizing, and the mapping
//! side checks the seals (refuses by default, warns with `require_sealed_windows = false`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Mutex, Once};
use std::time::Duration;

use ntb::{
    connect_addr, listen_addr, ControlAddr, Endpoint, FabricError, LinkConfig, NodeId, SharedMemory,
};

const T: Duration = Duration::from_secs(5);

/// Captures warnings so the test can see them (this test binary owns the global logger).
struct Capture(Mutex<Vec<String>>);

static LOGS: Capture = Capture(Mutex::new(Vec::new()));
static INIT: Once = Once::new();

impl log::Log for Capture {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::Level::Warn
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            self.0.lock().unwrap().push(r.args().to_string());
        }
    }
    fn flush(&self) {}
}

fn warnings_about(needle: &str) -> Vec<String> {
    LOGS.0
        .lock()
        .unwrap()
        .iter()
        .filter(|m| m.contains(needle))
        .cloned()
        .collect()
}

/// `a` exports, `b` maps; `b` requires sealed windows if `require`.
struct Pair {
    a: Box<dyn Endpoint>,
    b: Box<dyn Endpoint>,
    _dir: tempfile::TempDir,
}

fn pair(require: bool) -> Pair {
    pair_with(LinkConfig {
        require_sealed_windows: require,
        ..LinkConfig::default()
    })
}

/// `a` exports (and does not check), `b` maps with `b_cfg`.
fn pair_with(b_cfg: LinkConfig) -> Pair {
    INIT.call_once(|| {
        log::set_logger(&LOGS).unwrap();
        log::set_max_level(log::LevelFilter::Warn);
    });
    let dir = tempfile::tempdir().unwrap();
    let a_cfg = LinkConfig {
        require_sealed_windows: false,
        ..LinkConfig::default()
    };
    let addr = ControlAddr::Unix(dir.path().join("a.sock"));
    let l = listen_addr(&addr, &NodeId::new("a").unwrap(), &a_cfg).unwrap();
    let t = std::thread::spawn(move || {
        connect_addr(&addr, &NodeId::new("b").unwrap(), &b_cfg).unwrap()
    });
    let a = l.accept(Some(T)).unwrap();
    let b = t.join().unwrap();
    Pair { a, b, _dir: dir }
}

/// A memfd as a careless exporter makes it: `flags` for memfd_create, no seals added.
fn plain_memfd(flags: libc::c_uint, size: u64) -> OwnedFd {
    let name = CString::new("unsealed").unwrap();
    // SAFETY: valid name; result checked.
    let raw = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    assert!(raw >= 0);
    // SAFETY: a fresh fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    ftruncate(fd.as_fd(), size as i64).unwrap();
    fd
}

fn ftruncate(fd: std::os::fd::BorrowedFd<'_>, len: i64) -> std::io::Result<()> {
    // SAFETY: ftruncate on a live fd owned by the test.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[test]
fn sealed_window_maps_and_cannot_be_shrunk() {
    let p = pair(true);
    let mem = SharedMemory::new("sealed", 8192).unwrap();
    let w = p.a.export_window(mem.fd(), 0, 8192, "sealed-win").unwrap();
    let info = p.b.wait_peer_window("sealed-win", T).unwrap();
    let win = p.b.map_peer_window(info.id).unwrap();
    win.write_at(8000, b"hello").unwrap();
    let mut buf = [0u8; 5];
    mem.read_at(8000, &mut buf).unwrap();
    assert_eq!(&buf, b"hello");
    // The exporter cannot pull the memory out from under the mapping.
    let e = ftruncate(mem.fd(), 4096).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    let e = ftruncate(mem.fd(), 0).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    // So the far end of the window stays accessible.
    win.read_at(8000, &mut buf).unwrap();
    assert_eq!(&buf, b"hello");
    assert!(warnings_about("sealed-win").is_empty());
    drop(w);
}

#[test]
fn unsealed_windows_are_refused_by_default() {
    assert!(LinkConfig::default().require_sealed_windows);
    let p = pair_with(LinkConfig::default());
    let fd = plain_memfd(libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING, 4096);
    let _w =
        p.a.export_window(fd.as_fd(), 0, 4096, "default-win")
            .unwrap();
    let info = p.b.wait_peer_window("default-win", T).unwrap();
    let e = p.b.map_peer_window(info.id).err().unwrap();
    assert!(matches!(e, FabricError::UnsealedWindow { .. }), "{e}");
    let m = e.to_string();
    assert!(
        m.contains("\"default-win\"")
            && m.contains("from a")
            && m.contains("without F_SEAL_SHRINK (seals 0x0)")
            && m.contains("refusing to map it"),
        "{m}"
    );
    assert!(warnings_about("default-win").is_empty());
}

#[test]
fn unsealed_window_maps_with_a_warning_when_not_required() {
    let p = pair(false);
    let fd = plain_memfd(libc::MFD_CLOEXEC, 4096);
    let _w =
        p.a.export_window(fd.as_fd(), 0, 4096, "careless-win")
            .unwrap();
    let info = p.b.wait_peer_window("careless-win", T).unwrap();
    let win = p.b.map_peer_window(info.id).unwrap();
    win.write_at(0, b"x").unwrap();
    let w = warnings_about("careless-win");
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].contains("without F_SEAL_SHRINK") && w[0].contains("from a"),
        "{w:?}"
    );
}

#[test]
fn unsealed_windows_are_refused_when_required() {
    let p = pair(true);
    // No MFD_ALLOW_SEALING (the kernel reports F_SEAL_SEAL only), sealing allowed but not
    // done, and a regular file that cannot carry seals at all.
    let no_sealing = plain_memfd(libc::MFD_CLOEXEC, 4096);
    let unsealed = plain_memfd(libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING, 4096);
    let file = tempfile::tempfile().unwrap();
    file.set_len(4096).unwrap();
    let cases: [(&str, std::os::fd::BorrowedFd<'_>, &str); 3] = [
        ("nosealing-win", no_sealing.as_fd(), "seals 0x1"),
        ("unsealed-win", unsealed.as_fd(), "seals 0x0"),
        ("file-win", file.as_fd(), "cannot be sealed"),
    ];
    for (label, fd, why) in cases {
        let _w = p.a.export_window(fd, 0, 4096, label).unwrap();
        let info = p.b.wait_peer_window(label, T).unwrap();
        let e = p.b.map_peer_window(info.id).err().unwrap();
        assert!(matches!(e, FabricError::UnsealedWindow { .. }), "{e}");
        let m = e.to_string();
        assert!(
            m.contains(label) && m.contains(why) && m.contains("F_SEAL_SHRINK"),
            "{m}"
        );
        assert!(warnings_about(label).is_empty());
    }
    // The link survives the refusals.
    let mem = SharedMemory::new("fine", 4096).unwrap();
    let _w = p.a.export_window(mem.fd(), 0, 4096, "fine-win").unwrap();
    let info = p.b.wait_peer_window("fine-win", T).unwrap();
    p.b.map_peer_window(info.id).unwrap();
}
