//! proptest: NVMe submission entries and PRP lists against the emulated controller with a
//! software DMA window ([`TestMemory`]: DMA may only touch `[WIN.0, WIN.1)` of a 16 MiB
//! "guest RAM"; everything outside is a guard filled with a known byte).
//!
//! * `random_commands_are_contained`: random SQEs for every admin and I/O opcode (invalid
//!   ones included), random nsid, command dwords and PRPs (in the window, outside it,
//!   unaligned, a random PRP list): no panic, every command completes, the guards outside
//!   the window are untouched.
//! * `valid_io_reads_back`: random lengths, first-page offsets, contiguous or scattered
//!   pages and PRP lists starting anywhere in a page (so they chain across list pages):
//!   written data reads back through a different random layout, and no byte outside the
//!   named data (in-window guard pages, the rest of each data page) is touched.
//! * `hostile_prps_are_contained`: PRP1/PRP2/list entries outside the window or into
//!   unmapped holes, misaligned lists, lists that chain to themselves or back to an earlier
//!   list page: the command completes (bounded) with an error where the data lies outside
//!   the window, the guards and a canary region of the disk are untouched, and the
//!   controller still serves a valid command afterwards.
//! * `prp_walk_is_bounded`: `prp::segments` on random list memory reads at most a bounded
//!   number of list bytes and, when it succeeds, describes exactly the requested length.
//!
//! Case count: PROPTEST_CASES (default 64; `scripts/test.sh` runs a fixed larger budget).
//! Crashes found become named tests in `hostile.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test/bench code

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use emulated::nvme::prp;
use emulated::nvme::spec::{io, status, Sqe};
use emulated::testing::{GuestRam, LocalRig, TestMemory};
use emulated::{DmaFault, DmaMemory, NotifyMode};
use proptest::prelude::*;

const RAM: usize = 16 << 20;
const WIN: (u64, u64) = (1 << 20, 12 << 20);
const PAGE: u64 = 4096;
/// MDTS 5: 32 pages, 128 KiB per command.
const MDTS_PAGES: u64 = 32;
const LBA: u64 = 512;
/// Disk size and the canary region at its end that no fuzzed command may write.
const DISK: u64 = 4 << 20;
const CANARY_LBAS: u64 = 64;
const CANARY_SLBA: u64 = DISK / LBA - CANARY_LBAS;
/// Guard bytes: below and above the window, and in-window guard pages.
const LOW_GUARD: u8 = 0xc3;
const HIGH_GUARD: u8 = 0x3c;
const PAGE_GUARD: u8 = 0x5a;
/// Fill of data pages before a read (bytes the read must not name stay so).
const STALE: u8 = 0x77;
/// Pages of each data pool; data uses even pages, odd pages are guards.
const POOL_PAGES: u64 = 2 * MDTS_PAGES + 2;
/// List pages per list area (a list of up to 32 entries chains at most once per page).
const LIST_PAGES: u64 = 4;

struct Fixture {
    _dir: tempfile::TempDir,
    rig: LocalRig,
    /// Scratch page for random PRP lists of `random_commands_are_contained`.
    scratch: u64,
    /// Data pools and list areas (page aligned).
    pool_w: u64,
    pool_r: u64,
    list_w: u64,
    list_r: u64,
    /// Canary data (what the canary LBAs hold).
    canary: Vec<u8>,
}

