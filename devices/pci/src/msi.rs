//! MSI capability emulation (32/64-bit address, optional per-vector masking) driving an
//! [`InterruptSourceGroup`] the same way as MSI-X.
//!
//! The capability bytes live in the function's [`PciConfiguration`] (guest-writable bits
//! set from [`MsiCap::writable_mask`]); after each guest config write the device calls
//! [`MsiConfig::handle_config_write`], which re-reads the capability and updates routes.
//! Vector `v` of a multi-message MSI uses data `data | v` (low bits replaced).

use std::sync::Arc;

use crate::configuration::{cap_id, ConfigError, PciConfiguration};
use crate::interrupt::{InterruptSourceGroup, MsiIrqSourceConfig};

/// Message Control: MSI Enable.
pub const MSI_CTL_ENABLE: u16 = 1 << 0;
/// Message Control: Multiple Message Capable (log2), bits 3:1.
pub const MSI_CTL_MMC_SHIFT: u16 = 1;
/// Message Control: Multiple Message Enable (log2), bits 6:4.
pub const MSI_CTL_MME_SHIFT: u16 = 4;
/// Message Control: 64-bit address capable.
pub const MSI_CTL_64_BIT: u16 = 1 << 7;
/// Message Control: per-vector masking capable.
pub const MSI_CTL_PER_VECTOR_MASK: u16 = 1 << 8;

/// Errors of MSI setup.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MsiError {
    #[error("msi vector count {0} is not a power of two in 1..=32")]
    VectorCount(u32),
    #[error("interrupt group has {group} vectors, msi needs {needed}")]
    GroupTooSmall { group: u32, needed: u32 },
    #[error("msi capability: {0}")]
    Config(#[from] ConfigError),
}

/// Layout of an MSI capability.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsiCap {
    /// log2 of the number of vectors the function can use (0..=5).
    pub vectors_log2: u8,
    pub is_64bit: bool,
    pub per_vector_mask: bool,
}

impl MsiCap {
    /// `vectors` must be a power of two in 1..=32.
    pub fn new(vectors: u32, is_64bit: bool, per_vector_mask: bool) -> Result<Self, MsiError> {
        if !vectors.is_power_of_two() || vectors > 32 {
            return Err(MsiError::VectorCount(vectors));
        }
        Ok(Self {
            vectors_log2: vectors.trailing_zeros() as u8,
            is_64bit,
            per_vector_mask,
        })
    }

    fn from_ctl(ctl: u16) -> Self {
        Self {
            vectors_log2: ((ctl >> MSI_CTL_MMC_SHIFT) & 7).min(5) as u8,
            is_64bit: ctl & MSI_CTL_64_BIT != 0,
            per_vector_mask: ctl & MSI_CTL_PER_VECTOR_MASK != 0,
        }
    }

    pub fn vectors(&self) -> u32 {
        1 << self.vectors_log2
    }

    fn data_offset(&self) -> usize {
        if self.is_64bit {
            12
        } else {
            8
        }
    }

    fn mask_offset(&self) -> usize {
        self.data_offset() + 4
    }

    fn pending_offset(&self) -> usize {
        self.mask_offset() + 4
    }

    /// Size of the capability in bytes.
    pub fn size(&self) -> usize {
        match (self.is_64bit, self.per_vector_mask) {
            (false, false) => 10,
            (true, false) => 14,
            (false, true) => 20,
            (true, true) => 24,
        }
    }

    fn msg_ctl(&self) -> u16 {
        let mut ctl = u16::from(self.vectors_log2) << MSI_CTL_MMC_SHIFT;
        if self.is_64bit {
            ctl |= MSI_CTL_64_BIT;
        }
        if self.per_vector_mask {
            ctl |= MSI_CTL_PER_VECTOR_MASK;
        }
        ctl
    }

