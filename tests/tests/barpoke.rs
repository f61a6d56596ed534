//! The Linux guests' `barpoke` (tests/linux/initramfs/barpoke.c), built as make-initramfs.sh
//! builds it (`build_nolibc` of tests/linux/lib.sh) and run out here on a sparse file that
//! stands in for a BAR's sysfs resource file: the words it writes are the host's
//! [`lendvm_tests::barpoke_word`] (the Linux and VFIO cases look for them in guest consoles
//! and in files behind BARs), they land at the offsets named, and bad arguments get exit 2
//! and a line naming them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn build(dir: &Path) -> PathBuf {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let out = dir.join("barpoke");
    let st = Command::new("bash")
        .arg("-c")
        .arg(r#"set -e; source "$1/tests/linux/lib.sh"; build_nolibc "$1/tests/linux/initramfs/barpoke.c" "$2""#)
        .arg("bash")
        .arg(repo)
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success(), "build_nolibc barpoke.c failed: {st}");
    out
}

fn run(bin: &Path, args: &[&str]) -> (i32, String) {
    let o = Command::new(bin).args(args).output().unwrap();
    (
        o.status.code().expect("barpoke exited by a signal"),
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr),
    )
}

#[test]
fn barpoke_writes_the_hosts_words_where_it_is_told_and_refuses_bad_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let bin = build(dir.path());
    // A 16 GiB sparse file: the VFIO case's BAR, as far as offsets go.
    let file = dir.path().join("resource2");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&file)
        .unwrap();
    f.set_len(16 << 30).unwrap();
    let seed = 0x4241_5231u64;
    let offsets = [0x1000u64, 1 << 32, (16 << 30) - 8];
    let (rc, out) = run(
        &bin,
        &[
            file.to_str().unwrap(),
            &format!("{seed:#x}"),
            "4096",
            "0x100000000",
            &((16u64 << 30) - 8).to_string(),
        ],
    );
    assert_eq!(rc, 0, "{out}");
    let mut word = [0u8; 8];
    for o in offsets {
        let want = lendvm_tests::barpoke_word(seed, o);
        let line = format!("BARPOKE {o:#018x} {want:#018x} ok");
        assert!(out.lines().any(|l| l == line), "no `{line}` in:\n{out}");
        f.read_at(&mut word, o).unwrap();
        assert_eq!(u64::from_le_bytes(word), want, "the file at {o:#x}");
    }
    // Nothing else was written: the word before the first is still a hole's zeros.
    f.read_at(&mut word, 0xff8).unwrap();
    assert_eq!(word, [0; 8]);

    let path = file.to_str().unwrap();
    for (args, says) in [
        (
            vec![path, "1"],
            "usage: barpoke <resource-file> <seed> <offset>...",
        ),
        (vec![path, "seedless", "0"], "BARPOKE fail seed seedless"),
        (vec![path, "1", "0x12"], "BARPOKE fail offset 0x12"),
        (vec![path, "1", "12k"], "BARPOKE fail offset 12k"),
        (
            vec!["/nonexistent/resource0", "1", "0"],
            "BARPOKE fail open /nonexistent/resource0",
        ),
    ] {
        let (rc, out) = run(&bin, &args);
        assert_eq!(rc, 2, "{args:?}: {out}");
        assert!(out.contains(says), "{args:?}: `{says}` not in {out}");
    }
}
