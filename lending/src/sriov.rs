//! SR-IOV on the lender: PCI addresses of virtual functions, and the emulated NVMe's physical
//! function with `vfs=N` virtual functions, each a lendable device of its own ("SR-IOV used
//! as MR-IOV", SmartIO: the functions of one device go to different borrowers).
//!
//! * **Addresses.** VF `n` (1-based) has routing ID `PF + First VF Offset + (n - 1) * VF
//!   Stride` ([`emulated::sriov::vf_routing_id`]); [`Bdf`] converts between `DDDD:BB:DD.F`
//!   and routing IDs. The emulated PF uses offset [`VF_OFFSET`] and stride [`VF_STRIDE`]
//!   (1 and 1, as QEMU's emulated NVMe): PF `0000:82:00.0` has VFs `0000:82:00.1` ..
//!   `0000:82:00.7`, `0000:82:01.0`, ...
//! * **Namespaces.** With `size=S` and `vfs=N` the backing file holds N + 1 namespaces of S
//!   bytes each: function `f` (0 = the PF, `n` = VF n) owns bytes `[f * S, (f + 1) * S)` as
//!   its LBA 0 .. S / lba - 1 ([`namespace_offset`]). The slices are disjoint and each
//!   controller refuses an LBA outside its own (LBA Out of Range), so no function, PF
//!   included, can read or write another's blocks.
//! * **Independence.** Every function is its own [`EmulatedBackend`]: own controller thread
//!   and I/O engine, own register BAR (a memfd window), MSI-X vectors, software IOMMU domain
//!   and interrupt wiring. Reset, FLR, lease end or a borrower's crash on one function touch
//!   nothing of another. Unlike hardware, a PF reset leaves the VFs alone: NumVFs is lender
//!   state, not the PF borrower's (see [`crate::backend::config::extended`]: a borrower never
//!   sees the SR-IOV capability and its writes to extended config space are dropped).
//! * **Exclusion.** Still, a PF and its VFs are never lent at the same time, as for a real
//!   device, where resetting the PF (`VFIO_DEVICE_RESET`, FLR) takes every VF away from its
//!   borrower: the inventory refuses the PF while any of its VFs is lent, releasing or
//!   resetting, and a VF while its PF is ([`crate::inventory::InventoryError::Family`]). So
//!   whenever the lender resets a PF (its borrower's RESET, the end of its lease) none of its
//!   VFs has a borrower to lose it. Vfio VFs name their PF through sysfs (`physfn`).
//!
//! A real SR-IOV device (vfio) needs none of this: the operator enables its VFs on the lender
//! host (`sriov_numvfs`), binds each to vfio-pci and lends each by its BDF; see docs/SRIOV.md.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use emulated::nvme::NvmeConfig;
use emulated::sriov::{SriovCap, SriovError};
use thiserror::Error;

use crate::backend::emulated::EmulatedBackend;
use crate::backend::{BackendError, DeviceBackend};

/// First VF Offset of the emulated PF.
pub const VF_OFFSET: u16 = 1;
/// VF Stride of the emulated PF.
pub const VF_STRIDE: u16 = 1;
/// Most VFs an emulated PF offers (each is a controller with its own threads).
pub const MAX_VFS: u16 = 32;
/// A device id (its BDF) and the backend that lends it.
pub type LendableFunction = (String, Arc<dyn DeviceBackend>);

/// Kind of an emulated NVMe virtual function (`lendctl list` shows it).
pub const NVME_VF_KIND: &str = "nvme-vf";

/// Errors of PCI addresses and VF layout.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum BdfError {
    /// Not `DDDD:BB:DD.F`.
    #[error("{0:?} is not a PCI address like 0000:81:00.0")]
    Syntax(String),
    /// A VF address that does not exist.
    #[error("{pf}: {source}")]
    Vf {
        /// The PF.
        pf: Bdf,
        /// Why.
        #[source]
        source: SriovError,
    },
}

/// A PCI address: domain, bus, device (0..=31), function (0..=7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bdf {
    /// PCI domain (segment).
    pub domain: u16,
    /// Bus.
    pub bus: u8,
    /// Device (0..=31).
    pub device: u8,
    /// Function (0..=7).
    pub function: u8,
}

