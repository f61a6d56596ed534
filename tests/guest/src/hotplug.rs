//! ACPI PCI hotplug, the way Linux's acpiphp sees it without AML: the GED interrupt (IOAPIC
//! pin 5, edge) → GED status (bit 1 = PCI hotplug, cleared by the read) → PCIU / PCID slot
//! bitmaps (cleared by the read) → for an added slot, probe the function and (in `hotplug`
//! mode) run its driver test; for a slot the VMM wants back, quiesce the function (controller
//! disabled, MSI-X off, Memory and Bus Master off) and eject it by writing `1 << slot` to
//! B0EJ.
//!
//! `eject_delay_ms=N` holds every eject back by N ms (the host can watch the `removing` or
//! `lost` state meanwhile).
//!
//! Console lines: `HOTPLUG ready mode=hotplug rounds=N`, `HOTPLUG event ged=… up=… down=…`,
//! `HOTPLUG io seq=N seed=S lba=L ok|fail` and `HOTPLUG io dma seq=N ok|fail` (with
//! `seqio=1`, after an NVMe function's or a dmatest engine's test),
//! `HOTPLUG add slot=S bdf=00:SS.0 id=vvvv:dddd class=cccccc`, `HOTPLUG eject slot=S`, and
//! at the end `TEST hotplug ok rounds=N adds=A ejects=E` (or `TEST idle ok …`).

use crate::interrupts::{self, irq_count, ticks, wait_until, GED_VECTOR};
use crate::mmio;
use crate::nvme;
use crate::pci::{Func, Msix};
use crate::serial::Out;
use crate::{dmatest, Results};

const GED_STATUS: u64 = 0xfe00_0000;
const GED_PIN: u32 = 5;
const HP_BASE: u64 = 0xfe00_1000;
const PCIU: u64 = HP_BASE;
const PCID: u64 = HP_BASE + 4;
const B0EJ: u64 = HP_BASE + 8;
const PSEG: u64 = HP_BASE + 12;

/// How the event loop runs (`rounds=`, `wait_ms=`, `total_ms=` on the command line).
pub struct Mode {
    /// "hotplug" or "idle" (for the report line).
    pub name: &'static str,
    /// Stop after this many ejects.
    pub rounds: u64,
    /// Run the driver test on every added function.
    pub io: bool,
    /// Longest wait for one GED event.
    pub wait_ms: u64,
    /// Longest time in the loop.
    pub total_ms: u64,
    /// Pause between seeing a removal request and ejecting (lets the host observe the
    /// `removing`/`lost` state).
    pub eject_delay_ms: u64,
    pub nvme: nvme::Params,
    /// `seqio=1`: every add of an NVMe function writes its own data (the pattern seeded by
    /// `seed ^ <add number>`) at its own place (`lba + (add number % 1024) * 64`: 1024
    /// regions of 64 LBAs) and reports `HOTPLUG io seq=<add number> seed=<hex> lba=<n>
    /// ok|fail` after its driver test, so a host can tell each write from the others (the
    /// chaos harness's history), and a lender's store keeps growing (a full one fails them).
    pub seqio: bool,
}

struct State {
    adds: u64,
    ejects: u64,
    events: u64,
    bad: u64,
}

/// Runs the hotplug event loop until `mode.rounds` ejects or a timeout.
pub fn run(r: &mut Results, mode: &Mode) {
    // Unclaimed MMIO reads all ones: without the platform devices there is nothing to wait for.
    if mmio::read32(PSEG) == 0xffff_ffff {
        r.report(mode.name, false)
            .s("no PCI hotplug controller at ")
            .hex(HP_BASE)
            .nl();
        return;
    }
    interrupts::ioapic_route_edge(GED_PIN, GED_VECTOR);
    let o = Out.s("HOTPLUG ready mode=").s(mode.name).s(" rounds=");
    if mode.rounds == u64::MAX {
        o.s("unbounded").nl();
    } else {
        o.dec(mode.rounds).nl();
    }
    let mut st = State {
        adds: 0,
        ejects: 0,
        events: 0,
        bad: 0,
    };
    // Events raised before the pin was routed were lost as edges; their bits are still set.
    // The interrupt count is read *before* every `handle`: an event that arrives while a
    // driver test runs then ends the next wait at once instead of being missed (its bits
    // are read by the next `handle`; one with nothing new returns quietly).
    let mut seen = irq_count(GED_VECTOR);
    handle(r, mode, &mut st);
    let start = ticks();
    let mut timed_out = false;
    while st.ejects < mode.rounds {
        let elapsed = ticks().wrapping_sub(start);
        if elapsed >= mode.total_ms {
            timed_out = true;
            break;
        }
        let limit = mode.wait_ms.min(mode.total_ms - elapsed);
        if !wait_until(|| irq_count(GED_VECTOR) != seen, limit) {
            timed_out = true;
            break;
        }
        seen = irq_count(GED_VECTOR);
        handle(r, mode, &mut st);
    }
    interrupts::ioapic_mask(GED_PIN);
    // Idle mode ends by its time budget; that is success. Hotplug mode needs all its rounds.
    let ok = st.bad == 0 && (st.ejects >= mode.rounds || (!mode.io && mode.rounds == u64::MAX));
    let o = r
        .report(mode.name, ok)
        .s("rounds=")
        .dec(st.ejects)
        .s(" adds=")
        .dec(st.adds)
        .s(" ejects=")
        .dec(st.ejects)
        .s(" events=")
        .dec(st.events);
    if timed_out {
        o.s(" (timed out waiting for a GED event)").nl();
    } else {
        o.nl();
    }
}

