//! Property test ("fuzz") of the lender's config path: random CONFIG_READ/CONFIG_WRITE
//! sequences, encoded and decoded as on the wire, then through the lease's [`ConfigGate`]
//! into a fake VFIO function with a 4 KiB config space (standard MSI-X and PCI Express
//! capabilities; extended AER, ACS, SR-IOV, ATS, PRI, PASID, resizable BAR, unknown).
//!
//! Asserts: nothing panics; every request gets the answer its class calls for (protocol
//! error, bad access, forbidden, dropped, written); the device's bytes outside the
//! borrower-writable set never change (BARs, ROM, identity, MSI-X, the PCIe header, all of
//! the extended space), Bus Master Enable stays the lender's, the FLR bit is never set;
//! reads of extended space show exactly the lender's view; counts match.
//!
//! Cases: `PROPTEST_CASES` (scripts/test.sh: 20000), default 1000.

use proptest::prelude::*;
use std::sync::OnceLock;

use super::extended::tests::guest_walk;
use super::extended::{ext_policy, ExtPolicy};
use super::{ConfigGate, GateCounts, WriteOutcome};
use crate::backend::vfio::fake::{FakeSysfs, FakeVfioDevice};
use crate::backend::vfio::tests::{backend_with, nic_config, nic_with};
use crate::backend::vfio::VfioBackend;
use crate::backend::{BackendError, DeviceBackend};
use crate::protocol::{ConfigRead, ConfigWrite, Request};

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

/// A sysfs root without resource files (BARs trapped), shared by all cases.
fn sysfs() -> &'static FakeSysfs {
    static S: OnceLock<FakeSysfs> = OnceLock::new();
    S.get_or_init(|| FakeSysfs::new().unwrap())
}

/// Ranges of the fixture the borrower may not write (the conventional filter's protected
/// ranges for `nic_config`, written out independently of it).
const PROTECTED: &[(usize, usize)] = &[
    (0x00, 0x04), // vendor/device
    (0x08, 0x0c), // revision/class
    (0x0e, 0x10), // header type/BIST
    (0x10, 0x28), // BARs
    (0x28, 0x30), // cardbus/subsystem
    (0x30, 0x34), // ROM
    (0x34, 0x3c), // capability pointer
    (0x3d, 0x40), // interrupt pin, min_gnt, max_lat
    (0x40, 0x4c), // MSI-X
    (0x60, 0x68), // PCIe header + device capabilities
];
const FLR_BYTE: usize = 0x69;

/// Checks that nothing the borrower may not write changed (slice compares: cheap enough
/// for every write of every case).
fn check_unchanged(before: &[u8], now: &[u8], op: &Op) -> Result<(), TestCaseError> {
    for &(s, e) in PROTECTED {
        prop_assert_eq!(
            &now[s..e],
            &before[s..e],
            "{:#x}..{:#x} changed after {:?}",
            s,
            e,
            op
        );
    }
    prop_assert!(
        now[0x100..] == before[0x100..],
        "extended space changed after {:?}",
        op
    );
    prop_assert_eq!(
        now[4] & 0x04,
        before[4] & 0x04,
        "bus master enable is the lender's"
    );
    prop_assert_eq!(now[FLR_BYTE] & 0x80, 0, "flr bit set by {:?}", op);
    Ok(())
}

/// Cheap deterministic bytes from a seed (splitmix64), so a case does not draw thousands of
/// values through proptest.
fn bytes_from(mut seed: u64, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(n);
    out
}

/// The extended space as the borrower must see it, from the raw config (independent model
/// of `nic_config(true)`: AER at 0x140 → ACS at 0x190 → Resizable BAR at 0x1c0 visible,
/// the rest hidden; the Resizable BAR offers only its current size, 4 MiB).
fn expected_ext(raw: &[u8], at: usize) -> u8 {
    let b = |v: u32| v.to_le_bytes()[at % 4];
    match at {
        0x100..=0x103 => b(0x140 << 20),
        0x140..=0x143 => b(0x0001_0001 | 0x190 << 20),
        0x190..=0x193 => b(0x0001_000d | 0x1c0 << 20),
        0x1c0..=0x1c3 => b(0x0001_0015),
        0x1c4..=0x1c7 => b(1 << (2 + 4)),
        0x144..=0x187 | 0x194..=0x19f | 0x1c8..=0x1f3 => raw[at],
        _ => 0,
    }
}

