//! A minimal NVMe driver: probe by class 01:08:02, admin queue bring-up, Identify controller
//! and namespace, one I/O queue pair on MSI-X vector 1, 64-LBA write / read-back / verify
//! (PRP1 only, PRP1+PRP2, and PRP lists), Flush.
//!
//! When the controller offers Doorbell Buffer Config (OACS bit 8) the driver enables shadow
//! doorbells after creating the I/O queues, as Linux does, and updates the I/O queue's
//! doorbells the way Linux's `nvme_dbbuf_update_and_check_event` does: store the value in
//! the shadow slot, full fence, read EventIdx, write MMIO only if
//! `(u16)(new - ei - 1) < (u16)(new - old)`. `TEST nvme-doorbells` reports the I/O queue's
//! doorbell updates and the MMIO writes made for them.
//!
//! With `cmb=1` the driver turns on the controller's Controller Memory Buffer the NVMe 1.4
//! way (as Linux's `nvme_map_cmb`: CMBMSC.CRE, read CMBSZ/CMBLOC, CMBMSC = CRE | CMSE | the
//! buffer's bus address, here its guest-physical BAR address) and puts the I/O submission
//! queue there (`TEST nvme-cmb`); commands are then stored into BAR0, not guest RAM.
//!
//! Completions are polled by phase bit (a bounded spin, then `hlt` until an interrupt or the
//! 1 ms tick, bounded in time); the I/O queue's MSI-X vector is counted and reported as
//! `TEST nvme-msix ok count=N`. Everything is sized for KVM's instruction emulator: the whole
//! run is a few hundred thousand instructions plus the console output.

use crate::dma::{self, PAGE};
use crate::interrupts::{irq_count, poll_then_wait, wait_until, NVME_ADMIN_VECTOR, NVME_IO_VECTOR};
use crate::mmio;
use crate::pci::{self, Func, Msix, CMD_BUS_MASTER, CMD_INTX_DISABLE, CMD_MEM};
use crate::serial::Out;
use crate::Results;

/// Mass storage / NVM / NVMe.
pub const CLASS: u32 = 0x01_08_02;

pub const REG_CAP: u64 = 0x00;
const REG_VS: u64 = 0x08;
const REG_CC: u64 = 0x14;
pub const REG_CSTS: u64 = 0x1c;
const REG_AQA: u64 = 0x24;
const REG_ASQ: u64 = 0x28;
const REG_ACQ: u64 = 0x30;
const REG_CMBLOC: u64 = 0x38;
const REG_CMBSZ: u64 = 0x3c;
const REG_CMBMSC: u64 = 0x50;
const CAP_CMBS_HI: u32 = 1 << (57 - 32);
const CMBSZ_SQS: u32 = 1;
pub const REG_DBS: u64 = 0x1000;
pub const CSTS_RDY: u32 = 1;
const CSTS_CFS: u32 = 2;
/// CC: EN, IOSQES 64 B (2^6), IOCQES 16 B (2^4), MPS 4 KiB, NVM command set, RR arbitration.
const CC_ENABLE: u32 = 1 | 6 << 16 | 4 << 20;

const OP_FLUSH: u32 = 0x00;
pub const OP_WRITE: u32 = 0x01;
pub const OP_READ: u32 = 0x02;
const OP_CREATE_SQ: u32 = 0x01;
const OP_CREATE_CQ: u32 = 0x05;
pub const OP_IDENTIFY: u32 = 0x06;
pub const OP_GET_LOG_PAGE: u32 = 0x02;
pub const OP_ASYNC_EVENT: u32 = 0x0c;
const OP_SET_FEATURES: u32 = 0x09;
const OP_DBBUF_CONFIG: u32 = 0x7c;
/// OACS: Doorbell Buffer Config supported.
const OACS_DBBUF: u32 = 1 << 8;
const FEAT_NUM_QUEUES: u32 = 0x07;

pub const ADMIN_ENTRIES: u16 = 8;
pub const IO_ENTRIES: u16 = 16;
/// Control pages of the DMA arena.
const P_ASQ: u64 = 0;
const P_ACQ: u64 = 1;
const P_IOSQ: u64 = 2;
const P_IOCQ: u64 = 3;
const P_IDENT: u64 = 4;
const P_PRPLIST: u64 = 5;
const P_SHADOW: u64 = 6;
const P_EVENTIDX: u64 = 7;

