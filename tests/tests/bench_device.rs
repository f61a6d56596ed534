//! `scripts/bench-device.sh`, which carries the benches to another machine and brings their
//! figures back into docs/BENCHMARKS.md: bad input is refused by name, and an import puts each
//! section's result beside the section's own block, under its own stamp, and replaces it when
//! run again (never a second copy).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/bench-device.sh")
}

fn run(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut c = Command::new("bash");
    c.arg(script()).args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn refused(o: &Output, what: &str) {
    assert!(!o.status.success(), "accepted: {}", text(o));
    assert!(text(o).contains(what), "no '{what}' in: {}", text(o));
}

#[test]
fn bad_input_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    refused(&run(&["frobnicate"], &[]), "unknown command 'frobnicate'");
    refused(
        &run(&["import"], &[]),
        "usage: scripts/bench-device.sh import FILE.tgz",
    );
    refused(
        &run(&["import", "/nonexistent/results.tgz"], &[]),
        "usage: scripts/bench-device.sh import FILE.tgz",
    );
    let junk = dir.path().join("junk.tgz");
    std::fs::write(&junk, "not an archive").unwrap();
    refused(
        &run(&["import", junk.to_str().unwrap()], &[]),
        "is not a gzip'd tar archive",
    );
    // No pack: `run` says what to do first.
    let empty = dir.path().join("nopack");
    refused(
        &run(&["run"], &[("BENCH_PACK", &empty)]),
        "run 'scripts/bench-device.sh pack' here first",
    );
    // A pack, but a section that does not exist.
    let pack = dir.path().join("pack");
    std::fs::create_dir_all(pack.join("bin")).unwrap();
    refused(
        &run(&["run", "fabric", "meteor"], &[("BENCH_PACK", &pack)]),
        "unknown section 'meteor'",
    );
    // An archive that is not a run's results.
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("x"), "x").unwrap();
    let tgz = dir.path().join("other.tgz");
    tar(&other, &tgz);
    let doc = dir.path().join("BENCHMARKS.md");
    std::fs::write(&doc, "<!-- bench:p2p:begin -->\n<!-- bench:p2p:end -->\n").unwrap();
    refused(
        &run(&["import", tgz.to_str().unwrap()], &[("BENCH_DOC", &doc)]),
        "not an archive of 'scripts/bench-device.sh run'",
    );
}

fn tar(dir: &Path, out: &Path) {
    let st = Command::new("tar")
        .arg("czf")
        .arg(out)
        .arg("-C")
        .arg(dir)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success());
}

/// A run's results as `run` packs them: the machine, the commit, and per mode the p2p
/// section's stamp, fragment and SVG; the fabric section failed in mode `all`.
fn results(dir: &Path, figure: &str) -> PathBuf {
    let work = dir.join(format!("work-{figure}"));
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join("machine"), "16 CPUs (Test CPU); Linux 9.9").unwrap();
    std::fs::write(work.join("commit"), "0123456789ab").unwrap();
    for mode in ["all", "2cpu"] {
        let b = work.join(mode).join("bench");
        std::fs::create_dir_all(&b).unwrap();
        std::fs::write(
            b.join("p2p.stamp"),
            "2026-11-30 12:00 UTC|5|0.10 0.20 0.30|0.40 0.50 0.60|0",
        )
        .unwrap();
        std::fs::write(b.join("p2p.md"), format!("| p2p {mode} | {figure} |\n")).unwrap();
        std::fs::write(b.join("p2p-bench.svg"), "<svg/>").unwrap();
    }
    let b = work.join("all").join("bench");
    std::fs::write(
        b.join("fabric.stamp"),
        "2026-11-30 12:01 UTC|1|0.1 0.1 0.1|0.1 0.1 0.1|101",
    )
    .unwrap();
    std::fs::write(b.join("fabric.failed"), "exit 101").unwrap();
    std::fs::write(
        b.join("fabric.log"),
        "line one\nthread 'main' panicked: boom\n",
    )
    .unwrap();
    let tgz = dir.join(format!("results-{figure}.tgz"));
    tar(&work, &tgz);
    tgz
}

#[test]
fn an_import_sits_beside_the_section_under_its_own_stamp_and_replaces_itself() {
    let dir = tempfile::tempdir().unwrap();
    let doc = dir.path().join("docs").join("BENCHMARKS.md");
    std::fs::create_dir_all(doc.parent().unwrap()).unwrap();
    let original = "# Benchmarks\n\n## Fabric\n\n<!-- bench:fabric:begin -->\nhere\n<!-- bench:fabric:end -->\n\n## P2P\n\n<!-- bench:p2p:begin -->\n| p2p here |\n<!-- bench:p2p:end -->\n\nprose after\n";
    std::fs::write(&doc, original).unwrap();

    let first = results(dir.path(), "1.11");
    let o = run(&["import", first.to_str().unwrap()], &[("BENCH_DOC", &doc)]);
    assert!(o.status.success(), "{}", text(&o));
    let t = std::fs::read_to_string(&doc).unwrap();
    // This host's blocks are untouched; the other machine's follow the section's own, "all"
    // first, each under a stamp naming the machine, the commit and the mode.
    assert!(t.contains("<!-- bench:p2p:begin -->\n| p2p here |\n<!-- bench:p2p:end -->"));
    let own = t.find("<!-- bench:p2p:end -->").unwrap();
    let all = t.find("<!-- bench:p2p@16cpu-all:begin -->").unwrap();
    let two = t.find("<!-- bench:p2p@16cpu-2cpu:begin -->").unwrap();
    assert!(own < all && all < two, "{t}");
    assert!(t[all..two].contains("| p2p all | 1.11 |"), "{t}");
    assert!(t[two..].contains("| p2p 2cpu | 1.11 |"), "{t}");
    assert!(t[all..two].contains("commit `0123456789ab`"), "{t}");
    assert!(t[all..two].contains("16 CPUs (Test CPU); Linux 9.9"), "{t}");
    assert!(t[two..].contains("taskset -c 0,1"), "{t}");
    assert!(t.ends_with("prose after\n"), "{t}");
    // A failed section says so, with the end of its log, rather than showing nothing.
    let fab = t.find("<!-- bench:fabric@16cpu-all:begin -->").unwrap();
    assert!(t[fab..].contains("The bench failed (exit 101)"), "{t}");
    assert!(t[fab..].contains("panicked: boom"), "{t}");
    assert!(doc
        .parent()
        .unwrap()
        .join("bench/p2p-16cpu-all.svg")
        .is_file());

    // Again, with other figures: the blocks are replaced, not added.
    let second = results(dir.path(), "2.22");
    let o = run(
        &["import", second.to_str().unwrap()],
        &[("BENCH_DOC", &doc)],
    );
    assert!(o.status.success(), "{}", text(&o));
    let t = std::fs::read_to_string(&doc).unwrap();
    assert_eq!(
        t.matches("<!-- bench:p2p@16cpu-all:begin -->").count(),
        1,
        "{t}"
    );
    assert_eq!(
        t.matches("<!-- bench:p2p@16cpu-2cpu:begin -->").count(),
        1,
        "{t}"
    );
    assert!(
        !t.contains("1.11") && t.contains("| p2p all | 2.22 |"),
        "{t}"
    );
}
