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

/// The CPU model a guest sees (`lendvm --cpu-model`). Both start from KVM's supported CPUID
/// and both get [`MASKED`] and [`REMOVED_LEAVES`] (what this host's emulator cannot run).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpuModel {
    /// The host's features as KVM offers them, minus [`MASKED`].
    #[default]
    Host,
    /// Like QEMU's `qemu64` (what `scripts/bench-guest.sh` gives QEMU): the feature leaves 1,
    /// 7 and 0x8000_0001 cut down to qemu64's set ([`QEMU64_KEEP`]; leaf 7 empty), the basic
    /// leaves up to 0xD and the extended ones up to 0x8000_000A. The vendor, family and model
    /// stay the host's (a guest must not take an Intel host for an AMD K8).
    Qemu64,
}

impl CpuModel {
    /// Every model, by name.
    pub const ALL: &'static [CpuModel] = &[CpuModel::Host, CpuModel::Qemu64];

    pub fn name(self) -> &'static str {
        match self {
            CpuModel::Host => "host",
            CpuModel::Qemu64 => "qemu64",
        }
    }
}

impl std::fmt::Display for CpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CpuModel {
    type Err = CpuidError;
    fn from_str(s: &str) -> Result<Self, CpuidError> {
        CpuModel::ALL
            .iter()
            .copied()
            .find(|m| m.name() == s)
            .ok_or_else(|| CpuidError::UnknownModel(s.to_owned()))
    }
}

/// The bits QEMU's `qemu64` model has (QEMU 7.2, `target/i386/cpu.c`, with KVM's defaults:
/// x2apic and the hypervisor bit), per (leaf, register). A register not listed here is
/// cleared whole in leaves 1, 7 and 0x8000_0001 by [`CpuModel::Qemu64`].
pub const QEMU64_KEEP: &[(u32, Reg, u32)] = &[
    // Leaf 1 EDX: fpu de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush
    // mmx fxsr sse sse2 (QEMU's PPRO_FEATURES + mtrr clflush mca pse36); ht when SMP (set by
    // the topology code below).
    (
        1,
        Reg::Edx,
        (1 << 0)
            | (1 << 2)
            | (1 << 3)
            | (1 << 4)
            | (1 << 5)
            | (1 << 6)
            | (1 << 7)
            | (1 << 8)
            | (1 << 9)
            | (1 << 11)
            | (1 << 12)
            | (1 << 13)
            | (1 << 14)
            | (1 << 15)
            | (1 << 16)
            | (1 << 17)
            | (1 << 19)
            | (1 << 23)
            | (1 << 24)
            | (1 << 25)
            | (1 << 26)
            | (1 << 28),
    ),
    // Leaf 1 ECX: pni (sse3) cx16, x2apic (QEMU turns it on with KVM), hypervisor.
    (1, Reg::Ecx, (1 << 0) | (1 << 13) | (1 << 21) | (1 << 31)),
    // Leaf 0x8000_0001 EDX: syscall nx lm, and (AMD) the leaf 1 EDX aliases qemu64 has.
    (
        0x8000_0001,
        Reg::Edx,
        (1 << 11) | (1 << 20) | (1 << 29) | 0x0183_f3fd,
    ),
    // Leaf 0x8000_0001 ECX: lahf_lm (svm is off without nested virtualization).
    (0x8000_0001, Reg::Ecx, 1 << 0),
];

/// Highest basic and extended leaf of QEMU's `qemu64`.
const QEMU64_MAX_BASIC: u32 = 0xd;
const QEMU64_MAX_EXTENDED: u32 = 0x8000_000a;