/// LBAs written and read back.
pub const TEST_LBAS: u64 = 64;
const SPINS: u32 = 2_000;
const TIMEOUT_MS: u64 = 5_000;

/// What to write where (`seed=`, `lba=` on the command line), and `hold=1`: after the
/// set-up (Bus Master on, queues created) print `MAILBOX 0x<gpa>` and `STEP 1 nvme-ready`
/// and wait (up to `wait_ms=`) until the host writes 1 there before any I/O, so a host can
/// start the I/O of several VMs at the same moment.
#[derive(Clone, Copy)]
pub struct Params {
    pub seed: u32,
    pub slba: u64,
    pub hold: bool,
    pub wait_ms: u64,
    pub cmb: bool,
}

pub struct Queue {
    qid: u16,
    sq: u64,
    cq: u64,
    entries: u16,
    tail: u16,
    head: u16,
    phase: u32,
}

impl Queue {
    fn new(qid: u16, sq: u64, cq: u64, entries: u16) -> Self {
        dma::zero(sq, PAGE);
        dma::zero(cq, PAGE);
        Queue {
            qid,
            sq,
            cq,
            entries,
            tail: 0,
            head: 0,
            phase: 1,
        }
    }
}

pub struct Completion {
    pub dw0: u32,
    pub status: u32,
}

pub struct Nvme {
    pub bar0: u64,
    pub stride: u64,
    admin: Queue,
    io: Queue,
    cid: u16,
    /// Shadow doorbell and EventIdx pages once Doorbell Buffer Config succeeded.
    dbbuf: Option<(u64, u64)>,
    /// I/O queue doorbell updates, and MMIO doorbell writes made for them.
    io_updates: u64,
    io_mmio: u64,
    /// No console line per error completion (the hostile tests cause hundreds).
    pub quiet: bool,
}

impl Nvme {
    pub fn reg32(&self, off: u64) -> u32 {
        mmio::read32(self.bar0 + off)
    }

    fn set_reg32(&self, off: u64, v: u32) {
        mmio::write32(self.bar0 + off, v)
    }

    fn set_reg64(&self, off: u64, v: u64) {
        self.set_reg32(off, v as u32);
        self.set_reg32(off + 4, (v >> 32) as u32);
    }

    /// Sets doorbell `db` (0: SQ tail, 1: CQ head) of queue `qid` to `v`: an MMIO write, or
    /// for a shadowed I/O queue the shadow slot plus an MMIO write only if EventIdx asks.
    fn doorbell(&mut self, qid: u16, db: u64, v: u16) {
        let idx = 2 * qid as u64 + db;
        if qid != 0 {
            self.io_updates += 1;
            if let Some((shadow, eventidx)) = self.dbbuf {
                let slot = idx * self.stride;
                let old = dma::read32(shadow + slot) as u16;
                dma::write32(shadow + slot, v as u32);
                // SAFETY: a full fence; no memory operands.
                unsafe { core::arch::asm!("mfence", options(nostack, preserves_flags)) };
                let ei = dma::read32(eventidx + slot) as u16;
                if v.wrapping_sub(ei).wrapping_sub(1) >= v.wrapping_sub(old) {
                    return;
                }
            }
            self.io_mmio += 1;
        }
        mmio::write32(self.bar0 + REG_DBS + idx * self.stride, v as u32);
    }

    /// Doorbell register offset of queue `qid` (`db` 0: SQ tail, 1: CQ head).
    pub fn doorbell_reg(&self, qid: u16, db: u64) -> u64 {
        REG_DBS + (2 * qid as u64 + db) * self.stride
    }

    /// Submits `cmd` (the command id is filled in) and waits for its completion.
    pub fn exec(&mut self, io: bool, cmd: [u32; 16]) -> Option<Completion> {
        let cid = self.submit(io, cmd);
        self.wait(io, cid, cmd[0] & 0xff)
    }

    /// Writes `cmd` into the SQ and rings its doorbell; returns the command id.
    pub fn submit(&mut self, io: bool, mut cmd: [u32; 16]) -> u16 {
        self.cid = self.cid.wrapping_add(1);
        let cid = self.cid;
        cmd[0] |= (cid as u32) << 16;
        let q = if io { &mut self.io } else { &mut self.admin };
        let slot = q.sq + 64 * q.tail as u64;
        for (i, d) in cmd.iter().enumerate() {
            dma::write32(slot + 4 * i as u64, *d);
        }
        q.tail = if q.tail + 1 == q.entries {
            0
        } else {
            q.tail + 1
        };
        let (qid, tail) = (q.qid, q.tail);
        self.doorbell(qid, 0, tail);
        cid
    }

