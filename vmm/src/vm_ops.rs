//! `pci::vm_ops::VmOps` with KVM: memslots and ioeventfds owned by guards, guest RAM access.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_READONLY};
use kvm_ioctls::{NoDatamatch, VmFd};
use pci::vm_ops::{
    GuestRamRegion, IoEventAddress, IoEventDatamatch, IoEventGuard, MemslotGuard, VmOps, VmOpsError,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
use vmm_sys_util::eventfd::EventFd;

use crate::id_alloc::IdAllocator;
use crate::memory::GuestRam;

/// Hands out KVM memslot numbers in `[first, end)`, reusing freed ones.
pub type SlotAllocator = IdAllocator;

fn io_err(op: &'static str, e: kvm_ioctls::Error) -> VmOpsError {
    VmOpsError::Backend {
        op,
        source: std::io::Error::from_raw_os_error(e.errno()),
    }
}

fn kvm_addr(addr: IoEventAddress) -> kvm_ioctls::IoEventAddress {
    match addr {
        IoEventAddress::Pio(a) => kvm_ioctls::IoEventAddress::Pio(a),
        IoEventAddress::Mmio(a) => kvm_ioctls::IoEventAddress::Mmio(a),
    }
}

fn ioevent(
    vm: &VmFd,
    fd: &EventFd,
    addr: IoEventAddress,
    dm: Option<IoEventDatamatch>,
    register: bool,
) -> Result<(), kvm_ioctls::Error> {
    let a = kvm_addr(addr);
    macro_rules! call {
        ($v:expr) => {
            if register {
                vm.register_ioevent(fd, &a, $v)
            } else {
                vm.unregister_ioevent(fd, &a, $v)
            }
        };
    }
    match dm {
        None => call!(NoDatamatch),
        Some(IoEventDatamatch::U8(v)) => call!(v),
        Some(IoEventDatamatch::U16(v)) => call!(v),
        Some(IoEventDatamatch::U32(v)) => call!(v),
        Some(IoEventDatamatch::U64(v)) => call!(v),
    }
}

/// The VM's [`VmOps`]: KVM memslots above the RAM slots, ioeventfds, guest RAM access.
pub struct KvmVmOps {
    vm: Arc<VmFd>,
    ram: Arc<GuestRam>,
    slots: Arc<Mutex<SlotAllocator>>,
    ioevents: Arc<AtomicUsize>,
}

impl KvmVmOps {
    /// `first_free_slot` is the first memslot not used by guest RAM.
    pub fn new(vm: Arc<VmFd>, ram: Arc<GuestRam>, first_free_slot: u32, max_slots: u32) -> Self {
        Self {
            vm,
            ram,
            slots: Arc::new(Mutex::new(SlotAllocator::new(
                "memslot",
                first_free_slot,
                max_slots,
            ))),
            ioevents: Arc::default(),
        }
    }

    /// Device memslots in use (guest RAM slots not counted).
    pub fn memslots_in_use(&self) -> usize {
        self.slots.lock().map(|s| s.in_use()).unwrap_or(0)
    }

    /// Ioeventfds registered through this object and not yet unregistered.
    pub fn ioevents_registered(&self) -> usize {
        self.ioevents.load(Ordering::SeqCst)
    }
}

impl VmOps for KvmVmOps {
    fn map_guest_region(
        &self,
        gpa: u64,
        size: u64,
        host_addr: u64,
        readonly: bool,
    ) -> Result<MemslotGuard, VmOpsError> {
        let bad = |reason| VmOpsError::InvalidRegion { gpa, size, reason };
        if size == 0 {
            return Err(bad("zero size"));
        }
        if (gpa | size | host_addr) & 0xfff != 0 {
            return Err(bad("not page aligned"));
        }
        if gpa.checked_add(size).is_none() {
            return Err(bad("wraps the address space"));
        }
        if self
            .ram
            .regions()
            .iter()
            .any(|r| gpa < r.gpa + r.size && r.gpa < gpa + size)
        {
            return Err(bad("overlaps guest RAM"));
        }
        let slot = self
            .slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .allocate()
            .ok_or_else(|| VmOpsError::Exhausted("no free KVM memslot".into()))?;
        let region = kvm_userspace_memory_region {
            slot,
            flags: if readonly { KVM_MEM_READONLY } else { 0 },
            guest_phys_addr: gpa,
            memory_size: size,
            userspace_addr: host_addr,
        };
        // SAFETY: the caller hands us a mapping of at least `size` bytes at `host_addr` that it
        // keeps alive for as long as it holds the returned guard (whose drop removes the slot).
        if let Err(e) = unsafe { self.vm.set_user_memory_region(region) } {
            self.slots
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .release(slot);
            return Err(io_err("KVM_SET_USER_MEMORY_REGION", e));
        }
        log::debug!("memslot {slot}: {gpa:#x}+{size:#x} -> host {host_addr:#x}");
        let vm = self.vm.clone();
        let slots = self.slots.clone();
        Ok(MemslotGuard::new(gpa, size, slot, move || {
            let remove = kvm_userspace_memory_region {
                slot,
                memory_size: 0,
                ..region
            };
            // SAFETY: a zero-sized region deletes the slot; no memory is referenced.
            match unsafe { vm.set_user_memory_region(remove) } {
                Ok(()) => slots
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .release(slot),
                Err(e) => log::warn!("removing memslot {slot} failed: {e}"),
            }
        }))
    }

    fn register_ioevent(
        &self,
        fd: &EventFd,
        addr: IoEventAddress,
        datamatch: Option<IoEventDatamatch>,
    ) -> Result<IoEventGuard, VmOpsError> {
        let fd = fd.try_clone().map_err(|source| VmOpsError::Backend {
            op: "eventfd dup",
            source,
        })?;
        ioevent(&self.vm, &fd, addr, datamatch, true).map_err(|e| io_err("KVM_IOEVENTFD", e))?;
        self.ioevents.fetch_add(1, Ordering::SeqCst);
        let vm = self.vm.clone();
        let count = self.ioevents.clone();
        Ok(IoEventGuard::new(addr, datamatch, move || {
            match ioevent(&vm, &fd, addr, datamatch, false) {
                Ok(()) => {
                    count.fetch_sub(1, Ordering::SeqCst);
                }
                Err(e) => log::warn!("unregistering ioeventfd at {addr:?} failed: {e}"),
            }
        }))
    }

    fn guest_ram_regions(&self) -> Vec<GuestRamRegion> {
        let mem = self.ram.memory();
        self.ram
            .regions()
            .iter()
            .map(|r| GuestRamRegion {
                gpa: r.gpa,
                size: r.size,
                host_addr: mem
                    .get_host_address(GuestAddress(r.gpa))
                    .map(|p| p as u64)
                    .unwrap_or(0),
                file: Some((self.ram.memfd().clone(), r.file_offset)),
            })
            .collect()
    }

    fn read_guest(&self, gpa: u64, data: &mut [u8]) -> Result<(), VmOpsError> {
        self.ram
            .memory()
            .read_slice(data, GuestAddress(gpa))
            .map_err(|_| VmOpsError::NotRam {
                gpa,
                len: data.len() as u64,
            })
    }

    fn write_guest(&self, gpa: u64, data: &[u8]) -> Result<(), VmOpsError> {
        self.ram
            .memory()
            .write_slice(data, GuestAddress(gpa))
            .map_err(|_| VmOpsError::NotRam {
                gpa,
                len: data.len() as u64,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_allocator_reuses() {
        let mut a = SlotAllocator::new("memslot", 2, 4);
        assert_eq!(a.allocate(), Some(2));
        assert_eq!(a.allocate(), Some(3));
        assert_eq!(a.allocate(), None);
        a.release(2);
        assert_eq!(a.allocate(), Some(2));
    }

    /// Exercises KVM when /dev/kvm is usable (skips otherwise).
    #[test]
    fn memslot_and_ioevent_guards_with_kvm() {
        let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm is required by the vmm tests");
        let vm = Arc::new(kvm.create_vm().unwrap());
        let ram = Arc::new(GuestRam::new(16 << 20).unwrap());
        let ops = KvmVmOps::new(vm, ram.clone(), 1, 8);
        // A page of host memory standing in for a fabric window.
        let window = GuestRam::new(16 << 20).unwrap();
        let host = window.memory().get_host_address(GuestAddress(0)).unwrap() as u64;
        let g = ops
            .map_guest_region(0xc000_0000, 0x1000, host, false)
            .unwrap();
        assert_eq!(g.slot(), 1);
        drop(g);
        let g = ops
            .map_guest_region(0xc000_0000, 0x1000, host, true)
            .unwrap();
        assert_eq!(g.slot(), 1, "slot reused after drop");
        assert!(ops.map_guest_region(0x1000, 0x1000, host, false).is_err());
        assert!(ops
            .map_guest_region(0xc000_0001, 0x1000, host, false)
            .is_err());
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let io = ops
            .register_ioevent(
                &evt,
                IoEventAddress::Mmio(0xc000_2000),
                Some(IoEventDatamatch::U32(1)),
            )
            .unwrap();
        drop(io);
        // Re-registering the same one works only if the guard really unregistered it.
        let _io = ops
            .register_ioevent(
                &evt,
                IoEventAddress::Mmio(0xc000_2000),
                Some(IoEventDatamatch::U32(1)),
            )
            .unwrap();
        ops.write_guest(0x1000, &[1, 2, 3]).unwrap();
        let mut b = [0u8; 3];
        ops.read_guest(0x1000, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3]);
        assert!(ops.read_guest(0x2000_0000, &mut b).is_err());
        let regions = ops.guest_ram_regions();
        assert_eq!(regions.len(), 1);
        assert!(regions[0].file.is_some());
    }
}
