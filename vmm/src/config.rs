//! VM configuration and the parsing of user-supplied values.

use std::path::PathBuf;

/// Errors in user-supplied configuration values.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("invalid size '{0}': expected a number with an optional K, M or G suffix (e.g. 512M)")]
    Size(String),
    #[error("invalid serial '{0}': expected stdout, off or file=PATH")]
    Serial(String),
    #[error("invalid CPU count {0}: must be between 1 and {max}", max = MAX_CPUS)]
    Cpus(u32),
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
    File(PathBuf),
    Off,
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
    pub cpus: u8,
    pub kernel: PathBuf,
    pub cmdline: String,
    pub initramfs: Option<PathBuf>,
    pub serial: SerialConfig,
    /// Append `noxsave clearcpuid=...` to a Linux kernel's command line when KVM ignores the
    /// VMM's CPUID masks (see `cmdline`).
    pub cpuid_cmdline: bool,
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
    fn serial_and_cpus() {
        assert_eq!("stdout".parse(), Ok(SerialConfig::Stdout));
        assert_eq!("off".parse(), Ok(SerialConfig::Off));
        assert_eq!(
            "file=/tmp/x".parse(),
            Ok(SerialConfig::File(PathBuf::from("/tmp/x")))
        );
        assert!("file=".parse::<SerialConfig>().is_err());
        assert!("tty".parse::<SerialConfig>().is_err());
        assert_eq!(check_cpus(0), Err(ConfigError::Cpus(0)));
        assert_eq!(check_cpus(2), Ok(2));
    }
}
