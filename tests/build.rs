//! Builds the bare-metal test guest (tests/guest) with a direct `rustc` invocation and exposes
//! its path as `env!("LENDVM_TEST_GUEST")`.
//!
//! The guest runs in KVM's instruction emulator on this host, which cannot decode SSE/AVX, so
//! it is compiled with `-sse,-sse2,-avx` (rustc warns that the ABI needs sse2; the guest uses
//! no floating point, so that is fine) and the build fails if `objdump -d` shows any
//! xmm/ymm/zmm register. No `build-std` is needed: the precompiled `core` is linked, and the
//! guest avoids every `core` path that panics or formats (those carry SSE code), which the
//! same check enforces.

use std::path::{Path, PathBuf};
use std::process::Command;

const FLAGS: &[&str] = &[
    "--edition=2021",
    "--crate-type=bin",
    "--crate-name=lendvm_test_guest",
    "--target=x86_64-unknown-linux-gnu",
    "-Cpanic=abort",
    "-Copt-level=s",
    "-Ctarget-feature=-sse,-sse2,-avx",
    "-Crelocation-model=static",
    "-Cdebug-assertions=off",
    "-Coverflow-checks=off",
    "-Cdebuginfo=0",
    "-Clink-arg=-nostartfiles",
    "-Clink-arg=-nostdlib",
    "-Clink-arg=-static",
    "-Clink-arg=-Wl,--build-id=none",
];

fn fail(msg: &str) -> ! {
    eprintln!("error building the test guest: {msg}");
    std::process::exit(1);
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let guest = manifest.join("guest");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").unwrap_or_default());
    let out = out_dir.join("lendvm-test-guest");
    println!("cargo:rerun-if-changed={}", guest.display());
    println!("cargo:rerun-if-changed=build.rs");

    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let mut cmd = Command::new(&rustc);
    // A clean environment for the nested compiler: no flags meant for the host crates.
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
    ] {
        cmd.env_remove(var);
    }
    cmd.args(FLAGS)
        .arg(format!(
            "-Clink-arg=-T{}",
            guest.join("linker.ld").display()
        ))
        .arg(guest.join("src/main.rs"))
        .arg("-o")
        .arg(&out);
    let output = cmd
        .output()
        .unwrap_or_else(|e| fail(&format!("cannot run {rustc}: {e}")));
    if !output.status.success() {
        fail(&format!(
            "rustc failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    check_no_vector_instructions(&out);
    println!("cargo:rustc-env=LENDVM_TEST_GUEST={}", out.display());
}

/// Fails the build if the guest contains any SSE/AVX register use.
fn check_no_vector_instructions(elf: &Path) {
    let dis = Command::new("objdump")
        .args(["-d", "--no-show-raw-insn"])
        .arg(elf)
        .output()
        .unwrap_or_else(|e| fail(&format!("cannot run objdump (binutils) on the guest: {e}")));
    if !dis.status.success() {
        fail(&format!(
            "objdump failed: {}",
            String::from_utf8_lossy(&dis.stderr)
        ));
    }
    let text = String::from_utf8_lossy(&dis.stdout);
    let bad: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("%xmm") || l.contains("%ymm") || l.contains("%zmm"))
        .take(20)
        .collect();
    if !bad.is_empty() {
        fail(&format!(
            "the guest uses vector registers, which KVM's emulator cannot run \
             (look for core::fmt or panicking code pulled in):\n{}",
            bad.join("\n")
        ));
    }
}
