//! Snapshot and restore of a whole VM: `vm.snapshot {"destination_url"}` and
//! `lendvm --restore source_url`.
//!
//! A snapshot is a directory ([`format`]): `state.json` with the format name and version, the
//! lendvm version, the machine's shape, the KVM state of the VM and of every vCPU ([`kvm`])
//! and the VMM-side device state (each device hands it out through
//! [`pci::Snapshottable`]), plus one raw file per guest RAM region.
//!
//! Saving needs the VM paused (the control plane pauses it and resumes it afterwards, see
//! `Controller::snapshot`): the vCPU threads, parked outside `KVM_RUN`, read their own
//! state ([`crate::vcpu::VcpuControl::run_on_parked`]); RAM is copied from the memfd.
//! Restoring builds a VM of the same shape without loading a kernel, puts the state back
//! before any vCPU runs, and leaves the vCPUs parked: the restored VM starts paused.
//!
//! Lent devices are saved as their lease identity and guest-visible PCI state
//! ([`devices`]); a restore re-borrows each one, has the lender reset it and re-applies that
//! state. A snapshot is therefore a crash-consistent point for them (see
//! docs/ARCHITECTURE.md, "Life of a snapshot and restore").

pub mod devices;
pub mod format;
pub mod kvm;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use acpi::PciHotplugController;
use kvm_ioctls::{VcpuFd, VmFd};
use pci::{RestoreError, Snapshottable};

use crate::device_manager::DeviceManager;
use crate::memory::GuestRam;
use crate::vcpu::{VcpuControl, VcpuError};
use format::{DeviceStates, FormatError, Header, MachineConfig, RamFile, VmSnapshot};
use kvm::{KvmCaps, KvmStateError};

/// How long the parked vCPU threads get to hand over their state.
const VCPU_SAVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of taking or restoring a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error(transparent)]
    Kvm(#[from] KvmStateError),
    #[error("reading the vCPUs' state")]
    Vcpu(#[from] VcpuError),
    #[error("restoring device state")]
    Device(#[from] RestoreError),
    #[error("the snapshot does not fit this VM: {0}")]
    Mismatch(String),
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Reads a file at increasing offsets (guest RAM through the memfd, without moving a shared
/// file position).
struct ReadAt<'a> {
    file: &'a File,
    offset: u64,
}

impl std::io::Read for ReadAt<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.file.read_at(buf, self.offset)?;
        self.offset += n as u64;
        Ok(n)
    }
}

/// Writes a file at increasing offsets.
struct WriteAt<'a> {
    file: &'a File,
    offset: u64,
}

impl std::io::Write for WriteAt<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write_at(buf, self.offset)?;
        self.offset += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What a snapshot reads from a running VM (built by `Vm::snapshot_source`).
#[derive(Clone)]
pub struct SnapshotSource {
    pub vm: Arc<VmFd>,
    pub ram: Arc<GuestRam>,
    pub vcpus: Arc<VcpuControl>,
    pub devices: Arc<DeviceManager>,
    pub hotplug: Arc<Mutex<PciHotplugController>>,
    pub caps: Arc<KvmCaps>,
    pub config: MachineConfig,
}

/// What a finished snapshot wrote.
#[derive(Clone, Debug)]
pub struct Saved {
    pub dir: PathBuf,
    pub ram_bytes: u64,
}

impl SnapshotSource {
    /// Writes a snapshot of the paused VM into `dir` (already prepared with
    /// [`format::prepare_destination`]). On failure the files written so far are removed.
    /// `lent` are the lent devices' states, read by the control plane (which owns them).
    pub fn save(&self, dir: &Path, lent: Vec<devices::LentDevice>) -> Result<Saved, SnapshotError> {
        let r = self.save_inner(dir, lent);
        if r.is_err() {
            format::remove_partial(dir, self.ram.regions().len());
        }
        r
    }

    /// The VM's state without its RAM (VM paused): every vCPU (read on its own thread), the
    /// in-kernel irqchip, PIT and clock, and the VMM-side devices. `memory` is left empty.
    /// Live migration sends this after the RAM it streamed.
    pub fn save_state(&self, lent: Vec<devices::LentDevice>) -> Result<VmSnapshot, SnapshotError> {
        let caps = self.caps.clone();
        let vcpus = self
            .vcpus
            .run_on_parked(
                move |id, fd: &mut VcpuFd| kvm::save_vcpu(fd, id, &caps),
                VCPU_SAVE_TIMEOUT,
            )?
            .into_iter()
            .collect::<Result<Vec<_>, _>>()?;
        let vm = kvm::save_vm(&self.vm)?;
        // The vCPUs are parked: the serial's partial last line goes out now, while this
        // process still owns the console. Held back, it would be written after the
        // destination had appended the rest of that line, and the line would be split.
        self.devices.flush_serial();
        let devices = {
            let hp = lock(&self.hotplug);
            DeviceStates {
                serial: self.devices.serial().map(|s| lock(s).snapshot()),
                ged: hp.ged().snapshot(),
                hotplug: hp.snapshot(),
                lent,
            }
        };
        Ok(VmSnapshot {
            header: Header::current(),
            config: self.config.clone(),
            memory: Vec::new(),
            vm,
            vcpus,
            devices,
        })
    }

