//! Soak: hundreds of hot-add/remove cycles of real remote devices through a real `lenderd`,
//! with lender restarts in between, ending with nothing leaked on either side.
//!
//! Every cycle hot-adds a device from the lender over a session of its own (`lendvm
//! --lender-idle-ms 0`: the link is set up and torn down every cycle); the bare-metal test
//! guest's hotplug loop (`tests=hotplug`, `tests/guest/src/hotplug.rs`) runs its driver on
//! it, which enables
//! MSI-X and Bus Master, so the VMM really allocates GSIs, registers irqfds, maps BAR
//! memslots and pins guest RAM for DMA (the test checks that those counters are non-zero
//! while the device is in use); then the host removes it and the guest quiesces and ejects
//! it. Even cycles use the `dmatest` device (a DMA copy and an MSI-X interrupt), odd cycles
//! the emulated NVMe controller (identify, a verified write and read).
//!
//! `LENDVM_SOAK_RESTARTS` (default 10) lender restarts are spread evenly over the
//! `LENDVM_SOAK_CYCLES` (default 500) cycles, rotating through four kinds: SIGTERM while
//! idle, SIGKILL while a device is attached (the device is lost mid-cycle: the VMM reports
//! it lost, the guest ejects it, the test removes it), SIGKILL while idle, SIGTERM while
//! attached.
//!
//! At the end: `vm.info`'s counters (devices, leases, memslots, GSIs, irqfds, ioeventfds,
//! pinned bytes) are 0, lendvm's descriptors, locked memory (VmLck) and mapped fabric windows
//! (memfd mappings) are what they were before the first add, each lender instance's
//! descriptors and windows are what they were after its first two cycles, the lender has no
//! DMA mapping left, and both processes' RSS is flat within a small slack (see
//! [`RSS_SLACK_KB`]).
//! A one-line JSON summary is printed and written to `target/reliability/soak.json`.
//!
//! The test is `#[ignore]`d in plain `cargo test`: `scripts/test.sh` runs it explicitly
//! (`cargo test -p lendvm-tests --test soak -- --ignored`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use api::client::ApiClient;
use api::types::{LeaseState, VmCounters, VmInfo};
use common::*;
use lending::protocol::DeviceState;

const T: Duration = BOOT_TIMEOUT;
const SLBA: u64 = 16;

/// Allowed RSS growth (KiB) from the baseline to the end, per process. RSS is not an exact
/// resource count: glibc malloc keeps freed chunks in its arenas and per-thread caches
/// (threads come and go with leases), log formatting and the API server reuse buffers of
/// varying sizes, and RSS moves in whole pages. 2 MiB absorbs that noise; a real per-cycle
/// leak does not fit in it: lendvm's baseline is taken once the event ring is full (about
/// cycle 200 of 500, so ~300 cycles remain) and anything leaking more than ~7 KiB per cycle
/// (two pages: a leaked window mapping, pin bookkeeping, a thread stack touched) exceeds it;
/// a lender instance lives ~45 cycles, so there only leaks above ~45 KiB per cycle show. Exact leaks (fds, memslots, GSIs, irqfds, ioeventfds,
/// pins, windows) are asserted to be exactly 0 separately.
const RSS_SLACK_KB: i64 = 2048;

fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

/// `target/` of this build (the test executable is `target/<profile>/deps/soak-…`).
fn reliability_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let target = exe
        .parent()
        .and_then(|d| d.parent())
        .and_then(|d| d.parent())
        .unwrap();
    let dir = target.join("reliability");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `fd -> target` of every descriptor of `pid`, with socket/pipe/anon-inode numbers
/// removed (a reconnect to a restarted lender gets a new socket inode in the same role).
fn fds_of(pid: u32) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| {
            let t = std::fs::read_link(e.path()).unwrap_or_default();
            let t = t.display().to_string();
            let t = match t.split_once(":[") {
                Some((kind, _)) => kind.to_string(),
                None => t,
            };
            format!("{} -> {t}", e.file_name().to_string_lossy())
        })
        .collect();
    v.sort();
    v
}