impl Bdf {
    /// Routing ID: `bus << 8 | device << 3 | function`.
    pub fn routing_id(&self) -> u16 {
        u16::from(self.bus) << 8 | u16::from(self.device & 0x1f) << 3 | u16::from(self.function & 7)
    }

    /// The address of routing ID `rid` in `domain`.
    pub fn from_routing_id(domain: u16, rid: u16) -> Bdf {
        Bdf {
            domain,
            bus: (rid >> 8) as u8,
            device: ((rid >> 3) & 0x1f) as u8,
            function: (rid & 7) as u8,
        }
    }

    /// The addresses of VFs 1..=`cap.num_vfs` of the PF at `self`.
    pub fn vfs(&self, cap: &SriovCap) -> Result<Vec<Bdf>, BdfError> {
        (1..=cap.num_vfs)
            .map(|n| {
                cap.vf_routing_id(self.routing_id(), n)
                    .map(|rid| Bdf::from_routing_id(self.domain, rid))
                    .map_err(|source| BdfError::Vf { pf: *self, source })
            })
            .collect()
    }
}

impl fmt::Display for Bdf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl FromStr for Bdf {
    type Err = BdfError;

    fn from_str(s: &str) -> Result<Bdf, BdfError> {
        if !crate::spec::valid_bdf(s) {
            return Err(BdfError::Syntax(s.to_string()));
        }
        let hex = |r: std::ops::Range<usize>| {
            u16::from_str_radix(&s[r], 16).map_err(|_| BdfError::Syntax(s.to_string()))
        };
        Ok(Bdf {
            domain: hex(0..4)?,
            bus: hex(5..7)? as u8,
            device: hex(8..10)? as u8,
            function: hex(11..12)? as u8,
        })
    }
}

/// The SR-IOV capability of an emulated NVMe PF with `vfs` VFs.
pub fn nvme_sriov_cap(vfs: u16, vf_device_id: u16) -> Result<SriovCap, SriovError> {
    SriovCap::enabled(
        vfs,
        VF_OFFSET,
        VF_STRIDE,
        vf_device_id,
        vec![
            emulated::BarInfo {
                index: 0,
                size: emulated::nvme::BAR0_SIZE,
                is_64bit: true,
                prefetchable: false,
                register_memory: true,
                doorbells: None,
            },
            emulated::BarInfo {
                index: emulated::nvme::MSIX_BAR,
                size: emulated::nvme::MSIX_BAR_SIZE,
                is_64bit: false,
                prefetchable: false,
                register_memory: false,
                doorbells: None,
            },
        ],
    )
}

/// The VF addresses of an emulated NVMe PF at `pf` with `vfs` VFs.
pub fn nvme_vf_bdfs(pf: &Bdf, vfs: u16) -> Result<Vec<Bdf>, BdfError> {
    let cap = nvme_sriov_cap(vfs, 0).map_err(|source| BdfError::Vf { pf: *pf, source })?;
    pf.vfs(&cap)
}

/// Byte offset of function `f`'s namespace (0 = the PF, n = VF n) in the shared backing file
/// when each namespace is `size` bytes.
pub fn namespace_offset(f: u16, size: u64) -> Option<u64> {
    u64::from(f).checked_mul(size)
}

/// The serial number lenderd gives the emulated NVMe at `id`: `LENDVM` + the address without
/// separators (20 characters at most).
pub fn nvme_serial(id: &str) -> String {
    format!("LENDVM{}", id.replace([':', '.'], ""))
        .chars()
        .take(20)
        .collect()
}

