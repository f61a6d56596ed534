//! Guest CPUID: KVM's supported set, filtered for what this host's KVM can run.
//!
//! On this host (`kvm_pvm`, see `docs/DEVELOPING.md`) a non-PVM guest runs inside KVM's
//! instruction emulator. An instruction the emulator cannot decode stops the guest with
//! `KVM_EXIT_INTERNAL_ERROR`; one it decodes as a *different* instruction (e.g. `lzcnt`, which
//! without the F3 prefix is `bsr`) silently computes the wrong result. Guests, Linux included,
//! select code paths from CPUID, so every feature whose instructions the emulator lacks is
//! hidden here. Each masked bit is listed in [`MASKED`] with its reason;
//! `docs/ARCHITECTURE-guest.md` ("Guest CPUID") summarises the table.
//!
//! Measured on this host: PVM replaces leaf 1 ECX/EDX and leaf 7 with its own values after
//! `KVM_SET_CPUID2` and re-adds leaf 0xD, so those masks do not reach the guest (the VMM logs
//! which at `info`); leaf 0x8000_0001, topology and the removed leaves do. Linux guests must
//! therefore also get `clearcpuid=...`/`noxsave` on the command line. The table is still applied
//! so that a KVM that honours it (a normal host) gets a consistent guest.

use kvm_bindings::{kvm_cpuid_entry2, CpuId, KVM_CPUID_FLAG_SIGNIFCANT_INDEX};

/// A CPUID register of a leaf.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reg {
    Eax,
    Ebx,
    Ecx,
    Edx,
}

/// One feature bit the VMM hides from the guest.
#[derive(Clone, Copy, Debug)]
pub struct MaskedBit {
    pub leaf: u32,
    /// `None`: every subleaf.
    pub subleaf: Option<u32>,
    pub reg: Reg,
    pub bit: u32,
    pub name: &'static str,
    pub why: &'static str,
}

const fn m(
    leaf: u32,
    subleaf: Option<u32>,
    reg: Reg,
    bit: u32,
    name: &'static str,
    why: &'static str,
) -> MaskedBit {
    MaskedBit {
        leaf,
        subleaf,
        reg,
        bit,
        name,
        why,
    }
}

const VEC: &str = "vector instruction: the emulator decodes no SSE3+/AVX/VEX encodings";
const NOEMU: &str = "instruction not implemented by KVM's emulator (internal error)";