fn handle(r: &mut Results, mode: &Mode, st: &mut State) {
    let ged = mmio::read32(GED_STATUS);
    mmio::write32(PSEG, 0);
    let up = mmio::read32(PCIU);
    let down = mmio::read32(PCID);
    if ged == 0 && up == 0 && down == 0 {
        return;
    }
    st.events += 1;
    Out.s("HOTPLUG event ged=")
        .hex(ged as u64)
        .s(" up=")
        .hex(up as u64)
        .s(" down=")
        .hex(down as u64)
        .nl();
    for slot in 0..32u8 {
        if up >> slot & 1 != 0 {
            add(r, mode, st, slot);
        }
    }
    if down != 0 && mode.eject_delay_ms > 0 {
        wait_until(|| false, mode.eject_delay_ms);
    }
    for slot in 0..32u8 {
        if down >> slot & 1 != 0 {
            eject(st, slot);
        }
    }
}

fn add(r: &mut Results, mode: &Mode, st: &mut State, slot: u8) {
    let f = Func::new(0, slot, 0);
    let o = Out.s("HOTPLUG add slot=").dec(slot as u64);
    if !f.present() {
        o.s(" empty").nl();
        st.bad += 1;
        return;
    }
    st.adds += 1;
    f.print_id(f.print(o.s(" bdf=")).s(" id="))
        .s(" class=")
        .hex_digits(f.class() as u64, 6)
        .nl();
    if !mode.io {
        return;
    }
    let failed = r.failed;
    if f.class() == nvme::CLASS && mode.seqio {
        let p = nvme::Params {
            seed: mode.nvme.seed ^ st.adds as u32,
            slba: mode.nvme.slba + (st.adds % 1024) * nvme::TEST_LBAS,
            ..mode.nvme
        };
        nvme::test_on(f, r, p);
        Out.s("HOTPLUG io seq=")
            .dec(st.adds)
            .s(" seed=")
            .hex(p.seed as u64)
            .s(" lba=")
            .dec(p.slba)
            .s(if r.failed == failed { " ok" } else { " fail" })
            .nl();
    } else if f.class() == nvme::CLASS {
        nvme::test_on(f, r, mode.nvme);
    } else if f.id() == dmatest::ID {
        let seed = if mode.seqio {
            mode.nvme.seed ^ st.adds as u32
        } else {
            mode.nvme.seed
        };
        dmatest::test_on(f, r, seed);
        if mode.seqio {
            Out.s("HOTPLUG io dma seq=")
                .dec(st.adds)
                .s(if r.failed == failed { " ok" } else { " fail" })
                .nl();
        }
    } else {
        Out.s("HOTPLUG no driver for slot ").dec(slot as u64).nl();
    }
    if r.failed != failed {
        st.bad += 1;
    }
}

/// Stops the function's DMA and interrupts, then hands the slot back.
pub fn quiesce(f: Func) {
    if !f.present() {
        return;
    }
    if f.class() == nvme::CLASS {
        nvme::quiesce(f);
    }
    if let Some(m) = Msix::probe(f) {
        m.enable(false);
    }
    f.set_command(0);
}

fn eject(st: &mut State, slot: u8) {
    quiesce(Func::new(0, slot, 0));
    st.ejects += 1;
    Out.s("HOTPLUG eject slot=").dec(slot as u64).nl();
    mmio::write32(B0EJ, 1 << slot);
}
