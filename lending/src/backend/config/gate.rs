//! One lease's door to the device's config space: every borrower CONFIG_READ and
//! CONFIG_WRITE passes here.
//!
//! * Reads of any length inside 0x000–0xFFF: the conventional header as the device has it
//!   (the borrower's VMM virtualizes what the guest sees of it), the extended space through
//!   the lender's view ([`ExtLayout`]: hidden capabilities unlinked and zero).
//! * Writes must be 1, 2 or 4 bytes inside one dword (what a PCI config cycle can be);
//!   anything else is refused with [`BackendError::BadConfigAccess`] and never reaches the
//!   device.
//! * Writes below 0x100 pass the [`ConfigFilter`] (protected ranges refused with
//!   [`BackendError::Forbidden`], BME kept at the lender's value).
//! * Writes at 0x100 and above are dropped (the reply is success, as for a read-only
//!   register), except a Resizable BAR control dword's: its size field is how a driver
//!   picks a BAR's size. A backend that resizes BARs ([`DeviceBackend::resizes_bars`])
//!   applies it or refuses a size it does not offer ([`BackendError::ResizeRefused`]); for
//!   one that does not (vfio-pci), the capability offers only each BAR's current size, and
//!   any other is refused by name.
//!
//! Refused and dropped writes are counted per lease and logged at most once a second with
//! the number held back ([`ntb::RateLimit`]): a borrower can repeat them at will.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::extended::{ExtLayout, EXT_CAP_REBAR, EXT_END, EXT_START};
use super::ConfigFilter;
use crate::backend::{capabilities, BackendError, DeviceBackend};
use crate::protocol::DeviceInfo;

/// What happened to a write the gate accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Written to the device (after the filter's adjustments).
    Written,
    /// Dropped: extended config space is read-only to the borrower.
    Dropped,
}

/// Counts of what the gate kept from the device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GateCounts {
    /// Writes to extended config space, dropped.
    pub dropped: u64,
    /// Writes refused with an error (protected fields, bad size or alignment, out of range).
    pub refused: u64,
}

/// The config-space gate of one lease.
#[derive(Debug)]
pub struct ConfigGate {
    name: String,
    /// The conventional filter, from the config space as it was when the lease began: what
    /// is protected must not depend on bytes the borrower writes later.
    filter: ConfigFilter,
    /// The extended chain and its view (fixed in hardware; walked once).
    layout: ExtLayout,
    dropped: AtomicU64,
    refused: AtomicU64,
    log: ntb::RateLimit,
}

impl ConfigGate {
    /// A gate for `backend` (the device as the lease begins: reset and unused), whose log
    /// lines start with `name` (e.g. "peer/vm: lease 3 of 0000:81:00.0").
    pub fn new(name: &str, backend: &dyn DeviceBackend) -> Result<ConfigGate, BackendError> {
        let mut snapshot = [0u8; EXT_START];
        backend.config_read(0, &mut snapshot)?;
        Ok(ConfigGate {
            name: name.to_string(),
            filter: ConfigFilter::from_config(&snapshot),
            layout: layout(backend),
            dropped: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            log: ntb::RateLimit::new(Duration::from_secs(1)),
        })
    }

    /// What the gate kept from the device so far.
    pub fn counts(&self) -> GateCounts {
        GateCounts {
            dropped: self.dropped.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
        }
    }

    fn range(offset: u16, len: usize) -> Result<(usize, usize), BackendError> {
        let start = usize::from(offset);
        let end = start + len;
        if len == 0 || end > EXT_END {
            return Err(BackendError::OutOfRange {
                what: "config space".into(),
                offset: u64::from(offset),
                len,
                size: EXT_END as u64,
            });
        }
        Ok((start, end))
    }

