//! VM configuration and the parsing of user-supplied values.

use std::path::PathBuf;

/// Errors in user-supplied configuration values.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("invalid size '{0}': expected a number with an optional K, M or G suffix (e.g. 512M)")]
    Size(String),
    #[error(
        "invalid --pci-mmio64-size '{0}': expected auto, or a multiple of 2M, at least 2M (e.g. 256G)"
    )]
    Mmio64Size(String),
    #[error("invalid serial '{0}': expected stdout, off or file=PATH")]
    Serial(String),
    #[error("invalid CPU count {0}: must be between 1 and {max}", max = MAX_CPUS)]
    Cpus(u32),
    #[error(
        "invalid memory option '{0}': expected SIZE[,hugepages=on|off][,thp=on|off][,shared=PATH[,offset=N]] (e.g. 8G,hugepages=on)"
    )]
    MemoryOption(String),
    #[error("invalid memory options '{0}': {1}")]
    MemoryCombination(String, &'static str),
    #[error(
        "invalid --pci-slots '{0}': expected 1 to {max} (the root bus's slots for devices; slot 0 is the host bridge's)",
        max = pci::root::MAX_DEVICE_SLOTS
    )]
    PciSlots(String),
}

/// Guest RAM inside a shared region (`--memory SIZE,shared=PATH,offset=N`): the file behind a
/// `bar` fabric's window (an ivshmem BAR's memory, an NTB window's), so that a lender reaches
/// guest RAM at the same offsets through its BAR.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedRam {
    pub path: PathBuf,
    /// Where guest RAM starts in the file (4 KiB aligned).
    pub offset: u64,
}

/// How guest RAM is backed (`--memory SIZE,hugepages=on,thp=on`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RamBacking {
    /// A hugetlbfs memfd (`MFD_HUGETLB`): needs huge pages reserved (`vm.nr_hugepages`).
    pub hugepages: bool,
    /// Transparent huge pages: `MADV_HUGEPAGE` on the mapping (effective only where
    /// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` allows `advise`).
    pub thp: bool,
    /// Guest RAM in this file, not in a memfd of its own.
    pub shared: Option<SharedRam>,
}

/// `--memory`: a size and backing options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryConfig {
    pub size: u64,
    pub backing: RamBacking,
}

/// Parses `8G`, `8G,hugepages=on`, `1G,thp=on`.
pub fn parse_memory(s: &str) -> Result<MemoryConfig, ConfigError> {
    let mut parts = s.split(',');
    let size = parse_size(parts.next().unwrap_or_default())?;
    let mut backing = RamBacking::default();
    let mut offset = None;
    for opt in parts {
        let bad = || ConfigError::MemoryOption(opt.to_owned());
        let (key, value) = opt.split_once('=').ok_or_else(bad)?;
        let on = || match value {
            "on" => Ok(true),
            "off" => Ok(false),
            _ => Err(bad()),
        };
        match key {
            "hugepages" => backing.hugepages = on()?,
            "thp" => backing.thp = on()?,
            "shared" if value.starts_with('/') => {
                backing.shared = Some(SharedRam {
                    path: PathBuf::from(value),
                    offset: 0,
                })
            }
            "offset" => offset = Some(parse_size(value).map_err(|_| bad())?),
            _ => return Err(bad()),
        }
    }
    match (&mut backing.shared, offset) {
        (Some(s), Some(o)) => s.offset = o,
        (None, Some(_)) => {
            return Err(ConfigError::MemoryCombination(
                s.to_owned(),
                "offset= needs shared=PATH",
            ))
        }
        _ => {}
    }
    if backing.shared.is_some() && backing.hugepages {
        return Err(ConfigError::MemoryCombination(
            s.to_owned(),
            "shared= and hugepages=on exclude each other (the shared file is the backing)",
        ));
    }
    Ok(MemoryConfig { size, backing })
}

/// Most vCPUs a VM may have (APIC ids fit one byte).
pub const MAX_CPUS: u32 = 254;

/// Parses `512M`, `1G`, `65536K`, `1GiB` or a plain byte count.
pub fn parse_size(s: &str) -> Result<u64, ConfigError> {
    let err = || ConfigError::Size(s.to_owned());
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(err()),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: u64 = num.parse().map_err(|_| err())?;
    n.checked_mul(1u64 << shift).ok_or_else(err)
}

/// Where the guest's COM1 output goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SerialConfig {
    Stdout,
    /// A file, created afresh (truncated).
    File(PathBuf),
    /// A file appended to: a migrated VM's console goes on in the file its source wrote,
    /// whose content stays (never parsed from the command line).
    Append(PathBuf),
    Off,
}

