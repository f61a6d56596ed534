//! The generic hosting seam: what the lender needs to expose any emulated device.

use thiserror::Error;
use vmm_sys_util::eventfd::EventFd;

/// Errors of device construction and start.
#[derive(Debug, Error)]
pub enum DeviceError {
    /// The register memory handed in is too small for the register BAR.
    #[error("register memory of {got:#x} bytes is smaller than the {need:#x}-byte register bar")]
    RegisterMemoryTooSmall {
        /// Bytes provided.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// Opening or sizing the backing file failed.
    #[error("backing file {path}: {source}")]
    Backing {
        /// Path of the backing file.
        path: String,
        /// OS error.
        source: std::io::Error,
    },
    /// An OS resource (eventfd, thread) could not be created.
    #[error("{what}: {source}")]
    Os {
        /// What was being created.
        what: &'static str,
        /// OS error.
        source: std::io::Error,
    },
}

/// PCI identity of a function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciIdentity {
    /// Vendor id.
    pub vendor_id: u16,
    /// Device id.
    pub device_id: u16,
    /// Subsystem vendor id.
    pub subsystem_vendor_id: u16,
    /// Subsystem id.
    pub subsystem_id: u16,
    /// Base class (e.g. 0x01 mass storage).
    pub class: u8,
    /// Sub class (e.g. 0x08 non-volatile memory).
    pub subclass: u8,
    /// Programming interface (e.g. 0x02 NVMe).
    pub prog_if: u8,
    /// Revision id.
    pub revision: u8,
}

/// One memory BAR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarInfo {
    /// BAR index (0..=5; a 64-bit BAR also uses index + 1).
    pub index: u8,
    /// Size in bytes (power of two, at least 4 KiB).
    pub size: u64,
    /// 64-bit BAR.
    pub is_64bit: bool,
    /// Prefetchable.
    pub prefetchable: bool,
    /// True for the BAR backed by the device's [`crate::RegisterMemory`]; other BARs (MSI-X)
    /// are emulated by the borrower's VMM.
    pub register_memory: bool,
    /// Register-memory BARs only: the range whose writes are doorbells (see
    /// [`DoorbellRange`]). Writes outside it must reach the device through
    /// [`DeviceModel::bar_write`]; `None` means every write must.
    pub doorbells: Option<DoorbellRange>,
}

/// A range of a register BAR whose registers hold absolute values that the device reads when
/// notified (queue doorbells, plain parameter registers): storing a write into register
/// memory and then signalling [`DeviceModel::doorbell_event`] has exactly the effect of
/// [`DeviceModel::bar_write`], so a borrower may take that fast path. Writing the same value
/// twice, or two values before the worker runs, loses nothing the device would have acted on.
///
/// Registers outside the range are *control registers* (write-1-to-set/clear masks, enable
/// bits whose transitions matter, read-only registers): the worker only sees register memory
/// by diffing it against the values it last saw, which loses a write that does not change the
/// stored value (an INTMC write equal to the current mask) or that is undone before the worker
/// runs (CC.EN 1 -> 0 -> 1). Those writes must take the exact, synchronous `bar_write`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DoorbellRange {
    /// First byte, within the BAR.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl DoorbellRange {
    /// True when the access of `len` bytes at `offset` lies entirely inside the range.
    pub fn contains(&self, offset: u64, len: u64) -> bool {
        offset >= self.offset
            && offset
                .checked_add(len)
                .is_some_and(|end| end <= self.offset.saturating_add(self.len))
    }
}

/// Doorbells of a register BAR whose written value the device does not need right now (it
/// reads the value from a shadow buffer in host memory, e.g. NVMe shadow doorbells): a write
/// there is only a kick, so a borrower may turn it into a KVM ioeventfd on
/// [`DeviceModel::doorbell_event`] (the value is then lost, which is fine).
///
/// `generation` grows with every change of the set, so a borrower that sees the set through
/// several paths (a reply, an asynchronous event) keeps the newest. An empty `offsets`
/// means every doorbell needs its value again (e.g. after a controller reset).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KickDoorbells {
    /// Increases with every change.
    pub generation: u64,
    /// Register BAR the offsets are in.
    pub bar: u8,
    /// Offsets of 4-byte doorbell registers that are kick-only.
    pub offsets: Vec<u64>,
}

