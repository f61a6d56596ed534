//! What the guest sees in CPUID: the VMM must set the hypervisor bit and hide the features the
//! host's instruction emulator cannot run (see `vmm/src/cpuid.rs`).

use crate::serial::Out;
use crate::Results;

pub fn cpuid(leaf: u32, sub: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: `cpuid` only writes the four registers; rbx is saved because LLVM reserves it.
    unsafe {
        core::arch::asm!(
            "mov {tmp:r}, rbx",
            "cpuid",
            "xchg {tmp:r}, rbx",
            tmp = out(reg) b,
            inout("eax") leaf => a,
            inout("ecx") sub => c,
            out("edx") d,
            options(nostack, preserves_flags),
        );
    }
    [a, b, c, d]
}

/// (leaf, register 1=ebx 2=ecx, bit, name): features the VMM masks because the emulator
/// cannot run them. On this PVM host KVM overrides leaves 1 and 7 with its own values, so they
/// may still be visible; the test reports them (information) and only requires the
/// hypervisor bit.
const MASKED: &[(u32, u8, u32, &str)] = &[
    (1, 2, 30, "rdrand"),
    (1, 2, 26, "xsave"),
    (1, 2, 23, "popcnt"),
    (1, 2, 17, "pcid"),
    (1, 2, 28, "avx"),
    (7, 1, 20, "smap"),
    (7, 1, 7, "smep"),
    (7, 1, 0, "fsgsbase"),
    (7, 1, 18, "rdseed"),
    (7, 2, 3, "pku"),
];

fn reg(v: &[u32; 4], r: u8) -> u32 {
    match r {
        0 => v[0],
        1 => v[1],
        2 => v[2],
        _ => v[3],
    }
}

pub fn test(r: &mut Results) {
    let max = cpuid(0, 0)[0];
    let l1 = cpuid(1, 0);
    let l7 = if max >= 7 { cpuid(7, 0) } else { [0; 4] };
    let hv = l1[2] & (1 << 31) != 0;
    let o = r
        .report("cpuid", hv)
        .s("hypervisor ")
        .s(if hv { "yes" } else { "no" })
        .s(" leaf1.ecx ")
        .hex(l1[2] as u64)
        .s(" leaf7.ebx ")
        .hex(l7[1] as u64)
        .s(" masked-but-visible:");
    let mut none = true;
    for &(leaf, r, bit, name) in MASKED {
        let v = if leaf == 1 { reg(&l1, r) } else { reg(&l7, r) };
        if v & (1 << bit) != 0 {
            o.s(" ").s(name);
            none = false;
        }
    }
    if none {
        o.s(" none");
    }
    Out.nl();
}