    /// Reads `buf.len()` bytes at `offset` as the borrower sees them.
    pub fn read(
        &self,
        backend: &dyn DeviceBackend,
        offset: u16,
        buf: &mut [u8],
    ) -> Result<(), BackendError> {
        let (start, end) = Self::range(offset, buf.len())?;
        let conv_end = end.min(EXT_START);
        if start < conv_end {
            backend.config_read(offset, &mut buf[..conv_end - start])?;
        }
        if end > EXT_START {
            let from = start.max(EXT_START);
            let out = &mut buf[from - start..];
            out.fill(0);
            let size = usize::from(backend.config_size()).min(EXT_END);
            let raw_end = end.min(size);
            if from < raw_end {
                backend.config_read(from as u16, &mut out[..raw_end - from])?;
            }
            self.layout.apply(from, out);
            if !backend.resizes_bars() {
                offer_only_current(&self.layout, from, out, |o| dword_of(backend, o));
            }
        }
        Ok(())
    }

    /// Writes `data` at `offset` if the borrower may; see the module documentation.
    pub fn write(
        &self,
        backend: &dyn DeviceBackend,
        offset: u16,
        data: &[u8],
    ) -> Result<WriteOutcome, BackendError> {
        let r = self.check_and_write(backend, offset, data);
        match &r {
            Err(e) => {
                let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
                if let Some(held) = self.log.hit() {
                    log::warn!(
                        "{}: {e} ({n} config writes refused on this lease, {held} lines held \
                         back)",
                        self.name
                    );
                }
            }
            Ok(WriteOutcome::Dropped) => {
                let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                if let Some(held) = self.log.hit() {
                    log::warn!(
                        "{}: config write of {} bytes at {offset:#x} dropped: it touches {}, \
                         and extended config space is read-only to borrowers ({n} dropped on \
                         this lease, {held} lines held back)",
                        self.name,
                        data.len(),
                        self.layout.describe(usize::from(offset)),
                    );
                }
            }
            Ok(WriteOutcome::Written) => {}
        }
        r
    }

    fn check_and_write(
        &self,
        backend: &dyn DeviceBackend,
        offset: u16,
        data: &[u8],
    ) -> Result<WriteOutcome, BackendError> {
        let (start, _) = Self::range(offset, data.len())?;
        if !matches!(data.len(), 1 | 2 | 4) || start % 4 + data.len() > 4 {
            return Err(BackendError::BadConfigAccess {
                offset,
                len: data.len(),
            });
        }
        if start >= EXT_START {
            return self.ext_write(backend, offset, data);
        }
        let mut cmd = [0u8; 2];
        backend.config_read(4, &mut cmd)?;
        let data = self
            .filter
            .filter_write(offset, data, u16::from_le_bytes(cmd))?;
        backend.config_write(offset, &data)?;
        Ok(WriteOutcome::Written)
    }
}

impl ConfigGate {
    /// A write in extended config space: only a Resizable BAR control dword takes one.
    fn ext_write(
        &self,
        backend: &dyn DeviceBackend,
        offset: u16,
        data: &[u8],
    ) -> Result<WriteOutcome, BackendError> {
        let start = usize::from(offset);
        let entry = self
            .layout
            .chain()
            .iter()
            .filter(|c| c.id == EXT_CAP_REBAR)
            .flat_map(|c| emulated::rebar::entries(usize::from(c.offset), |o| dword_of(backend, o)))
            .find(|e| (e.ctrl_at()..e.ctrl_at() + 4).contains(&start));
        let Some(e) = entry else {
            return Ok(WriteOutcome::Dropped);
        };
        if backend.resizes_bars() {
            backend.config_write(offset, data)?;
            return Ok(WriteOutcome::Written);
        }
        let at = e.ctrl_at();
        let mut ctrl = dword_of(backend, at).unwrap_or(0).to_le_bytes();
        ctrl[start - at..start - at + data.len()].copy_from_slice(data);
        let asked = emulated::rebar::ctrl_size(u32::from_le_bytes(ctrl));
        if asked == e.current {
            // Linux writes the current size back after every reset: nothing to change.
            return Ok(WriteOutcome::Written);
        }
        Err(BackendError::ResizeRefused {
            bar: e.bar,
            asked: emulated::rebar::human(asked),
            offered: format!(
                "only its current size, {} (vfio-pci does not resize a bound function: \
                 resize it on the lender, sysfs resource{}_resize, before lending it)",
                emulated::rebar::human(e.current),
                e.bar
            ),
        })
    }
}