impl SerialConfig {
    /// Where a migrated VM's console goes: the destination's explicit `--serial` if it gave
    /// one, else the source's configuration (a file appended to, not truncated), else
    /// stdout.
    pub fn for_migrated(explicit: Option<&SerialConfig>, source: Option<&SerialConfig>) -> Self {
        match (explicit, source) {
            (Some(e), _) => e.clone(),
            (None, Some(SerialConfig::File(p) | SerialConfig::Append(p))) => {
                SerialConfig::Append(p.clone())
            }
            (None, Some(s)) => s.clone(),
            (None, None) => SerialConfig::Stdout,
        }
    }
}

/// The form `--serial` takes (a file appended to reads as `file=`).
impl std::fmt::Display for SerialConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SerialConfig::Stdout => write!(f, "stdout"),
            SerialConfig::File(p) | SerialConfig::Append(p) => write!(f, "file={}", p.display()),
            SerialConfig::Off => write!(f, "off"),
        }
    }
}

impl std::str::FromStr for SerialConfig {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "stdout" => Ok(SerialConfig::Stdout),
            "off" => Ok(SerialConfig::Off),
            _ => match s.strip_prefix("file=") {
                Some(p) if !p.is_empty() => Ok(SerialConfig::File(PathBuf::from(p))),
                _ => Err(ConfigError::Serial(s.to_owned())),
            },
        }
    }
}

/// Everything needed to build and boot a VM.
#[derive(Clone, Debug)]
pub struct VmConfig {
    pub memory_size: u64,
    /// Hugetlbfs / THP backing of guest RAM.
    pub ram_backing: RamBacking,
    pub cpus: u8,
    pub kernel: PathBuf,
    pub cmdline: String,
    pub initramfs: Option<PathBuf>,
    pub serial: SerialConfig,
    /// Append `noxsave clearcpuid=...` to a Linux kernel's command line when KVM ignores the
    /// VMM's CPUID masks (see `cmdline`).
    pub cpuid_cmdline: bool,
    /// The CPUID the guest sees (`--cpu-model`).
    pub cpu_model: crate::cpuid::CpuModel,
    /// Size of the 64-bit PCI BAR window after RAM (`--pci-mmio64-size`; every 64-bit BAR
    /// of every device, at launch and hot-added, must fit in it). `None`: as large as the
    /// guest can address, up to [`MMIO64_AUTO_MAX`] (resolved when the VM is built).
    pub pci_mmio64_size: Option<u64>,
    /// Guest NUMA nodes (`--numa`); empty: one node, no SRAT.
    pub numa: Vec<crate::numa::NumaNodeConfig>,
    /// Slots of the root bus that take devices, at launch and hot-added: 1..=`pci_slots`
    /// (`--pci-slots`, 1 to [`pci::root::MAX_DEVICE_SLOTS`]). The guest's ACPI tables describe
    /// only these, and a guest kernel interprets each at boot.
    pub pci_slots: u8,
    /// A switch per lender with two or more launch devices on one root bus
    /// (`device_manager::plan_switches`); a restored or migrated VM keeps its own.
    pub switches: Vec<crate::device_manager::LenderSwitch>,
}

/// Checks a `--pci-slots`: 1 to 31 (slot 0 of the root bus is the host bridge's).
pub fn check_pci_slots(s: &str) -> Result<u8, ConfigError> {
    let max = pci::root::MAX_DEVICE_SLOTS;
    s.trim()
        .parse::<u8>()
        .ok()
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| ConfigError::PciSlots(s.to_owned()))
}

/// The most `--pci-mmio64-size auto` takes: room for eight 128 GiB apertures, far below the
/// 64 TiB a guest kernel with 4-level paging maps.
pub const MMIO64_AUTO_MAX: u64 = 1 << 40;

/// Checks a `--pci-mmio64-size`: `auto` (`None`), or a multiple of 2 MiB, at least 2 MiB
/// (the guest's own limit, its physical address width, is checked when the VM is built).
pub fn check_mmio64_size(s: &str) -> Result<Option<u64>, ConfigError> {
    if s.trim() == "auto" {
        return Ok(None);
    }
    let size = parse_size(s)?;
    if size < (2 << 20) || !size.is_multiple_of(2 << 20) {
        return Err(ConfigError::Mmio64Size(s.to_owned()));
    }
    Ok(Some(size))
}

