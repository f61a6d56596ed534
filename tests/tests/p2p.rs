//! Peer-to-peer DMA in one VM between two dmatest engines lent by one lender, and by two
//! lenders (real `lenderd`s and `lendvm` on the shm and tcp fabrics, the bare-metal test
//! guest as the driver, `tests=p2p`):
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
    run_guest(&cluster.path, &a, &b, Topology::OneSwitch);
    // The lender counted A's refused DMAs (the hole and the old BAR address).
    let d = cluster.device(DMATEST_BDF);
    assert!(d.iommu_faults >= 2, "{d:?}");
    cluster.wait_available(DMATEST_BDF);
    cluster.wait_available(DMATEST2_BDF);
}

/// One lender over tcp: the lender requires B's capability (a grant to itself) for the
/// same-lender mapping, which the VMM's router asks for.
#[test]
fn two_dmatests_of_one_lender_copy_peer_to_peer_tcp() {
    let cluster = Cluster::new(Fabric::Tcp);
    let _lender = cluster.start_lenderd(&[
        format!("{DMATEST_BDF}=dmatest"),
        format!("{DMATEST2_BDF}=dmatest"),
    ]);
    let a = format!("{LENDER}:{DMATEST_BDF},id=dta");
    let b = format!("{LENDER}:{DMATEST2_BDF},id=dtb");
    run_guest(&cluster.path, &a, &b, Topology::OneSwitch);
    let log = std::fs::read_to_string(cluster.file("lenderd.log")).unwrap();
    assert!(
        log.contains(&format!("granted to lender {LENDER}")),
        "no capability grant:\n{log}"
    );
    cluster.wait_available(DMATEST_BDF);
    cluster.wait_available(DMATEST2_BDF);
}

/// A on `node1`, B on `node2`: node1 reaches node2 over its own lender-to-lender link.
fn two_lenders(fabric: Fabric) {
    let cluster = Cluster::two_lenders(fabric);
    let l1 = start_lender(&cluster, "node1", DMATEST_BDF);
    let l2 = start_lender(&cluster, "node2", DMATEST2_BDF);
    let a = format!("node1:{DMATEST_BDF},id=dta");
    let b = format!("node2:{DMATEST2_BDF},id=dtb");
    run_guest(&cluster.path, &a, &b, Topology::RootBus);
    let log1 = std::fs::read_to_string(cluster.file("node1.log")).unwrap();
    assert!(
        log1.contains("lender-to-lender link to node2 up"),
        "node1 never linked to node2:\n{log1}"
    );
    assert!(log1.contains("peer-to-peer across lenders"), "{log1}");
    let log2 = std::fs::read_to_string(cluster.file("node2.log")).unwrap();
    assert!(log2.contains("attached by node1"), "{log2}");
    // The VM is gone: both leases end, the grants and the link with them.
    let d = lender_device(&cluster, "node1", DMATEST_BDF);
    assert!(d.iommu_faults >= 2, "{d:?}");
    // node2 withdrew every window it exported to node1 (at the BAR move and at the end).
    let withdrawn = poll(Duration::from_secs(10), || {
        let log2 = std::fs::read_to_string(cluster.file("node2.log")).unwrap();
        let attached = log2.matches("attached by node1").count();
        let revoked = log2
            .lines()
            .filter(|l| l.contains(") to node1: window ") && l.contains(" revoked ("))
            .count();
        (attached >= 2 && revoked == attached).then_some(())
    });
    assert!(
        withdrawn.is_some(),
        "{}",
        std::fs::read_to_string(cluster.file("node2.log")).unwrap()
    );
    for (node, bdf) in [("node1", DMATEST_BDF), ("node2", DMATEST2_BDF)] {
        let ok = poll(Duration::from_secs(10), || {
            (lender_device(&cluster, node, bdf).summary.state
                == lending::protocol::DeviceState::Available)
                .then_some(())
        });
        assert!(ok.is_some(), "{node}:{bdf} not given back");
    }
    drop((l1, l2));
}

