//! Kernel command-line augmentation for Linux guests on a KVM that ignores CPUID masking.
//!
//! This host's PVM replaces leaf 1 ECX/EDX and leaf 7 after `KVM_SET_CPUID2`
//! (`docs/ARCHITECTURE-guest.md`), so a Linux guest still sees features whose instructions
//! KVM's emulator cannot run (xsave, smap/clac, popcnt, rdrand, ...). When the kernel is Linux
//! and the read-back CPUID (`KVM_GET_CPUID2`) still shows bits the VMM masked, the VMM appends
//! the equivalent `noxsave clearcpuid=...` options ([`augment`]) and logs them at `info`;
//! `lendvm --no-cpuid-cmdline` turns this off.
//!
//! Linux detection ([`is_linux_kernel`]): a bzImage (boot-protocol magic `HdrS` at 0x202) is
//! Linux; an ELF is Linux when it contains the `linux_banner` text `Linux version `. The
//! project's bare-metal test guest is neither, so its command line is never touched.
//!
//! Options the user already gave win: no `clearcpuid=` is added when the command line has
//! one, and `noxsave` is added only once. Linux 6.x copies `clearcpuid=`'s value into a
//! 128-byte buffer, so the list is cut at [`CLEARCPUID_MAX`] bytes, most important first.

use std::io::Read;
use std::path::Path;

/// Longest `clearcpuid=` value Linux reads (its buffer is 128 bytes with the NUL).
pub const CLEARCPUID_MAX: usize = 127;

/// (VMM name in `cpuid::MASKED` or `cpuid::QEMU64_CLEARED`, Linux flag name), in priority
/// order. Features that
/// `noxsave` already removes (xsave, osxsave, avx*, fma, f16c, amx*) are not listed.
const LINUX_FLAGS: &[(&str, &str)] = &[
    ("smap", "smap"),
    ("smep", "smep"),
    ("pcid", "pcid"),
    ("invpcid", "invpcid"),
    ("popcnt", "popcnt"),
    ("rdrand", "rdrand"),
    ("rdseed", "rdseed"),
    ("fsgsbase", "fsgsbase"),
    ("pku", "pku"),
    ("ospke", "ospke"),
    ("waitpkg", "waitpkg"),
    ("la57", "la57"),
    ("movdiri", "movdiri"),
    ("movdir64b", "movdir64b"),
    ("cldemote", "cldemote"),
    ("serialize", "serialize"),
    // Cleared by `--cpu-model qemu64` only (`cpuid::QEMU64_CLEARED`): what changes the
    // kernel's own code paths (string copies, the timer, getcpu) comes first.
    ("erms", "erms"),
    ("fsrm", "fsrm"),
    // X86_FEATURE_TSC_DEADLINE_TIMER by number (word 4, bit 24): Linux 6.1 takes numbers
    // too, and the name alone would use 18 of the 127 bytes. Masked for both models
    // (`cpuid::MASKED`), not only qemu64.
    ("tsc_deadline_timer", "152"),
    ("rdpid", "rdpid"),
    ("clflushopt", "clflushopt"),
    ("umip", "umip"),
    ("movbe", "movbe"),
    ("bmi1", "bmi1"),
    ("bmi2", "bmi2"),
    ("adx", "adx"),
    ("sha", "sha_ni"),
    ("aes", "aes"),
    ("pclmulqdq", "pclmulqdq"),
    ("sse4.2", "sse4_2"),
    ("sse4.1", "sse4_1"),
    ("ssse3", "ssse3"),
    ("sse3", "pni"),
    ("monitor", "monitor"),
    ("gfni", "gfni"),
    ("vaes", "vaes"),
    ("vpclmulqdq", "vpclmulqdq"),
    ("clwb", "clwb"),
    ("hle", "hle"),
    ("rtm", "rtm"),
    ("vmx", "vmx"),
];

/// Masked names that `noxsave` takes care of.
const XSAVE_FEATURES: &[&str] = &["xsave", "osxsave"];

/// Whether the kernel at `path` is Linux (bzImage, or an ELF with the Linux banner).
pub fn is_linux_kernel(path: &Path) -> bool {
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let mut head = [0u8; 0x208];
    if f.read_exact(&mut head).is_ok() && &head[0x202..0x206] == b"HdrS" {
        return true;
    }
    if head.get(..4) != Some(b"\x7fELF".as_slice()) {
        return false;
    }
    contains(path, b"Linux version ")
}

/// Whether the file at `path` contains `needle` (streamed, 1 MiB at a time).
fn contains(path: &Path, needle: &[u8]) -> bool {
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let mut buf = vec![0u8; 1 << 20];
    let mut carry: Vec<u8> = Vec::new();
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) | Err(_) => return false,
            Ok(n) => n,
        };
        carry.extend_from_slice(&buf[..n]);
        if carry.windows(needle.len()).any(|w| w == needle) {
            return true;
        }
        let keep = needle.len().saturating_sub(1).min(carry.len());
        carry.drain(..carry.len() - keep);
    }
}

fn has_option(cmdline: &str, name: &str) -> bool {
    cmdline
        .split_whitespace()
        .any(|w| w == name || w.starts_with(&format!("{name}=")))
}