    /// Capability bytes (everything zero but id and Message Control).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; self.size()];
        b[0] = cap_id::MSI;
        b[2..4].copy_from_slice(&self.msg_ctl().to_le_bytes());
        b
    }

    /// Guest-writable bits: Enable, MME, address, data and the mask bits.
    pub fn writable_mask(&self) -> Vec<u8> {
        let mut m = vec![0u8; self.size()];
        m[2] = (MSI_CTL_ENABLE | 7 << MSI_CTL_MME_SHIFT) as u8;
        m[4..8].copy_from_slice(&0xffff_fffcu32.to_le_bytes());
        if self.is_64bit {
            m[8..12].fill(0xff);
        }
        let d = self.data_offset();
        m[d..d + 2].fill(0xff);
        if self.per_vector_mask {
            let mask_bits = if self.vectors() == 32 {
                u32::MAX
            } else {
                (1u32 << self.vectors()) - 1
            };
            let o = self.mask_offset();
            m[o..o + 4].copy_from_slice(&mask_bits.to_le_bytes());
        }
        m
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct MsiState {
    ctl: u16,
    addr_lo: u32,
    addr_hi: u32,
    data: u16,
    mask: u32,
}

/// Runtime state of an MSI capability at a fixed offset.
pub struct MsiConfig {
    cap_offset: usize,
    cap: MsiCap,
    state: MsiState,
    group: Arc<dyn InterruptSourceGroup>,
    devid: u32,
    /// Per vector (bit): the guest unmasked it with a message the VMM refuses to route.
    refusing: u32,
    /// Times a vector entered that state.
    refused: u64,
}

impl std::fmt::Debug for MsiConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MsiConfig")
            .field("cap_offset", &self.cap_offset)
            .field("cap", &self.cap)
            .field("enabled", &self.enabled())
            .finish()
    }
}

impl MsiConfig {
    /// Adds `cap` to `config` and returns its runtime state.
    pub fn add_to(
        config: &mut PciConfiguration,
        cap: MsiCap,
        group: Arc<dyn InterruptSourceGroup>,
        devid: u32,
    ) -> Result<Self, MsiError> {
        if group.count() < cap.vectors() {
            return Err(MsiError::GroupTooSmall {
                group: group.count(),
                needed: cap.vectors(),
            });
        }
        let cap_offset = config.add_capability_with_mask(&cap.to_bytes(), &cap.writable_mask())?;
        Ok(Self {
            cap_offset,
            cap,
            state: MsiState::default(),
            group,
            devid,
            refusing: 0,
            refused: 0,
        })
    }

    /// Attaches to an MSI capability already present at `cap_offset` (e.g. a snapshot).
    pub fn attach(
        config: &mut PciConfiguration,
        cap_offset: usize,
        group: Arc<dyn InterruptSourceGroup>,
        devid: u32,
    ) -> Result<Self, MsiError> {
        let ctl = u16::from_le_bytes([
            config.read_byte(cap_offset + 2),
            config.read_byte(cap_offset + 3),
        ]);
        let cap = MsiCap::from_ctl(ctl);
        if group.count() < cap.vectors() {
            return Err(MsiError::GroupTooSmall {
                group: group.count(),
                needed: cap.vectors(),
            });
        }
        let mask = cap.writable_mask();
        for (i, chunk) in mask.chunks(4).enumerate() {
            let mut w = [0u8; 4];
            w[..chunk.len()].copy_from_slice(chunk);
            let reg = (cap_offset + i * 4) / 4;
            // Keep the writable bits of anything sharing the first register (none: caps are
            // dword aligned) and set the capability's.
            config.set_writable_bits(reg, u32::from_le_bytes(w));
        }
        let mut c = Self {
            cap_offset,
            cap,
            state: MsiState::default(),
            group,
            devid,
            refusing: 0,
            refused: 0,
        };
        c.state = c.read_state(config);
        Ok(c)
    }

    pub fn cap_offset(&self) -> usize {
        self.cap_offset
    }

