//! Peer-to-peer DMA between the first two dmatest functions (both lent by one lender): A
//! copies guest RAM into B's BAR buffer and B's buffer back into RAM by bus address (B's
//! guest-physical BAR address), a copy to an address that is neither RAM nor a BAR fails,
//! and after B's BAR0 is moved the copy works at the new address and fails at the old one.
//! Each step prints one `TEST p2p-*` line.

use crate::dma::{self, PAGE};
use crate::dmatest::ID;
use crate::interrupts::wait_until;
use crate::mmio;
use crate::pci::{self, CMD_BUS_MASTER, CMD_INTX_DISABLE, CMD_MEM};
use crate::Results;

const REG_STATUS: u64 = 0x04;
const REG_SRC: u64 = 0x08;
const REG_DST: u64 = 0x10;
const REG_LEN: u64 = 0x18;
const REG_CMD: u64 = 0x20;
const REG_FAULTS: u64 = 0x24;
const REG_COMPLETED: u64 = 0x28;
const STATUS_DONE: u32 = 2;
const STATUS_ERROR: u32 = 4;
const CMD_START: u32 = 1;
/// The data buffer's offset in BAR0.
const BUF: u64 = 0x1000;
/// Inside the 32-bit PCI window, far above where the VMM places BARs: neither RAM nor a BAR.
const HOLE: u64 = 0xdff0_0000;
/// Arena pages used as source and destination.
const P_SRC: u64 = 6;
const P_DST: u64 = 7;

fn write64(addr: u64, v: u64) {
    // SAFETY: a device register in a BAR the VMM assigned; one 8-byte access.
    unsafe { core::ptr::write_volatile(addr as *mut u64, v) }
}

/// One copy on the dmatest at `bar0`; returns (finished, status).
fn copy(bar0: u64, src: u64, dst: u64, len: u32) -> (bool, u32) {
    let before = mmio::read32(bar0 + REG_COMPLETED);
    write64(bar0 + REG_SRC, src);
    write64(bar0 + REG_DST, dst);
    mmio::write32(bar0 + REG_LEN, len);
    mmio::write32(bar0 + REG_CMD, CMD_START);
    let done = wait_until(
        || mmio::read32(bar0 + REG_COMPLETED) != before,
        crate::interrupts::MUST_ARRIVE_MS,
    );
    (done, mmio::read32(bar0 + REG_STATUS))
}

fn ok_status(r: (bool, u32)) -> bool {
    r.0 && r.1 & STATUS_DONE != 0 && r.1 & STATUS_ERROR == 0
}

fn err_status(r: (bool, u32)) -> bool {
    r.0 && r.1 & STATUS_ERROR != 0
}

pub fn run(r: &mut Results, seed: u32) {
    let Some(a) = pci::find(|f| f.id() == ID) else {
        r.report("p2p-probe", false).s("no dmatest function").nl();
        return;
    };
    let Some(b) = pci::find(|f| f.id() == ID && (f.bus != a.bus || f.dev != a.dev)) else {
        r.report("p2p-probe", false)
            .s("one dmatest function, two needed")
            .nl();
        return;
    };
    b.set_command(CMD_MEM | CMD_INTX_DISABLE);
    a.set_command(CMD_MEM | CMD_BUS_MASTER | CMD_INTX_DISABLE);
    let (a0, b0) = (a.bar(0), b.bar(0));
    let o = a
        .print(r.report("p2p-probe", a0 != 0 && b0 != 0))
        .s(" bar0 ")
        .hex(a0)
        .s(" peer ")
        .hex(b0)
        .s(" peer-bdf ");
    b.print(o).nl();
    if a0 == 0 || b0 == 0 {
        return;
    }
    let (src, dst) = (dma::page(P_SRC), dma::page(P_DST));

    // RAM -> B's buffer, by B's guest-physical address; verified by reading B's BAR.
    dma::fill_pattern(src, PAGE, seed);
    let c = copy(a0, src, b0 + BUF, PAGE as u32);
    let bad = dma::check_pattern(b0 + BUF, PAGE, seed);
    report_copy(r, "p2p-copy", c, bad, b0 + BUF);

    // B's buffer -> RAM (a peer read).
    dma::zero(dst, PAGE);
    let c = copy(a0, b0 + BUF, dst, PAGE as u32);
    let bad = dma::check_pattern(dst, PAGE, seed);
    report_copy(r, "p2p-read", c, bad, dst);

    // Neither RAM nor a BAR: refused with STATUS.error, FAULTS counts it.
    let faults = mmio::read32(a0 + REG_FAULTS);
    let c = copy(a0, src, HOLE, 256);
    let nf = mmio::read32(a0 + REG_FAULTS);
    r.report("p2p-refused", err_status(c) && nf == faults.wrapping_add(1))
        .s("status ")
        .hex(c.1 as u64)
        .s(" faults ")
        .dec(nf as u64)
        .nl();

    // Move B's BAR0 by 1 MiB with decoding on; then the new address works, the old fails.
    let moved = b0 + 0x10_0000;
    let lo = b.read32(0x10);
    b.write32(0x10, moved as u32 | (lo & 0xf));
    let at = b.bar(0);
    dma::fill_pattern(src, PAGE, seed ^ 0x5a5a_5a5a);
    let c_new = copy(a0, src, moved + BUF, PAGE as u32);
    let bad = dma::check_pattern(moved + BUF, PAGE, seed ^ 0x5a5a_5a5a);
    let c_old = copy(a0, src, b0 + BUF, 256);
    r.report(
        "p2p-move",
        at == moved && ok_status(c_new) && bad.is_none() && err_status(c_old),
    )
    .s("bar0 ")
    .hex(at)
    .s(" new status ")
    .hex(c_new.1 as u64)
    .s(" old status ")
    .hex(c_old.1 as u64)
    .s(if bad.is_none() { " verified" } else { " mismatch" })
    .nl();
    // Bus mastering off again: the VMM drops the peer mapping.
    a.set_command(CMD_MEM | CMD_INTX_DISABLE);
}