    fn save_inner(
        &self,
        dir: &Path,
        lent: Vec<devices::LentDevice>,
    ) -> Result<Saved, SnapshotError> {
        let t0 = Instant::now();
        let mut doc = self.save_state(lent)?;
        let mut memory = Vec::new();
        let mut ram_bytes = 0;
        for (i, r) in self.ram.regions().iter().enumerate() {
            let name = format::ram_file_name(i);
            let mut src = ReadAt {
                file: self.ram.memfd(),
                offset: r.file_offset,
            };
            let crc32 = format::write_ram_file(dir, &name, &mut src, r.size)?;
            ram_bytes += r.size;
            memory.push(RamFile {
                gpa: r.gpa,
                size: r.size,
                file: name,
                crc32,
            });
        }
        doc.memory = memory;
        format::write_document(dir, &doc)?;
        log::info!(
            "snapshot of {} vCPUs and {ram_bytes:#x} bytes of RAM written to {} in {:.1} ms",
            doc.vcpus.len(),
            dir.display(),
            t0.elapsed().as_secs_f64() * 1e3
        );
        Ok(Saved {
            dir: dir.to_path_buf(),
            ram_bytes,
        })
    }
}

/// A snapshot document read and checked, ready to restore.
#[derive(Clone, Debug)]
pub struct LoadedSnapshot {
    pub dir: PathBuf,
    pub doc: VmSnapshot,
}

/// Reads the snapshot at `url` (`file:///dir` or a path) and checks that it is complete
/// and consistent; RAM contents are checked (size and CRC) while they are restored.
pub fn load(url: &str) -> Result<LoadedSnapshot, SnapshotError> {
    let dir = format::parse_url(url)?;
    let doc = format::read_document(&dir)?;
    let cpus = usize::from(doc.config.cpus);
    if doc.vcpus.len() != cpus {
        return Err(SnapshotError::Mismatch(format!(
            "config says {cpus} vCPUs, the snapshot holds {}",
            doc.vcpus.len()
        )));
    }
    for (i, v) in doc.vcpus.iter().enumerate() {
        if usize::from(v.id) != i {
            return Err(SnapshotError::Mismatch(format!(
                "vcpus[{i}] is vCPU {} (expected {i})",
                v.id
            )));
        }
    }
    let ram: u64 = doc.memory.iter().map(|m| m.size).sum();
    if ram != doc.config.memory_size {
        return Err(SnapshotError::Mismatch(format!(
            "config says {:#x} bytes of RAM, the RAM files cover {ram:#x}",
            doc.config.memory_size
        )));
    }
    Ok(LoadedSnapshot { dir, doc })
}

/// The parts of a freshly built VM a restore writes into (vCPUs not started yet).
pub struct RestoreTarget<'a> {
    pub vm: &'a VmFd,
    pub ram: &'a GuestRam,
    pub vcpus: &'a [VcpuFd],
    pub devices: &'a DeviceManager,
    pub hotplug: &'a Mutex<PciHotplugController>,
    pub caps: &'a KvmCaps,
}

/// Puts `snap` into `t`: RAM (checked), then the irqchip, PIT and clock, then the vCPUs
/// (their LAPICs after the IOAPIC), then the VMM-side devices.
pub fn restore_into(t: &RestoreTarget<'_>, snap: &LoadedSnapshot) -> Result<(), SnapshotError> {
    let t0 = Instant::now();
    let doc = &snap.doc;
    let regions = t.ram.regions();
    if regions.len() != doc.memory.len() {
        return Err(SnapshotError::Mismatch(format!(
            "{} RAM regions here, {} in the snapshot",
            regions.len(),
            doc.memory.len()
        )));
    }
    for (r, m) in regions.iter().zip(&doc.memory) {
        if (r.gpa, r.size) != (m.gpa, m.size) {
            return Err(SnapshotError::Mismatch(format!(
                "RAM region at {:#x}+{:#x} here, {:#x}+{:#x} in the snapshot",
                r.gpa, r.size, m.gpa, m.size
            )));
        }
        let mut dst = WriteAt {
            file: t.ram.memfd(),
            offset: r.file_offset,
        };
        format::read_ram_file(&snap.dir, m, &mut dst)?;
    }
    restore_state(t, doc)?;
    log::info!(
        "restored {} vCPUs and {:#x} bytes of RAM from {} (written by lendvm {}) in {:.1} ms",
        doc.vcpus.len(),
        doc.config.memory_size,
        snap.dir.display(),
        doc.header.lendvm_version,
        t0.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

/// Puts everything but RAM of `doc` into `t`: the irqchip, PIT and clock, then the vCPUs
/// (their LAPICs after the IOAPIC), then the VMM-side devices. Live migration calls this
/// after the RAM has arrived.
pub fn restore_state(t: &RestoreTarget<'_>, doc: &VmSnapshot) -> Result<(), SnapshotError> {
    if t.vcpus.len() != doc.vcpus.len() {
        return Err(SnapshotError::Mismatch(format!(
            "{} vCPUs here, {} in the snapshot",
            t.vcpus.len(),
            doc.vcpus.len()
        )));
    }
    kvm::restore_vm(t.vm, &doc.vm)?;
    for (fd, s) in t.vcpus.iter().zip(&doc.vcpus) {
        kvm::restore_vcpu(fd, s, t.caps)?;
    }
    match (t.devices.serial(), &doc.devices.serial) {
        (Some(dev), Some(s)) => lock(dev).restore(s)?,
        (None, Some(_)) => log::info!("snapshot has serial state; this VM has no serial port"),
        (_, None) => {}
    }
    {
        let mut hp = lock(t.hotplug);
        hp.restore(&doc.devices.hotplug)?;
        hp.ged_mut().restore(&doc.devices.ged)?;
    }
    Ok(())
}