/// Every feature bit masked from the guest, with the reason.
pub const MASKED: &[MaskedBit] = &[
    // Leaf 1 ECX.
    m(1, None, Reg::Ecx, 0, "sse3", VEC),
    m(1, None, Reg::Ecx, 1, "pclmulqdq", VEC),
    m(
        1,
        None,
        Reg::Ecx,
        3,
        "monitor",
        "monitor/mwait idle is not emulated; guests must use hlt",
    ),
    m(1, None, Reg::Ecx, 5, "vmx", "no nested virtualization"),
    m(1, None, Reg::Ecx, 9, "ssse3", VEC),
    m(1, None, Reg::Ecx, 12, "fma", VEC),
    m(
        1,
        None,
        Reg::Ecx,
        17,
        "pcid",
        "setting CR4.PCID through KVM_SET_SREGS fails on PVM",
    ),
    m(1, None, Reg::Ecx, 19, "sse4.1", VEC),
    m(
        1,
        None,
        Reg::Ecx,
        20,
        "sse4.2",
        "crc32/pcmpxstri are not emulated (Linux crc32c-intel)",
    ),
    m(
        1,
        None,
        Reg::Ecx,
        23,
        "popcnt",
        "popcnt is not emulated (seen stopping Linux)",
    ),
    m(1, None, Reg::Ecx, 25, "aes", VEC),
    m(
        1,
        None,
        Reg::Ecx,
        26,
        "xsave",
        "xsave/xrstor are not emulated (Linux fpu init stops)",
    ),
    m(1, None, Reg::Ecx, 27, "osxsave", "follows xsave"),
    m(1, None, Reg::Ecx, 28, "avx", VEC),
    m(1, None, Reg::Ecx, 29, "f16c", VEC),
    m(
        1,
        None,
        Reg::Ecx,
        30,
        "rdrand",
        "rdrand is not emulated (Linux KASLR/random stop)",
    ),
    // Leaf 7.0 EBX.
    m(
        7,
        Some(0),
        Reg::Ebx,
        0,
        "fsgsbase",
        "rd/wr{fs,gs}base are not emulated",
    ),
    m(7, Some(0), Reg::Ebx, 2, "sgx", "no SGX"),
    m(
        7,
        Some(0),
        Reg::Ebx,
        3,
        "bmi1",
        "VEX-encoded andn/bextr/blsi are not emulated; tzcnt decodes as bsf",
    ),
    m(
        7,
        Some(0),
        Reg::Ebx,
        4,
        "hle",
        "transactional memory is not emulated",
    ),
    m(7, Some(0), Reg::Ebx, 5, "avx2", VEC),
    m(
        7,
        Some(0),
        Reg::Ebx,
        7,
        "smep",
        "masked like smap: PVM's emulated mode, keep paging simple",
    ),
    m(
        7,
        Some(0),
        Reg::Ebx,
        8,
        "bmi2",
        "VEX-encoded shlx/pdep/... are not emulated",
    ),
    m(
        7,
        Some(0),
        Reg::Ebx,
        10,
        "invpcid",
        "invpcid is not emulated and PCID is off",
    ),
    m(
        7,
        Some(0),
        Reg::Ebx,
        11,
        "rtm",
        "transactional memory is not emulated",
    ),
    m(
        7,
        Some(0),
        Reg::Ebx,
        14,
        "mpx",
        "bound registers need xsave",
    ),
    m(7, Some(0), Reg::Ebx, 16, "avx512f", VEC),
    m(7, Some(0), Reg::Ebx, 17, "avx512dq", VEC),
    m(7, Some(0), Reg::Ebx, 18, "rdseed", "rdseed is not emulated"),
    m(
        7,
        Some(0),
        Reg::Ebx,
        19,
        "adx",
        "adcx/adox are not emulated",
    ),
    m(
        7,
        Some(0),
        Reg::Ebx,
        20,
        "smap",
        "clac/stac are not emulated (Linux stops on clac)",
    ),
    m(7, Some(0), Reg::Ebx, 21, "avx512ifma", VEC),
    m(7, Some(0), Reg::Ebx, 24, "clwb", NOEMU),
    m(7, Some(0), Reg::Ebx, 26, "avx512pf", VEC),
    m(7, Some(0), Reg::Ebx, 27, "avx512er", VEC),
    m(7, Some(0), Reg::Ebx, 28, "avx512cd", VEC),
    m(7, Some(0), Reg::Ebx, 29, "sha", VEC),
    m(7, Some(0), Reg::Ebx, 30, "avx512bw", VEC),
    m(7, Some(0), Reg::Ebx, 31, "avx512vl", VEC),
    // Leaf 7.0 ECX.
    m(7, Some(0), Reg::Ecx, 1, "avx512vbmi", VEC),
    m(
        7,
        Some(0),
        Reg::Ecx,
        3,
        "pku",
        "protection keys need xsave and rdpkru/wrpkru emulation",
    ),
    m(7, Some(0), Reg::Ecx, 4, "ospke", "follows pku"),
    m(
        7,
        Some(0),
        Reg::Ecx,
        5,
        "waitpkg",
        "umonitor/umwait/tpause are not emulated",
    ),
    m(7, Some(0), Reg::Ecx, 6, "avx512vbmi2", VEC),
    m(
        7,
        Some(0),
        Reg::Ecx,
        7,
        "cet_ss",
        "shadow stacks need xsave",
    ),
    m(7, Some(0), Reg::Ecx, 8, "gfni", VEC),
    m(7, Some(0), Reg::Ecx, 9, "vaes", VEC),
    m(7, Some(0), Reg::Ecx, 10, "vpclmulqdq", VEC),
    m(7, Some(0), Reg::Ecx, 11, "avx512vnni", VEC),
    m(7, Some(0), Reg::Ecx, 12, "avx512bitalg", VEC),
    m(7, Some(0), Reg::Ecx, 14, "avx512vpopcntdq", VEC),
    m(
        7,
        Some(0),
        Reg::Ecx,
        16,
        "la57",
        "5-level paging: keep the guest on 4-level tables",
    ),
    m(7, Some(0), Reg::Ecx, 25, "cldemote", NOEMU),
    m(7, Some(0), Reg::Ecx, 27, "movdiri", NOEMU),
    m(7, Some(0), Reg::Ecx, 28, "movdir64b", NOEMU),
    // Leaf 7.0 EDX.
    m(7, Some(0), Reg::Edx, 2, "avx512_4vnniw", VEC),
    m(7, Some(0), Reg::Edx, 3, "avx512_4fmaps", VEC),
    m(7, Some(0), Reg::Edx, 8, "avx512_vp2intersect", VEC),
    m(7, Some(0), Reg::Edx, 14, "serialize", NOEMU),
    m(
        7,
        Some(0),
        Reg::Edx,
        20,
        "cet_ibt",
        "endbr64 tracking needs xsave-managed state",
    ),
    m(7, Some(0), Reg::Edx, 22, "amx_bf16", VEC),
    m(7, Some(0), Reg::Edx, 23, "avx512_fp16", VEC),
    m(7, Some(0), Reg::Edx, 24, "amx_tile", VEC),
    m(7, Some(0), Reg::Edx, 25, "amx_int8", VEC),
    // Leaf 7.1 EAX.
    m(7, Some(1), Reg::Eax, 4, "avx_vnni", VEC),
    m(7, Some(1), Reg::Eax, 5, "avx512_bf16", VEC),
    // Leaf 0x8000_0001.
    m(
        0x8000_0001,
        None,
        Reg::Ecx,
        5,
        "abm/lzcnt",
        "lzcnt decodes as bsr in the emulator (wrong result)",
    ),
    m(0x8000_0001, None, Reg::Ecx, 6, "sse4a", VEC),
    m(0x8000_0001, None, Reg::Ecx, 11, "xop", VEC),
    m(0x8000_0001, None, Reg::Ecx, 16, "fma4", VEC),
    m(0x8000_0001, None, Reg::Ecx, 21, "tbm", VEC),
    // Leaf 0x4000_0001 EAX: KVM's paravirtual features. Those that work by `vmcall` are
    // masked: on this PVM host a `vmcall` of a guest in KVM's instruction emulator never
    // completes (the vCPU stays on the instruction). An SMP Linux sends its IPIs by
    // KVM_HC_SEND_IPI when offered, so it hung at AP bring-up ("x86: Booting SMP
    // configuration:"), the AP in `vmcall` and the BSP spinning on a lock it held.
    // Without these the guest uses the local APIC's ICR, which KVM emulates in the kernel.
    m(
        KVM_CPUID_FEATURES,
        None,
        Reg::Eax,
        7,
        "kvm-pv-unhalt",
        "kicks halted vCPUs with vmcall KVM_HC_KICK_CPU, which never completes in PVM's emulator",
    ),
    m(
        KVM_CPUID_FEATURES,
        None,
        Reg::Eax,
        11,
        "kvm-pv-ipi",
        "sends IPIs with vmcall KVM_HC_SEND_IPI, which never completes in PVM's emulator \
         (an SMP guest hangs at AP bring-up)",
    ),
    m(
        KVM_CPUID_FEATURES,
        None,
        Reg::Eax,
        13,
        "kvm-pv-sched-yield",
        "yields with vmcall KVM_HC_SCHED_YIELD, which never completes in PVM's emulator",
    ),
    m(
        KVM_CPUID_FEATURES,
        None,
        Reg::Eax,
        16,
        "kvm-hc-map-gpa-range",
        "vmcall KVM_HC_MAP_GPA_RANGE, which never completes in PVM's emulator",
    ),
];

