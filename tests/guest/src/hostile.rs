//! `tests=hostile`: a guest that abuses a lent NVMe controller and a lent dmatest engine
//! the way a malicious driver could, and checks from its side that every abuse is refused
//! or contained. The host (`tests/tests/hostile.rs`) checks the rest: VMM and lender
//! counters, bounded logs, guard patterns in guest RAM read through the VMM's memfd, the
//! lender's backing file, leaks.
//!
//! Each abuse group prints `TEST hostile-<group> ok|fail injected=N refused=M ...` where
//! `injected` counts the abusive operations and `refused` those that ended as required
//! (an error status, an ignored write, an unrouted vector...). `reps=` (default 4) repeats
//! each group's abuse; `flrs=` (default 32) sizes the FLR storm. Guard regions are printed as
//! `GUARD 0x<gpa> 0x<len>` (u64 word at `a` holds `GUARD_SEED ^ a`); `MAILBOX`/`STEP`
//! lines (see `bme.rs`) let the host look at the VM after the set-up (step 1) and after the
//! abuse (step 2), each wait bounded by `wait_ms=`.
//!
//! Data written to the disk: valid writes only to LBAs `lba..lba+16` (the test pattern of
//! `seed`); every write that must be refused targets LBAs `lba+256..` (the host checks that
//! they keep their original content).

use core::ptr::{addr_of, read_volatile, write_volatile};

use crate::dma::{self, PAGE};
use crate::interrupts::{
    irq_count, ticks, wait_until, DMATEST_VECTOR, NVME_ADMIN_VECTOR, NVME_IO_VECTOR,
};
use crate::mmio;
use crate::nvme::{self, Nvme, Setup};
use crate::pci::{self, Func, Msix, CAP_MSIX, CMD_BUS_MASTER, CMD_INTX_DISABLE, CMD_MEM};
use crate::serial::Out;
use crate::{bme, dmatest, Results};

/// NVMe status codes (generic command status).
const SC_SUCCESS: u32 = 0x00;
const SC_DATA_TRANSFER_ERROR: u32 = 0x04;
const SC_PRP_OFFSET_INVALID: u32 = 0x13;
/// Asynchronous event: Error / Invalid Doorbell Write Value / Error Information log.
const AEN_INVALID_DOORBELL: u32 = 0x0001_0100;
/// Guard words: `GUARD_SEED ^ address`.
pub const GUARD_SEED: u64 = 0x4755_4152_4421_2121;
/// dmatest registers (see `dmatest.rs`).
const DT_STATUS: u64 = 0x04;
const DT_SRC: u64 = 0x08;
const DT_DST: u64 = 0x10;
const DT_LEN: u64 = 0x18;
const DT_IRQ_VECTOR: u64 = 0x1c;
const DT_CMD: u64 = 0x20;
const DT_FAULTS: u64 = 0x24;
const DT_COMPLETED: u64 = 0x28;
const DT_ID_VALUE: u32 = 0x544d_4144;
const DT_DONE: u32 = 2;
const DT_ERROR: u32 = 4;
const PCIE_CAP: u8 = 0x10;
const PM_CAP: u8 = 0x01;

/// A 16 KiB-aligned RAM target for "BAR over RAM" (NVMe BAR0 is 16 KiB).
#[repr(C, align(16384))]
struct RamTarget([u8; 16384]);
static mut RAM_TARGET: RamTarget = RamTarget([0; 16384]);

#[derive(Clone, Copy)]
pub struct Params {
    pub nvme: nvme::Params,
    pub reps: u64,
    pub flrs: u64,
    pub wait_ms: u64,
    /// Top of guest RAM below 4 GiB (from e820).
    pub ram_top: u64,
}

/// Guard regions set so far (checked at the end, printed for the host).
struct Guards {
    regions: [(u64, u64); 8],
    len: usize,
}

