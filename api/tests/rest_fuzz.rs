//! Request-body fuzzing of every REST endpoint, in-process: the real `ApiServer` (axum, Unix
//! socket) in front of the fake VMM, driven through the real client (responses are also
//! checked against `api/openapi.yaml` by the harness).
//!
//! Properties, each over `PROPTEST_CASES` cases (proptest's default 256 when unset;
//! `scripts/test.sh` runs a fixed larger budget):
//!
//! * `random_bodies_get_a_4xx_with_a_message`: arbitrary bytes and arbitrary JSON values to
//!   the endpoints that take a body: never a panic or 5xx, always a 4xx with a text message,
//!   and the server keeps answering.
//! * `mutated_bodies_are_refused_naming_the_field`: a valid body with one mutation (a field
//!   set to a random JSON value, a required field dropped, an unknown field added, the text
//!   truncated or a byte inserted): whatever the server accepts, the parser accepts too;
//!   whatever the parser refuses is a 400 whose message names the field concerned.
//! * `valid_bodies_round_trip`: generated valid add bodies are accepted with the id asked for
//!   and removed again; bodies survive serialize → parse unchanged.
//! * `bodies_on_bodiless_endpoints_are_ignored`: GET endpoints and pause/resume answer as
//!   without a body.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use api::types::{RemoteDeviceMode, VmAddRemoteDeviceData, VmRemoveDeviceData};
use common::Harness;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{json, Map, Value};

const ADD: &str = "vm.add-remote-device";
const REMOVE: &str = "vm.remove-device";

/// proptest's config from the environment (`PROPTEST_CASES`), no failure files.
fn config() -> Config {
    Config {
        failure_persistence: None,
        ..Config::default()
    }
}

/// Any JSON value, a few levels deep.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        (-1e12..1e12f64).prop_map(|f| json!(f)),
        ".{0,40}".prop_map(Value::String),
        // Strings that look like the fields' real values.
        "(node[0-9]|[a-z]{1,8}):([0-9a-f]{4}:)?[0-9a-f]{2}:[0-9a-f]{2}\\.[0-9]"
            .prop_map(Value::String),
        "(direct|trapped|fast|)".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A valid device id.
fn id() -> impl Strategy<Value = String> {
    "[A-Za-z0-9_.-]{1,24}"
}

/// A valid add body for the fake VMM's lenders (`node1:0000:01:00.0`, `node3:0000:81/82:00.0`).
fn valid_add() -> impl Strategy<Value = VmAddRemoteDeviceData> {
    (
        prop_oneof![
            Just("node1:0000:01:00.0"),
            Just("node3:0000:81:00.0"),
            Just("node3:82:00.0"),
        ],
        prop::option::of(id()),
        prop::option::of(prop_oneof![
            Just(RemoteDeviceMode::Direct),
            Just(RemoteDeviceMode::Trapped)
        ]),
        any::<bool>(),
    )
        .prop_map(|(device, id, mode, replace_lost)| VmAddRemoteDeviceData {
            device: device.parse().unwrap(),
            id,
            mode,
            replace_lost,
            numa_node: None,
        })
}

#[derive(Debug, Clone)]
enum Mutation {
    /// Set field to a value.
    Set(&'static str, Value),
    /// Drop the field.
    Drop(&'static str),
    /// Add a field the type does not have.
    Unknown(String, Value),
    /// Cut the text at this fraction of its length.
    Truncate(f64),
    /// Insert this byte at this fraction of the text.
    Insert(f64, u8),
}

fn mutation(fields: &'static [&'static str]) -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (prop::sample::select(fields), any_json()).prop_map(|(f, v)| Mutation::Set(f, v)),
        1 => prop::sample::select(fields).prop_map(Mutation::Drop),
        1 => ("[a-z]{1,12}", any_json()).prop_map(|(f, v)| Mutation::Unknown(f, v)),
        1 => (0.0..1.0f64).prop_map(Mutation::Truncate),
        1 => (0.0..1.0f64, any::<u8>()).prop_map(|(at, b)| Mutation::Insert(at, b)),
    ]
}

