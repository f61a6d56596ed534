//! The lender-crash writer of the Linux guest's init (`lendvm_crash=<disk>,<blocks>,<blocks2>`,
//! tests/linux/initramfs/init): synced 4 KiB writes, each acknowledged on the console, so a
//! test that kills the lender side mid-stream can check that every acknowledged block is
//! in the disk's backing file. Used by tests/tests/linux.rs (emulated NVMe) and
//! tests/tests/vfio.rs (QEMU's NVMe through VFIO in L1).

/// Bytes per block.
pub const BLOCK: u64 = 4096;
/// Where pass 1 writes in the disk (block n at `BASE1 + n * BLOCK`).
pub const BASE1: u64 = 8 << 20;
/// Where pass 2 (after the disk came back) writes.
pub const BASE2: u64 = 32 << 20;

/// Block `n` of pass `pass`: a text line naming it, then zeros.
pub fn block(pass: u32, n: u64) -> Vec<u8> {
    let mut b = format!("LENDVM-CRASH pass={pass} block={n}\n").into_bytes();
    b.resize(BLOCK as usize, 0);
    b
}

/// The blocks the guest saw acknowledged (`LENDVM-CRASH ack block=<n>`), in console order.
pub fn acked(lines: &[String]) -> Vec<u64> {
    lines
        .iter()
        .filter_map(|l| {
            l.split("LENDVM-CRASH ack block=")
                .nth(1)?
                .trim()
                .parse()
                .ok()
        })
        .collect()
}

/// The first acknowledged block (of `acked`) that is not intact in `disk` (the backing file's
/// contents), with how it starts.
pub fn first_lost(disk: &[u8], acked: &[u64]) -> Option<(u64, String)> {
    acked.iter().find_map(|&n| {
        let off = (BASE1 + n * BLOCK) as usize;
        let got = disk.get(off..off + BLOCK as usize).unwrap_or(&[]);
        (got != block(1, n).as_slice()).then(|| {
            (
                n,
                String::from_utf8_lossy(&got[..got.len().min(48)]).into_owned(),
            )
        })
    })
}
