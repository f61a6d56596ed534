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

/// lenderd lending the NVMe with a 2 MiB CMB (BAR0: 4 MiB); its backing file.
fn lend_cmb_nvme(cluster: &Cluster) -> (Lenderd, std::path::PathBuf) {
    let disk = cluster.file("disk.img");
    let lender = cluster.start_lenderd(&[format!(
        "{NVME_BDF}=nvme:path={},size=4M,cmb=2M",
        disk.display()
    )]);
    (lender, disk)
}

/// The test guest with the lent NVMe (`dev`, `mode=` included) and `extra` arguments.
fn start_with(cluster: &Cluster, dev: &str, cmdline: &str, extra: &[&str]) -> Vm {
    let cluster_arg = cluster.path.display().to_string();
    let mut args = vec![
        "--cluster",
        &cluster_arg,
        "--remote-device",
        dev,
        "--cmdline",
        cmdline,
    ];
    args.extend_from_slice(extra);
    Vm::start("64M", &args)
}

fn cmb_run(fabric: Fabric, mode: Option<&str>) {
    let cluster = Cluster::new(fabric);
    let (_lender, disk) = lend_cmb_nvme(&cluster);
    let mut dev = format!("{LENDER}:{NVME_BDF},id=nvme0");
    if let Some(m) = mode {
        dev.push_str(&format!(",mode={m}"));
    }
    let cmdline = format!("tests=pci,nvme seed={SEED:#x} lba={SLBA} cmb=1");
    let mut vm = start_with(&cluster, &dev, &cmdline, &[]);
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

/// The guest's 64-bit PCI window (`--pci-mmio64-size`) must hold every 64-bit BAR: a BAR that
/// does not fit is refused with the sizes and the option named, at launch (lendvm exits, the
/// lease goes back) and at hot-add (the API answers the same, the VM runs on); bad values of
/// the option are refused by name.
#[test]
fn a_bar_larger_than_the_64bit_window_is_refused_naming_the_sizes() {
    let cluster = Cluster::new(Fabric::Shm);
    let (_lender, _disk) = lend_cmb_nvme(&cluster);
    let dev = format!("{LENDER}:{NVME_BDF},id=nvme0");
    // BAR0 is 4 MiB (registers, doorbells and the 2 MiB buffer); the window 2 MiB.
    let mut vm = start_with(&cluster, &dev, "tests=pci", &["--pci-mmio64-size", "2M"]);
    let st = vm.wait_exit(BOOT_TIMEOUT);
    assert!(st.is_some_and(|s| !s.success()), "{st:?} {}", vm.stderr());
    let err = vm.stderr();
    assert!(
        err.contains(
            "no room for a 4 MiB 64-bit BAR in the guest's 64-bit PCI window of 2 MiB at \
             0x100000000 (0 bytes already taken)"
        ) && err.contains("--pci-mmio64-size"),
        "{err}"
    );
    cluster.wait_available(NVME_BDF);

    // Hot-added into a running VM with the same window: refused, the VM runs on.
    let mut vm = boot_with_api(
        &cluster,
        &format!("tests=hotplug rounds=1 seed={SEED:#x} wait_ms=120000"),
        &["--pci-mmio64-size", "2M"],
    );
    let api = vm.api();
    vm.expect_line("HOTPLUG ready", BOOT_TIMEOUT);
    let e = api
        .add_remote_device(&api::types::VmAddRemoteDeviceData {
            device: spec(NVME_BDF),
            id: Some("nvme0".into()),
            mode: None,
            replace_lost: false,
            numa_node: None,
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("409")
            && e.contains("no room for a 4 MiB 64-bit BAR")
            && e.contains("--pci-mmio64-size"),
        "{e}"
    );
    assert_eq!(vm.child.try_wait().unwrap(), None, "the VM exited");
    cluster.wait_available(NVME_BDF);
    let _ = vm.child.kill();

    // Bad values, by name.
    for (size, want) in [
        ("3M", "invalid --pci-mmio64-size '3M'"),
        ("lots", "invalid size 'lots'"),
        ("1048576T", "past the guest's"),
    ] {
        let mut vm = Vm::start(
            "64M",
            &["--pci-mmio64-size", size, "--cmdline", "tests=pci"],
        );
        let st = vm.wait_exit(BOOT_TIMEOUT);
        assert!(st.is_some_and(|s| !s.success()), "{size}: {st:?}");
        assert!(vm.stderr().contains(want), "{size}: {}", vm.stderr());
    }
}
