//! Peer-to-peer DMA in one VM between two dmatest engines lent by one lender (real `lenderd`
//! and `lendvm` on the shm fabric, the bare-metal test guest as the driver, `tests=p2p`):
//! device A copies guest RAM into device B's BAR by B's guest-physical address, and back;
//! a copy to an address that is neither RAM nor a BAR ends with STATUS.error and an IOMMU
//! fault on the lender; after the guest moves B's BAR0 (decoding on) the copy works at the
//! new address and is refused at the old one.
//!
//! Guest work: two 4 KiB pattern fills and three compares (well under 1 M emulated
//! instructions).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;

const DMATEST2_BDF: &str = "0000:84:00.0";

#[test]
fn two_dmatests_of_one_lender_copy_peer_to_peer() {
    let cluster = Cluster::new(Fabric::Shm);
    let _lender = cluster.start_lenderd(&[
        format!("{DMATEST_BDF}=dmatest"),
        format!("{DMATEST2_BDF}=dmatest"),
    ]);
    let a = format!("{LENDER}:{DMATEST_BDF},id=dta");
    let b = format!("{LENDER}:{DMATEST2_BDF},id=dtb");
    let cluster_arg = cluster.path.display().to_string();
    let cmdline = format!("tests=p2p seed={SEED:#x}");
    let mut vm = Vm::start_with_log(
        "64M",
        &[
            "--cluster",
            &cluster_arg,
            "--remote-device",
            &a,
            "--remote-device",
            &b,
            "--cmdline",
            &cmdline,
        ],
        "info",
    );
    vm.expect_exit(0, BOOT_TIMEOUT);
    let t = Duration::ZERO;
    let probe = vm.expect_ok("p2p-probe", t);
    let copy = vm.expect_ok("p2p-copy", t);
    assert!(copy.contains("verified"), "{copy}");
    let read = vm.expect_ok("p2p-read", t);
    assert!(read.contains("verified"), "{read}");
    vm.expect_ok("p2p-refused", t);
    let moved = vm.expect_ok("p2p-move", t);
    assert!(moved.contains("verified"), "{moved}");

    // The VMM mapped B's BAR for A at B's guest address, withdrew it for the move and
    // mapped it again at the new one.
    let err = vm.stderr();
    let hex = |w: &str| u64::from_str_radix(w.trim_start_matches("0x"), 16).unwrap();
    let after = |line: &str, word: &str| {
        let mut it = line.split_whitespace();
        it.by_ref().find(|w| *w == word);
        hex(it.next().unwrap_or_else(|| panic!("no {word} in {line}")))
    };
    let peer = after(&probe, "peer");
    let mapped: Vec<u64> = err
        .lines()
        .filter(|l| l.contains("dta: peer bar 0 of dtb mapped at"))
        .map(|l| after(l, "at"))
        .collect();
    assert_eq!(
        mapped,
        vec![peer, peer + 0x10_0000],
        "mapped at B's address, then at the moved one:\n{err}"
    );
    // The lender counted A's refused DMAs (the hole and the old BAR address).
    let d = cluster.device(DMATEST_BDF);
    assert!(d.iommu_faults >= 2, "{d:?}");
    cluster.wait_available(DMATEST_BDF);
    cluster.wait_available(DMATEST2_BDF);
}