    /// Waits for the next completion of the queue, which must be `cid`'s.
    pub fn wait(&mut self, io: bool, cid: u16, opcode: u32) -> Option<Completion> {
        let cmd = [opcode; 1];
        let q = if io { &mut self.io } else { &mut self.admin };
        let entry = q.cq + 16 * q.head as u64;
        let phase = q.phase;
        let posted = || (dma::read32(entry + 12) >> 16) & 1 == phase;
        if !poll_then_wait(posted, SPINS, TIMEOUT_MS) {
            Out.s("NVME timeout: qid ")
                .dec(q.qid as u64)
                .s(" cid ")
                .dec(cid as u64)
                .s(" opcode ")
                .hex((cmd[0] & 0xff) as u64)
                .nl();
            return None;
        }
        let dw3 = dma::read32(entry + 12);
        let c = Completion {
            dw0: dma::read32(entry),
            status: (dw3 >> 17) & 0x7fff,
        };
        if dw3 & 0xffff != cid as u32 {
            Out.s("NVME completion for cid ")
                .dec((dw3 & 0xffff) as u64)
                .s(", expected ")
                .dec(cid as u64)
                .nl();
            return None;
        }
        if q.head + 1 == q.entries {
            q.head = 0;
            q.phase ^= 1;
        } else {
            q.head += 1;
        }
        let (qid, head) = (q.qid, q.head);
        self.doorbell(qid, 1, head);
        if c.status != 0 && !self.quiet {
            Out.s("NVME status ")
                .hex(c.status as u64)
                .s(" opcode ")
                .hex((cmd[0] & 0xff) as u64)
                .nl();
        }
        Some(c)
    }

    /// Runs an admin or I/O command; `Some(dw0)` on success.
    pub fn ok(&mut self, io: bool, cmd: [u32; 16]) -> Option<u32> {
        match self.exec(io, cmd) {
            Some(c) if c.status == 0 => Some(c.dw0),
            _ => None,
        }
    }
}

pub fn command(opcode: u32, nsid: u32, prp1: u64, prp2: u64) -> [u32; 16] {
    let mut c = [0u32; 16];
    c[0] = opcode;
    c[1] = nsid;
    c[6] = prp1 as u32;
    c[7] = (prp1 >> 32) as u32;
    c[8] = prp2 as u32;
    c[9] = (prp2 >> 32) as u32;
    c
}

pub fn rw(opcode: u32, prp1: u64, prp2: u64, slba: u64, nlb: u64) -> [u32; 16] {
    let mut c = command(opcode, 1, prp1, prp2);
    c[10] = slba as u32;
    c[11] = (slba >> 32) as u32;
    c[12] = (nlb - 1) as u32;
    c
}

/// Bytes of the identify page `[off, off + len)` without trailing spaces.
fn ident_str(off: u64, len: usize) -> &'static [u8] {
    // SAFETY: the identify page is arena memory the device finished writing.
    let s = unsafe { core::slice::from_raw_parts((dma::page(P_IDENT) + off) as *const u8, len) };
    match s.iter().rposition(|&c| c != b' ' && c != 0) {
        Some(last) => s.get(..last + 1).unwrap_or(s),
        None => &[],
    }
}

/// Writes a PRP list for `count` pages starting at `first` into the list page.
fn prp_list(first: u64, count: u64) -> u64 {
    let list = dma::page(P_PRPLIST);
    let mut i = 0;
    while i < count {
        dma::write64(list + 8 * i, first + i * PAGE);
        i += 1;
    }
    list
}

/// Finds the first NVMe controller and runs the driver test on it.
pub fn test(r: &mut Results, p: Params) {
    match pci::find(|f| f.class() == CLASS) {
        Some(f) => test_on(f, r, p),
        None => {
            r.report("nvme-probe", false)
                .s("no function with class 010802 on bus 0")
                .nl();
        }
    }
}

/// A controller brought up by [`setup`]: admin and one I/O queue pair (vector 1), no shadow
/// doorbells yet.
pub struct Setup {
    pub n: Nvme,
    pub msix: Msix,
    /// log2 of the LBA size.
    pub lbads: u32,
    /// Identify Controller OACS.
    pub oacs: u32,
    pub admin_irqs: u64,
    pub io_irqs: u64,
}