fn fixture() -> &'static Mutex<Fixture> {
    static F: OnceLock<Mutex<Fixture>> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = common::config(&dir, NotifyMode::Interrupt, 512, DISK);
        cfg.mdts = 5;
        let mem = TestMemory::with_window(RAM, WIN.0, WIN.1);
        mem.fill(0, WIN.0 as usize, LOW_GUARD);
        mem.fill(WIN.1, RAM - WIN.1 as usize, HIGH_GUARD);
        let mut rig = common::rig_with(cfg, mem, true, 1);
        let d = &mut rig.driver;
        let scratch = d.alloc(4096 * 64, 4096).unwrap();
        let pool_w = d.alloc((POOL_PAGES * PAGE) as usize, PAGE).unwrap();
        let pool_r = d.alloc((POOL_PAGES * PAGE) as usize, PAGE).unwrap();
        let list_w = d.alloc((LIST_PAGES * PAGE) as usize, PAGE).unwrap();
        let list_r = d.alloc((LIST_PAGES * PAGE) as usize, PAGE).unwrap();
        assert!(
            list_r + LIST_PAGES * PAGE <= WIN.0 + (2 << 20),
            "fixture outgrew 2 MiB"
        );
        // The canary: written once through the controller, read back after every case.
        let canary: Vec<u8> = (0..CANARY_LBAS * LBA).map(|i| (i * 7 + 3) as u8).collect();
        let buf = d.alloc_data(canary.len(), 0, false).unwrap();
        buf.fill(d.ram(), &canary);
        let e = d
            .rw(1, true, CANARY_SLBA, CANARY_LBAS as u32, &buf)
            .unwrap();
        assert_eq!(e.code(), status::SUCCESS, "canary write");
        Mutex::new(Fixture {
            _dir: dir,
            rig,
            scratch,
            pool_w,
            pool_r,
            list_w,
            list_r,
            canary,
        })
    })
}

fn lock() -> std::sync::MutexGuard<'static, Fixture> {
    // A failed case panics while holding the lock; the next one still gets the fixture.
    fixture().lock().unwrap_or_else(|p| p.into_inner())
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

fn guards_intact(mem: &TestMemory) -> Result<(), TestCaseError> {
    prop_assert!(
        mem.check(0, WIN.0 as usize, LOW_GUARD),
        "guard below the window touched"
    );
    prop_assert!(
        mem.check(WIN.1, RAM - WIN.1 as usize, HIGH_GUARD),
        "guard above the window touched"
    );
    Ok(())
}

/// Reads the canary LBAs back through the controller (a valid command: the controller must
/// still serve it) and compares.
fn canary_intact(f: &mut Fixture) -> Result<(), TestCaseError> {
    let pool = f.pool_r;
    let pages: Vec<u64> = (0..MDTS_PAGES).map(|i| pool + 2 * i * PAGE).collect();
    let list = f.list_r;
    let (prp1, prp2) = layout(f.rig.driver.ram(), &pages, 0, CANARY_LBAS * LBA, list);
    let mut s = Sqe::new(io::READ, 0);
    s.set_nsid(1).set_prps(prp1, prp2);
    s.set_cdw(10, CANARY_SLBA as u32)
        .set_cdw(12, CANARY_LBAS as u32 - 1);
    let e = f.rig.driver.execute(1, s);
    prop_assert!(e.is_ok(), "canary read did not complete: {:?}", e);
    let e = e.unwrap();
    prop_assert_eq!(e.code(), status::SUCCESS, "canary read failed");
    let got = gather(f.rig.driver.ram(), &pages, 0, CANARY_LBAS * LBA);
    prop_assert!(got == f.canary, "canary lbas changed");
    Ok(())
}

/// Writes a PRP list of `entries` starting at `list` (qword aligned, any offset in its
/// page): when a page's last slot is reached with more than one entry left, that slot
/// chains to the next list page. Returns the list pointer (PRP2).
fn write_list(ram: &dyn GuestRam, list: u64, entries: &[u64]) -> u64 {
    let mut at = list;
    let mut rest = entries;
    while !rest.is_empty() {
        let slots = ((PAGE - (at % PAGE)) / 8) as usize;
        if rest.len() <= slots {
            let b: Vec<u8> = rest.iter().flat_map(|e| e.to_le_bytes()).collect();
            ram.write(at, &b);
            break;
        }
        let next = (at & !(PAGE - 1)) + PAGE;
        let mut b: Vec<u8> = rest[..slots - 1]
            .iter()
            .flat_map(|e| e.to_le_bytes())
            .collect();
        b.extend_from_slice(&next.to_le_bytes());
        ram.write(at, &b);
        rest = &rest[slots - 1..];
        at = next;
    }
    list
}