/// The lenders know each other only through the etcd cluster directory (a cluster file
/// without nodes; each lender registers its own control address): node1 finds node2 there
/// for its lender-to-lender link, and the VM finds both there.
#[test]
fn two_dmatests_of_two_lenders_found_in_etcd_copy_peer_to_peer() {
    use lending::directory::testing::EtcdCluster;
    let etcd = EtcdCluster::start(1);
    let dir = tempfile::tempdir().unwrap();
    let file = directory_file(dir.path(), &etcd, 4, "");
    let lender = |node: &str, bdf: &str| {
        let sock = dir.path().join(format!("{node}.sock"));
        Lenderd::command(binary("lenderd"), node, &file)
            .log(dir.path().join(format!("{node}.log")))
            .arg("--control")
            .arg(&sock)
            .device(format!("{bdf}=dmatest"))
            .spawn_until_listening(&sock)
    };
    let l1 = lender("node1", DMATEST_BDF);
    let l2 = lender("node2", DMATEST2_BDF);
    // Each lender registers right after it listens.
    let (directory, _) = lending::directory::open(
        &file.display().to_string(),
        lending::directory::static_file::FanOut {
            local: "p2p-test".into(),
            token: TOKEN.into(),
            client: "p2p-test".into(),
            connect_timeout: Duration::from_secs(2),
        },
    )
    .unwrap();
    let registered = poll(Duration::from_secs(10), || {
        directory.snapshot().ok().filter(|s| s.devices.len() == 2)
    });
    assert!(registered.is_some(), "lenders never registered in etcd");
    let a = format!("node1:{DMATEST_BDF},id=dta");
    let b = format!("node2:{DMATEST2_BDF},id=dtb");
    run_guest(&file, &a, &b, Topology::RootBus);
    let log1 = std::fs::read_to_string(dir.path().join("node1.log")).unwrap();
    assert!(
        log1.contains("lender-to-lender link to node2 up"),
        "node1 never linked to node2:\n{log1}"
    );
    let log2 = std::fs::read_to_string(dir.path().join("node2.log")).unwrap();
    assert!(log2.contains("attached by node1"), "{log2}");
    drop((l1, l2));
}

#[test]
fn two_dmatests_of_two_lenders_copy_peer_to_peer_shm() {
    two_lenders(Fabric::Shm);
}

#[test]
fn two_dmatests_of_two_lenders_copy_peer_to_peer_tcp() {
    two_lenders(Fabric::Tcp);
}

/// node2 (B's lender) is killed while A keeps copying into B's BAR: node1 unmaps B's window
/// as its link to node2 dies, A's copies end with STATUS.error and node1 counts the faults;
/// afterwards node1's device is given back with nothing left mapped.
#[test]
fn killing_the_targets_lender_refuses_the_sources_dma() {
    let cluster = Cluster::two_lenders(Fabric::Shm);
    let _l1 = start_lender(&cluster, "node1", DMATEST_BDF);
    let mut l2 = start_lender(&cluster, "node2", DMATEST2_BDF);
    let a = format!("node1:{DMATEST_BDF},id=dta");
    let b = format!("node2:{DMATEST2_BDF},id=dtb");
    let cluster_arg = cluster.path.display().to_string();
    let cmdline = format!("tests=p2p-loss seed={SEED:#x} wait_ms=30000");
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
    let copy = vm.expect_ok("p2p-copy", BOOT_TIMEOUT);
    assert!(copy.contains("verified"), "{copy}");
    let before = lender_device(&cluster, "node1", DMATEST_BDF).iommu_faults;
    l2.kill();
    vm.expect_exit(0, BOOT_TIMEOUT);
    let lost = vm.expect_ok("p2p-lost", Duration::ZERO);
    let log1 = std::fs::read_to_string(cluster.file("node1.log")).unwrap();
    // Unmapped by node1's link watcher, or (if lendvm's removal of the lost device came
    // first) by lendvm's P2P_UNMAP_REMOTE: either way before A's copies failed.
    assert!(
        log1.contains("lender-to-lender link to node2 ended")
            && log1.contains(" on node2 at iova ")
            && log1.contains(" removed ("),
        "node1 did not unmap at the link's death:\n{log1}\n{lost}"
    );
    let d = lender_device(&cluster, "node1", DMATEST_BDF);
    assert!(d.iommu_faults > before, "{d:?}");
    let ok = poll(Duration::from_secs(10), || {
        (lender_device(&cluster, "node1", DMATEST_BDF).summary.state
            == lending::protocol::DeviceState::Available)
            .then_some(())
    });
    assert!(ok.is_some(), "node1's device not given back");
}

