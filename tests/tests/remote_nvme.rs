//! Boot-time remote devices (`lendvm --cluster F --remote-device NODE:BDF[,id=..][,mode=..]`)
//! end to end: the real `lenderd` lends an emulated NVMe controller (file-backed) or a dmatest
//! engine, `lendvm` borrows it, and the bare-metal test guest drives it as a PCI function.
//!
//! * `nvme_over_shm_direct` / `nvme_over_tcp_trapped`: the guest finds the controller at its
//!   guest PCI address, identifies it (model/serial are the lender's), writes a pattern to 64
//!   LBAs, reads it back and verifies it, takes MSI-X interrupts, exits 0; the lender's backing
//!   file then holds the pattern.
//! * `bus_master_enable_maps_and_unmaps_dma`: the lender has no DMA window before Bus Master
//!   Enable, one after, none after it is cleared; the VMM's pinned memory (VmLck) goes up and
//!   back down. The guest pauses at each step (`tests=bme-steps`) until the test acknowledges
//!   through a mailbox in guest RAM.
//! * `bad_remote_devices_fail_before_the_guest_starts`: unknown node, unreachable lender, busy
//!   device, bad or unknown BDF → exit code 2 and one error line naming the cause.
//!
//! Guest work per test: well under 1 M emulated instructions (queue set-up, 32 KiB pattern
//! fill and compare, console output).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use lending::protocol::DeviceState;

const SLBA: u64 = 8;
const LBAS: u64 = 64;

fn nvme_spec(cluster: &Cluster) -> String {
    format!(
        "{NVME_BDF}=nvme:path={},size=4M",
        cluster.file("disk.img").display()
    )
}

/// Boots the guest with the lender's NVMe as a boot-time device and checks the whole run.
fn nvme_end_to_end(fabric: Fabric, mode: Option<&str>) {
    let cluster = Cluster::new(fabric);
    let _lender = cluster.start_lenderd(&[nvme_spec(&cluster)]);
    let mut dev = format!("{LENDER}:{NVME_BDF},id=nvme0");
    if let Some(m) = mode {
        dev.push_str(&format!(",mode={m}"));
    }
    let cmdline = format!("tests=pci,nvme seed={SEED:#x} lba={SLBA}");
    let cluster_arg = cluster.path.display().to_string();
    let mut vm = Vm::start_with_log(
        &cluster.memory("64M"),
        &[
            "--cluster",
            &cluster_arg,
            "--remote-device",
            &dev,
            "--cmdline",
            &cmdline,
        ],
        "info",
    );
    vm.expect_exit(0, BOOT_TIMEOUT);
    let out = vm.stdout();
    eprintln!("{out}");
    // The VMM's log says how the device is reached: the fabric, and direct or trapped BARs.
    let err = vm.stderr();
    let (fabric_word, mode_word) = match fabric {
        Fabric::Shm => ("on Shm", "(direct)"),
        Fabric::Tcp => ("on Tcp", "(trapped)"),
        Fabric::Bar => ("on Bar", "(trapped)"),
    };
    assert!(
        err.contains(fabric_word) && err.contains(mode_word),
        "want {fabric_word:?} and {mode_word:?} in the VMM log:\n{err}"
    );

    // Found by class at its guest address (the first boot device takes slot 1 of bus 0; not
    // the lender's 82:00.0), with the BARs the VMM assigned.
    let probe = vm.expect_ok("nvme-probe", Duration::ZERO);
    let bdf = probe.split_whitespace().nth(3).unwrap().to_string();
    assert_eq!(bdf, "00:01.0", "{probe}");
    assert!(
        probe.contains("bar0 0x100000000 "),
        "the 64-bit BAR0 comes from the 64-bit window: {probe}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with(&format!("PCI {bdf} 1b36:0010 class 010802"))),
        "ECAM enumeration did not list the borrowed controller at {bdf}:\n{out}"
    );
    // The controller is the lender's: its identify data is what lenderd configured.
    let ident = vm.expect_ok("nvme-identify", Duration::ZERO);
    assert!(
        ident.contains(&format!("model \"{NVME_MODEL}\"")),
        "{ident}"
    );
    assert!(
        ident.contains(&format!("serial \"{NVME_SERIAL}\"")),
        "{ident}"
    );
    let ns = vm.expect_ok("nvme-namespace", Duration::ZERO);
    assert!(ns.contains("nsze 8192 lba 512"), "{ns}");
    vm.expect_ok("nvme-queues", Duration::ZERO);
    vm.expect_ok("nvme-write", Duration::ZERO);
    let read = vm.expect_ok("nvme-read", Duration::ZERO);
    assert!(read.contains("verified 32768 bytes"), "{read}");
    vm.expect_ok("nvme-flush", Duration::ZERO);
    let msix = vm.expect_ok("nvme-msix", Duration::ZERO);
    let count: u64 = field(&msix, "count").unwrap().parse().unwrap();
    assert!(count >= 1, "{msix}");

    // The data went through the lender's controller into its backing file.
    assert_backing_has_pattern(&cluster.file("disk.img"), SLBA, LBAS, SEED);
    // The lease ended with the VM.
    cluster.wait_available(NVME_BDF);
    // How the lender reached guest RAM for the device's DMA: shm and bar map it (on bar
    // through the shared region), tcp goes by messages.
    let log = std::fs::read_to_string(cluster.file("lenderd.log")).unwrap();
    let how = match fabric {
        Fabric::Shm | Fabric::Bar => "mapped directly",
        Fabric::Tcp => "mapped by messages",
    };
    assert!(
        log.lines()
            .any(|l| l.contains("borrower window") && l.contains(how)),
        "want a borrower window {how} in the lender's log:\n{log}"
    );
}

