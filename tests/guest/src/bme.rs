//! `tests=bme-steps`: walks a borrowed function through Memory-only → Bus Master on → Bus
//! Master off, pausing after each step until the host acknowledges it, so the host can look
//! at the lender's DMA window and the VMM's pinned memory in each state.
//!
//! Handshake: the guest prints `MAILBOX 0x<gpa>` (a u64 in its RAM), then for each step
//! `STEP <n> <name>` and halts (1 ms tick) until the mailbox holds at least `n`. The host
//! writes `n` as a little-endian u64 at that guest-physical address (through the guest-RAM
//! memfd of the `lendvm` process: `/proc/<pid>/fd/<n>` → `memfd:lendvm-guest-ram`, file offset
//! = GPA below 3 GiB). Each wait is bounded by `wait_ms=` (default 30 s).

use core::ptr::{addr_of, read_volatile};

use crate::interrupts::wait_until;
use crate::pci::{self, Msix, CMD_BUS_MASTER, CMD_INTX_DISABLE, CMD_MEM};
use crate::serial::Out;
use crate::{dmatest, nvme, Results};

#[no_mangle]
static mut BME_MAILBOX: u64 = 0;

pub fn mailbox() -> u64 {
    // SAFETY: written only by the host (through guest RAM) and read here.
    unsafe { read_volatile(addr_of!(BME_MAILBOX)) }
}

/// Prints `MAILBOX 0x<gpa>` (the host writes step acknowledgements there).
pub fn announce_mailbox() {
    Out.s("MAILBOX ").hex(addr_of!(BME_MAILBOX) as u64).nl();
}

/// Prints `STEP <n> <name>` and waits (bounded) until the host acknowledged step `n`.
pub fn step(n: u64, name: &str, wait_ms: u64) -> bool {
    Out.s("STEP ").dec(n).s(" ").s(name).nl();
    let acked = wait_until(|| mailbox() >= n, wait_ms);
    if !acked {
        Out.s("STEP ").dec(n).s(" not acknowledged").nl();
    }
    acked
}

pub fn run(r: &mut Results, wait_ms: u64, seed: u32) {
    let Some(f) = pci::find(|f| f.class() == nvme::CLASS || f.id() == dmatest::ID) else {
        r.report("bme-steps", false)
            .s("no nvme or dmatest function on bus 0")
            .nl();
        return;
    };
    Out.s("MAILBOX ").hex(addr_of!(BME_MAILBOX) as u64).nl();
    let mut ok = true;
    f.set_command(CMD_MEM | CMD_INTX_DISABLE);
    ok &= step(1, "mem-only", wait_ms);
    if f.id() == dmatest::ID {
        // Proves the window works while Bus Master is on (the driver sets MEM|BME itself).
        dmatest::test_on(f, r, seed);
    } else {
        f.set_command(CMD_MEM | CMD_BUS_MASTER | CMD_INTX_DISABLE);
    }
    ok &= step(2, "bus-master-on", wait_ms);
    if let Some(m) = Msix::probe(f) {
        m.enable(false);
    }
    f.set_command(CMD_MEM | CMD_INTX_DISABLE);
    ok &= step(3, "bus-master-off", wait_ms);
    f.print(r.report("bme-steps", ok)).s(" steps 3").nl();
}
