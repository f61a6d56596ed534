//! Shadow doorbells: Doorbell Buffer Config (admin 0x7C) and EventIdx (NVMe 2.0 Appendix
//! B.5). Once configured, I/O queue tails and heads are read from the driver's shadow buffer
//! and the controller keeps EventIdx so the driver rings MMIO only when needed; the state
//! (on/off with a generation) is published for the borrower's ioeventfds.

use std::sync::atomic::Ordering;

use super::{err, ok, Ctrl, Done};
use crate::dma::DmaMemory;
use crate::nvme::spec::*;

/// Doorbell Buffer Config state: guest addresses of the shadow doorbell and EventIdx buffers
/// (NVMe 2.0 Appendix B.5). Slot layout (DSTRD 0): SQ `q` at `8q`, CQ `q` at `8q + 4`.
#[derive(Clone, Copy)]
pub(super) struct Dbbuf {
    pub(super) shadow: u64,
    pub(super) eventidx: u64,
}

/// I/O queue pairs whose doorbells are reported kick-only at most (2 ioeventfds each on the
/// borrower; doorbells of higher queues keep the exact path, which stays correct).
pub(crate) const MAX_KICK_QUEUES: u16 = 32;

/// Shadow doorbell state shared with [`crate::nvme::NvmeController`]'s `kick_doorbells`:
/// `generation << 1 | on`, one atomic so readers never see a torn pair; and whom to tell
/// about changes.
#[derive(Default)]
pub(crate) struct DbbufState {
    state: std::sync::atomic::AtomicU64,
    listener: std::sync::Mutex<Option<crate::KickListener>>,
}

impl DbbufState {
    /// (generation, on).
    pub(crate) fn get(&self) -> (u64, bool) {
        let v = self.state.load(Ordering::Acquire);
        (v >> 1, v & 1 != 0)
    }

    pub(crate) fn set_listener(&self, l: Option<crate::KickListener>) {
        *self.listener.lock().unwrap_or_else(|p| p.into_inner()) = l;
    }

    pub(super) fn set(&self, on: bool) {
        let (g, was) = self.get();
        if was == on {
            return;
        }
        self.state
            .store(((g + 1) << 1) | u64::from(on), Ordering::Release);
        let l = self
            .listener
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(l) = l {
            l();
        }
    }
}

impl Ctrl {
    /// Shadowed CQs: write each one's EventIdx; for one with completions waiting for room,
    /// re-read the shadow head after the (fenced) EventIdx store, so a head update that the
    /// driver made before it could see the new EventIdx is not missed. True if a head moved.
    pub(super) fn arm_cq_events(&mut self) -> bool {
        let mut moved = false;
        for qid in 1..self.cqs.len() {
            self.cq_event_idx(qid);
            let (Some(cq), Some(d)) = (self.cqs[qid].as_ref(), self.dbbuf) else {
                continue;
            };
            if cq.shadow && cq.waits_for_head() {
                std::sync::atomic::fence(Ordering::SeqCst);
                moved |= read_slot(&*self.dma, d.shadow, cq_slot(qid))
                    .is_some_and(|h| h != u32::from(cq.head));
            }
        }
        moved
    }

    /// A shadowed SQ that has caught up with `tail`: ask for a doorbell at the next
    /// submission (EventIdx = tail), then re-read the shadow tail so a submission that raced
    /// with the EventIdx update is not missed (the driver stores its tail, fences, then reads
    /// EventIdx; we store EventIdx, fence, then read its tail). True if there is more work.
    pub(super) fn sq_event_idx(&mut self, qid: usize, tail: u32) -> bool {
        let (Some(sq), Some(d)) = (self.sqs[qid].as_ref(), self.dbbuf) else {
            return false;
        };
        if !sq.shadow || u32::from(sq.head) != tail || sq.deleting.is_some() {
            return false;
        }
        write_slot(&*self.dma, d.eventidx, sq_slot(qid), tail);
        std::sync::atomic::fence(Ordering::SeqCst);
        read_slot(&*self.dma, d.shadow, sq_slot(qid)).is_some_and(|t| t != tail)
    }

    /// A shadowed CQ's EventIdx. The controller reads CQ heads from the shadow buffer every
    /// pass, so it needs a doorbell only when it waits for room (completions held, or a fetch
    /// stopped because the CQ could not take another completion): then EventIdx = head (the
    /// next head update rings); otherwise one below the head, which a driver's new head only
    /// passes when it wraps the ring.
    pub(super) fn cq_event_idx(&mut self, qid: usize) {
        let (Some(cq), Some(d)) = (self.cqs[qid].as_mut(), self.dbbuf) else {
            return;
        };
        if !cq.shadow {
            return;
        }
        let ei = if cq.waits_for_head() {
            cq.head
        } else if cq.head == 0 {
            cq.size - 1
        } else {
            cq.head - 1
        };
        if cq.event_idx != Some(u32::from(ei)) {
            cq.event_idx = Some(u32::from(ei));
            write_slot(&*self.dma, d.eventidx, cq_slot(qid), u32::from(ei));
        }
    }