/// `p2p-loss`: A copies RAM into B's buffer (verified, `TEST p2p-copy`), then repeats the
/// copy every tick until one ends with STATUS.error (the host kills B's lender meanwhile:
/// A's lender must unmap B's window) and reports it as `TEST p2p-lost`.
pub fn run_loss(r: &mut Results, seed: u32, wait_ms: u64) {
    let Some(a) = pci::find(|f| f.id() == ID) else {
        r.report("p2p-probe", false).s("no dmatest function").nl();
        return;
    };
    let Some(b) = pci::find(|f| f.id() == ID && (f.bus != a.bus || f.dev != a.dev)) else {
        r.report("p2p-probe", false)
            .s("one dmatest function, two needed")
            .nl();
        return;
    };
    b.set_command(CMD_MEM | CMD_INTX_DISABLE);
    a.set_command(CMD_MEM | CMD_BUS_MASTER | CMD_INTX_DISABLE);
    let (a0, b0) = (a.bar(0), b.bar(0));
    let o = a
        .print(r.report("p2p-probe", a0 != 0 && b0 != 0))
        .s(" bar0 ")
        .hex(a0)
        .s(" peer ")
        .hex(b0)
        .s(" peer-bdf ");
    b.print(o).nl();
    if a0 == 0 || b0 == 0 {
        return;
    }
    let src = dma::page(P_SRC);
    dma::fill_pattern(src, PAGE, seed);
    let c = copy(a0, src, b0 + BUF, PAGE as u32);
    let bad = dma::check_pattern(b0 + BUF, PAGE, seed);
    report_copy(r, "p2p-copy", c, bad, b0 + BUF);
    // B's BAR is not read again: its lender is about to die.
    let faults = mmio::read32(a0 + REG_FAULTS);
    let mut last = (false, 0);
    let mut copies = 0u64;
    let refused = wait_until(
        || {
            last = copy(a0, src, b0 + BUF, 256);
            copies += 1;
            !ok_status(last)
        },
        wait_ms,
    );
    let nf = mmio::read32(a0 + REG_FAULTS);
    r.report("p2p-lost", refused && err_status(last) && nf != faults)
        .s("after ")
        .dec(copies)
        .s(" copies status ")
        .hex(last.1 as u64)
        .s(" faults ")
        .dec(nf as u64)
        .nl();
    a.set_command(CMD_MEM | CMD_INTX_DISABLE);
}

fn report_copy(r: &mut Results, name: &str, c: (bool, u32), bad: Option<u64>, at: u64) {
    let o = r
        .report(name, ok_status(c) && bad.is_none())
        .s("bytes ")
        .dec(PAGE)
        .s(" status ")
        .hex(c.1 as u64)
        .s(" at ")
        .hex(at);
    match bad {
        None => o.s(" verified").nl(),
        Some(off) => o.s(" mismatch at byte ").dec(off).nl(),
    }
}

