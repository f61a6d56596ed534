//! Lent devices in a snapshot: saved as their lease identity plus the guest-visible PCI state
//! the VMM shadows (config header, BARs, MSI-X table and control), never their contents.
//!
//! Everything is read and written the way the guest does it: config space through the ECAM
//! window and the MSI-X table through its BAR, both on the VMM's MMIO bus. So a restore
//! goes through the same validated paths as guest accesses (BAR moves through the
//! `BarRelocator`, MSI-X messages checked before they become KVM routes and irqfds, Bus
//! Master Enable pinning guest RAM and mapping it for DMA on the lender) and needs nothing
//! from the device's internals.
//!
//! Restore order on a freshly borrowed and reset device: BARs (verified to decode where the
//! guest placed them), Command with Memory Space only (so the MSI-X table decodes), MSI-X
//! table entries, MSI-X control, the MSI capability (message, mask, then control), Interrupt
//! Line, then the saved Command (Bus Master Enable pins and maps guest RAM again).

use pci::{Bus, PciBdf};
use serde::{Deserialize, Serialize};

use super::SnapshotError;
use crate::layout::PCI_ECAM_START;

const PCI_CAP_ID_MSIX: u8 = 0x11;
const PCI_CAP_ID_MSI: u8 = 0x05;
/// MSI Message Control: 64-bit address, per-vector masking.
const MSI_CTL_64_BIT: u16 = 1 << 7;
const MSI_CTL_PER_VECTOR_MASK: u16 = 1 << 8;
const CMD_MEMORY: u32 = 1 << 1;
/// Registers of the type 0 header.
const REG_ID: usize = 0;
const REG_COMMAND: usize = 1;
const REG_CLASS: usize = 2;
const REG_BAR0: usize = 4;
const REG_CAP_PTR: usize = 13;
const REG_INTERRUPT: usize = 15;
/// The standard config space (64 dwords).
const CONFIG_DWORDS: usize = 64;

/// A lent device in a snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LentDevice {
    /// The VMM's device id (`vm.info`).
    pub id: String,
    /// The lease identity: lender node and the device's lender-local address (NODE:BDF).
    pub device: String,
    /// BAR access mode the device had (direct or trapped).
    pub mode: api::types::RemoteDeviceMode,
    /// Guest slot on bus 0 (guest BDF 0000:00:<slot>.0).
    pub slot: u8,
    /// The 64 dwords of config space as the guest read them (vendor/device and class
    /// identify the device kind; the BARs are the guest's addresses).
    pub config: Vec<u32>,
    /// The MSI-X capability, if the device has one.
    pub msix: Option<MsixShadow>,
}

/// The MSI-X state the guest programmed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsixShadow {
    /// Config offset of the capability.
    pub cap: u16,
    /// Message Control (enable, function mask).
    pub control: u16,
    /// Entries: message address low, high, data, vector control.
    pub table: Vec<[u32; 4]>,
}

/// The ECAM address of register `reg` of the function at `at` (its bus *number*, which
/// differs from the slot number's bus index behind switches: `pci::topology`).
fn ecam(at: PciBdf, reg: usize) -> u64 {
    PCI_ECAM_START + (u64::from(at.bus()) << 20) + (u64::from(at.device()) << 15) + (reg as u64) * 4
}

fn read32(bus: &Bus, addr: u64) -> Result<u32, SnapshotError> {
    let mut b = [0u8; 4];
    bus.read(addr, &mut b).map_err(|_| {
        SnapshotError::Mismatch(format!(
            "nothing answers a read at {addr:#x} on the MMIO bus"
        ))
    })?;
    Ok(u32::from_le_bytes(b))
}

fn write(bus: &Bus, addr: u64, data: &[u8]) -> Result<(), SnapshotError> {
    bus.write(addr, data).map_err(|_| {
        SnapshotError::Mismatch(format!(
            "nothing answers a write at {addr:#x} on the MMIO bus"
        ))
    })
}

fn config(bus: &Bus, at: PciBdf) -> Result<Vec<u32>, SnapshotError> {
    (0..CONFIG_DWORDS)
        .map(|r| read32(bus, ecam(at, r)))
        .collect()
}

