//! `--device` specifications of lenderd.
//!
//! ```text
//! 0000:81:00.0=vfio
//! 0000:82:00.0=nvme:path=/var/lib/lendvm/disk0.img,size=1G[,lba=512|4096][,mode=interrupt|polling][,dbbuf=on|off][,vfs=N][,cmb=SIZE]
//! 0000:83:00.0=dmatest[:mode=interrupt|polling][,buf=SIZE][,rebar=SIZE]
//! 0000:85:00.0=epftest[:vectors=N]
//! ```
//!
//! `epftest` is the register interface of Linux's PCI endpoint test function with `vectors`
//! MSI-X vectors (1..=2048, default 128; `emulated::epftest`): the guest's
//! `pci_endpoint_test` driver enables them all and raises any one on request.
//!
//! `buf=SIZE` (a multiple of 4K, at most 128G, sparse; default 60K) sizes the dmatest's data buffer
//! (its peer memory); BAR0 grows to the next power of two above 4K + SIZE.
//!
//! `rebar=SIZE` makes that BAR0 resizable, as a GPU's aperture is: a 64-bit prefetchable BAR
//! with the Resizable BAR capability, offering every power of two from 1M to 4K + `buf`
//! (which must then be a power of two), and SIZE until the guest's driver picks another.
//!
//! `vfs=N` (1..=32, needs `size`) gives the emulated NVMe N SR-IOV virtual functions at the
//! next N routing IDs, each lendable on its own with a `size`-byte namespace of its own in
//! the same file (see [`crate::sriov`]). `cmb=SIZE` (a power of two, 2M..=256M) gives it a
//! Controller Memory Buffer in BAR0 (see `emulated::nvme::cmb`); with `vfs`, every function
//! has one.

use std::path::PathBuf;

use emulated::NotifyMode;
use thiserror::Error;

/// A bad device specification; the message names the bad part.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("device spec {spec:?}: {msg}")]
pub struct SpecError {
    /// The whole spec.
    pub spec: String,
    /// What is wrong.
    pub msg: String,
}

/// What backs a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceKind {
    /// Real device bound to vfio-pci.
    Vfio,
    /// Emulated NVMe controller.
    Nvme {
        /// Backing file.
        path: PathBuf,
        /// Namespace size in bytes (`None`: the file's size).
        size: Option<u64>,
        /// LBA size.
        lba: u32,
        /// Doorbell notification.
        mode: NotifyMode,
        /// Offer shadow doorbells (Doorbell Buffer Config); `dbbuf=off` for comparisons.
        dbbuf: bool,
        /// SR-IOV virtual functions (0: none, no SR-IOV capability).
        vfs: u16,
        /// Controller Memory Buffer size (0: none).
        cmb: u64,
        /// MSI-X vectors (`None`: the model's default, one per I/O queue plus the admin
        /// queue's). `msix=1` makes a guest driver share one vector between all its queues,
        /// whose interrupt affinity the guest may then move (Linux manages, and pins, the
        /// affinity of per-queue vectors).
        msix: Option<u16>,
        /// I/O queue pairs offered (`queues=`, 1..=1024; `None`: the model's 16). With
        /// `msix=` at 128 and more queues than vCPUs, a guest whose driver asks for extra
        /// queues (Linux: `nvme.write_queues=`) enables a vector per queue: a GPU's
        /// interrupt count on a device that is here.
        queues: Option<u16>,
    },
    /// Emulated PCI endpoint test function (MSI-X at a GPU's scale).
    Epftest {
        /// MSI-X vectors.
        vectors: u16,
    },
    /// Emulated dmatest copy engine.
    Dmatest {
        /// Doorbell notification.
        mode: NotifyMode,
        /// Data buffer size (`emulated::dmatest::BUF_SIZE` by default).
        buf: u64,
        /// BAR0's initial size when it is resizable.
        rebar: Option<u64>,
    },
}

/// One `--device` argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    /// PCI address (`0000:81:00.0`), the device's id.
    pub id: String,
    /// Backend.
    pub kind: DeviceKind,
}

