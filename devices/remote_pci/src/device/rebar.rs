//! Resizable BAR: a guest driver picks a BAR's size through the capability's control
//! dword (Linux: `pci_resize_resource`, or sysfs `resourceN_resize`).
//!
//! The lender is the authority on what a function offers: the write goes to it, and the
//! control dword read back says whether it took (an emulated function resizes; one bound
//! to vfio-pci offers only its current size). When the size changed, the config write
//! returns a [`BarResize`] effect: the device manager makes the BAR's bus range and
//! reservation the new size ([`pci::DeviceRelocation::resize_bar`]), then
//! [`RemotePciDevice::rebar_applied`] re-makes the BAR's view (size mask, memslots, lazy
//! chunks, ioeventfds) at the new size. When the VMM has no room, the function is asked
//! to go back to the old size ([`RemotePciDevice::rebar_refused`]).
//!
//! Checked here before anything is forwarded, so that the lender never applies a size the
//! VMM cannot show: the new size must fit the lender's window for the BAR (a direct BAR)
//! and must keep the MSI-X table and PBA inside the BAR.

use emulated::rebar;
use log::{info, warn};
use pci::device::{human, BarResize, PciDeviceError};

use super::RemotePciDevice;
use crate::link::BarAccess;

impl RemotePciDevice {
    /// The Resizable BAR entry whose control dword holds config offset `abs`, if any.
    fn rebar_entry_at(&self, abs: usize) -> Option<rebar::Entry> {
        // Every forwarded config write asks: the capability is in extended space only.
        if abs < 0x100 {
            return None;
        }
        rebar::entries_in(&self.config.to_bytes())
            .into_iter()
            .find(|e| (e.ctrl_at()..e.ctrl_at() + 4).contains(&abs))
    }

    /// A guest write inside a Resizable BAR control dword (`Some` effects), or `None` when
    /// `abs` is elsewhere.
    pub(super) fn rebar_write(&mut self, abs: usize, data: &[u8]) -> Option<Vec<BarResize>> {
        let e = self.rebar_entry_at(abs)?;
        let at = e.ctrl_at();
        let mut ctrl = self.config.read_reg(at / 4).to_le_bytes();
        ctrl[abs - at..abs - at + data.len()].copy_from_slice(data);
        let asked = rebar::ctrl_size(u32::from_le_bytes(ctrl));
        let Some(i) = self.bars.iter().position(|b| b.remote.index == e.bar) else {
            self.rebar_log(format!("bar {} has no such bar; nothing resized", e.bar));
            return Some(Vec::new());
        };
        if asked != e.current {
            if let Err(why) = self.rebar_fits(i, asked) {
                self.rebar_log(format!(
                    "bar {} resize {} -> {} refused: {why}",
                    e.bar,
                    human(e.current),
                    human(asked)
                ));
                return Some(Vec::new());
            }
        }
        self.forward_and_refresh(abs, data);
        let now = rebar::ctrl_size(self.config.read_reg(at / 4));
        if now == self.bars[i].remote.size {
            if asked != now {
                self.rebar_log(format!(
                    "bar {} stays {}: the lender did not take {}",
                    e.bar,
                    human(now),
                    human(asked)
                ));
            }
            return Some(Vec::new());
        }
        Some(vec![BarResize {
            bar_idx: usize::from(e.bar),
            base: self.bars[i].placed,
            old_len: self.bars[i].remote.size,
            new_len: now,
            region_type: self.bars[i].region_type,
        }])
    }

    /// Why BAR `i` cannot be `size` bytes here, if it cannot.
    fn rebar_fits(&self, i: usize, size: u64) -> Result<(), String> {
        let b = &self.bars[i];
        if let BarAccess::Direct(w) = &b.remote.access {
            if size > w.len() {
                return Err(format!("the lender's window for it is {}", human(w.len())));
            }
        }
        let holes = self.msix_holes(usize::from(b.remote.index));
        if let Some(end) = holes.iter().map(|h| h.1).max().filter(|&e| e > size) {
            return Err(format!(
                "the msi-x table and pba reach {end:#x} bytes into it"
            ));
        }
        Ok(())
    }

    /// The VMM made room: the BAR is `rs.new_len` bytes at `base` from now on.
    pub(super) fn rebar_applied(&mut self, rs: &BarResize, base: u64) {
        let Some(i) = self
            .bars
            .iter()
            .position(|b| usize::from(b.remote.index) == rs.bar_idx)
        else {
            return;
        };
        if let Err(e) = self.config.resize_pci_bar(rs.bar_idx, rs.new_len, base) {
            warn!(
                "{}: bar {} of {:#x} bytes: {e}",
                self.id, rs.bar_idx, rs.new_len
            );
        }
        // Peers stop reaching the old range, the memslots go, then both come back at the
        // new size (the mapping is re-made even when the base stayed).
        self.p2p_moving.push(rs.bar_idx);
        self.sync_p2p(false);
        self.kicks.guards.clear();
        let b = &mut self.bars[i];
        b.ioevents.clear();
        b.slots.clear();
        b.lazy_pieces.clear();
        b.lazy_chunks.clear();
        b.mapped_at = None;
        b.remote.size = rs.new_len;
        b.placed = base;
        self.p2p_moving.retain(|&m| m != rs.bar_idx);
        self.sync_bar_mappings();
        info!(
            "{}: bar {} is {} at {base:#x} (was {})",
            self.id,
            rs.bar_idx,
            human(rs.new_len),
            human(rs.old_len)
        );
    }

    /// The VMM had no room for the new size: the function goes back to the old one.
    pub(super) fn rebar_refused(&mut self, rs: &BarResize, why: &PciDeviceError) {
        self.rebar_log(format!(
            "bar {} resize {} -> {} refused by the vmm: {why}; asking the lender for {} again",
            rs.bar_idx,
            human(rs.old_len),
            human(rs.new_len),
            human(rs.old_len)
        ));
        let Some(e) = rebar::entries_in(&self.config.to_bytes())
            .into_iter()
            .find(|e| usize::from(e.bar) == rs.bar_idx)
        else {
            return;
        };
        let at = e.ctrl_at();
        let ctrl = rebar::ctrl_with_size(self.config.read_reg(at / 4), rs.old_len);
        self.forward_and_refresh(at, &ctrl.to_le_bytes());
    }

    /// A refused or ignored resize: counted and logged rate-limited (a guest may repeat it).
    fn rebar_log(&mut self, what: String) {
        self.config_refused(format_args!("resizable {what}"));
    }
}