/// Features of leaves 1 and 7 that [`CpuModel::Qemu64`] clears and that a Linux guest acts on,
/// beyond [`MASKED`], by their `/proc/cpuinfo` names (which `clearcpuid=` takes). This PVM host
/// puts its own leaves 1 and 7 back after `KVM_SET_CPUID2` ([`overridden`]), so for a Linux
/// guest these reach it only as `clearcpuid=`; the order is the priority within its
/// 127-byte value.
pub const QEMU64_CLEARED: &[(u32, u32, Reg, u32, &str)] = &[
    // (leaf, subleaf, register, bit, name)
    (7, 0, Reg::Ebx, 9, "erms"),
    (7, 0, Reg::Edx, 4, "fsrm"),
    // The TSC-deadline timer (1/ECX bit 24) is in [`MASKED`]: both models lose it.
    (7, 0, Reg::Ecx, 22, "rdpid"),
    (7, 0, Reg::Ebx, 23, "clflushopt"),
    (7, 0, Reg::Ecx, 2, "umip"),
    (1, 0, Reg::Ecx, 22, "movbe"),
];

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
    m(
        1,
        None,
        Reg::Ecx,
        24,
        "tsc_deadline_timer",
        "SMP guests stalled for minutes, or for good, once their LAPIC timer ran in \
         TSC-deadline mode on a loaded AMD host (docs/linux-guest-on-pvm.md); the one-shot \
         mode qemu64 guests use ran without a stall",
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

/// Cuts `e` down to QEMU's `qemu64` (see [`CpuModel::Qemu64`]).
fn qemu64_entry(e: &mut kvm_cpuid_entry2) {
    match e.function {
        0 => e.eax = e.eax.min(QEMU64_MAX_BASIC),
        0x8000_0000 => e.eax = e.eax.min(QEMU64_MAX_EXTENDED),
        1 | 0x8000_0001 => {
            for reg in [Reg::Ecx, Reg::Edx] {
                let keep = QEMU64_KEEP
                    .iter()
                    .filter(|(l, r, _)| *l == e.function && *r == reg)
                    .fold(0, |acc, (_, _, bits)| acc | bits);
                *reg_mut(e, reg) &= keep;
            }
        }
        // Structured extended features: none in qemu64 (EAX, the highest subleaf, stays).
        7 => {
            if e.index != 0 {
                e.eax = 0;
            }
            e.ebx = 0;
            e.ecx = 0;
            e.edx = 0;
        }
        _ => {}
    }
}

/// Filters KVM's supported CPUID for vCPU `cpu_id` of `cpu_count` with `model` (pure;
/// unit-tested).
pub fn filter_entries(
    entries: &[kvm_cpuid_entry2],
    model: CpuModel,
    cpu_id: u8,
    cpu_count: u8,
) -> Vec<kvm_cpuid_entry2> {
    let (max_basic_in, max_ext_in) = match model {
        CpuModel::Host => (u32::MAX, u32::MAX),
        CpuModel::Qemu64 => (QEMU64_MAX_BASIC, QEMU64_MAX_EXTENDED),
    };
    let mut out: Vec<kvm_cpuid_entry2> = entries
        .iter()
        .filter(|e| !REMOVED_LEAVES.iter().any(|(l, _)| *l == e.function))
        // Topology is rebuilt below.
        .filter(|e| e.function != 0xb && e.function != 0x1f)
        // Leaves above the model's highest (KVM's own 0x4000_xxxx range stays).
        .filter(|e| match e.function {
            f @ 0..=0x3fff_ffff => f <= max_basic_in,
            f @ 0x8000_0000..=0x8fff_ffff => f <= max_ext_in,
            _ => true,
        })
        .copied()
        .collect();
    if model == CpuModel::Qemu64 {
        out.iter_mut().for_each(qemu64_entry);
    }
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

/// Names of bits `model` clears that are set in `got` (the table KVM reports back after
/// `KVM_SET_CPUID2`): [`MASKED`] ones and, for qemu64, [`QEMU64_CLEARED`] ones. On this PVM
/// host KVM replaces leaf 1 ECX/EDX and leaf 7 with its own values and re-adds leaf 0xD, so
/// most masks do not reach the guest; the VMM logs the result and tells a Linux guest.
pub fn overridden(got: &[kvm_cpuid_entry2], model: CpuModel) -> Vec<&'static str> {
    let set = |leaf: u32, subleaf: Option<u32>, reg: Reg, bit: u32| {
        got.iter().any(|e| {
            e.function == leaf
                && subleaf.is_none_or(|s| s == e.index)
                && (match reg {
                    Reg::Eax => e.eax,
                    Reg::Ebx => e.ebx,
                    Reg::Ecx => e.ecx,
                    Reg::Edx => e.edx,
                }) & (1 << bit)
                    != 0
        })
    };
    let mut out = masked_but_set(got);
    if model == CpuModel::Qemu64 {
        out.extend(
            QEMU64_CLEARED
                .iter()
                .filter(|(leaf, sub, reg, bit, _)| set(*leaf, Some(*sub), *reg, *bit))
                .map(|b| b.4),
        );
    }
    out
}

fn masked_but_set(got: &[kvm_cpuid_entry2]) -> Vec<&'static str> {
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
    #[error("unknown CPU model '{0}': expected host or qemu64")]
    UnknownModel(String),
}