/// The full driver test on function `f`.
pub fn test_on(f: Func, r: &mut Results, p: Params) {
    let Some(Setup {
        mut n,
        msix: _msix,
        lbads,
        oacs,
        admin_irqs,
        io_irqs,
    }) = setup(f, r, p)
    else {
        return;
    };
    if p.hold {
        crate::bme::announce_mailbox();
        let go = crate::bme::step(1, "nvme-ready", p.wait_ms);
        r.report("nvme-hold", go)
            .s("released ")
            .s(if go { "yes" } else { "no" })
            .nl();
        if !go {
            return;
        }
    }
    run_io(&mut n, r, p, lbads, oacs, admin_irqs, io_irqs);
}

/// Turns the CMB on (NVMe 1.4 scheme) and returns its guest-physical address (the start of
/// the buffer, where the I/O SQ goes) and CMBSZ; `None` without CAP.CMBS or CMBSZ.SQS.
fn map_cmb(n: &Nvme) -> Option<(u64, u32)> {
    if n.reg32(REG_CAP + 4) & CAP_CMBS_HI == 0 {
        return None;
    }
    n.set_reg32(REG_CMBMSC + 4, 0);
    n.set_reg32(REG_CMBMSC, 1); // CRE
    let sz = n.reg32(REG_CMBSZ);
    if sz & CMBSZ_SQS == 0 {
        return None;
    }
    let loc = n.reg32(REG_CMBLOC);
    let unit = 4096u64 << (4 * ((sz >> 8) & 0xf));
    if loc & 7 != 0 {
        return None; // only a CMB in BAR0 is supported here
    }
    let addr = n.bar0 + (loc >> 12) as u64 * unit;
    // CBA high dword first, then the low dword with CRE | CMSE (as Linux's hi_lo_writeq).
    n.set_reg32(REG_CMBMSC + 4, (addr >> 32) as u32);
    n.set_reg32(REG_CMBMSC, (addr as u32 & !0xfff) | 3);
    Some((addr, sz))
}

