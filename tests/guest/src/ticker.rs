//! `tests=ticker`: a guest that keeps working, so that a snapshot and restore can be watched
//! from outside (`tests/tests/snapshot.rs`).
//!
//! It fills a 4 KiB marker with the seed pattern (u64 word `w` = `seed << 32 | w`, the pattern
//! of `dma.rs`) and prints `MAILBOX 0x<gpa>` and `MARKER 0x<gpa>`. Then, every `period_ms=`
//! (default 100) LAPIC ticks, it prints `TICK <n> ticks=<t> marker=ok|bad`: `n` counts up
//! by one (a restored guest continues from where it was), `t` is the tick count (the LAPIC
//! timer keeps interrupting). It ends when the host writes 1 or more into the mailbox, or
//! after `total_ms=` (default 600000) ticks, with `TEST ticker ok|fail`.

use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};

use crate::bme::{announce_mailbox, mailbox};
use crate::interrupts::{ticks, wait_until};
use crate::serial::Out;
use crate::Results;

const WORDS: usize = 512;

#[no_mangle]
static mut TICKER_MARKER: [u64; WORDS] = [0; WORDS];

fn word(seed: u32, w: usize) -> u64 {
    ((seed as u64) << 32) | w as u64
}

/// Words of the marker that differ from the pattern.
fn marker_errors(seed: u32) -> u64 {
    let mut bad = 0;
    for w in 0..WORDS {
        // SAFETY: reads one word of the static marker, which only this module writes.
        let v = unsafe { read_volatile(addr_of!(TICKER_MARKER[w])) };
        if v != word(seed, w) {
            bad += 1;
        }
    }
    bad
}

pub fn run(r: &mut Results, seed: u32, period_ms: u64, total_ms: u64) {
    for w in 0..WORDS {
        // SAFETY: single-threaded guest; writes one word of the static marker.
        unsafe { write_volatile(addr_of_mut!(TICKER_MARKER[w]), word(seed, w)) };
    }
    announce_mailbox();
    Out.s("MARKER ").hex(addr_of!(TICKER_MARKER) as u64).nl();
    let start = ticks();
    let mut n: u64 = 0;
    let mut bad_ticks = 0;
    let stopped = loop {
        if wait_until(|| mailbox() >= 1, period_ms.max(1)) {
            break true;
        }
        n += 1;
        let bad = marker_errors(seed);
        if bad != 0 {
            bad_ticks += 1;
        }
        Out.s("TICK ")
            .dec(n)
            .s(" ticks=")
            .dec(ticks())
            .s(if bad == 0 { " marker=ok" } else { " marker=bad" })
            .nl();
        if ticks().wrapping_sub(start) >= total_ms {
            break false;
        }
    };
    r.report("ticker", stopped && bad_ticks == 0)
        .s("ticks=")
        .dec(n)
        .s(" bad=")
        .dec(bad_ticks)
        .s(if stopped { " stopped by the host" } else { " ran out of time" })
        .nl();
}
