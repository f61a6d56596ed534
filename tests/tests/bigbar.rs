//! A GPU aperture's shape without a GPU: lenderd lends a dmatest engine whose buffer makes
//! BAR0 a 64 GiB 64-bit prefetchable BAR (`dmatest:buf=`, sparse on a memfd), and the guest
//! reaches all of it as memory (issue 33, "large BARs, end to end").

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;

/// 64 GiB less the register page, in KiB: BAR0 is then exactly 64 GiB.
const BUF_KIB: u64 = (64 << 20) - 4;
const BAR_SIZE: u64 = 64 << 30;
/// What attaching the BAR may cost either daemon in resident memory: page tables, the
/// lazily-made memslots' bookkeeping, a few touched pages; far below the BAR's size.
const RSS_SLACK_KB: u64 = 64 << 10;

fn lend_big(cluster: &Cluster) -> Lenderd {
    cluster.start_lenderd(&[format!("{DMATEST_BDF}=dmatest:buf={BUF_KIB}K")])
}

/// The hex number after the word `key` in `line` (`... bar0 0x1000000000 size ...`).
fn hex_after(line: &str, key: &str) -> u64 {
    let v = line
        .split_whitespace()
        .skip_while(|w| *w != key)
        .nth(1)
        .unwrap_or_else(|| panic!("no {key} in {line}"));
    u64::from_str_radix(v.trim_start_matches("0x"), 16).unwrap()
}

/// At boot: the guest sizes BAR0 as a driver does (64 GiB), finds it above 4 GiB and
/// aligned, writes, reads back and has the engine copy out words at the buffer's first page,
/// 4 GiB into it and at its end; an unwritten word reads zero. lenderd holds no more memory
/// after the lease than before it (the reset gave the written pages back).
#[test]
fn a_64_gib_bar_reaches_the_guest_as_memory_end_to_end() {
    big_bar_end_to_end(Fabric::Shm);
}

/// The same over the tcp fabric, where the BAR is not shared memory: the guest's accesses
/// travel the link (trapped), and still nothing is allocated for the untouched BAR.
#[test]
fn a_64_gib_bar_reaches_the_guest_over_tcp() {
    big_bar_end_to_end(Fabric::Tcp);
}

fn big_bar_end_to_end(fabric: Fabric) {
    let cluster = Cluster::new(fabric);
    let lender = lend_big(&cluster);
    let lender_pid = lender.child.id();
    let rss_before = proc_status_kb(lender_pid, "VmRSS");
    let dev = format!("{LENDER}:{DMATEST_BDF},id=big");
    let cluster_arg = cluster.path.display().to_string();
    let cmdline = format!("tests=bigbar seed={SEED:#x}");
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
    vm.expect_exit(0, BOOT_TIMEOUT);
    let bar = vm.expect_ok("bigbar-bar", Duration::ZERO);
    let (bar0, size) = (hex_after(&bar, "bar0"), hex_after(&bar, "size"));
    assert_eq!(size, BAR_SIZE, "{bar}");
    assert!(bar0 >= 4 << 30 && bar0 % BAR_SIZE == 0, "{bar}");
    let ok = vm.expect_ok("bigbar", Duration::ZERO);
    assert!(ok.contains("copied 3 fresh zero"), "{ok}");
    cluster.wait_available(DMATEST_BDF);
    let rss_after = proc_status_kb(lender_pid, "VmRSS");
    assert!(
        rss_after <= rss_before + RSS_SLACK_KB,
        "lenderd went from {rss_before} kB to {rss_after} kB resident"
    );
    let log = lender.log();
    assert!(!log.contains("not cleared"), "{log}");
}

/// At hot-add: the 64 GiB BAR goes into the 64-bit window (placed as at boot, above) and
/// comes out again without either daemon's resident memory growing by anything near the BAR
/// (nothing on the path touches it), and the lease goes back.
#[test]
fn hot_adding_a_64_gib_bar_costs_no_memory_in_proportion() {
    let cluster = Cluster::new(Fabric::Shm);
    let lender = lend_big(&cluster);
    let lender_pid = lender.child.id();
    let vm = boot_with_api(&cluster, "tests=idle total_ms=60000", &[]);
    let api = vm.api();
    let (vm0, l0) = (
        vm.proc_status_kb("VmRSS"),
        proc_status_kb(lender_pid, "VmRSS"),
    );
    add(&api, DMATEST_BDF, "big");
    let (vm1, l1) = (
        vm.proc_status_kb("VmRSS"),
        proc_status_kb(lender_pid, "VmRSS"),
    );
    assert!(
        vm1 <= vm0 + RSS_SLACK_KB && l1 <= l0 + RSS_SLACK_KB,
        "resident memory grew with the BAR: lendvm {vm0} -> {vm1} kB, lenderd {l0} -> {l1} kB"
    );
    remove(&api, "big");
    cluster.wait_available(DMATEST_BDF);
}

/// A live migration of a VM holding the 64 GiB BAR: the lease moves to the destination (the
/// device stays on its lender), whose lendvm does not grow by the BAR either, and the
/// destination can remove it and give the lease back.
#[test]
fn a_vm_with_a_64_gib_bar_migrates_and_the_bar_moves_with_it() {
    let cluster = Cluster::new(Fabric::Shm);
    let _lender = lend_big(&cluster);
    let c = cluster.path.display().to_string();
    let dev = format!("{LENDER}:{DMATEST_BDF},id=big");
    let src_sock = cluster.file("src.sock").display().to_string();
    let mut src = Vm::start_with_log(
        "64M",
        &[
            "--cluster",
            &c,
            "--name",
            "vm-src",
            "--remote-device",
            &dev,
            "--api-socket",
            &src_sock,
            "--cmdline",
            "tests=idle total_ms=60000",
        ],
        "info",
    );
    src.wait_api();
    assert_eq!(cluster.lent_to(DMATEST_BDF).as_deref(), Some("vm-src"));
    let dst_sock = cluster.file("dst.sock").display().to_string();
    let dst = Vm::start_args(
        &[
            "--cluster",
            &c,
            "--name",
            "vm-dst",
            "--api-socket",
            &dst_sock,
        ],
        "info",
    );
    dst.wait_api();
    let rss_idle = dst.proc_status_kb("VmRSS");
    let url = format!("unix:{}", cluster.file("dst.mig").display());
    dst.api()
        .receive_migration(&api::types::VmReceiveMigrationData {
            receiver_url: url.clone(),
        })
        .unwrap();
    src.api()
        .send_migration(&api::types::VmSendMigrationData {
            destination_url: url,
            local: false,
        })
        .unwrap_or_else(|e| panic!("{e}\n--- source\n{}", src.stderr()));
    src.expect_exit(0, BOOT_TIMEOUT);
    assert_eq!(cluster.lent_to(DMATEST_BDF).as_deref(), Some("vm-dst"));
    // The destination holds the guest's 64 MiB of RAM and the device, not the BAR.
    let rss = dst.proc_status_kb("VmRSS");
    assert!(
        rss <= rss_idle + (64 << 10) + RSS_SLACK_KB,
        "the destination went from {rss_idle} kB to {rss} kB resident"
    );
    remove(&dst.api(), "big");
    cluster.wait_available(DMATEST_BDF);
}