    pub fn enabled(&self) -> bool {
        self.state.ctl & MSI_CTL_ENABLE != 0
    }

    /// Vectors the guest enabled (Multiple Message Enable, capped by the capability).
    pub fn enabled_vectors(&self) -> u32 {
        let mme = ((self.state.ctl >> MSI_CTL_MME_SHIFT) & 7).min(u16::from(self.cap.vectors_log2));
        1 << mme
    }

    fn read_u32(config: &PciConfiguration, offset: usize) -> u32 {
        let mut b = [0u8; 4];
        config.read_bytes(offset, &mut b);
        u32::from_le_bytes(b)
    }

    fn read_state(&self, config: &PciConfiguration) -> MsiState {
        let o = self.cap_offset;
        let mut b = [0u8; 2];
        config.read_bytes(o + 2, &mut b);
        let ctl = u16::from_le_bytes(b);
        config.read_bytes(o + self.cap.data_offset(), &mut b);
        MsiState {
            ctl,
            addr_lo: Self::read_u32(config, o + 4),
            addr_hi: if self.cap.is_64bit {
                Self::read_u32(config, o + 8)
            } else {
                0
            },
            data: u16::from_le_bytes(b),
            mask: if self.cap.per_vector_mask {
                Self::read_u32(config, o + self.cap.mask_offset())
            } else {
                0
            },
        }
    }

    fn masked_in(&self, s: &MsiState, v: u32) -> bool {
        s.ctl & MSI_CTL_ENABLE == 0 || s.mask & (1 << v) != 0
    }

    /// Whether vector `v`'s message in `s` may become a KVM route (the same rule as MSI-X,
    /// [`crate::msix::msi_message_valid`]): a guest-written address outside the local APIC
    /// window, or a reserved encoding, is never routed.
    fn valid_in(&self, s: &MsiState, v: u32) -> bool {
        let m = self.msg(s, v);
        self.routable(&m)
    }

    /// The MSI-X rule ([`crate::msix::msi_message_valid`]) plus a destination the VM has
    /// ([`InterruptSourceGroup::destination_exists`]).
    fn routable(&self, m: &MsiIrqSourceConfig) -> bool {
        crate::msix::msi_message_valid(m.low_addr, m.high_addr, m.data)
            && self.group.destination_exists(m)
    }

    /// True if vector `v` cannot be delivered now: not enabled, masked, or its message is
    /// refused (then it stays unrouted, as if masked, until a valid message is written).
    pub fn is_vector_masked(&self, v: u32) -> bool {
        v >= self.enabled_vectors()
            || self.masked_in(&self.state, v)
            || !self.valid_in(&self.state, v)
    }

    /// How many times the guest enabled or unmasked a vector (or changed an unmasked
    /// vector's message) with a message the VMM refused to route.
    pub fn refused_messages(&self) -> u64 {
        self.refused
    }

    /// Counts vector `v` as refused when it newly is (unmasked by the guest, message
    /// invalid); `changed`: its message changed, which makes a new refusal.
    fn note_refusal(&mut self, v: u32, changed: bool) {
        let bit = 1u32 << v;
        if changed {
            self.refusing &= !bit;
        }
        let now = v < self.enabled_vectors()
            && !self.masked_in(&self.state, v)
            && !self.valid_in(&self.state, v);
        let newly = now && self.refusing & bit == 0;
        if now {
            self.refusing |= bit;
        } else {
            self.refusing &= !bit;
        }
        if !newly {
            return;
        }
        self.refused += 1;
        let n = self.refused;
        // A guest can do this in a loop: rate-limited.
        if n <= 16 || n % 1024 == 0 {
            let m = self.msg(&self.state, v);
            log::warn!(
                "msi vector {v} (devid {:#x}): message address {:#x}:{:#x} data {:#x} is not an \
                 interrupt for a local APIC of this VM; not routed (refusal #{n})",
                self.devid,
                m.high_addr,
                m.low_addr,
                m.data
            );
        }
    }

