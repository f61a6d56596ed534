//! PRP (physical region page) walking. Every access goes through [`DmaMemory`].

use super::spec::{status, PAGE_SIZE};
use crate::dma::DmaMemory;

/// One contiguous device-address range.
pub type Segment = (u64, usize);

/// Why a PRP walk failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrpError {
    /// The PRP list itself could not be read (IOMMU fault).
    Fault,
    /// An entry had a non-zero offset where the spec requires page alignment.
    Offset,
}

impl PrpError {
    /// NVMe status for this error.
    pub fn status(self) -> u16 {
        match self {
            PrpError::Fault => status::DATA_TRANSFER_ERROR,
            PrpError::Offset => status::PRP_OFFSET_INVALID,
        }
    }
}

fn push(segs: &mut Vec<Segment>, addr: u64, len: usize) {
    if let Some(last) = segs.last_mut() {
        if last.0.wrapping_add(last.1 as u64) == addr {
            last.1 += len;
            return;
        }
    }
    segs.push((addr, len));
}

/// Turn PRP1/PRP2 describing `len` bytes into merged segments. `len` is bounded by the
/// caller (MDTS), so the walk is bounded too.
pub fn segments(
    dma: &dyn DmaMemory,
    prp1: u64,
    prp2: u64,
    len: usize,
) -> Result<Vec<Segment>, PrpError> {
    let mut segs = Vec::new();
    if len == 0 {
        return Ok(segs);
    }
    if prp1 & 3 != 0 {
        return Err(PrpError::Offset);
    }
    let first = ((PAGE_SIZE - (prp1 & (PAGE_SIZE - 1))) as usize).min(len);
    push(&mut segs, prp1, first);
    let mut left = len - first;
    if left == 0 {
        return Ok(segs);
    }
    if left <= PAGE_SIZE as usize {
        if prp2 & (PAGE_SIZE - 1) != 0 {
            return Err(PrpError::Offset);
        }
        push(&mut segs, prp2, left);
        return Ok(segs);
    }
    // PRP2 points to a PRP list (may start at an offset within its page, qword aligned).
    if prp2 & 7 != 0 {
        return Err(PrpError::Offset);
    }
    let mut list = prp2;
    let max_entries = len.div_ceil(PAGE_SIZE as usize) + 8;
    let mut seen = 0usize;
    while left > 0 {
        let entries_in_page = ((PAGE_SIZE - (list & (PAGE_SIZE - 1))) / 8) as usize;
        let pages_left = left.div_ceil(PAGE_SIZE as usize);
        // The last slot of a list page chains to the next list if more entries remain.
        let (data_entries, chained) = if pages_left > entries_in_page {
            (entries_in_page - 1, true)
        } else {
            (pages_left, false)
        };
        let mut raw = vec![0u8; data_entries * 8 + if chained { 8 } else { 0 }];
        dma.read(list, &mut raw).map_err(|_| PrpError::Fault)?;
        for i in 0..data_entries {
            let e = u64::from_le_bytes(
                raw[i * 8..i * 8 + 8]
                    .try_into()
                    .map_err(|_| PrpError::Fault)?,
            );
            if e & (PAGE_SIZE - 1) != 0 {
                return Err(PrpError::Offset);
            }
            let n = left.min(PAGE_SIZE as usize);
            push(&mut segs, e, n);
            left -= n;
        }
        seen += data_entries + 1;
        if seen > max_entries {
            return Err(PrpError::Offset);
        }
        if chained {
            let next = u64::from_le_bytes(
                raw[data_entries * 8..data_entries * 8 + 8]
                    .try_into()
                    .map_err(|_| PrpError::Fault)?,
            );
            if next & 7 != 0 {
                return Err(PrpError::Offset);
            }
            list = next;
        }
    }
    Ok(segs)
}

/// Read the data described by `segs` into `buf` (its length is the segments' total).
pub fn gather(dma: &dyn DmaMemory, segs: &[Segment], buf: &mut [u8]) -> Result<(), PrpError> {
    let mut off = 0;
    for &(a, l) in segs {
        dma.read(a, &mut buf[off..off + l])
            .map_err(|_| PrpError::Fault)?;
        off += l;
    }
    Ok(())
}

/// Write `buf` to the places described by `segs`.
pub fn scatter(dma: &dyn DmaMemory, segs: &[Segment], buf: &[u8]) -> Result<(), PrpError> {
    let mut off = 0;
    for &(a, l) in segs {
        dma.write(a, &buf[off..off + l])
            .map_err(|_| PrpError::Fault)?;
        off += l;
    }
    Ok(())
}