/// Where the two devices sit in the guest.
#[derive(PartialEq)]
enum Topology {
    /// One lender's two devices: behind its switch, a PCI-to-PCI bridge at 00:01.0 whose
    /// secondary bus 01 holds them, ports 0 and 1.
    OneSwitch,
    /// One device per lender: each on the root bus, no switch.
    RootBus,
}

/// Boots the test guest with dmatests `a` (id dta) and `b` (id dtb) and checks its p2p
/// steps and the VMM's mappings of B's BAR for A (at B's address, then the moved one), in
/// the topology `topology` (the guest finds the devices behind bridges as firmware would).
fn run_guest(cluster_file: &std::path::Path, a: &str, b: &str, topology: Topology) {
    let cluster_arg = cluster_file.display().to_string();
    let cmdline = format!("tests=p2p seed={SEED:#x}");
    let mut vm = Vm::start_with_log(
        "64M",
        &[
            "--cluster",
            &cluster_arg,
            "--remote-device",
            a,
            "--remote-device",
            b,
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
    let switch_line = err.lines().find(|l| l.contains("pci: switch of lender"));
    let placed = |id: &str| {
        err.lines()
            .find(|l| l.contains(&format!("remote device {id} (")))
            .and_then(|l| l.rsplit(" at ").next())
            .unwrap_or_else(|| panic!("no placement of {id}:\n{err}"))
            .trim()
            .to_string()
    };
    let (at_a, at_b) = (placed("dta"), placed("dtb"));
    if topology == Topology::OneSwitch {
        let sw = switch_line.unwrap_or_else(|| panic!("no switch made:\n{err}"));
        assert!(sw.contains(" at 0000:00:01.0 (bus 01, 4 ports)"), "{sw}");
        assert_eq!(
            (at_a.as_str(), at_b.as_str()),
            ("0000:01:00.0", "0000:01:01.0")
        );
        // The guest found B behind the bridge, where the VMM put it.
        assert!(probe.contains("peer-bdf 01:01.0"), "{probe}");
    } else {
        assert!(
            switch_line.is_none(),
            "one device per lender needs no switch:\n{err}"
        );
        assert!(
            at_a.starts_with("0000:00:") && at_b.starts_with("0000:00:"),
            "{at_a} {at_b}"
        );
    }
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
}

fn lender_device(cluster: &Cluster, node: &str, bdf: &str) -> lending::protocol::DeviceStatus {
    let session = api::lenders::Session {
        local: ntb::NodeId::new("lendvm-tests").unwrap(),
        token: TOKEN.to_string(),
        connect_timeout: Duration::from_secs(2),
    };
    let n = api::lenders::lender(&cluster.cfg, node).unwrap();
    let c = session.connect(&cluster.cfg, n).unwrap();
    c.status()
        .unwrap()
        .devices
        .into_iter()
        .find(|d| d.summary.id == bdf)
        .unwrap_or_else(|| panic!("{node} has no device {bdf}"))
}

fn start_lender(cluster: &Cluster, name: &str, bdf: &str) -> lending::testing::Lenderd {
    let _ = std::fs::remove_file(cluster.file(&format!("{name}.sock")));
    lending::testing::Lenderd::command(binary("lenderd"), name, &cluster.path)
        .log(cluster.file(&format!("{name}.log")))
        .token(TOKEN)
        .device(format!("{bdf}=dmatest"))
        .spawn_until("answering status requests", |_| {
            let session = api::lenders::Session {
                local: ntb::NodeId::new("lendvm-tests").unwrap(),
                token: TOKEN.to_string(),
                connect_timeout: Duration::from_secs(2),
            };
            api::lenders::lender(&cluster.cfg, name)
                .ok()
                .and_then(|n| session.connect(&cluster.cfg, n).ok())
                .is_some_and(|c| c.status().is_ok())
        })
}