/// PRP1/PRP2 for `len` bytes over `pages` (page addresses), the data starting `offset`
/// bytes into the first page; a list (if needed) at `list`.
fn layout(ram: &dyn GuestRam, pages: &[u64], offset: u64, len: u64, list: u64) -> (u64, u64) {
    let n = (offset + len).div_ceil(PAGE) as usize;
    let prp1 = pages[0] + offset;
    let prp2 = match n {
        1 => 0,
        2 => pages[1],
        _ => write_list(ram, list, &pages[1..n]),
    };
    (prp1, prp2)
}

/// The `len` bytes at `offset` over `pages`, as the guest sees them.
fn gather(ram: &dyn GuestRam, pages: &[u64], offset: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    let mut done = 0u64;
    let mut i = 0;
    let mut off = offset;
    while done < len {
        let n = (PAGE - off).min(len - done);
        ram.read(pages[i] + off, &mut out[done as usize..(done + n) as usize]);
        done += n;
        off = 0;
        i += 1;
    }
    out
}

fn scatter(ram: &dyn GuestRam, pages: &[u64], offset: u64, data: &[u8]) {
    let mut done = 0usize;
    let mut i = 0;
    let mut off = offset;
    while done < data.len() {
        let n = ((PAGE - off) as usize).min(data.len() - done);
        ram.write(pages[i] + off, &data[done..done + n]);
        done += n;
        off = 0;
        i += 1;
    }
}

/// `count` data pages of `pool` (even pages only): in order, or permuted by `perm`.
fn pick_pages(pool: u64, count: usize, perm: &[usize]) -> Vec<u64> {
    let mut idx: Vec<usize> = (0..MDTS_PAGES as usize + 1).collect();
    let n = idx.len();
    for (i, &p) in perm.iter().enumerate() {
        idx.swap(i % n, p % n);
    }
    idx.into_iter()
        .take(count)
        .map(|i| pool + 2 * i as u64 * PAGE)
        .collect()
}

/// Prepares a pool: data pages `STALE`, guard (odd) pages `PAGE_GUARD`.
fn prime_pool(mem: &TestMemory, pool: u64) {
    for p in 0..POOL_PAGES {
        let b = if p % 2 == 0 { STALE } else { PAGE_GUARD };
        mem.fill(pool + p * PAGE, PAGE as usize, b);
    }
}

fn pool_guards_intact(mem: &TestMemory, pool: u64) -> Result<(), TestCaseError> {
    for p in (1..POOL_PAGES).step_by(2) {
        prop_assert!(
            mem.check(pool + p * PAGE, PAGE as usize, PAGE_GUARD),
            "in-window guard page {} of pool {:#x} touched",
            p,
            pool
        );
    }
    Ok(())
}

/// Deterministic bytes from a seed (xorshift64*).
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

/// The driver's own queues live in the first MiB of the window; random DMA must not clobber
/// them (that would only break the test driver, not the controller), nor the fixture's
/// pools (the canary check reads through them).
fn avoid_driver(a: u64) -> u64 {
    if (WIN.0..WIN.0 + (2 << 20)).contains(&a) {
        a + (2 << 20)
    } else {
        a
    }
}

fn addr() -> impl Strategy<Value = u64> {
    raw_addr().prop_map(avoid_driver)
}

fn raw_addr() -> impl Strategy<Value = u64> {
    prop_oneof![
        (0u64..RAM as u64).prop_map(|a| a & !3),
        (WIN.0..WIN.1).prop_map(|a| a & !0xfff),
        Just(0u64),
        any::<u64>(),
        Just(WIN.1 - 4096),
        // Holes of a PC memory map: PCI BAR window, ECAM, LAPIC / MSI window.
        Just(0xc000_0000u64),
        Just(0xe000_0000u64),
        Just(0xfee0_0000u64),
    ]
}

