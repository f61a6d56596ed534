//! Controller Memory Buffer (NVMe 1.4, 3.1.11-12 and 3.1.14-15): memory in BAR0 that the host
//! may use for submission and completion queues, PRP lists and read/write data, so commands
//! and data need not cross the host's memory (and other devices can DMA into it).
//!
//! Layout: the CMB is the part of BAR0 from [`CMB_OFFSET`] (2 MiB, after the registers and
//! doorbells) for `cmb_size` bytes; BAR0 grows to the next power of two that holds it
//! ([`bar0_size`]). The 2 MiB offset and sizes of 2 MiB multiples let Linux's p2pdma map it
//! (it registers device memory in 2 MiB sub-sections).
//!
//! The NVMe 1.4 scheme (CAP.CMBS = 1): CMBLOC and CMBSZ read as 0 until the host sets
//! CMBMSC.CRE; the host then writes CMBMSC.CBA, the address *it* uses for the CMB (for a
//! lent device: the guest-physical address of BAR0 + offset, which only the guest knows),
//! and CMBMSC.CMSE. From then on every controller memory access whose address lies in
//! `[CBA, CBA + size)` goes to the CMB instead of the host (the IOMMU domain): queue entries,
//! PRP lists, data, completions, shadow doorbells alike. An access that only partly lies in
//! it, or that is not dword aligned, is refused like an access outside the DMA window.
//!
//! CMBMSC survives a controller reset (CC.EN 1 -> 0: Linux maps its CMB once and keeps its
//! queues there across resets); a function reset clears it and zeroes the buffer, so nothing
//! of one borrower's commands or data is left for the next.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::dma::{DmaFault, DmaMemory};
use crate::regs::RegisterMemory;

/// Offset of the CMB in BAR0.
pub const CMB_OFFSET: u64 = 2 << 20;
/// Smallest CMB.
pub const CMB_MIN: u64 = 2 << 20;
/// Largest CMB.
pub const CMB_MAX: u64 = 256 << 20;
/// CAP.CMBS: Controller Memory Buffer Supported (the NVMe 1.4 scheme).
pub const CAP_CMBS: u64 = 1 << 57;
/// CMBMSC.CRE: Capabilities Registers Enabled.
pub const CMBMSC_CRE: u64 = 1 << 0;
/// CMBMSC.CMSE: Controller Memory Space Enable.
pub const CMBMSC_CMSE: u64 = 1 << 1;
/// CMBMSC.CBA mask (4 KiB aligned).
pub const CMBMSC_CBA: u64 = !0xfff;
/// CMBSZ.SQS: submission queues may be in the CMB.
pub const CMBSZ_SQS: u32 = 1 << 0;
/// CMBSZ.CQS: completion queues may be in the CMB.
pub const CMBSZ_CQS: u32 = 1 << 1;
/// CMBSZ.LISTS: PRP lists may be in the CMB.
pub const CMBSZ_LISTS: u32 = 1 << 2;
/// CMBSZ.RDS: read data may be in the CMB.
pub const CMBSZ_RDS: u32 = 1 << 3;
/// CMBSZ.WDS: write data may be in the CMB.
pub const CMBSZ_WDS: u32 = 1 << 4;

/// BAR0's size for a CMB of `cmb_size` bytes (0: no CMB, the 16 KiB register BAR).
pub fn bar0_size(cmb_size: u64) -> u64 {
    if cmb_size == 0 {
        super::BAR0_SIZE
    } else {
        (CMB_OFFSET + cmb_size).next_power_of_two()
    }
}

/// Checks a CMB size: 0, or a power of two in [`CMB_MIN`]..=[`CMB_MAX`].
pub fn check_size(cmb_size: u64) -> Result<(), String> {
    if cmb_size == 0 || (cmb_size.is_power_of_two() && (CMB_MIN..=CMB_MAX).contains(&cmb_size)) {
        Ok(())
    } else {
        Err(format!(
            "cmb size {cmb_size:#x} is not a power of two from {CMB_MIN:#x} to {CMB_MAX:#x}"
        ))
    }
}