/// Probe, MSI-X (vectors 0 and 1), enable, identify, one I/O queue pair. Reports
/// `nvme-probe`, `nvme-enable`, `nvme-identify`, `nvme-namespace`, `nvme-queues`.
pub fn setup(f: Func, r: &mut Results, p: Params) -> Option<Setup> {
    let bar0 = f.bar(0);
    f.set_command(CMD_MEM | CMD_BUS_MASTER | CMD_INTX_DISABLE);
    let msix = Msix::probe(f);
    let ok = bar0 != 0 && msix.as_ref().is_some_and(|m| m.vectors >= 2);
    let o = f
        .print_id(f.print(r.report("nvme-probe", ok)).s(" "))
        .s(" bar0 ")
        .hex(bar0);
    match &msix {
        Some(m) => o
            .s(" msix-table ")
            .hex(m.table())
            .s(" vectors ")
            .dec(m.vectors as u64)
            .nl(),
        None => o.s(" no msi-x").nl(),
    }
    let msix = msix?;
    if !ok {
        return None;
    }
    msix.route(0, NVME_ADMIN_VECTOR);
    msix.route(1, NVME_IO_VECTOR);
    msix.enable(true);
    let admin_irqs = irq_count(NVME_ADMIN_VECTOR);
    let io_irqs = irq_count(NVME_IO_VECTOR);

    // Reset, program the admin queue, enable.
    let cap = mmio::read32(bar0 + REG_CAP) as u64 | (mmio::read32(bar0 + REG_CAP + 4) as u64) << 32;
    let vs = mmio::read32(bar0 + REG_VS);
    let mut n = Nvme {
        bar0,
        stride: 4 << ((cap >> 32) & 0xf),
        admin: Queue::new(0, dma::page(P_ASQ), dma::page(P_ACQ), ADMIN_ENTRIES),
        io: Queue::new(1, dma::page(P_IOSQ), dma::page(P_IOCQ), IO_ENTRIES),
        cid: 0,
        dbbuf: None,
        io_updates: 0,
        io_mmio: 0,
        quiet: false,
    };
    n.set_reg32(REG_CC, 0);
    let disabled = wait_until(|| n.reg32(REG_CSTS) & CSTS_RDY == 0, TIMEOUT_MS);
    n.set_reg32(
        REG_AQA,
        (ADMIN_ENTRIES as u32 - 1) << 16 | (ADMIN_ENTRIES as u32 - 1),
    );
    n.set_reg64(REG_ASQ, n.admin.sq);
    n.set_reg64(REG_ACQ, n.admin.cq);
    n.set_reg32(REG_CC, CC_ENABLE);
    let ready = disabled
        && wait_until(
            || n.reg32(REG_CSTS) & (CSTS_RDY | CSTS_CFS) != 0,
            TIMEOUT_MS,
        );
    let csts = n.reg32(REG_CSTS);
    let ok = ready && csts & CSTS_RDY != 0 && csts & CSTS_CFS == 0;
    r.report("nvme-enable", ok)
        .s("cap ")
        .hex(cap)
        .s(" vs ")
        .hex(vs as u64)
        .s(" csts ")
        .hex(csts as u64)
        .nl();
    if !ok {
        return None;
    }

    // Identify controller (CNS 1) and namespace 1 (CNS 0).
    let ident = dma::page(P_IDENT);
    dma::zero(ident, PAGE);
    let mut c = command(OP_IDENTIFY, 0, ident, 0);
    c[10] = 1;
    let ok = n.ok(false, c).is_some();
    r.report("nvme-identify", ok)
        .s("model \"")
        .bytes(ident_str(24, 40))
        .s("\" serial \"")
        .bytes(ident_str(4, 20))
        .s("\" fw \"")
        .bytes(ident_str(64, 8))
        .s("\"")
        .nl();
    if !ok {
        return None;
    }
    let oacs = dma::read32(ident + 256) & 0xffff;
    dma::zero(ident, PAGE);
    let ok = n.ok(false, command(OP_IDENTIFY, 1, ident, 0)).is_some();
    let nsze = dma::read64(ident);
    let flbas = (dma::read32(ident + 24) >> 16) & 0xf;
    let lbads = (dma::read32(ident + 128 + 4 * flbas as u64) >> 16) & 0xff;
    let ok = ok && (9..=12).contains(&lbads) && nsze >= p.slba + TEST_LBAS;
    r.report("nvme-namespace", ok)
        .s("nsze ")
        .dec(nsze)
        .s(" lba ")
        .dec(1 << lbads)
        .nl();
    if !ok {
        return None;
    }

    if p.cmb {
        let sq = map_cmb(&n);
        let o = r.report("nvme-cmb", sq.is_some());
        match sq {
            Some((addr, sz)) => {
                n.io.sq = addr;
                o.s("io sq at ").hex(addr).s(" cmbsz ").hex(sz as u64).nl();
            }
            None => {
                o.s("no usable controller memory buffer").nl();
                return None;
            }
        }
    }

    // One I/O queue pair: Set Features (Number of Queues), Create CQ (vector 1), Create SQ.
    let mut c = command(OP_SET_FEATURES, 0, 0, 0);
    c[10] = FEAT_NUM_QUEUES;
    let granted = n.ok(false, c);
    let mut c = command(OP_CREATE_CQ, 0, n.io.cq, 0);
    c[10] = (IO_ENTRIES as u32 - 1) << 16 | 1;
    c[11] = 1 << 16 | 1 << 1 | 1; // IV 1, IEN, PC
    let cq = n.ok(false, c).is_some();
    let mut c = command(OP_CREATE_SQ, 0, n.io.sq, 0);
    c[10] = (IO_ENTRIES as u32 - 1) << 16 | 1;
    c[11] = 1 << 16 | 1; // CQID 1, PC
    let sq = cq && n.ok(false, c).is_some();
    let ok = granted.is_some() && sq;
    r.report("nvme-queues", ok)
        .s("io sq 1 cq 1 vector 1 granted ")
        .hex(granted.unwrap_or(0) as u64)
        .nl();
    if !ok {
        return None;
    }
    Some(Setup {
        n,
        msix,
        lbads,
        oacs,
        admin_irqs,
        io_irqs,
    })
}

