//! SR-IOV used as MR-IOV, end to end: one `lenderd` lends an emulated NVMe PF with `vfs=2`;
//! two `lendvm` processes each borrow a different VF (`--remote-device node1:0000:82:00.N`)
//! and the bare-metal test guest in each drives its VF with the stock NVMe verify workload.
//!
//! Both guests hold after the set-up (`hold=1`: Bus Master on, queues created, the VF's DMA
//! window mapped on the lender) until the test has seen both hold their VF at once; then
//! both are released together and write, read back and verify their pattern at the *same*
//! LBA with different seeds. Each VF's data lands in its own slice of the PF's backing file
//! (VF n at n * size), the PF's slice stays untouched, and both VFs are available again
//! after the VMs exit.
//!
//! `the_pf_is_refused_while_a_vf_is_lent_then_goes_to_a_vm`: the PF is refused to a VM
//! while a VF is held by another (a PF reset would take the VF away), and lent once the VF
//! is back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use lending::protocol::DeviceState;

const VF1: &str = "0000:82:00.1";
const VF2: &str = "0000:82:00.2";
/// Each function's namespace: 4 MiB = 8192 blocks of 512 bytes.
const NS_BYTES: u64 = 4 << 20;
const NS_BLOCKS: u64 = NS_BYTES / 512;
const SLBA: u64 = 8;
const LBAS: u64 = 64;

fn boot_on_vf(cluster: &Cluster, vm: &str, vf: &str, seed: u32) -> Vm {
    boot_on(cluster, vm, vf, seed, true)
}

/// A VM borrowing `function` at boot, running the NVMe verify (after the host's go with
/// `hold`).
fn boot_on(cluster: &Cluster, vm: &str, function: &str, seed: u32, hold: bool) -> Vm {
    let cluster_arg = cluster.path.display().to_string();
    let dev = format!("{LENDER}:{function},id=nvme0");
    let cmdline = format!(
        "tests=pci,nvme seed={seed:#x} lba={SLBA} hold={} wait_ms=60000",
        u8::from(hold)
    );
    Vm::start(
        "64M",
        &[
            "--cluster",
            &cluster_arg,
            "--name",
            vm,
            "--remote-device",
            &dev,
            "--cmdline",
            &cmdline,
        ],
    )
}

#[test]
fn two_vms_each_borrow_a_vf_of_one_pf_and_do_verified_io_at_once() {
    let cluster = Cluster::new(Fabric::Shm);
    let disk = cluster.file("pf.img");
    let _lender = cluster.start_lenderd(&[format!(
        "{NVME_BDF}=nvme:path={},size={NS_BYTES},vfs=2",
        disk.display()
    )]);
    let st = cluster.status().unwrap();
    let rows: Vec<(&str, &str)> = st
        .devices
        .iter()
        .map(|d| (d.summary.id.as_str(), d.summary.kind.as_str()))
        .collect();
    assert_eq!(
        rows,
        [(NVME_BDF, "nvme"), (VF1, "nvme-vf"), (VF2, "nvme-vf")]
    );

    let (seed_a, seed_b) = (SEED, SEED ^ 0x0101_0101);
    let mut a = boot_on_vf(&cluster, "vm-a", VF1, seed_a);
    let mut b = boot_on_vf(&cluster, "vm-b", VF2, seed_b);
    let mut mailboxes = Vec::new();
    for vm in [&a, &b] {
        let m = vm.expect_line("MAILBOX ", BOOT_TIMEOUT);
        mailboxes.push(u64::from_str_radix(m.trim_start_matches("MAILBOX 0x"), 16).unwrap());
        vm.expect_line("STEP 1 nvme-ready", BOOT_TIMEOUT);
    }
    // Both VMs hold their VF at the same time, each with its DMA window mapped.
    for (vf, vm) in [(VF1, "vm-a"), (VF2, "vm-b")] {
        let d = cluster.device(vf);
        assert!(
            matches!(&d.summary.state, DeviceState::Lent { vm: v, .. } if v == vm),
            "{d:?}"
        );
        assert!(
            !d.dma_maps.is_empty(),
            "{vf}: no DMA window while held: {d:?}"
        );
    }
    assert_eq!(
        cluster.device(NVME_BDF).summary.state,
        DeviceState::Available
    );
    // Go: both start their I/O now.
    a.write_guest_u64(mailboxes[0], 1);
    b.write_guest_u64(mailboxes[1], 1);
    for (vm, serial) in [(&mut a, "LENDVM000082001"), (&mut b, "LENDVM000082002")] {
        vm.expect_exit(0, BOOT_TIMEOUT);
        let ident = vm.expect_ok("nvme-identify", Duration::ZERO);
        assert!(ident.contains(&format!("serial \"{serial}\"")), "{ident}");
        let ns = vm.expect_ok("nvme-namespace", Duration::ZERO);
        assert!(ns.contains(&format!("nsze {NS_BLOCKS} lba 512")), "{ns}");
        vm.expect_ok("nvme-hold", Duration::ZERO);
        vm.expect_ok("nvme-write", Duration::ZERO);
        let read = vm.expect_ok("nvme-read", Duration::ZERO);
        assert!(read.contains("verified 32768 bytes"), "{read}");
        vm.expect_ok("nvme-flush", Duration::ZERO);
        let out = vm.stdout();
        assert!(
            out.lines()
                .any(|l| l.starts_with("PCI 00:01.0 1b36:0010 class 010802")),
            "the VF is an NVMe function at the guest's own address:\n{out}"
        );
    }
    // Each VF's blocks are its own slice of the PF's file; the PF's slice is untouched.
    assert_backing_has_pattern(&disk, NS_BLOCKS + SLBA, LBAS, seed_a);
    assert_backing_has_pattern(&disk, 2 * NS_BLOCKS + SLBA, LBAS, seed_b);
    let data = std::fs::read(&disk).unwrap();
    assert_eq!(data.len() as u64, 3 * NS_BYTES);
    assert!(
        data[..NS_BYTES as usize].iter().all(|&x| x == 0),
        "the PF's namespace was written"
    );
    cluster.wait_available(VF1);
    cluster.wait_available(VF2);
}