#[test]
fn nvme_over_shm_direct() {
    nvme_end_to_end(Fabric::Shm, None);
}

#[test]
fn nvme_over_tcp_trapped() {
    nvme_end_to_end(Fabric::Tcp, Some("trapped"));
}

/// The bar fabric: BARs trapped over tcp, guest RAM inside the shared region, which the lender
/// maps directly (as it would through an NTB BAR) for the device's DMA.
#[test]
fn nvme_over_bar_dma_through_the_shared_region() {
    nvme_end_to_end(Fabric::Bar, Some("trapped"));
}

#[test]
fn bus_master_enable_maps_and_unmaps_dma() {
    let cluster = Cluster::new(Fabric::Shm);
    let _lender = cluster.start_lenderd(&[format!("{DMATEST_BDF}=dmatest")]);
    let dev = format!("{LENDER}:{DMATEST_BDF},id=dma0");
    let cluster_arg = cluster.path.display().to_string();
    let cmdline = format!("tests=bme-steps seed={SEED:#x} wait_ms=20000");
    let mut vm = Vm::start(
        "64M",
        &[
            "--cluster",
            &cluster_arg,
            "--remote-device",
            &dev,
            "--cmdline",
            &cmdline,
        ],
    );
    let t = BOOT_TIMEOUT;
    let mailbox = vm.expect_line("MAILBOX ", t);
    let gpa = u64::from_str_radix(mailbox.trim_start_matches("MAILBOX 0x"), 16).unwrap();

    // Step 1: Memory Space on, Bus Master off: lent, but no DMA window, nothing pinned.
    vm.expect_line("STEP 1 ", t);
    let d = cluster.device(DMATEST_BDF);
    assert!(matches!(d.summary.state, DeviceState::Lent { .. }), "{d:?}");
    assert!(d.dma_maps.is_empty(), "DMA mapped before BME: {d:?}");
    let locked_before = vm.proc_status_kb("VmLck");
    vm.write_guest_u64(gpa, 1);

    // Step 2: Bus Master on: guest RAM pinned and mapped on the lender (and the copy works).
    vm.expect_line("STEP 2 ", t);
    vm.expect_ok("dmatest-copy", Duration::ZERO);
    let d = cluster.device(DMATEST_BDF);
    let mapped: u64 = d.dma_maps.iter().map(|m| m.1).sum();
    assert!(
        mapped >= 60 << 20,
        "after BME the lender maps guest RAM: {d:?}"
    );
    let locked_on = vm.proc_status_kb("VmLck");
    assert!(
        locked_on >= locked_before + (60 << 10),
        "VmLck {locked_before} kB -> {locked_on} kB after BME"
    );
    vm.write_guest_u64(gpa, 2);

    // Step 3: Bus Master off: unmapped on the lender, unpinned here.
    vm.expect_line("STEP 3 ", t);
    let d = cluster.device(DMATEST_BDF);
    assert!(
        d.dma_maps.is_empty(),
        "DMA still mapped after BME off: {d:?}"
    );
    let locked_off = vm.proc_status_kb("VmLck");
    assert_eq!(
        locked_off, locked_before,
        "VmLck {locked_before} kB -> {locked_on} kB -> {locked_off} kB"
    );
    vm.write_guest_u64(gpa, 3);
    vm.expect_ok("bme-steps", t);
    vm.expect_exit(0, t);
}

