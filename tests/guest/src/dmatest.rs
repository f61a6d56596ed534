//! Driver for the `dmatest` copy engine (`devices/emulated/src/dmatest.rs`, 1b36:1105):
//! copy one page of guest RAM to another through the device, wait for its MSI-X vector 0,
//! verify.

use crate::dma::{self, PAGE};
use crate::interrupts::{irq_count, poll_then_wait, wait_until, DMATEST_VECTOR};
use crate::mmio;
use crate::pci::{self, Func, Msix, CMD_BUS_MASTER, CMD_INTX_DISABLE, CMD_MEM};
use crate::Results;

pub const VENDOR: u32 = 0x1b36;
pub const DEVICE: u32 = 0x1105;
/// `device << 16 | vendor` as config dword 0 reads.
pub const ID: u32 = DEVICE << 16 | VENDOR;

const REG_ID: u64 = 0x00;
pub const REG_STATUS: u64 = 0x04;
pub const REG_SRC: u64 = 0x08;
pub const REG_DST: u64 = 0x10;
pub const REG_LEN: u64 = 0x18;
const REG_IRQ_VECTOR: u64 = 0x1c;
pub const REG_CMD: u64 = 0x20;
pub const REG_COMPLETED: u64 = 0x28;
const ID_VALUE: u32 = 0x544d_4144;
pub const STATUS_DONE: u32 = 2;
pub const STATUS_ERROR: u32 = 4;
pub const CMD_START: u32 = 1;
pub const CMD_ACK: u32 = 2;

/// Control pages of the DMA arena used as source and destination.
const P_SRC: u64 = 6;
const P_DST: u64 = 7;

/// Finds the first dmatest function and runs the copy test on it.
pub fn test(r: &mut Results, seed: u32) {
    match pci::find(|f| f.id() == ID) {
        Some(f) => test_on(f, r, seed),
        None => {
            r.report("dmatest-probe", false)
                .s("no 1b36:1105 function on bus 0")
                .nl();
        }
    }
}

fn write64(addr: u64, v: u64) {
    // SAFETY: a device register in a BAR the VMM assigned; one 8-byte access.
    unsafe { core::ptr::write_volatile(addr as *mut u64, v) }
}

/// Enables the function, copies a page through the device and verifies it.
pub fn test_on(f: Func, r: &mut Results, seed: u32) {
    let bar0 = f.bar(0);
    f.set_command(CMD_MEM | CMD_BUS_MASTER | CMD_INTX_DISABLE);
    let id = if bar0 != 0 {
        mmio::read32(bar0 + REG_ID)
    } else {
        0
    };
    let msix = Msix::probe(f);
    let ok = id == ID_VALUE && msix.is_some();
    f.print(r.report("dmatest-probe", ok))
        .s(" bar0 ")
        .hex(bar0)
        .s(" id ")
        .hex(id as u64)
        .nl();
    let Some(msix) = msix else { return };
    if !ok {
        return;
    }
    msix.route(0, DMATEST_VECTOR);
    msix.enable(true);
    let irqs = irq_count(DMATEST_VECTOR);

    let (src, dst) = (dma::page(P_SRC), dma::page(P_DST));
    dma::fill_pattern(src, PAGE, seed);
    dma::zero(dst, PAGE);
    let before = mmio::read32(bar0 + REG_COMPLETED);
    write64(bar0 + REG_SRC, src);
    write64(bar0 + REG_DST, dst);
    mmio::write32(bar0 + REG_LEN, PAGE as u32);
    mmio::write32(bar0 + REG_IRQ_VECTOR, 0);
    mmio::write32(bar0 + REG_CMD, CMD_START);
    let finished = poll_then_wait(
        || mmio::read32(bar0 + REG_STATUS) & (STATUS_DONE | STATUS_ERROR) != 0,
        200,
        crate::interrupts::MUST_ARRIVE_MS,
    );
    let status = mmio::read32(bar0 + REG_STATUS);
    let irq = wait_until(|| irq_count(DMATEST_VECTOR) > irqs, crate::interrupts::MUST_ARRIVE_MS);
    let bad = dma::check_pattern(dst, PAGE, seed);
    mmio::write32(bar0 + REG_CMD, CMD_ACK);
    let ok = finished && status & STATUS_DONE != 0 && irq && bad.is_none();
    let o = r
        .report("dmatest-copy", ok)
        .s("bytes ")
        .dec(PAGE)
        .s(" status ")
        .hex(status as u64)
        .s(" completed ")
        .dec(mmio::read32(bar0 + REG_COMPLETED).wrapping_sub(before) as u64)
        .s(" irq count=")
        .dec(irq_count(DMATEST_VECTOR) - irqs);
    match bad {
        None => o.s(" verified").nl(),
        Some(off) => o.s(" mismatch at byte ").dec(off).nl(),
    }
}
