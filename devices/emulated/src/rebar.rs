//! The PCIe Resizable BAR extended capability: its encoding, in one place for the models
//! that offer it ([`crate::DeviceModel::resizable_bars`]), the lender's config gate and the
//! borrower's VMM.
//!
//! Layout (PCIe Base 6.0, 7.8.6): a header (ID 0x0015), then one 8-byte entry per resizable
//! BAR: a capability dword whose bits 31:4 say which sizes the BAR offers (bit 4 is 1 MiB,
//! each next bit twice that) and a control dword: BAR index (2:0), the number of entries (in
//! the first entry only, 7:5), the current size (13:8, `n` meaning `1 MiB << n`).

use crate::model::ResizableBar;

/// Extended capability ID.
pub const EXT_CAP_ID: u16 = 0x0015;
/// Offset of the first entry's capability dword from the header.
pub const FIRST_ENTRY: usize = 4;
/// Offset of an entry's control dword from its capability dword.
pub const CTRL: usize = 4;
/// Bytes per entry.
pub const ENTRY_LEN: usize = 8;
/// At most six BARs.
pub const MAX_ENTRIES: usize = 6;
/// Bytes of a capability with `n` entries.
pub const fn cap_len(n: usize) -> usize {
    FIRST_ENTRY + n * ENTRY_LEN
}

const CTRL_BAR_MASK: u32 = 0x7;
const CTRL_NBAR_SHIFT: u32 = 5;
const CTRL_NBAR_MASK: u32 = 0x7 << CTRL_NBAR_SHIFT;
const CTRL_SIZE_SHIFT: u32 = 8;
/// The control dword's size field: the only bits a driver writes.
pub const CTRL_SIZE_MASK: u32 = 0x3f << CTRL_SIZE_SHIFT;

/// `1 MiB << n`.
pub fn size_bytes(n: u32) -> u64 {
    1u64 << (20 + n.min(43))
}

/// The encoding of `bytes` (a power of two of 1 MiB or more).
pub fn size_index(bytes: u64) -> Option<u32> {
    (bytes.is_power_of_two() && bytes >= 1 << 20).then(|| bytes.trailing_zeros() - 20)
}

/// `bytes` as people write it: "256 MiB", "4 GiB".
pub fn human(bytes: u64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (1 << 40, "TiB"),
        (1 << 30, "GiB"),
        (1 << 20, "MiB"),
        (1 << 10, "KiB"),
    ];
    UNITS
        .iter()
        .find(|(u, _)| bytes >= *u && bytes.is_multiple_of(*u))
        .map_or_else(
            || format!("{bytes:#x} bytes"),
            |(u, n)| format!("{} {n}", bytes / u),
        )
}