/// Validates a CPU count.
pub fn check_cpus(n: u32) -> Result<u8, ConfigError> {
    if n == 0 || n > MAX_CPUS {
        return Err(ConfigError::Cpus(n));
    }
    Ok(n as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_slots() {
        assert_eq!(check_pci_slots("4"), Ok(4));
        assert_eq!(check_pci_slots(" 31 "), Ok(31));
        assert_eq!(check_pci_slots("1"), Ok(1));
        for bad in ["0", "32", "-1", "many", ""] {
            let err = check_pci_slots(bad).unwrap_err().to_string();
            assert!(
                err.contains("--pci-slots") && err.contains("1 to 31"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn mmio64_sizes() {
        assert_eq!(check_mmio64_size("64G"), Ok(Some(64 << 30)));
        assert_eq!(check_mmio64_size("2M"), Ok(Some(2 << 20)));
        assert_eq!(check_mmio64_size("1T"), Ok(Some(1 << 40)));
        assert_eq!(check_mmio64_size("auto"), Ok(None));
        for bad in ["1M", "3M", "0", "4097K"] {
            assert_eq!(
                check_mmio64_size(bad),
                Err(ConfigError::Mmio64Size(bad.into())),
                "{bad}"
            );
        }
        assert_eq!(check_mmio64_size("x"), Err(ConfigError::Size("x".into())));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size("4096"), Ok(4096));
        for bad in [
            "",
            "M",
            "12X",
            "lots",
            "-1M",
            "99999999999999999999G",
            "1.5G",
        ] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn memory_options() {
        assert_eq!(
            parse_memory("8G"),
            Ok(MemoryConfig {
                size: 8 << 30,
                backing: RamBacking::default()
            })
        );
        let m = parse_memory("8G,hugepages=on").unwrap();
        assert!(m.backing.hugepages && !m.backing.thp);
        let m = parse_memory("1G,thp=on,hugepages=off").unwrap();
        assert!(!m.backing.hugepages && m.backing.thp);
        assert_eq!(parse_memory("x,thp=on"), Err(ConfigError::Size("x".into())));
        let m = parse_memory("128M,shared=/dev/shm/l1,offset=1M").unwrap();
        assert_eq!(
            m.backing.shared,
            Some(SharedRam {
                path: "/dev/shm/l1".into(),
                offset: 1 << 20
            })
        );
        for (bad, why) in [
            ("1G,offset=1M", "needs shared"),
            ("1G,shared=/x,hugepages=on", "exclude"),
        ] {
            let e = parse_memory(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
        for bad in [
            "1G,hugepages",
            "1G,hugepages=yes",
            "1G,numa=on",
            "1G,",
            "1G,shared=relative",
            "1G,shared=/x,offset=z",
        ] {
            let e = parse_memory(bad).unwrap_err();
            assert!(matches!(e, ConfigError::MemoryOption(_)), "{bad}: {e}");
        }
        assert!(parse_memory("1G,hugepages=yes")
            .unwrap_err()
            .to_string()
            .contains("'hugepages=yes'"));
    }

    #[test]
    fn serial_and_cpus() {
        assert_eq!("stdout".parse(), Ok(SerialConfig::Stdout));
        assert_eq!("off".parse(), Ok(SerialConfig::Off));
        assert_eq!(
            "file=/tmp/x".parse(),
            Ok(SerialConfig::File(PathBuf::from("/tmp/x")))
        );
        assert!("file=".parse::<SerialConfig>().is_err());
        assert!("tty".parse::<SerialConfig>().is_err());
        for s in ["stdout", "off", "file=/tmp/x"] {
            assert_eq!(s.parse::<SerialConfig>().unwrap().to_string(), s);
        }
        // A migrated VM: the destination's own --serial wins; else the source's, a file
        // appended to.
        let file = SerialConfig::File(PathBuf::from("/tmp/x"));
        let append = SerialConfig::Append(PathBuf::from("/tmp/x"));
        assert_eq!(
            SerialConfig::for_migrated(None, Some(&file)),
            append.clone()
        );
        assert_eq!(
            SerialConfig::for_migrated(Some(&SerialConfig::Stdout), Some(&file)),
            SerialConfig::Stdout
        );
        assert_eq!(
            SerialConfig::for_migrated(None, Some(&SerialConfig::Off)),
            SerialConfig::Off
        );
        assert_eq!(SerialConfig::for_migrated(None, None), SerialConfig::Stdout);
        assert_eq!(append.to_string(), "file=/tmp/x");
        assert_eq!(check_cpus(0), Err(ConfigError::Cpus(0)));
        assert_eq!(check_cpus(2), Ok(2));
    }
}
