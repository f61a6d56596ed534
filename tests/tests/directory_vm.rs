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
        numa_node: None,
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
    let mut vm = hotplug_vm(&file, &dir.path().join("api.sock"), 2);
    let api = vm.api();
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
    let vm2 = vm_on(&file, &dir.path().join("api2.sock"), "tests=idle");
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

/// Starts a VM of the bare-metal guest with `cmdline` on the cluster `file`, its API at
/// `sock`, once the API answers.
fn vm_on(file: &std::path::Path, sock: &std::path::Path, cmdline: &str) -> Vm {
    let vm = Vm::start(
        "64M",
        &[
            "--cluster",
            &file.display().to_string(),
            "--api-socket",
            &sock.display().to_string(),
            "--cmdline",
            cmdline,
        ],
    );
    vm.wait_api();
    vm
}

/// Starts a VM of the bare-metal guest's hotplug loop (`rounds` ejects) on `file`.
fn hotplug_vm(file: &std::path::Path, sock: &std::path::Path, rounds: u32) -> Vm {
    let vm = vm_on(
        file,
        sock,
        &format!("tests=hotplug rounds={rounds} seed={SEED:#x}"),
    );
    vm.expect_line("HOTPLUG ready", T);
    vm
}

/// Adds `d0` (the lender's dmatest) to `api`, retrying (bounded) while the lender is not
/// registered yet or still ends the previous holder's lease.
fn add_retrying(api: &ApiClient) {
    let t0 = Instant::now();
    loop {
        match add(api, "d0") {
            Ok(_) => return,
            Err(e) if t0.elapsed() < Duration::from_secs(20) => {
                eprintln!("add: {e}");
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(e) => panic!("add: {e}"),
        }
    }
}

/// The lender's own records (`lenderd --audit-log`, read into a chaos history and decided by
/// the chaos checker) across a lender paused longer than its peer timeout: the VM holding
/// the device is told it is lost while the lender is stopped; the lender, continued, ends
/// that lease, and a second VM's lease comes after its end with a higher fencing token
/// (the directory claim's revision). One holder at a time, growing tokens, nothing served
/// on the first lease after its end: by the lender's records, not the harness's belief.
#[test]
fn a_paused_lender_hands_the_device_on_by_its_own_records() {
    use lendvm_tests::chaos::audit::{entries, monotonic_ms};
    use lendvm_tests::chaos::check::{check, Bounds};
    use lendvm_tests::chaos::history::Op;

    let t0 = monotonic_ms();
    let etcd = EtcdCluster::start(1);
    let dir = tempfile::tempdir().unwrap();
    let file = directory_file(
        dir.path(),
        &etcd,
        TTL_S,
        "[link]\nheartbeat_ms = 100\npeer_timeout_ms = 1000\nconnect_timeout_ms = 2000\n",
    );
    let sock = dir.path().join("node1.sock");
    let audit = dir.path().join("audit.jsonl");
    let lender = Lenderd::command(binary("lenderd"), LENDER, &file)
        .log(dir.path().join("lenderd.log"))
        .arg("--control")
        .arg(&sock)
        .arg("--audit-log")
        .arg(&audit)
        .device(format!("{DMATEST_BDF}=dmatest"))
        .spawn_until_listening(&sock);
    let pid = lender.child.id() as libc::pid_t;

    // Two rounds: the guest ejects the lost device and keeps running (its API answers).
    let a = hotplug_vm(&file, &dir.path().join("a.sock"), 2);
    add_retrying(&a.api());
    a.expect_nth_line("TEST dmatest-copy ok", 0, T);

    // SAFETY: signals to our own child, which is alive (its handle is held).
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let stopped_at = monotonic_ms();
    // The VM finds the link silent past the peer timeout: the device is lost (then
    // ejected by the guest and gone from vm.info).
    let lost = poll(Duration::from_secs(20), || {
        a.api().info().ok().and_then(|i| {
            i.remote_devices
                .iter()
                .all(|d| d.id != "d0" || d.lease_state == LeaseState::Lost)
                .then_some(())
        })
    });
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    assert!(lost.is_some(), "the VM was not told: {}", a.stderr());
    a.expect_line("HOTPLUG eject ", T);
    drop(a);

    let b = hotplug_vm(&file, &dir.path().join("b.sock"), 1);
    add_retrying(&b.api());
    b.expect_nth_line("TEST dmatest-copy ok", 0, T);
    b.api()
        .remove_device(&VmRemoveDeviceData {
            id: "d0".into(),
            force: false,
        })
        .unwrap();
    let mut b = b;
    b.expect_exit(0, T);
    // The lender ends B's lease once B's VMM has returned it.
    let ended = poll(Duration::from_secs(10), || {
        let text = std::fs::read_to_string(&audit).unwrap_or_default();
        (text.matches("\"event\":\"end\"").count() >= 2).then_some(text)
    })
    .unwrap_or_else(|| panic!("the lender did not end both leases:\n{}", lender.log()));

    let h = entries(&ended, t0).unwrap();
    let grants: Vec<(u64, u64, String)> = h
        .iter()
        .filter_map(|e| match &e.op {
            Op::LeaseGrant {
                lease,
                fence,
                holder,
                ..
            } => Some((*lease, *fence, holder.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(grants.len(), 2, "{ended}");
    assert!(grants[1].1 > grants[0].1, "fencing tokens {grants:?}");
    assert_ne!(grants[0].2, grants[1].2, "{grants:?}");
    // The first lease's end is the lender's, after the pause (it could not end it while
    // stopped), and it serves nothing on it afterwards (the checker's rule).
    let end_a = h
        .iter()
        .find_map(|e| match &e.op {
            Op::LeaseEnd { lease, .. } if *lease == grants[0].0 => Some(e.start_ms),
            _ => None,
        })
        .unwrap();
    assert!(
        end_a + t0 >= stopped_at,
        "lease ended at {end_a} ms, before the lender was stopped at {} ms",
        stopped_at - t0
    );
    let r = check(&h, &Bounds::default());
    assert!(r.ok(), "{r}\n{ended}");
    drop(lender);
}