/// An address the software window never maps.
fn outside() -> impl Strategy<Value = u64> {
    prop_oneof![
        (0u64..WIN.0).prop_map(|a| a & !0xfff),
        (WIN.1..RAM as u64).prop_map(|a| a & !0xfff),
        Just(WIN.1),
        Just(WIN.0 - PAGE),
        Just(0xc000_0000u64),
        Just(0xe000_0000u64),
        Just(0xfee0_0000u64),
        Just(!0xfffu64),
        any::<u64>().prop_map(|a| (a | 1 << 40) & !0xfff),
    ]
}

/// Every admin opcode the controller implements, their neighbours, and random ones.
fn opcode() -> impl Strategy<Value = u8> {
    prop_oneof![
        prop::sample::select(vec![
            0x00u8, 0x01, 0x02, 0x04, 0x05, 0x06, 0x08, 0x09, 0x0a, 0x0c, 0x0d, 0x10, 0x11, 0x18,
            0x7c, 0x7f, 0x80, 0x81, 0xc0, 0xff
        ]),
        0u8..0x20,
        any::<u8>(),
    ]
}

/// Rewrites commands that would take the fixture's own queues, shadow doorbells or the
/// canary away; every other command goes through as generated.
fn tame(qid: u16, mut s: Sqe) -> Sqe {
    let op = s.opcode();
    if qid == 0 {
        match op {
            // Delete/Create SQ/CQ: never queue 1 (the fixture's I/O pair).
            0x00 | 0x01 | 0x04 | 0x05 => {
                s.set_cdw(10, (s.dw[10] & !0xffff) | 2);
            }
            // Asynchronous Event Request completes only on an event: not awaited here.
            0x0c => s = Sqe::new(0x0d, 0),
            // Set Features Number of Queues after queue creation changes nothing useful.
            0x09 if s.dw[10] & 0xff == 7 => {
                s.set_cdw(10, 0x06);
            }
            // Doorbell Buffer Config would switch the fixture's I/O queue to shadow
            // doorbells behind the driver's back (covered by nvme_dbbuf.rs).
            0x7c => s = Sqe::new(0x7d, 0),
            _ => {}
        }
    } else if matches!(op, 0x01 | 0x08) {
        // Write / Write Zeroes: never into the canary (Write Zeroes has no MDTS limit, so
        // its length is capped too).
        let slba = u64::from(s.dw[11]) << 32 | u64::from(s.dw[10]);
        let nlb = u64::from(s.dw[12] & 0xffff) + 1;
        if slba < DISK / LBA && slba + nlb > CANARY_SLBA {
            let nlb = nlb.min(MDTS_PAGES * PAGE / LBA);
            let dw12 = (s.dw[12] & !0xffff) | (nlb as u32 - 1);
            s.set_cdw(10, 0).set_cdw(11, 0).set_cdw(12, dw12);
        }
    }
    s
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        failure_persistence: None,
        .. ProptestConfig::default()
    })]

    #[test]
    fn random_commands_are_contained(
        admin_q in any::<bool>(),
        opcode in opcode(),
        flags in 0u32..4,
        nsid in prop_oneof![Just(1u32), Just(0u32), Just(0xffff_ffffu32), any::<u32>()],
        prp1 in addr(),
        prp2 in addr(),
        cdw in proptest::array::uniform6(prop_oneof![0u32..64, any::<u32>()]),
        list in proptest::collection::vec(addr(), 0..40),
    ) {
        let mut f = lock();
        let base = f.scratch;
        let d = &mut f.rig.driver;
        // A random PRP list in RAM that prp2 may point to.
        let bytes: Vec<u8> = list.iter().flat_map(|e| e.to_le_bytes()).collect();
        d.ram().write(base, &bytes);
        let prp2 = if flags & 1 != 0 { base } else { prp2 };
        let mut s = Sqe::new(opcode, 0);
        s.set_nsid(nsid).set_prps(prp1, prp2);
        for (i, v) in cdw.iter().enumerate() {
            s.set_cdw(10 + i, *v);
        }
        let qid = if admin_q { 0 } else { 1 };
        let s = tame(qid, s);
        let e = d.execute(qid, s);
        prop_assert!(e.is_ok(), "no completion for {:02x?}: {:?}", s.dw, e);
        guards_intact(&f.rig.mem)?;
        canary_intact(&mut f)?;
    }

    #[test]
    fn valid_io_reads_back(
        nlb in 1u64..=(MDTS_PAGES * PAGE / LBA),
        w_off in (0u64..1024).prop_map(|o| o * 4),
        r_off in (0u64..1024).prop_map(|o| o * 4),
        w_perm in proptest::collection::vec(any::<usize>(), 0..40),
        r_perm in proptest::collection::vec(any::<usize>(), 0..40),
        w_list in (0u64..512).prop_map(|q| q * 8),
        r_list in (0u64..512).prop_map(|q| q * 8),
        slba in 0u64..(CANARY_SLBA - MDTS_PAGES * PAGE / LBA),
        seed in any::<u64>(),
    ) {
        let mut f = lock();
        let len = nlb * LBA;
        // The data must fit MDTS pages from its offset: trim the offset if it does not.
        let fit = |off: u64| if (off + len).div_ceil(PAGE) > MDTS_PAGES { 0 } else { off };
        let (w_off, r_off) = (fit(w_off), fit(r_off));
        let (pool_w, pool_r, list_w, list_r) = (f.pool_w, f.pool_r, f.list_w, f.list_r);
        let mem = f.rig.mem.clone();
        prime_pool(&mem, pool_w);
        prime_pool(&mem, pool_r);
        let data = bytes(seed, len as usize);
        let d = &mut f.rig.driver;

        let wp = pick_pages(pool_w, (w_off + len).div_ceil(PAGE) as usize, &w_perm);
        scatter(d.ram(), &wp, w_off, &data);
        let (p1, p2) = layout(d.ram(), &wp, w_off, len, list_w + w_list);
        let mut s = Sqe::new(io::WRITE, 0);
        s.set_nsid(1).set_prps(p1, p2);
        s.set_cdw(10, slba as u32).set_cdw(12, nlb as u32 - 1);
        let e = d.execute(1, s);
        prop_assert!(e.is_ok(), "write did not complete: {:?}", e);
        prop_assert_eq!(e.unwrap().code(), status::SUCCESS, "write failed");

        let rp = pick_pages(pool_r, (r_off + len).div_ceil(PAGE) as usize, &r_perm);
        let (p1, p2) = layout(d.ram(), &rp, r_off, len, list_r + r_list);
        let mut s = Sqe::new(io::READ, 0);
        s.set_nsid(1).set_prps(p1, p2);
        s.set_cdw(10, slba as u32).set_cdw(12, nlb as u32 - 1);
        let e = d.execute(1, s);
        prop_assert!(e.is_ok(), "read did not complete: {:?}", e);
        prop_assert_eq!(e.unwrap().code(), status::SUCCESS, "read failed");
        let got = gather(d.ram(), &rp, r_off, len);
        prop_assert!(got == data, "data read back differs ({} lbas at {})", nlb, slba);

        // The read wrote exactly the named bytes: the rest of each data page is stale.
        let mut head = vec![0u8; r_off as usize];
        d.ram().read(rp[0], &mut head);
        prop_assert!(head.iter().all(|&b| b == STALE), "read wrote before its offset");
        let end = (r_off + len) % PAGE;
        if end != 0 {
            let last = *rp.last().unwrap();
            let mut tail = vec![0u8; (PAGE - end) as usize];
            d.ram().read(last + end, &mut tail);
            prop_assert!(tail.iter().all(|&b| b == STALE), "read wrote past its end");
        }
        pool_guards_intact(&mem, pool_w)?;
        pool_guards_intact(&mem, pool_r)?;
        guards_intact(&mem)?;
    }

    #[test]
    fn hostile_prps_are_contained(
        kind in 0u8..9,
        write in any::<bool>(),
        nlb in 1u64..=(MDTS_PAGES * PAGE / LBA),
        bad in outside(),
        pos in any::<usize>(),
        list_off in (0u64..512).prop_map(|q| q * 8),
        slba in 0u64..(CANARY_SLBA - MDTS_PAGES * PAGE / LBA),
    ) {
        let mut f = lock();
        let len = nlb * LBA;
        let npages = len.div_ceil(PAGE) as usize;
        let (pool, list_area) = (f.pool_w, f.list_w);
        let mem = f.rig.mem.clone();
        prime_pool(&mem, pool);
        let d = &mut f.rig.driver;
        let mut pages = pick_pages(pool, npages, &[]);
        let list = list_area + list_off;
        // Whether the command names memory outside the window (it must then fail).
        let mut names_outside = true;
        let (prp1, prp2) = match kind {
            // PRP1 outside the window.
            0 => {
                pages[0] = bad;
                layout(d.ram(), &pages, 0, len, list)
            }
            // PRP2 (a data page, or the list pointer) outside.
            1 => {
                let (p1, p2) = layout(d.ram(), &pages, 0, len, list);
                if p2 == 0 { names_outside = false; }
                (p1, if p2 == 0 { 0 } else { bad })
            }
            // One list entry (or PRP2 data page) outside.
            2 => {
                if npages > 1 {
                    let i = 1 + pos % (npages - 1);
                    pages[i] = bad;
                } else {
                    names_outside = false;
                }
                layout(d.ram(), &pages, 0, len, list)
            }
            // The list chains to itself from its last slot (a loop that consumes nothing).
            3 => {
                let last = (list & !(PAGE - 1)) + PAGE - 8;
                d.ram().write(last, &last.to_le_bytes());
                names_outside = false;
                (pages[0], if npages > 2 { last } else { pages.get(1).copied().unwrap_or(0) })
            }
            // A short list at the end of its page whose last slot chains back to the
            // list's first entry: the same entries repeat until the length is used up.
            4 => {
                names_outside = false;
                let k = 2 + (pos % 3) as u64;
                let start = (list & !(PAGE - 1)) + PAGE - 8 * k;
                let mut b: Vec<u8> = (1..k as usize)
                    .flat_map(|i| pages.get(i).copied().unwrap_or(pages[0]).to_le_bytes())
                    .collect();
                b.extend_from_slice(&start.to_le_bytes());
                d.ram().write(start, &b);
                let p2 = match npages {
                    1 => 0,
                    2 => pages[1],
                    _ => start,
                };
                (pages[0], p2)
            }
            // The list chains into a page outside the window.
            5 => {
                let last = (list & !(PAGE - 1)) + PAGE - 8;
                d.ram().write(last, &bad.to_le_bytes());
                (pages[0], if npages > 2 { last } else { names_outside = false; pages.get(1).copied().unwrap_or(0) })
            }
            // A misaligned list pointer or entry.
            6 => {
                names_outside = false;
                let (p1, p2) = layout(d.ram(), &pages, 0, len, list);
                (p1, if p2 == 0 { 0 } else { p2 | (1 + (pos as u64 % 7)) })
            }
            // PRP1 not dword aligned.
            7 => {
                names_outside = false;
                let (p1, p2) = layout(d.ram(), &pages, 0, len, list);
                (p1 | (1 + pos as u64 % 3), p2)
            }
            // A list entry pointing into the list itself (device reads/writes its own list).
            _ => {
                names_outside = false;
                if npages > 2 {
                    let i = 1 + pos % (npages - 1);
                    pages[i] = list & !(PAGE - 1);
                }
                layout(d.ram(), &pages, 0, len, list)
            }
        };
        let mut s = Sqe::new(if write { io::WRITE } else { io::READ }, 0);
        s.set_nsid(1).set_prps(prp1, prp2);
        s.set_cdw(10, slba as u32).set_cdw(12, nlb as u32 - 1);
        let faults = mem.faults();
        let e = d.execute(1, s);
        prop_assert!(e.is_ok(), "kind {} did not complete: {:?}", kind, e);
        let code = e.unwrap().code();
        if names_outside {
            prop_assert_ne!(code, status::SUCCESS, "kind {} succeeded outside the window", kind);
            prop_assert!(
                code == status::DATA_TRANSFER_ERROR || code == status::PRP_OFFSET_INVALID,
                "kind {} status {:#x}", kind, code
            );
            if code == status::DATA_TRANSFER_ERROR {
                prop_assert!(mem.faults() > faults, "kind {}: no iommu fault counted", kind);
            }
        }
        pool_guards_intact(&mem, pool)?;
        guards_intact(&mem)?;
        canary_intact(&mut f)?;
    }
}

