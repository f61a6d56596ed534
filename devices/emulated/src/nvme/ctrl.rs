//! The controller state machine: register diffing, queue processing, command execution.
//! Runs on the controller thread (and synchronously for trapped page-0 writes) under a mutex.

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cmb::{CmbState, CAP_CMBS};
use super::identify::{self, SmartCounters, VERSION};
use super::prp::{self, Segment};
use super::spec::*;
use super::{NvmeConfig, NvmeStats};
use crate::dma::DmaMemory;
use crate::engine::{AlignedBuf, Engine, IoDone, IoKind, IoOp};
use crate::irq::{InterruptMode, InterruptSink};
use crate::regs::RegisterMemory;
use dbbuf::{cq_slot, read_slot, sq_slot, Dbbuf};
pub(crate) use dbbuf::{DbbufState, MAX_KICK_QUEUES};

mod dbbuf;

/// Outstanding Asynchronous Event Requests allowed (AERL + 1).
const MAX_AERS: usize = 4;
/// SQEs fetched from one queue per pass (fairness between queues).
const FETCH_BUDGET: usize = 64;
/// Asynchronous event (completion dword 0): type Error Status (0), information Invalid
/// Doorbell Write Value (01h), log page Error Information (01h). NVMe 1.4 5.2.1.
pub(crate) const AEN_INVALID_DOORBELL_VALUE: u32 = 1 << 16 | 1 << 8;

/// Whether the `n`th occurrence of a guest-triggerable event is logged at warn level: the
/// first 16, then one in 1024 (a hostile guest can repeat it in a loop).
fn loud(n: u64) -> bool {
    n <= 16 || n.is_multiple_of(1024)
}

struct SubQ {
    base: u64,
    /// Tail comes from the shadow doorbell buffer (Doorbell Buffer Config), not BAR0.
    shadow: bool,
    size: u16,
    head: u16,
    cqid: u16,
    /// Commands fetched from this queue whose completion is not yet produced (engine I/O,
    /// a pending Delete I/O SQ). Bound: fetching stops at `size` (as QEMU bounds a queue's
    /// requests by its size), and by the CQ's room before that.
    inflight: u32,
    deleting: Option<u16>,
    /// The out-of-range tail last refused (counted once per value written, not per pass).
    bad_tail: Option<u32>,
}

struct CompQ {
    base: u64,
    /// Head comes from the shadow doorbell buffer, not BAR0.
    shadow: bool,
    /// EventIdx last written for this CQ (written again only when it changes).
    event_idx: Option<u32>,
    size: u16,
    tail: u16,
    head: u16,
    phase: bool,
    ien: bool,
    vector: u16,
    /// Completions fetched commands of this CQ's SQs still owe (not yet written or held).
    /// A command is fetched only while `used + reserved + held < size - 1`, so a CQ the
    /// host never consumes stops its SQs instead of queueing completions (a real
    /// controller's behaviour): a guest cannot make the lender hold more than that.
    reserved: u32,
    /// Completions produced while the ring had no room. Every one had a reserved slot when
    /// its command was fetched, so this only fills when the host moved its head backwards
    /// (its own ring is then corrupt) or for Asynchronous Event Request completions.
    /// Bound: `size - 1 + MAX_AERS` entries (checked in `complete`).
    held: VecDeque<Cqe>,
    /// Fetch stopped for lack of room here: EventIdx asks for the next head update.
    starved: bool,
    unsignalled: u32,
    first_unsignalled: Option<Instant>,
    /// The out-of-range head last refused.
    bad_head: Option<u32>,
}

impl CompQ {
    fn new(base: u64, shadow: bool, size: u16, ien: bool, vector: u16) -> Self {
        CompQ {
            base,
            shadow,
            event_idx: None,
            size,
            tail: 0,
            head: 0,
            phase: true,
            ien,
            vector,
            reserved: 0,
            held: VecDeque::new(),
            starved: false,
            unsignalled: 0,
            first_unsignalled: None,
            bad_head: None,
        }
    }

    fn full(&self) -> bool {
        (self.tail + 1) % self.size == self.head
    }

    /// Entries posted and not yet consumed by the host.
    fn used(&self) -> u32 {
        u32::from((self.tail + self.size - self.head) % self.size)
    }

    /// Whether one more command may be fetched for this CQ: its completion has a slot.
    fn has_room(&self) -> bool {
        self.used() + self.reserved + self.held.len() as u32 + 1 < u32::from(self.size)
    }

    /// Completions waiting for room, or a fetch stopped for it: the controller needs to
    /// hear about the next head update.
    fn waits_for_head(&self) -> bool {
        self.starved || !self.held.is_empty()
    }
}

enum Pending {
    Read(Vec<Segment>),
    Write,
    Other,
}

struct Inflight {
    sqid: u16,
    cid: u16,
    what: Pending,
}

#[derive(Clone)]
struct Features {
    arbitration: u32,
    power: u32,
    temp_threshold: u32,
    error_recovery: u32,
    wce: bool,
    coalesce_thr: u8,
    coalesce_time: u8,
    vector_cd: Vec<bool>,
    write_atomicity: u32,
    aec: u32,
}

impl Features {
    fn new(vectors: u16) -> Self {
        Features {
            arbitration: 0,
            power: 0,
            temp_threshold: 0x0157,
            error_recovery: 0,
            wce: true,
            coalesce_thr: 0,
            coalesce_time: 0,
            vector_cd: vec![false; vectors as usize],
            write_atomicity: 0,
            aec: 0,
        }
    }
}

type Done = Option<(u32, u16)>;

fn ok(dw0: u32) -> Done {
    Some((dw0, status::SUCCESS))
}

fn err(s: u16) -> Done {
    Some((0, s))
}