/// Called after the kick-only doorbells changed (see [`DeviceModel::set_kick_listener`]).
pub type KickListener = std::sync::Arc<dyn Fn() + Send + Sync>;

/// Where the MSI-X table and PBA are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsixInfo {
    /// Number of vectors.
    pub vectors: u16,
    /// BAR holding the table.
    pub table_bar: u8,
    /// Table offset within that BAR.
    pub table_offset: u32,
    /// BAR holding the PBA.
    pub pba_bar: u8,
    /// PBA offset within that BAR.
    pub pba_offset: u32,
}

/// What the lender needs to host an emulated device generically. Object safe.
pub trait DeviceModel: Send + Sync {
    /// Short name for logs ("nvme", "dmatest").
    fn name(&self) -> &str;
    /// PCI identity.
    fn identity(&self) -> PciIdentity;
    /// Memory BARs.
    fn bars(&self) -> Vec<BarInfo>;
    /// MSI-X layout, if the function has MSI-X.
    fn msix(&self) -> Option<MsixInfo>;
    /// INTx pin (1 = INTA .. 4 = INTD, 0 = none).
    fn intx_pin(&self) -> u8;
    /// The 256-byte config space (header + capability list: PM, MSI-X, PCIe with FLR), for
    /// the VMM to shadow.
    fn config_space(&self) -> [u8; 256];
    /// Eventfd to signal after storing a write into register memory (or to hand to KVM as an
    /// ioeventfd).
    fn doorbell_event(&self) -> &EventFd;
    /// Trapped read of `data.len()` (4 or 8) bytes at `offset` of BAR `bar`.
    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]);
    /// Trapped write: stores into register memory (with register semantics) and notifies.
    /// This is the exact path: every write takes effect, in order, even when it does not
    /// change the stored value (see [`DoorbellRange`]).
    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]);
    /// Start the worker thread(s). Idempotent.
    fn start(&self) -> Result<(), DeviceError>;
    /// Function-level reset: stop queues, wait for in-flight work, clear registers.
    fn reset(&self);
    /// INTx resample: the borrower's interrupt controller lowered the line after the guest's
    /// EOI. Re-check the interrupt condition and, if it is still pending, assert INTx again
    /// ([`crate::InterruptSink::set_intx`] with `true`). Default: nothing (no INTx).
    fn intx_resample(&self) {}
    /// Doorbell notifications received so far, over the model's life: the sum of the values
    /// read from [`DeviceModel::doorbell_event`] (each store + notify, KVM ioeventfd kick or
    /// exact doorbell [`DeviceModel::bar_write`] counts once, coalesced or not; the model's
    /// own wake-ups do not count). Exact once the worker has drained the eventfd. Default: 0
    /// (a model that does not count).
    fn doorbell_kicks(&self) -> u64 {
        0
    }
    /// The model's own counters over its life (monotonic), for the lender's metrics and
    /// `vm.counters`. Default: none counted.
    fn model_counters(&self) -> ModelCounters {
        ModelCounters::default()
    }
    /// `true`: stop fetching doorbells and descriptors (for the borrower's `vm.pause`): the
    /// worker finishes the pass it is in (commands already fetched complete, but their
    /// completions are posted only after resume) and returns here once it is stopped (or
    /// after a bound, logged). `false`: resume, taking up whatever was written meanwhile.
    /// [`DeviceModel::reset`] does not clear it and works on a quiesced model (the worker is
    /// parked between passes); a host that resets to end a pause resumes after the reset.
    /// Default: nothing.
    fn quiesce(&self, _stop: bool) {}
    /// Bus Master Enable of the function, as the host sets it around its DMA windows:
    /// `false` before the last window is unmapped (returns once the model issues no more
    /// DMA), `true` after a window is mapped again. Default: nothing (a model without a
    /// background worker does DMA only in calls the host makes).
    fn set_bus_master(&self, _enable: bool) {}
    /// For a hand-over of the device to another borrower: on a quiesced model, completes the
    /// work already fetched (its DMA done, its completions posted, their interrupts raised
    /// as the model raises them) and returns `true` once no DMA is in flight, `false` when
    /// `timeout` passed first or the model is not quiesced. Fetches nothing new. Default:
    /// `true` (a model without background work has nothing in flight).
    fn drain(&self, _timeout: std::time::Duration) -> bool {
        true
    }
    /// Doorbells that are currently kick-only (see [`KickDoorbells`]). Default: none ever.
    fn kick_doorbells(&self) -> KickDoorbells {
        KickDoorbells::default()
    }
    /// The generation of [`DeviceModel::kick_doorbells`], cheaply (polled by the lender).
    fn kick_generation(&self) -> u64 {
        self.kick_doorbells().generation
    }
    /// Calls `listener` (from the device's own threads) after every change of
    /// [`DeviceModel::kick_doorbells`], so the lender can tell the borrower at once; `None`
    /// removes it. Default: the set never changes, nothing to call.
    fn set_kick_listener(&self, listener: Option<KickListener>) {
        let _ = listener;
    }
    /// True when the device polls its doorbell range (polling mode): stores there need no
    /// notification, so a borrower may map those pages writable. Default: false.
    fn polls_doorbells(&self) -> bool {
        false
    }
    /// The part of register BAR `bar` that is plain memory another device may reach by
    /// peer-to-peer DMA, as (offset, length), page aligned. Peer writes land in the memory
    /// without passing [`DeviceModel::bar_write`], so registers must never be in it.
    /// Default: none.
    fn peer_memory(&self, _bar: u8) -> Option<(u64, u64)> {
        None
    }

    /// The BARs whose size the driver may choose (PCIe Resizable BAR): each with the sizes
    /// it offers and its current size. The lender builds the extended capability from
    /// this. Default: none.
    fn resizable_bars(&self) -> Vec<ResizableBar> {
        Vec::new()
    }

    /// Makes BAR `bar` `size` bytes (one of [`DeviceModel::resizable_bars`]' sizes). What
    /// the BAR holds beyond the new size is kept, not cleared: a GPU keeps its memory when
    /// its aperture shrinks. Default: refused.
    fn resize_bar(&self, bar: u8, size: u64) -> Result<(), DeviceError> {
        Err(DeviceError::InvalidConfig(format!(
            "bar {bar} of {} is not resizable (asked for {size:#x} bytes)",
            self.name()
        )))
    }
}

