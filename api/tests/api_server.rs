//! The REST server end to end: real server, real client, fake VMM behind the channel + eventfd.
//! Every response is checked against api/openapi.yaml by `Harness::call`.

mod common;

use std::os::unix::fs::FileTypeExt;
use std::time::Duration;

use api::fake::{FakeBehaviour, FakeVmmConfig};
use api::server::{ApiServer, ApiServerConfig, ServerError, ENDPOINTS};
use api::types::{InterruptCounts, LeaseState, RemoteDeviceConfig, VmAddRemoteDeviceData};
use common::{Harness, OpenApi};
use serde_json::{json, Value};

const ADD: &str = "vm.add-remote-device";
const REMOVE: &str = "vm.remove-device";

#[allow(clippy::unwrap_used)]
fn add(h: &Harness, body: &str) -> Value {
    let r = h.call("PUT", ADD, Some(body));
    assert_eq!(r.status, 200, "{}", r.body_text());
    serde_json::from_slice(&r.body).unwrap()
}

// ----------------------------------------------------------------------------- happy paths

#[test]
fn ping_answers_version_pid_features() {
    let h = Harness::start();
    let r = h.call("GET", "vmm.ping", None);
    assert_eq!(r.status, 200);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["pid"], json!(std::process::id()));
    assert_eq!(v["version"], json!(env!("CARGO_PKG_VERSION")));
    assert_eq!(v["features"], json!(["remote_pci"]));
}

#[test]
fn info_shows_config_state_and_boot_devices() {
    let mut cfg = FakeVmmConfig::default();
    cfg.vm.remote_devices = vec!["node1:0000:01:00.0,id=boot0,mode=trapped"
        .parse::<RemoteDeviceConfig>()
        .unwrap()];
    let h = Harness::with(cfg, Duration::from_secs(10));
    let info = h.info();
    assert_eq!(info["state"], "Running");
    assert_eq!(info["config"]["cpus"], 2);
    assert_eq!(info["config"]["memory_size"], 512u64 << 20);
    assert_eq!(
        info["config"]["remote_devices"][0],
        json!({"device": "node1:0000:01:00.0", "id": "boot0", "mode": "trapped"})
    );
    let d = &info["remote_devices"][0];
    assert_eq!(d["id"], "boot0");
    assert_eq!(d["node"], "node1");
    assert_eq!(d["lender_bdf"], "0000:01:00.0");
    assert_eq!(d["guest_bdf"], "0000:00:01.0");
    assert_eq!(d["mode"], "trapped");
    assert_eq!(d["lease_state"], "active");
    assert_eq!(
        d["dma_window"],
        json!({"mapped": true, "size": 512u64 << 20})
    );
    assert_eq!(d["interrupts"], json!({"intx": 0, "msi": 0, "msix": 0}));
}

