//! What the VMM benches share: the binaries they drive, their processes' clean-up and the
//! smallest guests lendvm boots (each bench uses some).
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Child;

/// A child process killed and reaped when dropped.
pub struct Kill(pub Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// lendvm as cargo built it for this bench, and the lenderd beside it (built by `cargo build
/// --release -p lending --bins`, which `scripts/bench.sh` runs first).
pub fn binaries() -> (PathBuf, PathBuf) {
    // `LENDVM_BIN_DIR`: binaries carried to another machine beside the bench executables
    // (`scripts/bench-device.sh`), where the build's own path does not exist.
    let lendvm = std::env::var_os("LENDVM_BIN_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_lendvm")),
        |d| PathBuf::from(d).join("lendvm"),
    );
    let lenderd = lendvm.with_file_name("lenderd");
    assert!(
        lenderd.is_file(),
        "{} is missing: run `cargo build --release -p lending --bins` (same CARGO_TARGET_DIR) first",
        lenderd.display()
    );
    (lendvm, lenderd)
}

/// Guest physical address the code is loaded at (and entered).
const BASE: u64 = 0x20_0000;

/// `cli; hlt; jmp` back to the `hlt`: the vCPU halts in KVM (in-kernel irqchip) and,
/// interrupts being off, stays halted.
pub const IDLE: [u8; 4] = [0xfa, 0xf4, 0xeb, 0xfd];

/// Turns on Memory Space and Bus Master Enable in the command register of the function at
/// 00:01.0 (the first device lendvm attaches) through configuration mechanism #1, then
/// [`IDLE`]: the guest side of a first Bus Master Enable, with nothing else.
pub const BUS_MASTER_THEN_IDLE: [u8; 24] = [
    0xb8, 0x04, 0x08, 0x00, 0x80, // mov eax, 0x8000_0804 (bus 0, dev 1, fn 0, reg 4)
    0x66, 0xba, 0xf8, 0x0c, // mov dx, 0xcf8
    0xef, // out dx, eax
    0xb8, 0x06, 0x00, 0x00, 0x00, // mov eax, 6 (MEM | BUS_MASTER)
    0x66, 0xba, 0xfc, 0x0c, // mov dx, 0xcfc
    0xef, // out dx, eax
    0xfa, 0xf4, 0xeb, 0xfd, // IDLE
];

/// `code` as an ELF64 image with one loadable segment at [`BASE`], entered at its first byte.
pub fn guest_elf(code: &[u8]) -> Vec<u8> {
    let mut e = Vec::new();
    e.extend_from_slice(b"\x7fELF\x02\x01\x01\x00");
    e.extend_from_slice(&[0; 8]);
    e.extend_from_slice(&2u16.to_le_bytes());
    e.extend_from_slice(&0x3eu16.to_le_bytes());
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&BASE.to_le_bytes());
    e.extend_from_slice(&64u64.to_le_bytes());
    e.extend_from_slice(&0u64.to_le_bytes());
    e.extend_from_slice(&0u32.to_le_bytes());
    for v in [64u16, 56, 1, 0, 0, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&5u32.to_le_bytes());
    let len = code.len() as u64;
    for v in [0x1000u64, BASE, BASE, len, len, 0x1000] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.resize(0x1000, 0);
    e.extend_from_slice(code);
    e
}
