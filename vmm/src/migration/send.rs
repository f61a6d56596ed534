//! The source side: dirty logging, precopy rounds, the final pass.

use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::VmFd;
use vm_memory::{GuestAddress, GuestMemoryBackend};

use super::protocol::{
    self, kind, Hello, MigrationError, MigrationUrl, Stream, MAX_RUN, PAGE_SIZE,
};
use crate::memory::GuestRam;
use crate::snapshot::devices::LentDevice;
use crate::snapshot::SnapshotSource;

/// Precopy stops iterating once a round finds at most this many dirty pages (1 MiB): the
/// rest goes in the final pass with the VM paused.
pub const CONVERGED_PAGES: u64 = 256;
/// Precopy gives up iterating after this many dirty rounds and pauses anyway (a guest that
/// dirties faster than the stream carries never converges).
pub const MAX_ROUNDS: u32 = 8;
/// Every read and write on the stream is bounded by this: a destination that stops
/// answering fails the migration instead of hanging the source.
pub const IO_TIMEOUT: Duration = Duration::from_secs(20);

/// How long a failed write waits for the destination's reason.
const REASON_TIMEOUT: Duration = Duration::from_secs(1);

/// KVM dirty logging on every guest RAM memslot; `Drop` turns it off again.
pub struct DirtyLog {
    vm: Arc<VmFd>,
    ram: Arc<GuestRam>,
    enabled: u32,
}

impl DirtyLog {
    /// Sets `KVM_MEM_LOG_DIRTY_PAGES` on RAM slots 0..n (slot i is RAM region i, see
    /// `Vm::build`). From here on KVM records every page a vCPU writes.
    pub fn enable(vm: Arc<VmFd>, ram: Arc<GuestRam>) -> Result<Self, MigrationError> {
        let slots = ram.regions().len() as u32;
        let mut log = Self {
            vm,
            ram,
            enabled: 0,
        };
        for slot in 0..slots {
            log.set(slot, KVM_MEM_LOG_DIRTY_PAGES)?;
            log.enabled = slot + 1;
        }
        Ok(log)
    }

    fn set(&self, slot: u32, flags: u32) -> Result<(), MigrationError> {
        let r = self.ram.regions()[slot as usize];
        let host = self
            .ram
            .memory()
            .get_host_address(GuestAddress(r.gpa))
            .map_err(|_| MigrationError::NoMapping { gpa: r.gpa })?;
        let region = kvm_userspace_memory_region {
            slot,
            flags,
            guest_phys_addr: r.gpa,
            memory_size: r.size,
            userspace_addr: host as u64,
        };
        // SAFETY: the same slot, address and size as `Vm::build` registered (only the flags
        // change); the mapping lives as long as `ram`, which outlives this value.
        unsafe { self.vm.set_user_memory_region(region) }.map_err(|source| MigrationError::Kvm {
            op: "KVM_SET_USER_MEMORY_REGION",
            slot,
            source,
        })
    }

    /// The pages written since the last call (KVM clears its bitmap as it hands it over),
    /// per RAM region: one bit per page.
    pub fn take(&self) -> Result<Vec<Vec<u64>>, MigrationError> {
        (0..self.enabled)
            .map(|slot| {
                let r = self.ram.regions()[slot as usize];
                self.vm
                    .get_dirty_log(slot, r.size as usize)
                    .map_err(|source| MigrationError::Kvm {
                        op: "KVM_GET_DIRTY_LOG",
                        slot,
                        source,
                    })
            })
            .collect()
    }
}

impl Drop for DirtyLog {
    fn drop(&mut self) {
        for slot in 0..self.enabled {
            if let Err(e) = self.set(slot, 0) {
                log::error!("turning dirty logging off: {e}");
            }
        }
    }
}

