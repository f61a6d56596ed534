//! A real `lendvm` (the bare-metal test guest) borrowing through the etcd cluster directory:
//! the lender registers in a three-member etcd cluster on loopback (started by the test,
//! killed by pid on drop), the VM hot-adds the device by claiming it there, the etcd leader
//! is SIGKILLed, and the VM keeps its device: the lease stays active, the guest keeps using
//! it, removing and re-adding it (a new claim, after the leader change) works.
//!
//! Also: a device claimed by one VM is refused to a second VM (409, "claimed by").

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use api::client::ApiClient;
use api::types::{LeaseState, VmAddRemoteDeviceData, VmInfo, VmRemoveDeviceData};
use common::*;
use lending::directory::testing::EtcdCluster;

const T: Duration = BOOT_TIMEOUT;
/// Directory lease TTL of the test (short, so a wrong expiry would show within the test).
// Long enough that a claim's keepalive survives the etcd election after the leader is
// killed on a loaded 2-core CI host (at 2 s it once expired there, and the VM lost the device).
const TTL_S: u64 = 4;

fn add(api: &ApiClient, id: &str) -> Result<api::types::PciDeviceInfo, String> {
    api.add_remote_device(&VmAddRemoteDeviceData {
        device: format!("{LENDER}:{DMATEST_BDF}").parse().unwrap(),
        id: Some(id.to_string()),
        mode: None,
        replace_lost: false,
    })
    .map_err(|e| e.to_string())
}

fn info(api: &ApiClient) -> VmInfo {
    api.info().unwrap()
}

#[test]
fn a_vm_keeps_its_device_through_an_etcd_leader_change() {
    let mut etcd = EtcdCluster::start(3);
    let dir = tempfile::tempdir().unwrap();
    let file = directory_file(
        dir.path(),
        &etcd,
        TTL_S,
        "[link]\nheartbeat_ms = 100\npeer_timeout_ms = 1000\nconnect_timeout_ms = 2000\n",
    );
    let sock = dir.path().join("node1.sock");
    let _lender = Lenderd::command(binary("lenderd"), LENDER, &file)
        .log(dir.path().join("lenderd.log"))
        .arg("--control")
        .arg(&sock)
        .device(format!("{DMATEST_BDF}=dmatest"))
        .spawn_until_listening(&sock);
    let api_sock = dir.path().join("api.sock");
    let mut vm = Vm::start(
        "64M",
        &[
            "--cluster",
            &file.display().to_string(),
            "--api-socket",
            &api_sock.display().to_string(),
            "--cmdline",
            &format!("tests=hotplug rounds=2 seed={SEED:#x}"),
        ],
    );
    vm.wait_api();
    let api = vm.api();
    vm.expect_line("HOTPLUG ready", T);
    // The lender registers right after it listens: retry the add (bounded) until it has.
    let t0 = Instant::now();
    let added = loop {
        match add(&api, "d0") {
            Ok(a) => break a,
            Err(e) if t0.elapsed() < Duration::from_secs(10) && e.contains("not registered") => {
                std::thread::sleep(Duration::from_millis(100))
            }
            Err(e) => panic!("add: {e}"),
        }
    };
    vm.expect_nth_line("TEST dmatest-copy ok", 0, T);

    // A second VM cannot take the claimed device.
    let api2_sock = dir.path().join("api2.sock");
    let vm2 = Vm::start(
        "64M",
        &[
            "--cluster",
            &file.display().to_string(),
            "--api-socket",
            &api2_sock.display().to_string(),
            "--cmdline",
            "tests=idle",
        ],
    );
    vm2.wait_api();
    let e = add(&vm2.api(), "d0").unwrap_err();
    assert!(e.contains("409") || e.contains("claimed by"), "{e}");
    drop(vm2);

    let old = etcd.wait_leader(Duration::from_secs(10));
    etcd.members[old].kill();
    let new = etcd.wait_leader(Duration::from_secs(20));
    assert_ne!(old, new);
    // Three TTLs after the change the lease is still active (no surprise removal).
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3 * TTL_S) {
        let i = info(&api);
        let d = i
            .remote_devices
            .iter()
            .find(|d| d.id == "d0")
            .unwrap_or_else(|| panic!("d0 is gone from vm.info: {i:?}\n{}", vm.stderr()));
        assert_eq!(d.lease_state, LeaseState::Active, "{i:?}\n{}", vm.stderr());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        vm.count_lines("HOTPLUG event "),
        1,
        "the guest saw a removal"
    );

    // Remove and add again: a fresh claim through the new leader, and the guest uses it.
    api.remove_device(&VmRemoveDeviceData {
        id: "d0".into(),
        force: false,
    })
    .unwrap();
    let l = vm.expect_line("HOTPLUG eject ", T);
    assert_eq!(
        field(&l, "slot"),
        Some(added.bdf.device.to_string().as_str()),
        "{l}"
    );
    let gone = poll(Duration::from_secs(10), || {
        info(&api).remote_devices.is_empty().then_some(())
    });
    assert!(gone.is_some());
    let t0 = Instant::now();
    loop {
        // The released claim is deleted by the VMM's revoke; retry briefly if the lender
        // has not yet seen the old lease end.
        match add(&api, "d0") {
            Ok(_) => break,
            Err(e) if t0.elapsed() < Duration::from_secs(10) => {
                eprintln!("re-add: {e}");
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(e) => panic!("re-add: {e}"),
        }
    }
    vm.expect_nth_line("TEST dmatest-copy ok", 1, T);
    api.remove_device(&VmRemoveDeviceData {
        id: "d0".into(),
        force: false,
    })
    .unwrap();
    vm.expect_ok("hotplug", T);
    vm.expect_exit(0, T);
}