/// One BAR of a model that its driver may resize (see [`DeviceModel::resizable_bars`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResizableBar {
    /// BAR index.
    pub index: u8,
    /// Sizes offered, as the Resizable BAR capability encodes them: bit `n` is
    /// `1 MiB << n`.
    pub sizes: u64,
    /// Current size in bytes.
    pub current: u64,
}

impl ResizableBar {
    /// Whether `size` bytes is among the offered sizes.
    pub fn offers(&self, size: u64) -> bool {
        crate::rebar::size_index(size).is_some_and(|n| n < 64 && self.sizes & (1 << n) != 0)
    }
}

pub(crate) const CAP_PM: u8 = 0x40;
pub(crate) const CAP_MSIX: u8 = 0x50;
pub(crate) const CAP_PCIE: u8 = 0x60;

/// Build a type-0 config space with PM, MSI-X (if any) and PCIe (FLR capable) capabilities.
pub fn build_config_space(
    id: &PciIdentity,
    bars: &[BarInfo],
    msix: Option<&MsixInfo>,
    intx_pin: u8,
) -> [u8; 256] {
    let mut c = [0u8; 256];
    let put16 =
        |c: &mut [u8; 256], off: usize, v: u16| c[off..off + 2].copy_from_slice(&v.to_le_bytes());
    let put32 =
        |c: &mut [u8; 256], off: usize, v: u32| c[off..off + 4].copy_from_slice(&v.to_le_bytes());
    put16(&mut c, 0x00, id.vendor_id);
    put16(&mut c, 0x02, id.device_id);
    put16(&mut c, 0x06, 0x0010); // status: capability list
    c[0x08] = id.revision;
    c[0x09] = id.prog_if;
    c[0x0a] = id.subclass;
    c[0x0b] = id.class;
    for b in bars {
        let off = 0x10 + 4 * b.index as usize;
        if off + 4 > 0x28 {
            continue;
        }
        let mut v: u32 = 0;
        if b.is_64bit {
            v |= 0b100;
        }
        if b.prefetchable {
            v |= 0b1000;
        }
        put32(&mut c, off, v);
    }
    put16(&mut c, 0x2c, id.subsystem_vendor_id);
    put16(&mut c, 0x2e, id.subsystem_id);
    c[0x34] = CAP_PM;
    c[0x3d] = intx_pin;
    // Power management v3, D0 only, No_Soft_Reset.
    let pm = CAP_PM as usize;
    c[pm] = 0x01;
    c[pm + 1] = if msix.is_some() { CAP_MSIX } else { CAP_PCIE };
    put16(&mut c, pm + 2, 0x0003);
    put16(&mut c, pm + 4, 0x0008);
    if let Some(m) = msix {
        let x = CAP_MSIX as usize;
        c[x] = 0x11;
        c[x + 1] = CAP_PCIE;
        put16(&mut c, x + 2, m.vectors.saturating_sub(1) & 0x7ff);
        put32(&mut c, x + 4, m.table_offset | u32::from(m.table_bar));
        put32(&mut c, x + 8, m.pba_offset | u32::from(m.pba_bar));
    }
    // PCI Express capability v2, endpoint.
    let e = CAP_PCIE as usize;
    c[e] = 0x10;
    c[e + 1] = 0;
    put16(&mut c, e + 2, 0x0002);
    // Device capabilities: max payload 256 B, FLR (bit 28).
    put32(&mut c, e + 4, (1 << 28) | 0x1);
    // Device control: relaxed ordering, no snoop enabled, MPS 128, MRRS 512.
    put16(&mut c, e + 8, 0x2810);
    // Link capabilities: x4 Gen3, port 0; link status: x4 Gen3.
    put32(&mut c, e + 0x0c, (4 << 4) | 3);
    put16(&mut c, e + 0x12, (4 << 4) | 3);
    // Device capabilities 2: completion timeout disable supported.
    put32(&mut c, e + 0x24, 1 << 4);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_space_has_capability_chain() {
        let id = PciIdentity {
            vendor_id: 0x1b36,
            device_id: 0x0010,
            subsystem_vendor_id: 0x1af4,
            subsystem_id: 0x1100,
            class: 1,
            subclass: 8,
            prog_if: 2,
            revision: 2,
        };
        let bars = [BarInfo {
            index: 0,
            size: 0x4000,
            is_64bit: true,
            prefetchable: false,
            register_memory: true,
            doorbells: None,
        }];
        let m = MsixInfo {
            vectors: 8,
            table_bar: 4,
            table_offset: 0,
            pba_bar: 4,
            pba_offset: 0x800,
        };
        let c = build_config_space(&id, &bars, Some(&m), 1);
        assert_eq!(&c[0..4], &[0x36, 0x1b, 0x10, 0x00]);
        assert_eq!(&c[9..12], &[2, 8, 1]);
        assert_eq!(c[0x10] & 0b110, 0b100);
        let mut ids = vec![];
        let mut p = c[0x34] as usize;
        while p != 0 && ids.len() < 8 {
            ids.push(c[p]);
            p = c[p + 1] as usize;
        }
        assert_eq!(ids, vec![0x01, 0x11, 0x10]);
        let devcap = u32::from_le_bytes(c[0x64..0x68].try_into().unwrap());
        assert_ne!(devcap & (1 << 28), 0, "flr");
        assert_eq!(u16::from_le_bytes([c[0x52], c[0x53]]), 7);
        assert_eq!(u32::from_le_bytes(c[0x54..0x58].try_into().unwrap()), 4);
        assert_eq!(u32::from_le_bytes(c[0x58..0x5c].try_into().unwrap()), 0x804);
    }

    #[test]
    fn doorbell_range_contains_whole_accesses_only() {
        let r = DoorbellRange {
            offset: 0x1000,
            len: 0x3000,
        };
        assert!(r.contains(0x1000, 4));
        assert!(r.contains(0x3ff8, 8));
        assert!(!r.contains(0xffc, 8), "straddles the start");
        assert!(!r.contains(0x3ffc, 8), "straddles the end");
        assert!(!r.contains(0x14, 4));
        assert!(!r.contains(u64::MAX, 4));
    }
}

/// What a device model counts of the guest's use of it ([`DeviceModel::model_counters`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelCounters {
    /// Commands fetched.
    pub commands: u64,
    /// Doorbell writes refused for a value outside the queue.
    pub invalid_doorbells: u64,
    /// Commands refused for their PRPs.
    pub bad_prps: u64,
}