/// Runs of consecutive set bits of `bitmap` as (first page, pages), each at most
/// [`MAX_RUN`] bytes long.
pub fn dirty_runs(bitmap: &[u64]) -> Vec<(u64, u64)> {
    let max = MAX_RUN / PAGE_SIZE;
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (i, &word) in bitmap.iter().enumerate() {
        if word == 0 {
            continue;
        }
        for b in 0..64 {
            if word & (1 << b) == 0 {
                continue;
            }
            let page = i as u64 * 64 + b;
            match runs.last_mut() {
                Some((start, n)) if *start + *n == page && *n < max => *n += 1,
                _ => runs.push((page, 1)),
            }
        }
    }
    runs
}

/// One outgoing migration (connected, hello exchanged, the VM's shape sent).
pub struct Sender {
    stream: Stream,
    src: SnapshotSource,
    /// The destination's fabric identity (leases move to it).
    pub identity: protocol::Identity,
    /// Same-host fast path: the destination maps our guest RAM memfd; nothing is copied.
    pub local: bool,
    buf: Vec<u8>,
    /// Bytes of guest RAM sent so far.
    pub bytes: u64,
}

impl Sender {
    /// Connects to `url`, checks the destination speaks this protocol and sends the VM's
    /// shape (the destination builds an empty VM of it).
    /// `local`: the same-host fast path (unix urls only): the guest RAM memfd goes to the
    /// destination over SCM_RIGHTS instead of the pages. `lent_devices`: how many lent
    /// devices will be handed over (the destination faults its RAM in for them first).
    /// `auth`: the cluster secret and this node's name; the stream is authenticated first
    /// ([`super::auth`]: TLS on tcp, the peer's uid on unix, then the proofs), so nothing of
    /// the VM goes to a destination that did not prove the secret.
    pub fn connect(
        url: &MigrationUrl,
        src: SnapshotSource,
        local: bool,
        lent_devices: u32,
        auth: &super::auth::StreamAuth,
    ) -> Result<Self, MigrationError> {
        if local && !matches!(url, MigrationUrl::Unix(_)) {
            return Err(MigrationError::LocalNeedsUnix);
        }
        if matches!(url, MigrationUrl::Tcp(_)) && !auth.has_secret() {
            return Err(MigrationError::NoSecret);
        }
        let mut stream = protocol::connect(url, IO_TIMEOUT)?;
        stream
            .set_timeout(Some(IO_TIMEOUT))
            .map_err(|source| MigrationError::Io {
                step: "setting the stream timeout",
                source,
            })?;
        // Before anything is said (or the RAM memfd passed): the peer's user, then the
        // secret, which also proves the destination's name for the leases' tickets.
        stream.check_peer_user()?;
        let proven = super::auth::prove_source(&mut stream, auth)?;
        let hello = Hello {
            lent_devices,
            ..Hello::current()
        };
        protocol::write_json(&mut stream, kind::HELLO, "hello", &hello)?;
        protocol::read_answer(&mut stream, "waiting for the destination's hello")?;
        let step = "waiting for the destination's identity";
        let identity = match protocol::read_frame(&mut stream, step)? {
            protocol::Frame::Identity(i) => i,
            protocol::Frame::Refused(why) => return Err(MigrationError::Refused(why.reason)),
            f => {
                return Err(MigrationError::Unexpected {
                    step,
                    got: protocol::kind_of(&f),
                })
            }
        };
        if let Some(p) = proven {
            if p != identity {
                let name = |i: &protocol::Identity| {
                    format!(
                        "{}/{}",
                        i.node.as_deref().unwrap_or_default(),
                        i.vm.as_deref().unwrap_or_default()
                    )
                };
                return Err(MigrationError::IdentityChanged {
                    proved: name(&p),
                    named: name(&identity),
                });
            }
        }
        if local {
            use std::os::fd::AsRawFd;
            protocol::write_memfd(&mut stream, src.ram.memfd().as_raw_fd())?;
        }
        protocol::write_json(&mut stream, kind::CONFIG, "config", &src.config)?;
        protocol::read_answer(&mut stream, "waiting for the destination to build the vm")?;
        Ok(Self {
            stream,
            src,
            identity,
            local,
            buf: vec![0u8; MAX_RUN as usize],
            bytes: 0,
        })
    }