impl Guards {
    fn add(&mut self, addr: u64, len: u64) {
        fill_guard(addr, len);
        if let Some(slot) = self.regions.get_mut(self.len) {
            *slot = (addr, len);
            self.len += 1;
        }
        Out.s("GUARD ").hex(addr).s(" ").hex(len).nl();
    }

    /// Address of the first guard word that changed.
    fn check(&self) -> Option<u64> {
        self.regions
            .iter()
            .take(self.len)
            .find_map(|&(a, l)| check_guard(a, l))
    }
}

fn fill_guard(addr: u64, len: u64) {
    let mut a = addr;
    while a < addr + len {
        dma::write64(a, GUARD_SEED ^ a);
        a += 8;
    }
}

fn check_guard(addr: u64, len: u64) -> Option<u64> {
    let mut a = addr;
    while a < addr + len {
        if dma::read64(a) != GUARD_SEED ^ a {
            return Some(a);
        }
        a += 8;
    }
    None
}

/// Status code and type of a completion (`None`: no completion in time).
fn sc(c: &Option<nvme::Completion>) -> Option<u32> {
    c.as_ref().map(|c| c.status & 0x7ff)
}

/// Counts of one abuse group.
#[derive(Default)]
struct Tally {
    injected: u64,
    refused: u64,
    /// Something went wrong that is not merely "not refused" (a hang, a broken device).
    broken: bool,
}

impl Tally {
    fn expect(&mut self, ok: bool) {
        self.injected += 1;
        if ok {
            self.refused += 1;
        }
    }

    fn report(&self, r: &mut Results, name: &str) -> Out {
        r.report(
            name,
            !self.broken && self.refused == self.injected && self.injected > 0,
        )
        .s("injected=")
        .dec(self.injected)
        .s(" refused=")
        .dec(self.refused)
    }
}

struct Ctx {
    nf: Func,
    df: Func,
    s: Setup,
    p: Params,
    /// LBAs per page.
    lpp: u64,
    /// LBA of valid data, and of writes that must be refused.
    good: u64,
    poison: u64,
    guards: Guards,
}

impl Ctx {
    fn n(&mut self) -> &mut Nvme {
        &mut self.s.n
    }

    /// Writes the pattern to the good LBAs (2 pages) and reads it back: the controller
    /// works.
    fn io_works(&mut self) -> bool {
        let (a, b) = (dma::data_a(), dma::data_b());
        let seed = self.p.nvme.seed;
        let (good, lpp) = (self.good, self.lpp);
        dma::fill_pattern(a, 2 * PAGE, seed);
        let w = self
            .n()
            .ok(true, nvme::rw(nvme::OP_WRITE, a, a + PAGE, good, 2 * lpp))
            .is_some();
        dma::zero(b, 2 * PAGE);
        let rd = self
            .n()
            .ok(true, nvme::rw(nvme::OP_READ, b, b + PAGE, good, 2 * lpp))
            .is_some();
        w && rd && dma::check_pattern(b, 2 * PAGE, seed).is_none()
    }

    /// An address of the guest-physical map that is not RAM: past RAM, below the BAR window.
    fn past_ram(&self) -> u64 {
        let a = (self.p.ram_top + (16 << 20)) & !(PAGE - 1);
        if a < 0xc000_0000 {
            a
        } else {
            0x10_0000_0000
        }
    }
}

