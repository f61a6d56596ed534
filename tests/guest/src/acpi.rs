//! `tests=acpi`: finds the RSDP where Linux's BIOS-area scan does (0xE0000..0xFFFFF, 16-byte
//! steps), walks the XSDT, checks every table's checksum, and prints what a NUMA-aware kernel
//! reads from SRAT and SLIT:
//!
//! - `ACPI table <SIG> <addr>` per table the XSDT lists;
//! - `ACPI srat cpu <apic id> node <n>` and `ACPI srat mem <base> <len> node <n>`;
//! - `ACPI slit <n> <d00> <d01> ...` (the matrix, row by row);
//! - `TEST acpi ok tables <count>` (or `fail` naming the table).

use crate::serial::Out;
use crate::Results;

/// Reads `N` bytes at guest physical `addr` (identity-mapped; the tables sit below 1 MiB).
fn bytes<const N: usize>(addr: u64) -> [u8; N] {
    let mut out = [0u8; N];
    for (i, b) in out.iter_mut().enumerate() {
        // SAFETY: the first 4 GiB are identity-mapped and readable; ACPI tables are in RAM.
        *b = unsafe { core::ptr::read_volatile((addr + i as u64) as *const u8) };
    }
    out
}

fn u8_at(addr: u64) -> u8 {
    bytes::<1>(addr)[0]
}

fn u32_at(addr: u64) -> u32 {
    u32::from_le_bytes(bytes::<4>(addr))
}

fn u64_at(addr: u64) -> u64 {
    u64::from_le_bytes(bytes::<8>(addr))
}

/// Whether `len` bytes at `addr` sum to zero (an ACPI checksum).
fn sums_to_zero(addr: u64, len: u64) -> bool {
    (0..len).fold(0u8, |a, i| a.wrapping_add(u8_at(addr + i))) == 0
}

fn find_rsdp() -> Option<u64> {
    (0xe_0000u64..0x10_0000)
        .step_by(16)
        .find(|&a| &bytes::<8>(a) == b"RSD PTR " && sums_to_zero(a, 20))
}

pub fn test(r: &mut Results) {
    let Some(rsdp) = find_rsdp() else {
        r.report("acpi", false).s("no RSDP in 0xe0000..0xfffff").nl();
        return;
    };
    let xsdt = u64_at(rsdp + 24);
    if &bytes::<4>(xsdt) != b"XSDT" || !sums_to_zero(xsdt, u64::from(u32_at(xsdt + 4))) {
        r.report("acpi", false).s("bad XSDT at ").hex(xsdt).nl();
        return;
    }
    let entries = (u64::from(u32_at(xsdt + 4)) - 36) / 8;
    for i in 0..entries {
        let t = u64_at(xsdt + 36 + 8 * i);
        let sig = bytes::<4>(t);
        let len = u64::from(u32_at(t + 4));
        Out.s("ACPI table ").bytes(&sig).s(" ").hex(t).nl();
        if !sums_to_zero(t, len) {
            r.report("acpi", false).bytes(&sig).s(" checksum").nl();
            return;
        }
        match &sig {
            b"SRAT" => srat(t, len),
            b"SLIT" => slit(t),
            _ => {}
        }
    }
    r.report("acpi", true).s("tables ").dec(entries).nl();
}

/// SRAT structures from offset 48: type 0 (processor local APIC, 16 bytes) and type 1
/// (memory, 40 bytes); others are printed by type.
fn srat(t: u64, len: u64) {
    let mut off = 48;
    while off + 2 <= len {
        let e = t + off;
        let (kind, elen) = (u8_at(e), u64::from(u8_at(e + 1)));
        if elen == 0 {
            break;
        }
        match kind {
            0 => {
                let node = u32::from(u8_at(e + 2)) | (u32_at(e + 8) & 0xffff_ff00);
                Out.s("ACPI srat cpu ")
                    .dec(u64::from(u8_at(e + 3)))
                    .s(" node ")
                    .dec(u64::from(node))
                    .nl();
            }
            1 => {
                Out.s("ACPI srat mem ")
                    .hex(u64_at(e + 8))
                    .s(" ")
                    .hex(u64_at(e + 16))
                    .s(" node ")
                    .dec(u64::from(u32_at(e + 2)))
                    .nl();
            }
            other => Out.s("ACPI srat type ").dec(u64::from(other)).nl(),
        }
        off += elen;
    }
}

/// SLIT: the locality count at 36, then the matrix.
fn slit(t: u64) {
    let n = u64_at(t + 36).min(16);
    for i in 0..n {
        let mut o = Out.s("ACPI slit ").dec(i);
        for j in 0..n {
            o = o.s(" ").dec(u64::from(u8_at(t + 44 + i * n + j)));
        }
        o.nl();
    }
}
