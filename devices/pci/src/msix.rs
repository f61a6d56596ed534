//! MSI-X emulation: the capability (`MsixCap`), and the table + PBA state (`MsixConfig`)
//! that drives an [`InterruptSourceGroup`].
//!
//! A vector is *effectively masked* when MSI-X is disabled, the function is masked, or its
//! vector-control mask bit is set. Whenever that state or an unmasked vector's message
//! changes, `MsixConfig` calls `group.update(vector, msg, masked)`. A vector triggered while
//! masked (and MSI-X enabled) sets its PBA bit; unmasking it injects it and clears the bit.
//! Interrupts signalled directly on a group notifier (irqfd) while masked stay in the
//! eventfd and are delivered by KVM when the irqfd is registered again; they do not show
//! in the PBA.
//!
//! A guest can write anything into the table. A message that is not an x86 interrupt
//! ([`msi_message_valid`]: address outside the 0xFEEx_xxxx window, a non-zero upper
//! address, reserved data bits or delivery modes), or one aimed at a local APIC that no vCPU
//! has ([`InterruptSourceGroup::destination_exists`]), is never routed: the vector behaves as
//! masked (no KVM route, no irqfd; signals wait in the eventfd or the PBA) until the guest
//! writes a valid message. Each refusal is counted ([`MsixConfig::refused_messages`]) and
//! logged rate-limited; the other vectors are not affected.

use std::sync::Arc;

use crate::configuration::{cap_id, PciConfiguration};
use crate::interrupt::{InterruptSourceGroup, MsiIrqSourceConfig};

/// Bytes per MSI-X table entry.
pub const MSIX_TABLE_ENTRY_SIZE: u64 = 16;
/// Bytes per PBA entry (64 vectors).
pub const MSIX_PBA_ENTRY_SIZE: u64 = 8;
/// Most vectors a function may have.
pub const MAX_MSIX_VECTORS: u16 = 2048;
/// Message Control: MSI-X Enable.
pub const MSIX_CTL_ENABLE: u16 = 1 << 15;
/// Message Control: Function Mask.
pub const MSIX_CTL_FUNCTION_MASK: u16 = 1 << 14;
/// Message Control: Table Size (N - 1).
pub const MSIX_CTL_TABLE_SIZE_MASK: u16 = 0x07ff;
/// Vector Control: Mask bit.
pub const MSIX_VECTOR_CTL_MASK: u32 = 1;
/// Size of the capability in configuration space.
pub const MSIX_CAP_SIZE: usize = 12;
/// The x86 MSI address window (the local APICs): address bits 31:20 are 0xFEE.
pub const MSI_ADDRESS_WINDOW: u32 = 0xfee0_0000;
const MSI_ADDRESS_WINDOW_MASK: u32 = 0xfff0_0000;

/// Whether an MSI/MSI-X message is an interrupt an x86 guest can be given: the address lies
/// in the 0xFEEx_xxxx window with a zero upper half, the data's reserved upper half is zero
/// and its delivery mode (bits 10:8) is not one of the reserved encodings 011b and 110b.
pub fn msi_message_valid(addr_lo: u32, addr_hi: u32, data: u32) -> bool {
    let delivery = (data >> 8) & 7;
    addr_lo & MSI_ADDRESS_WINDOW_MASK == MSI_ADDRESS_WINDOW
        && addr_hi == 0
        && data >> 16 == 0
        && delivery != 0b011
        && delivery != 0b110
}

/// Errors of MSI-X setup.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MsixError {
    #[error("msi-x vector count {0} is not in 1..=2048")]
    VectorCount(u16),
    #[error("interrupt group has {group} vectors, msi-x needs {needed}")]
    GroupTooSmall { group: u32, needed: u16 },
    #[error("msi-x {what} bir {bir} is not a bar index")]
    Bir { what: &'static str, bir: u8 },
    #[error("msi-x {what} offset {offset:#x} is not 8-byte aligned")]
    Offset { what: &'static str, offset: u32 },
}

/// The MSI-X capability registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsixCap {
    pub msg_ctl: u16,
    /// Table offset (bits 31:3) | table BIR (bits 2:0).
    pub table: u32,
    /// PBA offset (bits 31:3) | PBA BIR (bits 2:0).
    pub pba: u32,
}

