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
/// contents), with how it starts, where it first differs and how many of its bytes differ
/// (a torn or stale block, which sectors: what a failure needs to be told apart).
pub fn first_lost(disk: &[u8], acked: &[u64]) -> Option<(u64, String)> {
    acked.iter().find_map(|&n| {
        let off = (BASE1 + n * BLOCK) as usize;
        let got = disk.get(off..off + BLOCK as usize).unwrap_or(&[]);
        let want = block(1, n);
        (got != want.as_slice()).then(|| {
            let first = got
                .iter()
                .zip(&want)
                .position(|(a, b)| a != b)
                .unwrap_or(got.len().min(want.len()));
            let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            let sectors: Vec<usize> = (0..got.len() / 512)
                .filter(|s| got[s * 512..(s + 1) * 512] != want[s * 512..(s + 1) * 512])
                .collect();
            let end = got.len().min(first + 32);
            (
                n,
                format!(
                    "{:?}; {} bytes long, first difference at byte {first} (file offset {}): \
                     {:02x?}; {differ} bytes differ, in 512-byte sectors {sectors:?}",
                    String::from_utf8_lossy(&got[..got.len().min(48)]),
                    got.len(),
                    off + first,
                    &got[first.min(end)..end],
                ),
            )
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_block_is_described_by_where_it_differs() {
        let mut disk = vec![0u8; (BASE1 + 4 * BLOCK) as usize];
        for n in 0..3 {
            let off = (BASE1 + n * BLOCK) as usize;
            disk[off..off + BLOCK as usize].copy_from_slice(&block(1, n));
        }
        assert_eq!(first_lost(&disk, &[0, 1, 2]), None);
        // Block 1's third sector holds stale data.
        let off = (BASE1 + BLOCK) as usize + 1024 + 7;
        disk[off] = 0xab;
        let (n, what) = first_lost(&disk, &[0, 1, 2]).unwrap();
        assert_eq!(n, 1);
        assert!(what.contains("first difference at byte 1031"), "{what}");
        assert!(
            what.contains("1 bytes differ, in 512-byte sectors [2]"),
            "{what}"
        );
        assert!(what.contains("[ab, 00"), "{what}");
    }
}
