//! Deliberate failures (`fault=NAME` on the command line) that exercise the VMM's error paths.

use crate::serial::Out;

/// Runs fault `name`; returns if the instruction completes or the name is unknown.
pub fn run(name: &[u8]) {
    match name {
        // Measured on this host's emulator (64-bit, CPL 0): `rdrand` runs; `popcnt`, `int3`,
        // `xgetbv` and `clac` stop the guest with KVM_EXIT_INTERNAL_ERROR (emulation failure),
        // which the VMM reports with RIP and the instruction bytes.
        b"rdrand" => {
            Out.s("fault: rdrand").nl();
            // SAFETY: `rdrand` only writes eax and flags.
            unsafe { core::arch::asm!("rdrand eax", out("eax") _, options(nomem, nostack)) };
        }
        b"popcnt" => {
            Out.s("fault: popcnt").nl();
            // SAFETY: register-only instruction.
            unsafe {
                core::arch::asm!("popcnt eax, ecx", out("eax") _, in("ecx") 5u32, options(nomem, nostack))
            };
        }
        b"int3" => {
            Out.s("fault: int3").nl();
            // SAFETY: traps into the IDT's #BP handler, which ends the run.
            unsafe { core::arch::asm!("int3", options(nomem, nostack)) };
        }
        b"xgetbv" => {
            Out.s("fault: xgetbv").nl();
            // SAFETY: register-only instruction.
            unsafe {
                core::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") _, out("edx") _, options(nomem, nostack))
            };
        }
        b"clac" => {
            Out.s("fault: clac").nl();
            // SAFETY: flag-only instruction.
            unsafe { core::arch::asm!("clac", options(nomem, nostack)) };
        }
        // An undefined opcode: the guest's own #UD handler reports it (vector 6).
        b"ud2" => {
            Out.s("fault: ud2").nl();
            // SAFETY: traps into the IDT's #UD handler, which ends the run.
            unsafe { core::arch::asm!("ud2", options(nomem, nostack)) };
        }
        _ => {
            Out.s("fault: unknown '").bytes(name).s("'").nl();
        }
    }
}