/// Filters a `CpuId` from `KVM_GET_SUPPORTED_CPUID` for one vCPU.
pub fn filter(
    supported: &CpuId,
    model: CpuModel,
    cpu_id: u8,
    cpu_count: u8,
) -> Result<CpuId, CpuidError> {
    let entries = filter_entries(supported.as_slice(), model, cpu_id, cpu_count);
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
        let out = filter_entries(&input, CpuModel::Host, 1, 2);
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
        assert_eq!(
            overridden(&[l1, l7], CpuModel::Host),
            vec!["rdrand", "smap"]
        );
        assert!(overridden(
            &filter_entries(&[entry(1, 0, u32::MAX)], CpuModel::Host, 0, 1),
            CpuModel::Host
        )
        .is_empty());
    }

    #[test]
    fn builds_topology_leaf() {
        let out = filter_entries(&[entry(0, 0, 0xd)], CpuModel::Host, 3, 4);
        let s0 = find(&out, 0xb, 0);
        let s1 = find(&out, 0xb, 1);
        let s2 = find(&out, 0xb, 2);
        assert_eq!((s0.ebx, s0.ecx >> 8, s0.edx), (1, 1, 3));
        assert_eq!((s1.eax, s1.ebx, s1.ecx >> 8, s1.edx), (2, 4, 2, 3));
        assert_eq!((s2.ebx, s2.ecx >> 8), (0, 0));
    }

    /// Every feature bit set, in the leaves a model touches.
    fn full_table() -> Vec<kvm_cpuid_entry2> {
        let all = u32::MAX;
        let mut l0 = entry(0, 0, all);
        l0.eax = 0x20;
        let mut e0 = entry(0x8000_0000, 0, all);
        e0.eax = 0x8000_0021;
        vec![
            l0,
            entry(1, 0, all),
            entry(4, 0, 0x63),
            entry(7, 0, all),
            entry(7, 1, all),
            entry(0xd, 0, all),
            entry(0x10, 0, all),
            entry(0x1f, 0, all),
            e0,
            entry(0x8000_0001, 0, all),
            entry(0x8000_0008, 0, all),
            entry(0x8000_001f, 0, all),
            entry(KVM_CPUID_FEATURES, 0, all),
        ]
    }

    #[test]
    fn qemu64_model_has_qemu64s_features_only() {
        let out = filter_entries(&full_table(), CpuModel::Qemu64, 0, 1);
        let l1 = find(&out, 1, 0);
        // What a 64-bit Linux needs stays: fpu tsc msr pae cx8 apic sep pge cmov pat clflush
        // fxsr sse sse2 (EDX), cx16 and x2apic (ECX); syscall nx lm (0x8000_0001 EDX).
        for bit in [0, 4, 5, 6, 8, 9, 11, 13, 15, 16, 19, 24, 25, 26] {
            assert_ne!(l1.edx & (1 << bit), 0, "leaf 1 edx bit {bit} stays");
        }
        for bit in [13, 21, HYPERVISOR_BIT] {
            assert_ne!(l1.ecx & (1 << bit), 0, "leaf 1 ecx bit {bit} stays");
        }
        // Gone: tsc-deadline, movbe, pcid, popcnt, xsave, avx, rdrand, sse4.x, ... and vme.
        assert_eq!(
            l1.ecx,
            (1 << 13) | (1 << 21) | (1 << HYPERVISOR_BIT),
            "leaf 1 ecx: cx16 x2apic hypervisor (sse3 is masked for the emulator)"
        );
        assert_eq!(l1.edx & (1 << 1), 0, "vme");
        assert_eq!(l1.edx & (1 << 28), 0, "ht: one vCPU");
        // Leaf 7: no structured extended features at all (ERMS, FSRM, AVX2, SMAP, RDPID, ...).
        let l7 = find(&out, 7, 0);
        assert_eq!((l7.ebx, l7.ecx, l7.edx), (0, 0, 0));
        assert_eq!(l7.eax, u32::MAX, "highest subleaf stays");
        assert_eq!(find(&out, 7, 1).eax, 0);
        let e1 = find(&out, 0x8000_0001, 0);
        assert_eq!(
            e1.ecx, 1,
            "lahf_lm only: no abm, 3dnowprefetch, topoext, ..."
        );
        for bit in [11, 20, 29] {
            assert_ne!(e1.edx & (1 << bit), 0, "syscall nx lm: bit {bit}");
        }
        assert_eq!(e1.edx & (1 << 27), 0, "rdtscp");
        assert_eq!(e1.edx & (1 << 26), 0, "pdpe1gb");
        // Highest leaves as qemu64's; the leaves above them are gone, KVM's own stay.
        assert_eq!(find(&out, 0, 0).eax, 0xd);
        assert_eq!(find(&out, 0x8000_0000, 0).eax, 0x8000_000a);
        for gone in [0x10, 0x1f, 0x8000_001f] {
            assert!(out.iter().all(|e| e.function != gone), "leaf {gone:#x}");
        }
        assert!(out.iter().any(|e| e.function == 0x8000_0008));
        assert!(
            out.iter().all(|e| e.function != 0xd),
            "0xd: xsave is masked"
        );
        // The emulator's masks apply to both models: the PV leaf loses its vmcall features.
        let pv = find(&out, KVM_CPUID_FEATURES, 0).eax;
        assert_eq!(pv & ((1 << 7) | (1 << 11) | (1 << 13) | (1 << 16)), 0);
        assert_ne!(pv & (1 << 3), 0, "kvmclock2 stays");
        // The host model keeps what qemu64 drops (and the emulator can run).
        let host = filter_entries(&full_table(), CpuModel::Host, 0, 1);
        let h7 = find(&host, 7, 0);
        assert_ne!(h7.ebx & (1 << 9), 0, "erms");
        assert_ne!(h7.edx & (1 << 4), 0, "fsrm");
        // The TSC-deadline timer is masked for both (docs/linux-guest-on-pvm.md).
        assert_eq!(find(&host, 1, 0).ecx & (1 << 24), 0, "tsc-deadline");
        assert_eq!(find(&host, 0, 0).eax, 0x20);
    }

    #[test]
    fn qemu64_reports_what_kvm_put_back() {
        // PVM puts its own leaves 1 and 7 back: the qemu64 bits it restored are reported
        // (for clearcpuid=), besides the emulator's masks.
        let mut l1 = entry(1, 0, 0);
        l1.ecx = (1 << 24) | (1 << 30);
        let mut l7 = entry(7, 0, 0);
        l7.ebx = (1 << 9) | (1 << 20);
        l7.edx = 1 << 4;
        assert_eq!(
            overridden(&[l1, l7], CpuModel::Qemu64),
            vec!["tsc_deadline_timer", "rdrand", "smap", "erms", "fsrm"]
        );
        assert_eq!(
            overridden(&[l1, l7], CpuModel::Host),
            vec!["tsc_deadline_timer", "rdrand", "smap"]
        );
        let clean = filter_entries(&full_table(), CpuModel::Qemu64, 0, 1);
        assert!(overridden(&clean, CpuModel::Qemu64).is_empty());
    }

    #[test]
    fn model_names() {
        for m in CpuModel::ALL {
            assert_eq!(m.name().parse::<CpuModel>().unwrap(), *m);
        }
        assert_eq!(CpuModel::default(), CpuModel::Host);
        let e = "pentium".parse::<CpuModel>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown CPU model 'pentium': expected host or qemu64"
        );
        assert!("Host".parse::<CpuModel>().is_err(), "names are exact");
    }

    #[test]
    fn single_cpu_has_no_htt() {
        let out = filter_entries(
            &[entry(0, 0, 1), entry(1, 0, u32::MAX)],
            CpuModel::Host,
            0,
            1,
        );
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
        let out = filter(&supported, CpuModel::Host, 0, 1).unwrap();
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
