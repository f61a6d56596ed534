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
//! * `testing` (cargo feature `testing`): the real `lenderd` as a child process of a test.

pub mod auth;
pub mod backend;
pub mod client;
pub mod directory;
pub mod inventory;
pub mod iommu;
pub mod protocol;
pub mod server;
pub mod spec;
#[cfg(feature = "testing")]
pub mod testing;

use std::sync::Arc;

use backend::emulated::EmulatedBackend;
use backend::DeviceBackend;
use spec::{DeviceKind, DeviceSpec};

pub use client::{ClientIrq, LenderClient};

/// Creates the backend a spec describes.
pub fn open_backend(spec: &DeviceSpec) -> Result<Arc<dyn DeviceBackend>, backend::BackendError> {
    let name = spec.id.replace(':', "_");
    Ok(match &spec.kind {
        DeviceKind::Vfio => Arc::new(backend::vfio::VfioBackend::open(&spec.id)?),
        DeviceKind::Dmatest { mode } => Arc::new(EmulatedBackend::dmatest(&name, *mode)?),
        DeviceKind::Nvme {
            path,
            size,
            lba,
            mode,
            dbbuf,
        } => {
            let cfg = emulated::nvme::NvmeConfig {
                backing: path.clone(),
                size: *size,
                lba_size: *lba,
                notify: *mode,
                dbbuf: *dbbuf,
                serial: format!("LENDVM{}", spec.id.replace([':', '.'], ""))
                    .chars()
                    .take(20)
                    .collect(),
                ..Default::default()
            };
            Arc::new(EmulatedBackend::nvme(&name, cfg)?)
        }
    })
}
