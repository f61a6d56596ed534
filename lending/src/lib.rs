//! Lender side of device lending: `lenderd`'s inventory, leases, control protocol, IOMMU
//! domains and device backends, plus the client library borrowers use.
//!
//! * [`iommu`]: [`iommu::IommuDomain`], the bounds-checking [`iommu::SoftIommu`], and the VFIO
//!   domain behind [`iommu::vfio::VfioContainerOps`].
//! * [`backend`]: [`backend::DeviceBackend`], the emulated-model host and the vfio-pci backend,
//!   the lender-side config filter and interrupt wiring.
//! * [`protocol`]: the control protocol (vfio-user-like operations on the fabric wire format).
//! * [`inventory`]: device states and exclusive [`inventory::Lease`]s whose drop gives the
//!   device back.
//! * [`server`]: the per-link protocol server; [`client`]: the borrower's [`client::LenderClient`].
//! * [`directory`]: the cluster directory (static file or etcd): registration, claims and
//!   fencing.
//! * [`spec`]: `--device` parsing.
//! * [`audit`]: `lenderd --audit-log`: every lease's grant, end and serving, as JSON lines.
//! * [`metrics`]: the `--metrics` listener (Prometheus/OpenMetrics) of lenderd and lendvm.
//! * `testing` (cargo feature `testing`): the real `lenderd` as a child process of a test.
//! * `earlier_borrower` (unit tests and the feature `testing`): a borrower that keeps every
//!   fd it received and tries them on the next borrower's device.

pub mod audit;
pub mod auth;
pub mod backend;
pub mod cli;
pub mod client;
pub mod directory;
#[cfg(any(test, feature = "testing"))]
pub mod earlier_borrower;
pub mod inventory;
pub mod iommu;
pub mod metrics;
pub mod protocol;
pub mod server;
pub mod spec;
pub mod sriov;
#[cfg(feature = "testing")]
pub mod testing;

use std::sync::Arc;

use backend::emulated::EmulatedBackend;
use backend::DeviceBackend;
use spec::{DeviceKind, DeviceSpec};

pub use client::{ClientIrq, LenderClient};

/// Creates the backends a spec describes, with their ids: one, or an SR-IOV PF followed by
/// its virtual functions (`vfs=N`, see [`sriov`]). `node` (this lender's name) makes emulated
/// NVMe subsystem NQNs unique in the cluster.
pub fn open_backends(
    spec: &DeviceSpec,
    node: &str,
) -> Result<Vec<sriov::LendableFunction>, backend::BackendError> {
    let name = spec.id.replace(':', "_");
    let one = |b: Arc<dyn DeviceBackend>| vec![(spec.id.clone(), b)];
    Ok(match &spec.kind {
        DeviceKind::Vfio => one(Arc::new(backend::vfio::VfioBackend::open(&spec.id)?)),
        DeviceKind::Epftest { vectors } => {
            one(Arc::new(EmulatedBackend::epftest(&name, *vectors)?))
        }
        DeviceKind::Dmatest { mode, buf, rebar } => one(Arc::new(
            EmulatedBackend::dmatest_resizable(&name, *mode, *buf, *rebar)?,
        )),
        DeviceKind::Nvme {
            path,
            size,
            lba,
            mode,
            dbbuf,
            vfs,
            cmb,
            msix,
            queues,
        } => {
            let defaults = emulated::nvme::NvmeConfig::default();
            let cfg = emulated::nvme::NvmeConfig {
                backing: path.clone(),
                size: *size,
                lba_size: *lba,
                notify: *mode,
                dbbuf: *dbbuf,
                serial: sriov::nvme_serial(&spec.id),
                subsystem: node.to_string(),
                cmb_size: *cmb,
                msix_vectors: msix.unwrap_or(defaults.msix_vectors),
                max_io_queues: queues.unwrap_or(defaults.max_io_queues),
                ..defaults
            };
            if *vfs == 0 {
                one(Arc::new(EmulatedBackend::nvme(&name, cfg)?))
            } else {
                let pf: sriov::Bdf = spec
                    .id
                    .parse()
                    .map_err(|e: sriov::BdfError| backend::BackendError::Model(e.to_string()))?;
                sriov::open_nvme_functions(&pf, cfg, *vfs)?
            }
        }
    })
}