/// The PF is refused to a VM while a VF is held by another: that `lendvm` fails at boot
/// with the lender's reason, and the VF's VM then does its I/O undisturbed. Once the VF is
/// back the PF goes to a VM: its borrower gets the whole 4 KiB config space of the PF (its
/// SR-IOV capability hidden by the lender) and drives its own namespace (slice 0), leaving
/// the VF's slice as the VF wrote it.
#[test]
fn the_pf_is_refused_while_a_vf_is_lent_then_goes_to_a_vm() {
    let cluster = Cluster::new(Fabric::Shm);
    let disk = cluster.file("pf.img");
    let _lender = cluster.start_lenderd(&[format!(
        "{NVME_BDF}=nvme:path={},size={NS_BYTES},vfs=2",
        disk.display()
    )]);
    let (seed_v, seed_p) = (SEED ^ 0x0202_0202, SEED ^ 0x0303_0303);
    let mut v = boot_on_vf(&cluster, "vm-v", VF2, seed_v);
    let m = v.expect_line("MAILBOX ", BOOT_TIMEOUT);
    let mailbox = u64::from_str_radix(m.trim_start_matches("MAILBOX 0x"), 16).unwrap();
    v.expect_line("STEP 1 nvme-ready", BOOT_TIMEOUT);
    let mut refused = boot_on(&cluster, "vm-p", NVME_BDF, seed_p, false);
    let st = refused.wait_exit(BOOT_TIMEOUT);
    let err = refused.stderr();
    assert!(
        st.is_some_and(|s| !s.success())
            && err.contains(&format!("virtual function {VF2} is lent to"))
            && err.contains("never lent at the same time"),
        "lendvm with the PF while a VF is lent: {st:?}\n{err}"
    );
    assert_eq!(
        cluster.device(NVME_BDF).summary.state,
        DeviceState::Available
    );
    // The VF was lent all along; now it does its I/O.
    assert!(matches!(
        cluster.device(VF2).summary.state,
        DeviceState::Lent { ref vm, .. } if vm == "vm-v"
    ));
    v.write_guest_u64(mailbox, 1);
    v.expect_exit(0, BOOT_TIMEOUT);
    let read = v.expect_ok("nvme-read", Duration::ZERO);
    assert!(read.contains("verified 32768 bytes"), "{read}");
    cluster.wait_available(VF2);

    let mut p = boot_on(&cluster, "vm-p", NVME_BDF, seed_p, false);
    p.expect_exit(0, BOOT_TIMEOUT);
    let read = p.expect_ok("nvme-read", Duration::ZERO);
    assert!(read.contains("verified 32768 bytes"), "{read}");
    let ident = p.expect_ok("nvme-identify", Duration::ZERO);
    assert!(
        ident.contains(&format!("serial \"{NVME_SERIAL}\"")),
        "{ident}"
    );
    cluster.wait_available(NVME_BDF);
    assert_backing_has_pattern(&disk, SLBA, LBAS, seed_p);
    assert_backing_has_pattern(&disk, 2 * NS_BLOCKS + SLBA, LBAS, seed_v);
    cluster.wait_available(VF2);
}