/// The address BAR `i` decodes at (memory BARs; 0 for I/O or unused BARs), and whether it
/// is the low half of a 64-bit BAR.
fn bar(config: &[u32], i: usize) -> (u64, bool) {
    let lo = config[REG_BAR0 + i];
    if lo & 1 != 0 {
        return (0, false);
    }
    let is64 = (lo >> 1) & 3 == 2 && i < 5;
    let hi = if is64 {
        u64::from(config[REG_BAR0 + i + 1])
    } else {
        0
    };
    (u64::from(lo & !0xf) | hi << 32, is64)
}

/// Offset of the MSI-X capability in `config`.
fn msix_cap(config: &[u32]) -> Option<usize> {
    find_cap(config, PCI_CAP_ID_MSIX)
}

/// Offset of the first capability with `id` in `config`'s list (a loop or a pointer out of
/// the device-specific area ends the walk).
fn find_cap(config: &[u32], id: u8) -> Option<usize> {
    let byte = |off: usize| (config[off / 4] >> ((off % 4) * 8)) as u8;
    let mut off = usize::from(byte(REG_CAP_PTR * 4)) & !3;
    for _ in 0..48 {
        if !(0x40..CONFIG_DWORDS * 4).contains(&off) {
            return None;
        }
        if byte(off) == id {
            return Some(off);
        }
        off = usize::from(byte(off + 1)) & !3;
    }
    None
}

/// The config writes that program the MSI capability at `cap` as `config` has it, in the
/// order a driver uses: message address (low, then high if 64-bit), data, the per-vector
/// mask if there is one, and Message Control (enable, vectors enabled) last, so the device
/// builds its routes from the complete message. (byte offset, bytes) each.
fn msi_writes(config: &[u32], cap: usize) -> Vec<(usize, Vec<u8>)> {
    let dw = |off: usize| config[off / 4];
    let control = (dw(cap) >> 16) as u16;
    let is64 = control & MSI_CTL_64_BIT != 0;
    let data = if is64 { cap + 12 } else { cap + 8 };
    let mut w = vec![(cap + 4, dw(cap + 4).to_le_bytes().to_vec())];
    if is64 {
        w.push((cap + 8, dw(cap + 8).to_le_bytes().to_vec()));
    }
    w.push((data, (dw(data) as u16).to_le_bytes().to_vec()));
    if control & MSI_CTL_PER_VECTOR_MASK != 0 {
        w.push((data + 4, dw(data + 4).to_le_bytes().to_vec()));
    }
    w.push((cap + 2, control.to_le_bytes().to_vec()));
    w
}

/// Where the MSI-X table of `config` is: (address, entries).
fn msix_table(config: &[u32], cap: usize) -> Result<(u64, usize), SnapshotError> {
    let control = (config[cap / 4] >> 16) as u16;
    let entries = usize::from(control & 0x7ff) + 1;
    let t = config[cap / 4 + 1];
    let bir = (t & 7) as usize;
    if bir > 5 {
        return Err(SnapshotError::Mismatch(format!(
            "MSI-X table in BAR {bir}, which does not exist"
        )));
    }
    let (base, _) = bar(config, bir);
    if base == 0 {
        return Err(SnapshotError::Mismatch(format!(
            "MSI-X table in BAR {bir}, which is not placed"
        )));
    }
    Ok((base + u64::from(t & !7), entries))
}

/// Reads the guest-visible state of the lent device in `slot`, at `at` (VM paused).
pub fn save_lent(
    bus: &Bus,
    at: PciBdf,
    id: &str,
    device: String,
    mode: api::types::RemoteDeviceMode,
    slot: u8,
) -> Result<LentDevice, SnapshotError> {
    let config = config(bus, at)?;
    let msix = match msix_cap(&config) {
        None => None,
        Some(cap) => {
            let (table, entries) = msix_table(&config, cap)?;
            let mut t = Vec::with_capacity(entries);
            for e in 0..entries {
                let a = table + 16 * e as u64;
                t.push([
                    read32(bus, a)?,
                    read32(bus, a + 4)?,
                    read32(bus, a + 8)?,
                    read32(bus, a + 12)?,
                ]);
            }
            Some(MsixShadow {
                cap: cap as u16,
                control: (config[cap / 4] >> 16) as u16,
                table: t,
            })
        }
    };
    Ok(LentDevice {
        id: id.to_string(),
        device,
        mode,
        slot,
        config,
        msix,
    })
}