pub fn run(r: &mut Results, p: Params) {
    let nf = pci::find(|f| f.class() == nvme::CLASS);
    let df = pci::find(|f| f.id() == dmatest::ID);
    let (Some(nf), Some(df)) = (nf, df) else {
        r.report("hostile-probe", false)
            .s("want an nvme and a dmatest function on bus 0")
            .nl();
        return;
    };
    let Some(mut s) = nvme::setup(nf, r, p.nvme) else {
        return;
    };
    s.n.quiet = true;
    dmatest::test_on(df, r, p.nvme.seed);
    let lpp = PAGE >> s.lbads;
    let mut c = Ctx {
        nf,
        df,
        s,
        p,
        lpp,
        good: p.nvme.slba,
        poison: p.nvme.slba + 256,
        guards: Guards {
            regions: [(0, 0); 8],
            len: 0,
        },
    };
    let ok = c.io_works();
    r.report("hostile-setup", ok)
        .s("lba ")
        .dec(c.good)
        .s(" poison ")
        .dec(c.poison)
        .s(" lbas/page ")
        .dec(lpp)
        .nl();
    if !ok {
        return;
    }
    // Guard regions: the first and last data pages of both buffers (never named by a
    // command) and the RAM target of the BAR abuse.
    c.guards.add(dma::data_a() + 32 * PAGE, 32 * PAGE);
    c.guards.add(dma::data_b() + 32 * PAGE, 32 * PAGE);
    let target = addr_of!(RAM_TARGET) as u64;
    c.guards.add(target, 16384);

    bme::announce_mailbox();
    let mut ok = bme::step(1, "hostile-baseline", p.wait_ms);

    dma_outside_ram(&mut c, r);
    prp_lists(&mut c, r);
    doorbells(&mut c, r);
    msix_messages(&mut c, r);
    dmatest_outside(&mut c, r);
    bars(&mut c, r, target);
    config_writes(&mut c, r);
    flr_storm(&mut c, r);

    let bad = c.guards.check();
    let works = c.io_works();
    let o = r
        .report("hostile-guards", bad.is_none() && works)
        .s("regions=")
        .dec(c.guards.len as u64)
        .s(" io-after=")
        .s(if works { "ok" } else { "broken" });
    match bad {
        None => o.nl(),
        Some(a) => o.s(" changed at ").hex(a).nl(),
    }
    ok &= bme::step(2, "hostile-done", p.wait_ms);
    r.report("hostile-steps", ok).s("steps 2").nl();
}

/// NVMe reads and writes whose PRP1 lies outside guest RAM (past RAM, the BAR window, the
/// ECAM, the LAPIC, the controller's own BAR): Data Transfer Error, every time.
fn dma_outside_ram(c: &mut Ctx, r: &mut Results) {
    let targets = [
        c.past_ram(),
        0xc000_0000,
        0xe000_0000,
        0xfee0_0000,
        c.s.n.bar0,
        0x10_0000_0000,
    ];
    let mut t = Tally::default();
    let (lpp, good, poison) = (c.lpp, c.good, c.poison);
    for _ in 0..c.p.reps {
        for &a in &targets {
            let st = sc(&c.n().exec(true, nvme::rw(nvme::OP_READ, a, 0, good, lpp)));
            t.expect(st == Some(SC_DATA_TRANSFER_ERROR));
            let st = sc(&c
                .n()
                .exec(true, nvme::rw(nvme::OP_WRITE, a, 0, poison, lpp)));
            t.expect(st == Some(SC_DATA_TRANSFER_ERROR));
        }
    }
    t.broken = !c.io_works();
    t.report(r, "hostile-dma-outside-ram")
        .s(" targets=")
        .dec(targets.len() as u64)
        .nl();
}