    fn msg(&self, s: &MsiState, v: u32) -> MsiIrqSourceConfig {
        let low_bits = self.enabled_vectors() - 1;
        MsiIrqSourceConfig {
            high_addr: s.addr_hi,
            low_addr: s.addr_lo,
            data: (u32::from(s.data) & !low_bits) | (v & low_bits),
            devid: self.devid,
        }
    }

    fn pending(&self, config: &PciConfiguration) -> u32 {
        if self.cap.per_vector_mask {
            Self::read_u32(config, self.cap_offset + self.cap.pending_offset())
        } else {
            0
        }
    }

    fn set_pending(&self, config: &mut PciConfiguration, pending: u32) {
        if self.cap.per_vector_mask {
            config.write_bytes_raw(
                self.cap_offset + self.cap.pending_offset(),
                &pending.to_le_bytes(),
            );
        }
    }

    /// Call after every guest config write at (`reg_idx`, `offset`, `len`): if it touched
    /// the capability, updates routes, enables/disables the group and injects pending
    /// vectors that became unmasked.
    pub fn handle_config_write(
        &mut self,
        config: &mut PciConfiguration,
        reg_idx: usize,
        offset: u64,
        len: usize,
    ) {
        let start = reg_idx * 4 + offset as usize;
        if start >= self.cap_offset + self.cap.size() || self.cap_offset >= start + len {
            return;
        }
        let old = self.state;
        let new = self.read_state(config);
        if old == new {
            return;
        }
        let was_enabled = old.ctl & MSI_CTL_ENABLE != 0;
        let enabled = new.ctl & MSI_CTL_ENABLE != 0;
        let old_vectors = self.enabled_vectors();
        let old_msgs: Vec<_> = (0..self.cap.vectors()).map(|v| self.msg(&old, v)).collect();
        self.state = new;
        if enabled && !was_enabled {
            if let Err(e) = self.group.enable() {
                log::error!("msi enable: {e}");
            }
        }
        let mut pending = self.pending(config);
        for v in 0..self.cap.vectors() {
            let om = &old_msgs[v as usize];
            let before = v >= old_vectors || self.masked_in(&old, v) || !self.routable(om);
            let after = self.is_vector_masked(v);
            let msg = self.msg(&new, v);
            self.note_refusal(v, msg != old_msgs[v as usize]);
            if before != after || (!after && msg != old_msgs[v as usize]) {
                if let Err(e) = self.group.update(v, msg, after) {
                    log::error!("msi vector {v} update (masked={after}): {e}");
                }
            }
            if before && !after && pending & (1 << v) != 0 {
                pending &= !(1 << v);
                if let Err(e) = self.group.trigger(v) {
                    log::error!("msi vector {v} trigger: {e}");
                }
            }
        }
        self.set_pending(config, pending);
        if !enabled && was_enabled {
            if let Err(e) = self.group.disable() {
                log::error!("msi disable: {e}");
            }
        }
    }