/// Opens an emulated NVMe PF at `pf` from `cfg` (whose `size` is each function's namespace
/// size) with `vfs` VFs: the PF (with the SR-IOV capability) first, then VF 1..=vfs, each
/// with its address. The backing file is extended to hold all `vfs + 1` namespaces.
pub fn open_nvme_functions(
    pf: &Bdf,
    cfg: NvmeConfig,
    vfs: u16,
) -> Result<Vec<LendableFunction>, BackendError> {
    let model = |e: String| BackendError::Model(e);
    let size = cfg.size.ok_or_else(|| {
        model(format!(
            "{pf}: sr-iov needs the size of each function's namespace"
        ))
    })?;
    let cap =
        nvme_sriov_cap(vfs, cfg.identity.device_id).map_err(|e| model(format!("{pf}: {e}")))?;
    let vf_bdfs = pf.vfs(&cap).map_err(|e| model(e.to_string()))?;
    let name = |b: &Bdf| b.to_string().replace(':', "_");
    let pf_id = pf.to_string();
    let mut out: Vec<LendableFunction> = Vec::with_capacity(vf_bdfs.len() + 1);
    let pf_cfg = NvmeConfig {
        ns_offset: 0,
        serial: nvme_serial(&pf_id),
        ..cfg.clone()
    };
    let pf_backend = EmulatedBackend::nvme(&name(pf), pf_cfg)?.with_sriov(&cap);
    out.push((pf_id.clone(), Arc::new(pf_backend)));
    for (i, vf) in vf_bdfs.iter().enumerate() {
        let n = i as u16 + 1;
        let off = namespace_offset(n, size).ok_or_else(|| {
            model(format!(
                "{vf}: namespace {n} of {size:#x} bytes is past 2^64"
            ))
        })?;
        let id = vf.to_string();
        let mut vf_cfg = NvmeConfig {
            ns_offset: off,
            intx: false,
            serial: nvme_serial(&id),
            ..cfg.clone()
        };
        vf_cfg.identity.device_id = cap.vf_device_id;
        let b = EmulatedBackend::nvme_kind(&name(vf), NVME_VF_KIND, vf_cfg)?.with_physfn(&pf_id);
        log::info!(
            "{id}: virtual function {n} of {pf_id}, namespace at bytes {off:#x}..{:#x} of {}",
            off + size,
            cfg.backing.display()
        );
        out.push((id, Arc::new(b)));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bdf_parses_prints_and_converts_routing_ids() {
        let b: Bdf = "0000:82:1f.7".parse().unwrap();
        assert_eq!((b.domain, b.bus, b.device, b.function), (0, 0x82, 0x1f, 7));
        assert_eq!(b.routing_id(), 0x82ff);
        assert_eq!(b.to_string(), "0000:82:1f.7");
        assert_eq!(
            Bdf::from_routing_id(0x10, 0x82ff).to_string(),
            "0010:82:1f.7"
        );
        for bad in [
            "82:00.0",
            "0000:82:20.0",
            "0000:82:00.8",
            "0000:8g:00.0",
            "",
        ] {
            let e = bad.parse::<Bdf>().unwrap_err();
            assert_eq!(e, BdfError::Syntax(bad.into()));
        }
    }

    #[test]
    fn emulated_pf_vf_addresses() {
        let pf: Bdf = "0000:82:00.0".parse().unwrap();
        let v: Vec<String> = nvme_vf_bdfs(&pf, 9)
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            v,
            [
                "0000:82:00.1",
                "0000:82:00.2",
                "0000:82:00.3",
                "0000:82:00.4",
                "0000:82:00.5",
                "0000:82:00.6",
                "0000:82:00.7",
                "0000:82:01.0",
                "0000:82:01.1"
            ]
        );
        // Into the next bus, and past the last one.
        let pf: Bdf = "0001:82:1f.6".parse().unwrap();
        let v = nvme_vf_bdfs(&pf, 2).unwrap();
        assert_eq!(v[1].to_string(), "0001:83:00.0");
        let pf: Bdf = "0000:ff:1f.6".parse().unwrap();
        let e = nvme_vf_bdfs(&pf, 2).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("0000:ff:1f.6: virtual function 2"),
            "{e}"
        );
        assert!(nvme_vf_bdfs(&pf, 1).is_ok());
    }

    #[test]
    fn namespaces_are_disjoint_slices() {
        let s = 4 << 20;
        let offs: Vec<u64> = (0..4).map(|f| namespace_offset(f, s).unwrap()).collect();
        assert_eq!(offs, [0, s, 2 * s, 3 * s]);
        assert_eq!(namespace_offset(2, u64::MAX), None);
        assert_eq!(nvme_serial("0000:82:00.1"), "LENDVM000082001");
    }

    /// The PF has a 4 KiB config space with the SR-IOV capability at 0x100 (lender view);
    /// each VF is an `nvme-vf` with its own header (vendor/device shown as vfio-pci shows a
    /// VF's), no INTx, MSI-X. A PF borrower's view hides the capability, its NumVFs write is
    /// dropped and counted, a write that bypasses the gate is ignored too, and a PF reset
    /// keeps the capability as it was.
    #[test]
    fn pf_capability_vf_headers_and_numvfs_writes() {
        use crate::backend::config::{virtualized_info, ConfigGate, WriteOutcome};
        use emulated::sriov::{REG_NUM_VFS, REG_TOTAL_VFS};

        let dir = tempfile::tempdir().unwrap();
        let size = 1u64 << 20;
        let cfg = NvmeConfig {
            backing: dir.path().join("pf.img"),
            size: Some(size),
            io_threads: 1,
            ..NvmeConfig::default()
        };
        let pf: Bdf = "0000:82:00.0".parse().unwrap();
        let fns = open_nvme_functions(&pf, cfg, 2).unwrap();
        let ids: Vec<&str> = fns.iter().map(|(i, _)| i.as_str()).collect();
        assert_eq!(ids, ["0000:82:00.0", "0000:82:00.1", "0000:82:00.2"]);
        assert_eq!(
            std::fs::metadata(dir.path().join("pf.img")).unwrap().len(),
            3 * size,
            "the file holds three namespaces"
        );
        let pfb = &fns[0].1;
        assert_eq!((pfb.kind(), pfb.config_size()), ("nvme", 4096));
        let mut c = vec![0u8; 4096];
        pfb.config_read(0, &mut c).unwrap();
        let cap = SriovCap::parse(&c[0x100..0x140]).unwrap();
        assert_eq!(
            (
                cap.total_vfs,
                cap.num_vfs,
                cap.first_vf_offset,
                cap.vf_stride
            ),
            (2, 2, VF_OFFSET, VF_STRIDE)
        );
        assert_eq!(cap.vf_device_id, 0x0010);
        assert_eq!(c[0x3d], 1, "the pf has inta");
        let lender_caps = crate::backend::capabilities(&c);
        assert!(lender_caps.iter().any(|k| k.extended && k.id == 0x10));
        for (id, vf) in &fns[1..] {
            assert_eq!(vf.kind(), NVME_VF_KIND);
            assert_eq!(vf.config_size(), 256);
            let info = vf.describe(id);
            assert_eq!(&info.config[0..4], &[0x36, 0x1b, 0x10, 0x00], "{id}");
            assert_eq!(info.config[0x3d], 0, "{id}: a vf has no intx pin");
            assert_eq!((info.irqs.intx, info.irqs.msix), (0, 17), "{id}");
        }

        // The PF's borrower: no SR-IOV capability; its NumVFs write changes nothing.
        let info = virtualized_info(pfb.as_ref(), "0000:82:00.0");
        assert!(
            !info.caps.iter().any(|k| k.extended && k.id == 0x10),
            "{:?}",
            info.caps
        );
        let gate = ConfigGate::new("test pf", pfb.as_ref()).unwrap();
        let mut v = [0u8; 4];
        gate.read(pfb.as_ref(), 0x100 + REG_TOTAL_VFS as u16 - 2, &mut v)
            .unwrap();
        assert_eq!(v, [0; 4], "hidden: reads as zero");
        let at = 0x100 + REG_NUM_VFS as u16;
        assert_eq!(
            gate.write(pfb.as_ref(), at, &0u16.to_le_bytes()).unwrap(),
            WriteOutcome::Dropped
        );
        assert_eq!(gate.counts().dropped, 1);
        pfb.config_write(at, &0u16.to_le_bytes()).unwrap();
        pfb.config_read(at, &mut v[..2]).unwrap();
        assert_eq!(
            u16::from_le_bytes([v[0], v[1]]),
            2,
            "numvfs is the lender's"
        );
        pfb.reset().unwrap();
        let mut after = vec![0u8; 4096];
        pfb.config_read(0, &mut after).unwrap();
        assert_eq!(&after[0x100..0x140], &c[0x100..0x140]);
    }

    #[test]
    fn sriov_without_a_size_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = NvmeConfig {
            backing: dir.path().join("pf.img"),
            ..NvmeConfig::default()
        };
        let pf: Bdf = "0000:82:00.0".parse().unwrap();
        let e = open_nvme_functions(&pf, cfg, 2).err().unwrap();
        assert!(
            e.to_string()
                .contains("0000:82:00.0: sr-iov needs the size"),
            "{e}"
        );
    }
}