    /// Doorbell Buffer Config (admin 0x7C): PRP1 = shadow doorbells, PRP2 = EventIdx, both
    /// page aligned and inside the DMA window for the slots of the granted queues. Existing
    /// I/O queues switch to the shadow buffer (seeded with the values seen so far); the
    /// admin queue never does. A refused command changes nothing.
    pub(super) fn dbbuf_config(&mut self, sqe: &Sqe) -> Done {
        if !self.cfg.dbbuf {
            return err(status::INVALID_OPCODE);
        }
        let (shadow, eventidx) = (sqe.prp1(), sqe.prp2());
        if shadow & (PAGE_SIZE - 1) != 0 || eventidx & (PAGE_SIZE - 1) != 0 {
            log::debug!("nvme dbbuf config: buffers {shadow:#x}/{eventidx:#x} not page aligned");
            return err(status::INVALID_FIELD);
        }
        // The slots of the queues the driver may create (Set Features Number of Queues): a
        // driver sizes its buffers by the queues it uses, not by what we could offer.
        let len = (usize::from(self.nq_sq.max(self.nq_cq)) + 1) * 8;
        let mut probe = vec![0u8; len];
        for base in [shadow, eventidx] {
            if let Err(e) = self.dma.read(base, &mut probe) {
                self.stats.dma_faults.fetch_add(1, Ordering::Relaxed);
                // The driver sees the status; the DMA fault is counted. A guest can repeat
                // this at will: no warning per command.
                log::debug!("nvme dbbuf config: buffer {base:#x}+{len:#x}: {e}");
                return err(status::DATA_TRANSFER_ERROR);
            }
        }
        let d = Dbbuf { shadow, eventidx };
        // A second config moves shadowed queues to the new buffers: their latest tail is in
        // the old shadow buffer (their MMIO doorbells may have been kicks only).
        let old = self.dbbuf.replace(d);
        for qid in 1..self.sqs.len() {
            if let Some(sq) = self.sqs[qid].as_mut() {
                let tail = match (sq.shadow, old) {
                    (true, Some(o)) => read_slot(&*self.dma, o.shadow, sq_slot(qid)),
                    _ => Some(self.regs.read32(sq_doorbell(qid as u16))),
                };
                sq.shadow = true;
                let tail = match tail {
                    Some(t) if t < u32::from(sq.size) => t,
                    _ => u32::from(sq.head),
                };
                write_slot(&*self.dma, shadow, sq_slot(qid), tail);
                write_slot(&*self.dma, eventidx, sq_slot(qid), tail);
            }
            if let Some(cq) = self.cqs[qid].as_mut() {
                cq.shadow = true;
                cq.event_idx = None;
                write_slot(&*self.dma, shadow, cq_slot(qid), u32::from(cq.head));
                self.cq_event_idx(qid);
            }
        }
        self.dbbuf_state.set(true);
        log::debug!("nvme shadow doorbells at {shadow:#x}, eventidx at {eventidx:#x}");
        ok(0)
    }

    /// A queue created while shadow doorbells are on uses them from the start: its shadow
    /// and EventIdx slots start at 0 (the driver cannot have rung it yet). Returns whether
    /// the queue is shadowed.
    pub(super) fn init_slots(&self, slot: u64) -> bool {
        let Some(d) = self.dbbuf else {
            return false;
        };
        write_slot(&*self.dma, d.shadow, slot, 0);
        write_slot(&*self.dma, d.eventidx, slot, 0);
        true
    }
}

/// Byte offset of SQ `qid`'s slot in the shadow / EventIdx buffers (DSTRD 0).
pub(super) fn sq_slot(qid: usize) -> u64 {
    8 * qid as u64
}

/// Byte offset of CQ `qid`'s slot.
pub(super) fn cq_slot(qid: usize) -> u64 {
    8 * qid as u64 + 4
}

/// Reads a shadow slot; `None` when the buffer became unreachable (counted by the caller's
/// DMA domain; the queue simply makes no progress).
pub(super) fn read_slot(dma: &dyn DmaMemory, base: u64, slot: u64) -> Option<u32> {
    let mut b = [0u8; 4];
    match dma.read(base + slot, &mut b) {
        Ok(()) => Some(u32::from_le_bytes(b)),
        Err(e) => {
            log::debug!("nvme shadow doorbell read at {:#x}: {e}", base + slot);
            None
        }
    }
}

fn write_slot(dma: &dyn DmaMemory, base: u64, slot: u64, v: u32) {
    if let Err(e) = dma.write(base + slot, &v.to_le_bytes()) {
        log::debug!("nvme eventidx write at {:#x}: {e}", base + slot);
    }
}