/// Mapped memfds of `pid` (fabric windows, the guest RAM and its DMA mapping on the lender):
/// every shm window a peer exports is a sealed memfd mapped with `mmap`.
/// [`fds_of`] once it stopped changing (two reads 250 ms apart agree, within 5 s): a control
/// connection the test just closed (e.g. a status query) takes a moment to be torn down on
/// the lender's side, with its session's eventfds and scratchpad memfd.
fn settled_fds(pid: u32) -> Vec<String> {
    let mut prev = fds_of(pid);
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(250));
        let now = fds_of(pid);
        if now == prev {
            return now;
        }
        prev = now;
    }
    panic!("descriptors of {pid} never settled: {prev:?}");
}

/// The memfd mappings of a process, for a leak report.
fn memfd_maps(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("/memfd:"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn windows_of(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("/memfd:"))
        .count()
}

/// Descriptors in one list and not the other (both directions).
fn fd_diff(before: &[String], after: &[String]) -> Vec<String> {
    let mut d: Vec<String> = after
        .iter()
        .filter(|f| !before.contains(f))
        .map(|f| format!("+{f}"))
        .collect();
    d.extend(
        before
            .iter()
            .filter(|f| !after.contains(f))
            .map(|f| format!("-{f}")),
    );
    d
}

fn info(api: &ApiClient) -> VmInfo {
    api.info().unwrap()
}

fn wait_no_devices(api: &ApiClient, what: &str) {
    let mut last = None;
    let gone = poll(Duration::from_secs(15), || {
        let i = info(api);
        let empty = i.remote_devices.is_empty();
        last = Some(i);
        empty.then_some(())
    });
    assert!(gone.is_some(), "{what}: devices still listed: {last:?}");
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Dmatest,
    Nvme,
}

impl Kind {
    fn of(cycle: usize) -> Kind {
        if cycle.is_multiple_of(2) {
            Kind::Dmatest
        } else {
            Kind::Nvme
        }
    }
    fn bdf(self) -> &'static str {
        match self {
            Kind::Dmatest => DMATEST_BDF,
            Kind::Nvme => NVME_BDF,
        }
    }
    fn id(self) -> &'static str {
        match self {
            Kind::Dmatest => "dma0",
            Kind::Nvme => "nvme0",
        }
    }
    /// The guest's last line of its driver test for this kind (the driver is done with the
    /// device after it).
    fn done_line(self) -> &'static str {
        match self {
            Kind::Dmatest => "TEST dmatest-copy ",
            Kind::Nvme => "TEST nvme-msix ",
        }
    }
}

/// How a lender restart happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Restart {
    TermIdle,
    KillAttached,
    KillIdle,
    TermAttached,
}

impl Restart {
    fn nth(k: usize) -> Restart {
        [
            Restart::TermIdle,
            Restart::KillAttached,
            Restart::KillIdle,
            Restart::TermAttached,
        ][k % 4]
    }
    fn attached(self) -> bool {
        matches!(self, Restart::KillAttached | Restart::TermAttached)
    }
}