/// Puts the saved guest-visible state back onto the freshly borrowed, reset device in
/// `saved.slot` (before any vCPU runs).
///
/// `at` is the function's address; `refused_moves` counts the BAR moves the VMM refused
/// (a refused move leaves the register as the guest wrote it, so only the count tells).
pub fn replay_lent(
    bus: &Bus,
    at: PciBdf,
    saved: &LentDevice,
    refused_moves: &dyn Fn() -> u64,
) -> Result<(), SnapshotError> {
    let slot = at;
    let id = &saved.id;
    if saved.config.len() != CONFIG_DWORDS {
        return Err(SnapshotError::Mismatch(format!(
            "{id}: {} config dwords saved, expected {CONFIG_DWORDS}",
            saved.config.len()
        )));
    }
    let now = config(bus, slot)?;
    for (reg, what) in [(REG_ID, "vendor/device id"), (REG_CLASS, "class/revision")] {
        if now[reg] != saved.config[reg] {
            return Err(SnapshotError::Mismatch(format!(
                "{id} ({}): {what} is {:#010x}, the snapshot has {:#010x}: not the same kind \
                 of device",
                saved.device, now[reg], saved.config[reg]
            )));
        }
    }
    // BARs: the allocator usually hands out the same addresses again (same devices, same
    // order); a BAR that differs is moved as the guest would move it.
    let mut i = 0;
    while i < 6 {
        let (want, is64) = bar(&saved.config, i);
        let (have, _) = bar(&now, i);
        if want != have {
            // Only the last write's verdict counts: a 64-bit BAR's low half alone may name
            // an address the VMM refuses on the way (its high half is still the old one).
            let mut refused_before = refused_moves();
            write(
                bus,
                ecam(slot, REG_BAR0 + i),
                &saved.config[REG_BAR0 + i].to_le_bytes(),
            )?;
            if is64 {
                refused_before = refused_moves();
                write(
                    bus,
                    ecam(slot, REG_BAR0 + i + 1),
                    &saved.config[REG_BAR0 + i + 1].to_le_bytes(),
                )?;
            }
            let after = config(bus, slot)?;
            let (got, _) = bar(&after, i);
            if got != want || refused_moves() != refused_before {
                return Err(SnapshotError::Mismatch(format!(
                    "{id}: BAR {i} decodes at {got:#x}, the guest had it at {want:#x} (the \
                     move was refused)"
                )));
            }
            log::info!("{id}: BAR {i} moved from {have:#x} to the guest's {want:#x}");
        }
        i += if is64 { 2 } else { 1 };
    }
    let command = saved.config[REG_COMMAND] & 0xffff;
    write(
        bus,
        ecam(slot, REG_COMMAND),
        &((command & CMD_MEMORY) as u16).to_le_bytes(),
    )?;
    if let Some(m) = &saved.msix {
        let cap = usize::from(m.cap);
        if msix_cap(&now) != Some(cap) {
            return Err(SnapshotError::Mismatch(format!(
                "{id}: the MSI-X capability is not at {cap:#x} any more"
            )));
        }
        let (table, entries) = msix_table(&saved.config, cap)?;
        if entries != m.table.len() {
            return Err(SnapshotError::Mismatch(format!(
                "{id}: {} MSI-X entries saved, the capability says {entries}",
                m.table.len()
            )));
        }
        for (e, words) in m.table.iter().enumerate() {
            let a = table + 16 * e as u64;
            for (k, w) in words.iter().enumerate() {
                write(bus, a + 4 * k as u64, &w.to_le_bytes())?;
            }
        }
        // Message Control is the upper half of the capability's first dword.
        write(bus, ecam(slot, cap / 4) + 2, &m.control.to_le_bytes())?;
    }
    // Plain MSI lives in config space, which is saved whole: its message and control go back
    // through the device's config path like the guest's own writes (routes and irqfds).
    let msi = find_cap(&saved.config, PCI_CAP_ID_MSI);
    if let Some(cap) = msi {
        if find_cap(&now, PCI_CAP_ID_MSI) != Some(cap) {
            return Err(SnapshotError::Mismatch(format!(
                "{id}: the MSI capability is not at {cap:#x} any more"
            )));
        }
        for (off, bytes) in msi_writes(&saved.config, cap) {
            write(bus, ecam(slot, off / 4) + (off % 4) as u64, &bytes)?;
        }
    }
    write(
        bus,
        ecam(slot, REG_INTERRUPT),
        &[saved.config[REG_INTERRUPT] as u8],
    )?;
    write(
        bus,
        ecam(slot, REG_COMMAND),
        &(command as u16).to_le_bytes(),
    )?;
    log::info!(
        "{id}: guest PCI state re-applied at {slot} (command {command:#06x}{})",
        match &saved.msix {
            Some(m) => format!(
                ", {} MSI-X entries, control {:#06x}",
                m.table.len(),
                m.control
            ),
            None => String::new(),
        } + &match msi {
            Some(cap) => format!(", MSI control {:#06x}", saved.config[cap / 4] >> 16),
            None => String::new(),
        }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A type 0 header: 64-bit BAR0 at 0x1_0000_0000, 32-bit BAR2 at 0xc000_0000, an
    /// MSI-X capability at 0x50 (after a PM capability at 0x40) with 17 vectors, table at
    /// BAR2 + 0x2000.
    fn header() -> Vec<u32> {
        let mut c = vec![0u32; CONFIG_DWORDS];
        c[REG_ID] = 0x0010_1b36;
        c[REG_BAR0] = 0x0000_0004;
        c[REG_BAR0 + 1] = 0x1;
        c[REG_BAR0 + 2] = 0xc000_0000;
        c[REG_CAP_PTR] = 0x40;
        c[0x40 / 4] = 0x0003_5001; // PM, next 0x50
        c[0x50 / 4] = 0x8010_0011; // MSI-X, last, enabled, 17 vectors
        c[0x54 / 4] = 0x2000 | 2;
        c
    }

    #[test]
    fn bars_decode_32_and_64_bit_addresses() {
        let c = header();
        assert_eq!(bar(&c, 0), (0x1_0000_0000, true));
        assert_eq!(bar(&c, 2), (0xc000_0000, false));
        assert_eq!(bar(&c, 3), (0, false));
        let mut io = c.clone();
        io[REG_BAR0 + 3] = 0xc001;
        assert_eq!(bar(&io, 3), (0, false), "I/O BARs are not memory addresses");
    }

    /// Config space of slot 1 as plain memory on an ECAM range of a bus, recording writes.
    struct FakeConfig {
        bytes: Vec<u8>,
        writes: Vec<(usize, usize)>,
    }

    impl pci::BusDevice for FakeConfig {
        fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
            let o = offset as usize;
            data.copy_from_slice(&self.bytes[o..o + data.len()]);
        }
        fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
            let o = offset as usize;
            self.bytes[o..o + data.len()].copy_from_slice(data);
            self.writes.push((o, data.len()));
        }
    }

    /// A plain-MSI device is restored with its message and control: the capability's
    /// registers written back through config space, Message Control after the message.
    #[test]
    fn replay_restores_plain_msi_message_and_control() {
        let mut saved = vec![0u32; CONFIG_DWORDS];
        saved[REG_ID] = 0x0010_1b36;
        saved[REG_COMMAND] = 0x0006; // memory + bus master
        saved[REG_CAP_PTR] = 0x40;
        saved[0x40 / 4] = 0x0003_6001; // PM, next 0x60
                                       // MSI: enabled, 2 vectors enabled (MME 1) of 4, 64-bit, per-vector mask.
        saved[0x60 / 4] = 0x0000_0005 | (0x0193 << 16);
        saved[0x64 / 4] = 0xfee0_1000;
        saved[0x68 / 4] = 0;
        saved[0x6c / 4] = 0x0000_4041;
        saved[0x70 / 4] = 0x2;
        saved[REG_INTERRUPT] = 0x010b;
        assert_eq!(find_cap(&saved, PCI_CAP_ID_MSI), Some(0x60));
        assert_eq!(
            msi_writes(&saved, 0x60)
                .iter()
                .map(|(o, b)| (*o, b.len()))
                .collect::<Vec<_>>(),
            vec![(0x64, 4), (0x68, 4), (0x6c, 2), (0x70, 4), (0x62, 2)]
        );
        // The freshly borrowed, reset device: same capability list, MSI off and empty.
        let mut fresh = saved.clone();
        fresh[REG_COMMAND] = 0;
        fresh[0x60 / 4] = 0x0000_0005 | (0x0184 << 16);
        for r in [0x64, 0x68, 0x6c, 0x70] {
            fresh[r / 4] = 0;
        }
        let at = PciBdf::new(0, 1, 0);
        let (dev, bus) = fake_at(at, &fresh);
        let lent = lent_disk(1, saved.clone());
        replay_lent(&bus, at, &lent, &|| 0).unwrap();
        let d = dev.lock().unwrap();
        let now: Vec<u32> = d
            .bytes
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(&now[0x60 / 4..0x74 / 4], &saved[0x60 / 4..0x74 / 4]);
        assert_eq!(now[REG_COMMAND] & 0xffff, 0x0006);
        let control_at = d.writes.iter().position(|w| *w == (0x62, 2)).unwrap();
        let data_at = d.writes.iter().position(|w| *w == (0x6c, 2)).unwrap();
        assert!(
            data_at < control_at,
            "control before the message: {:?}",
            d.writes
        );
        // Bus Master comes last, after every interrupt register.
        assert_eq!(d.writes.last(), Some(&(4 * REG_COMMAND, 2)));

        // A device whose MSI capability moved is not the saved one.
        drop(d);
        let mut other = fresh.clone();
        other[0x40 / 4] = 0x0003_0001;
        dev.lock().unwrap().bytes = other.iter().flat_map(|d| d.to_le_bytes()).collect();
        let e = replay_lent(&bus, at, &lent, &|| 0).unwrap_err().to_string();
        assert!(e.contains("MSI capability"), "{e}");
    }

    /// A device whose config space is `config`, answering ECAM at `at` on a bus of its own.
    fn fake_at(at: PciBdf, config: &[u32]) -> (Arc<Mutex<FakeConfig>>, Bus) {
        let dev = Arc::new(Mutex::new(FakeConfig {
            bytes: config.iter().flat_map(|d| d.to_le_bytes()).collect(),
            writes: Vec::new(),
        }));
        let bus = Bus::new();
        bus.insert(dev.clone(), ecam(at, 0), 4 * CONFIG_DWORDS as u64)
            .unwrap();
        (dev, bus)
    }

    /// The saved state of a lent disk in `slot` whose config space was `config`.
    fn lent_disk(slot: u8, config: Vec<u32>) -> LentDevice {
        LentDevice {
            id: "disk0".into(),
            device: "node1:0000:82:00.0".into(),
            mode: api::types::RemoteDeviceMode::Direct,
            slot,
            config,
            msix: None,
        }
    }

    /// A BAR move the VMM refuses leaves the register as written: the replay hears of it
    /// from the refusal count and fails naming the BAR, rather than restoring a guest whose
    /// BAR decodes elsewhere.
    #[test]
    fn a_refused_bar_move_fails_the_replay() {
        let saved = header();
        let mut fresh = saved.clone();
        fresh[REG_BAR0 + 2] = 0xc001_0000;
        let at = PciBdf::new(1, 2, 0);
        let (dev, bus) = fake_at(at, &fresh);
        let lent = lent_disk(34, saved);
        let refused = std::cell::Cell::new(0u64);
        let count = || {
            // Every write of BAR 2 is refused: the count grows each time it is read after
            // one.
            let n = dev.lock().unwrap().writes.len() as u64;
            refused.set(n);
            n
        };
        let e = replay_lent(&bus, at, &lent, &count)
            .unwrap_err()
            .to_string();
        assert!(e.contains("BAR 2") && e.contains("refused"), "{e}");
        assert!(refused.get() >= 1);
    }

    #[test]
    fn msix_capability_is_found_through_the_list() {
        let c = header();
        assert_eq!(msix_cap(&c), Some(0x50));
        assert_eq!(msix_table(&c, 0x50).unwrap(), (0xc000_2000, 17));
        let mut none = c.clone();
        none[0x40 / 4] = 0x0003_0001; // PM is the last capability
        assert_eq!(msix_cap(&none), None);
        // A loop in the list ends.
        let mut looped = c.clone();
        looped[0x40 / 4] = 0x0003_4001;
        assert_eq!(msix_cap(&looped), None);
        // The table in an unplaced BAR is an error naming it.
        let mut unplaced = c;
        unplaced[0x54 / 4] = 0x2000 | 3;
        let e = msix_table(&unplaced, 0x50).unwrap_err().to_string();
        assert!(e.contains("BAR 3"), "{e}");
    }
}