pub(crate) struct Ctrl {
    cfg: Arc<NvmeConfig>,
    regs: Arc<dyn RegisterMemory>,
    dma: Arc<dyn DmaMemory>,
    irq: Arc<dyn InterruptSink>,
    engine: Box<dyn Engine>,
    stats: Arc<NvmeStats>,
    nsze: u64,
    lba_shift: u32,
    cap: u64,
    mdts_bytes: usize,
    sqs: Vec<Option<SubQ>>,
    cqs: Vec<Option<CompQ>>,
    enabled: bool,
    csts: u32,
    last_cc: u32,
    intmask: u32,
    nq_sq: u16,
    nq_cq: u16,
    feats: Features,
    /// Parked Asynchronous Event Requests. Bound: MAX_AERS (more are refused).
    aers: Vec<u16>,
    /// An asynchronous event waiting for an Asynchronous Event Request to complete.
    pending_aen: Option<u32>,
    /// Error events are masked from the one reported until the host reads the Error
    /// Information log page (NVMe 1.4 5.2: one event of a type until its log is read).
    aen_error_masked: bool,
    /// Engine I/O by tag, with the free tags. Bound: commands are fetched only with a
    /// reserved CQ slot, so at most the sum of the I/O CQ sizes (max_io_queues x
    /// max_queue_entries) are in flight at once; tags are reused.
    inflight: Vec<Option<Inflight>>,
    free_tags: Vec<usize>,
    /// I/O the engine could not take yet. Bound: the in-flight commands above.
    backlog: VecDeque<IoOp>,
    /// Engine completions of one reap. Bound: the in-flight commands.
    done: Vec<IoDone>,
    /// Recycled data buffers. Bound: 256 (`recycle`), each at most MDTS.
    pool: Vec<AlignedBuf>,
    smart: SmartCounters,
    started: Instant,
    intx_level: bool,
    dbbuf: Option<Dbbuf>,
    dbbuf_state: Arc<DbbufState>,
    /// The Controller Memory Buffer, if configured (its CMBMSC is applied here).
    cmb: Option<Arc<CmbState>>,
}