/// Checks a PCI address `DDDD:BB:DD.F`.
pub fn valid_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(|c| c.is_ascii_hexdigit());
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && hex(0..4)
        && hex(5..7)
        && hex(8..10)
        && (b'0'..=b'7').contains(&b[11])
        && u8::from_str_radix(&s[8..10], 16).is_ok_and(|d| d < 32)
}

/// Parses `1G`, `512M`, `4096`, `64K`, `2T` (binary units).
pub fn parse_size(s: &str) -> Option<u64> {
    let (num, mul) = match s.char_indices().last()? {
        (i, 'K' | 'k') => (&s[..i], 1u64 << 10),
        (i, 'M' | 'm') => (&s[..i], 1 << 20),
        (i, 'G' | 'g') => (&s[..i], 1 << 30),
        (i, 'T' | 't') => (&s[..i], 1 << 40),
        _ => (s, 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mul).filter(|&v| v > 0)
}

fn parse_mode(v: &str, err: &dyn Fn(String) -> SpecError) -> Result<NotifyMode, SpecError> {
    match v {
        "interrupt" => Ok(NotifyMode::Interrupt),
        "polling" => Ok(NotifyMode::Polling),
        other => Err(err(format!(
            "mode {other:?} is not \"interrupt\" or \"polling\""
        ))),
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = SpecError;

    fn from_str(spec: &str) -> Result<Self, SpecError> {
        let err = |msg: String| SpecError {
            spec: spec.to_string(),
            msg,
        };
        let (id, rest) = spec
            .split_once('=')
            .ok_or_else(|| err("expected BDF=KIND[:OPTIONS]".into()))?;
        if !valid_bdf(id) {
            return Err(err(format!(
                "{id:?} is not a PCI address like 0000:81:00.0"
            )));
        }
        let (kind, opts) = match rest.split_once(':') {
            Some((k, o)) => (k, Some(o)),
            None => (rest, None),
        };
        let mut pairs = Vec::new();
        if let Some(o) = opts {
            for part in o.split(',') {
                let (k, v) = part
                    .split_once('=')
                    .ok_or_else(|| err(format!("option {part:?} is not key=value")))?;
                pairs.push((k, v));
            }
        }
        let kind = match kind {
            "vfio" => {
                if let Some((_, v)) = pairs.iter().find(|(k, _)| *k == "vfs") {
                    return Err(err(format!(
                        "vfs={v} is not a vfio option: enable the virtual functions on this \
                         host (echo N > /sys/bus/pci/devices/{id}/sriov_numvfs), bind each to \
                         vfio-pci and lend each by its own address (BDF=vfio)"
                    )));
                }
                if let Some((k, _)) = pairs.first() {
                    return Err(err(format!("vfio takes no options, got {k:?}")));
                }
                DeviceKind::Vfio
            }
            "dmatest" => {
                let mut mode = NotifyMode::Interrupt;
                let mut buf = emulated::dmatest::BUF_SIZE;
                let mut rebar = None;
                for (k, v) in pairs {
                    match k {
                        "mode" => mode = parse_mode(v, &err)?,
                        "buf" => {
                            buf = parse_size(v)
                                .filter(|s| {
                                    s.is_multiple_of(4096) && *s <= emulated::dmatest::MAX_BUF_SIZE
                                })
                                .ok_or_else(|| {
                                    err(format!(
                                        "buf {v:?} is not a multiple of 4K from 4K to 128G"
                                    ))
                                })?;
                        }
                        "vfs" => {
                            return Err(err(format!(
                                "vfs={v}: dmatest has no sr-iov (only nvme has virtual functions)"
                            )))
                        }
                        "rebar" => {
                            rebar = Some(parse_size(v).ok_or_else(|| {
                                err(format!("rebar {v:?} is not a size (1M, 256M, 4G)"))
                            })?);
                        }
                        other => return Err(err(format!("unknown dmatest option {other:?}"))),
                    }
                }
                if let Some(r) = rebar {
                    let whole = emulated::dmatest::BUF_OFFSET + buf;
                    if !whole.is_power_of_two() || whole < 1 << 20 {
                        return Err(err(format!(
                            "rebar needs a BAR0 of a power of two from 1M: buf={buf:#x} makes \
                             it {whole:#x} bytes (use a power of two less 4K, e.g. \
                             buf=4194300K for 4G)"
                        )));
                    }
                    if !r.is_power_of_two() || !(1 << 20..=whole).contains(&r) {
                        return Err(err(format!(
                            "rebar {r:#x} bytes: the initial size must be a power of two from \
                             1M to the whole BAR0 ({whole:#x} bytes)"
                        )));
                    }
                }
                DeviceKind::Dmatest { mode, buf, rebar }
            }
            "epftest" => {
                let mut vectors = emulated::epftest::DEFAULT_VECTORS;
                for (k, v) in pairs {
                    match k {
                        "vectors" => {
                            vectors = v
                                .parse::<u16>()
                                .ok()
                                .filter(|n| (1..=emulated::epftest::MAX_VECTORS).contains(n))
                                .ok_or_else(|| {
                                    err(format!(
                                        "vectors {v:?} is not a count from 1 to {}",
                                        emulated::epftest::MAX_VECTORS
                                    ))
                                })?;
                        }
                        other => return Err(err(format!("unknown epftest option {other:?}"))),
                    }
                }
                DeviceKind::Epftest { vectors }
            }
            "nvme" => {
                let mut path = None;
                let mut size = None;
                let mut lba = 512;
                let mut mode = NotifyMode::Interrupt;
                let mut dbbuf = true;
                let mut vfs = 0;
                let mut cmb = 0;
                let mut msix = None;
                let mut queues = None;
                for (k, v) in pairs {
                    match k {
                        "path" if !v.is_empty() => path = Some(PathBuf::from(v)),
                        "path" => return Err(err("path is empty".into())),
                        "size" => {
                            size = Some(parse_size(v).ok_or_else(|| {
                                err(format!("size {v:?} is not a size like 1G, 512M or 4096"))
                            })?)
                        }
                        "lba" => {
                            lba = match v {
                                "512" => 512,
                                "4096" => 4096,
                                _ => return Err(err(format!("lba {v:?} is not 512 or 4096"))),
                            }
                        }
                        "mode" => mode = parse_mode(v, &err)?,
                        "dbbuf" => {
                            dbbuf = match v {
                                "on" => true,
                                "off" => false,
                                _ => return Err(err(format!("dbbuf {v:?} is not on or off"))),
                            }
                        }
                        "vfs" => {
                            let max = crate::sriov::MAX_VFS;
                            vfs = match v.parse::<u16>() {
                                Ok(n) if (1..=max).contains(&n) => n,
                                Ok(_) => {
                                    return Err(err(format!(
                                        "vfs {v} is not in 1..={max} (leave vfs out for no \
                                         virtual functions)"
                                    )))
                                }
                                Err(_) => {
                                    return Err(err(format!(
                                        "vfs {v:?} is not a number of virtual functions \
                                         (1..={max})"
                                    )))
                                }
                            }
                        }
                        "cmb" => {
                            cmb = parse_size(v)
                                .filter(|&s| emulated::nvme::cmb::check_size(s).is_ok())
                                .ok_or_else(|| {
                                    err(format!("cmb {v:?} is not a power of two from 2M to 256M"))
                                })?;
                        }
                        "msix" => {
                            msix = Some(
                                v.parse::<u16>()
                                    .ok()
                                    .filter(|n| (1..=emulated::nvme::MAX_MSIX_VECTORS).contains(n))
                                    .ok_or_else(|| {
                                        err(format!(
                                            "msix {v:?} is not a number of MSI-X vectors \
                                             (1..={})",
                                            emulated::nvme::MAX_MSIX_VECTORS
                                        ))
                                    })?,
                            );
                        }
                        "queues" => {
                            let max = emulated::nvme::MAX_IO_QUEUES;
                            queues = Some(
                                v.parse::<u16>()
                                    .ok()
                                    .filter(|n| (1..=max).contains(n))
                                    .ok_or_else(|| {
                                        err(format!(
                                            "queues {v:?} is not a number of I/O queue pairs \
                                             (1..={max})"
                                        ))
                                    })?,
                            );
                        }
                        other => return Err(err(format!("unknown nvme option {other:?}"))),
                    }
                }
                let path = path.ok_or_else(|| err("nvme needs path=FILE".into()))?;
                if let Some(s) = size {
                    if s % u64::from(lba) != 0 {
                        return Err(err(format!(
                            "size {s:#x} is not a multiple of the {lba}-byte lba"
                        )));
                    }
                }
                if vfs > 0 {
                    if size.is_none() {
                        return Err(err(format!(
                            "vfs={vfs} needs size= (the size of each function's namespace; \
                             the file holds {} of them)",
                            u32::from(vfs) + 1
                        )));
                    }
                    let pf: crate::sriov::Bdf = id.parse().map_err(|e| err(format!("{e}")))?;
                    crate::sriov::nvme_vf_bdfs(&pf, vfs).map_err(|e| err(e.to_string()))?;
                }
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
                }
            }
            other => {
                return Err(err(format!(
                    "unknown device kind {other:?} (vfio, nvme, dmatest, epftest)"
                )))
            }
        };
        Ok(DeviceSpec {
            id: id.to_string(),
            kind,
        })
    }
}

impl DeviceSpec {
    /// The ids of the devices this spec lends: its own, then its virtual functions'.
    pub fn function_ids(&self) -> Vec<String> {
        let mut ids = vec![self.id.clone()];
        if let DeviceKind::Nvme { vfs, .. } = self.kind {
            if vfs > 0 {
                if let Ok(pf) = self.id.parse::<crate::sriov::Bdf>() {
                    if let Ok(v) = crate::sriov::nvme_vf_bdfs(&pf, vfs) {
                        ids.extend(v.iter().map(ToString::to_string));
                    }
                }
            }
        }
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        let s: DeviceSpec = "0000:81:00.0=vfio".parse().unwrap();
        assert_eq!(s.kind, DeviceKind::Vfio);
        let s: DeviceSpec = "0000:82:00.0=nvme:path=/var/lib/lendvm/disk0.img,size=1G"
            .parse()
            .unwrap();
        assert_eq!(
            s.kind,
            DeviceKind::Nvme {
                path: "/var/lib/lendvm/disk0.img".into(),
                size: Some(1 << 30),
                lba: 512,
                mode: NotifyMode::Interrupt,
                dbbuf: true,
                vfs: 0,
                cmb: 0,
                msix: None,
                queues: None,
            }
        );
        let s: DeviceSpec = "0000:82:00.0=nvme:path=d.img,size=64M,lba=4096,mode=polling"
            .parse()
            .unwrap();
        assert!(matches!(
            s.kind,
            DeviceKind::Nvme {
                lba: 4096,
                mode: NotifyMode::Polling,
                ..
            }
        ));
        let s: DeviceSpec = "0000:82:00.0=nvme:path=d.img,dbbuf=off".parse().unwrap();
        assert!(matches!(s.kind, DeviceKind::Nvme { dbbuf: false, .. }));
        let s: DeviceSpec = "0000:82:00.0=nvme:path=d.img,dbbuf=on".parse().unwrap();
        assert!(matches!(s.kind, DeviceKind::Nvme { dbbuf: true, .. }));
        let s: DeviceSpec = "0000:83:00.0=dmatest".parse().unwrap();
        assert_eq!(
            s.kind,
            DeviceKind::Dmatest {
                mode: NotifyMode::Interrupt,
                buf: emulated::dmatest::BUF_SIZE,
                rebar: None,
            }
        );
        let s: DeviceSpec = "0000:83:00.0=dmatest:buf=4194300K,rebar=256M"
            .parse()
            .unwrap();
        assert!(
            matches!(s.kind, DeviceKind::Dmatest { buf, rebar: Some(r), .. }
                if buf == (4 << 30) - 4096 && r == 256 << 20),
            "a resizable 4 GiB aperture that starts at 256 MiB"
        );
        for (bad, needle) in [
            (
                "buf=64M,rebar=1M",
                "rebar needs a BAR0 of a power of two from 1M",
            ),
            (
                "buf=60K,rebar=1M",
                "rebar needs a BAR0 of a power of two from 1M",
            ),
            (
                "buf=4194300K,rebar=8G",
                "the initial size must be a power of two from 1M",
            ),
            (
                "buf=4194300K,rebar=3M",
                "the initial size must be a power of two from 1M",
            ),
            (
                "buf=4194300K,rebar=512K",
                "the initial size must be a power of two from 1M",
            ),
            ("buf=4194300K,rebar=big", "rebar \"big\" is not a size"),
        ] {
            let e = format!("0000:83:00.0=dmatest:{bad}")
                .parse::<DeviceSpec>()
                .unwrap_err();
            assert!(e.to_string().contains(needle), "{bad}: {e}");
        }
        let s: DeviceSpec = "0000:83:00.0=dmatest:buf=64M".parse().unwrap();
        assert!(matches!(s.kind, DeviceKind::Dmatest { buf, .. } if buf == 64 << 20));
        let s: DeviceSpec = "0000:83:00.0=dmatest:buf=67108860K".parse().unwrap();
        assert!(
            matches!(s.kind, DeviceKind::Dmatest { buf, .. } if buf == (64 << 30) - 4096),
            "a GPU aperture's size"
        );
        for bad in ["buf=1000", "buf=129G", "buf=0"] {
            let e = format!("0000:83:00.0=dmatest:{bad}")
                .parse::<DeviceSpec>()
                .unwrap_err();
            assert!(e.to_string().contains("is not a multiple of 4K"), "{e}");
        }
    }

    #[test]
    fn epftest_takes_a_vector_count() {
        let s: DeviceSpec = "0000:85:00.0=epftest".parse().unwrap();
        assert_eq!(s.kind, DeviceKind::Epftest { vectors: 128 });
        let s: DeviceSpec = "0000:85:00.0=epftest:vectors=2048".parse().unwrap();
        assert_eq!(s.kind, DeviceKind::Epftest { vectors: 2048 });
        for bad in ["vectors=0", "vectors=2049", "vectors=lots"] {
            let e = format!("0000:85:00.0=epftest:{bad}")
                .parse::<DeviceSpec>()
                .unwrap_err();
            assert!(
                e.to_string().contains("is not a count from 1 to 2048"),
                "{e}"
            );
        }
        let e = "0000:85:00.0=epftest:buf=1M"
            .parse::<DeviceSpec>()
            .unwrap_err();
        assert!(
            e.to_string().contains("unknown epftest option \"buf\""),
            "{e}"
        );
    }

    #[test]
    fn errors_name_the_bad_part() {
        for (spec, needle) in [
            ("0000:81:00.0", "BDF=KIND"),
            ("81:00.0=vfio", "\"81:00.0\" is not a PCI address"),
            ("0000:81:00.9=vfio", "not a PCI address"),
            ("0000:81:00.0=gpu", "unknown device kind \"gpu\""),
            ("0000:81:00.0=nvme:size=1G", "needs path"),
            ("0000:81:00.0=nvme:path=x,size=1Q", "size \"1Q\""),
            ("0000:81:00.0=nvme:path=x,lba=1024", "lba \"1024\""),
            ("0000:81:00.0=nvme:path=x,mode=fast", "mode \"fast\""),
            (
                "0000:81:00.0=nvme:path=x,dbbuf=yes",
                "dbbuf \"yes\" is not on or off",
            ),
            (
                "0000:81:00.0=nvme:path=x,colour=red",
                "unknown nvme option \"colour\"",
            ),
            ("0000:81:00.0=nvme:path", "\"path\" is not key=value"),
            ("0000:81:00.0=vfio:x=1", "vfio takes no options"),
            (
                "0000:81:00.0=nvme:path=x,size=1000",
                "multiple of the 512-byte lba",
            ),
            (
                "0000:81:00.0=nvme:path=x,size=1M,vfs=0",
                "vfs 0 is not in 1..=32",
            ),
            (
                "0000:81:00.0=nvme:path=x,size=1M,vfs=33",
                "vfs 33 is not in 1..=32",
            ),
            (
                "0000:81:00.0=nvme:path=x,size=1M,vfs=two",
                "vfs \"two\" is not a number of virtual functions",
            ),
            (
                "0000:81:00.0=nvme:path=x,size=1M,vfs=-1",
                "vfs \"-1\" is not a number",
            ),
            ("0000:81:00.0=nvme:path=x,vfs=2", "vfs=2 needs size="),
            (
                "0000:ff:1f.7=nvme:path=x,size=1M,vfs=1",
                "0000:ff:1f.7: virtual function 1",
            ),
            ("0000:83:00.0=dmatest:vfs=2", "vfs=2: dmatest has no sr-iov"),
            (
                "0000:81:00.0=nvme:path=x,cmb=3M",
                "cmb \"3M\" is not a power of two from 2M to 256M",
            ),
            (
                "0000:81:00.0=nvme:path=x,cmb=1G",
                "cmb \"1G\" is not a power of two",
            ),
            (
                "0000:81:00.0=vfio:vfs=4",
                "vfs=4 is not a vfio option: enable the virtual functions on this host",
            ),
        ] {
            let e = spec.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(e.contains(needle), "{spec}: {e}");
        }
    }

    #[test]
    fn vfs_option_and_function_ids() {
        let s: DeviceSpec = "0000:82:00.0=nvme:path=d.img,size=4M,vfs=2"
            .parse()
            .unwrap();
        assert!(matches!(s.kind, DeviceKind::Nvme { vfs: 2, .. }));
        assert_eq!(
            s.function_ids(),
            ["0000:82:00.0", "0000:82:00.1", "0000:82:00.2"]
        );
        let s: DeviceSpec = "0000:82:00.0=nvme:path=d.img,cmb=4M".parse().unwrap();
        assert_eq!(s.function_ids(), ["0000:82:00.0"]);
        assert!(matches!(s.kind, DeviceKind::Nvme { cmb, .. } if cmb == 4 << 20));
        let s: DeviceSpec = "0000:82:00.0=nvme:path=d.img,msix=1".parse().unwrap();
        assert!(matches!(s.kind, DeviceKind::Nvme { msix: Some(1), .. }));
        for bad in ["0", "129", "x", ""] {
            let e = format!("0000:82:00.0=nvme:path=d.img,msix={bad}")
                .parse::<DeviceSpec>()
                .unwrap_err()
                .to_string();
            assert!(e.contains("MSI-X vectors (1..=128)"), "{bad}: {e}");
        }
        let s: DeviceSpec = "0000:82:00.0=nvme:path=d.img,msix=128,queues=80"
            .parse()
            .unwrap();
        assert!(matches!(
            s.kind,
            DeviceKind::Nvme {
                msix: Some(128),
                queues: Some(80),
                ..
            }
        ));
        for bad in ["0", "1025", "many", ""] {
            let e = format!("0000:82:00.0=nvme:path=d.img,queues={bad}")
                .parse::<DeviceSpec>()
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!(
                    "queues {bad:?} is not a number of I/O queue pairs (1..=1024)"
                )),
                "{bad}: {e}"
            );
        }
        // A VF's address is an ordinary BDF: lendable as vfio like any other.
        let s: DeviceSpec = "0000:03:10.2=vfio".parse().unwrap();
        assert_eq!(s.function_ids(), ["0000:03:10.2"]);
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("64K"), Some(65536));
        assert_eq!(parse_size("2T"), Some(2 << 40));
        assert_eq!(parse_size("0"), None);
        assert_eq!(parse_size("G"), None);
        assert_eq!(parse_size("99999999999T"), None);
    }
}
