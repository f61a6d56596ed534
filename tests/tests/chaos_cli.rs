//! `lendvm-chaos` on the command line: bad input exits 2 naming the problem, a history with a
//! violation exits 1 and names it, a clean one exits 0 with the invariants table.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};

fn chaos(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lendvm-chaos"))
        .args(args)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn bad_input_to_the_harness_is_refused_by_name() {
    let o = chaos(&["schedule", "--seed", "abc", "--minutes", "5"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("seed \"abc\" is not a number"),
        "{}",
        text(&o)
    );

    let o = chaos(&[
        "schedule",
        "--seed",
        "1",
        "--minutes",
        "5",
        "--faults",
        "lender-kill,meteor",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("unknown fault \"meteor\""),
        "{}",
        text(&o)
    );
    assert!(text(&o).contains("lender-pause"), "{}", text(&o));

    let dir = tempfile::tempdir().unwrap();
    let h = dir.path().join("h.jsonl");
    std::fs::write(&h, "{\"start_ms\":1,\"end_ms\":2,\"outcome\":\"ok\",\"op\":\"api\",\"process\":\"p\",\"call\":\"c\"}\n{oops\n").unwrap();
    let o = chaos(&["check", h.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("history line 2"), "{}", text(&o));
}

#[test]
fn a_seed_prints_the_same_schedule_twice() {
    let a = chaos(&["schedule", "--seed", "34", "--minutes", "5"]);
    let b = chaos(&["schedule", "--seed", "34", "--minutes", "5"]);
    assert!(a.status.success(), "{}", text(&a));
    assert_eq!(a.stdout, b.stdout);
    assert!(
        text(&a).starts_with("# seed 34 length 300000 ms"),
        "{}",
        text(&a)
    );
}

#[test]
fn check_exits_by_what_it_found() {
    let dir = tempfile::tempdir().unwrap();
    let h = dir.path().join("h.jsonl");
    let call = |end: &str| {
        format!("{{\"start_ms\":10,{end}\"outcome\":\"ok\",\"op\":\"api\",\"process\":\"b1-vm0\",\"call\":\"vm.pause\"}}\n")
    };
    std::fs::write(&h, call("\"end_ms\":20,")).unwrap();
    let o = chaos(&["check", h.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        text(&o).contains("| every call answers in time | held |"),
        "{}",
        text(&o)
    );

    std::fs::write(&h, call("")).unwrap();
    let o = chaos(&["check", h.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("vm.pause to b1-vm0 from 10 ms never answered"),
        "{}",
        text(&o)
    );
}
