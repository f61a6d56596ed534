//! The extended configuration space (0x100–0xFFF) as the borrower sees it.
//!
//! The lender walks the device's PCIe extended capability list (header: ID bits 15:0,
//! version 19:16, next pointer 31:20) and decides per capability ([`ext_policy`]):
//!
//! | ID | capability | borrower view |
//! |---|---|---|
//! | 0x0001 | AER | read-only |
//! | 0x000D | ACS | read-only |
//! | 0x000F | ATS | hidden |
//! | 0x0010 | SR-IOV | hidden |
//! | 0x0013 | PRI | hidden |
//! | 0x0015 | Resizable BAR | resizable: readable; the size field of each control dword is writable when the backend resizes BARs, else each BAR offers only its current size |
//! | 0x001B | PASID | hidden |
//! | anything else | | hidden |
//!
//! *Hidden* capabilities are unlinked: the previous visible capability's next pointer skips
//! them (when the one at 0x100 is hidden, 0x100 reads as a null capability, ID 0, whose next
//! pointer is the first visible one, as PCIe allows), and their bytes read as zero. Bytes that
//! belong to no visible capability read as zero too. The borrower never writes extended
//! config space except a Resizable BAR control dword: every other write at 0x100 or above is
//! dropped (see `super::ConfigGate`), so *read-only* capabilities show the device's live
//! registers and keep them. Why each is
//! treated so is in docs/SECURITY.md, "Extended configuration space".

/// Start of the extended configuration space.
pub const EXT_START: usize = 0x100;
/// End of the extended configuration space (PCIe: 4 KiB per function).
pub const EXT_END: usize = 0x1000;

/// AER: Advanced Error Reporting.
pub const EXT_CAP_AER: u16 = 0x0001;
/// ACS: Access Control Services.
pub const EXT_CAP_ACS: u16 = 0x000D;
/// ATS: Address Translation Services.
pub const EXT_CAP_ATS: u16 = 0x000F;
/// SR-IOV: Single Root I/O Virtualization.
pub const EXT_CAP_SRIOV: u16 = 0x0010;
/// PRI: Page Request Interface.
pub const EXT_CAP_PRI: u16 = 0x0013;
/// Resizable BAR.
pub const EXT_CAP_REBAR: u16 = 0x0015;
/// PASID: Process Address Space ID.
pub const EXT_CAP_PASID: u16 = 0x001B;

/// How the borrower sees one extended capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtPolicy {
    /// Unlinked from the chain; its bytes read as zero, writes are dropped.
    Hide,
    /// Linked and readable (the device's live registers); writes are dropped.
    ReadOnly,
    /// The Resizable BAR capability: linked and readable; a control dword's size field is
    /// the one thing a borrower writes (see `super::ConfigGate`).
    Resizable,
}

/// The lender's decision for extended capability `id` (see the module table).
pub fn ext_policy(id: u16) -> ExtPolicy {
    match id {
        EXT_CAP_AER | EXT_CAP_ACS => ExtPolicy::ReadOnly,
        EXT_CAP_REBAR => ExtPolicy::Resizable,
        // SR-IOV, ATS, PRI, PASID and everything the lender does not know.
        _ => ExtPolicy::Hide,
    }
}

/// A short name for logs and errors.
pub fn ext_name(id: u16) -> &'static str {
    match id {
        EXT_CAP_AER => "aer",
        EXT_CAP_ACS => "acs",
        EXT_CAP_ATS => "ats",
        EXT_CAP_SRIOV => "sr-iov",
        EXT_CAP_PRI => "pri",
        EXT_CAP_REBAR => "resizable bar",
        EXT_CAP_PASID => "pasid",
        _ => "unknown",
    }
}

/// How far a visible capability's registers reach from its header, at most (bounded further
/// by the next capability and the end of config space).
fn visible_len(id: u16) -> usize {
    match id {
        // Header, uncorrectable status/mask/severity, correctable status/mask, capabilities
        // and control, header log (16), root error command/status, error source id, TLP
        // prefix log (16).
        EXT_CAP_AER => 0x48,
        // Header, ACS capability + control, egress control vector (at most 256 bits).
        EXT_CAP_ACS => 0x08 + 0x20,
        // Header and six entries at most.
        EXT_CAP_REBAR => emulated::rebar::cap_len(emulated::rebar::MAX_ENTRIES),
        _ => 0,
    }
}

