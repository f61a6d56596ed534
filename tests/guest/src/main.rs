//! lendvm bare-metal test guest.
//!
//! Entered by the VMM in 64-bit long mode (identity-mapped first 4 GiB, interrupts off) with
//! RSI = the Linux zero page (`docs/CONTRACTS.md`). It runs the tests selected by the command
//! line (`tests=cpuid,mmio,pci,irq` or `tests=none`; default those four; `exit=N` sets the code
//! on success; `fault=rdrand|ud2` provokes a failure), prints `TEST <name> ok|fail <detail>` lines on
//! COM1, then `EXIT <code>` and writes the code to the debug-exit port 0xf4.
//!
//! Device groups run only when named in `tests=` (they need a borrowed device or the host):
//!
//! | group | what | parameters |
//! |---|---|---|
//! | `acpi` | finds the RSDP as Linux does, walks the XSDT, checks checksums, prints SRAT's CPU and memory affinities and SLIT's matrix (`lendvm --numa`) | |
//! | `nvme` | NVMe driver test on the first class 01:08:02 function | `seed=` (pattern, default 0x4c454e44), `lba=` (first LBA, 0), `hold=1` (after set-up print `MAILBOX`, `STEP 1 nvme-ready` and wait for the host before any I/O), `wait_ms=` (30000), `cmb=1` (I/O SQ in the controller memory buffer) |
//! | `bigbar` | a dmatest function with a 64-bit BAR0 of 1 GiB or more (a GPU aperture's shape): sized as a driver does, a word written, read back and copied out by the engine at the buffer's first page, past 4 GiB and its last word; an unwritten word reads zero | `seed=` |
//! | `dmatest` | one-page copy through the first 1b36:1105 function | `seed=` |
//! | `p2p` | peer-to-peer DMA between the first two 1b36:1105 functions (one lender or two): RAM → peer BAR, peer BAR → RAM, a hole refused, peer BAR0 moved | `seed=` |
//! | `p2p-nvme` | a real NVMe (the first class 01:08:02 function) reads a block it was given from RAM straight into an ivshmem-plain function's BAR 2; the peer's BAR and the cleared RAM buffer are checked | `seed=`, `lba=` |
//! | `p2p-loss` | RAM → peer BAR once (verified), then the same copy every tick until one ends with STATUS.error (the host kills the peer's lender) | `seed=`, `wait_ms=` (30000) |
//! | `bme-steps` | Memory → Bus Master on → off, each step acknowledged by the host through a mailbox | `wait_ms=` |
//! | `hotplug` | GED/PCI-hotplug event loop: driver test on every add, eject on every removal; ends after `rounds=N` ejects | `rounds=` (1), `wait_ms=` (30000 per event), `total_ms=` (600000), `eject_delay_ms=` (0), `seqio=1` (each NVMe add writes `seed ^ add` and prints `HOTPLUG io seq=`) |
//! | `nvme-loop` | one verified page of NVMe I/O every `period_ms=` ticks; re-initialises a controller found reset (after a restore) and retries; ends when the host writes the mailbox | `seed=`, `lba=`, `period_ms=` (100), `total_ms=` (600000) |
//! | `ticker` | prints `TICK n` every `period_ms=` ticks and checks a memory marker until the host writes the mailbox (snapshot/restore/migration tests); `churn=1` keeps rewriting 2 MiB between ticks | `seed=`, `period_ms=` (100), `total_ms=` (600000), `churn=` (0) |
//! | `idle` | the same loop without I/O, for `total_ms=` (default 600000), then exit 0 | `total_ms=` |
//! | `hostile` | abuse of a lent NVMe + dmatest (DMA outside RAM, PRP loops, bad doorbells, bogus MSI-X, BAR moves, forbidden config writes, FLR storms), each group checked; two host-acknowledged steps | `seed=`, `lba=`, `reps=` (4), `flrs=` (32), `wait_ms=` (30000) |
//!
//! Built without SSE (the host's KVM runs this guest in its instruction emulator, which cannot
//! decode vector instructions) and without `core::fmt`; see `tests/build.rs`.

#![no_std]
#![no_main]

mod acpi;
mod bigbar;
mod bme;
mod bootinfo;
mod cpuid;
mod dma;
mod dmatest;
mod exit;
mod fault;
mod hostile;
mod hotplug;
mod interrupts;
mod io;
mod mem;
mod mmio;
mod nvme;
mod nvmeloop;
mod p2p;
mod pci;
mod serial;
mod ticker;

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

/// Default pattern seed ("LEND").
const DEFAULT_SEED: u64 = 0x4c45_4e44;

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
    let params = nvme::Params {
        seed: info.param_u64("seed", DEFAULT_SEED) as u32,
        slba: info.param_u64("lba", 0),
        hold: info.param_u64("hold", 0) != 0,
        wait_ms: info.param_u64("wait_ms", 30_000),
        cmb: info.param_u64("cmb", 0) != 0,
    };
    if info.wants_explicitly("acpi") {
        acpi::test(&mut r);
    }
    if info.wants_explicitly("nvme") {
        nvme::test(&mut r, params);
    }
    if info.wants_explicitly("dmatest") {
        dmatest::test(&mut r, params.seed);
    }
    if info.wants_explicitly("bigbar") {
        bigbar::test(&mut r, params.seed);
    }
    if info.wants_explicitly("p2p") {
        p2p::run(&mut r, params.seed);
    }
    if info.wants_explicitly("p2p-nvme") {
        p2p::run_nvme(&mut r, params);
    }
    if info.wants_explicitly("p2p-loss") {
        p2p::run_loss(&mut r, params.seed, params.wait_ms);
    }
    if info.wants_explicitly("bme-steps") {
        bme::run(&mut r, info.param_u64("wait_ms", 30_000), params.seed);
    }
    if info.wants_explicitly("hostile") {
        let p = hostile::Params {
            nvme: params,
            reps: info.param_u64("reps", 4),
            flrs: info.param_u64("flrs", 32),
            wait_ms: info.param_u64("wait_ms", 30_000),
            ram_top: info.ram_bytes().min(0xc000_0000),
        };
        hostile::run(&mut r, p);
    }
    if info.wants_explicitly("hotplug") {
        let mode = hotplug::Mode {
            name: "hotplug",
            rounds: info.param_u64("rounds", 1),
            io: true,
            wait_ms: info.param_u64("wait_ms", 30_000),
            total_ms: info.param_u64("total_ms", 600_000),
            eject_delay_ms: info.param_u64("eject_delay_ms", 0),
            nvme: params,
            seqio: info.param_u64("seqio", 0) != 0,
        };
        hotplug::run(&mut r, &mode);
    }
    if info.wants_explicitly("nvme-loop") {
        nvmeloop::run(
            &mut r,
            params,
            info.param_u64("period_ms", 100),
            info.param_u64("total_ms", 600_000),
        );
    }
    if info.wants_explicitly("ticker") {
        ticker::run(
            &mut r,
            params.seed,
            info.param_u64("period_ms", 100),
            info.param_u64("total_ms", 600_000),
            info.param_u64("churn", 0) != 0,
        );
    }
    if info.wants_explicitly("idle") {
        let mode = hotplug::Mode {
            name: "idle",
            rounds: u64::MAX,
            io: false,
            wait_ms: u64::MAX,
            total_ms: info.param_u64("total_ms", 600_000),
            eject_delay_ms: info.param_u64("eject_delay_ms", 0),
            nvme: params,
            seqio: false,
        };
        hotplug::run(&mut r, &mode);
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