const ADD_FIELDS: &[&str] = &["device", "id", "mode", "replace_lost"];
const REMOVE_FIELDS: &[&str] = &["id", "force"];

/// Applies `m` to the JSON object `base`; returns the body and the field the error must name
/// (none for text-level damage).
fn apply(base: &Value, m: &Mutation) -> (Vec<u8>, Option<String>) {
    let mut obj = base.as_object().unwrap().clone();
    match m {
        Mutation::Set(f, v) => {
            obj.insert(f.to_string(), v.clone());
            (
                Value::Object(obj).to_string().into_bytes(),
                Some(f.to_string()),
            )
        }
        Mutation::Drop(f) => {
            obj.remove(*f);
            (
                Value::Object(obj).to_string().into_bytes(),
                Some(f.to_string()),
            )
        }
        Mutation::Unknown(f, v) => {
            let known = ADD_FIELDS.contains(&f.as_str()) || REMOVE_FIELDS.contains(&f.as_str());
            obj.insert(f.clone(), v.clone());
            let name = (!known).then(|| f.clone());
            (Value::Object(obj).to_string().into_bytes(), name)
        }
        Mutation::Truncate(at) => {
            let mut b = base.to_string().into_bytes();
            b.truncate((b.len() as f64 * at) as usize);
            (b, None)
        }
        Mutation::Insert(at, byte) => {
            let mut b = base.to_string().into_bytes();
            let i = (b.len() as f64 * at) as usize;
            b.insert(i.min(b.len()), *byte);
            (b, None)
        }
    }
}

/// What the parser alone says about `body` for `endpoint` (the oracle).
fn parses(endpoint: &str, body: &[u8]) -> bool {
    match endpoint {
        ADD => serde_json::from_slice::<VmAddRemoteDeviceData>(body)
            .is_ok_and(|d| d.validate().is_ok()),
        REMOVE => {
            serde_json::from_slice::<VmRemoveDeviceData>(body).is_ok_and(|d| d.validate().is_ok())
        }
        _ => unreachable!(),
    }
}

/// One request; checks the invariants every answer to a body endpoint must meet.
fn send(h: &Harness, endpoint: &str, body: &[u8]) -> Result<(u16, String), TestCaseError> {
    let resp = h
        .client()
        .request("PUT", endpoint, Some(body))
        .map_err(|e| TestCaseError::fail(format!("request failed: {e}")))?;
    h.openapi.check_response("PUT", endpoint, &resp);
    let text = resp.body_text();
    prop_assert!(
        resp.status < 500,
        "{endpoint} {:?}: {} {text}",
        String::from_utf8_lossy(body),
        resp.status
    );
    if resp.status >= 400 {
        prop_assert!(!text.trim().is_empty(), "empty error message");
    }
    Ok((resp.status, text))
}

/// Undoes a successful add so the fake VMM's table stays small.
fn cleanup(h: &Harness, status: u16, text: &str) -> Result<(), TestCaseError> {
    if status == 200 {
        let id = serde_json::from_str::<Value>(text).unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string();
        let (s, t) = send(h, REMOVE, json!({ "id": id }).to_string().as_bytes())?;
        prop_assert_eq!(s, 204, "{}", t);
    }
    Ok(())
}

#[test]
fn random_bodies_get_a_4xx_with_a_message() {
    let h = Harness::start();
    let body = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..256),
        any_json().prop_map(|v| v.to_string().into_bytes()),
    ];
    let mut runner = TestRunner::new(config());
    runner
        .run(
            &(prop::sample::select(vec![ADD, REMOVE]), body),
            |(endpoint, body)| {
                let (status, text) = send(&h, endpoint, &body)?;
                if parses(endpoint, &body) {
                    // A random body that happens to be valid: a VMM answer, never a 5xx.
                    cleanup(&h, status, &text)?;
                } else {
                    prop_assert!((400..500).contains(&status), "{status} {text}");
                    prop_assert!(
                        text.contains("request body"),
                        "{status} {text}: the message should say the body is the problem"
                    );
                }
                Ok(())
            },
        )
        .unwrap();
    h.assert_alive();
}