/// DMA memory over a sparse map of qwords, counting the bytes read.
struct ListMemory {
    window: (u64, u64),
    seed: u64,
    read: AtomicU64,
}

impl DmaMemory for ListMemory {
    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaFault> {
        if iova < self.window.0 || iova.saturating_add(buf.len() as u64) > self.window.1 {
            return Err(DmaFault::read(iova, buf.len()));
        }
        self.read.fetch_add(buf.len() as u64, Ordering::Relaxed);
        // Each qword is a function of its address: page-aligned in-window pointers mostly,
        // sometimes garbage.
        for (i, c) in buf.chunks_mut(8).enumerate() {
            let a = iova + 8 * i as u64;
            let h = (a ^ self.seed).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let v = match h >> 61 {
                0 => h,
                1 => iova & !(PAGE - 1),
                2 => (iova & !(PAGE - 1)) + PAGE - 8,
                _ => (self.window.0 + h % (self.window.1 - self.window.0)) & !(PAGE - 1),
            };
            let b = v.to_le_bytes();
            c.copy_from_slice(&b[..c.len()]);
        }
        Ok(())
    }

    fn write(&self, iova: u64, buf: &[u8]) -> Result<(), DmaFault> {
        Err(DmaFault::write(iova, buf.len()))
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases().saturating_mul(16),
        failure_persistence: None,
        .. ProptestConfig::default()
    })]

    #[test]
    fn prp_walk_is_bounded(
        prp1 in prop_oneof![any::<u64>(), (0u64..1 << 24).prop_map(|a| a & !3)],
        prp2 in prop_oneof![any::<u64>(), (0u64..1 << 24).prop_map(|a| a & !7)],
        len in prop_oneof![1usize..=(128 << 10), Just(4096usize), Just(8192), Just(4097)],
        seed in any::<u64>(),
    ) {
        let mem = ListMemory { window: (0, 1 << 24), seed, read: AtomicU64::new(0) };
        let r = prp::segments(&mem, prp1, prp2, len);
        // At most one list qword per data page plus one chain pointer per list page, and
        // the bounded walk's slack.
        let pages = len.div_ceil(4096) as u64;
        let bound = 8 * (pages + pages.div_ceil(511) + 16) + 4096;
        prop_assert!(
            mem.read.load(Ordering::Relaxed) <= bound,
            "read {} list bytes for {} bytes of data", mem.read.load(Ordering::Relaxed), len
        );
        if let Ok(segs) = r {
            let total: usize = segs.iter().map(|s| s.1).sum();
            prop_assert_eq!(total, len);
            prop_assert_eq!(segs[0].0, prp1);
        }
    }
}
