//! `tests=nvme-loop`: verified NVMe I/O in a loop on the first NVMe function, for snapshot
//! and restore with a lent device (`tests/tests/snapshot.rs`).
//!
//! After bring-up ([`nvme::setup`]) it prints `MAILBOX 0x<gpa>`, then every `period_ms=`
//! ticks writes one page (a pattern seeded by the round number) to one of 8 pages from
//! `lba=`, reads it back and compares: `IO <round> ok reinits=<n> irqs=<i> missed=<m>`.
//!
//! **Interrupts.** Each command's completion raises the I/O queue's MSI-X vector; after
//! each command the loop waits (up to 1 s) for that interrupt before it submits the next
//! one, so no two can merge: `irqs=` counts them since bring-up and `missed=` counts the
//! commands whose interrupt never came (live migration must not lose one).
//!
//! **A page only the device writes.** The read lands in a page the vCPU never writes (it
//! only reads it to verify), and before each round the loop checks that the page still
//! holds the previous round's data: `stale=` counts the rounds where it did not. Across a
//! live migration that page reaches the destination only through the lender's device dirty
//! log (KVM's dirty log never sees it written).
//!
//! **Why a re-initialisation step.** A restored VM gets its lent device back *reset* (a
//! snapshot is a crash-consistent point; the lender resets the device as after a guest
//! reboot): CC.EN is 0, the queues are gone, a command in flight at the snapshot is lost.
//! Before each round, and when a round fails, the loop checks CSTS.RDY; a controller that is
//! not ready is brought up again from scratch (`NVME controller reset: reinitialising`) and
//! the round is retried, as Linux's nvme driver does after a controller reset. A round that
//! fails on a ready controller counts as bad. Ends with `TEST nvme-loop ok|fail` when the
//! host writes 1 into the mailbox, or after `total_ms=`.

use crate::bme::{announce_mailbox, mailbox};
use crate::dma::{self, PAGE};
use crate::interrupts::{irq_count, ticks, wait_until, NVME_IO_VECTOR};
use crate::nvme::{self, Params, Setup, CSTS_RDY, OP_READ, OP_WRITE, REG_CSTS};
use crate::pci::{self, Func};
use crate::serial::Out;
use crate::Results;

/// One page written and read back; `Some(true)` verified, `Some(false)` wrong data, `None`
/// a command failed.
fn round(s: &mut Setup, p: Params, round: u64, missed: &mut u64) -> Option<bool> {
    let per_page = 1u64 << (12 - s.lbads);
    let lba = p.slba + (round % 8) * per_page;
    let seed = p.seed ^ (round as u32);
    let a = dma::data_a();
    dma::fill_pattern(a, PAGE, seed);
    let i0 = irq_count(NVME_IO_VECTOR);
    s.n.ok(true, nvme::rw(OP_WRITE, a, 0, lba, per_page))?;
    if !wait_until(|| irq_count(NVME_IO_VECTOR) > i0, crate::interrupts::MUST_ARRIVE_MS) {
        *missed += 1;
    }
    let b = dma::data_b();
    let i1 = irq_count(NVME_IO_VECTOR);
    s.n.ok(true, nvme::rw(OP_READ, b, 0, lba, per_page))?;
    if !wait_until(|| irq_count(NVME_IO_VECTOR) > i1, crate::interrupts::MUST_ARRIVE_MS) {
        *missed += 1;
    }
    Some(dma::check_pattern(b, PAGE, seed).is_none())
}

fn ready(s: &Setup) -> bool {
    s.n.reg32(REG_CSTS) & CSTS_RDY != 0
}

pub fn run(r: &mut Results, p: Params, period_ms: u64, total_ms: u64) {
    let Some(f): Option<Func> = pci::find(|f| f.class() == nvme::CLASS) else {
        r.report("nvme-loop", false)
            .s("no function with class 010802 on bus 0")
            .nl();
        return;
    };
    let Some(mut s) = nvme::setup(f, r, p) else {
        return;
    };
    announce_mailbox();
    let start = ticks();
    let (mut n, mut reinits, mut bad, mut missed, mut stale) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut prev_ok = false;
    let irq0 = irq_count(NVME_IO_VECTOR);
    let stopped = loop {
        if wait_until(|| mailbox() >= 1, period_ms.max(1)) {
            break true;
        }
        n += 1;
        // The device wrote the previous round's data into B; only the device did.
        if prev_ok && dma::check_pattern(dma::data_b(), PAGE, p.seed ^ ((n - 1) as u32)).is_some() {
            stale += 1;
        }
        let mut result = None;
        for _attempt in 0..3 {
            if !ready(&s) {
                Out.s("NVME controller reset: reinitialising").nl();
                reinits += 1;
                match nvme::setup(f, r, p) {
                    Some(again) => s = again,
                    None => break,
                }
            }
            result = round(&mut s, p, n, &mut missed);
            if result.is_some() || ready(&s) {
                break;
            }
        }
        prev_ok = result == Some(true);
        match result {
            Some(true) => Out
                .s("IO ")
                .dec(n)
                .s(" ok reinits=")
                .dec(reinits)
                .s(" irqs=")
                .dec(irq_count(NVME_IO_VECTOR).wrapping_sub(irq0))
                .s(" missed=")
                .dec(missed)
                .s(" stale=")
                .dec(stale)
                .nl(),
            _ => {
                bad += 1;
                Out.s("IO ").dec(n).s(" fail reinits=").dec(reinits).nl()
            }
        }
        if ticks().wrapping_sub(start) >= total_ms {
            break false;
        }
    };
    r.report("nvme-loop", stopped && bad == 0 && n > 0)
        .s("rounds=")
        .dec(n)
        .s(" bad=")
        .dec(bad)
        .s(" reinits=")
        .dec(reinits)
        .nl();
}
