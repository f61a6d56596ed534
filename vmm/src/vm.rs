//! A VM: KVM VM with in-kernel irqchip and PIT, guest RAM, devices, loaded kernel, vCPUs.

use std::sync::Arc;
use std::time::Duration;

use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_memory::{GuestAddress, GuestMemoryBackend};

use crate::arch::{self, ArchError};
use crate::cmdline;
use crate::config::VmConfig;
use crate::device_manager::{DeviceError, DeviceManager};
use crate::exit::{ExitNotifier, VmExit};
use crate::interrupt::KvmInterruptManager;
use crate::layout::pci_mmio64_start;
use crate::loader::{self, BootSource, LoadedKernel, LoaderError};
use crate::memory::{GuestRam, MemoryError};
use crate::platform::{Platform, PlatformError};
use crate::snapshot::kvm::KvmCaps;
use crate::stats::VcpuStats;
use crate::vcpu::{self, VcpuContext, VcpuControl, VcpuError, Vcpus};
use crate::vm_ops::KvmVmOps;

/// KVM's TSS address on Intel (three pages below the BIOS area).
const KVM_TSS_ADDRESS: usize = 0xfffb_d000;

/// Errors of VM creation and running.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("cannot open /dev/kvm")]
    KvmOpen(#[source] kvm_ioctls::Error),
    #[error("/dev/kvm is not a usable KVM device (API version {0}, expected 12)")]
    KvmApi(i32),
    #[error("KVM operation {op} failed")]
    Kvm {
        op: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Loader(#[from] LoaderError),
    #[error(transparent)]
    Arch(#[from] ArchError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error("interrupt set-up failed")]
    Interrupt(#[from] pci::interrupt::InterruptError),
    #[error("hotplug platform set-up failed")]
    Platform(#[from] PlatformError),
    #[error("cannot restore the snapshot")]
    Restore(#[from] crate::snapshot::SnapshotError),
    #[error(transparent)]
    Numa(#[from] crate::numa::NumaError),
    #[error("--cpus {asked}: this KVM allows at most {max} vCPUs per VM (KVM_CAP_MAX_VCPUS)")]
    TooManyCpus { asked: u8, max: usize },
    #[error(
        "--pci-mmio64-size {}: the 64-bit PCI window at {base:#x} would end at {end:#x}, past \
         the guest's {phys_bits}-bit physical address space ({} at most here)",
        pci::device::human(*size),
        pci::device::human(*max)
    )]
    Mmio64TooLarge {
        size: u64,
        base: u64,
        end: u128,
        phys_bits: u8,
        max: u64,
    },
}

/// The guest's physical address width from KVM's supported CPUID (leaf 0x8000_0008 EAX[7:0];
/// 36 when absent, as the SDM says).
fn phys_bits(supported: &[kvm_bindings::kvm_cpuid_entry2]) -> u8 {
    supported
        .iter()
        .find(|e| e.function == 0x8000_0008)
        .map(|e| (e.eax & 0xff) as u8)
        .filter(|&b| b > 0)
        .unwrap_or(36)
}

/// Bytes the guest can address from `base` on, with `phys_bits` of physical address.
fn address_room(base: u64, phys_bits: u8) -> u64 {
    let limit = 1u128 << phys_bits.min(64);
    u64::try_from(limit.saturating_sub(u128::from(base))).unwrap_or(u64::MAX)
}

/// `--pci-mmio64-size auto`: from `base` to the end of what the guest addresses, at most
/// [`crate::config::MMIO64_AUTO_MAX`], in whole GiB.
fn auto_mmio64_size(base: u64, phys_bits: u8) -> u64 {
    (address_room(base, phys_bits).min(crate::config::MMIO64_AUTO_MAX) >> 30) << 30
}

/// Refuses a 64-bit BAR window `(base, size)` that ends past what the guest can address.
fn check_mmio64_window(base: u64, size: u64, phys_bits: u8) -> Result<(), VmError> {
    let max = address_room(base, phys_bits);
    if size > max {
        return Err(VmError::Mmio64TooLarge {
            size,
            base,
            end: u128::from(base) + u128::from(size),
            phys_bits,
            max,
        });
    }
    Ok(())
}

/// Refuses more vCPUs than KVM allows per VM (`KVM_CAP_MAX_VCPUS`: `max`).
fn check_vcpu_limit(asked: u8, max: usize) -> Result<(), VmError> {
    if usize::from(asked) > max {
        return Err(VmError::TooManyCpus { asked, max });
    }
    Ok(())
}

fn kvm_op(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { op, source }
}

/// A built VM: vCPUs are created with their boot state but run only after [`Vm::start`].
pub struct Vm {
    vm: Arc<VmFd>,
    ram: Arc<GuestRam>,
    devices: Arc<DeviceManager>,
    interrupts: Arc<KvmInterruptManager>,
    vm_ops: Arc<KvmVmOps>,
    exit: Arc<ExitNotifier>,
    platform: Platform,
    /// The 64-bit PCI window (base, size), as resolved from `--pci-mmio64-size`.
    mmio64: (u64, u64),
    vcpus: Vec<VcpuFd>,
    vcpu_control: Arc<VcpuControl>,
    running: Option<Vcpus>,
    /// `None` for a VM restored from a snapshot (its kernel is in the restored RAM).
    kernel: Option<LoadedKernel>,
    cmdline: String,
    /// What KVM offers for saving vCPU state (MSR list, XSAVE, XCRs).
    caps: Arc<KvmCaps>,
    /// Guest RAM pinned ahead of a migration's hand-over ([`Vm::prepin_ram`]).
    prepinned: std::sync::Mutex<Vec<remote_pci::PinnedRange>>,
}

impl Vm {
    /// Builds the VM, the hotplug platform and ACPI tables, and loads the kernel; vCPUs are
    /// created but not started.
    pub fn new(cfg: &VmConfig) -> Result<Self, VmError> {
        Self::build(cfg, true, None)
    }

    /// Rebuilds the VM a snapshot was taken of (`cfg` from the snapshot's machine config) and
    /// puts its state back: guest RAM, the irqchip, PIT and clock, every vCPU and the
    /// VMM-side devices. The vCPUs park before their first entry: the VM starts paused.
    pub fn restore(
        cfg: &VmConfig,
        snap: &crate::snapshot::LoadedSnapshot,
    ) -> Result<Self, VmError> {
        let vm = Self::build(cfg, false, None)?;
        crate::snapshot::restore_into(
            &crate::snapshot::RestoreTarget {
                vm: &vm.vm,
                ram: &vm.ram,
                vcpus: &vm.vcpus,
                devices: &vm.devices,
                hotplug: vm.platform.hotplug(),
                caps: &vm.caps,
            },
            snap,
        )?;
        vm.vcpu_control.start_paused();
        Ok(vm)
    }

    /// Builds an empty VM of `cfg`'s shape for an incoming live migration: no kernel is
    /// loaded (RAM arrives from the source, then [`Vm::restore_migrated`] puts the state in).
    pub fn for_migration(cfg: &VmConfig) -> Result<Self, VmError> {
        Self::build(cfg, false, None)
    }

    /// [`Vm::for_migration`] on the source's guest RAM memfd (same host: nothing is
    /// copied, see [`GuestRam::from_memfd`]).
    pub fn for_migration_on(cfg: &VmConfig, memfd: std::fs::File) -> Result<Self, VmError> {
        Self::build(cfg, false, Some(memfd))
    }

    /// Puts the migrated state (everything but RAM, which is already in) into a VM built
    /// with [`Vm::for_migration`]. The vCPUs park before their first entry: the VM starts
    /// paused until resumed.
    pub fn restore_migrated(
        &self,
        doc: &crate::snapshot::format::VmSnapshot,
    ) -> Result<(), VmError> {
        crate::snapshot::restore_state(
            &crate::snapshot::RestoreTarget {
                vm: &self.vm,
                ram: &self.ram,
                vcpus: &self.vcpus,
                devices: &self.devices,
                hotplug: self.platform.hotplug(),
                caps: &self.caps,
            },
            doc,
        )?;
        self.vcpu_control.start_paused();
        Ok(())
    }

    /// What a snapshot of this VM reads (clone it into the control plane).
    pub fn snapshot_source(
        &self,
        config: crate::snapshot::format::MachineConfig,
    ) -> crate::snapshot::SnapshotSource {
        crate::snapshot::SnapshotSource {
            vm: self.vm.clone(),
            ram: self.ram.clone(),
            vcpus: self.vcpu_control.clone(),
            devices: self.devices.clone(),
            hotplug: self.platform.hotplug().clone(),
            caps: self.caps.clone(),
            config,
        }
    }

    fn build(cfg: &VmConfig, boot: bool, memfd: Option<std::fs::File>) -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(VmError::KvmOpen)?;
        let api = kvm.get_api_version();
        if api != kvm_bindings::KVM_API_VERSION as i32 {
            return Err(VmError::KvmApi(api));
        }
        // Checked before anything is built: KVM_CREATE_VCPU would fail only at the vCPU
        // past the limit, with a bare EINVAL.
        check_vcpu_limit(cfg.cpus, kvm.get_max_vcpus())?;
        let numa_distances = crate::numa::check(&cfg.numa, cfg.cpus, cfg.memory_size)?;
        let vm = Arc::new(kvm.create_vm().map_err(kvm_op("KVM_CREATE_VM"))?);
        if let Err(e) = vm.set_tss_address(KVM_TSS_ADDRESS) {
            log::debug!("KVM_SET_TSS_ADDR not accepted ({e}); continuing");
        }
        vm.create_irq_chip().map_err(kvm_op("KVM_CREATE_IRQCHIP"))?;
        vm.create_pit2(kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        })
        .map_err(kvm_op("KVM_CREATE_PIT2"))?;

        let ram = Arc::new(match memfd {
            Some(f) => GuestRam::from_memfd(f, cfg.memory_size)?,
            None => GuestRam::with_backing(cfg.memory_size, cfg.ram_backing.clone())?,
        });
        let mem = ram.memory();
        for (slot, region) in ram.regions().iter().enumerate() {
            let host = mem
                .get_host_address(GuestAddress(region.gpa))
                .map_err(|_| MemoryError::TooSmall { size: 0, min: 0 })?;
            let r = kvm_userspace_memory_region {
                slot: slot as u32,
                flags: 0,
                guest_phys_addr: region.gpa,
                memory_size: region.size,
                userspace_addr: host as u64,
            };
            // SAFETY: `host` maps `region.size` bytes of guest RAM that live as long as `ram`,
            // which the VM owns for its whole life.
            unsafe { vm.set_user_memory_region(r) }
                .map_err(kvm_op("KVM_SET_USER_MEMORY_REGION"))?;
        }

        let exit = Arc::new(ExitNotifier::new());
        let interrupts = Arc::new(KvmInterruptManager::new(vm.clone(), cfg.cpus)?);
        let supported = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm_op("KVM_GET_SUPPORTED_CPUID"))?;
        let mmio64_start = pci_mmio64_start(ram.end());
        let bits = phys_bits(supported.as_slice());
        let size = cfg
            .pci_mmio64_size
            .unwrap_or_else(|| auto_mmio64_size(mmio64_start, bits));
        let mmio64 = (mmio64_start, size);
        check_mmio64_window(mmio64_start, size, bits)?;
        log::info!(
            "64-bit PCI window: {} at {mmio64_start:#x} (guest physical address width {bits} bits)",
            pci::device::human(size)
        );
        let devices = Arc::new(DeviceManager::new(
            &vm,
            &cfg.serial,
            exit.clone(),
            mmio64,
            cfg.pci_slots,
            cfg.numa.len(),
            &cfg.switches,
        )?);
        let numa = crate::numa::layout(&cfg.numa, ram.regions(), &numa_distances);
        for (id, node) in numa.iter().enumerate() {
            log::info!(
                "numa node {id}: vCPUs {:?}, memory {:x?}, distances {:?}",
                node.cpus,
                node.memory,
                node.distances
            );
        }
        let platform = Platform::new(&vm, &devices, mem, cfg.cpus, numa)?;
        if cfg.pci_slots < pci::root::MAX_DEVICE_SLOTS {
            log::info!(
                "pci: slots 1 to {} of bus 0 take devices (--pci-slots)",
                cfg.pci_slots
            );
        }

        arch::setup_boot_tables(mem, mmio64_start)?;

        let mut vcpus = Vec::new();
        let mut visible = Vec::new();
        for id in 0..cfg.cpus {
            let (fd, v) = vcpu::create_vcpu(&vm, &supported, cfg.cpu_model, id, cfg.cpus)?;
            if id == 0 {
                visible = v;
            }
            vcpus.push(fd);
        }
        let caps = Arc::new(KvmCaps::probe(&kvm, &vm));
        let mut line = cfg.cmdline.clone();
        if boot && cfg.cpuid_cmdline && !visible.is_empty() && cmdline::is_linux_kernel(&cfg.kernel)
        {
            if let Some(l) = cmdline::augment(&line, &visible) {
                log::info!(
                    "Linux kernel on a KVM that ignores CPUID masking: command line is now \
                     '{l}' (--no-cpuid-cmdline turns this off)"
                );
                line = l;
            }
        }
        let kernel = if boot {
            let kernel = loader::load(
                mem,
                ram.regions(),
                &BootSource {
                    kernel: &cfg.kernel,
                    cmdline: &line,
                    initramfs: cfg.initramfs.as_deref(),
                    acpi_rsdp_addr: Some(platform.rsdp_addr()),
                },
            )?;
            // Only the bootstrap processor enters the kernel. The application processors
            // stay in their reset state (KVM_MP_STATE_UNINITIALIZED: KVM makes every vCPU
            // but vCPU 0 of a VM with an in-kernel LAPIC so), waiting for the guest's
            // INIT-SIPI-SIPI through its local APIC, as on hardware: an AP given the boot
            // registers would run the kernel's entry a second time.
            if let Some(bsp) = vcpus.first() {
                vcpu::setup_boot_state(bsp, 0, kernel.entry)?;
            }
            for (id, fd) in vcpus.iter().enumerate().skip(1) {
                vcpu::hold_in_reset(fd, id as u8)?;
            }
            Some(kernel)
        } else {
            None
        };
        // Statistics fds are taken before the vCPU fds move to their threads; a KVM without
        // KVM_GET_STATS_FD only loses the exit counts of vm.counters.
        let mut stats = Vec::new();
        for (id, fd) in vcpus.iter().enumerate() {
            match VcpuStats::open(fd, id as u8) {
                Ok(s) => stats.push(s),
                Err(e) => {
                    log::warn!("no KVM statistics: {e}");
                    stats.clear();
                    break;
                }
            }
        }
        let vcpu_control = Arc::new(VcpuControl::new(vcpus.len(), stats));
        let max_slots = kvm.get_nr_memslots() as u32;
        let vm_ops = Arc::new(KvmVmOps::new(
            vm.clone(),
            ram.clone(),
            ram.regions().len() as u32,
            max_slots,
        ));
        Ok(Self {
            vm,
            ram,
            devices,
            interrupts,
            vm_ops,
            exit,
            platform,
            mmio64,
            vcpus,
            vcpu_control,
            running: None,
            kernel,
            cmdline: line,
            caps,
            prepinned: std::sync::Mutex::default(),
        })
    }

    /// A migration destination whose VM holds lent devices pins guest RAM while the source
    /// still runs, so the devices' Bus Master Enable at the hand-over finds it pinned (see
    /// `dma::Prepinned`). On failure (e.g. `RLIMIT_MEMLOCK`) the RAM is only faulted in and
    /// the hand-over pins it.
    pub fn prepin_ram(&self) {
        let mem = self.ram.memory();
        let mut ranges = Vec::new();
        for r in self.ram.regions() {
            match mem.get_host_address(GuestAddress(r.gpa)) {
                Ok(h) => ranges.push((h as u64, r.size)),
                Err(_) => return self.ram.populate(),
            }
        }
        let pinner = remote_pci::ParallelPinner::available();
        match remote_pci::pin::pin_all(&pinner, &ranges) {
            Ok((pins, _)) => {
                *self
                    .prepinned
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = pins;
            }
            Err(e) => {
                log::warn!("pinning guest ram ahead of the hand-over: {e}; faulting it in only");
                self.ram.populate();
            }
        }
    }

    /// The ranges [`Vm::prepin_ram`] pinned (for the VM's DMA manager).
    pub fn take_prepinned_ram(&self) -> Vec<remote_pci::PinnedRange> {
        std::mem::take(
            &mut *self
                .prepinned
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// The 64-bit PCI window (base, size).
    pub fn pci_mmio64(&self) -> (u64, u64) {
        self.mmio64
    }

    /// The command line the kernel got (after CPUID augmentation).
    pub fn cmdline(&self) -> &str {
        &self.cmdline
    }

    /// The hotplug platform (GED, hotplug controller, eject channel).
    pub fn platform_mut(&mut self) -> &mut Platform {
        &mut self.platform
    }

    /// The hotplug platform.
    pub fn platform(&self) -> &Platform {
        &self.platform
    }

    /// The KVM VM fd.
    pub fn vm_fd(&self) -> &Arc<VmFd> {
        &self.vm
    }

    /// Guest RAM (memfd + regions).
    pub fn ram(&self) -> &Arc<GuestRam> {
        &self.ram
    }

    /// The device manager (buses, PCI root); clone the `Arc` to add devices later.
    pub fn devices(&self) -> &Arc<DeviceManager> {
        &self.devices
    }

    /// The interrupt manager for device models.
    pub fn interrupt_manager(&self) -> Arc<KvmInterruptManager> {
        self.interrupts.clone()
    }

    /// The VM operations for device models.
    pub fn vm_ops(&self) -> Arc<KvmVmOps> {
        self.vm_ops.clone()
    }

    /// Where the kernel was loaded (`None` for a restored VM).
    pub fn kernel(&self) -> Option<LoadedKernel> {
        self.kernel
    }

    /// Pause/resume and KVM statistics of the vCPUs.
    pub fn vcpu_control(&self) -> &Arc<VcpuControl> {
        &self.vcpu_control
    }

    /// The stop notifier (request a stop from outside, e.g. the API).
    pub fn exit_notifier(&self) -> &Arc<ExitNotifier> {
        &self.exit
    }

    /// Starts one thread per vCPU.
    pub fn start(&mut self) -> Result<(), VmError> {
        if self.running.is_some() {
            return Ok(());
        }
        let ctx = VcpuContext {
            pio: self.devices.pio_bus().clone(),
            mmio: self.devices.mmio_bus().clone(),
            memory: self.ram.memory().clone(),
            exit: self.exit.clone(),
            control: self.vcpu_control.clone(),
        };
        self.running = Some(Vcpus::start(std::mem::take(&mut self.vcpus), ctx)?);
        Ok(())
    }

    /// Stops and joins the vCPU threads (if running) and flushes the serial output.
    pub fn stop(&mut self) {
        if let Some(v) = self.running.take() {
            v.stop();
        }
        self.devices.flush_serial();
    }

    /// Runs the guest until it exits (or `timeout` passes); returns why it stopped.
    pub fn run(mut self, timeout: Option<Duration>) -> Result<VmExit, VmError> {
        self.start()?;
        let reason = self
            .exit
            .wait(timeout)
            .unwrap_or_else(|| VmExit::Error("timed out waiting for the guest".into()));
        self.stop();
        Ok(reason)
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_vcpus_than_kvm_allows_are_refused_by_name() {
        assert!(check_vcpu_limit(2, 2).is_ok());
        let e = check_vcpu_limit(9, 8).unwrap_err().to_string();
        assert_eq!(
            e,
            "--cpus 9: this KVM allows at most 8 vCPUs per VM (KVM_CAP_MAX_VCPUS)"
        );
        // This host's KVM takes every count the command line accepts.
        let kvm = Kvm::new().expect("/dev/kvm is required by the vmm tests");
        assert!(kvm.get_max_vcpus() >= 2);
    }

    #[test]
    fn a_64bit_window_past_the_guests_address_width_is_refused_by_name() {
        assert!(check_mmio64_window(4 << 30, 64 << 30, 40).is_ok());
        // Exactly up to the limit is fine; one page more is not.
        assert!(check_mmio64_window(4 << 30, (1 << 40) - (4 << 30), 40).is_ok());
        let e = check_mmio64_window(4 << 30, 1 << 40, 40)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "--pci-mmio64-size 1 TiB: the 64-bit PCI window at 0x100000000 would end at \
             0x10100000000, past the guest's 40-bit physical address space (1020 GiB at most \
             here)"
        );
        let kvm = Kvm::new().expect("/dev/kvm is required by the vmm tests");
        let supported = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
        let bits = phys_bits(supported.as_slice());
        assert!((36..=52).contains(&bits), "{bits}");
        // The window of older documents and `auto` fit every guest this host can run.
        assert!(check_mmio64_window(4 << 30, crate::device_manager::PCI_MMIO64_SIZE, bits).is_ok());
        assert!(check_mmio64_window(4 << 30, auto_mmio64_size(4 << 30, bits), bits).is_ok());
    }

    #[test]
    fn auto_takes_the_address_space_up_to_a_tebibyte_in_whole_gib() {
        assert_eq!(auto_mmio64_size(4 << 30, 48), 1 << 40);
        assert_eq!(auto_mmio64_size(4 << 30, 40), (1 << 40) - (4 << 30));
        assert_eq!(auto_mmio64_size(4 << 30, 36), (64 << 30) - (4 << 30));
        // Nothing left: an empty window, which check_mmio64_window then accepts and every
        // 64-bit BAR is refused by name.
        assert_eq!(auto_mmio64_size(1 << 36, 36), 0);
    }
}