/// One dword of the device's config space.
fn dword_of(backend: &dyn DeviceBackend, offset: usize) -> Option<u32> {
    let mut b = [0u8; 4];
    backend
        .config_read(u16::try_from(offset).ok()?, &mut b)
        .ok()?;
    Some(u32::from_le_bytes(b))
}

/// For a backend that does not resize BARs: each Resizable BAR entry's capability dword, in
/// the `out` bytes read at `from`, offers only the BAR's current size (read through
/// `read_u32`), so a driver never picks one the lender would refuse.
fn offer_only_current(
    layout: &ExtLayout,
    from: usize,
    out: &mut [u8],
    mut read_u32: impl FnMut(usize) -> Option<u32>,
) {
    let end = from + out.len();
    for cap in layout.chain().iter().filter(|c| c.id == EXT_CAP_REBAR) {
        for e in emulated::rebar::entries(usize::from(cap.offset), &mut read_u32) {
            let v = emulated::rebar::cap_offering_only(e.current).to_le_bytes();
            for (k, byte) in v.into_iter().enumerate() {
                if (from..end).contains(&(e.at + k)) {
                    out[e.at + k - from] = byte;
                }
            }
        }
    }
}

/// The device's extended capability chain, walked through `config_read` (a few dword reads;
/// none for a device with a 256-byte config space).
fn layout(backend: &dyn DeviceBackend) -> ExtLayout {
    let size = usize::from(backend.config_size()).min(EXT_END);
    ExtLayout::walk(size, |off| {
        let mut b = [0u8; 4];
        let off = u16::try_from(off).ok()?;
        backend.config_read(off, &mut b).ok()?;
        Some(u32::from_le_bytes(b))
    })
}

