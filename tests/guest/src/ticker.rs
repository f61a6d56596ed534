//! `tests=ticker`: a guest that keeps working, so that a snapshot and restore can be watched
//! from outside (`tests/tests/snapshot.rs`).
//!
//! It fills a 4 KiB marker with the seed pattern (u64 word `w` = `seed << 32 | w`, the pattern
//! of `dma.rs`) and prints `MAILBOX 0x<gpa>` and `MARKER 0x<gpa>`. Then, every `period_ms=`
//! (default 100) LAPIC ticks, it prints `TICK <n> ticks=<t> marker=ok|bad`: `n` counts up
//! by one (a restored guest continues from where it was), `t` is the tick count (the LAPIC
//! timer keeps interrupting). It ends when the host writes 1 or more into the mailbox, or
//! after `total_ms=` (default 600000) ticks, with `TEST ticker ok|fail`.
//!
//! With `churn=1` it does not halt between ticks but keeps rewriting a 2 MiB buffer (512
//! pages), so that live migration's precopy always finds dirty pages: each pass writes
//! generation `g` into the first word `w` of every page (`g << 32 | w`) after checking that
//! it still holds generation `g - 1`. A page a migration lost or sent stale shows up as a word of an older
//! generation; the TICK line then says `churn=bad` (`churn=ok gen=<g> pos=<word>` otherwise).

use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};

use crate::bme::{announce_mailbox, mailbox};
use crate::interrupts::{start_ticks, ticks, wait_until};
use crate::serial::Out;
use crate::Results;

const WORDS: usize = 512;

#[no_mangle]
static mut TICKER_MARKER: [u64; WORDS] = [0; WORDS];

const CHURN_WORDS: usize = (2 << 20) / 8;
/// Words per 4 KiB page: the churn writes the first word of each page, so every pass
/// dirties all 512 pages even in a slow (emulated) guest.
const PAGE_WORDS: usize = 512;
const CHURN_PAGES: usize = CHURN_WORDS / PAGE_WORDS;

#[no_mangle]
static mut TICKER_CHURN: [u64; CHURN_WORDS] = [0; CHURN_WORDS];
/// Next page to rewrite, the generation being written, and words found wrong.
static mut CHURN_POS: usize = 0;
static mut CHURN_GEN: u64 = 1;
static mut CHURN_BAD: u64 = 0;

/// Rewrites the first word of the next `n` pages of the churn buffer, checking each first.
fn churn_step(n: usize) {
    // SAFETY: single-threaded guest; only this module touches the churn statics.
    unsafe {
        for _ in 0..n {
            // The modulo (a mask) lets the compiler drop the bounds check and its panic.
            let pos = read_volatile(addr_of!(CHURN_POS)) % CHURN_PAGES;
            let w = pos * PAGE_WORDS;
            let gen = read_volatile(addr_of!(CHURN_GEN));
            let want = if gen == 1 { 0 } else { ((gen - 1) << 32) | w as u64 };
            if read_volatile(addr_of!(TICKER_CHURN[w])) != want {
                write_volatile(addr_of_mut!(CHURN_BAD), read_volatile(addr_of!(CHURN_BAD)) + 1);
            }
            write_volatile(addr_of_mut!(TICKER_CHURN[w]), (gen << 32) | w as u64);
            if pos + 1 == CHURN_PAGES {
                write_volatile(addr_of_mut!(CHURN_POS), 0);
                write_volatile(addr_of_mut!(CHURN_GEN), gen + 1);
            } else {
                write_volatile(addr_of_mut!(CHURN_POS), pos + 1);
            }
        }
    }
}

/// [`wait_until`] for the mailbox, but busy rewriting the churn buffer instead of halting,
/// with interrupts enabled so the tick advances.
fn churn_wait(period_ms: u64) -> bool {
    start_ticks();
    let start = ticks();
    // SAFETY: the IDT is installed; the tick handler only counts.
    unsafe { core::arch::asm!("sti", options(nomem, nostack)) };
    let stop = loop {
        if mailbox() >= 1 {
            break true;
        }
        if ticks().wrapping_sub(start) >= period_ms {
            break false;
        }
        churn_step(64);
    };
    // SAFETY: masks interrupts again, as `wait_until` leaves them.
    unsafe { core::arch::asm!("cli", options(nomem, nostack)) };
    stop
}

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

pub fn run(r: &mut Results, seed: u32, period_ms: u64, total_ms: u64, churn: bool) {
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
        let stop = if churn {
            churn_wait(period_ms.max(1))
        } else {
            wait_until(|| mailbox() >= 1, period_ms.max(1))
        };
        if stop {
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
            .s(if bad == 0 { " marker=ok" } else { " marker=bad" });
        if churn {
            // SAFETY: single-threaded guest; reads the churn statics.
            let (gen, pos, churn_bad) = unsafe {
                (
                    read_volatile(addr_of!(CHURN_GEN)),
                    read_volatile(addr_of!(CHURN_POS)),
                    read_volatile(addr_of!(CHURN_BAD)),
                )
            };
            if churn_bad != 0 {
                bad_ticks += 1;
            }
            Out.s(if churn_bad == 0 { " churn=ok" } else { " churn=bad" })
                .s(" gen=")
                .dec(gen)
                .s(" pos=")
                .dec(pos as u64);
        }
        Out.nl();
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
