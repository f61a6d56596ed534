//! The operator endpoints of the control plane against the fake VMM: vm.pause/vm.resume,
//! vmm.shutdown, vm.counters, the vm.events stream and lost-device hints, over HTTP and
//! through lendctl.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use api::events::VmEvent;
use common::{stdout, Harness};
use serde_json::{json, Value};

#[test]
fn pause_resume_and_shutdown_follow_the_state_machine() {
    let h = Harness::start();
    let e = h.expect_error("PUT", "vm.resume", None, 409, "");
    assert_eq!(e, "the vm is not paused");
    assert_eq!(h.call("PUT", "vm.pause", None).status, 204);
    assert_eq!(h.info()["state"], "Paused");
    assert_eq!(
        h.expect_error("PUT", "vm.pause", None, 409, ""),
        "the vm is already paused"
    );
    let e = h.expect_error(
        "PUT",
        "vm.add-remote-device",
        Some(r#"{"device":"node3:0000:81:00.0"}"#),
        409,
        "",
    );
    assert_eq!(e, "cannot add a device: the vm is Paused");
    let o = h.lendctl(&["resume"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(stdout(&o).trim(), "vm resumed");
    assert_eq!(h.info()["state"], "Running");
    let o = h.lendctl(&["pause", "--json"]);
    assert_eq!(stdout(&o).trim(), "{}");
    // vmm.shutdown works from the paused state.
    assert_eq!(h.call("PUT", "vmm.shutdown", None).status, 204);
    assert_eq!(h.info()["state"], "Shutdown");
    assert_eq!(
        h.expect_error("PUT", "vmm.shutdown", None, 409, ""),
        "the vm is already shut down"
    );
}

#[test]
fn counters_are_groups_of_numbers_in_json_and_tables() {
    let h = Harness::start();
    let r = h.call(
        "PUT",
        "vm.add-remote-device",
        Some(r#"{"device":"node3:0000:81:00.0","id":"nvme1"}"#),
    );
    assert_eq!(r.status, 200);
    let r = h.call("GET", "vm.counters", None);
    assert_eq!(r.status, 200);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v, json!({"nvme1": {"interrupts": 0}}));
    h.openapi
        .validate_component("VmCountersReport", &v)
        .expect("vm.counters matches the schema");
    let o = h.lendctl(&["counters"]);
    let text = stdout(&o);
    assert!(text.contains("[nvme1]"), "{text}");
    assert!(text.contains("interrupts"), "{text}");
    let o = h.lendctl(&["counters", "--json"]);
    let j: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(j, v);
}

#[test]
fn events_stream_replays_then_follows_until_the_vmm_closes_it() {
    let h = Harness::start();
    h.events.emit("vm", "vm-booted", [("cpus", Value::from(2))]);
    // follow=false: what is retained, then the response ends.
    let evs = h.client().events(0).unwrap();
    assert_eq!(evs.len(), 1);
    assert_eq!(evs[0].event, "vm-booted");
    for e in &evs {
        h.openapi
            .validate_component("VmEvent", &serde_json::to_value(e).unwrap())
            .unwrap();
    }
    // Follow from seq 0: the backlog first, then live events as they are emitted.
    let (tx, rx) = mpsc::channel::<VmEvent>();
    let client = h.client();
    let follower = std::thread::spawn(move || {
        client.follow_events(Some(0), |line| {
            tx.send(serde_json::from_str(line).unwrap()).is_ok()
        })
    });
    let Ok(first) = rx.recv_timeout(Duration::from_secs(10)) else {
        panic!("follower ended: {:?}", follower.join());
    };
    assert_eq!(first.event, "vm-booted");
    // Events emitted while the stream is open arrive promptly and in order.
    let t0 = Instant::now();
    h.events
        .emit("device", "device-removed", [("id", Value::from("nvme1"))]);
    h.events
        .emit("vm", "vm-shutdown", Vec::<(String, Value)>::new());
    let a = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let b = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert_eq!((a.event.as_str(), a.seq), ("device-removed", 2));
    assert_eq!(a.properties["id"], "nvme1");
    assert_eq!((b.event.as_str(), b.seq), ("vm-shutdown", 3));
    // The VMM closing the bus ends every follower's stream cleanly.
    h.events.close();
    follower.join().unwrap().unwrap();
    // lendctl prints the retained events as JSON lines or a table.
    let o = h.lendctl(&["events", "--no-follow", "--json", "--since", "1"]);
    let lines: Vec<VmEvent> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 3]);
    let o = h.lendctl(&["events", "--no-follow"]);
    let text = stdout(&o);
    assert!(
        text.contains("device-removed") && text.contains("id=nvme1"),
        "{text}"
    );
    // lendctl events (following) ends when the stream ends.
    let o = h.lendctl(&["events"]);
    assert!(o.status.success(), "{o:?}");
    // Bad queries are refused with a message.
    let e = h.expect_error("GET", "vm.events?since=x", None, 400, "");
    assert!(e.contains("since"), "{e}");
}

#[test]
fn lost_devices_say_how_to_clear_them() {
    let h = Harness::start();
    let r = h.call(
        "PUT",
        "vm.add-remote-device",
        Some(r#"{"device":"node3:0000:81:00.0","id":"nvme0"}"#),
    );
    assert_eq!(r.status, 200);
    assert!(h.vmm.with_vmm(|v| v.lose("nvme0")));
    let e = h.expect_error(
        "PUT",
        "vm.add-remote-device",
        Some(r#"{"device":"node3:0000:81:00.0","id":"nvme1"}"#),
        409,
        "",
    );
    assert!(
        e.contains("which is lost") && e.contains("replace_lost"),
        "{e}"
    );
    let o = h.lendctl(&[
        "add-remote-device",
        "node3:0000:81:00.0",
        "--id",
        "nvme0",
        "--replace-lost",
    ]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(h.info()["remote_devices"][0]["lease_state"], "active");
}