/// Shadow doorbells (if offered), the 64-LBA write / read-back, Flush, interrupts.
fn run_io(
    n: &mut Nvme,
    r: &mut Results,
    p: Params,
    lbads: u32,
    oacs: u32,
    admin_irqs: u64,
    io_irqs: u64,
) {
    // Shadow doorbells, when offered (after the I/O queues exist, as Linux does).
    if oacs & OACS_DBBUF != 0 {
        let (shadow, eventidx) = (dma::page(P_SHADOW), dma::page(P_EVENTIDX));
        dma::zero(shadow, PAGE);
        dma::zero(eventidx, PAGE);
        let ok = n
            .ok(false, command(OP_DBBUF_CONFIG, 0, shadow, eventidx))
            .is_some();
        if ok {
            n.dbbuf = Some((shadow, eventidx));
        }
        r.report("nvme-dbbuf", ok)
            .s("shadow ")
            .hex(shadow)
            .s(" eventidx ")
            .hex(eventidx)
            .nl();
        if !ok {
            return;
        }
    }

    // Write 64 LBAs from buffer A in three commands: one page (PRP1), two pages
    // (PRP1 + PRP2), the rest (PRP1 + a PRP list).
    let lba_shift = 12 - lbads; // LBAs per page = 1 << lba_shift
    let bytes = TEST_LBAS << lbads;
    let pages = bytes / PAGE;
    let a = dma::data_a();
    dma::fill_pattern(a, bytes, p.seed);
    let mut ok = n
        .ok(true, rw(OP_WRITE, a, 0, p.slba, 1 << lba_shift))
        .is_some();
    ok = ok
        && n.ok(
            true,
            rw(
                OP_WRITE,
                a + PAGE,
                a + 2 * PAGE,
                p.slba + (1 << lba_shift),
                2 << lba_shift,
            ),
        )
        .is_some();
    let rest = pages - 3;
    let list = prp_list(a + 4 * PAGE, rest - 1);
    ok = ok
        && n.ok(
            true,
            rw(
                OP_WRITE,
                a + 3 * PAGE,
                list,
                p.slba + (3 << lba_shift),
                rest << lba_shift,
            ),
        )
        .is_some();
    r.report("nvme-write", ok)
        .s("lbas ")
        .dec(TEST_LBAS)
        .s(" at ")
        .dec(p.slba)
        .s(" bytes ")
        .dec(bytes)
        .s(" seed ")
        .hex(p.seed as u64)
        .s(" commands 3 (prp1, prp1+prp2, prp list)")
        .nl();
    if !ok {
        return;
    }

    // Read everything back into buffer B with one command (PRP list) and compare.
    let b = dma::data_b();
    dma::zero(b, bytes);
    let list = prp_list(b + PAGE, pages - 1);
    let read = n
        .ok(true, rw(OP_READ, b, list, p.slba, TEST_LBAS))
        .is_some();
    let bad = dma::check_pattern(b, bytes, p.seed);
    let o = r.report("nvme-read", read && bad.is_none());
    match (read, bad) {
        (true, None) => o
            .s("lbas ")
            .dec(TEST_LBAS)
            .s(" verified ")
            .dec(bytes)
            .s(" bytes")
            .nl(),
        (true, Some(off)) => o
            .s("mismatch at byte ")
            .dec(off)
            .s(": ")
            .hex(dma::read64(b + off))
            .nl(),
        (false, _) => o.s("read command failed").nl(),
    }

    let flushed = n.ok(true, command(OP_FLUSH, 1, 0, 0)).is_some();
    r.report("nvme-flush", flushed).s("nsid 1").nl();
    r.report("nvme-doorbells", true)
        .s("shadow ")
        .s(if n.dbbuf.is_some() { "on" } else { "off" })
        .s(" updates=")
        .dec(n.io_updates)
        .s(" mmio=")
        .dec(n.io_mmio)
        .nl();

    // Every I/O completion raised vector 1; at least one must have reached the IDT.
    let got = wait_until(|| irq_count(NVME_IO_VECTOR) > io_irqs, crate::interrupts::MUST_ARRIVE_MS);
    // The admin queue's vector 0 is informational (a lower-priority vector still pending
    // when the wait above returns is taken here).
    wait_until(|| irq_count(NVME_ADMIN_VECTOR) > admin_irqs, 100);
    let count = irq_count(NVME_IO_VECTOR) - io_irqs;
    r.report("nvme-msix", got)
        .s("count=")
        .dec(count)
        .s(" admin=")
        .dec(irq_count(NVME_ADMIN_VECTOR) - admin_irqs)
        .nl();
}

/// Stops a controller before its function goes away: CC.EN = 0 (no more DMA or interrupts).
pub fn quiesce(f: Func) {
    let bar0 = f.bar(0);
    if bar0 != 0 && f.command() & CMD_MEM != 0 {
        mmio::write32(bar0 + REG_CC, 0);
        // All ones: the function is already gone (surprise removal); nothing to wait for.
        wait_until(
            || {
                let csts = mmio::read32(bar0 + REG_CSTS);
                csts & CSTS_RDY == 0 || csts == 0xffff_ffff
            },
            1_000,
        );
    }
}
