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

    use std::sync::Arc;

    use ntb::ClusterConfig;

    use super::BarPath;
    use crate::backend::vfio::fake::FakeSysfs;
    use crate::backend::vfio::tests::{backend_with, nic_config, nic_with, BDF};
    use crate::backend::DeviceBackend;
    use crate::earlier_borrower::{self as earlier, EarlierBorrower, SecondBorrower, Setup, Tried};
    use crate::inventory::Inventory;

    const TEST: &str = "server::bars::tests::an_earlier_borrower_keeps_nothing_of_a_vfio_bar";
    const BAR0: u64 = 0x4000;
    /// The second borrower writes `pattern` at the start of BAR 0; the earlier one writes
    /// `attack` through every fd it kept.
    const SETUP: Setup<'static> = Setup {
        device: BDF,
        bar: 0,
        offset: 0,
        pattern: b"registers of the second borrower",
        attack: b"written by the earlier borrower!",
    };

    /// A borrower that keeps a dup of every fd it received, returns the lease, and after a
    /// second borrower enables the device and writes its registers, maps, reads and writes
    /// them all: none shows the device, and the device keeps the second borrower's bytes. A
    /// VFIO BAR (its sysfs resource file) is exported mediated on shm, never as an fd
    /// (docs/SECURITY.md, "Borrower vs later borrower"); the lease's metrics view says so.
    /// `tests/vfio_kernel.rs` runs the same against vfio-pci in L1.
    #[test]
    fn an_earlier_borrower_keeps_nothing_of_a_vfio_bar() {
        if earlier::child(&SETUP) {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        // The fake resource file is a plain file: real sysfs files pass the borrower's seal
        // check as fixed-extent files (ntb::mem::fd_has_fixed_extent); this one is let pass.
        let cluster = earlier::shm_cluster(dir.path(), false);
        let cfg = ClusterConfig::load(&cluster).unwrap();
        let sysfs = FakeSysfs::new().unwrap();
        let resource = sysfs.add_resource(BDF, 0, BAR0).unwrap();
        let (backend, _container) = backend_with(nic_with(nic_config(false), false), &sysfs);
        let backend: Arc<dyn DeviceBackend> = Arc::new(backend);
        let inv = Arc::new(Inventory::new(vec![(BDF.to_string(), backend)]).unwrap());
        let _serving = earlier::serve(&cfg, Arc::clone(&inv));

        let first = EarlierBorrower::spawn(TEST, false, &cluster);
        assert!(
            first.kept() > 0,
            "the earlier borrower kept no fd: nothing was tested"
        );
        let second = SecondBorrower::start(&cfg, &SETUP);
        let view = inv.get(BDF).unwrap().lease_view().unwrap();
        let device = std::fs::read(&resource).unwrap();
        assert_eq!(
            &device[..SETUP.pattern.len()],
            SETUP.pattern,
            "the write reached the device"
        );
        // The probe sees the registers through the resource file itself (what the lender
        // holds): had the earlier borrower been given it, it would have seen them too.
        let own = std::fs::File::open(&resource).unwrap();
        assert_eq!(
            earlier::try_fd(std::os::fd::AsFd::as_fd(&own), 0, SETUP.pattern, None),
            Tried::Registers
        );

        let tried = first.try_kept();
        println!("tried {}", earlier::summary(&tried));
        for (what, t) in &tried {
            assert!(
                t.got_nothing(),
                "an fd the earlier borrower kept ({what}) gave {t} (all: {})",
                earlier::summary(&tried)
            );
        }
        assert_eq!(
            second.registers(),
            SETUP.pattern,
            "the earlier borrower's writes reached the device"
        );
        assert_eq!(
            view.bar_paths,
            vec![(0, BarPath::Mediated), (2, BarPath::Trapped)]
        );
    }
}