/// PRP lists that loop, chain back on themselves, point into MMIO holes or past RAM.
fn prp_lists(c: &mut Ctx, r: &mut Results) {
    let (a, b) = (dma::data_a(), dma::data_b());
    let lpp = c.lpp;
    let (good, poison, past) = (c.good, c.poison, c.past_ram());
    let mut t = Tally::default();
    for _ in 0..c.p.reps {
        // (1) The last slot of the list page chains to itself: the walk consumes nothing.
        let last = b + PAGE - 8;
        dma::write64(last, last);
        let st = sc(&c
            .n()
            .exec(true, nvme::rw(nvme::OP_READ, a, last, good, 3 * lpp)));
        t.expect(st == Some(SC_PRP_OFFSET_INVALID));
        // (2) A two-slot list at the end of a page chains back to its own start: the same
        // data page repeats. Legal but odd: must complete, any status, guards untouched.
        let l2 = b + 2 * PAGE - 16;
        dma::write64(l2, a + PAGE);
        dma::write64(l2 + 8, l2);
        let st = sc(&c
            .n()
            .exec(true, nvme::rw(nvme::OP_READ, a, l2, good, 8 * lpp)));
        t.expect(st == Some(SC_SUCCESS) || st == Some(SC_PRP_OFFSET_INVALID));
        // (3) List entries into MMIO holes (BAR window, ECAM): write refused whole, read
        // fails.
        let l3 = b + 2 * PAGE;
        dma::write64(l3, a + 2 * PAGE);
        dma::write64(l3 + 8, 0xc000_0000);
        dma::write64(l3 + 16, 0xe000_0000);
        let st = sc(&c.n().exec(
            true,
            nvme::rw(nvme::OP_WRITE, a + PAGE, l3, poison, 4 * lpp),
        ));
        t.expect(st == Some(SC_DATA_TRANSFER_ERROR));
        let st = sc(&c
            .n()
            .exec(true, nvme::rw(nvme::OP_READ, a + PAGE, l3, good, 4 * lpp)));
        t.expect(st == Some(SC_DATA_TRANSFER_ERROR));
        // (4) The list itself in the ECAM, and past RAM.
        for l in [0xe000_0000, past] {
            let st = sc(&c
                .n()
                .exec(true, nvme::rw(nvme::OP_WRITE, a, l, poison, 3 * lpp)));
            t.expect(st == Some(SC_DATA_TRANSFER_ERROR));
        }
    }
    t.broken = !c.io_works();
    t.report(r, "hostile-prp-lists").nl();
}

/// SQ tail and CQ head doorbells beyond the queue size: ignored, reported by an
/// asynchronous event (once until the Error Information log is read), the queue survives.
fn doorbells(c: &mut Ctx, r: &mut Results) {
    let mut t = Tally::default();
    let bar0 = c.s.n.bar0;
    let sq1 = c.s.n.doorbell_reg(1, 0);
    let cq1 = c.s.n.doorbell_reg(1, 1);
    let events_before = irq_count(NVME_ADMIN_VECTOR);
    // SQ tail beyond the queue, with an AER outstanding.
    let aer = c
        .n()
        .submit(false, nvme::command(nvme::OP_ASYNC_EVENT, 0, 0, 0));
    mmio::write32(bar0 + sq1, nvme::IO_ENTRIES as u32 + 3);
    let e = c.n().wait(false, aer, nvme::OP_ASYNC_EVENT);
    t.expect(
        e.as_ref()
            .is_some_and(|e| e.status == 0 && e.dw0 == AEN_INVALID_DOORBELL),
    );
    t.broken |= !c.io_works();
    // Read the Error Information log (re-arms error events), then a CQ head beyond the queue.
    let page = dma::data_b() + 3 * PAGE;
    let mut cmd = nvme::command(nvme::OP_GET_LOG_PAGE, 0xffff_ffff, page, 0);
    cmd[10] = 1 | 15 << 16;
    t.broken |= c.n().ok(false, cmd).is_none();
    let aer = c
        .n()
        .submit(false, nvme::command(nvme::OP_ASYNC_EVENT, 0, 0, 0));
    mmio::write32(bar0 + cq1, nvme::IO_ENTRIES as u32 + 9);
    let e = c.n().wait(false, aer, nvme::OP_ASYNC_EVENT);
    t.expect(
        e.as_ref()
            .is_some_and(|e| e.status == 0 && e.dw0 == AEN_INVALID_DOORBELL),
    );
    t.broken |= !c.io_works();
    // A storm of distinct bad values (events stay masked: nothing to complete).
    let storm = 16 * c.p.reps;
    let mut i = 0;
    while i < storm {
        mmio::write32(bar0 + sq1, nvme::IO_ENTRIES as u32 + (i as u32 % 200));
        mmio::write32(bar0 + cq1, 0xffff - i as u32);
        t.expect(true);
        i += 1;
    }
    t.broken |= !c.io_works();
    t.report(r, "hostile-doorbells")
        .s(" storm=")
        .dec(storm)
        .s(" admin-irqs=")
        .dec(irq_count(NVME_ADMIN_VECTOR) - events_before)
        .nl();
}

