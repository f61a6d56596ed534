//! How each BAR of a lease reaches its borrower, decided at the lease's start (and again at
//! a migration's take-over), logged and shown by the metrics.
//!
//! A borrower is handed an fd only if the lender can take it back: an emulated device's
//! registers move to a new memfd at every lease's end ([`DeviceBackend::renew_exports`]),
//! so a kept fd reaches an orphan copy. A VFIO BAR's fd is the function's sysfs resource
//! file, and no kernel path revokes one process's mapping of it and not another's (vfio-pci
//! zaps only mappings made through its own device fd; revocable dma-bufs of BARs are newer
//! than the kernels lendvm supports). Such a BAR is exported mediated on every fabric: the
//! lender maps it and serves each access as a message, so a borrower never holds anything
//! that outlives its lease (docs/SECURITY.md, "Borrower vs later borrower").

use ntb::{Endpoint, ExportedWindow, FabricError};

use crate::backend::BarExport;

/// How a BAR reaches its borrower.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarPath {
    /// The borrower maps the memory itself: a per-lease memfd on shm, the link's shared
    /// region on `bar`.
    Mapped,
    /// The lender maps it and serves each access as a window message.
    Mediated,
    /// Not exported: every access is a BAR_READ/BAR_WRITE through the device's own
    /// interface (an i/o BAR, MSI-X, a BAR the kernel will not map).
    Trapped,
}

impl BarPath {
    /// Its name in logs and in the metrics' `path` label.
    pub fn as_str(self) -> &'static str {
        match self {
            BarPath::Mapped => "mapped",
            BarPath::Mediated => "mediated",
            BarPath::Trapped => "trapped",
        }
    }
}

/// Exports `x` on `ep` as the window `label`; returns it and the path it takes.
pub(super) fn export(
    ep: &dyn Endpoint,
    x: &BarExport<'_>,
    label: &str,
) -> Result<(ExportedWindow, BarPath), FabricError> {
    let w = if x.revocable {
        ep.export_window(x.fd, x.offset, x.size, label)?
    } else {
        ep.export_window_mediated(x.fd, x.offset, x.size, label)?
    };
    // The fabric decided how (fd on shm, the shared region on `bar`, else mediated).
    let path = if w.mapped_by_peer() {
        BarPath::Mapped
    } else {
        BarPath::Mediated
    };
    Ok((w, path))
}