/// One capability found in the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtCap {
    /// Capability ID.
    pub id: u16,
    /// Capability version.
    pub version: u8,
    /// Offset of its header.
    pub offset: u16,
    /// The device's raw header.
    pub header: u32,
    /// What the borrower sees.
    pub policy: ExtPolicy,
}

/// The extended capability chain of one function and the borrower's view of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtLayout {
    /// Capabilities in chain order.
    chain: Vec<ExtCap>,
    /// End of the device's config space (0x100 when it has no extended space).
    size: usize,
    /// Visible capabilities in chain order: (offset, end of its readable bytes).
    visible: Vec<(usize, usize)>,
    /// Whether the chain was cut short (a loop, a pointer below 0x100 or past the end).
    malformed: bool,
}

impl ExtLayout {
    /// Walks the chain of a config space of `size` bytes (256 or 4096), reading headers with
    /// `read_u32(offset)`. Bounded: every dword is visited at most once, so a looping or
    /// garbage chain ends after at most 960 steps.
    pub fn walk(size: usize, mut read_u32: impl FnMut(usize) -> Option<u32>) -> ExtLayout {
        let size = size.clamp(EXT_START, EXT_END);
        let mut layout = ExtLayout {
            size,
            ..ExtLayout::default()
        };
        let mut seen = [false; (EXT_END - EXT_START) / 4];
        let mut off = EXT_START;
        while off + 4 <= size {
            let slot = (off - EXT_START) / 4;
            if seen[slot] {
                layout.malformed = true;
                break;
            }
            seen[slot] = true;
            let Some(h) = read_u32(off) else { break };
            if h == 0 || h == u32::MAX {
                break;
            }
            let id = (h & 0xffff) as u16;
            layout.chain.push(ExtCap {
                id,
                version: ((h >> 16) & 0xf) as u8,
                offset: off as u16,
                header: h,
                policy: ext_policy(id),
            });
            let next = (h >> 20) as usize & 0xffc;
            if next == 0 {
                break;
            }
            if next < EXT_START || next + 4 > size {
                layout.malformed = true;
                break;
            }
            off = next;
        }
        layout.visible = layout.compute_visible();
        layout
    }

    /// Walks the chain of a config snapshot.
    pub fn from_config(config: &[u8]) -> ExtLayout {
        ExtLayout::walk(config.len(), |o| {
            config
                .get(o..o + 4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        })
    }

    fn compute_visible(&self) -> Vec<(usize, usize)> {
        let mut offsets: Vec<usize> = self.chain.iter().map(|c| usize::from(c.offset)).collect();
        offsets.sort_unstable();
        self.chain
            .iter()
            .filter(|c| c.policy != ExtPolicy::Hide)
            .map(|c| {
                let start = usize::from(c.offset);
                // The next capability (by address) ends this one's registers.
                let next = offsets
                    .iter()
                    .copied()
                    .find(|&o| o > start)
                    .unwrap_or(self.size);
                let end = (start + visible_len(c.id).max(4)).min(next).min(self.size);
                (start, end)
            })
            .collect()
    }

    /// The device's capabilities in chain order.
    pub fn chain(&self) -> &[ExtCap] {
        &self.chain
    }

    /// Whether the device's chain was cut short (loop or bad pointer).
    pub fn is_malformed(&self) -> bool {
        self.malformed
    }

    /// The capability whose registers hold `offset` (by address: from its header up to the
    /// next capability), for logs.
    pub fn cap_at(&self, offset: usize) -> Option<&ExtCap> {
        self.chain
            .iter()
            .filter(|c| usize::from(c.offset) <= offset)
            .max_by_key(|c| c.offset)
    }

    /// The headers the borrower reads differently from the device: each visible capability's
    /// (next pointer rewritten to the next visible one) and, when the chain's head is hidden,
    /// a null capability at 0x100 pointing at the first visible one.
    fn view_headers(&self) -> impl Iterator<Item = (usize, u32)> + '_ {
        let next = |i: usize| self.visible.get(i).map_or(0, |&(o, _)| (o as u32) << 20);
        let head_hidden = self
            .chain
            .first()
            .is_some_and(|c| c.policy == ExtPolicy::Hide);
        let head = head_hidden.then(|| (EXT_START, next(0)));
        let raw = |at: usize| {
            self.chain
                .iter()
                .find(|c| usize::from(c.offset) == at)
                .map_or(0, |c| c.header)
        };
        head.into_iter().chain(
            self.visible
                .iter()
                .enumerate()
                .map(move |(i, &(o, _))| (o, (raw(o) & 0x000f_ffff) | next(i + 1))),
        )
    }

