//! A hostile guest against devices lent over shm by a real `lenderd` (issue 13, "Hostile
//! guest"). The bare-metal test guest runs `tests=hostile` (tests/guest/src/hostile.rs) on a
//! lent NVMe controller and a lent dmatest engine: NVMe and dmatest DMA outside guest RAM,
//! PRP lists that loop or point into MMIO holes, doorbell values beyond the queue size,
//! MSI-X messages that are no x86 interrupts, BARs programmed over RAM / another device's
//! BAR / an MSI-X table page / the LAPIC, writes to read-only and forbidden config fields
//! (extended space included), and FLR storms. The guest checks each group from its side
//! (`TEST hostile-<group> ok injected=N refused=N`); this test checks the rest:
//!
//! * counters: per device in `vm.counters`, the lender's IOMMU faults rose by at least one
//!   per refused DMA, `msix_refused`, `bar_moves_refused` and `flrs` are exactly what the
//!   guest injected, refused config writes were counted; `iommu-fault` events were sent and
//!   rate-limited;
//! * logs: VMM and lender log lines of each abuse class stay bounded (rate-limited) for
//!   hundreds of repetitions;
//! * guards: guest RAM guard regions (read through the VMM's memfd) are intact; the NVMe
//!   backing file holds the guest's pattern where valid writes went and its original fill
//!   everywhere else (refused writes wrote nothing);
//! * leaks and crashes: memslots, GSIs, irqfds, ioeventfds, pinned bytes, VMM and lender
//!   fds and locked memory are the same after the abuse as before it; the guest exits 0, the
//!   lender is still up and both devices are available again afterwards.
//!
//! Writes `target/reliability/hostile.json` (abuse, injected, refused, what the system did,
//! data lost, leaks, crashes) for docs/RELIABILITY.md.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::*;

const REPS: u64 = 4;
const FLRS: u64 = 32;
const GOOD_LBA: u64 = 8;
/// LBAs the guest writes validly (two 4 KiB pages of 512-byte blocks).
const GOOD_LBAS: u64 = 16;
const DISK: usize = 4 << 20;
const FILL: u8 = 0xa5;
/// `tests/guest/src/hostile.rs`: guard word at `a` is `GUARD_SEED ^ a`.
const GUARD_SEED: u64 = 0x4755_4152_4421_2121;

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// Reads guest RAM at `gpa` (below 3 GiB) through the VMM's guest-RAM memfd.
fn read_guest(vm: &Vm, gpa: u64, len: usize) -> Vec<u8> {
    let dir = format!("/proc/{}/fd", vm.pid());
    let fd = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .find(|e| {
            std::fs::read_link(e.path())
                .map(|t| t.to_string_lossy().starts_with("/memfd:lendvm-guest-ram"))
                .unwrap_or(false)
        })
        .unwrap_or_else(|| panic!("no guest-ram memfd in {dir}"));
    let f = std::fs::File::open(fd.path()).unwrap();
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, gpa).unwrap();
    buf
}

fn hex(s: &str) -> u64 {
    u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap()
}

/// `injected=` and `refused=` of a guest group line that must say `ok`.
fn group(vm: &Vm, name: &str) -> (u64, u64) {
    let l = vm.expect_ok(name, Duration::ZERO);
    let n = |k| field(&l, k).unwrap().parse::<u64>().unwrap();
    (n("injected"), n("refused"))
}

fn count(log: &str, needle: &str) -> usize {
    log.lines().filter(|l| l.contains(needle)).count()
}