#[test]
fn add_remote_device_returns_id_and_guest_bdf() {
    let h = Harness::start();
    let v = add(&h, r#"{"device":"node3:0000:81:00.0","id":"nvme1"}"#);
    assert_eq!(v, json!({"id": "nvme1", "bdf": "0000:00:01.0"}));
    // No id: the VMM picks one; short BDF form accepted; mode given.
    let v = add(&h, r#"{"device":"node3:82:00.0","mode":"trapped"}"#);
    assert_eq!(v, json!({"id": "_remote0", "bdf": "0000:00:02.0"}));
    let info = h.info();
    let devs = info["remote_devices"].as_array().unwrap();
    assert_eq!(devs.len(), 2);
    assert_eq!(devs[0]["id"], "_remote0");
    assert_eq!(devs[0]["mode"], "trapped");
    assert_eq!(devs[1]["id"], "nvme1");
    assert_eq!(devs[1]["mode"], "direct");
}

#[test]
fn remove_device_then_slot_is_reused() {
    let h = Harness::start();
    add(&h, r#"{"device":"node3:0000:81:00.0","id":"nvme1"}"#);
    let r = h.call("PUT", REMOVE, Some(r#"{"id":"nvme1"}"#));
    assert_eq!((r.status, r.body.len()), (204, 0));
    assert_eq!(h.info()["remote_devices"], json!([]));
    // Same lender device and id can come back (no leaked registration, cf. CH #8763).
    let v = add(&h, r#"{"device":"node3:0000:81:00.0","id":"nvme1"}"#);
    assert_eq!(v["bdf"], "0000:00:01.0");
}

#[test]
fn cooperative_removal_waits_for_eject_and_force_removes() {
    let cfg = FakeVmmConfig {
        auto_eject: false,
        ..Default::default()
    };
    let h = Harness::with(cfg, Duration::from_secs(10));
    add(&h, r#"{"device":"node3:0000:81:00.0","id":"a"}"#);
    add(&h, r#"{"device":"node3:0000:82:00.0","id":"b"}"#);
    assert_eq!(h.call("PUT", REMOVE, Some(r#"{"id":"a"}"#)).status, 204);
    assert_eq!(h.info()["remote_devices"][0]["lease_state"], "removing");
    // A second plain remove while the eject is pending is a conflict that says what to do.
    h.expect_error("PUT", REMOVE, Some(r#"{"id":"a"}"#), 409, "use force");
    // A re-add of the lender device meanwhile hears that it is still being released (not
    // that it is attached), and what to wait for.
    h.expect_error(
        "PUT",
        ADD,
        Some(r#"{"device":"node3:0000:81:00.0","id":"a2"}"#),
        409,
        "node3:0000:81:00.0 (removed as a) is still being released: the guest has not \
         ejected it yet",
    );
    // The guest ejects: gone.
    assert!(h.vmm.with_vmm(|v| v.guest_eject("a")));
    h.expect_error(
        "PUT",
        REMOVE,
        Some(r#"{"id":"a"}"#),
        404,
        "no device with id a",
    );
    // The guest never ejects b: force.
    assert_eq!(h.call("PUT", REMOVE, Some(r#"{"id":"b"}"#)).status, 204);
    assert_eq!(
        h.vmm.with_vmm(|v| v.device("b").map(|d| d.lease_state)),
        Some(LeaseState::Removing)
    );
    let r = h.call("PUT", REMOVE, Some(r#"{"id":"b","force":true}"#));
    assert_eq!(r.status, 204);
    assert_eq!(h.info()["remote_devices"], json!([]));
}

#[test]
fn shutdown_is_204_and_releases_devices() {
    let h = Harness::start();
    add(&h, r#"{"device":"node3:0000:81:00.0","id":"nvme1"}"#);
    let r = h.call("PUT", "vm.shutdown", None);
    assert_eq!((r.status, r.body.len()), (204, 0));
    let info = h.info();
    assert_eq!(info["state"], "Shutdown");
    assert_eq!(info["remote_devices"], json!([]));
    h.expect_error("PUT", "vm.shutdown", None, 409, "already shut down");
}

#[test]
fn snapshot_body_is_checked_and_needs_a_live_vm() {
    let h = Harness::start();
    let r = h.call(
        "PUT",
        "vm.snapshot",
        Some(r#"{"destination_url":"file:///tmp/x"}"#),
    );
    assert_eq!((r.status, r.body.len()), (204, 0));
    h.expect_error(
        "PUT",
        "vm.snapshot",
        Some(r#"{"destination_url":" "}"#),
        400,
        "destination_url is empty",
    );
    h.expect_error(
        "PUT",
        "vm.snapshot",
        Some(r#"{"destination":"file:///tmp/x"}"#),
        400,
        "unknown field `destination`",
    );
    h.expect_error("PUT", "vm.snapshot", None, 400, "");
    assert_eq!(h.call("PUT", "vm.shutdown", None).status, 204);
    h.expect_error(
        "PUT",
        "vm.snapshot",
        Some(r#"{"destination_url":"/tmp/x"}"#),
        409,
        "cannot snapshot",
    );
}

#[test]
fn interrupt_counts_are_reported() {
    let h = Harness::start();
    add(&h, r#"{"device":"node3:0000:81:00.0","id":"nvme1"}"#);
    let counts = InterruptCounts {
        intx: 1,
        msi: 0,
        msix: 1234,
    };
    assert!(h.vmm.with_vmm(|v| v.set_interrupts("nvme1", counts)));
    assert_eq!(
        h.info()["remote_devices"][0]["interrupts"],
        json!({"intx": 1, "msi": 0, "msix": 1234})
    );
}

#[test]
fn typed_client_round_trips() {
    let h = Harness::start();
    let c = h.client();
    assert_eq!(c.ping().unwrap().pid, i64::from(std::process::id()));
    let d = c
        .add_remote_device(&VmAddRemoteDeviceData {
            device: "node3:0000:81:00.0".parse().unwrap(),
            id: Some("x".into()),
            mode: None,
            replace_lost: false,
            numa_node: None,
        })
        .unwrap();
    assert_eq!(d.bdf.to_string(), "0000:00:01.0");
    assert_eq!(c.info().unwrap().remote_devices[0].id, "x");
    let err = c
        .remove_device(&api::types::VmRemoveDeviceData {
            id: "nope".into(),
            force: false,
        })
        .unwrap_err();
    assert!(
        matches!(&err, api::client::ClientError::Status { status: 404, message, .. } if message == "no device with id nope"),
        "{err}"
    );
    c.shutdown().unwrap();
}

// ----------------------------------------------------------------------------- abuse

#[test]
fn malformed_json_is_400() {
    let h = Harness::start();
    let m = h.expect_error(
        "PUT",
        ADD,
        Some(r#"{"device":"node3:0000:81:00.0""#),
        400,
        "invalid request body",
    );
    assert!(m.contains("EOF") || m.contains("line 1"), "{m}");
    h.expect_error("PUT", ADD, Some("not json"), 400, "invalid request body");
    h.expect_error("PUT", REMOVE, Some("[1,2]"), 400, "invalid request body");
    h.expect_error("PUT", REMOVE, Some(r#"{"id":5}"#), 400, "invalid type");
    h.expect_error("PUT", ADD, Some(""), 400, "missing request body");
    h.expect_error(
        "PUT",
        ADD,
        Some(r#"{"id":"x"}"#),
        400,
        "missing field `device`",
    );
    h.expect_error(
        "PUT",
        ADD,
        Some("\u{0}\u{1}\u{2}"),
        400,
        "invalid request body",
    );
}

#[test]
fn unknown_fields_are_400() {
    let h = Harness::start();
    h.expect_error(
        "PUT",
        ADD,
        Some(r#"{"device":"node3:0000:81:00.0","idd":"x"}"#),
        400,
        "unknown field `idd`",
    );
    h.expect_error(
        "PUT",
        REMOVE,
        Some(r#"{"id":"x","forse":true}"#),
        400,
        "unknown field `forse`",
    );
    assert_eq!(h.info()["remote_devices"], json!([]));
}

#[test]
fn unknown_node_is_400() {
    let h = Harness::start();
    h.expect_error(
        "PUT",
        ADD,
        Some(r#"{"device":"node9:0000:81:00.0"}"#),
        400,
        "unknown node node9 (known: node1, node3)",
    );
    h.expect_error(
        "PUT",
        ADD,
        Some(r#"{"device":"node3:0000:99:00.0"}"#),
        400,
        "node node3 has no device 0000:99:00.0",
    );
    h.expect_error(
        "PUT",
        ADD,
        Some(r#"{"device":"bad node:0000:81:00.0"}"#),
        400,
        "node name",
    );
}

#[test]
fn unreachable_lender_is_502() {
    let cfg = FakeVmmConfig {
        unreachable: ["node5".to_string()].into(),
        ..Default::default()
    };
    let h = Harness::with(cfg, Duration::from_secs(10));
    h.expect_error(
        "PUT",
        ADD,
        Some(r#"{"device":"node5:0000:81:00.0","id":"nvme1"}"#),
        502,
        "lender node5 is unreachable",
    );
    assert_eq!(h.info()["remote_devices"], json!([]));
    // A node outside the cluster is still the client's mistake.
    h.expect_error(
        "PUT",
        ADD,
        Some(r#"{"device":"node9:0000:81:00.0"}"#),
        400,
        "unknown node node9 (known: node1, node3, node5)",
    );
    // Other lenders are unaffected, and the id was not taken by the failed add.
    add(&h, r#"{"device":"node3:0000:81:00.0","id":"nvme1"}"#);
}

#[test]
fn bad_bdf_is_400_naming_the_bad_part() {
    let h = Harness::start();
    let cases = [
        ("node3:0000:81:20.0", r#"pci device "20" in "0000:81:20.0""#),
        ("node3:0000:81:00.8", r#"pci function "8""#),
        ("node3:0000:100:00.0", r#"pci bus "100""#),
        ("node3:12345:81:00.0", r#"pci domain "12345""#),
        ("node3:0000:81:00", "is malformed"),
        ("81:00.0", "has no node"),
        ("", "empty device spec"),
    ];
    for (spec, needle) in cases {
        let body = json!({ "device": spec }).to_string();
        h.expect_error("PUT", ADD, Some(&body), 400, needle);
    }
    h.expect_error(
        "PUT",
        ADD,
        Some(r#"{"device":"node3:0000:81:00.0","mode":"fast"}"#),
        400,
        "unknown variant `fast`",
    );
    h.expect_error(
        "PUT",
        ADD,
        Some(r#"{"device":"node3:0000:81:00.0","id":"a/b"}"#),
        400,
        "device id \"a/b\" is invalid",
    );
    h.expect_error(
        "PUT",
        REMOVE,
        Some(r#"{"id":""}"#),
        400,
        "device id \"\" is invalid",
    );
    assert_eq!(h.info()["remote_devices"], json!([]));
}

#[test]
fn duplicate_id_is_409() {
    let h = Harness::start();
    add(&h, r#"{"device":"node3:0000:81:00.0","id":"nvme1"}"#);
    h.expect_error(
        "PUT",
        ADD,
        Some(r#"{"device":"node3:0000:82:00.0","id":"nvme1"}"#),
        409,
        "device id nvme1 is already in use",
    );
    h.expect_error(
        "PUT",
        ADD,
        Some(r#"{"device":"node3:0000:81:00.0","id":"nvme2"}"#),
        409,
        "node3:0000:81:00.0 is already attached as nvme1",
    );
    assert_eq!(h.info()["remote_devices"].as_array().unwrap().len(), 1);
}

#[test]
fn remove_of_unknown_id_is_404() {
    let h = Harness::start();
    h.expect_error(
        "PUT",
        REMOVE,
        Some(r#"{"id":"ghost"}"#),
        404,
        "no device with id ghost",
    );
}

#[test]
fn double_remove_is_404() {
    let h = Harness::start();
    add(&h, r#"{"device":"node3:0000:81:00.0","id":"nvme1"}"#);
    assert_eq!(h.call("PUT", REMOVE, Some(r#"{"id":"nvme1"}"#)).status, 204);
    h.expect_error(
        "PUT",
        REMOVE,
        Some(r#"{"id":"nvme1"}"#),
        404,
        "no device with id nvme1",
    );
    h.expect_error(
        "PUT",
        REMOVE,
        Some(r#"{"id":"nvme1","force":true}"#),
        404,
        "no device with id nvme1",
    );
}

#[test]
fn add_while_shutting_down_is_409() {
    let h = Harness::start();
    assert_eq!(h.call("PUT", "vm.shutdown", None).status, 204);
    h.expect_error(
        "PUT",
        ADD,
        Some(r#"{"device":"node3:0000:81:00.0","id":"late"}"#),
        409,
        "cannot add a device: the vm is Shutdown",
    );
    assert_eq!(h.info()["remote_devices"], json!([]));
}

#[test]
fn oversized_body_is_413() {
    let h = Harness::start();
    // A syntactically valid but huge body: the limit, not the parser, must reject it.
    let big = format!(
        r#"{{"device":"node3:0000:81:00.0","id":"{}"}}"#,
        "x".repeat(100_000)
    );
    h.expect_error(
        "PUT",
        ADD,
        Some(&big),
        413,
        "larger than the 65536 byte limit",
    );
    // Declared length over the limit with a body that is never sent in full.
    let r = h.raw(
        b"PUT /api/v1/vm.remove-device HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n{\"id\":",
    );
    assert_eq!(r.status, 413, "{}", r.body_text());
    h.assert_alive();
}

#[test]
fn slow_body_is_408() {
    let _ = env_logger::builder().is_test(true).try_init();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("api.sock");
    let vmm = api::fake::FakeVmmThread::spawn(FakeVmmConfig::default()).unwrap();
    let mut cfg = ApiServerConfig::new(&socket);
    cfg.body_timeout = Duration::from_millis(300);
    let server = ApiServer::start(cfg, vmm.api_sender(), vmm.api_event().unwrap()).unwrap();
    let mut s = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    use std::io::{Read, Write};
    s.write_all(
        b"PUT /api/v1/vm.remove-device HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n{\"id\":",
    )
    .unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let r = api::client::parse_response(&out).unwrap();
    assert_eq!(r.status, 408, "{}", r.body_text());
    assert!(r.body_text().contains("not received within 300 ms"));
    OpenApi::load().check_response("PUT", "vm.remove-device", &r);
    assert!(api::client::ApiClient::new(&socket, Duration::from_secs(5))
        .ping()
        .is_ok());
    server.shutdown().unwrap();
}

#[test]
fn unknown_path_is_404_and_wrong_method_is_405() {
    let h = Harness::start();
    h.expect_error(
        "GET",
        "vm.nothing",
        None,
        404,
        "unknown endpoint /api/v1/vm.nothing",
    );
    let r = h.raw(b"GET /other HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_eq!(
        (r.status, r.body_text()),
        (404, "unknown endpoint /other".to_string())
    );
    let m = h.expect_error("PUT", "vm.info", Some("{}"), 405, "use GET");
    assert!(
        m.contains("method PUT is not allowed on /api/v1/vm.info"),
        "{m}"
    );
    let r = h.call("GET", ADD, None);
    assert_eq!(r.status, 405);
    assert_eq!(r.header("allow"), Some("PUT"));
    h.expect_error("DELETE", REMOVE, None, 405, "use PUT");
}

#[test]
fn garbage_http_is_400_and_server_keeps_serving() {
    let h = Harness::start();
    let r = h.raw(b"THIS IS NOT HTTP\r\n\r\n");
    assert_eq!(r.status, 400);
    let r = h.raw(b"GET /api/v1/vmm.ping HTTP/1.1\r\nBad Header\r\n\r\n");
    assert_eq!(r.status, 400);
    // A client that connects and hangs up without a request.
    drop(std::os::unix::net::UnixStream::connect(&h.socket).unwrap());
    h.assert_alive();
}

// ----------------------------------------------------------------------------- VMM failures

#[test]
fn stuck_vmm_gives_504_not_a_hang() {
    let cfg = FakeVmmConfig {
        behaviour: FakeBehaviour::Stall,
        ..Default::default()
    };
    let h = Harness::with(cfg, Duration::from_millis(300));
    let r = h.call("GET", "vm.info", None);
    assert_eq!(r.status, 504);
    assert!(
        r.body_text()
            .contains("did not answer vm.info within 300 ms"),
        "{}",
        r.body_text()
    );
    // The server itself still answers (404 does not need the VMM).
    assert_eq!(h.call("GET", "vm.x", None).status, 404);
}

#[test]
fn vmm_dropping_requests_gives_503() {
    let cfg = FakeVmmConfig {
        behaviour: FakeBehaviour::Drop,
        ..Default::default()
    };
    let h = Harness::with(cfg, Duration::from_secs(10));
    let r = h.call("PUT", "vm.shutdown", None);
    assert_eq!(r.status, 503);
    assert!(r.body_text().contains("dropped the vm.shutdown request"));
}

#[test]
fn vmm_gone_gives_503() {
    let _ = env_logger::builder().is_test(true).try_init();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("api.sock");
    let (tx, rx) = std::sync::mpsc::channel();
    drop(rx);
    let evt = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let server = ApiServer::start(ApiServerConfig::new(&socket), tx, evt).unwrap();
    let c = api::client::ApiClient::new(&socket, Duration::from_secs(5));
    let r = c.request("GET", "vmm.ping", None).unwrap();
    assert_eq!(r.status, 503);
    assert!(r.body_text().contains("not accepting requests"));
    OpenApi::load().check_response("GET", "vmm.ping", &r);
    server.shutdown().unwrap();
}

// ----------------------------------------------------------------------------- lifecycle

#[test]
fn shutdown_joins_thread_and_removes_socket() {
    let mut h = Harness::start();
    assert!(h.socket.exists());
    h.assert_alive();
    h.stop_server();
    assert!(!h.socket.exists(), "socket file removed");
    assert!(std::os::unix::net::UnixStream::connect(&h.socket).is_err());
    // Drop (without shutdown) also cleans up.
    let server = ApiServer::start(
        ApiServerConfig::new(&h.socket),
        h.vmm.api_sender(),
        h.vmm.api_event().unwrap(),
    )
    .unwrap();
    assert!(h.socket.exists());
    drop(server);
    assert!(!h.socket.exists());
}

#[test]
fn shutdown_with_a_request_in_flight_still_returns() {
    let cfg = FakeVmmConfig {
        behaviour: FakeBehaviour::Stall,
        ..Default::default()
    };
    // The VMM never answers and the request timeout is long: only the drain deadline can end
    // the in-flight request.
    let mut h = Harness::with(cfg, Duration::from_secs(30));
    let client = h.client();
    let waiter = std::thread::spawn(move || client.request("GET", "vm.info", None));
    // Wait (bounded) until the request is queued at the VMM side: the server is then busy.
    for _ in 0..100 {
        if std::os::unix::net::UnixStream::connect(&h.socket).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    h.stop_server();
    assert!(!h.socket.exists());
    // The client gets an error (connection closed) rather than hanging for 30 s.
    let r = waiter.join().unwrap();
    assert!(r.is_err() || r.unwrap().status >= 500);
}

#[test]
fn socket_path_conflicts_are_reported() {
    let h = Harness::start();
    // Live socket: refused, and the running server is untouched.
    let err = ApiServer::start(
        ApiServerConfig::new(&h.socket),
        h.vmm.api_sender(),
        h.vmm.api_event().unwrap(),
    )
    .unwrap_err();
    assert!(matches!(err, ServerError::InUse(_)), "{err}");
    h.assert_alive();
    // A regular file: refused, not deleted.
    let file = h.dir.path().join("file");
    std::fs::write(&file, b"keep").unwrap();
    let err = ApiServer::start(
        ApiServerConfig::new(&file),
        h.vmm.api_sender(),
        h.vmm.api_event().unwrap(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("is not a socket"), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"keep");
    // A stale socket nobody listens on: replaced.
    let stale = h.dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(std::fs::symlink_metadata(&stale)
        .unwrap()
        .file_type()
        .is_socket());
    let s = ApiServer::start(
        ApiServerConfig::new(&stale),
        h.vmm.api_sender(),
        h.vmm.api_event().unwrap(),
    )
    .unwrap();
    let c = api::client::ApiClient::new(&stale, Duration::from_secs(5));
    assert_eq!(c.ping().unwrap().pid, i64::from(std::process::id()));
    s.shutdown().unwrap();
}

#[test]
fn concurrent_clients_are_all_served() {
    let h = Harness::start();
    std::thread::scope(|s| {
        for t in 0..6 {
            let h = &h;
            s.spawn(move || {
                for i in 0..10 {
                    let ep = if (t + i) % 2 == 0 {
                        "vmm.ping"
                    } else {
                        "vm.info"
                    };
                    assert_eq!(h.call("GET", ep, None).status, 200);
                }
            });
        }
    });
}

// ----------------------------------------------------------------------------- the document

#[test]
fn openapi_document_covers_every_endpoint_and_request_type() {
    let o = OpenApi::load();
    for (name, method) in ENDPOINTS {
        o.operation(method, name);
    }
    assert_eq!(o.doc()["paths"].as_object().unwrap().len(), ENDPOINTS.len());
    // Every $ref resolves.
    fn walk(o: &OpenApi, v: &Value) {
        match v {
            Value::Object(m) => {
                if m.contains_key("$ref") {
                    o.resolve(v);
                }
                m.values().for_each(|c| walk(o, c));
            }
            Value::Array(a) => a.iter().for_each(|c| walk(o, c)),
            _ => {}
        }
    }
    walk(&o, o.doc());
    // The request schemas accept what our request types serialize, and reject extras.
    let add = VmAddRemoteDeviceData {
        device: "node3:0000:81:00.0".parse().unwrap(),
        id: Some("nvme1".into()),
        mode: Some(api::types::RemoteDeviceMode::Trapped),
        replace_lost: false,
        numa_node: None,
    };
    o.validate_component("VmAddRemoteDevice", &serde_json::to_value(&add).unwrap())
        .unwrap();
    o.validate_component("VmRemoveDevice", &json!({"id": "nvme1", "force": true}))
        .unwrap();
    o.validate_component(
        "VmSnapshotConfig",
        &serde_json::to_value(api::types::VmSnapshotConfig {
            destination_url: "file:///tmp/s".into(),
        })
        .unwrap(),
    )
    .unwrap();
    assert!(o
        .validate_component("VmSnapshotConfig", &json!({"destination_url": "x", "y": 1}))
        .is_err());
    o.validate_component(
        "VmSendMigrationData",
        &serde_json::to_value(api::types::VmSendMigrationData {
            destination_url: "unix:/tmp/m".into(),
            local: true,
        })
        .unwrap(),
    )
    .unwrap();
    o.validate_component(
        "VmReceiveMigrationData",
        &serde_json::to_value(api::types::VmReceiveMigrationData {
            receiver_url: "tcp:127.0.0.1:4444".into(),
        })
        .unwrap(),
    )
    .unwrap();
    assert!(o
        .validate_component("VmReceiveMigrationData", &json!({"destination_url": "x"}))
        .is_err());
    assert!(o
        .validate_component("VmRemoveDevice", &json!({"id": "nvme1", "x": 1}))
        .is_err());
    assert!(o
        .validate_component("PciDeviceInfo", &json!({"id": "a", "bdf": "0000:00:20.0"}))
        .is_err());
    assert!(o
        .validate_component(
            "VmmPingResponse",
            &json!({"version": "1", "pid": "1", "features": []})
        )
        .is_err());
}