/// KVM's paravirtual feature leaf (`KVM_CPUID_FEATURES`).
pub const KVM_CPUID_FEATURES: u32 = 0x4000_0001;

/// Leaves removed entirely.
pub const REMOVED_LEAVES: &[(u32, &str)] = &[
    (
        0xa,
        "architectural PMU: no performance counters for an emulated guest",
    ),
    (0xd, "XSAVE state components: xsave is masked"),
    (0x12, "SGX"),
    (0x14, "processor trace"),
    (0x19, "key locker"),
    (0x1d, "AMX tile info"),
    (0x1e, "AMX TMUL info"),
];

/// Leaf 1 ECX: the guest runs under a hypervisor.
pub const HYPERVISOR_BIT: u32 = 31;

fn reg_mut(e: &mut kvm_cpuid_entry2, reg: Reg) -> &mut u32 {
    match reg {
        Reg::Eax => &mut e.eax,
        Reg::Ebx => &mut e.ebx,
        Reg::Ecx => &mut e.ecx,
        Reg::Edx => &mut e.edx,
    }
}

/// Filters KVM's supported CPUID for vCPU `cpu_id` of `cpu_count` (pure; unit-tested).
pub fn filter_entries(
    entries: &[kvm_cpuid_entry2],
    cpu_id: u8,
    cpu_count: u8,
) -> Vec<kvm_cpuid_entry2> {
    let mut out: Vec<kvm_cpuid_entry2> = entries
        .iter()
        .filter(|e| !REMOVED_LEAVES.iter().any(|(l, _)| *l == e.function))
        // Topology is rebuilt below.
        .filter(|e| e.function != 0xb && e.function != 0x1f)
        .copied()
        .collect();
    let cpus = u32::from(cpu_count.max(1));
    let core_bits = 32 - (cpus - 1).leading_zeros(); // ceil(log2(cpus))
    for e in out.iter_mut() {
        for bit in MASKED {
            if bit.leaf == e.function && bit.subleaf.is_none_or(|s| s == e.index) {
                *reg_mut(e, bit.reg) &= !(1u32 << bit.bit);
            }
        }
        match e.function {
            1 => {
                e.ecx |= 1 << HYPERVISOR_BIT;
                // EBX: [31:24] initial APIC id, [23:16] logical processors, [15:8] CLFLUSH
                // line size in quadwords.
                e.ebx = (u32::from(cpu_id) << 24) | (cpus << 16) | (8 << 8);
                if cpus > 1 {
                    e.edx |= 1 << 28; // HTT: EBX[23:16] is valid
                } else {
                    e.edx &= !(1 << 28);
                }
            }
            4 => {
                // Deterministic cache parameters: [31:26] cores per package - 1, [25:14]
                // logical processors sharing this cache - 1 (only the LLC is shared).
                let level = (e.eax >> 5) & 0x7;
                let sharing = if level >= 3 { cpus - 1 } else { 0 };
                e.eax = (e.eax & 0x3fff) | ((cpus - 1) << 26) | (sharing << 14);
            }
            6 => {
                // Thermal/power: no turbo/HWP/energy-bias MSRs are emulated.
                e.eax = 0;
                e.ecx &= !(1 << 3);
            }
            _ => {}
        }
    }
    // Extended topology (leaf 0xB): one thread per core, `cpus` cores in one package.
    let max_basic = out
        .iter()
        .find(|e| e.function == 0)
        .map(|e| e.eax)
        .unwrap_or(0);
    if max_basic >= 0xb {
        let levels = [
            (0u32, 0u32, 1u32, 1u32), // subleaf, shift, logical count, level type SMT
            (1, core_bits, cpus, 2),  // core level
            (2, 0, 0, 0),             // invalid: ends the enumeration
        ];
        for (sub, shift, count, kind) in levels {
            out.push(kvm_cpuid_entry2 {
                function: 0xb,
                index: sub,
                flags: KVM_CPUID_FLAG_SIGNIFCANT_INDEX,
                eax: shift,
                ebx: count,
                ecx: (kind << 8) | sub,
                edx: u32::from(cpu_id),
                ..Default::default()
            });
        }
    }
    out
}

