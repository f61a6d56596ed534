//! KVM binary statistics of the vCPUs (`KVM_GET_STATS_FD`, Linux 5.14+): VM exits, MMIO exits
//! to user space, port I/O exits, halt exits and the rest of KVM's per-vCPU counters, read
//! without debugfs (which is not readable on every host) and without stopping the vCPU.
//!
//! The fd's layout (Documentation/virt/kvm/api.rst, "KVM_GET_STATS_FD"): a header with the
//! number of descriptors and the offsets of the descriptors and the data; each descriptor
//! (16 bytes + `name_size` bytes of NUL-padded name) gives a statistic's type, size (in u64
//! values) and offset into the data block. The descriptors never change for an fd, so they are
//! read once; reading the values is one `pread` of the data block.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;

use kvm_ioctls::VcpuFd;
use thiserror::Error;
use vmm_sys_util::ioctl::ioctl;
use vmm_sys_util::ioctl_io_nr;

const KVMIO: u32 = 0xAE;
ioctl_io_nr!(KVM_GET_STATS_FD, KVMIO, 0xce);

/// `KVM_STATS_TYPE_*` (low 4 bits of a descriptor's flags).
const TYPE_MASK: u32 = 0xf;
const TYPE_CUMULATIVE: u32 = 0;
const HEADER_SIZE: usize = 24;
const DESC_SIZE: usize = 16;
/// Sanity bounds on what the kernel describes (it reports ~60 vCPU statistics).
const MAX_DESCS: u32 = 4096;
const MAX_NAME: u32 = 256;

/// Errors opening or reading a statistics fd.
#[derive(Debug, Error)]
pub enum StatsError {
    #[error("KVM_GET_STATS_FD on vCPU {vcpu}")]
    Open {
        vcpu: u8,
        #[source]
        source: std::io::Error,
    },
    #[error("reading the KVM statistics of vCPU {vcpu}")]
    Read {
        vcpu: u8,
        #[source]
        source: std::io::Error,
    },
    #[error("KVM statistics of vCPU {vcpu}: {what}")]
    Layout { vcpu: u8, what: String },
}

struct Stat {
    name: String,
    /// Offset of the value in the data block, in bytes.
    offset: usize,
}

/// One vCPU's statistics fd with its cumulative single-value statistics.
pub struct VcpuStats {
    vcpu: u8,
    file: File,
    data_offset: u64,
    data_len: usize,
    stats: Vec<Stat>,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut v = [0u8; 4];
    if let Some(s) = b.get(at..at + 4) {
        v.copy_from_slice(s);
    }
    u32::from_le_bytes(v)
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    let mut v = [0u8; 2];
    if let Some(s) = b.get(at..at + 2) {
        v.copy_from_slice(s);
    }
    u16::from_le_bytes(v)
}