/// ivshmem-plain (QEMU): BAR 2 is plain memory, the peer a real NVMe can write into.
pub const IVSHMEM_ID: u32 = 0x1110 << 16 | 0x1af4;
/// Bytes the NVMe reads into the peer's BAR.
const NVME_P2P_BYTES: u64 = 4096;

/// Byte `i` of the block `p2p-nvme` writes (the host checks it in the peer's file).
fn nvme_p2p_byte(seed: u32, i: u64) -> u8 {
    (seed as u64).wrapping_mul(31).wrapping_add(i.wrapping_mul(7)) as u8 ^ (i >> 8) as u8
}

/// `p2p-nvme`: a real NVMe (the first class 01:08:02 function) reads a block straight into
/// the memory BAR of a peer function (the first ivshmem-plain, BAR 2), by bus address.
/// The block is first written from guest RAM; the RAM buffer is then cleared, the read's
/// only PRP is the peer's BAR address, and the peer's BAR (read through its BAR) and the RAM
/// buffer (still clear) are checked. Prints `TEST p2p-nvme-probe`, then `TEST p2p-nvme ok
/// lba=<n> peer=<bar2> bytes=4096` (or fail with what differed).
pub fn run_nvme(r: &mut Results, p: crate::nvme::Params) {
    use crate::nvme;
    let (Some(nf), Some(peer)) = (
        pci::find(|f| f.class() == nvme::CLASS),
        pci::find(|f| f.id() == IVSHMEM_ID),
    ) else {
        r.report("p2p-nvme-probe", false)
            .s("need an NVMe and an ivshmem-plain function")
            .nl();
        return;
    };
    // The peer decodes its BAR before the NVMe masters the bus, so the VMM has published it
    // when the NVMe's Bus Master Enable maps the peers.
    peer.set_command(CMD_MEM);
    let bar2 = peer.bar(2);
    r.report("p2p-nvme-probe", bar2 != 0)
        .s("peer bar2 ")
        .hex(bar2)
        .nl();
    if bar2 == 0 {
        return;
    }
    let Some(mut s) = nvme::setup(nf, r, p) else {
        return;
    };
    // A count of LBAs: `nvme::rw` writes the 0-based field itself.
    let nlb = NVME_P2P_BYTES >> s.lbads;
    let slba = p.slba;
    let buf = dma::data_a();
    for i in 0..NVME_P2P_BYTES {
        // SAFETY: arena memory (the first data buffer).
        unsafe { core::ptr::write_volatile((buf + i) as *mut u8, nvme_p2p_byte(p.seed, i)) };
    }
    let wrote = s.n.ok(true, nvme::rw(nvme::OP_WRITE, buf, 0, slba, nlb)).is_some();
    dma::zero(buf, NVME_P2P_BYTES);
    let read = wrote
        && s
            .n
            .ok(true, nvme::rw(nvme::OP_READ, bar2, 0, slba, nlb))
            .is_some();
    let mut bad_peer = None;
    let mut bad_ram = None;
    for w in 0..NVME_P2P_BYTES / 4 {
        let want = u32::from_le_bytes(core::array::from_fn(|k| {
            nvme_p2p_byte(p.seed, w * 4 + k as u64)
        }));
        if bad_peer.is_none() && read && mmio::read32(bar2 + w * 4) != want {
            bad_peer = Some(w * 4);
        }
        if bad_ram.is_none() && dma::read32(buf + w * 4) != 0 {
            bad_ram = Some(w * 4);
        }
    }
    let ok = wrote && read && bad_peer.is_none() && bad_ram.is_none();
    let o = r.report("p2p-nvme", ok);
    let o = if !wrote {
        o.s("the write from RAM failed")
    } else if !read {
        o.s("the read into the peer's BAR failed")
    } else if let Some(off) = bad_peer {
        o.s("the peer's BAR differs at +").hex(off)
    } else if let Some(off) = bad_ram {
        o.s("guest RAM changed at +").hex(off)
    } else {
        o.s("lba ")
            .dec(slba)
            .s(" peer ")
            .hex(bar2)
            .s(" bytes ")
            .dec(NVME_P2P_BYTES)
    };
    o.nl();
    nvme::quiesce(nf);
}