#[test]
fn mutated_bodies_are_refused_naming_the_field() {
    let h = Harness::start();
    let add = (valid_add(), mutation(ADD_FIELDS))
        .prop_map(|(d, m)| (ADD, serde_json::to_value(d).unwrap(), m));
    let remove = (id(), any::<bool>(), mutation(REMOVE_FIELDS)).prop_map(|(id, force, m)| {
        (
            REMOVE,
            serde_json::to_value(VmRemoveDeviceData { id, force }).unwrap(),
            m,
        )
    });
    let mut runner = TestRunner::new(config());
    runner
        .run(&prop_oneof![add, remove], |(endpoint, base, m)| {
            let (body, field) = apply(&base, &m);
            let (status, text) = send(&h, endpoint, &body)?;
            let ok = parses(endpoint, &body);
            if !ok {
                prop_assert_eq!(status, 400, "{:?} -> {}", m, text);
                prop_assert!(
                    text.starts_with("invalid request body")
                        || text.starts_with("missing request body"),
                    "{}",
                    text
                );
                if let Some(f) = field {
                    prop_assert!(
                        text.contains(&f),
                        "{:?}: message {:?} does not name the field {:?}",
                        m,
                        text,
                        f
                    );
                }
            } else {
                // Accepted by the parser: the server passed it to the VMM, whose answer is
                // a success or a 4xx about the request's meaning (unknown node, busy, ...).
                prop_assert!(
                    !text.starts_with("invalid request body"),
                    "{:?}: the parser accepts {:?} but the server said {}",
                    m,
                    String::from_utf8_lossy(&body),
                    text
                );
                cleanup(&h, status, &text)?;
            }
            Ok(())
        })
        .unwrap();
    h.assert_alive();
}

#[test]
fn valid_bodies_round_trip() {
    let h = Harness::start();
    let mut runner = TestRunner::new(config());
    runner
        .run(&valid_add(), |data| {
            let text = serde_json::to_string(&data).unwrap();
            let back: VmAddRemoteDeviceData = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(&back, &data);
            let (status, answer) = send(&h, ADD, text.as_bytes())?;
            prop_assert_eq!(status, 200, "{} -> {}", text, answer);
            let got: Value = serde_json::from_str(&answer).unwrap();
            if let Some(id) = &data.id {
                prop_assert_eq!(got["id"].as_str(), Some(id.as_str()));
            }
            let rm = VmRemoveDeviceData {
                id: got["id"].as_str().unwrap().to_string(),
                force: false,
            };
            let rm_text = serde_json::to_string(&rm).unwrap();
            prop_assert_eq!(
                serde_json::from_str::<VmRemoveDeviceData>(&rm_text).unwrap(),
                rm.clone()
            );
            let (status, answer) = send(&h, REMOVE, rm_text.as_bytes())?;
            prop_assert_eq!(status, 204, "{}", answer);
            Ok(())
        })
        .unwrap();
    assert_eq!(h.info()["remote_devices"], json!([]));
}

#[test]
fn bodies_on_bodiless_endpoints_are_ignored() {
    let h = Harness::start();
    let body = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..128),
        any_json().prop_map(|v| v.to_string().into_bytes()),
    ];
    let endpoints = vec![
        ("GET", "vmm.ping"),
        ("GET", "vm.info"),
        ("GET", "vm.counters"),
        ("PUT", "vm.pause"),
        ("PUT", "vm.resume"),
    ];
    let mut runner = TestRunner::new(config());
    runner
        .run(
            &(prop::sample::select(endpoints), body),
            |((method, endpoint), body)| {
                let resp = h
                    .client()
                    .request(method, endpoint, Some(&body))
                    .map_err(|e| TestCaseError::fail(format!("request failed: {e}")))?;
                h.openapi.check_response(method, endpoint, &resp);
                let want: &[u16] = if method == "GET" { &[200] } else { &[204, 409] };
                prop_assert!(
                    want.contains(&resp.status),
                    "{method} {endpoint}: {} {}",
                    resp.status,
                    resp.body_text()
                );
                Ok(())
            },
        )
        .unwrap();
    h.assert_alive();
}