/// The CMB's state, shared by the controller (which applies CMBMSC writes) and the DMA path.
pub struct CmbState {
    size: u64,
    /// CMBMSC as last applied (CRE, CMSE, CBA).
    msc: AtomicU64,
    regs: Arc<dyn RegisterMemory>,
}

impl CmbState {
    /// A disabled CMB of `size` bytes in `regs` (BAR0's memory) at [`CMB_OFFSET`].
    pub fn new(size: u64, regs: Arc<dyn RegisterMemory>) -> Arc<CmbState> {
        Arc::new(CmbState {
            size,
            msc: AtomicU64::new(0),
            regs,
        })
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// CMBMSC as applied.
    pub fn msc(&self) -> u64 {
        self.msc.load(Ordering::Acquire)
    }

    /// Applies a CMBMSC value (CRE, CMSE, CBA; other bits ignored). CMSE needs CRE.
    pub fn set_msc(&self, v: u64) {
        let mut v = v & (CMBMSC_CRE | CMBMSC_CMSE | CMBMSC_CBA);
        if v & CMBMSC_CRE == 0 {
            v &= !CMBMSC_CMSE;
        }
        self.msc.store(v, Ordering::Release);
    }

    /// CMBLOC: BAR0 (BIR 0), offset in 4 KiB units; 0 until CRE.
    pub fn cmbloc(&self) -> u32 {
        if self.msc() & CMBMSC_CRE == 0 {
            return 0;
        }
        ((CMB_OFFSET >> 12) as u32) << 12
    }

    /// CMBSZ: SQS, CQS, LISTS, RDS, WDS, size in 4 KiB units (SZU 0); 0 until CRE.
    pub fn cmbsz(&self) -> u32 {
        if self.msc() & CMBMSC_CRE == 0 {
            return 0;
        }
        let units = (self.size >> 12) as u32;
        (units << 12) | CMBSZ_SQS | CMBSZ_CQS | CMBSZ_LISTS | CMBSZ_RDS | CMBSZ_WDS
    }

    /// Where `[addr, addr + len)` lies: `None` outside the CMB (or CMB decoding off),
    /// `Some(Ok(offset in BAR0))` wholly inside and dword aligned, `Some(Err(()))` partly
    /// inside or misaligned (refused).
    fn route(&self, addr: u64, len: usize) -> Option<Result<u64, ()>> {
        let msc = self.msc();
        if msc & CMBMSC_CMSE == 0 || len == 0 {
            return None;
        }
        let base = msc & CMBMSC_CBA;
        let end = base.saturating_add(self.size);
        let last = addr.saturating_add(len as u64);
        if last <= base || addr >= end {
            return None;
        }
        if addr < base || last > end || !addr.is_multiple_of(4) || !len.is_multiple_of(4) {
            return Some(Err(()));
        }
        Some(Ok(CMB_OFFSET + (addr - base)))
    }

    /// Zeroes the buffer (function reset: nothing is left for the next user); shared memory
    /// gives its pages back rather than being written over (`RegisterMemory::zero_bytes`).
    pub fn clear(&self) {
        if !self.regs.zero_bytes(CMB_OFFSET, self.size) {
            log::warn!("nvme cmb: the buffer is outside the register memory; not cleared");
        }
    }
}

/// The controller's DMA: CMB addresses go to the buffer, everything else to `host`.
pub struct CmbDma {
    /// The host side (the lender's IOMMU domain).
    pub host: Arc<dyn DmaMemory>,
    /// The CMB.
    pub cmb: Arc<CmbState>,
}

impl DmaMemory for CmbDma {
    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaFault> {
        match self.cmb.route(iova, buf.len()) {
            None => self.host.read(iova, buf),
            Some(Err(())) => Err(DmaFault::read(iova, buf.len())),
            Some(Ok(off)) => {
                for (i, w) in buf.chunks_exact_mut(4).enumerate() {
                    w.copy_from_slice(&self.cmb.regs.read32(off + 4 * i as u64).to_le_bytes());
                }
                Ok(())
            }
        }
    }