    /// Device-side interrupt for vector `v`: injected, or recorded in the Pending Bits if
    /// masked (per-vector masking only). Returns true if injected.
    pub fn trigger(&mut self, config: &mut PciConfiguration, v: u32) -> bool {
        if !self.enabled() || v >= self.enabled_vectors() {
            return false;
        }
        if self.is_vector_masked(v) {
            let p = self.pending(config) | 1 << v;
            self.set_pending(config, p);
            return false;
        }
        if let Err(e) = self.group.trigger(v) {
            log::error!("msi vector {v} trigger: {e}");
            return false;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::configuration::PciConfigurationParams;
    use crate::testing::{GroupCall, MockGroup};

    fn write(c: &mut PciConfiguration, msi: &mut MsiConfig, offset: usize, data: &[u8]) {
        c.write_config_register(offset / 4, (offset % 4) as u64, data);
        msi.handle_config_write(c, offset / 4, (offset % 4) as u64, data.len());
    }

    #[test]
    fn msi_64bit_with_per_vector_masking() {
        let mut c = PciConfiguration::new(&PciConfigurationParams::default());
        let g = Arc::new(MockGroup::new(4));
        let cap = MsiCap::new(4, true, true).unwrap();
        assert_eq!(cap.size(), 24);
        let mut msi = MsiConfig::add_to(&mut c, cap, g.clone(), 7).unwrap();
        let o = msi.cap_offset();
        assert_eq!(c.find_capability(cap_id::MSI), Some(o));
        // Address, data, mask vector 1.
        write(&mut c, &mut msi, o + 4, &0xfee0_0003u32.to_le_bytes());
        write(&mut c, &mut msi, o + 8, &0u32.to_le_bytes());
        write(&mut c, &mut msi, o + 12, &0x40u16.to_le_bytes());
        write(&mut c, &mut msi, o + 16, &0b10u32.to_le_bytes());
        assert!(g.take().is_empty(), "nothing routed while disabled");
        assert!(!msi.trigger(&mut c, 0));
        // Enable with MME = 2 vectors (log2 1).
        write(
            &mut c,
            &mut msi,
            o + 2,
            &(MSI_CTL_ENABLE | 1 << 4).to_le_bytes(),
        );
        assert_eq!(msi.enabled_vectors(), 2);
        let m = |data| MsiIrqSourceConfig {
            high_addr: 0,
            low_addr: 0xfee0_0000,
            data,
            devid: 7,
        };
        assert_eq!(
            g.take(),
            vec![GroupCall::Enable, GroupCall::Update(0, m(0x40), false)]
        );
        assert!(msi.trigger(&mut c, 0));
        assert!(!msi.trigger(&mut c, 1));
        assert!(!msi.trigger(&mut c, 2), "vector beyond MME dropped");
        assert_eq!(g.take(), vec![GroupCall::Trigger(0)]);
        let mut p = [0u8; 4];
        c.read_bytes(o + 20, &mut p);
        assert_eq!(u32::from_le_bytes(p), 0b10);
        // Pending bits are read-only to the guest.
        write(&mut c, &mut msi, o + 20, &0u32.to_le_bytes());
        c.read_bytes(o + 20, &mut p);
        assert_eq!(u32::from_le_bytes(p), 0b10);
        // Unmask vector 1: routed with data | 1, injected, pending cleared.
        write(&mut c, &mut msi, o + 16, &0u32.to_le_bytes());
        assert_eq!(
            g.take(),
            vec![GroupCall::Update(1, m(0x41), false), GroupCall::Trigger(1)]
        );
        c.read_bytes(o + 20, &mut p);
        assert_eq!(u32::from_le_bytes(p), 0);
        // Disable (MME kept).
        write(&mut c, &mut msi, o + 2, &(1u16 << 4).to_le_bytes());
        assert_eq!(
            g.take(),
            vec![
                GroupCall::Update(0, m(0x40), true),
                GroupCall::Update(1, m(0x41), true),
                GroupCall::Disable
            ]
        );
    }

    /// A message that is not an interrupt (address outside the local APIC window, a
    /// non-zero upper address, a reserved delivery mode) is never routed: the vector stays
    /// masked for KVM, its interrupts wait in the pending bits, the refusal is counted once
    /// per message; a valid message routes it and delivers what was pending.
    #[test]
    fn bogus_msi_messages_are_never_routed_and_are_counted() {
        let mut c = PciConfiguration::new(&PciConfigurationParams::default());
        let g = Arc::new(MockGroup::new(1));
        let cap = MsiCap::new(1, true, true).unwrap();
        let mut msi = MsiConfig::add_to(&mut c, cap, g.clone(), 3).unwrap();
        let o = msi.cap_offset();
        for (i, (lo, hi, data)) in [
            (0xfec0_0000u32, 0u32, 0x30u16), // the IOAPIC, not the LAPIC window
            (0xfee0_0000, 1, 0x30),          // above 4 GiB
            (0xfee0_0000, 0, 0x330),         // delivery mode 011b (reserved)
        ]
        .into_iter()
        .enumerate()
        {
            write(&mut c, &mut msi, o + 4, &lo.to_le_bytes());
            write(&mut c, &mut msi, o + 8, &hi.to_le_bytes());
            write(&mut c, &mut msi, o + 12, &data.to_le_bytes());
            write(&mut c, &mut msi, o + 2, &MSI_CTL_ENABLE.to_le_bytes());
            let calls = g.take();
            assert!(
                !calls
                    .iter()
                    .any(|c| matches!(c, GroupCall::Update(_, _, false))),
                "message {i} routed: {calls:?}"
            );
            assert!(msi.is_vector_masked(0));
            assert_eq!(msi.refused_messages(), i as u64 + 1);
            // Rewriting the same bogus message is not a new refusal.
            write(&mut c, &mut msi, o + 12, &data.to_le_bytes());
            assert_eq!(msi.refused_messages(), i as u64 + 1);
            assert!(!msi.trigger(&mut c, 0), "not delivered");
            g.take();
            write(&mut c, &mut msi, o + 2, &0u16.to_le_bytes());
            g.take();
        }
        // Enabled again with the last bogus message: a new refusal. A device interrupt now
        // waits in the pending bit; a valid message routes the vector and delivers it.
        write(&mut c, &mut msi, o + 2, &MSI_CTL_ENABLE.to_le_bytes());
        assert_eq!(msi.refused_messages(), 4);
        assert!(!msi.trigger(&mut c, 0));
        g.take();
        write(&mut c, &mut msi, o + 4, &0xfee0_0000u32.to_le_bytes());
        write(&mut c, &mut msi, o + 8, &0u32.to_le_bytes());
        write(&mut c, &mut msi, o + 12, &0x31u16.to_le_bytes());
        let good = MsiIrqSourceConfig {
            high_addr: 0,
            low_addr: 0xfee0_0000,
            data: 0x31,
            devid: 3,
        };
        assert_eq!(
            g.take(),
            vec![GroupCall::Update(0, good, false), GroupCall::Trigger(0)]
        );
        assert!(!msi.is_vector_masked(0));
        assert!(msi.trigger(&mut c, 0));
        assert_eq!(msi.refused_messages(), 4, "a valid message is no refusal");
    }

    #[test]
    fn msi_32bit_attach_to_existing_capability() {
        let mut c = PciConfiguration::new(&PciConfigurationParams::default());
        let cap = MsiCap::new(1, false, false).unwrap();
        let o = c.add_capability(&cap.to_bytes()).unwrap();
        let g = Arc::new(MockGroup::new(1));
        let mut msi = MsiConfig::attach(&mut c, o, g.clone(), 0).unwrap();
        write(&mut c, &mut msi, o + 4, &0xfee0_1000u32.to_le_bytes());
        write(&mut c, &mut msi, o + 8, &0x25u16.to_le_bytes());
        write(&mut c, &mut msi, o + 2, &MSI_CTL_ENABLE.to_le_bytes());
        assert_eq!(
            g.take(),
            vec![
                GroupCall::Enable,
                GroupCall::Update(
                    0,
                    MsiIrqSourceConfig {
                        high_addr: 0,
                        low_addr: 0xfee0_1000,
                        data: 0x25,
                        devid: 0
                    },
                    false
                )
            ]
        );
        assert!(msi.trigger(&mut c, 0));
        assert_eq!(MsiCap::new(3, false, false), Err(MsiError::VectorCount(3)));
        assert!(matches!(
            MsiConfig::add_to(&mut c, MsiCap::new(4, false, false).unwrap(), g, 0),
            Err(MsiError::GroupTooSmall { .. })
        ));
    }
}