/// The options to append for `visible` (masked features the guest still sees).
pub fn cpuid_options(cmdline: &str, visible: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    if visible.iter().any(|v| XSAVE_FEATURES.contains(v)) && !has_option(cmdline, "noxsave") {
        out.push("noxsave".to_string());
    }
    if !has_option(cmdline, "clearcpuid") {
        let mut list = String::new();
        for (ours, linux) in LINUX_FLAGS {
            if !visible.contains(ours) {
                continue;
            }
            let extra = linux.len() + usize::from(!list.is_empty());
            if list.len() + extra > CLEARCPUID_MAX {
                log::debug!("clearcpuid: no room for {linux}");
                continue;
            }
            if !list.is_empty() {
                list.push(',');
            }
            list.push_str(linux);
        }
        if !list.is_empty() {
            out.push(format!("clearcpuid={list}"));
        }
    }
    out
}

/// `cmdline` with the options for `visible` appended, or `None` when nothing is needed.
pub fn augment(cmdline: &str, visible: &[&str]) -> Option<String> {
    let opts = cpuid_options(cmdline, visible);
    if opts.is_empty() {
        return None;
    }
    let mut s = cmdline.trim_end().to_string();
    for o in opts {
        if !s.is_empty() {
            s.push(' ');
        }
        s.push_str(&o);
    }
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_noxsave_and_clearcpuid_in_priority_order() {
        let visible = [
            "rdrand", "xsave", "osxsave", "avx", "popcnt", "smap", "smep", "sse3", "sha",
        ];
        assert_eq!(
            augment("console=ttyS0", &visible).unwrap(),
            "console=ttyS0 noxsave clearcpuid=smap,smep,popcnt,rdrand,sha_ni,pni"
        );
        assert_eq!(
            augment("", &["avx"]),
            None,
            "avx is handled by noxsave only"
        );
        assert_eq!(augment("x", &[]), None);
        assert_eq!(augment("", &["xsave"]).unwrap(), "noxsave");
    }

    #[test]
    fn user_options_win() {
        assert_eq!(
            augment("noxsave clearcpuid=smap", &["xsave", "smep"]),
            None,
            "both already given"
        );
        assert_eq!(
            augment("clearcpuid=smap", &["xsave", "smep"]).unwrap(),
            "clearcpuid=smap noxsave"
        );
    }

    #[test]
    fn clearcpuid_fits_linux_buffer() {
        let all: Vec<&str> = LINUX_FLAGS.iter().map(|f| f.0).collect();
        let opts = cpuid_options("", &all);
        let v = opts[0].strip_prefix("clearcpuid=").unwrap();
        assert!(v.len() <= CLEARCPUID_MAX, "{} bytes", v.len());
        assert!(v.starts_with("smap,smep,pcid,invpcid,popcnt,rdrand,rdseed,fsgsbase"));
    }

    #[test]
    fn qemu64_features_reach_clearcpuid() {
        // Every feature the qemu64 model clears has a Linux name here.
        for (_, _, _, _, name) in crate::cpuid::QEMU64_CLEARED {
            assert!(
                LINUX_FLAGS.iter().any(|(ours, _)| ours == name),
                "{name} has no Linux flag"
            );
        }
        // What this PVM host kept visible under --cpu-model qemu64 (the host model's list and
        // qemu64's own): everything a kernel path depends on fits in the 127 bytes.
        let visible = [
            "smap",
            "smep",
            "popcnt",
            "rdrand",
            "rdseed",
            "fsgsbase",
            "movdiri",
            "movdir64b",
            "cldemote",
            "serialize",
            "erms",
            "fsrm",
            "tsc_deadline_timer",
            "rdpid",
            "clflushopt",
            "umip",
            "movbe",
            "xsave",
        ];
        assert_eq!(
            augment("", &visible).unwrap(),
            "noxsave clearcpuid=smap,smep,popcnt,rdrand,rdseed,fsgsbase,movdiri,movdir64b,\
             cldemote,serialize,erms,fsrm,152,rdpid,clflushopt,umip,movbe"
        );
    }

    #[test]
    fn detects_linux_images() {
        let dir = tempfile::tempdir().unwrap();
        let mut bz = vec![0u8; 0x400];
        bz[0x202..0x206].copy_from_slice(b"HdrS");
        std::fs::write(dir.path().join("bz"), &bz).unwrap();
        assert!(is_linux_kernel(&dir.path().join("bz")));
        let mut elf = b"\x7fELF".to_vec();
        elf.resize(3 << 20, 0);
        // Straddle the 1 MiB read boundary.
        let at = (1 << 20) - 5;
        elf[at..at + 14].copy_from_slice(b"Linux version ");
        std::fs::write(dir.path().join("vmlinux"), &elf).unwrap();
        assert!(is_linux_kernel(&dir.path().join("vmlinux")));
        let mut guest = b"\x7fELF".to_vec();
        guest.resize(0x1000, 0);
        std::fs::write(dir.path().join("guest"), &guest).unwrap();
        assert!(!is_linux_kernel(&dir.path().join("guest")));
        assert!(!is_linux_kernel(&dir.path().join("missing")));
    }
}