/// [`DeviceBackend::describe`] with the extended config space as the borrower sees it (the
/// snapshot a borrower builds its view from must not show what reads hide) and the
/// capability list walked again over that view.
pub fn virtualized_info(backend: &dyn DeviceBackend, id: &str) -> DeviceInfo {
    let mut info = backend.describe(id);
    if info.config.len() > EXT_START {
        let layout = ExtLayout::from_config(&info.config);
        let raw = info.config.clone();
        layout.apply(EXT_START, &mut info.config[EXT_START..]);
        if !backend.resizes_bars() {
            offer_only_current(&layout, EXT_START, &mut info.config[EXT_START..], |o| {
                raw.get(o..o + 4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            });
        }
        info.caps = capabilities(&info.config);
    }
    info
}

#[cfg(test)]
mod tests {
    use super::super::extended::tests::{
        ext_chain, guest_walk, REBAR_CAP_SEEN, REBAR_CTRL, REBAR_CTRL_AT,
    };
    use super::super::extended::{ext_name, ext_policy, ExtPolicy, EXT_CAP_ACS, EXT_CAP_AER};
    use super::EXT_CAP_REBAR;
    use super::*;
    use crate::backend::emulated::EmulatedBackend;
    use crate::backend::filtered_config_write;
    use crate::backend::test_log;
    use crate::backend::vfio::fake::{FakeSysfs, FakeVfioDevice};
    use crate::backend::vfio::tests::{backend_with, nic_config, nic_with, BDF};
    use crate::backend::vfio::VfioBackend;

    fn ext_nic() -> (VfioBackend<FakeVfioDevice>, FakeSysfs) {
        let sysfs = FakeSysfs::new().unwrap();
        let (b, _) = backend_with(nic_with(nic_config(true), false), &sysfs);
        (b, sysfs)
    }

    fn device_config(b: &VfioBackend<FakeVfioDevice>) -> Vec<u8> {
        let mut c = vec![0u8; 4096];
        b.config_read(0, &mut c).unwrap();
        c
    }

    #[test]
    fn borrower_reads_each_extended_capability_as_the_table_says() {
        let (b, _s) = ext_nic();
        let raw = device_config(&b);
        let gate = ConfigGate::new("reads", &b).unwrap();
        let mut seen = vec![0u8; 4096];
        gate.read(&b, 0, &mut seen).unwrap();
        assert_eq!(
            &seen[..0x100],
            &raw[..0x100],
            "conventional header as the device"
        );
        assert_eq!(
            guest_walk(&seen),
            vec![
                (EXT_CAP_AER, 0x140),
                (EXT_CAP_ACS, 0x190),
                (EXT_CAP_REBAR, 0x1c0)
            ],
            "the chain a guest walks skips the hidden capabilities"
        );
        for (id, off, len) in ext_chain() {
            let body = &seen[off + 4..off + len];
            match ext_policy(id) {
                ExtPolicy::ReadOnly => {
                    assert_eq!(body, &raw[off + 4..off + len], "{}", ext_name(id))
                }
                ExtPolicy::Resizable => {
                    // vfio-pci does not resize: the BAR offers only its current size.
                    assert_eq!(&body[..4], &REBAR_CAP_SEEN.to_le_bytes());
                    assert_eq!(&body[4..], &raw[off + 8..off + len]);
                }
                ExtPolicy::Hide => {
                    assert!(body.iter().all(|&x| x == 0), "{} visible", ext_name(id))
                }
            }
            // Dword reads (what a guest does) agree with the bulk read.
            for at in (off..off + len).step_by(4) {
                let mut d = [0u8; 4];
                gate.read(&b, at as u16, &mut d).unwrap();
                assert_eq!(&d, &seen[at..at + 4], "{at:#x}");
            }
        }
        // What the borrower builds its view from hides them too.
        let info = virtualized_info(&b, BDF);
        assert_eq!(&info.config, &seen);
        let ext: Vec<u16> = info
            .caps
            .iter()
            .filter(|c| c.extended)
            .map(|c| c.id)
            .collect();
        assert_eq!(ext, vec![EXT_CAP_AER, EXT_CAP_ACS, EXT_CAP_REBAR]);
        assert_eq!(
            b.describe(BDF).caps.iter().filter(|c| c.extended).count(),
            8
        );
    }

    /// Fails on the code before the extended-space gate: a borrower's write at 0x100 and
    /// above reached the device (the filter knew only 256 bytes).
    #[test]
    fn borrower_writes_never_reach_extended_config_space() {
        test_log::init();
        let (b, _s) = ext_nic();
        let before = device_config(&b);
        for (id, off, len) in ext_chain() {
            for at in (off..off + len).step_by(4) {
                if at == REBAR_CTRL_AT {
                    continue; // below
                }
                for size in [1usize, 2, 4] {
                    let r = filtered_config_write(&b, at as u16, &vec![0xff; size]).unwrap();
                    assert_eq!(r, WriteOutcome::Dropped, "{} at {at:#x}", ext_name(id));
                }
            }
        }
        // Beyond the last capability and at the very end.
        assert_eq!(
            filtered_config_write(&b, 0xffc, &[1; 4]).unwrap(),
            WriteOutcome::Dropped
        );
        // The Resizable BAR's control dword: the current size is a no-op, any other
        // size is refused by name (vfio-pci cannot resize), bits beside the size field
        // change nothing.
        let ctrl = REBAR_CTRL.to_le_bytes();
        assert_eq!(
            filtered_config_write(&b, REBAR_CTRL_AT as u16, &ctrl).unwrap(),
            WriteOutcome::Written
        );
        assert_eq!(
            filtered_config_write(&b, REBAR_CTRL_AT as u16, &[0xff]).unwrap(),
            WriteOutcome::Written
        );
        let e = filtered_config_write(&b, REBAR_CTRL_AT as u16 + 1, &[4]).unwrap_err();
        assert!(
            matches!(e, BackendError::ResizeRefused { bar: 0, .. }),
            "{e}"
        );
        let msg = e.to_string();
        assert!(msg.contains("16 MiB refused"), "{msg}");
        assert!(msg.contains("only its current size, 4 MiB"), "{msg}");
        assert_eq!(device_config(&b), before, "extended config space unchanged");
        // Per-lease counts, and the log is rate-limited.
        let gate = ConfigGate::new("gate-test-dropped 0000:81:00.0", &b).unwrap();
        for i in (0..201u16).filter(|i| 0x100 + 4 * i != REBAR_CTRL_AT as u16) {
            let off = 0x100 + 4 * (i % 0x3c0);
            assert_eq!(
                gate.write(&b, off, &[0xaa; 4]).unwrap(),
                WriteOutcome::Dropped
            );
        }
        assert_eq!(
            gate.counts(),
            GateCounts {
                dropped: 200,
                refused: 0
            }
        );
        let lines = test_log::lines_with("gate-test-dropped");
        assert!(!lines.is_empty() && lines.len() <= 2, "{lines:?}");
        assert!(
            lines[0].contains("the sr-iov capability 0x0010 at 0x100 (hidden)"),
            "{}",
            lines[0]
        );
        assert!(lines[0].contains("read-only to borrowers"), "{}", lines[0]);
        assert_eq!(device_config(&b), before);
    }

    #[test]
    fn bad_sizes_alignment_and_offsets_are_refused_with_a_clear_error() {
        let (b, _s) = ext_nic();
        let before = device_config(&b);
        let gate = ConfigGate::new("bad", &b).unwrap();
        for (off, len) in [
            (0x0cu16, 3usize),
            (0x80, 8),
            (0x82, 4),
            (0x83, 2),
            (0x140, 8),
            (0x1fd, 4),
        ] {
            let e = gate.write(&b, off, &vec![0x5a; len]).unwrap_err();
            assert!(
                matches!(e, BackendError::BadConfigAccess { .. }),
                "{off:#x}+{len}: {e}"
            );
            assert!(
                e.to_string().contains("1, 2 or 4 bytes inside one dword"),
                "{e}"
            );
        }
        for (off, len) in [(0x1000u16, 1usize), (0xffe, 4), (0xffff, 4), (0x10, 0)] {
            let e = gate.write(&b, off, &vec![0; len]).unwrap_err();
            assert!(
                matches!(e, BackendError::OutOfRange { .. }),
                "{off:#x}+{len}: {e}"
            );
            let mut buf = vec![0; len];
            assert!(gate.read(&b, off, &mut buf).is_err(), "read {off:#x}+{len}");
        }
        // Conventional protected fields: refused as before.
        assert!(matches!(
            gate.write(&b, 0x10, &[0; 4]),
            Err(BackendError::Forbidden(_))
        ));
        assert_eq!(
            gate.counts(),
            GateCounts {
                dropped: 0,
                refused: 11
            }
        );
        assert_eq!(device_config(&b), before);
        // A device-specific dword below 0x100 is still the borrower's.
        assert_eq!(
            gate.write(&b, 0x80, &[1, 2, 3, 4]).unwrap(),
            WriteOutcome::Written
        );
        assert_eq!(&device_config(&b)[0x80..0x84], &[1, 2, 3, 4]);
    }

    /// A resizable function (an emulated dmatest with `rebar=`): the borrower reads every
    /// size it offers, picks one through the control dword, the model's BAR follows (the
    /// description a borrower reads says so), a size it does not offer is refused by name
    /// and changes nothing, and the end of the lease puts the first size back.
    #[test]
    fn a_resizable_function_resizes_through_its_control_dword_only() {
        let b = EmulatedBackend::dmatest_resizable(
            "gate-rebar",
            ::emulated::NotifyMode::Interrupt,
            (64 << 20) - 4096,
            Some(4 << 20),
        )
        .unwrap();
        assert!(b.resizes_bars());
        let gate = ConfigGate::new("gate-rebar", &b).unwrap();
        let mut seen = vec![0u8; 4096];
        gate.read(&b, 0, &mut seen).unwrap();
        assert_eq!(guest_walk(&seen), vec![(EXT_CAP_REBAR, 0x100)]);
        let e = ::emulated::rebar::entries_in(&seen);
        assert_eq!(e.len(), 1);
        assert_eq!((e[0].bar, e[0].sizes, e[0].current), (0, 0x7f, 4 << 20));
        let bar0 = |b: &EmulatedBackend| {
            let info = virtualized_info(b, "x");
            info.bars.iter().find(|x| x.index == 0).map(|x| x.size)
        };
        assert_eq!(bar0(&b), Some(4 << 20));
        let ctrl_at = e[0].ctrl_at() as u16;
        // Size field (bits 13:8) = 6: 64 MiB, written as the byte Linux's dword write holds.
        assert_eq!(
            gate.write(&b, ctrl_at + 1, &[6]).unwrap(),
            WriteOutcome::Written
        );
        assert_eq!(bar0(&b), Some(64 << 20));
        let mut ctrl = [0u8; 4];
        gate.read(&b, ctrl_at, &mut ctrl).unwrap();
        assert_eq!(
            ::emulated::rebar::ctrl_size(u32::from_le_bytes(ctrl)),
            64 << 20
        );
        // 128 MiB is not offered: refused by name, nothing changes.
        let err = gate.write(&b, ctrl_at + 1, &[7]).unwrap_err();
        assert!(
            err.to_string()
                .contains("resizable bar 0: 128 MiB refused; the function offers 1 MiB to 64 MiB"),
            "{err}"
        );
        assert_eq!(bar0(&b), Some(64 << 20));
        // The next lease starts where lenderd was told to.
        b.reset().unwrap();
        assert_eq!(bar0(&b), Some(64 << 20), "a function reset keeps the size");
        gate.read(&b, ctrl_at, &mut ctrl).unwrap();
        assert_eq!(
            ::emulated::rebar::ctrl_size(u32::from_le_bytes(ctrl)),
            64 << 20,
            "and says so"
        );
        b.restore_defaults().unwrap();
        assert_eq!(bar0(&b), Some(4 << 20));
        gate.read(&b, ctrl_at, &mut ctrl).unwrap();
        assert_eq!(
            ::emulated::rebar::ctrl_size(u32::from_le_bytes(ctrl)),
            4 << 20
        );
    }

    #[test]
    fn device_without_extended_space_reads_zero_and_drops_writes() {
        let b =
            EmulatedBackend::dmatest("gate-emulated", ::emulated::NotifyMode::Interrupt).unwrap();
        assert_eq!(b.config_size(), 256);
        let gate = ConfigGate::new("emulated", &b).unwrap();
        let mut ext = vec![0xffu8; 0xf00];
        gate.read(&b, 0x100, &mut ext).unwrap();
        assert!(ext.iter().all(|&x| x == 0));
        let mut all = vec![0u8; 4096];
        gate.read(&b, 0, &mut all).unwrap();
        assert_eq!(guest_walk(&all), vec![]);
        assert_eq!(
            gate.write(&b, 0x100, &[1; 4]).unwrap(),
            WriteOutcome::Dropped
        );
        gate.read(&b, 0x100, &mut ext[..4]).unwrap();
        assert_eq!(&ext[..4], &[0; 4]);
        // A 256-byte VFIO config region: reads past it are zero, not an error.
        let sysfs = FakeSysfs::new().unwrap();
        let (v, _) = backend_with(nic_with(nic_config(false), false), &sysfs);
        assert_eq!(v.config_size(), 256);
        let gate = ConfigGate::new("vfio-256", &v).unwrap();
        let mut d = [0xffu8; 8];
        gate.read(&v, 0xfc, &mut d).unwrap();
        assert_eq!(&d[4..], &[0; 4]);
        assert_eq!(
            gate.write(&v, 0x200, &[1; 4]).unwrap(),
            WriteOutcome::Dropped
        );
    }
}