impl VcpuStats {
    /// Opens the statistics fd of `fd` (vCPU `vcpu`) and reads its descriptors.
    pub fn open(fd: &VcpuFd, vcpu: u8) -> Result<Self, StatsError> {
        // SAFETY: KVM_GET_STATS_FD takes no argument and returns a new fd or -1; `fd` is a
        // valid vCPU fd for the duration of the call.
        let raw = unsafe { ioctl(fd, KVM_GET_STATS_FD()) };
        if raw < 0 {
            return Err(StatsError::Open {
                vcpu,
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: `raw` is a new fd the kernel just gave us and nobody else owns.
        let file = unsafe { File::from_raw_fd(raw) };
        Self::from_file(file, vcpu)
    }

    fn from_file(file: File, vcpu: u8) -> Result<Self, StatsError> {
        let layout = |what: String| StatsError::Layout { vcpu, what };
        let read = |source| StatsError::Read { vcpu, source };
        let mut header = [0u8; HEADER_SIZE];
        file.read_exact_at(&mut header, 0).map_err(read)?;
        let name_size = u32_at(&header, 4);
        let num_desc = u32_at(&header, 8);
        let desc_offset = u32_at(&header, 16);
        let data_offset = u32_at(&header, 20);
        if num_desc > MAX_DESCS || name_size > MAX_NAME {
            return Err(layout(format!(
                "{num_desc} descriptors with {name_size}-byte names is not plausible"
            )));
        }
        let desc_len = DESC_SIZE + name_size as usize;
        let mut descs = vec![0u8; desc_len * num_desc as usize];
        file.read_exact_at(&mut descs, u64::from(desc_offset))
            .map_err(read)?;
        let mut stats = Vec::new();
        let mut data_len = 0usize;
        for d in descs.chunks_exact(desc_len) {
            let flags = u32_at(d, 0);
            let size = u16_at(d, 6);
            let offset = u32_at(d, 8) as usize;
            let name_bytes = &d[DESC_SIZE..];
            let end = name_bytes
                .iter()
                .position(|b| *b == 0)
                .unwrap_or(name_bytes.len());
            let name = String::from_utf8_lossy(&name_bytes[..end]).into_owned();
            data_len = data_len.max(offset + usize::from(size) * 8);
            // Histograms and peak/instant values do not sum over vCPUs: keep the counters.
            if flags & TYPE_MASK == TYPE_CUMULATIVE && size == 1 && !name.is_empty() {
                stats.push(Stat { name, offset });
            }
        }
        if stats.is_empty() {
            return Err(layout("no cumulative statistics described".into()));
        }
        log::debug!("vCPU {vcpu}: {} KVM statistics", stats.len());
        Ok(VcpuStats {
            vcpu,
            file,
            data_offset: u64::from(data_offset),
            data_len,
            stats,
        })
    }

    /// Adds the current values to `into` (name → sum over the vCPUs read so far).
    pub fn add_to(&self, into: &mut BTreeMap<String, u64>) -> Result<(), StatsError> {
        let mut data = vec![0u8; self.data_len];
        self.file
            .read_exact_at(&mut data, self.data_offset)
            .map_err(|source| StatsError::Read {
                vcpu: self.vcpu,
                source,
            })?;
        for s in &self.stats {
            let mut v = [0u8; 8];
            if let Some(b) = data.get(s.offset..s.offset + 8) {
                v.copy_from_slice(b);
            }
            let e = into.entry(s.name.clone()).or_default();
            *e = e.saturating_add(u64::from_le_bytes(v));
        }
        Ok(())
    }

    /// The fd (for diagnostics).
    pub fn raw_fd(&self) -> i32 {
        self.file.as_raw_fd()
    }
}

/// Sums the statistics of every vCPU.
pub fn sum(stats: &[VcpuStats]) -> Result<BTreeMap<String, u64>, StatsError> {
    let mut out = BTreeMap::new();
    for s in stats {
        s.add_to(&mut out)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kvm_ioctls::Kvm;

    #[test]
    fn vcpu_statistics_name_the_exit_counters() {
        let kvm = Kvm::new().expect("/dev/kvm is required for the vmm tests");
        let vm = kvm.create_vm().unwrap();
        let vcpu = vm.create_vcpu(0).unwrap();
        let stats = VcpuStats::open(&vcpu, 0).unwrap();
        let values = sum(&[stats]).unwrap();
        for name in ["exits", "mmio_exits", "io_exits", "halt_exits"] {
            assert!(values.contains_key(name), "{name} missing: {values:?}");
        }
        // A vCPU that never ran has not exited.
        assert_eq!(values["exits"], 0);
    }

    #[test]
    fn implausible_layouts_are_refused() {
        let mut f = tempfile::tempfile().unwrap();
        use std::io::Write;
        let mut header = [0u8; HEADER_SIZE];
        header[8..12].copy_from_slice(&1_000_000u32.to_le_bytes());
        f.write_all(&header).unwrap();
        let e = VcpuStats::from_file(f, 3).err().unwrap();
        assert!(e.to_string().contains("vCPU 3"), "{e}");
    }
}