impl MsixCap {
    /// A capability for `vectors` vectors with the table at `table_offset` of BAR
    /// `table_bir` and the PBA at `pba_offset` of BAR `pba_bir`.
    pub fn new(
        vectors: u16,
        table_bir: u8,
        table_offset: u32,
        pba_bir: u8,
        pba_offset: u32,
    ) -> Result<Self, MsixError> {
        if vectors == 0 || vectors > MAX_MSIX_VECTORS {
            return Err(MsixError::VectorCount(vectors));
        }
        for (what, bir, offset) in [
            ("table", table_bir, table_offset),
            ("pba", pba_bir, pba_offset),
        ] {
            if bir > 5 {
                return Err(MsixError::Bir { what, bir });
            }
            if offset & 7 != 0 {
                return Err(MsixError::Offset { what, offset });
            }
        }
        Ok(Self {
            msg_ctl: (vectors - 1) & MSIX_CTL_TABLE_SIZE_MASK,
            table: table_offset | u32::from(table_bir),
            pba: pba_offset | u32::from(pba_bir),
        })
    }

    /// Parses the capability at `offset` of a configuration space.
    pub fn from_config(config: &PciConfiguration, offset: usize) -> Self {
        let reg = offset / 4;
        Self {
            msg_ctl: (config.read_reg(reg) >> 16) as u16,
            table: config.read_reg(reg + 1),
            pba: config.read_reg(reg + 2),
        }
    }

    /// Capability bytes for [`PciConfiguration::add_capability_with_mask`].
    pub fn to_bytes(&self) -> [u8; MSIX_CAP_SIZE] {
        let mut b = [0u8; MSIX_CAP_SIZE];
        b[0] = cap_id::MSIX;
        b[2..4].copy_from_slice(&self.msg_ctl.to_le_bytes());
        b[4..8].copy_from_slice(&self.table.to_le_bytes());
        b[8..12].copy_from_slice(&self.pba.to_le_bytes());
        b
    }

    /// Guest-writable bits: Enable and Function Mask only.
    pub fn writable_mask() -> [u8; MSIX_CAP_SIZE] {
        let mut m = [0u8; MSIX_CAP_SIZE];
        m[3] = ((MSIX_CTL_ENABLE | MSIX_CTL_FUNCTION_MASK) >> 8) as u8;
        m
    }

    /// Adds this capability to `config`; returns its offset.
    pub fn add_to(
        &self,
        config: &mut PciConfiguration,
    ) -> Result<usize, crate::configuration::ConfigError> {
        config.add_capability_with_mask(&self.to_bytes(), &Self::writable_mask())
    }

    pub fn table_size(&self) -> u16 {
        (self.msg_ctl & MSIX_CTL_TABLE_SIZE_MASK) + 1
    }

    pub fn table_bir(&self) -> usize {
        (self.table & 7) as usize
    }

    pub fn table_offset(&self) -> u64 {
        u64::from(self.table & !7)
    }

    /// Table length in bytes.
    pub fn table_len(&self) -> u64 {
        u64::from(self.table_size()) * MSIX_TABLE_ENTRY_SIZE
    }

    pub fn pba_bir(&self) -> usize {
        (self.pba & 7) as usize
    }

    pub fn pba_offset(&self) -> u64 {
        u64::from(self.pba & !7)
    }

    /// PBA length in bytes.
    pub fn pba_len(&self) -> u64 {
        u64::from(self.table_size()).div_ceil(64) * MSIX_PBA_ENTRY_SIZE
    }

    /// If an access at `offset` of BAR `bar_idx` hits the table, the offset inside it.
    pub fn table_hit(&self, bar_idx: usize, offset: u64) -> Option<u64> {
        (bar_idx == self.table_bir()
            && offset >= self.table_offset()
            && offset - self.table_offset() < self.table_len())
        .then(|| offset - self.table_offset())
    }

    /// If an access at `offset` of BAR `bar_idx` hits the PBA, the offset inside it.
    pub fn pba_hit(&self, bar_idx: usize, offset: u64) -> Option<u64> {
        (bar_idx == self.pba_bir()
            && offset >= self.pba_offset()
            && offset - self.pba_offset() < self.pba_len())
        .then(|| offset - self.pba_offset())
    }
}

/// One MSI-X table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsixTableEntry {
    pub msg_addr_lo: u32,
    pub msg_addr_hi: u32,
    pub msg_data: u32,
    pub vector_ctl: u32,
}

impl Default for MsixTableEntry {
    fn default() -> Self {
        Self {
            msg_addr_lo: 0,
            msg_addr_hi: 0,
            msg_data: 0,
            vector_ctl: MSIX_VECTOR_CTL_MASK,
        }
    }
}

impl MsixTableEntry {
    pub fn masked(&self) -> bool {
        self.vector_ctl & MSIX_VECTOR_CTL_MASK != 0
    }

    /// Whether the message may be routed ([`msi_message_valid`]).
    pub fn message_valid(&self) -> bool {
        msi_message_valid(self.msg_addr_lo, self.msg_addr_hi, self.msg_data)
    }
}