/// Names of [`MASKED`] bits that are set in `got` (the table KVM reports back after
/// `KVM_SET_CPUID2`). On this PVM host KVM replaces leaf 1 ECX/EDX and leaf 7 with its own
/// values and re-adds leaf 0xD, so most masks do not reach the guest; the VMM logs the result.
pub fn overridden(got: &[kvm_cpuid_entry2]) -> Vec<&'static str> {
    MASKED
        .iter()
        .filter(|b| {
            got.iter().any(|e| {
                e.function == b.leaf
                    && b.subleaf.is_none_or(|s| s == e.index)
                    && (match b.reg {
                        Reg::Eax => e.eax,
                        Reg::Ebx => e.ebx,
                        Reg::Ecx => e.ecx,
                        Reg::Edx => e.edx,
                    }) & (1 << b.bit)
                        != 0
            })
        })
        .map(|b| b.name)
        .collect()
}

/// Errors of CPUID set-up.
#[derive(Debug, thiserror::Error)]
pub enum CpuidError {
    #[error("cannot build a CPUID table of {0} entries")]
    Fam(usize),
}

/// Filters a `CpuId` from `KVM_GET_SUPPORTED_CPUID` for one vCPU.
pub fn filter(supported: &CpuId, cpu_id: u8, cpu_count: u8) -> Result<CpuId, CpuidError> {
    let entries = filter_entries(supported.as_slice(), cpu_id, cpu_count);
    CpuId::from_entries(&entries).map_err(|_| CpuidError::Fam(entries.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32, v: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax: v,
            ebx: v,
            ecx: v,
            edx: v,
            ..Default::default()
        }
    }

    fn find(v: &[kvm_cpuid_entry2], f: u32, i: u32) -> kvm_cpuid_entry2 {
        *v.iter().find(|e| e.function == f && e.index == i).unwrap()
    }

    #[test]
    fn masks_emulator_hostile_features_and_sets_hypervisor() {
        let all = u32::MAX;
        let input = vec![
            entry(0, 0, 0xd),
            entry(1, 0, all),
            entry(7, 0, all),
            entry(7, 1, all),
            entry(0xd, 0, all),
            entry(0xd, 1, all),
            entry(0x8000_0001, 0, all),
            entry(KVM_CPUID_FEATURES, 0, all),
        ];
        let out = filter_entries(&input, 1, 2);
        let l1 = find(&out, 1, 0);
        for bit in [30, 26, 27, 28, 23, 17] {
            assert_eq!(l1.ecx & (1 << bit), 0, "leaf 1 ecx bit {bit}");
        }
        assert_ne!(l1.ecx & (1 << HYPERVISOR_BIT), 0);
        assert_eq!(l1.ebx >> 24, 1, "APIC id");
        assert_eq!((l1.ebx >> 16) & 0xff, 2, "logical count");
        assert_ne!(l1.edx & (1 << 26), 0, "sse2 stays (x86_64 baseline)");
        let l7 = find(&out, 7, 0);
        for bit in [18, 20, 7, 10, 5] {
            assert_eq!(l7.ebx & (1 << bit), 0, "leaf 7 ebx bit {bit}");
        }
        assert_eq!(l7.ecx & (1 << 3), 0, "pku");
        assert_eq!(l7.ecx & (1 << 4), 0, "ospke");
        assert_ne!(l7.ebx & (1 << 9), 0, "erms stays");
        assert_eq!(find(&out, 7, 1).eax & (1 << 4), 0);
        assert!(out.iter().all(|e| e.function != 0xd), "leaf 0xd removed");
        assert_eq!(find(&out, 0x8000_0001, 0).ecx & (1 << 5), 0, "lzcnt");
        // KVM's vmcall-based paravirtual features are gone, the MSR-based ones stay.
        let pv = find(&out, KVM_CPUID_FEATURES, 0).eax;
        for bit in [7, 11, 13, 16] {
            assert_eq!(pv & (1 << bit), 0, "kvm pv feature bit {bit}");
        }
        for bit in [0, 3, 6] {
            assert_ne!(
                pv & (1 << bit),
                0,
                "kvmclock / kvmclock2 / pv-eoi stay: bit {bit}"
            );
        }
    }

    #[test]
    fn reports_masked_bits_that_kvm_kept() {
        let mut l1 = entry(1, 0, 0);
        l1.ecx = (1 << 30) | (1 << 31);
        let mut l7 = entry(7, 0, 0);
        l7.ebx = 1 << 20;
        assert_eq!(overridden(&[l1, l7]), vec!["rdrand", "smap"]);
        assert!(overridden(&filter_entries(&[entry(1, 0, u32::MAX)], 0, 1)).is_empty());
    }

    #[test]
    fn builds_topology_leaf() {
        let out = filter_entries(&[entry(0, 0, 0xd)], 3, 4);
        let s0 = find(&out, 0xb, 0);
        let s1 = find(&out, 0xb, 1);
        let s2 = find(&out, 0xb, 2);
        assert_eq!((s0.ebx, s0.ecx >> 8, s0.edx), (1, 1, 3));
        assert_eq!((s1.eax, s1.ebx, s1.ecx >> 8, s1.edx), (2, 4, 2, 3));
        assert_eq!((s2.ebx, s2.ecx >> 8), (0, 0));
    }

    #[test]
    fn single_cpu_has_no_htt() {
        let out = filter_entries(&[entry(0, 0, 1), entry(1, 0, u32::MAX)], 0, 1);
        assert_eq!(find(&out, 1, 0).edx & (1 << 28), 0);
        assert!(out.iter().all(|e| e.function != 0xb), "max leaf 1: no 0xb");
    }
}

#[cfg(test)]
mod kvm_tests {
    use super::*;

    /// Filters this host's real supported CPUID (skips without /dev/kvm).
    #[test]
    fn filters_the_hosts_supported_cpuid() {
        let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm is required by the vmm tests");
        let supported = kvm
            .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
            .unwrap();
        let out = filter(&supported, 0, 1).unwrap();
        let l1 = out.as_slice().iter().find(|e| e.function == 1).unwrap();
        eprintln!("leaf1 ecx {:#x}", l1.ecx);
        assert_eq!(l1.ecx & (1 << 30), 0, "rdrand");
        let l7 = out
            .as_slice()
            .iter()
            .find(|e| e.function == 7 && e.index == 0)
            .unwrap();
        assert_eq!(l7.ebx & (1 << 20), 0, "smap");
    }
}
