//! lendvm bare-metal test guest.
//!
//! Entered by the VMM in 64-bit long mode (identity-mapped first 4 GiB, interrupts off) with
//! RSI = the Linux zero page (`docs/CONTRACTS.md`). It runs the tests selected by the command
//! line (`tests=cpuid,mmio,pci,irq` or `tests=none`; default all; `exit=N` sets the code
//! on success; `fault=rdrand|ud2` provokes a failure), prints `TEST <name> ok|fail <detail>` lines on
//! COM1, then `EXIT <code>` and writes the code to the debug-exit port 0xf4.
//!
//! Built without SSE (the host's KVM runs this guest in its instruction emulator, which cannot
//! decode vector instructions) and without `core::fmt`; see `tests/build.rs`.

#![no_std]
#![no_main]

mod bootinfo;
mod cpuid;
mod exit;
mod fault;
mod interrupts;
mod io;
mod mem;
mod mmio;
mod pci;
mod serial;

use serial::Out;

core::arch::global_asm!(
    ".section .text.start, \"ax\"",
    ".global _start",
    "_start:",
    "    cli",
    "    mov rsp, offset __stack_top",
    "    mov rdi, rsi",
    "    call guest_main",
    "2:  hlt",
    "    jmp 2b",
    ".section .bss",
    ".balign 16",
    "__stack_bottom:",
    "    .skip 65536",
    "__stack_top:",
);

/// Test outcome bookkeeping.
pub struct Results {
    pub passed: u32,
    pub failed: u32,
}

impl Results {
    /// Prints `TEST <name> ok|fail ` and returns the writer for the detail; call `end()`.
    pub fn report(&mut self, name: &str, ok: bool) -> Out {
        if ok {
            self.passed += 1;
        } else {
            self.failed += 1;
        }
        Out.s("TEST ").s(name).s(if ok { " ok " } else { " fail " })
    }
}

#[no_mangle]
extern "C" fn guest_main(zero_page: u64) -> ! {
    serial::init();
    Out.s("lendvm test guest").nl();
    let info = bootinfo::BootInfo::read(zero_page);
    let mut r = Results {
        passed: 0,
        failed: 0,
    };
    bootinfo::test(&info, &mut r);
    interrupts::init();
    if let Some(name) = info.fault {
        fault::run(name);
    }
    if info.wants("cpuid") {
        cpuid::test(&mut r);
    }
    if info.wants("mmio") {
        mmio::test(&mut r);
    }
    if info.wants("pci") {
        pci::test(&mut r);
    }
    if info.wants("irq") {
        interrupts::test(&mut r);
    }
    let code = if r.failed > 0 {
        1
    } else {
        info.exit_code.unwrap_or(0)
    };
    Out.s("passed ")
        .dec(r.passed as u64)
        .s(" failed ")
        .dec(r.failed as u64)
        .nl();
    exit::exit(code)
}

/// The precompiled `core` references the unwinding personality even with `panic=abort`.
#[no_mangle]
extern "C" fn rust_eh_personality() {}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    Out.s("PANIC").nl();
    exit::exit(101)
}