/// A size mask as people read it: "1 MiB to 4 GiB" when it is one run, else a list.
pub fn describe_sizes(mask: u64) -> String {
    if mask == 0 {
        return "no size".into();
    }
    let lo = mask.trailing_zeros();
    let hi = 63 - mask.leading_zeros();
    let run = (mask >> lo).count_ones() == hi - lo + 1;
    if lo == hi {
        format!("only {}", human(size_bytes(lo)))
    } else if run {
        format!("{} to {}", human(size_bytes(lo)), human(size_bytes(hi)))
    } else {
        (lo..=hi)
            .filter(|n| mask & (1 << n) != 0)
            .map(|n| human(size_bytes(n)))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The capability's bytes for `bars` (at most [`MAX_ENTRIES`]), with `next` as the next
/// capability's offset.
pub fn encode(bars: &[ResizableBar], next: u16) -> Vec<u8> {
    let bars = &bars[..bars.len().min(MAX_ENTRIES)];
    let mut out = Vec::with_capacity(cap_len(bars.len()));
    let header = u32::from(EXT_CAP_ID) | 1 << 16 | u32::from(next & 0xffc) << 20;
    out.extend_from_slice(&header.to_le_bytes());
    for (i, b) in bars.iter().enumerate() {
        let cap = ((b.sizes & 0x0fff_ffff) as u32) << 4;
        let mut ctrl = u32::from(b.index) & CTRL_BAR_MASK;
        if i == 0 {
            ctrl |= (bars.len() as u32) << CTRL_NBAR_SHIFT;
        }
        ctrl |= size_index(b.current).unwrap_or(0) << CTRL_SIZE_SHIFT;
        out.extend_from_slice(&cap.to_le_bytes());
        out.extend_from_slice(&ctrl.to_le_bytes());
    }
    out
}

/// One entry as found in a config space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// BAR index.
    pub bar: u8,
    /// Offset of the entry's capability dword in config space.
    pub at: usize,
    /// Sizes offered (bit `n`: `1 MiB << n`).
    pub sizes: u64,
    /// Current size in bytes.
    pub current: u64,
}

impl Entry {
    /// Offset of the control dword in config space.
    pub fn ctrl_at(&self) -> usize {
        self.at + CTRL
    }

    /// Whether `bytes` is among the offered sizes.
    pub fn offers(&self, bytes: u64) -> bool {
        size_index(bytes).is_some_and(|n| n < 64 && self.sizes & (1 << n) != 0)
    }
}

/// The current size a control dword says.
pub fn ctrl_size(ctrl: u32) -> u64 {
    size_bytes((ctrl & CTRL_SIZE_MASK) >> CTRL_SIZE_SHIFT)
}

/// `ctrl` with its size field set to `bytes` (which must have an encoding).
pub fn ctrl_with_size(ctrl: u32, bytes: u64) -> u32 {
    (ctrl & !CTRL_SIZE_MASK) | size_index(bytes).unwrap_or(0) << CTRL_SIZE_SHIFT
}

/// A capability dword offering only `bytes` (none past 128 TiB, the dword's last size).
pub fn cap_offering_only(bytes: u64) -> u32 {
    size_index(bytes)
        .and_then(|n| 1u32.checked_shl(n + 4))
        .unwrap_or(0)
}

/// The entries of the capability whose header is at `cap` in a space read dword by dword
/// through `read_u32` (bounded: at most [`MAX_ENTRIES`], and only as many as the first
/// control dword says).
pub fn entries(cap: usize, mut read_u32: impl FnMut(usize) -> Option<u32>) -> Vec<Entry> {
    let Some(first) = read_u32(cap + FIRST_ENTRY + CTRL) else {
        return Vec::new();
    };
    let n = (((first & CTRL_NBAR_MASK) >> CTRL_NBAR_SHIFT) as usize).min(MAX_ENTRIES);
    (0..n)
        .filter_map(|i| {
            let at = cap + FIRST_ENTRY + i * ENTRY_LEN;
            let c = read_u32(at)?;
            let ctrl = read_u32(at + CTRL)?;
            Some(Entry {
                bar: (ctrl & CTRL_BAR_MASK) as u8,
                at,
                sizes: u64::from(c >> 4),
                current: ctrl_size(ctrl),
            })
        })
        .collect()
}

/// Offset of the Resizable BAR capability in a config snapshot, walking the extended
/// chain (bounded by the space's dwords).
pub fn find(config: &[u8]) -> Option<usize> {
    let dword = |o: usize| {
        config
            .get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let mut off = 0x100;
    for _ in 0..(0x1000 - 0x100) / 4 {
        let h = dword(off)?;
        if h == 0 || h == u32::MAX {
            return None;
        }
        if (h & 0xffff) as u16 == EXT_CAP_ID {
            return Some(off);
        }
        let next = (h >> 20) as usize & 0xffc;
        if next < 0x100 {
            return None;
        }
        off = next;
    }
    None
}

/// The entries of a config snapshot's Resizable BAR capability (none without one).
pub fn entries_in(config: &[u8]) -> Vec<Entry> {
    find(config).map_or_else(Vec::new, |cap| {
        entries(cap, |o| {
            config
                .get(o..o + 4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_round_trips_and_reads_as_people_write_it() {
        let bars = [ResizableBar {
            index: 0,
            sizes: 0b1_1111_1111_1111, // 1 MiB .. 4 GiB
            current: 256 << 20,
        }];
        let mut config = vec![0u8; 0x1000];
        let cap = encode(&bars, 0);
        config[0x100..0x100 + cap.len()].copy_from_slice(&cap);
        assert_eq!(cap.len(), cap_len(1));
        assert_eq!(find(&config), Some(0x100));
        let e = entries_in(&config);
        assert_eq!(
            e,
            vec![Entry {
                bar: 0,
                at: 0x104,
                sizes: 0x1fff,
                current: 256 << 20
            }]
        );
        assert!(e[0].offers(4 << 30) && e[0].offers(1 << 20));
        assert!(!e[0].offers(8 << 30) && !e[0].offers(3 << 20) && !e[0].offers(4096));
        assert_eq!(describe_sizes(0x1fff), "1 MiB to 4 GiB");
        assert_eq!(describe_sizes(1 << 8), "only 256 MiB");
        assert_eq!(describe_sizes(0b101), "1 MiB, 4 MiB");
        let ctrl = u32::from_le_bytes(config[0x108..0x10c].try_into().unwrap());
        assert_eq!(ctrl_size(ctrl), 256 << 20);
        assert_eq!(ctrl_size(ctrl_with_size(ctrl, 4 << 30)), 4 << 30);
        assert_eq!(
            ctrl_with_size(ctrl, 4 << 30) & !CTRL_SIZE_MASK,
            ctrl & !CTRL_SIZE_MASK
        );
        assert_eq!(cap_offering_only(256 << 20), 1 << 12);
        // A garbage size field past what the dword encodes offers nothing.
        assert_eq!(cap_offering_only(size_bytes(0x3f)), 0);
    }

    #[test]
    fn a_garbage_chain_or_count_stays_bounded() {
        let mut config = vec![0u8; 0x1000];
        // A header pointing at itself, never the Resizable BAR.
        config[0x100..0x104].copy_from_slice(&(0x0001u32 | 0x100 << 20).to_le_bytes());
        assert_eq!(find(&config), None);
        // A count of 7 entries reads at most six.
        let mut c2 = vec![0u8; 0x1000];
        c2[0x100..0x104].copy_from_slice(&u32::from(EXT_CAP_ID).to_le_bytes());
        c2[0x108..0x10c].copy_from_slice(&(7u32 << 5).to_le_bytes());
        assert_eq!(entries_in(&c2).len(), MAX_ENTRIES);
    }
}