/// SIGTERM (graceful) or SIGKILL, then reap (bounded: SIGKILL after 10 s).
fn stop_lender(l: &mut Lenderd, term: bool) {
    if !term {
        l.kill();
        return;
    }
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    let rc = unsafe { libc::kill(l.child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(
        rc,
        0,
        "SIGTERM to lenderd: {}",
        std::io::Error::last_os_error()
    );
    let exited = poll(Duration::from_secs(10), || l.child.try_wait().unwrap());
    if exited.is_none() {
        eprintln!("lenderd ignored SIGTERM for 10 s: {}", l.log());
        l.kill();
        panic!("lenderd did not exit on SIGTERM");
    }
}

/// The lender's leak baseline: descriptors, windows, RSS.
struct LenderBase {
    fds: Vec<String>,
    windows: usize,
    rss_kb: u64,
}

impl LenderBase {
    fn take(l: &Lenderd) -> LenderBase {
        let pid = l.child.id();
        LenderBase {
            fds: settled_fds(pid),
            windows: windows_of(pid),
            rss_kb: proc_status_kb(pid, "VmRSS"),
        }
    }
}

/// Running totals for the summary.
#[derive(Default)]
struct Tally {
    lender_checks: usize,
    lender_fds_leaked: usize,
    lender_windows_leaked: i64,
    lender_rss_growth_kb: i64,
    lender_rss: (u64, u64),
    lost_mid_cycle: usize,
    peak: VmCounters,
}

#[test]
#[ignore = "soak: run by scripts/test.sh (cargo test -p lendvm-tests --test soak -- --ignored)"]
fn soak_hotplug_cycles_and_lender_restarts_leak_nothing() {
    let cycles = env_usize("LENDVM_SOAK_CYCLES", 500);
    let restarts = env_usize("LENDVM_SOAK_RESTARTS", 10);
    assert!(cycles >= 4, "LENDVM_SOAK_CYCLES={cycles}: need at least 4");
    assert!(
        restarts < cycles,
        "LENDVM_SOAK_RESTARTS={restarts} must be below the cycle count {cycles}"
    );
    // lendvm's RSS baseline is taken after the warm-up (first-use allocations: the DMA
    // manager's tables, the API server's buffers, the lender connection's threads).
    let warmup = 20.min(cycles / 4);
    let restart_at: BTreeMap<usize, Restart> = (0..restarts)
        .map(|k| ((k + 1) * cycles / (restarts + 1), Restart::nth(k)))
        .collect();
    assert_eq!(restart_at.len(), restarts, "two restarts in one cycle");

    let cluster = Cluster::new(Fabric::Shm);
    let disk = cluster.file("disk.img");
    let devices = [
        format!("{DMATEST_BDF}=dmatest"),
        format!("{NVME_BDF}=nvme:path={},size=4M", disk.display()),
    ];
    let mut lender = cluster.start_lenderd(&devices);
    // Every cycle ends with one eject, plus a last round after the measurement that shows
    // the VM still works and ends the guest; the guest waits at most wait_ms for an event (a
    // lender restart sits between two) and runs for at most total_ms.
    let mut vm = boot_with_api(
        &cluster,
        &format!(
            "tests=hotplug rounds={} seed={SEED:#x} lba={SLBA} wait_ms=120000 \
             total_ms=3600000",
            cycles + 1
        ),
        // Every cycle sets up and tears down its own lender session. With an idle session
        // kept (the default, 1 s), whether the lender still had the link at a leak check
        // depended on how long the cycle took, and a check against a baseline taken the
        // other way round reported the session's descriptors and windows as leaked. The
        // keeper has its own test (hotplug.rs, `a_lenders_idle_session_serves_re_adds_then_closes`).
        &["--lender-idle-ms", "0"],
    );
    let api = vm.api();
    vm.expect_line("HOTPLUG ready", T);
    let vm_pid = vm.pid();

    let fds = settled_fds(vm_pid);
    let locked = vm.proc_status_kb("VmLck");
    let windows = windows_of(vm_pid);
    assert_eq!(info(&api).counters.unwrap(), VmCounters::default());

    let mut tally = Tally::default();
    let mut lender_base: Option<LenderBase> = None;
    let mut vm_rss_start = None;
    let mut vm_rss_mid = None;
    let mut rss_baseline_cycle = 0usize;
    let mut instance_cycles = 0usize;
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    let mut restarts_done = 0;
    let t0 = Instant::now();

    // Compares the current lender instance with its baseline (idle points only).
    let check_lender = |l: &Lenderd, base: &Option<LenderBase>, tally: &mut Tally, at: usize| {
        let Some(base) = base else { return };
        let pid = l.child.id();
        let mut now = Vec::new();
        let mut windows = 0;
        // A control connection the test itself just closed may linger for a moment, and the
        // lender unmaps a returned lease's windows when the VMM's return reaches it, which
        // can come after `vm.info` stopped listing the device (the lease is returned off the
        // vCPU, from the VMM's timer). The window's memfd descriptor is closed once mapped,
        // so settled descriptors say nothing about mappings: wait for both.
        let same = poll(Duration::from_secs(5), || {
            now = fds_of(pid);
            windows = windows_of(pid);
            (now == base.fds && windows == base.windows).then_some(())
        });
        let diff = if same.is_some() {
            Vec::new()
        } else {
            fd_diff(&base.fds, &now)
        };
        if !diff.is_empty() {
            eprintln!("cycle {at}: lenderd descriptors changed: {diff:?}");
        }
        tally.lender_fds_leaked += diff.len();
        if windows != base.windows {
            eprintln!(
                "cycle {at}: lenderd memfd mappings {} -> {windows}:\n{}",
                base.windows,
                memfd_maps(pid)
            );
        }
        tally.lender_windows_leaked += windows as i64 - base.windows as i64;
        let rss = proc_status_kb(pid, "VmRSS");
        let growth = rss as i64 - base.rss_kb as i64;
        tally.lender_rss_growth_kb = tally.lender_rss_growth_kb.max(growth);
        tally.lender_rss = (base.rss_kb, rss);
        tally.lender_checks += 1;
        let d = cluster.device(DMATEST_BDF);
        let n = cluster.device(NVME_BDF);
        assert!(
            d.dma_maps.is_empty() && n.dma_maps.is_empty(),
            "cycle {at}: lender DMA maps left: {d:?} {n:?}"
        );
    };

    for cycle in 0..cycles {
        let restart = restart_at.get(&cycle).copied();
        if restart.is_some() {
            // This lender instance's last idle moment.
            check_lender(&lender, &lender_base, &mut tally, cycle);
        }
        if let Some(r) = restart.filter(|r| !r.attached()) {
            stop_lender(&mut lender, r == Restart::TermIdle);
            lender = cluster.start_lenderd(&devices);
            lender_base = None;
            restarts_done += 1;
            eprintln!("cycle {cycle}: lender restarted ({r:?})");
        }
        let kind = Kind::of(cycle);
        add(&api, kind.bdf(), kind.id());
        let nth = seen.entry(kind.done_line()).or_default();
        let l = vm.expect_nth_line(kind.done_line(), *nth, T);
        *nth += 1;
        assert!(
            l.starts_with(&format!("{}ok", kind.done_line())),
            "cycle {cycle}: {l}"
        );
        match kind {
            Kind::Dmatest => assert!(l.contains("irq count=1"), "cycle {cycle}: {l}"),
            Kind::Nvme => {
                // The verified write + read came before the MSI-X summary line.
                let rd = vm.expect_nth_line("TEST nvme-read ", *nth - 1, Duration::ZERO);
                assert!(rd.starts_with("TEST nvme-read ok"), "cycle {cycle}: {rd}");
            }
        }
        // The device is in use: the VMM really holds interrupt routes and pins for it.
        let c = info(&api).counters.unwrap();
        assert!(
            c.gsis > 0 && c.irqfds > 0 && c.pinned_bytes > 0 && c.leases == 1,
            "cycle {cycle}: {kind:?} in use but {c:?}"
        );
        let p = &mut tally.peak;
        p.memslots = p.memslots.max(c.memslots);
        p.gsis = p.gsis.max(c.gsis);
        p.irqfds = p.irqfds.max(c.irqfds);
        p.ioeventfds = p.ioeventfds.max(c.ioeventfds);
        p.pinned_bytes = p.pinned_bytes.max(c.pinned_bytes);

        match restart.filter(|r| r.attached()) {
            None => {
                remove(&api, kind.id());
                vm.expect_nth_line("HOTPLUG eject ", cycle, T);
                wait_no_devices(&api, &format!("cycle {cycle}"));
            }
            Some(r) => {
                // The lender goes away under an attached device.
                stop_lender(&mut lender, r == Restart::TermAttached);
                let mut last = None;
                let lost = poll(Duration::from_secs(10), || {
                    let i = info(&api);
                    let gone = i
                        .remote_devices
                        .iter()
                        .all(|d| d.id != kind.id() || d.lease_state == LeaseState::Lost);
                    last = Some(i);
                    gone.then_some(())
                });
                assert!(
                    lost.is_some(),
                    "cycle {cycle}: device never reported lost: {last:?}"
                );
                // Removing a lost device is accepted; the guest may have ejected already.
                let r2 = api
                    .request(
                        "PUT",
                        "vm.remove-device",
                        Some(format!("{{\"id\":\"{}\"}}", kind.id()).as_bytes()),
                    )
                    .unwrap();
                assert!(
                    matches!(r2.status, 204 | 404 | 409),
                    "cycle {cycle}: remove of a lost device: {} {}",
                    r2.status,
                    r2.body_text()
                );
                vm.expect_nth_line("HOTPLUG eject ", cycle, T);
                wait_no_devices(&api, &format!("cycle {cycle} (lost)"));
                assert!(
                    vm.running(),
                    "the VMM died with its lender: {}",
                    vm.stderr()
                );
                lender = cluster.start_lenderd(&devices);
                lender_base = None;
                restarts_done += 1;
                tally.lost_mid_cycle += 1;
                eprintln!("cycle {cycle}: lender restarted ({r:?}, device lost mid-cycle)");
            }
        }
        assert_eq!(
            info(&api).counters.unwrap(),
            VmCounters::default(),
            "cycle {cycle}: resources left after removal"
        );
        cluster.wait_available(kind.bdf());
        // This lender instance's baseline, after its first two cycles (one of each device
        // kind: first-use allocations done); re-taken after each of them.
        instance_cycles = if restart.is_some() {
            1
        } else {
            instance_cycles + 1
        };
        if instance_cycles <= 2 {
            lender_base = Some(LenderBase::take(&lender));
        }
        // lendvm's RSS baseline: after the warm-up and once the event log's ring
        // (`vm.events`, the last `RETAINED` events, a few per cycle) is full, so that its
        // bounded growth is not mistaken for a leak.
        if vm_rss_start.is_none()
            && cycle + 1 >= warmup
            && (api.events(0).unwrap().len() >= api::events::RETAINED || cycle + 1 == cycles)
        {
            vm_rss_start = Some(vm.proc_status_kb("VmRSS"));
            rss_baseline_cycle = cycle + 1;
        }
        if cycle + 1 == (cycles + rss_baseline_cycle.max(warmup)) / 2 {
            vm_rss_mid = Some(vm.proc_status_kb("VmRSS"));
        }
    }
    let elapsed = t0.elapsed();
    check_lender(&lender, &lender_base, &mut tally, cycles);
    let vm_rss_end = vm.proc_status_kb("VmRSS");
    let vm_rss_start = vm_rss_start.unwrap();

    let counters = info(&api).counters.unwrap();
    let mut now = Vec::new();
    let same = poll(Duration::from_secs(3), || {
        now = fds_of(vm_pid);
        (now == fds).then_some(())
    });
    let vm_fd_diff = if same.is_some() {
        Vec::new()
    } else {
        fd_diff(&fds, &now)
    };
    let vm_windows_leaked = windows_of(vm_pid) as i64 - windows as i64;
    let vmlck_leaked = vm.proc_status_kb("VmLck") as i64 - locked as i64;
    let vm_rss_growth = vm_rss_end as i64 - vm_rss_start as i64;
    let d = cluster.device(DMATEST_BDF);
    let n = cluster.device(NVME_BDF);
    let lender_dma_maps = d.dma_maps.len() + n.dma_maps.len();

    let summary = serde_json::json!({
        "test": "soak",
        "cycles": cycles,
        "restarts": restarts_done,
        "lost_mid_cycle": tally.lost_mid_cycle,
        "seconds": (elapsed.as_secs_f64() * 10.0).round() / 10.0,
        "ms_per_cycle": (elapsed.as_secs_f64() * 1e3 / cycles as f64).round(),
        "peak_in_use": {
            "memslots": tally.peak.memslots,
            "gsis": tally.peak.gsis,
            "irqfds": tally.peak.irqfds,
            "ioeventfds": tally.peak.ioeventfds,
            "pinned_bytes": tally.peak.pinned_bytes,
        },
        "leaked": {
            "lendvm_fds": vm_fd_diff.len(),
            "lenderd_fds": tally.lender_fds_leaked,
            "devices": counters.devices,
            "leases": counters.leases,
            "memslots": counters.memslots,
            "gsis": counters.gsis,
            "irqfds": counters.irqfds,
            "ioeventfds": counters.ioeventfds,
            "pinned_bytes": counters.pinned_bytes,
            "vmlck_kb": vmlck_leaked,
            "lendvm_windows": vm_windows_leaked,
            "lenderd_windows": tally.lender_windows_leaked,
            "lenderd_dma_maps": lender_dma_maps,
        },
        "rss_kb": {
            "lendvm_start": vm_rss_start,
            "lendvm_mid": vm_rss_mid,
            "lendvm_end": vm_rss_end,
            "lenderd_start": tally.lender_rss.0,
            "lenderd_end": tally.lender_rss.1,
            "lenderd_max_growth": tally.lender_rss_growth_kb,
            "slack": RSS_SLACK_KB,
            "warmup_cycles": warmup,
            "lendvm_baseline_cycle": rss_baseline_cycle,
        },
        "lender_checks": tally.lender_checks,
    });
    let line = summary.to_string();
    println!("{line}");
    eprintln!("{line}");
    std::fs::write(reliability_dir().join("soak.json"), format!("{line}\n")).unwrap();

    assert_eq!(restarts_done, restarts);
    // The cycles really exercised what they must not leak (NVMe maps a BAR page as a
    // memslot and registers its shadow-doorbell ioeventfds).
    let p = &tally.peak;
    assert!(
        p.memslots > 0 && p.gsis > 0 && p.irqfds > 0 && p.ioeventfds > 0 && p.pinned_bytes > 0,
        "a resource was never in use: {p:?}"
    );
    assert_eq!(
        tally.lender_checks,
        restarts + 1,
        "every lender instance checked"
    );
    assert_eq!(counters, VmCounters::default(), "vm.info counters");
    assert!(
        vm_fd_diff.is_empty(),
        "lendvm descriptors leaked: {vm_fd_diff:?}"
    );
    assert_eq!(
        tally.lender_fds_leaked, 0,
        "lenderd descriptors leaked (see above)"
    );
    assert_eq!(vmlck_leaked, 0, "locked memory leaked");
    assert_eq!(vm_windows_leaked, 0, "lendvm window mappings leaked");
    assert_eq!(
        tally.lender_windows_leaked, 0,
        "lenderd window mappings leaked"
    );
    assert_eq!(lender_dma_maps, 0, "lender DMA maps left");
    assert!(
        vm_rss_growth <= RSS_SLACK_KB,
        "lendvm RSS grew {vm_rss_growth} KiB over {} cycles",
        cycles - rss_baseline_cycle
    );
    assert!(
        tally.lender_rss_growth_kb <= RSS_SLACK_KB,
        "lenderd RSS grew {} KiB in one lender lifetime",
        tally.lender_rss_growth_kb
    );
    // The VM still works: one more round, which ends the guest cleanly.
    add(&api, DMATEST_BDF, "dma0");
    let l = vm.expect_nth_line("TEST dmatest-copy ", seen["TEST dmatest-copy "], T);
    assert!(l.starts_with("TEST dmatest-copy ok"), "{l}");
    remove(&api, "dma0");
    vm.expect_ok("hotplug", T);
    vm.expect_exit(0, T);
    assert_backing_has_pattern(&disk, SLBA, 64, SEED);
    assert!(d.summary.state == DeviceState::Available && n.summary.state == DeviceState::Available);
}