    /// Turns dirty logging on (the caller keeps the guard for the whole migration).
    pub fn dirty_log(&self) -> Result<DirtyLog, MigrationError> {
        DirtyLog::enable(self.src.vm.clone(), self.src.ram.clone())
    }

    fn send_run(&mut self, region: usize, page: u64, pages: u64) -> Result<(), MigrationError> {
        let r = self.src.ram.regions()[region];
        let len = (pages * PAGE_SIZE) as usize;
        let offset = r.file_offset + page * PAGE_SIZE;
        let buf = &mut self.buf[..len];
        self.src
            .ram
            .memfd()
            .read_exact_at(buf, offset)
            .map_err(|source| MigrationError::Ram { offset, source })?;
        if let Err(e) = protocol::write_memory(&mut self.stream, r.gpa + page * PAGE_SIZE, buf) {
            return Err(self.explain(e));
        }
        self.bytes += len as u64;
        Ok(())
    }

    /// A write failed: if the destination closed the stream after saying why (`REFUSED`),
    /// that reason is the better error; otherwise `e` stands.
    fn explain(&mut self, e: MigrationError) -> MigrationError {
        if !matches!(e, MigrationError::Io { .. } | MigrationError::Closed { .. }) {
            return e;
        }
        if self.stream.set_timeout(Some(REASON_TIMEOUT)).is_err() {
            return e;
        }
        match protocol::read_frame(&mut self.stream, "reading why the destination stopped") {
            Ok(protocol::Frame::Refused(why)) => MigrationError::Refused(why.reason),
            other => {
                log::warn!("the destination gave no reason: {other:?}");
                e
            }
        }
    }

    /// Sends every page of guest RAM (round 0); returns the page count.
    pub fn send_all(&mut self) -> Result<u64, MigrationError> {
        let mut pages = 0;
        for i in 0..self.src.ram.regions().len() {
            let total = self.src.ram.regions()[i].size / PAGE_SIZE;
            let mut p = 0;
            while p < total {
                let n = (total - p).min(MAX_RUN / PAGE_SIZE);
                self.send_run(i, p, n)?;
                p += n;
            }
            pages += total;
        }
        Ok(pages)
    }

    /// Sends the pages set in `dirty` (one bitmap per region); returns the page count.
    pub fn send_dirty(&mut self, dirty: &[Vec<u64>]) -> Result<u64, MigrationError> {
        let mut pages = 0;
        for (i, bitmap) in dirty.iter().enumerate() {
            for (page, n) in dirty_runs(bitmap) {
                self.send_run(i, page, n)?;
                pages += n;
            }
        }
        Ok(pages)
    }

    /// The final pass, VM paused: reads the vCPU and device state (this may complete an
    /// access the guest made, so it comes first), sends the pages dirtied since the last
    /// round, then the state document, and waits for the destination to acknowledge that
    /// it restored the VM. Returns the pages of the final pass. `paused`: the VM was paused
    /// before the migration and stays so on the destination.
    pub fn finish(
        &mut self,
        log: &DirtyLog,
        lent: Vec<LentDevice>,
        paused: bool,
    ) -> Result<u64, MigrationError> {
        let doc = self.save_state(lent)?;
        let pages = self.send_dirty(&log.take()?)?;
        self.send_state(
            protocol::VmState {
                doc,
                paused,
                handover: Vec::new(),
            },
            IO_TIMEOUT,
        )?;
        Ok(pages)
    }

    /// Reads the vCPU and device state (VM paused).
    pub fn save_state(
        &self,
        lent: Vec<LentDevice>,
    ) -> Result<crate::snapshot::format::VmSnapshot, MigrationError> {
        Ok(self.src.save_state(lent)?)
    }