/// MSI-X table, PBA and control state of one function.
pub struct MsixConfig {
    table_entries: Vec<MsixTableEntry>,
    pba_entries: Vec<u64>,
    devid: u32,
    group: Arc<dyn InterruptSourceGroup>,
    masked: bool,
    enabled: bool,
    /// Masked by the VMM, not the guest (`vm.pause`): invisible in the guest's view.
    host_masked: bool,
    /// Per vector: the guest unmasked it with a message the VMM refuses to route.
    refusing: Vec<bool>,
    /// Times a vector entered that state.
    refused: u64,
}

impl std::fmt::Debug for MsixConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MsixConfig")
            .field("vectors", &self.table_entries.len())
            .field("enabled", &self.enabled)
            .field("masked", &self.masked)
            .finish()
    }
}

impl MsixConfig {
    /// State for `vectors` vectors delivered through `group` (at least `vectors` large);
    /// `devid` is the function's requester id.
    pub fn new(
        vectors: u16,
        group: Arc<dyn InterruptSourceGroup>,
        devid: u32,
    ) -> Result<Self, MsixError> {
        if vectors == 0 || vectors > MAX_MSIX_VECTORS {
            return Err(MsixError::VectorCount(vectors));
        }
        if group.count() < u32::from(vectors) {
            return Err(MsixError::GroupTooSmall {
                group: group.count(),
                needed: vectors,
            });
        }
        Ok(Self {
            table_entries: vec![MsixTableEntry::default(); usize::from(vectors)],
            pba_entries: vec![0; usize::from(vectors).div_ceil(64)],
            devid,
            group,
            masked: false,
            enabled: false,
            host_masked: false,
            refusing: vec![false; usize::from(vectors)],
            refused: 0,
        })
    }

    /// How many times the guest unmasked a vector (or changed an unmasked vector's message)
    /// with a message the VMM refused to route.
    pub fn refused_messages(&self) -> u64 {
        self.refused
    }

