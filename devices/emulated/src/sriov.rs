//! The SR-IOV extended capability of an emulated physical function (PCIe Base Spec 6.0,
//! 9.3.3, capability ID 0x0010), and the routing-ID arithmetic that places its virtual
//! functions.
//!
//! The capability is 0x40 bytes:
//!
//! | offset | size | register |
//! |---|---|---|
//! | 0x00 | 4 | extended capability header (ID 0x0010, version 1, next) |
//! | 0x04 | 4 | SR-IOV Capabilities |
//! | 0x08 | 2 | SR-IOV Control (bit 0 VF Enable, bit 3 VF MSE, bit 4 ARI Capable Hierarchy) |
//! | 0x0A | 2 | SR-IOV Status |
//! | 0x0C | 2 | InitialVFs |
//! | 0x0E | 2 | TotalVFs |
//! | 0x10 | 2 | NumVFs |
//! | 0x12 | 1 | Function Dependency Link |
//! | 0x14 | 2 | First VF Offset |
//! | 0x16 | 2 | VF Stride |
//! | 0x1A | 2 | VF Device ID |
//! | 0x1C | 4 | Supported Page Sizes |
//! | 0x20 | 4 | System Page Size |
//! | 0x24 | 24 | VF BAR0..VF BAR5 |
//! | 0x3C | 4 | VF Migration State Array Offset |
//!
//! An emulated PF's VFs exist from the start: the capability reads VF Enable and VF MSE set
//! and NumVFs = TotalVFs = InitialVFs, as on a host where the operator wrote `sriov_numvfs`
//! before lending. NumVFs is the lender's: nobody changes it while lenderd runs (a borrower
//! of the PF never sees this capability, see `lending::backend::config::extended`).

use thiserror::Error;

use crate::model::BarInfo;

/// Extended capability ID of SR-IOV.
pub const CAP_ID: u16 = 0x0010;
/// Size of the capability's registers.
pub const CAP_LEN: usize = 0x40;
/// SR-IOV Capabilities register.
pub const REG_CAPS: usize = 0x04;
/// SR-IOV Control register.
pub const REG_CTRL: usize = 0x08;
/// SR-IOV Status register.
pub const REG_STATUS: usize = 0x0a;
/// InitialVFs.
pub const REG_INITIAL_VFS: usize = 0x0c;
/// TotalVFs.
pub const REG_TOTAL_VFS: usize = 0x0e;
/// NumVFs.
pub const REG_NUM_VFS: usize = 0x10;
/// Function Dependency Link.
pub const REG_FUNC_DEP: usize = 0x12;
/// First VF Offset.
pub const REG_VF_OFFSET: usize = 0x14;
/// VF Stride.
pub const REG_VF_STRIDE: usize = 0x16;
/// VF Device ID.
pub const REG_VF_DEVICE_ID: usize = 0x1a;
/// Supported Page Sizes.
pub const REG_SUPPORTED_PAGE_SIZES: usize = 0x1c;
/// System Page Size.
pub const REG_SYSTEM_PAGE_SIZE: usize = 0x20;
/// VF BAR0 (VF BARn at + 4 * n).
pub const REG_VF_BAR0: usize = 0x24;
/// SR-IOV Control: VF Enable.
pub const CTRL_VF_ENABLE: u16 = 1 << 0;
/// SR-IOV Control: VF Memory Space Enable.
pub const CTRL_VF_MSE: u16 = 1 << 3;
/// Supported page sizes: 4 KiB, 8 KiB, 64 KiB, 256 KiB, 1 MiB, 4 MiB (the usual set).
pub const SUPPORTED_PAGE_SIZES: u32 = 0x553;

/// Errors of SR-IOV layout.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SriovError {
    /// A routing ID past bus 255.
    #[error(
        "virtual function {vf} of routing id {pf_rid:#06x} (offset {offset}, stride {stride}) \
         lies past bus 255"
    )]
    PastLastBus {
        /// The PF's routing ID.
        pf_rid: u16,
        /// VF number (1-based).
        vf: u16,
        /// First VF Offset.
        offset: u16,
        /// VF Stride.
        stride: u16,
    },
    /// VF number 0 or above NumVFs.
    #[error("virtual function {vf} is not in 1..={num_vfs}")]
    NoSuchVf {
        /// VF number asked for.
        vf: u16,
        /// NumVFs.
        num_vfs: u16,
    },
    /// Bad capability parameters.
    #[error("sr-iov capability: {0}")]
    Invalid(String),
}

/// What a PF's SR-IOV capability says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SriovCap {
    /// TotalVFs (= InitialVFs = NumVFs: the VFs exist from the start).
    pub total_vfs: u16,
    /// NumVFs.
    pub num_vfs: u16,
    /// First VF Offset: routing ID of VF 1 minus the PF's.
    pub first_vf_offset: u16,
    /// VF Stride: routing-ID distance between consecutive VFs.
    pub vf_stride: u16,
    /// VF Device ID.
    pub vf_device_id: u16,
    /// SR-IOV Control.
    pub control: u16,
    /// The VFs' BARs (type bits go into the VF BAR registers; VFs are lent as functions of
    /// their own, so their BARs are also in each VF's own header).
    pub vf_bars: Vec<BarInfo>,
}