/// `lendvm` with `args` must exit 2 with exactly one stderr line containing every needle,
/// before the guest prints anything.
fn boot_error(cluster: &Cluster, device: &str, needles: &[&str]) {
    let cluster_arg = cluster.path.display().to_string();
    let mut vm = Vm::start(
        "64M",
        &[
            "--cluster",
            &cluster_arg,
            "--remote-device",
            device,
            "--cmdline",
            "tests=none",
        ],
    );
    let st = vm.wait_exit(Duration::from_secs(30));
    let err = vm.stderr();
    assert_eq!(
        st.and_then(|s| s.code()),
        Some(2),
        "{device}: status {st:?}, stderr {err}"
    );
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "{device}: want one error line, got {lines:?}"
    );
    for n in needles {
        assert!(lines[0].contains(n), "{device}: {:?} lacks {n:?}", lines[0]);
    }
    assert!(
        vm.stdout().trim().is_empty(),
        "{device}: the guest ran: {}",
        vm.stdout()
    );
}

#[test]
fn bad_remote_devices_fail_before_the_guest_starts() {
    let cluster = Cluster::new(Fabric::Shm);
    // Before lenderd runs: node1 is unreachable; node9 never is; node7 is not in the file.
    boot_error(
        &cluster,
        &format!("node7:{DMATEST_BDF}"),
        &["unknown node", "node7"],
    );
    boot_error(
        &cluster,
        &format!("node9:{DMATEST_BDF}"),
        &["node9", "unreachable"],
    );
    boot_error(
        &cluster,
        &format!("{LENDER}:{DMATEST_BDF}"),
        &[LENDER, "unreachable"],
    );
    let _lender = cluster.start_lenderd(&[format!("{DMATEST_BDF}=dmatest")]);
    // Malformed BDFs are rejected by the parser; a well-formed one the lender lacks by it.
    boot_error(
        &cluster,
        &format!("{LENDER}:0000:83:00.9"),
        &["0000:83:00.9"],
    );
    boot_error(
        &cluster,
        &format!("{LENDER}:0000:83:20.0"),
        &["0000:83:20.0"],
    );
    boot_error(
        &cluster,
        &format!("{LENDER}:0000:99:00.0"),
        &[LENDER, "0000:99:00.0"],
    );
    // Busy: someone else holds the lease.
    let session = api::lenders::Session {
        local: ntb::NodeId::new("other-borrower").unwrap(),
        token: TOKEN.to_string(),
        connect_timeout: Duration::from_secs(2),
    };
    let node = api::lenders::lender(&cluster.cfg, LENDER).unwrap();
    let client = session.connect(&cluster.cfg, node).unwrap();
    let lease = client.borrow(DMATEST_BDF, "other-vm").unwrap();
    boot_error(
        &cluster,
        &format!("{LENDER}:{DMATEST_BDF}"),
        &[DMATEST_BDF, "busy", "other-vm"],
    );
    lease.return_device().unwrap();
    cluster.wait_available(DMATEST_BDF);
}

/// On bar, guest RAM outside the shared region cannot be reached by the lender's device:
/// Bus Master Enable is refused with the reason and the remedy, and nothing is lent half-way.
#[test]
fn bar_guest_ram_outside_the_shared_region_is_refused_by_name() {
    let cluster = Cluster::new(Fabric::Bar);
    let _lender = cluster.start_lenderd(&[nvme_spec(&cluster)]);
    let dev = format!("{LENDER}:{NVME_BDF},id=nvme0,mode=trapped");
    let cmdline = format!("tests=pci,nvme seed={SEED:#x} lba={SLBA}");
    let cluster_arg = cluster.path.display().to_string();
    let mut vm = Vm::start_with_log(
        "64M",
        &[
            "--cluster",
            &cluster_arg,
            "--remote-device",
            &dev,
            "--cmdline",
            &cmdline,
        ],
        "info",
    );
    let st = vm.wait_exit(BOOT_TIMEOUT);
    let err = vm.stderr();
    let out = vm.stdout();
    eprintln!("status {st:?}\n{out}\n{err}");
    // The device's DMA is refused (master abort), so the guest's first DMA command fails; the
    // VMM stays up and the guest ends its run normally, reporting the failure.
    assert!(out.contains("TEST nvme-identify fail"), "{out}");
    assert_eq!(st.and_then(|s| s.code()), Some(1), "{err}");
    assert!(
        err.contains("is not inside the shared region") && err.contains("--memory SIZE,shared="),
        "{err}"
    );
    cluster.wait_available(NVME_BDF);
}