    /// The interrupt group.
    pub fn group(&self) -> &Arc<dyn InterruptSourceGroup> {
        &self.group
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Function Mask.
    pub fn masked(&self) -> bool {
        self.masked
    }

    pub fn vectors(&self) -> usize {
        self.table_entries.len()
    }

    pub fn table_entry(&self, vector: usize) -> Option<MsixTableEntry> {
        self.table_entries.get(vector).copied()
    }

    /// True if `vector` cannot be delivered now (disabled, function or vector masked,
    /// masked by the VMM, or its message is refused).
    pub fn is_vector_masked(&self, vector: usize) -> bool {
        self.guest_masked(vector)
            || self.host_masked
            || self
                .table_entries
                .get(vector)
                .is_none_or(|e| !self.routable(e))
    }

    /// Whether `e`'s message may become a KVM route: an x86 interrupt
    /// ([`msi_message_valid`]) aimed at a local APIC the VM has
    /// ([`InterruptSourceGroup::destination_exists`]).
    fn routable(&self, e: &MsixTableEntry) -> bool {
        e.message_valid()
            && self.group.destination_exists(&MsiIrqSourceConfig {
                high_addr: e.msg_addr_hi,
                low_addr: e.msg_addr_lo,
                data: e.msg_data,
                devid: self.devid,
            })
    }

    /// Masked as the guest sees it (disabled, function mask, vector mask).
    fn guest_masked(&self, vector: usize) -> bool {
        !self.enabled || self.masked || self.table_entries.get(vector).is_none_or(|e| e.masked())
    }

    /// Counts (and logs, rate-limited) a vector the guest made deliverable with a message
    /// that is not routed.
    fn note_refusal(&mut self, vector: usize) {
        let Some(e) = self.table_entries.get(vector).copied() else {
            return;
        };
        let now = !self.guest_masked(vector) && !self.routable(&e);
        let Some(was) = self.refusing.get_mut(vector) else {
            return;
        };
        let newly = now && !*was;
        *was = now;
        if !newly {
            return;
        }
        self.refused += 1;
        let n = self.refused;
        if n <= 16 || n % 1024 == 0 {
            log::warn!(
                "msi-x vector {vector} (devid {:#x}): message address {:#x}:{:#x} data {:#x} \
                 is not an x86 interrupt for a local APIC of this VM; not routed until the \
                 guest writes a valid one \
                 (refusal #{n})",
                self.devid,
                e.msg_addr_hi,
                e.msg_addr_lo,
                e.msg_data
            );
        }
    }

    /// Masks every vector from the VMM's side (`vm.pause`) or lifts that mask, without
    /// touching what the guest sees in the table and Message Control. While masked, an
    /// irqfd signal stays pending in its eventfd and a VMM-side trigger sets the PBA bit;
    /// lifting the mask re-attaches the irqfds (KVM delivers what is pending) and injects
    /// pending PBA bits, so no interrupt is lost.
    pub fn set_host_masked(&mut self, masked: bool) {
        if masked == self.host_masked {
            return;
        }
        let before: Vec<bool> = (0..self.vectors())
            .map(|v| self.is_vector_masked(v))
            .collect();
        self.host_masked = masked;
        for (v, b) in before.into_iter().enumerate() {
            self.sync_vector(v, b, false);
        }
    }

    /// Whether the VMM masks every vector.
    pub fn host_masked(&self) -> bool {
        self.host_masked
    }

    pub fn is_pending(&self, vector: usize) -> bool {
        self.pba_entries
            .get(vector / 64)
            .is_some_and(|q| q & (1 << (vector % 64)) != 0)
    }

    fn set_pending(&mut self, vector: usize, pending: bool) {
        if let Some(q) = self.pba_entries.get_mut(vector / 64) {
            if pending {
                *q |= 1 << (vector % 64);
            } else {
                *q &= !(1 << (vector % 64));
            }
        }
    }

    fn msg(&self, vector: usize) -> MsiIrqSourceConfig {
        let e = self.table_entries[vector];
        MsiIrqSourceConfig {
            high_addr: e.msg_addr_hi,
            low_addr: e.msg_addr_lo,
            data: e.msg_data,
            devid: self.devid,
        }
    }

    fn route(&self, vector: usize, masked: bool) {
        if let Err(e) = self.group.update(vector as u32, self.msg(vector), masked) {
            log::error!("msi-x vector {vector} update (masked={masked}): {e}");
        }
    }

    fn inject(&mut self, vector: usize) {
        if let Err(e) = self.group.trigger(vector as u32) {
            log::error!("msi-x vector {vector} trigger: {e}");
        }
    }

    /// After the effective mask of `vector` went from `before` to the current state,
    /// update the route and inject a pending interrupt on unmask.
    fn sync_vector(&mut self, vector: usize, before: bool, msg_changed: bool) {
        if msg_changed {
            // A new bogus message on an unmasked vector is a new refusal.
            if let Some(r) = self.refusing.get_mut(vector) {
                *r = false;
            }
        }
        self.note_refusal(vector);
        let after = self.is_vector_masked(vector);
        if before != after || (msg_changed && !after) {
            self.route(vector, after);
        }
        if before && !after && self.is_pending(vector) {
            self.set_pending(vector, false);
            self.inject(vector);
        }
    }

    /// Applies a guest write of Message Control (only Enable and Function Mask matter).
    pub fn set_msg_ctl(&mut self, msg_ctl: u16) {
        let enabled = msg_ctl & MSIX_CTL_ENABLE != 0;
        let masked = msg_ctl & MSIX_CTL_FUNCTION_MASK != 0;
        if enabled == self.enabled && masked == self.masked {
            return;
        }
        let before: Vec<bool> = (0..self.vectors())
            .map(|v| self.is_vector_masked(v))
            .collect();
        let was_enabled = self.enabled;
        self.enabled = enabled;
        self.masked = masked;
        if enabled && !was_enabled {
            if let Err(e) = self.group.enable() {
                log::error!("msi-x enable: {e}");
            }
        }
        for (v, b) in before.into_iter().enumerate() {
            self.sync_vector(v, b, false);
        }
        if !enabled && was_enabled {
            if let Err(e) = self.group.disable() {
                log::error!("msi-x disable: {e}");
            }
        }
    }

    /// Call after a guest config write at (`reg_idx`, `offset`, `len`): if it touched the
    /// Message Control of the MSI-X capability at `cap_offset`, applies it.
    pub fn handle_config_write(
        &mut self,
        config: &PciConfiguration,
        cap_offset: usize,
        reg_idx: usize,
        offset: u64,
        len: usize,
    ) {
        let start = reg_idx * 4 + offset as usize;
        let ctl = cap_offset + 2;
        if start < ctl + 2 && ctl < start + len {
            self.set_msg_ctl(MsixCap::from_config(config, cap_offset).msg_ctl);
        }
    }

    /// Guest read of the table at `offset` (4 or 8 bytes; others read as zero).
    pub fn read_table(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let vector = (offset / MSIX_TABLE_ENTRY_SIZE) as usize;
        let field = offset % MSIX_TABLE_ENTRY_SIZE;
        let Some(e) = self.table_entries.get(vector) else {
            log::debug!("msi-x table read past the end at {offset:#x}");
            return;
        };
        let words = [e.msg_addr_lo, e.msg_addr_hi, e.msg_data, e.vector_ctl];
        let i = (field / 4) as usize;
        match (data.len(), field % 4) {
            (4, 0) => data.copy_from_slice(&words[i].to_le_bytes()),
            (8, 0) if i % 2 == 0 => {
                let v = u64::from(words[i]) | u64::from(words[i + 1]) << 32;
                data.copy_from_slice(&v.to_le_bytes());
            }
            _ => log::debug!(
                "msi-x table read of {} bytes at {offset:#x} ignored",
                data.len()
            ),
        }
    }

    /// Guest write of the table at `offset` (4 or 8 bytes, naturally aligned).
    pub fn write_table(&mut self, offset: u64, data: &[u8]) {
        let vector = (offset / MSIX_TABLE_ENTRY_SIZE) as usize;
        let field = offset % MSIX_TABLE_ENTRY_SIZE;
        if vector >= self.vectors() {
            log::debug!("msi-x table write past the end at {offset:#x}");
            return;
        }
        let mut words: Vec<(usize, u32)> = Vec::with_capacity(2);
        let i = (field / 4) as usize;
        match (data.len(), field % 4) {
            (4, 0) => words.push((i, u32::from_le_bytes([data[0], data[1], data[2], data[3]]))),
            (8, 0) if i % 2 == 0 => {
                words.push((i, u32::from_le_bytes([data[0], data[1], data[2], data[3]])));
                words.push((
                    i + 1,
                    u32::from_le_bytes([data[4], data[5], data[6], data[7]]),
                ));
            }
            _ => {
                log::debug!(
                    "msi-x table write of {} bytes at {offset:#x} ignored",
                    data.len()
                );
                return;
            }
        }
        let before = self.is_vector_masked(vector);
        let old_msg = self.msg(vector);
        let e = &mut self.table_entries[vector];
        for (i, w) in words {
            match i {
                0 => e.msg_addr_lo = w,
                1 => e.msg_addr_hi = w,
                2 => e.msg_data = w,
                _ => e.vector_ctl = w & MSIX_VECTOR_CTL_MASK,
            }
        }
        let msg_changed = self.msg(vector) != old_msg;
        self.sync_vector(vector, before, msg_changed);
    }

    /// Guest read of the PBA at `offset` (4 or 8 bytes).
    pub fn read_pba(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let q = self
            .pba_entries
            .get((offset / MSIX_PBA_ENTRY_SIZE) as usize)
            .copied()
            .unwrap_or(0);
        let bytes = q.to_le_bytes();
        let start = (offset % MSIX_PBA_ENTRY_SIZE) as usize;
        match (data.len(), start) {
            (8, 0) | (4, 0) | (4, 4) => data.copy_from_slice(&bytes[start..start + data.len()]),
            _ => log::debug!(
                "msi-x pba read of {} bytes at {offset:#x} ignored",
                data.len()
            ),
        }
    }

    /// Guest write of the PBA: read-only, ignored.
    pub fn write_pba(&mut self, offset: u64, _data: &[u8]) {
        log::debug!("msi-x pba write at {offset:#x} ignored (read-only)");
    }

    /// Device-side interrupt for `vector`: injected now, or recorded in the PBA if masked.
    /// Returns true if it was injected. Ignored (false) while MSI-X is disabled.
    pub fn trigger(&mut self, vector: usize) -> bool {
        if vector >= self.vectors() || !self.enabled {
            log::debug!("msi-x vector {vector} trigger dropped (disabled or out of range)");
            return false;
        }
        if self.is_vector_masked(vector) {
            self.set_pending(vector, true);
            return false;
        }
        self.inject(vector);
        true
    }

    /// Back to power-on state: all vectors masked, PBA clear, MSI-X disabled.
    pub fn reset(&mut self) {
        let was_enabled = self.enabled;
        for v in 0..self.vectors() {
            let before = self.is_vector_masked(v);
            self.table_entries[v] = MsixTableEntry::default();
            if !before {
                self.route(v, true);
            }
        }
        self.pba_entries.fill(0);
        self.refusing.fill(false);
        self.enabled = false;
        self.masked = false;
        if was_enabled {
            if let Err(e) = self.group.disable() {
                log::error!("msi-x disable on reset: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::configuration::PciConfigurationParams;
    use crate::testing::{GroupCall, MockGroup};

    fn setup(vectors: u16) -> (Arc<MockGroup>, MsixConfig) {
        let group = Arc::new(MockGroup::new(u32::from(vectors)));
        let msix = MsixConfig::new(vectors, group.clone(), 0x18).unwrap();
        (group, msix)
    }

    fn program(msix: &mut MsixConfig, v: u64, addr: u64, data: u32, masked: bool) {
        let base = v * MSIX_TABLE_ENTRY_SIZE;
        msix.write_table(base, &addr.to_le_bytes());
        msix.write_table(base + 8, &data.to_le_bytes());
        msix.write_table(base + 12, &u32::from(masked).to_le_bytes());
    }

    fn msg(addr: u64, data: u32) -> MsiIrqSourceConfig {
        MsiIrqSourceConfig {
            high_addr: (addr >> 32) as u32,
            low_addr: addr as u32,
            data,
            devid: 0x18,
        }
    }

    fn pba(msix: &MsixConfig) -> u64 {
        let mut b = [0u8; 8];
        msix.read_pba(0, &mut b);
        u64::from_le_bytes(b)
    }

    #[test]
    fn cap_layout_and_hits() {
        let cap = MsixCap::new(70, 2, 0x1000, 2, 0x1800).unwrap();
        assert_eq!(cap.table_size(), 70);
        assert_eq!(cap.table_len(), 70 * 16);
        assert_eq!(cap.pba_len(), 16);
        assert_eq!(cap.table_hit(2, 0x1000), Some(0));
        assert_eq!(cap.table_hit(2, 0x1000 + 70 * 16 - 4), Some(70 * 16 - 4));
        assert_eq!(cap.table_hit(2, 0x1000 + 70 * 16), None);
        assert_eq!(cap.table_hit(0, 0x1000), None);
        assert_eq!(cap.table_hit(2, 0xffc), None);
        assert_eq!(cap.pba_hit(2, 0x1808), Some(8));
        assert_eq!(cap.pba_hit(2, 0x1810), None);
        let b = cap.to_bytes();
        assert_eq!(b[0], cap_id::MSIX);
        assert_eq!(u16::from_le_bytes([b[2], b[3]]), 69);
        assert_eq!(MsixCap::new(0, 0, 0, 0, 0), Err(MsixError::VectorCount(0)));
        assert!(matches!(
            MsixCap::new(4, 6, 0, 0, 0),
            Err(MsixError::Bir { .. })
        ));
        assert!(matches!(
            MsixCap::new(4, 0, 4, 0, 0),
            Err(MsixError::Offset { .. })
        ));
        let group = Arc::new(MockGroup::new(2));
        assert_eq!(
            MsixConfig::new(4, group, 0).unwrap_err(),
            MsixError::GroupTooSmall {
                group: 2,
                needed: 4
            }
        );
    }

    #[test]
    fn bogus_messages_are_never_routed_and_are_counted() {
        let (g, mut msix) = setup(4);
        msix.set_msg_ctl(MSIX_CTL_ENABLE);
        program(&mut msix, 0, 0xfee0_0000, 0x30, false);
        g.take();
        // Outside the MSI window, a non-zero upper address, reserved data bits, reserved
        // delivery modes: the vector is unrouted (masked at KVM), counted once each.
        let bogus: [(u64, u32); 5] = [
            (0xdead_0000, 0x31),
            (0x1_fee0_0000, 0x31),
            (0xfee0_0000, 0x1_0031),
            (0xfee0_0000, 0x331),
            (0xfee0_0000, 0x631),
        ];
        for (i, (addr, data)) in bogus.iter().enumerate() {
            program(&mut msix, 1, 0xfee0_0000, 0x31, true);
            g.take();
            program(&mut msix, 1, *addr, *data, false);
            let calls = g.take();
            assert!(
                !calls
                    .iter()
                    .any(|c| matches!(c, GroupCall::Update(1, _, false))),
                "{addr:#x}/{data:#x} routed: {calls:?}"
            );
            assert_eq!(msix.refused_messages(), i as u64 + 1);
            assert!(msix.is_vector_masked(1));
            // The guest still reads what it wrote.
            let mut q = [0u8; 8];
            msix.read_table(16, &mut q);
            assert_eq!(u64::from_le_bytes(q), *addr);
        }
        // A VMM-side trigger of the refused vector waits in the PBA; vector 0 still works.
        assert!(!msix.trigger(1));
        assert_eq!(pba(&msix), 0b10);
        assert!(msix.trigger(0));
        assert_eq!(g.take(), vec![GroupCall::Trigger(0)]);
        // A valid message routes it and delivers what was pending.
        msix.write_table(16, &0xfee0_0000u64.to_le_bytes());
        msix.write_table(24, &0x31u32.to_le_bytes());
        assert_eq!(
            g.take(),
            vec![
                GroupCall::Update(1, msg(0xfee0_0000, 0x31), false),
                GroupCall::Trigger(1)
            ]
        );
        assert_eq!(pba(&msix), 0);
        assert_eq!(msix.refused_messages(), 5);
        // Reserved messages on masked vectors or with MSI-X off are not refusals.
        program(&mut msix, 2, 0xdead_0000, 0x31, true);
        msix.set_msg_ctl(0);
        program(&mut msix, 3, 0xdead_0000, 0x31, false);
        assert_eq!(msix.refused_messages(), 5);
        assert!(msi_message_valid(0xfee0_1008, 0, 0x4041));
    }

    /// A message aimed at a local APIC that no vCPU has is refused and counted like any
    /// other invalid message; aimed at a vCPU the VM has, it routes.
    #[test]
    fn messages_to_missing_apic_ids_are_refused_and_counted() {
        let (g, mut msix) = setup(2);
        *g.apic_ids.lock().unwrap() = Some(2);
        msix.set_msg_ctl(MSIX_CTL_ENABLE);
        g.take();
        program(&mut msix, 0, 0xfee0_5000, 0x31, false);
        assert!(msix.is_vector_masked(0));
        assert_eq!(msix.refused_messages(), 1);
        assert!(
            !g.take()
                .iter()
                .any(|c| matches!(c, GroupCall::Update(0, _, false))),
            "APIC id 5 routed on a 2-vCPU VM"
        );
        assert!(!msix.trigger(0));
        assert_eq!(pba(&msix), 0b1);
        // Aimed at vCPU 1: routed, and the pending interrupt delivered.
        msix.write_table(0, &0xfee0_1000u64.to_le_bytes());
        assert_eq!(
            g.take(),
            vec![
                GroupCall::Update(0, msg(0xfee0_1000, 0x31), false),
                GroupCall::Trigger(0)
            ]
        );
        assert_eq!(msix.refused_messages(), 1);
    }

    #[test]
    fn table_reads_back_and_starts_masked() {
        let (_g, mut msix) = setup(4);
        let mut b = [0u8; 4];
        msix.read_table(12, &mut b);
        assert_eq!(u32::from_le_bytes(b), 1, "vectors start masked");
        program(&mut msix, 1, 0xfee0_1000, 0x41, true);
        msix.read_table(16, &mut b);
        assert_eq!(u32::from_le_bytes(b), 0xfee0_1000);
        let mut q = [0u8; 8];
        msix.read_table(24, &mut q);
        assert_eq!(u64::from_le_bytes(q), 0x1_0000_0041);
        // Unaligned / odd sizes ignored, past the end reads zero.
        msix.write_table(17, &[1, 2, 3, 4]);
        msix.read_table(16, &mut b);
        assert_eq!(u32::from_le_bytes(b), 0xfee0_1000);
        msix.read_table(4 * 16, &mut b);
        assert_eq!(b, [0; 4]);
        // Reserved vector-control bits are not stored.
        msix.write_table(12, &0xffff_fffeu32.to_le_bytes());
        msix.read_table(12, &mut b);
        assert_eq!(u32::from_le_bytes(b), 0);
    }

    #[test]
    fn host_mask_is_invisible_to_the_guest_and_loses_nothing() {
        let (g, mut msix) = setup(4);
        program(&mut msix, 0, 0xfee0_0000, 0x30, false);
        program(&mut msix, 1, 0xfee0_0000, 0x31, true);
        msix.set_msg_ctl(MSIX_CTL_ENABLE);
        g.take();
        // vm.pause: the guest-unmasked vector's route is detached (irqfd signals stay
        // pending in the eventfd); the guest-masked one is left alone.
        msix.set_host_masked(true);
        assert_eq!(
            g.take(),
            vec![GroupCall::Update(0, msg(0xfee0_0000, 0x30), true)]
        );
        assert!(msix.host_masked());
        // The guest's view is unchanged.
        assert!(!msix.masked());
        let mut b = [0u8; 4];
        msix.read_table(12, &mut b);
        assert_eq!(
            u32::from_le_bytes(b),
            0,
            "vector 0 still unmasked in the table"
        );
        // A VMM-side interrupt while paused is recorded, not injected.
        assert!(!msix.trigger(0));
        assert_eq!(pba(&msix), 0b1);
        assert!(g.take().is_empty());
        msix.set_host_masked(true);
        assert!(g.take().is_empty(), "idempotent");
        // vm.resume: route re-attached (KVM delivers what the irqfd holds) and the pending
        // PBA bit injected; vector 1 stays masked as the guest left it.
        msix.set_host_masked(false);
        assert_eq!(
            g.take(),
            vec![
                GroupCall::Update(0, msg(0xfee0_0000, 0x30), false),
                GroupCall::Trigger(0)
            ]
        );
        assert_eq!(pba(&msix), 0);
        assert!(msix.is_vector_masked(1));
    }

    #[test]
    fn mask_unmask_with_pending_bit_injection() {
        let (g, mut msix) = setup(4);
        program(&mut msix, 0, 0xfee0_0000, 0x30, false);
        program(&mut msix, 1, 0xfee0_0000, 0x31, true);
        // Disabled: no routing yet, and triggers are dropped.
        assert!(g.take().is_empty());
        assert!(!msix.trigger(0));
        assert_eq!(pba(&msix), 0);

        msix.set_msg_ctl(MSIX_CTL_ENABLE);
        assert_eq!(
            g.take(),
            vec![
                GroupCall::Enable,
                GroupCall::Update(0, msg(0xfee0_0000, 0x30), false)
            ]
        );
        assert!(msix.trigger(0));
        assert_eq!(g.take(), vec![GroupCall::Trigger(0)]);

        // Vector 1 masked: trigger sets its PBA bit only.
        assert!(!msix.trigger(1));
        assert!(g.take().is_empty());
        assert_eq!(pba(&msix), 0b10);
        // PBA is read-only.
        msix.write_pba(0, &[0; 8]);
        assert_eq!(pba(&msix), 0b10);
        // Unmask: route installed, pending interrupt injected, bit cleared.
        msix.write_table(16 + 12, &0u32.to_le_bytes());
        assert_eq!(
            g.take(),
            vec![
                GroupCall::Update(1, msg(0xfee0_0000, 0x31), false),
                GroupCall::Trigger(1)
            ]
        );
        assert_eq!(pba(&msix), 0);

        // Changing an unmasked vector's message updates its route.
        msix.write_table(16 + 8, &0x35u32.to_le_bytes());
        assert_eq!(
            g.take(),
            vec![GroupCall::Update(1, msg(0xfee0_0000, 0x35), false)]
        );

        // Function mask: every unmasked vector is masked; triggers go to the PBA.
        msix.set_msg_ctl(MSIX_CTL_ENABLE | MSIX_CTL_FUNCTION_MASK);
        assert_eq!(
            g.take(),
            vec![
                GroupCall::Update(0, msg(0xfee0_0000, 0x30), true),
                GroupCall::Update(1, msg(0xfee0_0000, 0x35), true)
            ]
        );
        assert!(msix.masked());
        assert!(!msix.trigger(0));
        assert_eq!(pba(&msix), 0b1);
        msix.set_msg_ctl(MSIX_CTL_ENABLE);
        assert_eq!(
            g.take(),
            vec![
                GroupCall::Update(0, msg(0xfee0_0000, 0x30), false),
                GroupCall::Trigger(0),
                GroupCall::Update(1, msg(0xfee0_0000, 0x35), false)
            ]
        );
        assert_eq!(pba(&msix), 0);

        // Disable: vectors masked, then the group disabled.
        msix.set_msg_ctl(0);
        let calls = g.take();
        assert_eq!(calls.last(), Some(&GroupCall::Disable));
        assert_eq!(calls.len(), 3);
        assert!(msix.is_vector_masked(0));

        // Reset: entries masked again.
        msix.set_msg_ctl(MSIX_CTL_ENABLE);
        g.take();
        msix.reset();
        assert!(!msix.enabled());
        assert!(msix.table_entry(0).unwrap().masked());
        assert_eq!(g.take().last(), Some(&GroupCall::Disable));
    }

    #[test]
    fn pending_bits_beyond_64_vectors() {
        let (g, mut msix) = setup(100);
        msix.set_msg_ctl(MSIX_CTL_ENABLE);
        assert!(!msix.trigger(99));
        let mut b = [0u8; 4];
        msix.read_pba(12, &mut b);
        assert_eq!(u32::from_le_bytes(b), 1 << (99 - 96));
        assert!(msix.is_pending(99));
        assert!(!msix.trigger(100), "out of range vector is dropped");
        program(&mut msix, 99, 0xfee0_0000, 0x99, false);
        assert_eq!(g.take().last(), Some(&GroupCall::Trigger(99)));
        assert!(!msix.is_pending(99));
    }

    #[test]
    fn message_control_through_config_space() {
        let (g, mut msix) = setup(2);
        let mut config = PciConfiguration::new(&PciConfigurationParams::default());
        let cap = MsixCap::new(2, 0, 0, 0, 0x800).unwrap();
        let off = cap.add_to(&mut config).unwrap();
        // Guest sets Enable | Function Mask with a 16-bit write to Message Control; the
        // read-only table size bits stay.
        config.write_config_register(off / 4, 2, &0xffffu16.to_le_bytes());
        msix.handle_config_write(&config, off, off / 4, 2, 2);
        assert!(msix.enabled() && msix.masked());
        assert_eq!(MsixCap::from_config(&config, off).msg_ctl, 0xc001);
        assert_eq!(g.take(), vec![GroupCall::Enable]);
        // A write elsewhere in the capability does not touch the state.
        config.write_config_register(off / 4 + 1, 0, &[0; 4]);
        msix.handle_config_write(&config, off, off / 4 + 1, 0, 4);
        assert!(msix.masked());
    }
}