impl SriovCap {
    /// A capability with `vfs` VFs enabled at `first_vf_offset` + `stride` steps.
    pub fn enabled(
        vfs: u16,
        first_vf_offset: u16,
        vf_stride: u16,
        vf_device_id: u16,
        vf_bars: Vec<BarInfo>,
    ) -> Result<SriovCap, SriovError> {
        if vfs == 0 {
            return Err(SriovError::Invalid("totalvfs is 0".into()));
        }
        if first_vf_offset == 0 {
            return Err(SriovError::Invalid(
                "first vf offset 0 would give vf 1 the pf's routing id".into(),
            ));
        }
        if vfs > 1 && vf_stride == 0 {
            return Err(SriovError::Invalid(format!(
                "vf stride 0 would give all {vfs} vfs one routing id"
            )));
        }
        Ok(SriovCap {
            total_vfs: vfs,
            num_vfs: vfs,
            first_vf_offset,
            vf_stride,
            vf_device_id,
            control: CTRL_VF_ENABLE | CTRL_VF_MSE,
            vf_bars,
        })
    }

    /// The capability's registers with `next` as the next-capability pointer.
    pub fn to_bytes(&self, next: u16) -> [u8; CAP_LEN] {
        let mut c = [0u8; CAP_LEN];
        let put16 =
            |c: &mut [u8; CAP_LEN], o: usize, v: u16| c[o..o + 2].copy_from_slice(&v.to_le_bytes());
        let put32 =
            |c: &mut [u8; CAP_LEN], o: usize, v: u32| c[o..o + 4].copy_from_slice(&v.to_le_bytes());
        put32(
            &mut c,
            0,
            u32::from(CAP_ID) | (1 << 16) | (u32::from(next & 0xffc) << 20),
        );
        put16(&mut c, REG_CTRL, self.control);
        put16(&mut c, REG_INITIAL_VFS, self.total_vfs);
        put16(&mut c, REG_TOTAL_VFS, self.total_vfs);
        put16(&mut c, REG_NUM_VFS, self.num_vfs);
        put16(&mut c, REG_VF_OFFSET, self.first_vf_offset);
        put16(&mut c, REG_VF_STRIDE, self.vf_stride);
        put16(&mut c, REG_VF_DEVICE_ID, self.vf_device_id);
        put32(&mut c, REG_SUPPORTED_PAGE_SIZES, SUPPORTED_PAGE_SIZES);
        // System page size 4 KiB (bit 0): VF BARs are 4 KiB aligned.
        put32(&mut c, REG_SYSTEM_PAGE_SIZE, 1);
        for b in &self.vf_bars {
            let at = REG_VF_BAR0 + 4 * usize::from(b.index);
            if at + 4 > REG_VF_BAR0 + 24 {
                continue;
            }
            let mut v = 0u32;
            if b.is_64bit {
                v |= 0b100;
            }
            if b.prefetchable {
                v |= 0b1000;
            }
            put32(&mut c, at, v);
        }
        c
    }

    /// Parses the capability from its registers (`bytes` starts at its header).
    pub fn parse(bytes: &[u8]) -> Result<SriovCap, SriovError> {
        if bytes.len() < CAP_LEN {
            return Err(SriovError::Invalid(format!(
                "{} bytes, the capability has {CAP_LEN}",
                bytes.len()
            )));
        }
        let r16 = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]);
        if r16(0) != CAP_ID {
            return Err(SriovError::Invalid(format!(
                "capability id {:#06x} is not {CAP_ID:#06x}",
                r16(0)
            )));
        }
        Ok(SriovCap {
            total_vfs: r16(REG_TOTAL_VFS),
            num_vfs: r16(REG_NUM_VFS),
            first_vf_offset: r16(REG_VF_OFFSET),
            vf_stride: r16(REG_VF_STRIDE),
            vf_device_id: r16(REG_VF_DEVICE_ID),
            control: r16(REG_CTRL),
            vf_bars: Vec::new(),
        })
    }

    /// Routing ID of VF `vf` (1-based, as the spec numbers them) of the PF at `pf_rid`.
    pub fn vf_routing_id(&self, pf_rid: u16, vf: u16) -> Result<u16, SriovError> {
        if vf == 0 || vf > self.num_vfs {
            return Err(SriovError::NoSuchVf {
                vf,
                num_vfs: self.num_vfs,
            });
        }
        vf_routing_id(pf_rid, self.first_vf_offset, self.vf_stride, vf)
    }
}