    /// Sends the state document and waits, at most `restore_wait`, for the destination to
    /// acknowledge that it restored the VM (and took its lent devices over).
    pub fn send_state(
        &mut self,
        doc: protocol::VmState,
        restore_wait: Duration,
    ) -> Result<(), MigrationError> {
        if let Err(e) = protocol::write_json(&mut self.stream, kind::STATE, "state", &doc) {
            return Err(self.explain(e));
        }
        self.stream
            .set_timeout(Some(restore_wait.max(IO_TIMEOUT)))
            .map_err(|source| MigrationError::Io {
                step: "setting the stream timeout",
                source,
            })?;
        let r = protocol::read_answer(&mut self.stream, "waiting for the destination to restore");
        // Best effort: the stream's later steps are bounded as before.
        let _ = self.stream.set_timeout(Some(IO_TIMEOUT));
        r
    }

    /// Guest RAM (for merging a device's dirty pages).
    pub fn ram(&self) -> &GuestRam {
        &self.src.ram
    }
}

/// Sets in `dirty` (one bitmap per RAM region, as [`DirtyLog::take`]) the pages of guest
/// RAM a lent device wrote (IOVA = GPA); returns how many were set. Pages outside guest RAM
/// (none are mapped) are ignored.
pub fn merge_device_dirty(
    regions: &[crate::memory::RamRegion],
    dirty: &mut [Vec<u64>],
    d: &remote_pci::DeviceDirtyPages,
) -> u64 {
    let mut n = 0;
    for (w, &word) in d.bits.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            let b = u64::from(bits.trailing_zeros());
            bits &= bits - 1;
            let i = w as u64 * 64 + b;
            if i >= d.pages {
                break;
            }
            let gpa = d.iova + i * PAGE_SIZE;
            for (r, map) in regions.iter().zip(dirty.iter_mut()) {
                if gpa >= r.gpa && gpa < r.gpa + r.size {
                    let page = (gpa - r.gpa) / PAGE_SIZE;
                    let (word, bit) = ((page / 64) as usize, page % 64);
                    if map.len() <= word {
                        map.resize(word + 1, 0);
                    }
                    if map[word] & (1 << bit) == 0 {
                        map[word] |= 1 << bit;
                        n += 1;
                    }
                }
            }
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dirty_bits_become_bounded_runs() {
        assert!(dirty_runs(&[0, 0]).is_empty());
        assert_eq!(dirty_runs(&[0b1110_0001]), vec![(0, 1), (5, 3)]);
        // A run across a word boundary stays one run.
        assert_eq!(dirty_runs(&[1 << 63, 1]), vec![(63, 2)]);
        // All pages dirty: runs of MAX_RUN bytes.
        let per = MAX_RUN / PAGE_SIZE;
        let words = (2 * per as usize).div_ceil(64) + 1;
        let runs = dirty_runs(&vec![u64::MAX; words]);
        assert_eq!(runs[0], (0, per));
        assert_eq!(runs[1], (per, per));
        assert_eq!(runs.iter().map(|r| r.1).sum::<u64>(), words as u64 * 64);
    }

    #[test]
    fn device_dirty_pages_land_in_their_region_bitmap() {
        use crate::memory::RamRegion;
        let ram = [
            RamRegion {
                gpa: 0,
                size: 8 * PAGE_SIZE,
                file_offset: 0,
            },
            RamRegion {
                gpa: 0x1_0000_0000,
                size: 4 * PAGE_SIZE,
                file_offset: 8 * PAGE_SIZE,
            },
        ];
        let mut dirty = vec![vec![0u64; 1], vec![0u64; 1]];
        dirty[0][0] = 1 << 3;
        // Pages 2 and 3 of region 0 (3 already set), page 1 of region 1, one page past RAM.
        let d = remote_pci::DeviceDirtyPages {
            iova: 2 * PAGE_SIZE,
            pages: 3,
            bits: vec![0b011],
            whole_window: false,
        };
        assert_eq!(merge_device_dirty(&ram, &mut dirty, &d), 1);
        let d = remote_pci::DeviceDirtyPages {
            iova: 0x1_0000_0000,
            pages: 8,
            bits: vec![0b0001_0010],
            whole_window: false,
        };
        assert_eq!(merge_device_dirty(&ram, &mut dirty, &d), 1);
        assert_eq!(dirty, vec![vec![0b1100], vec![0b10]]);
    }
}