/// Whether a write of `data` at `off` in the Resizable BAR's control dword (0x1c8) asks
/// for a size other than the current one (4 MiB: size field 2).
fn asks_another_size(raw: &[u8], off: usize, data: &[u8]) -> bool {
    let mut ctrl = [raw[0x1c8], raw[0x1c9], raw[0x1ca], raw[0x1cb]];
    ctrl[off - 0x1c8..off - 0x1c8 + data.len()].copy_from_slice(data);
    (u32::from_le_bytes(ctrl) >> 8) & 0x3f != 2
}

#[derive(Debug, Clone)]
enum Op {
    Read { offset: u16, len: u16 },
    Write { offset: u16, data: Vec<u8> },
}

fn offset() -> impl Strategy<Value = u16> {
    prop_oneof![
        0u16..0x100,
        0x100u16..0x240,
        0u16..0x1010,
        Just(0xffc),
        Just(0xfff),
        any::<u16>(),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![Just(1usize), Just(2), Just(4), Just(8), Just(3), 0usize..17];
    prop_oneof![
        1 => (offset(), prop_oneof![Just(4u16), 1u16..9, 0u16..0x1100]).prop_map(|(offset, len)| Op::Read { offset, len }),
        3 => (offset(), size, any::<u64>()).prop_map(|(offset, n, v)| Op::Write {
            offset,
            data: (0..n).map(|i| (v >> (8 * (i % 8))) as u8).collect(),
        }),
    ]
}

fn raw_config(b: &VfioBackend<FakeVfioDevice>) -> Vec<u8> {
    let mut c = vec![0u8; 4096];
    b.config_read(0, &mut c).unwrap();
    c
}

/// One op through the wire codec and the gate; checks the answer's class and reads.
fn run_op(
    b: &VfioBackend<FakeVfioDevice>,
    gate: &ConfigGate,
    op: &Op,
    want: &mut GateCounts,
) -> Result<(), TestCaseError> {
    let req = match op {
        Op::Read { offset, len } => Request::ConfigRead(ConfigRead {
            lease: 7,
            offset: *offset,
            len: *len,
        }),
        Op::Write { offset, data } => Request::ConfigWrite(ConfigWrite {
            lease: 7,
            offset: *offset,
            data: data.clone(),
        }),
    };
    let (opc, payload) = req.encode().unwrap();
    let (off, len) = match op {
        Op::Read { offset, len } => (usize::from(*offset), usize::from(*len)),
        Op::Write { offset, data } => (usize::from(*offset), data.len()),
    };
    let decoded = match Request::decode(opc, &payload) {
        Ok(r) => r,
        Err(e) => {
            // The protocol refuses what is empty or beyond 0x1000, with a message saying so.
            prop_assert!(len == 0 || off + len > 0x1000, "{op:?}: {e}");
            prop_assert!(e.to_string().contains("beyond 0x1000"), "{e}");
            return Ok(());
        }
    };
    prop_assert!(len > 0 && off + len <= 0x1000, "{op:?} decoded");
    match decoded {
        Request::ConfigRead(r) => {
            let before = raw_config(b);
            let mut buf = vec![0u8; usize::from(r.len)];
            gate.read(b, r.offset, &mut buf)
                .map_err(|e| TestCaseError::fail(format!("{op:?}: {e}")))?;
            for (i, &got) in buf.iter().enumerate() {
                let at = off + i;
                let exp = if at < 0x100 {
                    before[at]
                } else {
                    expected_ext(&before, at)
                };
                prop_assert_eq!(got, exp, "read {:?} at {:#x}", op, at);
            }
        }
        Request::ConfigWrite(w) => {
            let r = gate.write(b, w.offset, &w.data);
            let touches = |s: usize, e: usize| off < e && s < off + len;
            if !matches!(len, 1 | 2 | 4) || off % 4 + len > 4 {
                prop_assert!(
                    matches!(r, Err(BackendError::BadConfigAccess { .. })),
                    "{op:?}: {r:?}"
                );
                want.refused += 1;
            } else if (0x1c8..0x1cc).contains(&off) {
                if asks_another_size(&raw_config(b), off, &w.data) {
                    prop_assert!(
                        matches!(r, Err(BackendError::ResizeRefused { bar: 0, .. })),
                        "{op:?}: {r:?}"
                    );
                    want.refused += 1;
                } else {
                    prop_assert_eq!(r.ok(), Some(WriteOutcome::Written), "{:?}", op);
                }
            } else if off >= 0x100 {
                prop_assert_eq!(r.ok(), Some(WriteOutcome::Dropped), "{:?}", op);
                want.dropped += 1;
            } else if PROTECTED.iter().any(|&(s, e)| touches(s, e))
                || (touches(FLR_BYTE, FLR_BYTE + 1) && w.data[FLR_BYTE - off] & 0x80 != 0)
            {
                prop_assert!(
                    matches!(r, Err(BackendError::Forbidden(_))),
                    "{op:?}: {r:?}"
                );
                want.refused += 1;
            } else {
                prop_assert_eq!(r.ok(), Some(WriteOutcome::Written), "{:?}", op);
            }
        }
        other => prop_assert!(false, "{op:?} decoded as {other:?}"),
    }
    Ok(())
}

proptest! {
    // XorShift: the default ChaCha generator costs more than the code under test in a
    // debug build.
    #![proptest_config(ProptestConfig {
        cases: cases(),
        failure_persistence: None,
        rng_algorithm: proptest::test_runner::RngAlgorithm::XorShift,
        ..ProptestConfig::default()
    })]

    /// Random CONFIG_READ/CONFIG_WRITE sequences keep every rule of the lender's config path.
    #[test]
    fn config_requests_keep_the_lenders_rules(bme in any::<bool>(), ops in proptest::collection::vec(op(), 1..16)) {
        let mut cfg = nic_config(true);
        cfg[4] = if bme { 0x06 } else { 0x02 };
        let (b, _) = backend_with(nic_with(cfg, false), sysfs());
        let gate = ConfigGate::new("fuzz", &b).unwrap();
        let before = raw_config(&b);
        let mut want = GateCounts::default();
        for op in &ops {
            run_op(&b, &gate, op, &mut want)?;
            if matches!(op, Op::Write { .. }) {
                check_unchanged(&before, &raw_config(&b), op)?;
            }
        }
        prop_assert_eq!(gate.counts(), want);
        // The chain a guest walks after all this: AER, ACS and the Resizable BAR only.
        let mut seen = vec![0u8; 4096];
        gate.read(&b, 0, &mut seen).unwrap();
        prop_assert_eq!(
            guest_walk(&seen),
            vec![(0x0001, 0x140), (0x000d, 0x190), (0x0015, 0x1c0)]
        );
    }

    /// Garbage extended space (loops, wild pointers, random IDs): the walk ends, a guest's
    /// walk of the view ends and meets only visible capabilities, no write gets through.
    #[test]
    fn garbage_extended_space_is_walked_safely(
        seed in any::<u64>(),
        heads in proptest::collection::vec((0usize..0x3c0, 0u16..0x30, 0usize..0x3c0), 0..12),
        writes in proptest::collection::vec((0x100u16..0x1000, any::<u32>()), 0..8),
    ) {
        let mut cfg = nic_config(false);
        cfg.resize(4096, 0);
        cfg[0x100..].copy_from_slice(&bytes_from(seed, 0xf00));
        // Plant well-formed-looking headers with small IDs (so AER/ACS/hidden ones occur).
        for &(at, id, next) in &heads {
            let at = 0x100 + at * 4;
            let h = u32::from(id) | 1 << 16 | ((0x100 + next as u32 * 4) << 20);
            cfg[at..at + 4].copy_from_slice(&h.to_le_bytes());
        }
        let (b, _) = backend_with(nic_with(cfg, false), sysfs());
        let gate = ConfigGate::new("garbage", &b).unwrap();
        let before = raw_config(&b);
        let mut seen = vec![0u8; 4096];
        gate.read(&b, 0, &mut seen).unwrap();
        for (id, _) in guest_walk(&seen) {
            prop_assert!(ext_policy(id) != ExtPolicy::Hide, "hidden {id:#x} visible");
        }
        for &(off, v) in &writes {
            let off = off & !3;
            // Dropped, or (a planted Resizable BAR's control dword) a no-op or refused:
            // never written, which the unchanged config below proves.
            let r = gate.write(&b, off, &v.to_le_bytes());
            prop_assert!(
                matches!(
                    r,
                    Ok(WriteOutcome::Dropped | WriteOutcome::Written)
                        | Err(BackendError::ResizeRefused { .. })
                ),
                "{off:#x}: {r:?}"
            );
        }
        prop_assert_eq!(raw_config(&b), before);
    }
}