/// Routing ID (bus << 8 | device << 3 | function) of VF `vf` (1-based):
/// `pf_rid + first_vf_offset + (vf - 1) * stride` (PCIe Base Spec 9.3.3.9-10). Without ARI
/// the sum carries from function into device number and from device into bus number, as
/// plain arithmetic on the 16-bit routing ID does.
pub fn vf_routing_id(
    pf_rid: u16,
    first_vf_offset: u16,
    stride: u16,
    vf: u16,
) -> Result<u16, SriovError> {
    let past = || SriovError::PastLastBus {
        pf_rid,
        vf,
        offset: first_vf_offset,
        stride,
    };
    if vf == 0 {
        return Err(SriovError::NoSuchVf { vf, num_vfs: 0 });
    }
    let rid =
        u32::from(pf_rid) + u32::from(first_vf_offset) + u32::from(vf - 1) * u32::from(stride);
    u16::try_from(rid).map_err(|_| past())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bars() -> Vec<BarInfo> {
        vec![
            BarInfo {
                index: 0,
                size: 0x4000,
                is_64bit: true,
                prefetchable: false,
                register_memory: true,
                doorbells: None,
            },
            BarInfo {
                index: 4,
                size: 0x1000,
                is_64bit: false,
                prefetchable: false,
                register_memory: false,
                doorbells: None,
            },
        ]
    }

    #[test]
    fn capability_registers_sit_where_the_spec_puts_them() {
        let cap = SriovCap::enabled(4, 1, 1, 0x0010, bars()).unwrap();
        let b = cap.to_bytes(0x140);
        let r16 = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let r32 = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        // Header: ID 0x0010, version 1, next 0x140.
        assert_eq!(r32(0), 0x1401_0010);
        assert_eq!(r16(REG_CTRL), CTRL_VF_ENABLE | CTRL_VF_MSE);
        assert_eq!(r16(REG_STATUS), 0);
        assert_eq!(
            (r16(REG_INITIAL_VFS), r16(REG_TOTAL_VFS), r16(REG_NUM_VFS)),
            (4, 4, 4)
        );
        assert_eq!(b[REG_FUNC_DEP], 0);
        assert_eq!((r16(REG_VF_OFFSET), r16(REG_VF_STRIDE)), (1, 1));
        assert_eq!(r16(REG_VF_DEVICE_ID), 0x0010);
        assert_eq!(r32(REG_SUPPORTED_PAGE_SIZES), 0x553);
        assert_eq!(r32(REG_SYSTEM_PAGE_SIZE), 1);
        // VF BAR0 64-bit memory (takes VF BAR1 too), VF BAR4 32-bit memory.
        assert_eq!(r32(REG_VF_BAR0), 0b100);
        assert_eq!(r32(REG_VF_BAR0 + 16), 0);
        assert_eq!(r32(REG_CAPS), 0);
        assert_eq!(
            SriovCap::parse(&b).unwrap(),
            SriovCap {
                vf_bars: vec![],
                ..cap
            }
        );
    }

    #[test]
    fn vf_routing_ids_follow_offset_and_stride_and_carry() {
        // PF 82:00.0 (rid 0x8200), offset 1, stride 1: VFs 82:00.1 .. 82:00.7, 82:01.0.
        assert_eq!(vf_routing_id(0x8200, 1, 1, 1), Ok(0x8201));
        assert_eq!(vf_routing_id(0x8200, 1, 1, 7), Ok(0x8207));
        assert_eq!(vf_routing_id(0x8200, 1, 1, 8), Ok(0x8208)); // 82:01.0
                                                                // Intel-style offset 0x80 stride 2 from 03:00.0: VF 1 = 03:10.0, VF 2 = 03:10.2.
        assert_eq!(vf_routing_id(0x0300, 0x80, 2, 1), Ok(0x0380));
        assert_eq!(vf_routing_id(0x0300, 0x80, 2, 2), Ok(0x0382));
        // Carries into the next bus.
        assert_eq!(vf_routing_id(0x82f8, 8, 1, 1), Ok(0x8300));
        // Past bus 255: an error naming the VF.
        let e = vf_routing_id(0xfffe, 1, 1, 2).unwrap_err();
        assert_eq!(
            e,
            SriovError::PastLastBus {
                pf_rid: 0xfffe,
                vf: 2,
                offset: 1,
                stride: 1
            }
        );
        assert!(e.to_string().contains("virtual function 2"), "{e}");
        let cap = SriovCap::enabled(2, 1, 1, 0x10, bars()).unwrap();
        assert_eq!(cap.vf_routing_id(0x8200, 2), Ok(0x8202));
        assert_eq!(
            cap.vf_routing_id(0x8200, 3),
            Err(SriovError::NoSuchVf { vf: 3, num_vfs: 2 })
        );
        assert!(cap.vf_routing_id(0x8200, 0).is_err());
    }

    #[test]
    fn degenerate_layouts_are_refused() {
        assert!(SriovCap::enabled(0, 1, 1, 0x10, bars()).is_err());
        let e = SriovCap::enabled(2, 0, 1, 0x10, bars()).unwrap_err();
        assert!(e.to_string().contains("first vf offset 0"), "{e}");
        let e = SriovCap::enabled(2, 1, 0, 0x10, bars()).unwrap_err();
        assert!(e.to_string().contains("vf stride 0"), "{e}");
        assert!(SriovCap::enabled(1, 1, 0, 0x10, bars()).is_ok());
        assert!(SriovCap::parse(&[0u8; 8]).is_err());
        assert!(SriovCap::parse(&[0u8; CAP_LEN]).is_err());
    }
}