/// Logs the paths of a lease's BARs (one line per lease; rate-bounded by the leases).
pub(super) fn log_paths(lease: u64, device: &str, paths: &[(u8, BarPath)]) {
    if paths.is_empty() {
        return;
    }
    let list = paths
        .iter()
        .map(|(i, p)| format!("bar {i} {}", p.as_str()))
        .collect::<Vec<_>>()
        .join(", ");
    log::info!("lease {lease}: {device}'s bars reach the borrower: {list}");
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::collections::BTreeSet;
    use std::io::{BufRead, BufReader, Write};
    use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
    use std::process::{Command, Stdio};
    use std::sync::Arc;

    use ntb::{ClusterConfig, Fabric, SocketFabric};

    use super::BarPath;
    use crate::backend::vfio::fake::FakeSysfs;
    use crate::backend::vfio::tests::{backend_with, nic_config, nic_with, stat, BDF};
    use crate::backend::DeviceBackend;
    use crate::inventory::Inventory;
    use crate::server::{BackgroundLender, Lender};
    use crate::LenderClient;

    const TOKEN: &str = "bar-paths-cluster-token";
    const TEST: &str = "server::bars::tests::an_earlier_borrower_keeps_nothing_of_a_vfio_bar";
    /// What the second borrower writes to the device's registers.
    const PATTERN: &[u8] = b"registers of the second borrower";
    const BAR0: u64 = 0x4000;

    fn open_fds() -> BTreeSet<i32> {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect()
    }

    /// Every way a kept fd could show the device's registers: mapped (as a shm window is)
    /// and read. Counts the fds that show `PATTERN`.
    fn fds_showing_the_pattern(kept: &[OwnedFd]) -> usize {
        kept.iter()
            .filter(|fd| {
                let st = stat(fd.as_fd());
                // Only a file at least as large as the BAR can be mapped without SIGBUS.
                if st.st_mode & libc::S_IFMT != libc::S_IFREG || (st.st_size as u64) < BAR0 {
                    return false;
                }
                let mut seen = vec![0u8; PATTERN.len()];
                let mapped = ntb::mem::Mapping::map_shared(fd.as_fd(), 0, BAR0)
                    .and_then(|m| m.read_at(0, &mut seen))
                    .is_ok()
                    && seen == PATTERN;
                let mut read = vec![0u8; PATTERN.len()];
                // SAFETY: pread writes at most `read.len()` bytes into `read`.
                let n =
                    unsafe { libc::pread(fd.as_raw_fd(), read.as_mut_ptr().cast(), read.len(), 0) };
                mapped || (n == PATTERN.len() as isize && read == PATTERN)
            })
            .count()
    }

    /// The earlier borrower, in a child process: borrows, maps BAR 0's window, keeps a dup of
    /// every fd it was given, returns the lease, and once told (a line on stdin) tries every
    /// kept fd; prints how many showed the second borrower's registers.
    fn earlier_borrower(cluster: &str) {
        let cfg = ClusterConfig::load(std::path::Path::new(cluster)).unwrap();
        let before = open_fds();
        let c = LenderClient::connect(&cfg, "a", "lender", TOKEN, "a").unwrap();
        let lease = c.borrow(BDF, "vm-a").unwrap();
        let window = lease.bar_window(0).unwrap();
        let kept: Vec<OwnedFd> = open_fds()
            .difference(&before)
            .filter_map(|&fd| {
                // SAFETY: F_DUPFD_CLOEXEC on an fd number of this process; a closed one
                // fails and is skipped.
                let d = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
                // SAFETY: `d` is a new fd owned by nothing else.
                (d >= 0).then(|| unsafe { OwnedFd::from_raw_fd(d) })
            })
            .collect();
        drop(window);
        lease.return_device().unwrap();
        drop(c);
        println!("RETURNED {}", kept.len());
        std::io::stdout().flush().unwrap();
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
        println!("SEEN {}", fds_showing_the_pattern(&kept));
    }

    /// A borrower that keeps a dup of every fd it received, returns the lease, and after a
    /// second borrower enables the device and writes its registers, maps and reads them all:
    /// none shows the device. A VFIO BAR (its sysfs resource file) is exported mediated on
    /// shm, never as an fd (docs/SECURITY.md, "Borrower vs later borrower"); the lease's
    /// metrics view says so.
    #[test]
    fn an_earlier_borrower_keeps_nothing_of_a_vfio_bar() {
        if let Ok(cluster) = std::env::var("LENDING_BARS_EARLIER_BORROWER") {
            earlier_borrower(&cluster);
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        // The fake resource file is a plain file: real sysfs files pass the borrower's seal
        // check as fixed-extent files (ntb::mem::fd_has_fixed_extent); this one is let pass.
        let head = "version = 1\n[link]\nrequire_sealed_windows = false\n".to_string();
        let src = ["lender", "a", "b"].iter().fold(head, |s, n| {
            s + &format!("[[node]]\nname = \"{n}\"\nfabric = \"shm\"\ncontrol = \"{d}/{n}.sock\"\n")
        });
        let cluster = dir.path().join("cluster.toml");
        std::fs::write(&cluster, src).unwrap();
        let cfg = ClusterConfig::load(&cluster).unwrap();
        let sysfs = FakeSysfs::new().unwrap();
        let resource = sysfs.add_resource(BDF, 0, BAR0).unwrap();
        let (backend, _container) = backend_with(nic_with(nic_config(false), false), &sysfs);
        let backend: Arc<dyn DeviceBackend> = Arc::new(backend);
        let inv = Arc::new(Inventory::new(vec![(BDF.to_string(), backend)]).unwrap());
        let listener = SocketFabric::from_cluster(&cfg, "lender")
            .unwrap()
            .listen()
            .unwrap();
        let lender = Lender::new(Arc::clone(&inv), "lender", TOKEN);
        let _serving = BackgroundLender::start(Arc::clone(&lender), listener).unwrap();

        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env("LENDING_BARS_EARLIER_BORROWER", &cluster)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut said = |prefix: &str| -> String {
            let mut line = String::new();
            for _ in 0..64 {
                line.clear();
                assert_ne!(out.read_line(&mut line).unwrap(), 0, "the borrower ended");
                // (libtest's "test NAME ... " may begin the same line)
                if let Some((_, rest)) = line.split_once(prefix) {
                    return rest.trim().to_string();
                }
            }
            panic!("the borrower never said {prefix}");
        };
        let kept: usize = said("RETURNED ").parse().unwrap();
        assert!(
            kept > 0,
            "the earlier borrower kept no fd: nothing was tested"
        );

        let c = LenderClient::connect(&cfg, "b", "lender", TOKEN, "b").unwrap();
        let lease = c.borrow(BDF, "vm-b").unwrap();
        let view = inv.get(BDF).unwrap().lease_view().unwrap();
        // Memory space and bus master on, then the registers.
        lease.config_write(4, &[0x06, 0x00]).unwrap();
        let window = lease.bar_window(0).unwrap();
        window.write_at(0, PATTERN).unwrap();
        let device = std::fs::read(&resource).unwrap();
        assert_eq!(
            &device[..PATTERN.len()],
            PATTERN,
            "the write reached the device"
        );

        writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
        let seen: usize = said("SEEN ").parse().unwrap();
        assert!(child.wait().unwrap().success());
        assert_eq!(
            seen, 0,
            "an fd the earlier borrower kept shows the next borrower's registers"
        );
        assert_eq!(
            view.bar_paths,
            vec![(0, BarPath::Mediated), (2, BarPath::Trapped)]
        );
    }
}