#[test]
fn hostile_guest_is_refused_or_contained() {
    let cluster = Cluster::new(Fabric::Shm);
    let disk = cluster.file("disk.img");
    std::fs::write(&disk, vec![FILL; DISK]).unwrap();
    let lender = cluster.start_lenderd(&[
        format!("{NVME_BDF}=nvme:path={},size=4M", disk.display()),
        format!("{DMATEST_BDF}=dmatest"),
    ]);
    let lender_pid = lender.child.id();
    let lender_fds_idle = fd_count(lender_pid);
    let cluster_arg = cluster.path.display().to_string();
    let sock = cluster.file("api.sock").display().to_string();
    let nvme = format!("{LENDER}:{NVME_BDF},id=nvme0");
    let dma = format!("{LENDER}:{DMATEST_BDF},id=dma0");
    let cmdline = format!(
        "tests=hostile seed={SEED:#x} lba={GOOD_LBA} reps={REPS} flrs={FLRS} wait_ms=120000"
    );
    let mut vm = Vm::start_with_log(
        "64M",
        &[
            "--cluster",
            &cluster_arg,
            "--api-socket",
            &sock,
            "--remote-device",
            &nvme,
            "--remote-device",
            &dma,
            "--cmdline",
            &cmdline,
        ],
        "info",
    );
    vm.wait_api();
    let api = vm.api();
    let mailbox = hex(vm
        .expect_line("MAILBOX ", BOOT_TIMEOUT)
        .trim_start_matches("MAILBOX "));
    vm.expect_line("STEP 1 ", BOOT_TIMEOUT);
    vm.expect_ok("hostile-setup", Duration::ZERO);

    // Baseline: both devices set up (BME, MSI-X), before any abuse.
    let before = api.info().unwrap().counters.unwrap();
    let c0 = api.counters().unwrap();
    let vm_fds = vm.fd_count();
    let vm_lck = vm.proc_status_kb("VmLck");
    let lender_fds = fd_count(lender_pid);
    let vm_log0 = vm.stderr().lines().count();
    let lender_log0 = lender.log().lines().count();
    let events0 = api.events(0).unwrap().last().map_or(0, |e| e.seq + 1);
    let t0 = Instant::now();
    vm.write_guest_u64(mailbox, 1);

    vm.expect_line("STEP 2 ", Duration::from_secs(600));
    let abuse_secs = t0.elapsed().as_secs() + 1;
    let out = vm.stdout();
    eprintln!("{out}");

    // The guest's side: every group ok, with what it injected.
    let dma_out = group(&vm, "hostile-dma-outside-ram");
    let prp = group(&vm, "hostile-prp-lists");
    let doorbells = group(&vm, "hostile-doorbells");
    let msix = group(&vm, "hostile-msix");
    let dt_out = group(&vm, "hostile-dmatest-outside-ram");
    let bars = group(&vm, "hostile-bars");
    let config = group(&vm, "hostile-config");
    let flr = group(&vm, "hostile-flr-storm");
    vm.expect_ok("hostile-guards", Duration::ZERO);
    assert_eq!(flr.0, 2 * FLRS);

    // Counters: exactly what the guest did, per device.
    let c1 = api.counters().unwrap();
    let d = |dev: &str, k: &str| {
        let get = |c: &api::types::VmCountersReport| {
            c.get(dev)
                .and_then(|g| g.get(k))
                .copied()
                .unwrap_or_else(|| panic!("no counter {dev}.{k}: {c:?}"))
        };
        get(&c1) - get(&c0)
    };
    let nvme_faults = d("nvme0", "iommu_faults");
    let dt_faults = d("dma0", "iommu_faults");
    assert!(
        nvme_faults >= dma_out.0 + 4 * REPS,
        "nvme iommu faults {nvme_faults} for {} refused dmas",
        dma_out.0 + 4 * REPS
    );
    assert!(dt_faults >= dt_out.0, "dmatest iommu faults {dt_faults}");
    assert_eq!(d("nvme0", "msix_refused"), 4 * REPS, "{c1:?}");
    assert_eq!(d("dma0", "msix_refused"), 1);
    // Each repetition moves NVMe BAR0 (64-bit) over RAM and over the dmatest BAR and back,
    // low half then high half. The two devices sit behind their lender's switch, where
    // a non-prefetchable 64-bit BAR is below 4 GiB: its high half is already 0, so only the
    // low-half writes move it (two refused per repetition); above 4 GiB each half is a move.
    let probe = vm.expect_ok("nvme-probe", Duration::ZERO);
    let nvme_bar0 = probe
        .split_whitespace()
        .skip_while(|w| *w != "bar0")
        .nth(1)
        .map(hex)
        .unwrap_or_else(|| panic!("no bar0 in {probe}"));
    let per_rep = if nvme_bar0 < 1 << 32 { 2 } else { 4 };
    assert_eq!(
        d("nvme0", "bar_moves_refused"),
        per_rep * REPS,
        "bar0 {nvme_bar0:#x}"
    );
    assert_eq!(d("dma0", "bar_moves_refused"), 3 * REPS);
    assert_eq!(d("nvme0", "flrs"), FLRS);
    // The lender's own counts of the NVMe abuse reach vm.counters (protocol version 7). Not
    // one for one: the controller counts an out-of-range value once until the doorbell
    // changes, a storm of writes may reach it as fewer doorbell updates (shadow doorbells),
    // and other steps (the FLR storm) write doorbells of their own.
    let invalid = d("nvme0", "invalid_doorbells");
    assert!(
        invalid >= 1,
        "invalid doorbells {invalid} for {doorbells:?}: {c1:?}"
    );
    assert_eq!(d("dma0", "flrs"), FLRS);
    // PCIe capability header/devcap and PM control per repetition reach the lender's filter.
    assert!(d("nvme0", "config_writes_refused") >= 3 * REPS);
    assert!(d("dma0", "config_writes_refused") >= 3 * REPS);
    // IOMMU fault events reached the VMM, rate-limited (16, then 2/s; the VMM samples too).
    let events = api.events(events0).unwrap();
    let faults_ev = events.iter().filter(|e| e.event == "iommu-fault").count() as u64;
    assert!(faults_ev >= 1, "no iommu-fault event");
    assert!(
        faults_ev <= 2 * (16 + 2 * abuse_secs),
        "{faults_ev} iommu-fault events in {abuse_secs} s"
    );

    // Logs: bounded per class whatever the repetitions.
    let vm_log = vm.stderr();
    let vm_new: Vec<&str> = vm_log.lines().skip(vm_log0).collect();
    let lender_log = lender.log();
    let lender_new: Vec<&str> = lender_log.lines().skip(lender_log0).collect();
    let vm_new_s = vm_new.join("\n");
    let lender_new_s = lender_new.join("\n");
    let per_second = 2 * (abuse_secs as usize + 1);
    for (what, log, needle, bound) in [
        // Rate limits: 16 lines, then one in 1024, per counter (PCI bus, each MSI-X
        // table, each IOMMU domain...), or one line a second per device.
        ("vmm bar moves", &vm_new_s, "refused move #", 16),
        ("vmm msi-x", &vm_new_s, "not an x86 interrupt", 2 * 16),
        ("vmm flr", &vm_new_s, "function reset", per_second),
        ("vmm config", &vm_new_s, "config write at", per_second),
        (
            "lender iommu",
            &lender_new_s,
            "outside the mapped window",
            3 * 16, // two IOMMU domains + the dmatest model's own line
        ),
        (
            "lender doorbells",
            &lender_new_s,
            "invalid doorbell write #",
            16,
        ),
        ("lender config", &lender_new_s, "refused config write #", 16),
        ("lender reset", &lender_new_s, "function reset", 16),
    ] {
        let n = count(log, needle);
        assert!(
            n <= bound,
            "{what}: {n} log lines (bound {bound}):\n{}",
            log.lines()
                .filter(|l| l.contains(needle))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    let injected_total =
        dma_out.0 + prp.0 + doorbells.0 + msix.0 + dt_out.0 + bars.0 + config.0 + flr.0;
    assert!(
        vm_new.len() + lender_new.len() < 400,
        "{} vmm + {} lender log lines for {injected_total} abuses",
        vm_new.len(),
        lender_new.len()
    );

    // Guard regions in guest RAM, read from the host side.
    let mut guards = 0;
    for l in out.lines().filter(|l| l.starts_with("GUARD ")) {
        let mut w = l.split_whitespace().skip(1);
        let (gpa, len) = (hex(w.next().unwrap()), hex(w.next().unwrap()));
        let mem = read_guest(&vm, gpa, len as usize);
        for (i, c) in mem.chunks_exact(8).enumerate() {
            let a = gpa + 8 * i as u64;
            let v = u64::from_le_bytes(c.try_into().unwrap());
            assert_eq!(v, GUARD_SEED ^ a, "guard word at {a:#x} changed");
        }
        guards += 1;
    }
    assert!(guards >= 3, "guest printed {guards} guard regions");

    // No leak: the same resources as before the abuse (both devices set up again).
    let after = api.info().unwrap().counters.unwrap();
    assert_eq!(after, before, "vm.info counters");
    // API connections come and go: the count must come back to the baseline (or below).
    let settled = poll(Duration::from_secs(5), || {
        (vm.fd_count() <= vm_fds).then_some(())
    });
    assert!(
        settled.is_some(),
        "vmm fds {vm_fds} -> {}:\n{:#?}",
        vm.fd_count(),
        vm.fds()
    );
    assert_eq!(vm.proc_status_kb("VmLck"), vm_lck, "locked memory");
    let settled = poll(Duration::from_secs(5), || {
        (fd_count(lender_pid) <= lender_fds).then_some(())
    });
    assert!(
        settled.is_some(),
        "lender fds {lender_fds} -> {}",
        fd_count(lender_pid)
    );

    vm.write_guest_u64(mailbox, 2);
    vm.expect_ok("hostile-steps", Duration::from_secs(60));
    vm.expect_exit(0, Duration::from_secs(60));

    // Data: the valid writes are there; refused writes (to LBAs 264..) changed nothing.
    assert_backing_has_pattern(&disk, GOOD_LBA, GOOD_LBAS, SEED);
    let data = std::fs::read(&disk).unwrap();
    let (s, e) = (
        (GOOD_LBA * 512) as usize,
        ((GOOD_LBA + GOOD_LBAS) * 512) as usize,
    );
    let stray = data
        .iter()
        .enumerate()
        .find(|&(i, &b)| (i < s || i >= e) && b != FILL)
        .map(|(i, _)| i);
    assert_eq!(stray, None, "backing file changed outside the valid writes");

    // The lender survived and lends both devices again.
    cluster.wait_available(NVME_BDF);
    cluster.wait_available(DMATEST_BDF);
    assert!(cluster.status().is_ok());
    let settled = poll(Duration::from_secs(5), || {
        (fd_count(lender_pid) <= lender_fds_idle).then_some(())
    });
    assert!(
        settled.is_some(),
        "lender fds {lender_fds_idle} idle -> {} after the vm",
        fd_count(lender_pid)
    );

    write_report(&[
        Row::new("NVMe read/write with PRP1 outside guest RAM (past RAM, BAR window, ECAM, LAPIC, own BAR, 64 GiB)", dma_out, "Data Transfer Error; lender IOMMU fault counted and reported (event 0x184)", nvme_faults),
        Row::new("PRP lists: self-chaining last slot, list looping to its start, entries into MMIO holes, list in ECAM / past RAM", prp, "PRP Offset Invalid (bounded walk) or Data Transfer Error; a loop over valid pages completes", 0),
        Row::new("SQ tail / CQ head doorbell beyond the queue size (2 with AER + storm)", doorbells, "write ignored, nothing fetched outside the queue; AER Invalid Doorbell Write Value; queue keeps working", 0),
        Row::new("MSI-X entries with bogus messages (address outside 0xFEEx_xxxx, upper address, reserved data bits / delivery mode)", msix, "vector not routed (no KVM route/irqfd), counted (msix_refused); other vectors work; pending interrupt delivered once fixed", 0),
        Row::new("dmatest copies from/to addresses outside guest RAM", dt_out, "copy fails with error status; device and lender IOMMU count the fault; nothing copied", dt_faults),
        Row::new("BARs programmed over guest RAM, another device's BAR, an MSI-X table page, the LAPIC", bars, "move refused (bar_moves_refused); BAR keeps decoding at its old address; RAM/other device/LAPIC untouched", 0),
        Row::new("Writes to read-only / forbidden config fields (header, MSI-X, PCIe, PM, extended 0x100-0xFFF)", config, "dropped: VMM-owned fields keep their value, lender-owned ones refused by its filter (counted)", 0),
        Row::new("FLR storm (Initiate FLR, back to back, both devices)", flr, "every FLR resets the function (DMA unmapped, MSI-X reset); both devices set up again and work", 0),
    ]);
}

struct Row {
    abuse: &'static str,
    injected: u64,
    refused: u64,
    outcome: &'static str,
    faults: u64,
}

impl Row {
    fn new(
        abuse: &'static str,
        (injected, refused): (u64, u64),
        outcome: &'static str,
        faults: u64,
    ) -> Row {
        Row {
            abuse,
            injected,
            refused,
            outcome,
            faults,
        }
    }
}

/// `target/reliability/hostile.json`. Every loss, leak and crash figure is 0 because the
/// assertions above passed (a failing run writes nothing).
fn write_report(rows: &[Row]) {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .join("reliability");
    std::fs::create_dir_all(&dir).unwrap();
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "abuse": r.abuse,
                "injected": r.injected,
                "refused_or_contained": r.refused,
                "outcome": r.outcome,
                "iommu_faults_counted": r.faults,
                "data_lost_blocks": 0,
                "leaked_resources": 0,
                "crashes": 0,
            })
        })
        .collect();
    let doc = serde_json::json!({
        "test": "tests/tests/hostile.rs hostile_guest_is_refused_or_contained",
        "fabric": "shm",
        "reps": REPS,
        "flrs_per_device": FLRS,
        "rows": rows,
    });
    let path = dir.join("hostile.json");
    std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    eprintln!("wrote {}", path.display());
}
