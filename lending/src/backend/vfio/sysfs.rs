//! Whether a PCI function may be lent through VFIO, from sysfs: bound to vfio-pci, alone in
//! its IOMMU group (or with bridges only), and not an SR-IOV physical function with virtual
//! functions enabled. The kernel's own answer
//! (`VFIO_GROUP_GET_STATUS` not viable, or `EBUSY`) names neither the device nor the
//! reason; this check does.

use std::path::Path;

use thiserror::Error;

pub use crate::backend::SriovUnreadable;

/// Why a function cannot be lent through VFIO.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BindingError {
    /// No such function in sysfs.
    #[error("{bdf}: no such pci function ({path} does not exist)")]
    NoDevice {
        /// The function.
        bdf: String,
        /// The sysfs directory looked for.
        path: String,
    },
    /// Not a name a sysfs directory can have (empty, `.`, `..`, a `/` or a NUL in it).
    #[error("{bdf:?} is not a pci address that names a sysfs directory (like 0000:81:00.0)")]
    BadName {
        /// What was given.
        bdf: String,
    },
    /// An SR-IOV PF with VFs enabled.
    #[error(transparent)]
    PfWithVfs(#[from] PfWithVfs),
    /// Its `sriov_numvfs` exists but cannot be read: refused (fails closed).
    #[error(transparent)]
    SriovUnreadable(#[from] SriovUnreadable),
    /// Bound to another driver, or to none.
    #[error(
        "{bdf} is bound to {driver}, not vfio-pci: unbind it and bind vfio-pci (echo vfio-pci > \
         /sys/bus/pci/devices/{bdf}/driver_override; echo {bdf} > \
         /sys/bus/pci/drivers/{driver}/unbind; echo {bdf} > /sys/bus/pci/drivers_probe)"
    )]
    NotVfioPci {
        /// The function.
        bdf: String,
        /// Its driver (`no driver` when none).
        driver: String,
    },
    /// No IOMMU group: no IOMMU, or it is off.
    #[error("{bdf} has no iommu group (is the iommu on? intel_iommu=on / amd_iommu=on)")]
    NoGroup {
        /// The function.
        bdf: String,
    },
    /// The group holds another endpoint: VFIO hands out groups whole, and this lender gives
    /// each lent function a container of its own.
    #[error(
        "{bdf} shares iommu group {group} with {other} (driver {driver}), which is not lent: a \
         group is isolated only as a whole; lend a function whose group holds nothing else \
         (ACS on the path, or another slot)"
    )]
    SharedGroup {
        /// The function.
        bdf: String,
        /// Its group number.
        group: String,
        /// The other function.
        other: String,
        /// The other function's driver.
        driver: String,
    },
}

/// A physical function with VFs enabled (checked before the driver: it is the reason even
/// when the PF is bound to its own driver, as it must be to manage its VFs).
#[derive(Debug, Error, PartialEq, Eq)]
#[error(
    "{bdf} is an SR-IOV physical function with {vfs} virtual function(s) enabled: a PF's \
     reset (every lease ends with one) takes its VFs away from whoever uses them, so a PF is \
     never lent while its VFs exist; lend the VFs instead, or disable them first (echo 0 > \
     /sys/bus/pci/devices/{bdf}/sriov_numvfs)"
)]
pub struct PfWithVfs {
    /// The PF.
    pub bdf: String,
    /// Its `sriov_numvfs`.
    pub vfs: u32,
}

/// The VFs enabled on the function at `dev` (its `sriov_numvfs`; 0 for a function without
/// SR-IOV, which has no such file). Read live: the PF's driver may enable VFs at any time.
/// Fails closed: a file that exists but cannot be read or holds no count is an error, not
/// 0, since a PF with VFs must never be lent (its reset takes them away from their users).
pub fn enabled_vfs(dev: &Path) -> Result<u32, SriovUnreadable> {
    let path = dev.join("sriov_numvfs");
    let unreadable = |kind, detail| SriovUnreadable {
        path: path.display().to_string(),
        kind,
        detail,
    };
    match std::fs::read_to_string(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(unreadable(e.kind(), e.to_string())),
        Ok(n) => n.trim().parse().map_err(|e| {
            unreadable(
                std::io::ErrorKind::InvalidData,
                format!("{:?} is not a count: {e}", n.trim()),
            )
        }),
    }
}