/// Rewrites an MSI-X entry the way drivers do: masked while it changes, then unmasked (so
/// each call is one refusal when the message is bogus, and no half-written message is ever
/// live).
fn table_write(table: u64, entry: u16, addr: u64, data: u32) {
    let e = table + 16 * entry as u64;
    mmio::write32(e + 12, 1);
    mmio::write32(e, addr as u32);
    mmio::write32(e + 4, (addr >> 32) as u32);
    mmio::write32(e + 8, data);
    mmio::write32(e + 12, 0);
}

fn apic_addr() -> u64 {
    0xfee0_0000 | (crate::interrupts::apic_id() as u64) << 12
}

/// MSI-X entries with messages that are no x86 interrupts: the VMM does not route them
/// (the vector's interrupts wait), other vectors keep working, and a valid message
/// delivers what waited.
fn msix_messages(c: &mut Ctx, r: &mut Results) {
    let mut t = Tally::default();
    let Some(table) = Msix::probe(c.nf).map(|m| m.table()) else {
        r.report("hostile-msix", false).s("no msi-x").nl();
        return;
    };
    let bogus: [(u64, u32); 4] = [
        (0xdead_0000, NVME_IO_VECTOR as u32),
        (0x1_0000_0000 | apic_addr(), NVME_IO_VECTOR as u32),
        (apic_addr(), 0x0001_0000 | NVME_IO_VECTOR as u32),
        (apic_addr(), 0x0300 | NVME_IO_VECTOR as u32),
    ];
    // Take every interrupt still pending from earlier groups (they are delivered only while
    // the guest halts with interrupts on), so the count below sees only new ones.
    wait_until(|| false, 20);
    let io_before = irq_count(NVME_IO_VECTOR);
    for rep in 0..c.p.reps {
        for &(addr, data) in &bogus {
            table_write(table, 1, addr, data);
            if rep == 0 {
                // I/O completes (polled) but its interrupt is not delivered anywhere.
                let done = c.io_works();
                t.expect(done);
            } else {
                t.expect(true);
            }
        }
    }
    let silent = !wait_until(|| irq_count(NVME_IO_VECTOR) > io_before, 100);
    // The admin vector was never touched: still delivers.
    let admin = irq_count(NVME_ADMIN_VECTOR);
    let page = dma::data_b() + 3 * PAGE;
    let mut cmd = nvme::command(nvme::OP_IDENTIFY, 0, page, 0);
    cmd[10] = 1;
    let admin_ok = c.n().ok(false, cmd).is_some()
        && wait_until(|| irq_count(NVME_ADMIN_VECTOR) > admin, c.p.wait_ms);
    // A valid message: the interrupts that waited in the eventfd are delivered now. (Every
    // wait for something that must come is bounded by `wait_ms`, as in
    // interrupts::MUST_ARRIVE_MS.)
    table_write(table, 1, apic_addr(), NVME_IO_VECTOR as u32);
    let delivered = wait_until(|| irq_count(NVME_IO_VECTOR) > io_before, c.p.wait_ms);
    t.broken = !(silent && admin_ok && delivered);

    // dmatest: its only vector bogus, a copy still completes; restored, the interrupt comes.
    let d_table = Msix::probe(c.df).map(|m| m.table()).unwrap_or(0);
    let d_before = irq_count(DMATEST_VECTOR);
    table_write(d_table, 0, 0xdead_0000, DMATEST_VECTOR as u32);
    t.expect(true);
    let copied = dt_copy(c.df, dma::page(6), dma::page(7)) == Some(DT_DONE);
    let d_silent = !wait_until(|| irq_count(DMATEST_VECTOR) > d_before, 100);
    table_write(d_table, 0, apic_addr(), DMATEST_VECTOR as u32);
    let d_delivered = wait_until(|| irq_count(DMATEST_VECTOR) > d_before, c.p.wait_ms);
    t.broken |= !(copied && d_silent && d_delivered);
    t.report(r, "hostile-msix")
        .s(" io-silent=")
        .dec(silent as u64)
        .s(" admin-ok=")
        .dec(admin_ok as u64)
        .s(" delivered-after-fix=")
        .dec(delivered as u64)
        .s(" dmatest=")
        .dec((copied && d_silent && d_delivered) as u64)
        .nl();
}