    /// Turns `buf`, the device's raw bytes at `offset..offset + buf.len()` (all at or above
    /// 0x100), into what the borrower sees: zero outside visible capabilities, headers
    /// rewritten.
    pub fn apply(&self, offset: usize, buf: &mut [u8]) {
        let end = offset + buf.len();
        let mut zero = |from: usize, to: usize| {
            let (from, to) = (from.clamp(offset, end), to.clamp(offset, end));
            if from < to {
                buf[from - offset..to - offset].fill(0);
            }
        };
        // Visible extents are disjoint (each ends where the next capability by address
        // begins) and inside the config space; everything between them is zeroed.
        let mut extents = self.visible.clone();
        extents.sort_unstable();
        let mut pos = offset;
        for (s, e) in extents {
            zero(pos, s);
            pos = pos.max(e);
        }
        zero(pos, end);
        for (at, h) in self.view_headers() {
            for (k, byte) in h.to_le_bytes().into_iter().enumerate() {
                if (offset..end).contains(&(at + k)) {
                    buf[at + k - offset] = byte;
                }
            }
        }
    }

    /// What a write at `offset` touches, for logs: "the sr-iov capability at 0x140 (hidden)".
    pub fn describe(&self, offset: usize) -> String {
        if offset >= self.size {
            return format!("extended config space at {offset:#x}, which the device does not have");
        }
        match self.cap_at(offset) {
            Some(c) if self.visible.iter().any(|&(s, e)| (s..e).contains(&offset)) => format!(
                "the {} capability at {:#x} ({})",
                ext_name(c.id),
                c.offset,
                if c.policy == ExtPolicy::Resizable {
                    "only its control dwords' size fields are writable"
                } else {
                    "read-only"
                }
            ),
            Some(c) if c.policy == ExtPolicy::Hide => format!(
                "the {} capability {:#06x} at {:#x} (hidden)",
                ext_name(c.id),
                c.id,
                c.offset
            ),
            _ => format!("extended config space at {offset:#x} outside any visible capability"),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A 4 KiB config space with the extended chain of the VFIO test fake:
    /// 0x100 SR-IOV → 0x140 AER → 0x188 ATS → 0x190 ACS → 0x1a0 PRI → 0x1b0 PASID →
    /// 0x1c0 resizable BAR → 0x200 vendor-specific (0x000B) → end.
    pub(crate) fn ext_chain() -> Vec<(u16, usize, usize)> {
        vec![
            (EXT_CAP_SRIOV, 0x100, 0x40),
            (EXT_CAP_AER, 0x140, 0x48),
            (EXT_CAP_ATS, 0x188, 0x08),
            (EXT_CAP_ACS, 0x190, 0x08),
            (EXT_CAP_PRI, 0x1a0, 0x10),
            (EXT_CAP_PASID, 0x1b0, 0x08),
            (EXT_CAP_REBAR, 0x1c0, 0x10),
            (0x000B, 0x200, 0x18),
        ]
    }

    /// Writes [`ext_chain`] into `cfg` (4096 bytes), each capability's body filled with a
    /// recognisable non-zero pattern.
    pub(crate) fn put_ext_chain(cfg: &mut [u8]) {
        let chain = ext_chain();
        for (i, &(id, off, len)) in chain.iter().enumerate() {
            let next = chain.get(i + 1).map_or(0, |c| c.1 as u32);
            let h = u32::from(id) | (1 << 16) | (next << 20);
            cfg[off..off + 4].copy_from_slice(&h.to_le_bytes());
            for (j, b) in cfg[off + 4..off + len].iter_mut().enumerate() {
                *b = (0xa0 ^ (id as u8) ^ (j as u8)) | 1;
            }
            if id == EXT_CAP_REBAR {
                // A well-formed entry: BAR 0 offers 1 to 16 MiB and is 4 MiB now.
                cfg[off + 4..off + 8].copy_from_slice(&REBAR_CAP.to_le_bytes());
                cfg[off + 8..off + 12].copy_from_slice(&REBAR_CTRL.to_le_bytes());
            }
        }
    }

    /// The fake's Resizable BAR entry: BAR 0 offers 1, 2, 4, 8 and 16 MiB ...
    pub(crate) const REBAR_CAP: u32 = 0x1f << 4;
    /// ... is one entry, and is 4 MiB now.
    pub(crate) const REBAR_CTRL: u32 = 1 << 5 | 2 << 8;
    /// Where that control dword is (the capability is at 0x1c0).
    pub(crate) const REBAR_CTRL_AT: usize = 0x1c8;
    /// What a borrower of a function that does not resize reads of that capability dword:
    /// only the current size (4 MiB).
    pub(crate) const REBAR_CAP_SEEN: u32 = 1 << (2 + 4);

    fn config() -> Vec<u8> {
        let mut c = vec![0u8; 4096];
        put_ext_chain(&mut c);
        c
    }

    fn view(layout: &ExtLayout, cfg: &[u8]) -> Vec<u8> {
        let mut v = cfg[EXT_START..].to_vec();
        layout.apply(EXT_START, &mut v);
        let mut out = cfg[..EXT_START].to_vec();
        out.extend(v);
        out
    }

    /// The capabilities a guest finds walking the chain like Linux's
    /// `pci_find_next_ext_capability` (skipping ID 0).
    pub(crate) fn guest_walk(cfg: &[u8]) -> Vec<(u16, usize)> {
        let mut out = Vec::new();
        let mut off = EXT_START;
        for _ in 0..960 {
            let h = u32::from_le_bytes([cfg[off], cfg[off + 1], cfg[off + 2], cfg[off + 3]]);
            if h == 0 || h == u32::MAX {
                break;
            }
            if h & 0xffff != 0 {
                out.push(((h & 0xffff) as u16, off));
            }
            off = (h >> 20) as usize & 0xffc;
            if off < EXT_START {
                break;
            }
        }
        out
    }

    #[test]
    fn policy_table() {
        use ExtPolicy::*;
        for (id, want) in [
            (EXT_CAP_AER, ReadOnly),
            (EXT_CAP_ACS, ReadOnly),
            (EXT_CAP_SRIOV, Hide),
            (EXT_CAP_ATS, Hide),
            (EXT_CAP_PRI, Hide),
            (EXT_CAP_PASID, Hide),
            (EXT_CAP_REBAR, Resizable),
            (0x000B, Hide),
            (0x0003, Hide),
            (0xffff, Hide),
        ] {
            assert_eq!(ext_policy(id), want, "{id:#06x}");
        }
    }

    #[test]
    fn walk_finds_the_whole_chain() {
        let l = ExtLayout::from_config(&config());
        let got: Vec<_> = l
            .chain()
            .iter()
            .map(|c| (c.id, usize::from(c.offset)))
            .collect();
        let want: Vec<_> = ext_chain().iter().map(|&(id, o, _)| (id, o)).collect();
        assert_eq!(got, want);
        assert!(!l.is_malformed());
        assert!(l.chain().iter().all(|c| c.version == 1));
    }

    #[test]
    fn guest_walk_sees_only_aer_and_acs() {
        let cfg = config();
        assert_eq!(guest_walk(&cfg).len(), 8, "the raw chain has all eight");
        let l = ExtLayout::from_config(&cfg);
        let v = view(&l, &cfg);
        assert_eq!(
            guest_walk(&v),
            vec![
                (EXT_CAP_AER, 0x140),
                (EXT_CAP_ACS, 0x190),
                (EXT_CAP_REBAR, 0x1c0)
            ]
        );
        // The hidden head reads as a null capability pointing at AER.
        assert_eq!(&v[0x100..0x104], &(0x140u32 << 20).to_le_bytes());
        // AER's header keeps ID and version, points at ACS, ACS at the Resizable BAR,
        // which ends the chain.
        assert_eq!(
            &v[0x140..0x144],
            &(0x0001_0001u32 | 0x190 << 20).to_le_bytes()
        );
        assert_eq!(
            &v[0x190..0x194],
            &(0x0001_000du32 | 0x1c0 << 20).to_le_bytes()
        );
        assert_eq!(&v[0x1c0..0x1c4], &0x0001_0015u32.to_le_bytes());
    }

    #[test]
    fn hidden_capabilities_and_gaps_read_as_zero_visible_ones_as_the_device() {
        let cfg = config();
        let l = ExtLayout::from_config(&cfg);
        let v = view(&l, &cfg);
        for (id, off, len) in ext_chain() {
            let body = &v[off + 4..off + len];
            match ext_policy(id) {
                ExtPolicy::Hide => {
                    assert!(body.iter().all(|&b| b == 0), "{} at {off:#x}", ext_name(id));
                    if off != EXT_START {
                        assert_eq!(&v[off..off + 4], &[0; 4], "hidden header at {off:#x}");
                    }
                }
                ExtPolicy::ReadOnly | ExtPolicy::Resizable => {
                    assert_eq!(body, &cfg[off + 4..off + len])
                }
            }
        }
        // Bytes between capabilities and above the last one: zero.
        assert!(v[0x218..].iter().all(|&b| b == 0));
        // The conventional header is not touched by the extended view.
        assert_eq!(&v[..EXT_START], &cfg[..EXT_START]);
    }

    #[test]
    fn visible_head_keeps_its_place_and_nothing_visible_reads_empty() {
        // AER at 0x100, then SR-IOV: AER ends the chain.
        let mut c = vec![0u8; 4096];
        c[0x100..0x104].copy_from_slice(&(0x0001_0001u32 | 0x140 << 20).to_le_bytes());
        c[0x140..0x144].copy_from_slice(&0x0001_0010u32.to_le_bytes());
        c[0x144] = 0x55;
        let l = ExtLayout::from_config(&c);
        let v = view(&l, &c);
        assert_eq!(&v[0x100..0x104], &0x0001_0001u32.to_le_bytes());
        assert_eq!(v[0x144], 0);
        // Only hidden capabilities: 0x100 reads as 0 ("no extended capabilities").
        let mut c = vec![0u8; 4096];
        c[0x100..0x104].copy_from_slice(&0x0001_0010u32.to_le_bytes());
        let l = ExtLayout::from_config(&c);
        let v = view(&l, &c);
        assert_eq!(&v[0x100..0x104], &[0; 4]);
        assert!(guest_walk(&v).is_empty());
    }

    #[test]
    fn loops_and_bad_pointers_end_the_walk() {
        let mut c = vec![0u8; 4096];
        // 0x100 -> 0x140 -> 0x100 (loop).
        c[0x100..0x104].copy_from_slice(&(0x0001_0001u32 | 0x140 << 20).to_le_bytes());
        c[0x140..0x144].copy_from_slice(&(0x0001_000du32 | 0x100 << 20).to_le_bytes());
        let l = ExtLayout::from_config(&c);
        assert_eq!(l.chain().len(), 2);
        assert!(l.is_malformed());
        // The view of a looping chain still ends (ACS's next pointer is rewritten to 0).
        let v = view(&l, &c);
        assert_eq!(guest_walk(&v).len(), 2);
        // A pointer below 0x100.
        c[0x140..0x144].copy_from_slice(&(0x0001_000du32 | 0x40 << 20).to_le_bytes());
        assert!(ExtLayout::from_config(&c).is_malformed());
        // A 256-byte config space has no extended capabilities.
        let l = ExtLayout::from_config(&c[..256]);
        assert!(l.chain().is_empty());
        let mut b = [0xffu8; 8];
        l.apply(0x100, &mut b);
        assert_eq!(b, [0; 8]);
        // All-ones (no device) ends the walk at once.
        let l = ExtLayout::walk(4096, |_| Some(u32::MAX));
        assert!(l.chain().is_empty());
    }

    #[test]
    fn describe_names_the_capability() {
        let l = ExtLayout::from_config(&config());
        assert_eq!(
            l.describe(0x108),
            "the sr-iov capability 0x0010 at 0x100 (hidden)"
        );
        assert_eq!(l.describe(0x144), "the aer capability at 0x140 (read-only)");
        assert_eq!(
            l.describe(0x300),
            "the unknown capability 0x000b at 0x200 (hidden)"
        );
        let l = ExtLayout::from_config(&[0u8; 4096]);
        assert!(l.describe(0x300).contains("outside any visible capability"));
        let l = ExtLayout::from_config(&[0u8; 256]);
        assert!(l.describe(0x100).contains("does not have"));
    }
}