/// [`PfWithVfs`] when the function `bdf` under `sysfs` has VFs enabled,
/// [`SriovUnreadable`] when that cannot be told.
pub fn check_no_vfs(sysfs: &Path, bdf: &str) -> Result<(), BindingError> {
    match enabled_vfs(&sysfs.join(bdf))? {
        0 => Ok(()),
        vfs => Err(PfWithVfs {
            bdf: bdf.into(),
            vfs,
        }
        .into()),
    }
}

fn driver_of(dev: &Path) -> String {
    std::fs::read_link(dev.join("driver"))
        .ok()
        .and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "no driver".into())
}

/// Whether the function at `dev` is a PCI bridge (class 0x0604): bridges may share a
/// group (vfio allows them bound to pcieport or to no driver).
fn is_bridge(dev: &Path) -> bool {
    std::fs::read_to_string(dev.join("class"))
        .ok()
        .and_then(|c| u32::from_str_radix(c.trim().trim_start_matches("0x"), 16).ok())
        .is_some_and(|c| c >> 8 == 0x0604)
}

/// Checks that `bdf` (under the sysfs root `sysfs`, normally `/sys/bus/pci/devices`) is
/// not an SR-IOV PF with VFs enabled, bound to vfio-pci, and that its IOMMU group holds no
/// other endpoint.
pub fn check_lendable(sysfs: &Path, bdf: &str) -> Result<(), BindingError> {
    let dev = sysfs.join(bdf);
    if !dev.exists() {
        return Err(BindingError::NoDevice {
            bdf: bdf.into(),
            path: dev.display().to_string(),
        });
    }
    check_no_vfs(sysfs, bdf)?;
    let driver = driver_of(&dev);
    if driver != "vfio-pci" {
        return Err(BindingError::NotVfioPci {
            bdf: bdf.into(),
            driver,
        });
    }
    let group = std::fs::read_link(dev.join("iommu_group"))
        .ok()
        .and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()))
        .ok_or_else(|| BindingError::NoGroup { bdf: bdf.into() })?;
    let members = std::fs::read_dir(dev.join("iommu_group").join("devices"))
        .map_err(|_| BindingError::NoGroup { bdf: bdf.into() })?;
    let mut others: Vec<String> = members
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|m| m != bdf)
        .collect();
    others.sort();
    for other in others {
        let o = sysfs.join(&other);
        if is_bridge(&o) {
            continue;
        }
        return Err(BindingError::SharedGroup {
            bdf: bdf.into(),
            group,
            driver: driver_of(&o),
            other,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A sysfs with drivers/, iommu_groups/ and devices/ like the kernel's.
    struct Sys(tempfile::TempDir);

    impl Sys {
        fn new() -> Self {
            Sys(tempfile::tempdir().unwrap())
        }
        fn devices(&self) -> std::path::PathBuf {
            self.0.path().join("devices")
        }
        fn add(&self, bdf: &str, driver: Option<&str>, group: Option<u32>, class: u32) {
            let d = self.devices().join(bdf);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("class"), format!("{class:#08x}\n")).unwrap();
            if let Some(drv) = driver {
                let p = self.0.path().join("drivers").join(drv);
                std::fs::create_dir_all(&p).unwrap();
                symlink(&p, d.join("driver")).unwrap();
            }
            if let Some(g) = group {
                let p = self.0.path().join("iommu_groups").join(g.to_string());
                std::fs::create_dir_all(p.join("devices")).unwrap();
                symlink(&p, d.join("iommu_group")).unwrap();
                symlink(&d, p.join("devices").join(bdf)).unwrap();
            }
        }
    }

    #[test]
    fn only_a_vfio_pci_function_alone_in_its_group_is_lendable() {
        let s = Sys::new();
        s.add("0000:01:00.0", Some("vfio-pci"), Some(3), 0x010802);
        s.add("0000:02:00.0", Some("nvme"), Some(4), 0x010802);
        s.add("0000:03:00.0", None, Some(5), 0x020000);
        s.add("0000:04:00.0", Some("vfio-pci"), Some(6), 0x020000);
        s.add("0000:04:00.1", Some("e1000e"), Some(6), 0x020000);
        s.add("0000:05:00.0", Some("vfio-pci"), Some(7), 0x020000);
        s.add("0000:00:1c.0", Some("pcieport"), Some(7), 0x060400);
        s.add("0000:06:00.0", Some("vfio-pci"), None, 0x020000);
        let d = s.devices();
        assert_eq!(check_lendable(&d, "0000:01:00.0"), Ok(()));
        assert_eq!(
            check_lendable(&d, "0000:05:00.0"),
            Ok(()),
            "a bridge may share"
        );
        let e = check_lendable(&d, "0000:02:00.0").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("0000:02:00.0 is bound to nvme, not vfio-pci"),
            "{e}"
        );
        let e = check_lendable(&d, "0000:03:00.0").unwrap_err();
        assert!(e.to_string().contains("bound to no driver"), "{e}");
        let e = check_lendable(&d, "0000:04:00.0").unwrap_err();
        assert_eq!(
            e,
            BindingError::SharedGroup {
                bdf: "0000:04:00.0".into(),
                group: "6".into(),
                other: "0000:04:00.1".into(),
                driver: "e1000e".into(),
            }
        );
        assert!(
            e.to_string()
                .contains("shares iommu group 6 with 0000:04:00.1"),
            "{e}"
        );
        assert!(matches!(
            check_lendable(&d, "0000:06:00.0"),
            Err(BindingError::NoGroup { .. })
        ));
        assert!(matches!(
            check_lendable(&d, "0000:09:00.0"),
            Err(BindingError::NoDevice { .. })
        ));
    }

    #[test]
    fn a_pf_with_vfs_enabled_is_refused_whatever_its_driver() {
        let s = Sys::new();
        s.add("0000:05:00.0", Some("nvme"), Some(8), 0x010802);
        s.add("0000:05:00.1", Some("vfio-pci"), Some(9), 0x010802);
        s.add("0000:06:00.0", Some("vfio-pci"), Some(10), 0x010802);
        let d = s.devices();
        std::fs::write(d.join("0000:05:00.0/sriov_numvfs"), "1\n").unwrap();
        // A PF whose VFs are all disabled is an ordinary function.
        std::fs::write(d.join("0000:06:00.0/sriov_numvfs"), "0\n").unwrap();
        let e = check_lendable(&d, "0000:05:00.0").unwrap_err();
        assert_eq!(
            e,
            BindingError::PfWithVfs(PfWithVfs {
                bdf: "0000:05:00.0".into(),
                vfs: 1
            })
        );
        assert!(
            e.to_string().starts_with(
                "0000:05:00.0 is an SR-IOV physical function with 1 virtual function(s) enabled"
            ),
            "{e}"
        );
        assert_eq!(check_lendable(&d, "0000:05:00.1"), Ok(()));
        assert_eq!(check_lendable(&d, "0000:06:00.0"), Ok(()));
        // Enabled after the check (vfio-pci's enable_sriov): the live re-check sees it.
        std::fs::write(d.join("0000:06:00.0/sriov_numvfs"), "2\n").unwrap();
        assert_eq!(
            check_no_vfs(&d, "0000:06:00.0"),
            Err(BindingError::PfWithVfs(PfWithVfs {
                bdf: "0000:06:00.0".into(),
                vfs: 2
            }))
        );
    }

    /// A `sriov_numvfs` that exists but cannot be read, or holds no count, refuses the
    /// function (fails closed) and names the file; only a missing file means "no SR-IOV".
    #[test]
    fn an_unreadable_vf_count_refuses_the_function() {
        let s = Sys::new();
        s.add("0000:07:00.0", Some("vfio-pci"), Some(11), 0x010802);
        s.add("0000:08:00.0", Some("vfio-pci"), Some(12), 0x010802);
        let d = s.devices();
        std::fs::write(d.join("0000:07:00.0/sriov_numvfs"), "lots\n").unwrap();
        // Reading a directory fails with EISDIR even for root (a mode would not).
        std::fs::create_dir(d.join("0000:08:00.0/sriov_numvfs")).unwrap();
        for bdf in ["0000:07:00.0", "0000:08:00.0"] {
            let e = check_lendable(&d, bdf).unwrap_err();
            let BindingError::SriovUnreadable(u) = &e else {
                panic!("{bdf}: {e:?}");
            };
            assert!(u.path.ends_with(&format!("{bdf}/sriov_numvfs")), "{u:?}");
            assert!(
                e.to_string()
                    .contains("cannot tell whether SR-IOV virtual functions are enabled"),
                "{e}"
            );
        }
        let e = enabled_vfs(&d.join("0000:07:00.0")).unwrap_err();
        assert_eq!(e.kind, std::io::ErrorKind::InvalidData);
        assert!(e.detail.contains("\"lots\" is not a count"), "{e:?}");
        // No file at all: a function without SR-IOV.
        s.add("0000:09:00.0", Some("vfio-pci"), Some(13), 0x010802);
        assert_eq!(enabled_vfs(&d.join("0000:09:00.0")), Ok(0));
    }
}