fn write64(addr: u64, v: u64) {
    // SAFETY: a device register in a BAR the VMM assigned; one 8-byte access.
    unsafe { write_volatile(addr as *mut u64, v) }
}

/// One dmatest copy of a page; the final status (`None`: it never finished). Completion is
/// the COMPLETED counter moving (a STATUS read right after the start could still show the
/// previous copy's result).
fn dt_copy(f: Func, src: u64, dst: u64) -> Option<u32> {
    let bar0 = f.bar(0);
    let before = mmio::read32(bar0 + DT_COMPLETED);
    write64(bar0 + DT_SRC, src);
    write64(bar0 + DT_DST, dst);
    mmio::write32(bar0 + DT_LEN, PAGE as u32);
    mmio::write32(bar0 + DT_IRQ_VECTOR, 0);
    mmio::write32(bar0 + DT_CMD, 1);
    let done = wait_until(|| mmio::read32(bar0 + DT_COMPLETED) != before, 2_000);
    let st = mmio::read32(bar0 + DT_STATUS) & (DT_DONE | DT_ERROR);
    mmio::write32(bar0 + DT_CMD, 2);
    done.then_some(st)
}

/// dmatest copies from and to addresses outside guest RAM: error status, fault counted by
/// the device, nothing copied.
fn dmatest_outside(c: &mut Ctx, r: &mut Results) {
    let mut t = Tally::default();
    let bar0 = c.df.bar(0);
    let faults = mmio::read32(bar0 + DT_FAULTS);
    let (src, dst) = (dma::page(6), dma::page(7));
    dma::fill_pattern(src, PAGE, 0x5eed);
    let past = c.past_ram();
    for _ in 0..c.p.reps {
        for (s, d) in [
            (src, past),
            (src, 0xfee0_0000),
            (0xe000_0000, dst),
            (src, c.s.n.bar0),
        ] {
            t.expect(dt_copy(c.df, s, d) == Some(DT_ERROR));
        }
    }
    let counted = mmio::read32(bar0 + DT_FAULTS).wrapping_sub(faults) as u64;
    dma::zero(dst, PAGE);
    let works =
        dt_copy(c.df, src, dst) == Some(DT_DONE) && dma::check_pattern(dst, PAGE, 0x5eed).is_none();
    t.broken = !works || counted < t.injected;
    t.report(r, "hostile-dmatest-outside-ram")
        .s(" device-faults=")
        .dec(counted)
        .nl();
}

/// Reads a 64-bit memory BAR's two registers.
fn bar_regs(f: Func, idx: u16) -> (u32, u32) {
    (f.read32(0x10 + 4 * idx), f.read32(0x14 + 4 * idx))
}

