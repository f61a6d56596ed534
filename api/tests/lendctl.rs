//! `lendctl` end to end against the real server + fake VMM.

mod common;

use std::time::Duration;

use api::fake::FakeVmmConfig;
use api::types::InterruptCounts;
use common::{lendctl, stderr, stdout, Harness};
use serde_json::Value;

#[test]
fn lendctl_ping_info_add_remove_shutdown_tables() {
    let h = Harness::start();
    let o = h.lendctl(&["ping"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("is alive") && out.contains("remote_pci"),
        "{out}"
    );

    let o = h.lendctl(&["add-remote-device", "node3:0000:81:00.0", "--id", "nvme1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        stdout(&o).trim(),
        "added node3:0000:81:00.0 as nvme1 at guest 0000:00:01.0"
    );
    let o = h.lendctl(&["add-remote-device", "node1:01:00.0", "--mode", "trapped"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("as _remote0 at guest 0000:00:02.0"));
    // In NUMA node 1: on that node's root bus; a node the VM lacks is refused by name.
    let o = h.lendctl(&[
        "add-remote-device",
        "node3:0000:82:00.0",
        "--numa-node",
        "2",
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("numa_node=2: this VM has NUMA nodes 0 to 1"),
        "{}",
        stderr(&o)
    );
    let o = h.lendctl(&[
        "add-remote-device",
        "node3:0000:82:00.0",
        "--id",
        "gpu1",
        "--numa-node",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("as gpu1 at guest 0000:01:01.0"),
        "{}",
        stdout(&o)
    );
    assert!(h
        .lendctl(&["remove-device", "gpu1", "--force"])
        .status
        .success());

    h.vmm.with_vmm(|v| {
        v.set_interrupts(
            "nvme1",
            InterruptCounts {
                intx: 0,
                msi: 0,
                msix: 42,
            },
        )
    });
    let o = h.lendctl(&["info"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    eprintln!("{out}");
    assert!(out.contains("state:   Running"), "{out}");
    assert!(out.contains("memory:  512 MiB"), "{out}");
    assert!(out.contains("pci:     slots 1 to 8 for devices"), "{out}");
    assert!(
        out.contains("numa:    node 0: cpus 0, memory 256 MiB, distances 10 21")
            && out.contains("numa:    node 1: cpus 1, memory 256 MiB, distances 21 10"),
        "{out}"
    );
    assert!(
        out.contains("switch:  lender node3 at 0000:00:01.0 (bus 01, 4 ports)"),
        "{out}"
    );
    let header = out.lines().find(|l| l.starts_with("ID")).unwrap();
    assert!(
        header.contains("LENDER BDF") && header.contains("DMA WINDOW"),
        "{out}"
    );
    let row = out.lines().find(|l| l.starts_with("nvme1")).unwrap();
    for cell in [
        "node3",
        "0000:81:00.0",
        "0000:00:01.0",
        "direct",
        "active",
        "yes (512 MiB)",
        "0/0/42",
    ] {
        assert!(row.contains(cell), "{cell} missing in {row:?}");
    }
    assert!(out
        .lines()
        .any(|l| l.starts_with("_remote0") && l.contains("trapped")));

    let o = h.lendctl(&["remove-device", "nvme1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("removal of nvme1 requested"));
    let o = h.lendctl(&["remove-device", "_remote0", "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim(), "removed _remote0");
    let o = h.lendctl(&["info"]);
    assert!(stdout(&o).contains("no remote devices"));

    let o = h.lendctl(&["shutdown"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("vm shutdown requested"));
    assert!(stdout(&h.lendctl(&["info"])).contains("state:   Shutdown"));
}

#[test]
fn lendctl_json_output_matches_openapi() {
    let h = Harness::start();
    let o = h.lendctl(&[
        "--json",
        "add-remote-device",
        "node3:0000:81:00.0",
        "--id",
        "n",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    h.openapi.validate_component("PciDeviceInfo", &v).unwrap();
    assert_eq!(v["id"], "n");

    let o = h.lendctl(&["info", "--json"]);
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    h.openapi.validate_component("VmInfo", &v).unwrap();
    assert_eq!(v["remote_devices"][0]["lender_bdf"], "0000:81:00.0");

    let o = h.lendctl(&["--json", "ping"]);
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    h.openapi.validate_component("VmmPingResponse", &v).unwrap();
}

#[test]
fn lendctl_server_errors_exit_1_with_the_message() {
    let h = Harness::start();
    let cases: &[(&[&str], &str)] = &[
        (
            &["add-remote-device", "node9:0000:81:00.0"],
            "unknown node node9 (known: node1, node3) (http 400",
        ),
        (
            &["remove-device", "ghost"],
            "no device with id ghost (http 404 Not Found)",
        ),
    ];
    for (args, needle) in cases {
        let o = h.lendctl(args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
        assert!(stdout(&o).is_empty());
    }
    assert!(h
        .lendctl(&["add-remote-device", "node3:0000:81:00.0", "--id", "d"])
        .status
        .success());
    let o = h.lendctl(&["add-remote-device", "node3:0000:82:00.0", "--id", "d"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("device id d is already in use (http 409 Conflict)"),
        "{}",
        stderr(&o)
    );
    h.assert_alive();
}

#[test]
fn lendctl_snapshot_sends_the_url_and_reports_refusals() {
    let h = Harness::start();
    let o = h.lendctl(&["snapshot", "file:///tmp/snap1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim(), "snapshot written to file:///tmp/snap1");
    let o = h.lendctl(&["snapshot", " "]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("destination_url is empty"),
        "{}",
        stderr(&o)
    );
    let o = h.lendctl(&["snapshot"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    h.assert_alive();
}

#[test]
fn lendctl_usage_errors_exit_2() {
    let h = Harness::start();
    let o = h.lendctl(&["add-remote-device", "node3:0000:81:20.0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("pci device \"20\""), "{}", stderr(&o));
    let o = h.lendctl(&["remove-device", "a/b"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("device id \"a/b\" is invalid"),
        "{}",
        stderr(&o)
    );
    let o = h.lendctl(&["add-remote-device", "node3:0000:81:00.0", "--mode", "fast"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("expected direct or trapped"));
    let o = h.lendctl(&["frobnicate"]);
    assert_eq!(o.status.code(), Some(2));
    let o = lendctl(&["info"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("needs --api-socket"), "{}", stderr(&o));
    // Nothing reached the VMM.
    assert_eq!(h.info()["remote_devices"], serde_json::json!([]));
}

#[test]
fn lendctl_without_a_server_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("none.sock");
    let o = lendctl(&["--api-socket", sock.to_str().unwrap(), "ping"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("cannot connect to api socket"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn lendctl_times_out_on_a_stuck_vmm() {
    let cfg = FakeVmmConfig {
        behaviour: api::fake::FakeBehaviour::Stall,
        ..Default::default()
    };
    let h = Harness::with(cfg, Duration::from_millis(300));
    let o = h.lendctl(&["info"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("(http 504"), "{}", stderr(&o));
}

#[test]
fn lendctl_lender_commands_need_their_options() {
    let o = lendctl(&["lenders"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("needs --cluster"));
    let o = lendctl(&["status"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("needs --lender"));
    let o = lendctl(&["list"]);
    assert_eq!(o.status.code(), Some(2));
    let o = lendctl(&["--cluster", "/nonexistent.toml", "lenders"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(!stderr(&o).is_empty());
}