impl Ctrl {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        cfg: Arc<NvmeConfig>,
        regs: Arc<dyn RegisterMemory>,
        dma: Arc<dyn DmaMemory>,
        irq: Arc<dyn InterruptSink>,
        engine: Box<dyn Engine>,
        stats: Arc<NvmeStats>,
        nsze: u64,
        cmb: Option<Arc<CmbState>>,
    ) -> Self {
        let mqes = u64::from(cfg.max_queue_entries - 1);
        // CAP: MQES, CQR, TO = 20 (10 s), DSTRD 0, CSS NVM (bit 37), MPSMIN = MPSMAX = 0,
        // CMBS (bit 57) with a CMB.
        let mut cap = mqes | (1 << 16) | (20 << 24) | (1 << 37);
        if cmb.is_some() {
            cap |= CAP_CMBS;
        }
        let q = cfg.max_io_queues as usize + 1;
        let c = Ctrl {
            lba_shift: cfg.lba_size.trailing_zeros(),
            mdts_bytes: (PAGE_SIZE as usize) << cfg.mdts,
            feats: Features::new(cfg.msix_vectors),
            nq_sq: cfg.max_io_queues,
            nq_cq: cfg.max_io_queues,
            cfg,
            regs,
            dma,
            irq,
            engine,
            stats,
            nsze,
            cap,
            sqs: (0..q).map(|_| None).collect(),
            cqs: (0..q).map(|_| None).collect(),
            enabled: false,
            csts: 0,
            last_cc: 0,
            intmask: 0,
            aers: Vec::new(),
            pending_aen: None,
            aen_error_masked: false,
            inflight: Vec::new(),
            free_tags: Vec::new(),
            backlog: VecDeque::new(),
            done: Vec::new(),
            pool: Vec::new(),
            smart: SmartCounters::default(),
            started: Instant::now(),
            intx_level: false,
            dbbuf: None,
            dbbuf_state: Arc::default(),
            cmb,
        };
        c.write_ro_registers();
        c
    }

    fn write_ro_registers(&self) {
        self.regs.write64(REG_CAP, self.cap);
        self.regs.write32(REG_VS, VERSION);
        self.regs.write32(REG_CSTS, self.csts);
        self.regs.write32(REG_INTMS, self.intmask);
        self.regs.write32(REG_INTMC, self.intmask);
        if let Some(cmb) = &self.cmb {
            self.regs.write32(REG_CMBLOC, cmb.cmbloc());
            self.regs.write32(REG_CMBSZ, cmb.cmbsz());
            self.regs.write64(REG_CMBMSC, cmb.msc());
            self.regs.write32(REG_CMBSTS, 0);
        }
    }

    /// Applies a CMBMSC the host stored (CRE makes CMBLOC/CMBSZ readable, CMSE with CBA
    /// starts routing CMB addresses to the buffer) and keeps the read-only CMB registers
    /// what they must be. Returns true if anything changed.
    fn check_cmb(&mut self) -> bool {
        let Some(cmb) = &self.cmb else {
            return false;
        };
        let stored = self.regs.read64(REG_CMBMSC);
        let changed = stored != cmb.msc();
        if changed {
            cmb.set_msc(stored);
            log::debug!(
                "nvme {}: cmbmsc {stored:#x} -> cre {} cmse {} cba {:#x}",
                self.cfg.serial,
                cmb.msc() & super::cmb::CMBMSC_CRE,
                (cmb.msc() & super::cmb::CMBMSC_CMSE) >> 1,
                cmb.msc() & super::cmb::CMBMSC_CBA
            );
        }
        if changed
            || self.regs.read32(REG_CMBLOC) != cmb.cmbloc()
            || self.regs.read32(REG_CMBSZ) != cmb.cmbsz()
            || self.regs.read32(REG_CMBSTS) != 0
        {
            self.regs.write32(REG_CMBLOC, cmb.cmbloc());
            self.regs.write32(REG_CMBSZ, cmb.cmbsz());
            self.regs.write64(REG_CMBMSC, cmb.msc());
            self.regs.write32(REG_CMBSTS, 0);
        }
        changed
    }

    /// The shadow doorbell state, for readers outside the controller lock.
    pub(crate) fn dbbuf_state(&self) -> Arc<DbbufState> {
        self.dbbuf_state.clone()
    }

    /// One round of work. Returns true if anything happened.
    pub(crate) fn pass(&mut self) -> bool {
        let mut work = self.check_page0();
        if !self.enabled {
            return work;
        }
        work |= self.reap();
        work |= self.update_cq_heads();
        work |= self.fetch();
        self.finish_deletes();
        self.engine.commit();
        self.signal();
        if self.dbbuf.is_some() {
            work |= self.arm_cq_events();
        }
        work
    }

    /// When the thread must wake at the latest (interrupt coalescing timers).
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        let t = self.agg_time();
        self.cqs
            .iter()
            .flatten()
            .filter_map(|c| c.first_unsignalled.map(|f| f + t))
            .min()
    }

    fn agg_time(&self) -> Duration {
        Duration::from_micros(100 * u64::from(self.feats.coalesce_time.max(1)))
    }

    // ---- registers -------------------------------------------------------------------------

    /// React to page-0 register changes. Returns true if something changed.
    pub(crate) fn check_page0(&mut self) -> bool {
        let mut work = self.check_cmb();
        if self.regs.read64(REG_CAP) != self.cap || self.regs.read32(REG_VS) != VERSION {
            self.regs.write64(REG_CAP, self.cap);
            self.regs.write32(REG_VS, VERSION);
        }
        if self.regs.read32(REG_CSTS) != self.csts {
            self.regs.write32(REG_CSTS, self.csts);
        }
        let ms = self.regs.read32(REG_INTMS);
        let mc = self.regs.read32(REG_INTMC);
        if ms != self.intmask || mc != self.intmask {
            let old = self.intmask;
            if ms != old {
                self.intmask |= ms;
            }
            if mc != old {
                self.intmask &= !mc;
            }
            self.regs.write32(REG_INTMS, self.intmask);
            self.regs.write32(REG_INTMC, self.intmask);
            self.update_intx();
            work = true;
        }
        let cc = self.regs.read32(REG_CC);
        if cc != self.last_cc {
            work = true;
            let old = self.last_cc;
            self.last_cc = cc;
            if old & CC_EN == 0 && cc & CC_EN != 0 {
                self.enable(cc);
            } else if old & CC_EN != 0 && cc & CC_EN == 0 {
                self.controller_reset();
            }
            let (shn_old, shn) = ((old >> 14) & 3, (cc >> 14) & 3);
            if shn != 0 && shn_old == 0 {
                self.shutdown();
            } else if shn == 0 && shn_old != 0 {
                self.csts &= !CSTS_SHST_MASK;
            }
            self.regs.write32(REG_CSTS, self.csts);
        }
        work
    }

    /// Trapped INTMS/INTMC write (exact RW1S/RW1C semantics).
    pub(crate) fn write_intm(&mut self, set: bool, v: u32) {
        if set {
            self.intmask |= v;
        } else {
            self.intmask &= !v;
        }
        self.regs.write32(REG_INTMS, self.intmask);
        self.regs.write32(REG_INTMC, self.intmask);
        self.update_intx();
    }

    fn enable(&mut self, cc: u32) {
        let aqa = self.regs.read32(REG_AQA);
        let asq = self.regs.read64(REG_ASQ) & !(PAGE_SIZE - 1);
        let acq = self.regs.read64(REG_ACQ) & !(PAGE_SIZE - 1);
        let asqs = (aqa & 0xfff) + 1;
        let acqs = ((aqa >> 16) & 0xfff) + 1;
        let css = (cc >> 4) & 7;
        let mps = (cc >> 7) & 0xf;
        let ams = (cc >> 11) & 7;
        if asqs < 2 || acqs < 2 || css != 0 || mps != 0 || ams != 0 {
            static REFUSED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = REFUSED.fetch_add(1, Ordering::Relaxed) + 1;
            if loud(n) {
                log::warn!(
                    "nvme enable refused: aqa {aqa:#x} (sq {asqs}, cq {acqs}), css {css}, \
                     mps {mps}, ams {ams} (refusal #{n})"
                );
            }
            self.csts |= CSTS_CFS;
            return;
        }
        self.cqs[0] = Some(CompQ::new(acq, false, acqs as u16, true, 0));
        self.sqs[0] = Some(SubQ {
            base: asq,
            shadow: false,
            size: asqs as u16,
            head: 0,
            cqid: 0,
            inflight: 0,
            deleting: None,
            bad_tail: None,
        });
        self.enabled = true;
        self.csts = (self.csts & !(CSTS_CFS | CSTS_SHST_MASK)) | CSTS_RDY;
        log::debug!("nvme enabled: asq {asq:#x}/{asqs} acq {acq:#x}/{acqs}");
    }

    /// Controller reset (CC.EN 1 -> 0): all queues go away, in-flight I/O is waited for.
    pub(crate) fn controller_reset(&mut self) {
        self.drain(false);
        for s in self.sqs.iter_mut() {
            *s = None;
        }
        for c in self.cqs.iter_mut() {
            *c = None;
        }
        self.aers.clear();
        self.pending_aen = None;
        self.aen_error_masked = false;
        self.pool.clear();
        // Shadow doorbells end with the controller: the driver configures them again.
        self.dbbuf = None;
        self.dbbuf_state.set(false);
        self.enabled = false;
        self.csts &= !(CSTS_RDY | CSTS_CFS);
        self.intmask = 0;
        self.feats = Features::new(self.cfg.msix_vectors);
        self.nq_sq = self.cfg.max_io_queues;
        self.nq_cq = self.cfg.max_io_queues;
        for q in 0..=self.cfg.max_io_queues {
            self.regs.write32(sq_doorbell(q), 0);
            self.regs.write32(cq_doorbell(q), 0);
        }
        self.write_ro_registers();
        if self.intx_level {
            self.intx_level = false;
            self.irq.set_intx(false);
        }
    }

    /// Function level reset: controller reset plus clearing CC/AQA/ASQ/ACQ.
    pub(crate) fn function_reset(&mut self) {
        self.controller_reset();
        self.csts = 0;
        self.last_cc = 0;
        for r in [REG_CC, REG_AQA, REG_NSSR] {
            self.regs.write32(r, 0);
        }
        self.regs.write64(REG_ASQ, 0);
        self.regs.write64(REG_ACQ, 0);
        // The CMB ends with the function: decoding off, registers hidden, contents zeroed.
        if let Some(cmb) = &self.cmb {
            cmb.set_msc(0);
            cmb.clear();
        }
        self.regs.write64(REG_CMBMSC, 0);
        self.write_ro_registers();
    }

    fn shutdown(&mut self) {
        self.csts = (self.csts & !CSTS_SHST_MASK) | (1 << 2);
        self.regs.write32(REG_CSTS, self.csts);
        self.drain(true);
        // Make everything acknowledged so far durable.
        let mut op = IoOp {
            tag: u64::MAX,
            kind: IoKind::Flush,
            offset: 0,
            len: 0,
            buf: AlignedBuf::new(0),
        };
        loop {
            match self.engine.submit(op) {
                Ok(()) => break,
                Err(back) => {
                    op = back;
                    self.wait_engine();
                    self.engine.reap(&mut self.done);
                }
            }
        }
        self.engine.commit();
        self.drain(true);
        self.csts = (self.csts & !CSTS_SHST_MASK) | CSTS_SHST_COMPLETE;
        log::debug!("nvme shutdown complete");
    }

    fn wait_engine(&self) {
        let mut p = libc::pollfd {
            fd: self.engine.completion_event().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; bounded 10 ms wait.
        unsafe { libc::poll(&mut p, 1, 10) };
        let _ = self.engine.completion_event().read();
    }

    /// Wait for all in-flight I/O; post completions if `post`, else discard them.
    pub(crate) fn drain(&mut self, post: bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            self.engine.commit();
            if post && self.enabled {
                self.reap();
            } else {
                self.resubmit_backlog();
                self.engine.reap(&mut self.done);
                for d in self.done.drain(..) {
                    if let Some(slot) = self.inflight.get_mut(d.tag as usize) {
                        if slot.take().is_some() {
                            self.free_tags.push(d.tag as usize);
                        }
                    }
                }
            }
            if self.engine.inflight() == 0 && self.backlog.is_empty() {
                break;
            }
            if Instant::now() > deadline {
                log::error!("nvme: in-flight I/O did not finish within 60 s");
                break;
            }
            self.wait_engine();
        }
        if !post {
            for s in self.sqs.iter_mut().flatten() {
                s.inflight = 0;
            }
        }
        self.engine.commit();
    }

    /// Completes every command already fetched (data DMA, completion entries) and raises
    /// their interrupts as [`Ctrl::pass`] would, without fetching new ones; `true` once no
    /// I/O is in flight, `false` at `deadline` (what is still in flight completes later).
    pub(crate) fn drain_for_handover(&mut self, deadline: Instant) -> bool {
        let done = loop {
            self.engine.commit();
            if self.enabled {
                self.reap();
            }
            if self.engine.inflight() == 0 && self.backlog.is_empty() {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
            self.wait_engine();
        };
        if self.enabled {
            self.finish_deletes();
            self.signal();
        }
        done
    }

    // ---- queues ----------------------------------------------------------------------------

    fn update_cq_heads(&mut self) -> bool {
        let mut work = false;
        for qid in 0..self.cqs.len() {
            let Some(cq) = self.cqs[qid].as_mut() else {
                continue;
            };
            let h = if cq.shadow {
                match self
                    .dbbuf
                    .and_then(|d| read_slot(&*self.dma, d.shadow, cq_slot(qid)))
                {
                    Some(h) => h,
                    None => continue,
                }
            } else {
                self.regs.read32(cq_doorbell(qid as u16))
            };
            if h >= u32::from(cq.size) {
                // Invalid Doorbell Write Value: ignored (the head stays), reported once per
                // value written.
                if cq.bad_head != Some(h) {
                    cq.bad_head = Some(h);
                    let size = cq.size;
                    self.invalid_doorbell("cq head", qid, h, size);
                }
                continue;
            }
            cq.bad_head = None;
            if h as u16 != cq.head {
                cq.head = h as u16;
                cq.starved = false;
                work = true;
                if !cq.held.is_empty() {
                    self.flush_held(qid);
                }
            }
        }
        if work {
            self.update_intx();
        }
        work
    }

    fn flush_held(&mut self, qid: usize) {
        loop {
            let Some(cq) = self.cqs[qid].as_mut() else {
                return;
            };
            if cq.full() {
                return;
            }
            let Some(e) = cq.held.pop_front() else {
                return;
            };
            self.write_cqe(qid, e);
        }
    }

    fn fetch(&mut self) -> bool {
        let mut work = false;
        for qid in 0..self.sqs.len() {
            let Some(sq) = self.sqs[qid].as_ref() else {
                continue;
            };
            if sq.deleting.is_some() {
                continue;
            }
            let tail = if sq.shadow {
                match self
                    .dbbuf
                    .and_then(|d| read_slot(&*self.dma, d.shadow, sq_slot(qid)))
                {
                    Some(t) => t,
                    None => continue,
                }
            } else {
                self.regs.read32(sq_doorbell(qid as u16))
            };
            if tail >= u32::from(sq.size) {
                // Invalid Doorbell Write Value: ignored, nothing fetched (never an entry
                // outside the queue), reported once per value written.
                let size = sq.size;
                if let Some(sq) = self.sqs[qid].as_mut().filter(|s| s.bad_tail != Some(tail)) {
                    sq.bad_tail = Some(tail);
                    self.invalid_doorbell("sq tail", qid, tail, size);
                }
                continue;
            }
            if let Some(sq) = self.sqs[qid].as_mut() {
                sq.bad_tail = None;
            }
            let mut budget = FETCH_BUDGET;
            while budget > 0 && (qid == 0 || self.backlog.is_empty()) {
                let Some(sq) = self.sqs[qid].as_mut() else {
                    break;
                };
                if u32::from(sq.head) == tail || sq.deleting.is_some() {
                    break;
                }
                // Bounded work per queue: at most `size` commands of this SQ outstanding,
                // and none whose completion the CQ could not take. The SQ entries stay in
                // guest memory until the host makes room (advances the CQ head).
                if sq.inflight >= u32::from(sq.size) {
                    break;
                }
                let cqid = sq.cqid as usize;
                let Some(cq) = self.cqs.get_mut(cqid).and_then(Option::as_mut) else {
                    break;
                };
                if !cq.has_room() {
                    if !cq.starved {
                        cq.starved = true;
                        self.stats.fetch_stalls.fetch_add(1, Ordering::Relaxed);
                    }
                    break;
                }
                let Some(sq) = self.sqs[qid].as_mut() else {
                    break;
                };
                let addr = sq.base + u64::from(sq.head) * SQE_SIZE;
                sq.head = (sq.head + 1) % sq.size;
                budget -= 1;
                work = true;
                let mut raw = [0u8; 64];
                if let Err(e) = self.dma.read(addr, &mut raw) {
                    let n = self.stats.dma_faults.fetch_add(1, Ordering::Relaxed) + 1;
                    if loud(n) {
                        log::warn!("nvme sq {qid}: {e}; entry dropped (dma fault #{n})");
                    }
                    continue;
                }
                if let Some(cq) = self.cqs.get_mut(cqid).and_then(Option::as_mut) {
                    cq.reserved += 1;
                }
                let sqe = Sqe::from_bytes(&raw);
                self.stats.commands.fetch_add(1, Ordering::Relaxed);
                let res = if qid == 0 {
                    self.admin(&sqe)
                } else {
                    self.io(qid as u16, &sqe)
                };
                if let Some((dw0, st)) = res {
                    self.complete(qid as u16, sqe.cid(), dw0, st);
                }
            }
            work |= self.sq_event_idx(qid, tail);
        }
        work
    }

    /// Posts the completion of a fetched command, which holds a reserved CQ slot.
    fn complete(&mut self, sqid: u16, cid: u16, dw0: u32, st: u16) {
        self.post(sqid, cid, dw0, st, true);
    }

    /// Posts a completion; `reserved` when its command still holds a CQ slot reservation
    /// (every command but a parked Asynchronous Event Request).
    fn post(&mut self, sqid: u16, cid: u16, dw0: u32, st: u16, reserved: bool) {
        let Some(sq) = self.sqs.get(sqid as usize).and_then(Option::as_ref) else {
            return;
        };
        let dnr = st != status::SUCCESS
            && st != status::INTERNAL_ERROR
            && st != status::ABORTED_SQ_DELETION;
        let e = Cqe {
            dw0,
            sq_head: sq.head,
            sq_id: sqid,
            cid,
            phase: false,
            status: st | if dnr { 1 << 14 } else { 0 },
        };
        let cqid = sq.cqid as usize;
        let Some(cq) = self.cqs.get_mut(cqid).and_then(Option::as_mut) else {
            return;
        };
        if reserved {
            cq.reserved = cq.reserved.saturating_sub(1);
        }
        if cq.full() || !cq.held.is_empty() {
            // Only a host that moved its head backwards (or AER completions) gets here:
            // bounded by the reservations plus the AERs.
            if cq.held.len() >= usize::from(cq.size) + MAX_AERS {
                let n = self
                    .stats
                    .dropped_completions
                    .fetch_add(1, Ordering::Relaxed)
                    + 1;
                if loud(n) {
                    log::warn!(
                        "nvme cq {cqid}: {} completions wait for room; completion of cid \
                         {cid} dropped (#{n})",
                        cq.held.len()
                    );
                }
                return;
            }
            cq.held.push_back(e);
            return;
        }
        self.write_cqe(cqid, e);
    }

    fn write_cqe(&mut self, cqid: usize, mut e: Cqe) {
        let Some(cq) = self.cqs[cqid].as_mut() else {
            return;
        };
        e.phase = cq.phase;
        let b = e.to_bytes();
        let addr = cq.base + u64::from(cq.tail) * CQE_SIZE;
        // Everything but the phase-carrying dword first, so a polling host never sees a new
        // phase with stale contents.
        let r = self.dma.write(addr, &b[..12]).and_then(|_| {
            std::sync::atomic::fence(Ordering::Release);
            self.dma.write(addr + 12, &b[12..])
        });
        if let Err(f) = r {
            let n = self.stats.dma_faults.fetch_add(1, Ordering::Relaxed) + 1;
            if loud(n) {
                log::warn!("nvme cq {cqid}: {f}; completion lost (dma fault #{n})");
            }
        }
        cq.tail = (cq.tail + 1) % cq.size;
        if cq.tail == 0 {
            cq.phase = !cq.phase;
        }
        cq.unsignalled += 1;
        if cq.first_unsignalled.is_none() {
            cq.first_unsignalled = Some(Instant::now());
        }
        self.stats.completions.fetch_add(1, Ordering::Relaxed);
    }

    /// A doorbell write with a value outside its queue (NVMe 1.4 3.1.x: the write is
    /// ignored and, with an Asynchronous Event Request outstanding, reported as an Error
    /// event "Invalid Doorbell Write Value"). Counted; logged rate-limited.
    fn invalid_doorbell(&mut self, what: &str, qid: usize, value: u32, size: u16) {
        let n = self.stats.invalid_doorbells.fetch_add(1, Ordering::Relaxed) + 1;
        if loud(n) {
            log::warn!(
                "nvme queue {qid}: {what} doorbell {value} is outside the queue of {size} \
                 entries; ignored (invalid doorbell write #{n})"
            );
        }
        if !self.aen_error_masked {
            self.aen_error_masked = true;
            self.pending_aen = Some(AEN_INVALID_DOORBELL_VALUE);
            self.deliver_aen();
        }
    }

    /// Completes an outstanding Asynchronous Event Request with the pending event, if both.
    fn deliver_aen(&mut self) {
        if self.pending_aen.is_none() || self.aers.is_empty() {
            return;
        }
        let cid = self.aers.remove(0);
        let dw0 = self.pending_aen.take().unwrap_or(0);
        // A parked AER gave its CQ reservation back when it was parked.
        self.post(0, cid, dw0, status::SUCCESS, false);
    }

    fn finish_deletes(&mut self) {
        for qid in 1..self.sqs.len() {
            let ready =
                matches!(&self.sqs[qid], Some(s) if s.deleting.is_some() && s.inflight == 0);
            if ready {
                let cid = self.sqs[qid].as_ref().and_then(|s| s.deleting).unwrap_or(0);
                self.sqs[qid] = None;
                self.complete(0, cid, 0, status::SUCCESS);
            }
        }
    }

    // ---- interrupts ------------------------------------------------------------------------

    fn signal(&mut self) {
        let mode = self.irq.mode();
        let now = Instant::now();
        let agg = self.agg_time();
        let thr = u32::from(self.feats.coalesce_thr);
        let coalescing = self.feats.coalesce_thr != 0 || self.feats.coalesce_time != 0;
        for qid in 0..self.cqs.len() {
            let Some(cq) = self.cqs[qid].as_mut() else {
                continue;
            };
            if cq.unsignalled == 0 {
                continue;
            }
            if !cq.ien {
                cq.unsignalled = 0;
                cq.first_unsignalled = None;
                continue;
            }
            let cd = self
                .feats
                .vector_cd
                .get(cq.vector as usize)
                .copied()
                .unwrap_or(false);
            let fire = qid == 0
                || !coalescing
                || cd
                || cq.unsignalled > thr
                || cq.first_unsignalled.is_some_and(|f| now >= f + agg);
            if !fire {
                continue;
            }
            cq.unsignalled = 0;
            cq.first_unsignalled = None;
            if let InterruptMode::MsiX { vectors } = mode {
                if cq.vector < vectors {
                    self.irq.signal_msix(cq.vector);
                    self.stats.interrupts.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.update_intx();
    }

    /// INTx resample (the guest's EOI lowered the line): with the CQ heads the guest has
    /// written so far, assert again if a completion is still unacknowledged.
    pub(crate) fn intx_resample(&mut self) {
        if self.enabled {
            self.update_cq_heads();
        }
        let was = self.intx_level;
        self.update_intx();
        if was && self.intx_level {
            self.irq.set_intx(true);
            self.stats.interrupts.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn update_intx(&mut self) {
        let want = self.irq.mode() == InterruptMode::Intx
            && self.intmask & 1 == 0
            && self.cqs.iter().flatten().any(|c| c.ien && c.tail != c.head);
        if want != self.intx_level {
            self.intx_level = want;
            self.irq.set_intx(want);
            if want {
                self.stats.interrupts.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    // ---- data transfer ---------------------------------------------------------------------

    fn segments(&self, sqe: &Sqe, len: usize) -> Result<Vec<Segment>, u16> {
        prp::segments(&*self.dma, sqe.prp1(), sqe.prp2(), len).map_err(|e| {
            match e {
                prp::PrpError::Fault => self.stats.dma_faults.fetch_add(1, Ordering::Relaxed),
                prp::PrpError::Offset => self.stats.invalid_prps.fetch_add(1, Ordering::Relaxed),
            };
            e.status()
        })
    }

    fn to_host(&self, sqe: &Sqe, data: &[u8]) -> u16 {
        let segs = match self.segments(sqe, data.len()) {
            Ok(s) => s,
            Err(s) => return s,
        };
        match prp::scatter(&*self.dma, &segs, data) {
            Ok(()) => status::SUCCESS,
            Err(e) => {
                self.stats.dma_faults.fetch_add(1, Ordering::Relaxed);
                e.status()
            }
        }
    }

    fn buf(&mut self, len: usize) -> AlignedBuf {
        // Reuse a pooled buffer of the same size (contents are fully overwritten before use:
        // reads fill the whole length or fail before scattering, writes gather all of it).
        if let Some(i) = self.pool.iter().position(|b| b.len() == len) {
            return self.pool.swap_remove(i);
        }
        AlignedBuf::new(len)
    }

    fn recycle(&mut self, b: AlignedBuf) {
        if self.pool.len() < 256 && !b.is_empty() {
            self.pool.push(b);
        }
    }

    // ---- admin -----------------------------------------------------------------------------

    fn admin(&mut self, sqe: &Sqe) -> Done {
        if sqe.fuse() != 0 || sqe.psdt() != 0 {
            return err(status::INVALID_FIELD);
        }
        let cdw10 = sqe.dw[10];
        let cdw11 = sqe.dw[11];
        match sqe.opcode() {
            admin::IDENTIFY => self.identify(sqe),
            admin::SET_FEATURES => self.set_features(cdw10, cdw11),
            admin::GET_FEATURES => self.get_features(cdw10, cdw11),
            admin::CREATE_CQ => self.create_cq(sqe.prp1(), cdw10, cdw11),
            admin::CREATE_SQ => self.create_sq(sqe.prp1(), cdw10, cdw11),
            admin::DELETE_SQ => self.delete_sq(sqe.cid(), cdw10),
            admin::DELETE_CQ => self.delete_cq(cdw10),
            admin::GET_LOG_PAGE => self.get_log_page(sqe),
            admin::ASYNC_EVENT => {
                if self.aers.len() >= MAX_AERS {
                    err(status::AER_LIMIT_EXCEEDED)
                } else {
                    // Parked (bounded by MAX_AERS) without its CQ slot: an AER may wait
                    // forever and must not keep the admin queue from fetching.
                    if let Some(cq) = self.cqs[0].as_mut() {
                        cq.reserved = cq.reserved.saturating_sub(1);
                    }
                    self.aers.push(sqe.cid());
                    self.deliver_aen();
                    None
                }
            }
            // Commands are executed as soon as they are fetched: nothing is ever abortable.
            admin::ABORT => ok(1),
            admin::DBBUF_CONFIG => self.dbbuf_config(sqe),
            op => {
                log::debug!("nvme admin opcode {op:#x} not supported");
                err(status::INVALID_OPCODE)
            }
        }
    }

    fn identify(&mut self, sqe: &Sqe) -> Done {
        let cns = sqe.dw[10] & 0xff;
        let nsid = sqe.nsid();
        let data = match cns {
            0 => {
                if nsid != 1 && nsid != 0xffff_ffff {
                    return err(status::INVALID_NAMESPACE);
                }
                identify::namespace(&self.cfg, self.nsze)
            }
            1 => identify::controller(&self.cfg, self.cfg.max_queue_entries),
            2 => {
                if nsid >= 0xffff_fffe {
                    return err(status::INVALID_NAMESPACE);
                }
                identify::active_ns_list(nsid)
            }
            3 => {
                if nsid != 1 {
                    return err(status::INVALID_NAMESPACE);
                }
                identify::ns_descriptors(&self.cfg)
            }
            _ => return err(status::INVALID_FIELD),
        };
        err(self.to_host(sqe, &data))
    }

    fn get_features(&mut self, cdw10: u32, cdw11: u32) -> Done {
        let fid = (cdw10 & 0xff) as u8;
        let sel = (cdw10 >> 8) & 7;
        if sel == 3 {
            // Supported capabilities: changeable, not saveable, not namespace specific.
            return match fid {
                feat::ARBITRATION..=feat::ASYNC_EVENT_CONFIG if fid != 3 => ok(1 << 2),
                _ => err(status::INVALID_FIELD),
            };
        }
        let defaults;
        let f = if sel == 0 {
            &self.feats
        } else {
            defaults = Features::new(self.cfg.msix_vectors);
            &defaults
        };
        let v = match fid {
            feat::ARBITRATION => f.arbitration,
            feat::POWER_MGMT => f.power,
            feat::TEMP_THRESHOLD => f.temp_threshold,
            feat::ERROR_RECOVERY => f.error_recovery,
            feat::VOLATILE_WC => u32::from(f.wce),
            feat::NUM_QUEUES => {
                if sel == 0 {
                    (u32::from(self.nq_cq - 1) << 16) | u32::from(self.nq_sq - 1)
                } else {
                    let m = u32::from(self.cfg.max_io_queues - 1);
                    (m << 16) | m
                }
            }
            feat::IRQ_COALESCING => (u32::from(f.coalesce_time) << 8) | u32::from(f.coalesce_thr),
            feat::IRQ_VECTOR_CONFIG => {
                let iv = (cdw11 & 0xffff) as usize;
                match f.vector_cd.get(iv) {
                    Some(cd) => (u32::from(*cd) << 16) | iv as u32,
                    None => return err(status::INVALID_FIELD),
                }
            }
            feat::WRITE_ATOMICITY => f.write_atomicity,
            feat::ASYNC_EVENT_CONFIG => f.aec,
            _ => return err(status::INVALID_FIELD),
        };
        ok(v)
    }

    fn set_features(&mut self, cdw10: u32, cdw11: u32) -> Done {
        let fid = (cdw10 & 0xff) as u8;
        if cdw10 & (1 << 31) != 0 {
            return err(status::FEATURE_NOT_SAVEABLE);
        }
        match fid {
            feat::ARBITRATION => self.feats.arbitration = cdw11,
            feat::POWER_MGMT => {
                if cdw11 & 0x1f != 0 {
                    return err(status::INVALID_FIELD);
                }
                self.feats.power = cdw11;
            }
            feat::TEMP_THRESHOLD => self.feats.temp_threshold = cdw11,
            feat::ERROR_RECOVERY => self.feats.error_recovery = cdw11,
            feat::VOLATILE_WC => self.feats.wce = cdw11 & 1 != 0,
            feat::NUM_QUEUES => {
                let nsqr = cdw11 & 0xffff;
                let ncqr = cdw11 >> 16;
                if nsqr == 0xffff || ncqr == 0xffff {
                    return err(status::INVALID_FIELD);
                }
                let max = u32::from(self.cfg.max_io_queues);
                self.nq_sq = (nsqr + 1).min(max) as u16;
                self.nq_cq = (ncqr + 1).min(max) as u16;
                return ok((u32::from(self.nq_cq - 1) << 16) | u32::from(self.nq_sq - 1));
            }
            feat::IRQ_COALESCING => {
                self.feats.coalesce_thr = (cdw11 & 0xff) as u8;
                self.feats.coalesce_time = ((cdw11 >> 8) & 0xff) as u8;
            }
            feat::IRQ_VECTOR_CONFIG => {
                let iv = (cdw11 & 0xffff) as usize;
                let cd = cdw11 & (1 << 16) != 0;
                match self.feats.vector_cd.get_mut(iv) {
                    Some(v) => *v = cd,
                    None => return err(status::INVALID_FIELD),
                }
            }
            feat::WRITE_ATOMICITY => self.feats.write_atomicity = cdw11 & 1,
            feat::ASYNC_EVENT_CONFIG => self.feats.aec = cdw11,
            _ => return err(status::INVALID_FIELD),
        }
        ok(0)
    }

    fn queue_id_size(&self, cdw10: u32, limit: u16) -> Result<(u16, u16), u16> {
        let qid = (cdw10 & 0xffff) as u16;
        let qsize = (cdw10 >> 16) + 1;
        if qid == 0 || qid > limit || qid > self.cfg.max_io_queues {
            return Err(status::INVALID_QID);
        }
        if qsize < 2 || qsize > u32::from(self.cfg.max_queue_entries) {
            return Err(status::INVALID_QSIZE);
        }
        Ok((qid, qsize as u16))
    }

    fn create_cq(&mut self, prp1: u64, cdw10: u32, cdw11: u32) -> Done {
        let (qid, size) = match self.queue_id_size(cdw10, self.nq_cq) {
            Ok(v) => v,
            Err(s) => return err(s),
        };
        if self.cqs[qid as usize].is_some() {
            return err(status::INVALID_QID);
        }
        let pc = cdw11 & 1 != 0;
        let ien = cdw11 & 2 != 0;
        let iv = (cdw11 >> 16) as u16;
        if !pc || prp1 & (PAGE_SIZE - 1) != 0 || (self.last_cc >> 20) & 0xf != 4 {
            return err(status::INVALID_FIELD);
        }
        let vectors = match self.irq.mode() {
            InterruptMode::MsiX { vectors } => vectors.min(self.cfg.msix_vectors),
            _ => self.cfg.msix_vectors,
        };
        if ien && iv >= vectors {
            return err(status::INVALID_VECTOR);
        }
        let shadow = self.init_slots(cq_slot(qid as usize));
        self.cqs[qid as usize] = Some(CompQ::new(prp1, shadow, size, ien, iv));
        self.regs.write32(cq_doorbell(qid), 0);
        ok(0)
    }

    fn create_sq(&mut self, prp1: u64, cdw10: u32, cdw11: u32) -> Done {
        let (qid, size) = match self.queue_id_size(cdw10, self.nq_sq) {
            Ok(v) => v,
            Err(s) => return err(s),
        };
        if self.sqs[qid as usize].is_some() {
            return err(status::INVALID_QID);
        }
        let pc = cdw11 & 1 != 0;
        let cqid = (cdw11 >> 16) as u16;
        if cqid == 0 || self.cqs.get(cqid as usize).is_none_or(Option::is_none) {
            return err(status::CQ_INVALID);
        }
        if !pc || prp1 & (PAGE_SIZE - 1) != 0 || (self.last_cc >> 16) & 0xf != 6 {
            return err(status::INVALID_FIELD);
        }
        let shadow = self.init_slots(sq_slot(qid as usize));
        self.sqs[qid as usize] = Some(SubQ {
            base: prp1,
            shadow,
            size,
            head: 0,
            cqid,
            inflight: 0,
            deleting: None,
            bad_tail: None,
        });
        self.regs.write32(sq_doorbell(qid), 0);
        ok(0)
    }

    fn delete_sq(&mut self, cid: u16, cdw10: u32) -> Done {
        let qid = (cdw10 & 0xffff) as usize;
        if qid == 0 {
            return err(status::INVALID_QID);
        }
        match self.sqs.get_mut(qid).and_then(Option::as_mut) {
            None => err(status::INVALID_QID),
            Some(sq) if sq.deleting.is_some() => err(status::INVALID_QID),
            Some(sq) if sq.inflight > 0 => {
                sq.deleting = Some(cid);
                None
            }
            Some(_) => {
                self.sqs[qid] = None;
                ok(0)
            }
        }
    }

    fn delete_cq(&mut self, cdw10: u32) -> Done {
        let qid = (cdw10 & 0xffff) as usize;
        if qid == 0 || self.cqs.get(qid).is_none_or(Option::is_none) {
            return err(status::INVALID_QID);
        }
        if self.sqs.iter().flatten().any(|s| s.cqid as usize == qid) {
            return err(status::INVALID_QUEUE_DELETION);
        }
        self.cqs[qid] = None;
        self.update_intx();
        ok(0)
    }

    fn get_log_page(&mut self, sqe: &Sqe) -> Done {
        let cdw10 = sqe.dw[10];
        let lid = cdw10 & 0xff;
        let numd = (((sqe.dw[11] & 0xffff) << 16) | (cdw10 >> 16)) as usize + 1;
        let len = numd * 4;
        let lpo = u64::from(sqe.dw[12]) | (u64::from(sqe.dw[13]) << 32);
        if lpo & 3 != 0 || len > self.mdts_bytes {
            return err(status::INVALID_FIELD);
        }
        let log = match lid {
            1 => {
                // Reading the Error Information log (Retain Asynchronous Event clear)
                // re-arms error events.
                if cdw10 & (1 << 15) == 0 {
                    self.aen_error_masked = false;
                }
                identify::error_log()
            }
            2 => identify::smart_log(&self.smart, self.started.elapsed().as_secs()),
            3 => identify::fw_slot_log(&self.cfg),
            _ => return err(status::INVALID_LOG_PAGE),
        };
        if lpo > log.len() as u64 {
            return err(status::INVALID_FIELD);
        }
        let mut data = vec![0u8; len];
        let src = &log[lpo as usize..];
        let n = src.len().min(len);
        data[..n].copy_from_slice(&src[..n]);
        err(self.to_host(sqe, &data))
    }

    // ---- I/O -------------------------------------------------------------------------------

    fn lba_range(&self, sqe: &Sqe) -> Result<(u64, u64), u16> {
        if sqe.nsid() != 1 {
            return Err(status::INVALID_NAMESPACE);
        }
        let slba = u64::from(sqe.dw[10]) | (u64::from(sqe.dw[11]) << 32);
        let nlb = u64::from(sqe.dw[12] & 0xffff) + 1;
        if slba.checked_add(nlb).is_none_or(|e| e > self.nsze) {
            return Err(status::LBA_OUT_OF_RANGE);
        }
        Ok((slba, nlb))
    }

    fn io(&mut self, qid: u16, sqe: &Sqe) -> Done {
        if sqe.fuse() != 0 || sqe.psdt() != 0 {
            return err(status::INVALID_FIELD);
        }
        let fua = sqe.dw[12] & (1 << 30) != 0;
        match sqe.opcode() {
            io::FLUSH => {
                if sqe.nsid() != 1 && sqe.nsid() != 0xffff_ffff {
                    return err(status::INVALID_NAMESPACE);
                }
                self.submit(
                    qid,
                    sqe.cid(),
                    Pending::Other,
                    IoKind::Flush,
                    0,
                    AlignedBuf::new(0),
                    0,
                );
                None
            }
            io::READ | io::WRITE => {
                let (slba, nlb) = match self.lba_range(sqe) {
                    Ok(v) => v,
                    Err(s) => return err(s),
                };
                let len = (nlb << self.lba_shift) as usize;
                if len > self.mdts_bytes {
                    return err(status::INVALID_FIELD);
                }
                let segs = match self.segments(sqe, len) {
                    Ok(s) => s,
                    Err(s) => return err(s),
                };
                // The namespace is the slice [ns_offset, ns_offset + nsze blocks) of the
                // backing file (lba_range keeps slba + nlb inside it).
                let offset = self.cfg.ns_offset + (slba << self.lba_shift);
                let mut buf = self.buf(len);
                if sqe.opcode() == io::WRITE {
                    if let Err(e) = prp::gather(&*self.dma, &segs, buf.as_mut_slice()) {
                        self.stats.dma_faults.fetch_add(1, Ordering::Relaxed);
                        self.recycle(buf);
                        return err(e.status());
                    }
                    self.smart.bytes_written += len as u64;
                    self.smart.write_cmds += 1;
                    let dsync = fua || !self.feats.wce;
                    self.submit(
                        qid,
                        sqe.cid(),
                        Pending::Write,
                        IoKind::Write { dsync },
                        offset,
                        buf,
                        len,
                    );
                } else {
                    self.smart.bytes_read += len as u64;
                    self.smart.read_cmds += 1;
                    self.submit(
                        qid,
                        sqe.cid(),
                        Pending::Read(segs),
                        IoKind::Read,
                        offset,
                        buf,
                        len,
                    );
                }
                None
            }
            io::WRITE_ZEROES => {
                let (slba, nlb) = match self.lba_range(sqe) {
                    Ok(v) => v,
                    Err(s) => return err(s),
                };
                let kind = IoKind::WriteZeroes {
                    dsync: fua || !self.feats.wce,
                };
                let len = (nlb << self.lba_shift) as usize;
                self.submit(
                    qid,
                    sqe.cid(),
                    Pending::Other,
                    kind,
                    self.cfg.ns_offset + (slba << self.lba_shift),
                    AlignedBuf::new(0),
                    len,
                );
                None
            }
            io::DSM => {
                if sqe.nsid() != 1 {
                    return err(status::INVALID_NAMESPACE);
                }
                let nr = (sqe.dw[10] & 0xff) as usize + 1;
                let segs = match self.segments(sqe, nr * 16) {
                    Ok(s) => s,
                    Err(s) => return err(s),
                };
                let mut ranges = vec![0u8; nr * 16];
                if let Err(e) = prp::gather(&*self.dma, &segs, &mut ranges) {
                    self.stats.dma_faults.fetch_add(1, Ordering::Relaxed);
                    return err(e.status());
                }
                for r in ranges.chunks_exact(16) {
                    let nlb = u64::from(u32::from_le_bytes([r[4], r[5], r[6], r[7]]));
                    let slba =
                        u64::from_le_bytes([r[8], r[9], r[10], r[11], r[12], r[13], r[14], r[15]]);
                    if slba.checked_add(nlb).is_none_or(|e| e > self.nsze) {
                        return err(status::LBA_OUT_OF_RANGE);
                    }
                }
                // Deallocate is advisory: reads of deallocated blocks keep returning old data.
                ok(0)
            }
            op => {
                log::debug!("nvme i/o opcode {op:#x} not supported");
                err(status::INVALID_OPCODE)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn submit(
        &mut self,
        qid: u16,
        cid: u16,
        what: Pending,
        kind: IoKind,
        offset: u64,
        buf: AlignedBuf,
        len: usize,
    ) {
        let tag = match self.free_tags.pop() {
            Some(t) => t,
            None => {
                self.inflight.push(None);
                self.inflight.len() - 1
            }
        };
        self.inflight[tag] = Some(Inflight {
            sqid: qid,
            cid,
            what,
        });
        if let Some(sq) = self.sqs[qid as usize].as_mut() {
            sq.inflight += 1;
        }
        let op = IoOp {
            tag: tag as u64,
            kind,
            offset,
            len,
            buf,
        };
        if !self.backlog.is_empty() {
            self.backlog.push_back(op);
            return;
        }
        if let Err(op) = self.engine.submit(op) {
            self.backlog.push_back(op);
        }
    }

    fn resubmit_backlog(&mut self) {
        while let Some(op) = self.backlog.pop_front() {
            if let Err(op) = self.engine.submit(op) {
                self.backlog.push_front(op);
                break;
            }
        }
    }

    fn reap(&mut self) -> bool {
        self.engine.reap(&mut self.done);
        self.resubmit_backlog();
        if self.done.is_empty() {
            return false;
        }
        let done = std::mem::take(&mut self.done);
        for d in done {
            self.complete_io(d);
        }
        true
    }

    fn complete_io(&mut self, d: IoDone) {
        let tag = d.tag as usize;
        let Some(inf) = self.inflight.get_mut(tag).and_then(Option::take) else {
            return;
        };
        self.free_tags.push(tag);
        let st = match (&d.result, &inf.what) {
            (Err(e), Pending::Read(_)) => {
                log::warn!("nvme read failed: errno {e}");
                self.smart.media_errors += 1;
                status::UNRECOVERED_READ
            }
            (Err(e), _) => {
                log::warn!("nvme write/flush failed: errno {e}");
                self.smart.media_errors += 1;
                status::WRITE_FAULT
            }
            (Ok(()), Pending::Read(segs)) => match prp::scatter(&*self.dma, segs, d.buf.as_slice())
            {
                Ok(()) => status::SUCCESS,
                Err(e) => {
                    self.stats.dma_faults.fetch_add(1, Ordering::Relaxed);
                    e.status()
                }
            },
            (Ok(()), _) => status::SUCCESS,
        };
        self.recycle(d.buf);
        if let Some(sq) = self.sqs.get_mut(inf.sqid as usize).and_then(Option::as_mut) {
            sq.inflight = sq.inflight.saturating_sub(1);
        }
        self.complete(inf.sqid, inf.cid, 0, st);
    }
}