/// BARs programmed over RAM, over another device's BAR, over an MSI-X table page and over
/// the LAPIC: refused, the BAR keeps decoding where it was and the RAM / other device /
/// LAPIC behind the address is untouched.
fn bars(c: &mut Ctx, r: &mut Results, target: u64) {
    let mut t = Tally::default();
    let (nf, df) = (c.nf, c.df);
    let nvme_bar0 = nf.bar(0);
    let nvme_bar4 = nf.bar(4);
    let dt_bar0 = df.bar(0);
    let dt_bar1 = df.bar(1);
    let (lo, hi) = bar_regs(nf, 0);
    let dt_reg = df.read32(0x10);
    let ticks0 = ticks();
    let nvme_table = Msix::probe(nf).map(|m| m.table()).unwrap_or(0);
    let entry1 = mmio::read32(nvme_table + 16);
    for _ in 0..c.p.reps {
        // NVMe BAR0 (64-bit) over guest RAM: low half first, as drivers write it.
        nf.write32(0x10, target as u32 | (lo & 0xf));
        nf.write32(0x14, 0);
        // The RAM still reads as RAM (guard checked at the end), not as registers.
        t.expect(mmio::read32(target + nvme::REG_CSTS) != 1);
        nf.write32(0x10, lo);
        nf.write32(0x14, hi);
        t.expect(mmio::read32(nvme_bar0 + nvme::REG_CSTS) & nvme::CSTS_RDY != 0);
        // NVMe BAR0 over the dmatest BAR (32-bit window).
        nf.write32(0x10, (dt_bar0 as u32 & !0x3fff) | (lo & 0xf));
        nf.write32(0x14, 0);
        t.expect(mmio::read32(dt_bar0) == DT_ID_VALUE);
        nf.write32(0x10, lo);
        nf.write32(0x14, hi);
        // dmatest BAR0 over the NVMe MSI-X table page, over its own MSI-X BAR, over the
        // LAPIC: the NVMe table stays the NVMe's.
        for over in [nvme_bar4, dt_bar1, 0xfee0_0000] {
            df.write32(0x10, over as u32);
            let ok =
                mmio::read32(nvme_table + 16) == entry1 && mmio::read32(dt_bar0) == DT_ID_VALUE;
            t.expect(ok);
            df.write32(0x10, dt_reg);
        }
    }
    // The LAPIC timer still ticks, both devices still work at their own addresses.
    let ticking = wait_until(|| ticks() > ticks0 + 2, c.p.wait_ms);
    let dt_ok = dt_copy(df, dma::page(6), dma::page(7)) == Some(DT_DONE);
    let io_ok = c.io_works();
    t.broken = !(ticking && dt_ok && io_ok) || bar_regs(nf, 0) != (lo, hi);
    t.report(r, "hostile-bars")
        .s(" ticking=")
        .dec(ticking as u64)
        .s(" dmatest=")
        .dec(dt_ok as u64)
        .s(" nvme=")
        .dec(io_ok as u64)
        .nl();
}

/// Writes `v` at `off` and reports whether the register reads as before.
fn unchanged(f: Func, off: u16, v: u32) -> bool {
    let before = f.read32(off);
    f.write32(off, v);
    f.read32(off) == before
}

