//! `tests=bigbar`: the first dmatest function (1b36:1105) whose BAR0 is a 64-bit BAR of at
//! least 1 GiB (lenderd's `dmatest:buf=` of GiBs: the shape of a GPU's aperture). The BAR is
//! sized as a driver sizes it, then a word is written and read back at the buffer's first
//! page, past 4 GiB into it and at its last word, and each is copied by the device's engine
//! out of its own buffer into RAM (so it is in the device's memory, not somewhere on the
//! way); a word never written reads zero. Prints `TEST bigbar-bar ok bar0 <addr> size <size>`
//! and `TEST bigbar ok words 3 ...`.
//!
//! The VMM identity-maps the first GiB of the 64-bit PCI window only; a BAR of 64 GiB is
//! aligned to 64 GiB, past it. So this test maps one GiB at a time where it needs it, with
//! the VMM's spare page directory (`PD_MMIO64_START`, 2 MiB pages).

use crate::dma;
use crate::dmatest::{
    CMD_ACK, CMD_START, REG_CMD, REG_COMPLETED, REG_DST, REG_LEN, REG_SRC, REG_STATUS, STATUS_DONE,
    STATUS_ERROR,
};
use crate::interrupts::wait_until;
use crate::mmio;
use crate::pci::{self, Func, CMD_BUS_MASTER, CMD_INTX_DISABLE, CMD_MEM};
use crate::Results;

/// Identity-map PDPT and the spare page directory (`vmm/src/layout.rs`).
const PDPT: u64 = 0xa000;
const PD_SPARE: u64 = 0xf000;
/// The four page directories of the first 4 GiB stay as they are.
const FIXED_GIBS: u64 = 4;
const GIB: u64 = 1 << 30;

const CMD_SRC_BUF: u32 = 4;
const BUF_OFFSET: u64 = 0x1000;

fn write64(addr: u64, v: u64) {
    // SAFETY: a page-table entry in identity-mapped guest RAM, or a BAR word this test mapped.
    unsafe { core::ptr::write_volatile(addr as *mut u64, v) }
}

fn read64(addr: u64) -> u64 {
    // SAFETY: as in write64.
    unsafe { core::ptr::read_volatile(addr as *const u64) }
}

/// Maps the GiB holding `gpa` (below 512 GiB) through the spare page directory, unmapping
/// whatever GiB it mapped before, and flushes the TLB.
fn map_gib(gpa: u64) -> bool {
    let gib = gpa / GIB;
    if !(FIXED_GIBS..512).contains(&gib) {
        return false;
    }
    for i in FIXED_GIBS..512 {
        if read64(PDPT + 8 * i) == PD_SPARE | 0x3 {
            write64(PDPT + 8 * i, 0);
        }
    }
    for i in 0..512 {
        write64(PD_SPARE + 8 * i, (gib * GIB + (i << 21)) | 0x83);
    }
    write64(PDPT + 8 * gib, PD_SPARE | 0x3);
    // SAFETY: reloading CR3 with its own value flushes the TLB; the tables stay valid.
    unsafe {
        core::arch::asm!("mov {t}, cr3", "mov cr3, {t}", t = out(reg) _, options(nostack));
    }
    true
}

/// Sizes 64-bit BAR `index` as a driver does (memory decode off, all ones, read back,
/// restore): its size, 0 when it is not a 64-bit memory BAR.
fn size64(f: Func, index: u8) -> u64 {
    let off = 0x10 + 4 * index as u16;
    let (lo, hi) = (f.read32(off), f.read32(off + 4));
    if lo & 0b111 != 0b100 {
        return 0;
    }
    let cmd = f.command();
    f.set_command(cmd & !CMD_MEM);
    f.write32(off, 0xffff_ffff);
    f.write32(off + 4, 0xffff_ffff);
    let mask = (f.read32(off) & !0xf) as u64 | ((f.read32(off + 4) as u64) << 32);
    f.write32(off, lo);
    f.write32(off + 4, hi);
    f.set_command(cmd);
    (!mask).wrapping_add(1)
}

/// Copies 8 bytes at buffer offset `off` into RAM at `dst` with the engine (registers at
/// `bar0`, mapped); the STATUS it ended with.
fn copy_out(bar0: u64, off: u64, dst: u64) -> u32 {
    // Done is this copy's once COMPLETED moved: the previous copy's ACK is handled by the
    // device's worker in its own time, so STATUS may still say done from it.
    let before = mmio::read32(bar0 + REG_COMPLETED);
    write64(bar0 + REG_SRC, off);
    write64(bar0 + REG_DST, dst);
    mmio::write32(bar0 + REG_LEN, 8);
    mmio::write32(bar0 + REG_CMD, CMD_START | CMD_SRC_BUF);
    wait_until(
        || {
            mmio::read32(bar0 + REG_COMPLETED) != before
                && mmio::read32(bar0 + REG_STATUS) & (STATUS_DONE | STATUS_ERROR) != 0
        },
        crate::interrupts::MUST_ARRIVE_MS,
    );
    let status = mmio::read32(bar0 + REG_STATUS);
    mmio::write32(bar0 + REG_CMD, CMD_ACK);
    status
}

pub fn test(r: &mut Results, seed: u32) {
    let found = pci::find(|f| f.id() == crate::dmatest::ID && size64(*f, 0) >= GIB);
    let Some(f) = found else {
        r.report("bigbar-bar", false)
            .s("no dmatest function with a 64-bit BAR0 of 1 GiB or more")
            .nl();
        return;
    };
    let (bar0, size) = (f.bar(0), size64(f, 0));
    let placed = bar0 >= 4 * GIB && bar0 % size == 0;
    f.print(r.report("bigbar-bar", placed))
        .s(" bar0 ")
        .hex(bar0)
        .s(" size ")
        .hex(size)
        .nl();
    if !placed {
        return;
    }
    f.set_command(CMD_MEM | CMD_BUS_MASTER | CMD_INTX_DISABLE);
    let buf = size - BUF_OFFSET;
    let offsets = [0, 4 * GIB + 0x1238, buf - 8];
    let fresh = 2 * GIB + 0x40;
    let word = |i: usize| dma::pattern_word(seed, i as u64) | 1;
    let mut bad = None;
    for (i, &o) in offsets.iter().enumerate() {
        let at = bar0 + BUF_OFFSET + o;
        if !map_gib(at) {
            bad = Some((o, 0));
            break;
        }
        write64(at, word(i));
        if read64(at) != word(i) {
            bad = Some((o, read64(at)));
            break;
        }
    }
    let zero = map_gib(bar0 + BUF_OFFSET + fresh) && read64(bar0 + BUF_OFFSET + fresh) == 0;
    // The engine copies each word out of its own buffer (registers in the BAR's first GiB).
    map_gib(bar0);
    let dst = dma::page(7);
    let mut copied = 0u64;
    if bad.is_none() {
        for (i, &o) in offsets.iter().enumerate() {
            dma::zero(dst, 8);
            let status = copy_out(bar0, o, dst);
            if status & STATUS_DONE == 0 || dma::read64(dst) != word(i) {
                bad = Some((o, dma::read64(dst)));
                break;
            }
            copied += 1;
        }
    }
    let o = r
        .report("bigbar", bad.is_none() && zero)
        .s("words 3 copied ")
        .dec(copied)
        .s(" fresh ")
        .s(if zero { "zero" } else { "not-zero" });
    match bad {
        None => o.nl(),
        Some((off, got)) => o.s(" mismatch at ").hex(off).s(" got ").hex(got).nl(),
    }
}
