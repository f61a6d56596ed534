//! The emulated NVMe's Controller Memory Buffer under `lendvm`: lenderd lends the controller
//! with `cmb=2M` (BAR0 grows to 4 MiB: registers, doorbells, and the buffer at 2 MiB); the
//! test guest (`cmb=1`) turns the buffer on with its guest-physical BAR address as CMBMSC.CBA
//! and puts its I/O submission queue there, so every command it submits is stored into the
//! lender's BAR window instead of guest RAM, then runs the usual verified write / read-back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;

const SLBA: u64 = 8;

fn cmb_run(fabric: Fabric, mode: Option<&str>) {
    let cluster = Cluster::new(fabric);
    let disk = cluster.file("disk.img");
    let _lender = cluster.start_lenderd(&[format!(
        "{NVME_BDF}=nvme:path={},size=4M,cmb=2M",
        disk.display()
    )]);
    let mut dev = format!("{LENDER}:{NVME_BDF},id=nvme0");
    if let Some(m) = mode {
        dev.push_str(&format!(",mode={m}"));
    }
    let cmdline = format!("tests=pci,nvme seed={SEED:#x} lba={SLBA} cmb=1");
    let cluster_arg = cluster.path.display().to_string();
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
    let probe = vm.expect_ok("nvme-probe", Duration::ZERO);
    let bar0 = u64::from_str_radix(
        probe
            .split_whitespace()
            .skip_while(|w| *w != "bar0")
            .nth(1)
            .unwrap()
            .trim_start_matches("0x"),
        16,
    )
    .unwrap();
    let cmb = vm.expect_ok("nvme-cmb", Duration::ZERO);
    assert!(
        cmb.contains(&format!("io sq at {:#x} ", bar0 + (2 << 20))),
        "the sq is at bar0 + 2 MiB: {cmb} ({probe})"
    );
    vm.expect_ok("nvme-queues", Duration::ZERO);
    vm.expect_ok("nvme-write", Duration::ZERO);
    let read = vm.expect_ok("nvme-read", Duration::ZERO);
    assert!(read.contains("verified 32768 bytes"), "{read}");
    vm.expect_ok("nvme-flush", Duration::ZERO);
    assert_backing_has_pattern(&disk, SLBA, 64, SEED);
    cluster.wait_available(NVME_BDF);
    assert_eq!(cluster.device(NVME_BDF).iommu_faults, 0);
}

#[test]
fn io_sq_in_the_cmb_over_shm() {
    cmb_run(Fabric::Shm, None);
}

#[test]
fn io_sq_in_the_cmb_over_tcp_trapped() {
    cmb_run(Fabric::Tcp, Some("trapped"));
}