/// Writes to read-only and forbidden config fields, extended space included: dropped.
fn config_writes(c: &mut Ctx, r: &mut Results) {
    let mut t = Tally::default();
    for f in [c.nf, c.df] {
        let msix = f.find_cap(CAP_MSIX);
        let pcie = f.find_cap(PCIE_CAP);
        let pm = f.find_cap(PM_CAP);
        for _ in 0..c.p.reps {
            // Identity, class, header type, subsystem, capability pointer, interrupt pin.
            t.expect(unchanged(f, 0x00, 0xffff_ffff));
            t.expect(unchanged(f, 0x08, 0xffff_ffff));
            let hdr = f.read32(0x0c);
            f.write32(0x0c, hdr ^ 0x00ff_0000);
            t.expect(f.read32(0x0c) >> 16 & 0xff == hdr >> 16 & 0xff);
            t.expect(unchanged(f, 0x2c, 0x1234_5678));
            t.expect(unchanged(f, 0x34, 0xffff_ffff));
            let intr = f.read32(0x3c);
            f.write32(0x3c, intr ^ 0xff00);
            t.expect(f.read32(0x3c) >> 8 & 0xff == intr >> 8 & 0xff);
            if let Some(m) = msix {
                // Header (id, next) and the table / PBA location.
                let h = f.read32(m);
                f.write32(m, (h & 0xffff_0000) | 0xffff);
                t.expect(f.read32(m) & 0xffff == h & 0xffff);
                t.expect(unchanged(f, m + 4, 0xffff_fff8));
                t.expect(unchanged(f, m + 8, 0xffff_fff8));
            }
            if let Some(e) = pcie {
                t.expect(unchanged(f, e, 0xffff_ffff));
                t.expect(unchanged(f, e + 4, 0));
            }
            if let Some(pm) = pm {
                // Power state D3hot belongs to the lender.
                let before = f.read32(pm + 4);
                f.write32(pm + 4, (before & !3) | 3);
                t.expect(f.read32(pm + 4) & 3 == before & 3);
            }
            // Extended config space.
            for off in [0x100u16, 0x104, 0x200, 0x400, 0xffc] {
                t.expect(unchanged(f, off, 0xdead_beef));
            }
        }
    }
    // Both devices still answer as themselves and work.
    let id_ok = c.df.id() == dmatest::ID && c.nf.class() == nvme::CLASS;
    let dt_ok = dt_copy(c.df, dma::page(6), dma::page(7)) == Some(DT_DONE);
    let io_ok = c.io_works();
    t.broken = !(id_ok && dt_ok && io_ok);
    t.report(r, "hostile-config").nl();
}

/// Initiates a function level reset through the PCIe capability's Device Control.
fn flr(f: Func) -> bool {
    let Some(e) = f.find_cap(PCIE_CAP) else {
        return false;
    };
    let ctl = f.read32(e + 8);
    f.write32(e + 8, ctl | 1 << 15);
    true
}

/// FLR storms on both devices, back to back; then both are set up again and work.
fn flr_storm(c: &mut Ctx, r: &mut Results) {
    let mut t = Tally::default();
    let t0 = ticks();
    for _ in 0..c.p.flrs {
        let a = flr(c.nf);
        let b = flr(c.df);
        // After an FLR the function is reset: Command cleared (no decode, no DMA).
        t.expect(a && c.nf.command() & (CMD_MEM | CMD_BUS_MASTER) == 0);
        t.expect(b && c.df.command() & (CMD_MEM | CMD_BUS_MASTER) == 0);
    }
    let ms = ticks() - t0;
    // Set both up again from scratch, as a driver would after a reset.
    let again = nvme::setup(c.nf, r, c.p.nvme);
    let mut ok = again.is_some();
    if let Some(mut s) = again {
        s.n.quiet = true;
        c.s = s;
        ok &= c.io_works();
    }
    c.df.set_command(CMD_MEM | CMD_BUS_MASTER | CMD_INTX_DISABLE);
    if let Some(m) = Msix::probe(c.df) {
        m.route(0, DMATEST_VECTOR);
        m.enable(true);
    }
    let before = irq_count(DMATEST_VECTOR);
    let dt_ok = dt_copy(c.df, dma::page(6), dma::page(7)) == Some(DT_DONE)
        && wait_until(|| irq_count(DMATEST_VECTOR) > before, c.p.wait_ms);
    t.broken = !(ok && dt_ok);
    t.report(r, "hostile-flr-storm")
        .s(" flrs=")
        .dec(c.p.flrs)
        .s(" ms=")
        .dec(ms)
        .s(" nvme=")
        .dec(ok as u64)
        .s(" dmatest=")
        .dec(dt_ok as u64)
        .nl();
}

#[allow(dead_code)]
fn read64(addr: u64) -> u64 {
    // SAFETY: guest RAM.
    unsafe { read_volatile(addr as *const u64) }
}