    fn write(&self, iova: u64, buf: &[u8]) -> Result<(), DmaFault> {
        match self.cmb.route(iova, buf.len()) {
            None => self.host.write(iova, buf),
            Some(Err(())) => Err(DmaFault::write(iova, buf.len())),
            Some(Ok(off)) => {
                for (i, w) in buf.chunks_exact(4).enumerate() {
                    let v = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                    self.cmb.regs.write32(off + 4 * i as u64, v);
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::regs::HeapRegisters;

    struct NoHost;
    impl DmaMemory for NoHost {
        fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaFault> {
            Err(DmaFault::read(iova, buf.len()))
        }
        fn write(&self, iova: u64, buf: &[u8]) -> Result<(), DmaFault> {
            Err(DmaFault::write(iova, buf.len()))
        }
    }

    #[test]
    fn registers_routing_and_refusals() {
        assert_eq!(bar0_size(0), 0x4000);
        assert_eq!(bar0_size(2 << 20), 4 << 20);
        assert_eq!(bar0_size(4 << 20), 8 << 20);
        assert!(check_size(0).is_ok() && check_size(2 << 20).is_ok());
        assert!(check_size(256 << 20).is_ok());
        for bad in [4096, 3 << 20, 512 << 20, 1 << 20] {
            let e = check_size(bad).unwrap_err();
            assert!(e.contains(&format!("{bad:#x}")), "{e}");
        }
        let regs = Arc::new(HeapRegisters::new(4 << 20));
        let cmb = CmbState::new(2 << 20, regs.clone());
        let dma = CmbDma {
            host: Arc::new(NoHost),
            cmb: cmb.clone(),
        };
        // Before CRE: CMBLOC/CMBSZ read 0; CMSE without CRE is ignored.
        assert_eq!((cmb.cmbloc(), cmb.cmbsz()), (0, 0));
        cmb.set_msc(CMBMSC_CMSE | 0x8000_0000);
        assert_eq!(cmb.msc() & CMBMSC_CMSE, 0);
        cmb.set_msc(CMBMSC_CRE);
        assert_eq!(cmb.cmbloc(), 0x0020_0000, "bir 0, offset 512 x 4 KiB");
        assert_eq!(cmb.cmbsz(), (512 << 12) | 0x1f);
        // Not decoding yet: goes to the host.
        assert!(dma.write(0x8000_0000, &[1; 4]).is_err());
        let cba = 0x8000_0000u64;
        cmb.set_msc(CMBMSC_CRE | CMBMSC_CMSE | cba);
        dma.write(cba + 0x1000, &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
        assert_eq!(regs.read64(CMB_OFFSET + 0x1000), 0x0807_0605_0403_0201);
        let mut b = [0u8; 8];
        dma.read(cba + 0x1000, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3, 4, 5, 6, 7, 8]);
        // The last dword, and one past it (the host's).
        dma.write(cba + (2 << 20) - 4, &[9; 4]).unwrap();
        assert!(dma.write(cba + (2 << 20), &[9; 4]).is_err());
        // Straddling either end, or misaligned: refused.
        assert!(dma.write(cba + (2 << 20) - 4, &[9; 8]).is_err());
        assert!(dma.read(cba - 4, &mut [0; 8]).is_err());
        assert!(dma.read(cba + 2, &mut [0; 4]).is_err());
        assert!(dma.read(cba, &mut [0; 6]).is_err());
        cmb.clear();
        assert_eq!(regs.read64(CMB_OFFSET + 0x1000), 0);
    }
}
