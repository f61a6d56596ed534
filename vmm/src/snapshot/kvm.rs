//! vCPU and VM state through KVM, in the orders KVM needs.
//!
//! **Save** (on the vCPU's own thread, the VM paused): first a `KVM_RUN` with
//! `immediate_exit` set, so KVM completes a port or MMIO read the VMM already answered (the
//! register write-back happens on the next entry; saving before it would lose the value);
//! then mp state first (`KVM_GET_MP_STATE` accepts pending INIT/SIPI and may change the
//! LAPIC), registers, sregs, FPU, XSAVE and XCRs where KVM has them, LAPIC, MSRs, and vcpu
//! events last (the pending exception/interrupt/NMI state).
//!
//! **Restore** (before the vCPU thread starts): regs, sregs (CR0/CR4/EFER, and the APIC
//! base that decides the LAPIC's mode), FPU, XSAVE, XCRs, then the LAPIC (after its base),
//! then MSRs (after the LAPIC: writing the LAPIC resets the TSC-deadline timer, which the
//! MSR then re-arms), then vcpu events, and the mp state last (QEMU's order; an earlier
//! `KVM_SET_LAPIC` or event injection must not override it).
//!
//! VM-wide: the in-kernel irqchip (PIC master, PIC slave, IOAPIC), PIT2 and kvmclock
//! (`KVM_GET_CLOCK`; restored with `KVM_SET_CLOCK`, so guest time does not jump by the time
//! the snapshot sat on disk).

use kvm_bindings::{
    kvm_irqchip, kvm_mp_state, kvm_xsave, Msrs, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::{Cap, VcpuFd, VmFd};

use super::format::{
    from_hex, hex_to_words, to_hex, words_to_hex, FormatError, KvmVmState, MsrValue, VcpuState,
};

/// Errors of reading or writing KVM state.
#[derive(Debug, thiserror::Error)]
pub enum KvmStateError {
    #[error("vCPU {id}: {op} failed")]
    Vcpu {
        id: u8,
        op: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("{op} failed")]
    Vm {
        op: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("vCPU {id}: KVM has {count} MSRs to save; building the MSR list failed")]
    MsrList { id: u8, count: usize },
}

/// What KVM offers for saving vCPUs, probed once per VM.
#[derive(Clone, Debug, Default)]
pub struct KvmCaps {
    /// `KVM_GET_MSR_INDEX_LIST`: the MSRs KVM can save and restore.
    pub msrs: Vec<u32>,
    pub xsave: bool,
    pub xcrs: bool,
}

impl KvmCaps {
    /// Probes `kvm` (the system fd) and `vm`; missing features are logged, not errors (PVM
    /// hosts have neither XSAVE nor XCRs).
    pub fn probe(kvm: &kvm_ioctls::Kvm, vm: &VmFd) -> Self {
        let msrs = match kvm.get_msr_index_list() {
            Ok(l) => l.as_slice().to_vec(),
            Err(e) => {
                log::warn!("KVM_GET_MSR_INDEX_LIST failed ({e}): snapshots carry no MSRs");
                Vec::new()
            }
        };
        let xsave = vm.check_extension(Cap::Xsave);
        let xcrs = vm.check_extension(Cap::Xcrs);
        if !xsave || !xcrs {
            log::info!(
                "snapshots: KVM has no {}{}{}; saved without them (the FPU/SSE state is \
                 saved with KVM_GET_FPU)",
                if xsave { "" } else { "XSAVE" },
                if !xsave && !xcrs { " and no " } else { "" },
                if xcrs { "" } else { "XCRs" }
            );
        }
        Self { msrs, xsave, xcrs }
    }
}

fn vcpu_err(id: u8, op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> KvmStateError {
    move |source| KvmStateError::Vcpu { id, op, source }
}

/// Reads every saveable MSR of `fd`. An index KVM lists but refuses to read is skipped (and
/// logged): `KVM_GET_MSRS` stops at the first failure and returns how many it read.
fn read_msrs(fd: &VcpuFd, id: u8, indices: &[u32]) -> Result<Vec<MsrValue>, KvmStateError> {
    let mut out = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let entries: Vec<kvm_bindings::kvm_msr_entry> = rest
            .iter()
            .map(|&index| kvm_bindings::kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(|_| KvmStateError::MsrList {
            id,
            count: rest.len(),
        })?;
        let n = fd
            .get_msrs(&mut msrs)
            .map_err(vcpu_err(id, "KVM_GET_MSRS"))?;
        out.extend(msrs.as_slice()[..n].iter().map(|e| MsrValue {
            index: e.index,
            data: e.data,
        }));
        if n < rest.len() {
            log::debug!("vCPU {id}: MSR {:#x} cannot be read; not saved", rest[n]);
            rest = &rest[n + 1..];
        } else {
            rest = &[];
        }
    }
    Ok(out)
}

/// Writes `msrs`; an MSR KVM refuses is skipped with a warning (it was readable on the
/// source, so a refusal means the two hosts differ).
fn write_msrs(fd: &VcpuFd, id: u8, msrs: &[MsrValue]) -> Result<(), KvmStateError> {
    let mut rest = msrs;
    while !rest.is_empty() {
        let entries: Vec<kvm_bindings::kvm_msr_entry> = rest
            .iter()
            .map(|m| kvm_bindings::kvm_msr_entry {
                index: m.index,
                data: m.data,
                ..Default::default()
            })
            .collect();
        let list = Msrs::from_entries(&entries).map_err(|_| KvmStateError::MsrList {
            id,
            count: rest.len(),
        })?;
        let n = fd.set_msrs(&list).map_err(vcpu_err(id, "KVM_SET_MSRS"))?;
        if n < rest.len() {
            log::warn!(
                "vCPU {id}: KVM refused MSR {:#x} = {:#x} on restore; skipped",
                rest[n].index,
                rest[n].data
            );
            rest = &rest[n + 1..];
        } else {
            rest = &[];
        }
    }
    Ok(())
}

/// Saves vCPU `id`. Call on the vCPU's thread while it is parked outside `KVM_RUN`.
pub fn save_vcpu(fd: &mut VcpuFd, id: u8, caps: &KvmCaps) -> Result<VcpuState, KvmStateError> {
    // Complete an exit the VMM already handled (an IN or MMIO read writes its result on the
    // next entry); immediate_exit makes KVM return at once without running guest code.
    fd.set_kvm_immediate_exit(1);
    let r = match fd.run() {
        Err(e) if e.errno() == libc::EINTR => Ok(()),
        Err(e) => Err(e),
        Ok(exit) => {
            log::debug!("vCPU {id}: immediate-exit KVM_RUN returned {exit:?}");
            Ok(())
        }
    };
    fd.set_kvm_immediate_exit(0);
    r.map_err(vcpu_err(id, "KVM_RUN (immediate exit)"))?;
    let mp_state = fd
        .get_mp_state()
        .map_err(vcpu_err(id, "KVM_GET_MP_STATE"))?;
    let regs = fd.get_regs().map_err(vcpu_err(id, "KVM_GET_REGS"))?;
    let sregs = fd.get_sregs().map_err(vcpu_err(id, "KVM_GET_SREGS"))?;
    let fpu = fd.get_fpu().map_err(vcpu_err(id, "KVM_GET_FPU"))?;
    let xsave = if caps.xsave {
        let x = fd.get_xsave().map_err(vcpu_err(id, "KVM_GET_XSAVE"))?;
        Some(words_to_hex(&x.region))
    } else {
        None
    };
    let xcrs = if caps.xcrs {
        Some(to_hex(
            &fd.get_xcrs().map_err(vcpu_err(id, "KVM_GET_XCRS"))?,
        ))
    } else {
        None
    };
    let lapic = fd.get_lapic().map_err(vcpu_err(id, "KVM_GET_LAPIC"))?;
    let msrs = read_msrs(fd, id, &caps.msrs)?;
    let events = fd
        .get_vcpu_events()
        .map_err(vcpu_err(id, "KVM_GET_VCPU_EVENTS"))?;
    Ok(VcpuState {
        id,
        regs: to_hex(&regs),
        sregs: to_hex(&sregs),
        fpu: to_hex(&fpu),
        xsave,
        xcrs,
        lapic: to_hex(&lapic),
        msrs,
        vcpu_events: to_hex(&events),
        mp_state: to_hex(&mp_state),
    })
}

/// Restores a vCPU created with the same CPUID, before its thread runs.
pub fn restore_vcpu(fd: &VcpuFd, s: &VcpuState, caps: &KvmCaps) -> Result<(), KvmStateError> {
    let id = s.id;
    let f = |name: &str| format!("vcpus[{id}].{name}");
    fd.set_regs(&from_hex(&f("regs"), &s.regs)?)
        .map_err(vcpu_err(id, "KVM_SET_REGS"))?;
    fd.set_sregs(&from_hex(&f("sregs"), &s.sregs)?)
        .map_err(vcpu_err(id, "KVM_SET_SREGS"))?;
    fd.set_fpu(&from_hex(&f("fpu"), &s.fpu)?)
        .map_err(vcpu_err(id, "KVM_SET_FPU"))?;
    match (&s.xsave, caps.xsave) {
        (Some(hex), true) => {
            let mut x = kvm_xsave {
                region: [0; 1024],
                extra: Default::default(),
            };
            hex_to_words(&f("xsave"), hex, &mut x.region)?;
            // SAFETY: `x` is a plain 4 KiB kvm_xsave without a FAM tail, which is what
            // KVM_SET_XSAVE reads when KVM_CAP_XSAVE2 is not in use (this VMM never enables
            // larger XSAVE areas).
            unsafe { fd.set_xsave(&x) }.map_err(vcpu_err(id, "KVM_SET_XSAVE"))?;
        }
        (Some(_), false) => log::warn!(
            "vCPU {id}: the snapshot has an XSAVE area but this KVM has no XSAVE; only the \
             FPU/SSE state is restored"
        ),
        (None, _) => {}
    }
    match (&s.xcrs, caps.xcrs) {
        (Some(hex), true) => fd
            .set_xcrs(&from_hex(&f("xcrs"), hex)?)
            .map_err(vcpu_err(id, "KVM_SET_XCRS"))?,
        (Some(_), false) => {
            log::warn!("vCPU {id}: the snapshot has XCRs but this KVM has none; skipped")
        }
        (None, _) => {}
    }
    fd.set_lapic(&from_hex(&f("lapic"), &s.lapic)?)
        .map_err(vcpu_err(id, "KVM_SET_LAPIC"))?;
    write_msrs(fd, id, &s.msrs)?;
    fd.set_vcpu_events(&from_hex(&f("vcpu_events"), &s.vcpu_events)?)
        .map_err(vcpu_err(id, "KVM_SET_VCPU_EVENTS"))?;
    let mp: kvm_mp_state = from_hex(&f("mp_state"), &s.mp_state)?;
    fd.set_mp_state(mp)
        .map_err(vcpu_err(id, "KVM_SET_MP_STATE"))?;
    Ok(())
}

fn vm_err(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> KvmStateError {
    move |source| KvmStateError::Vm { op, source }
}

fn get_chip(vm: &VmFd, chip_id: u32) -> Result<String, KvmStateError> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut chip)
        .map_err(vm_err("KVM_GET_IRQCHIP"))?;
    Ok(to_hex(&chip))
}

/// The in-kernel irqchip, PIT and clock (vCPUs paused).
pub fn save_vm(vm: &VmFd) -> Result<KvmVmState, KvmStateError> {
    Ok(KvmVmState {
        pic_master: get_chip(vm, KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: get_chip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: get_chip(vm, KVM_IRQCHIP_IOAPIC)?,
        pit: to_hex(&vm.get_pit2().map_err(vm_err("KVM_GET_PIT2"))?),
        clock: to_hex(&vm.get_clock().map_err(vm_err("KVM_GET_CLOCK"))?),
    })
}

/// Puts the irqchip, PIT and clock back (before any vCPU runs).
pub fn restore_vm(vm: &VmFd, s: &KvmVmState) -> Result<(), KvmStateError> {
    for (field, hex, chip_id) in [
        ("vm.pic_master", &s.pic_master, KVM_IRQCHIP_PIC_MASTER),
        ("vm.pic_slave", &s.pic_slave, KVM_IRQCHIP_PIC_SLAVE),
        ("vm.ioapic", &s.ioapic, KVM_IRQCHIP_IOAPIC),
    ] {
        let chip: kvm_irqchip = from_hex(field, hex)?;
        if chip.chip_id != chip_id {
            return Err(FormatError::Field {
                field: field.into(),
                why: format!("holds irqchip {} where {chip_id} belongs", chip.chip_id),
            }
            .into());
        }
        vm.set_irqchip(&chip).map_err(vm_err("KVM_SET_IRQCHIP"))?;
    }
    vm.set_pit2(&from_hex("vm.pit", &s.pit)?)
        .map_err(vm_err("KVM_SET_PIT2"))?;
    let mut clock: kvm_bindings::kvm_clock_data = from_hex("vm.clock", &s.clock)?;
    // Only the clock value is restored; the flags describe the source host's TSC/realtime
    // fields, which mean nothing here.
    clock.flags = 0;
    vm.set_clock(&clock).map_err(vm_err("KVM_SET_CLOCK"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use kvm_bindings::{kvm_lapic_state, KVM_MP_STATE_HALTED};

    const APIC_SVR: usize = 0xf0;
    const APIC_IRR: usize = 0x200;
    const VECTOR: usize = 0x41;

    fn reg(l: &kvm_lapic_state, off: usize) -> u32 {
        let b: Vec<u8> = l.regs[off..off + 4].iter().map(|&x| x as u8).collect();
        u32::from_le_bytes(b.try_into().unwrap())
    }

    fn set_reg(l: &mut kvm_lapic_state, off: usize, v: u32) {
        for (i, b) in v.to_le_bytes().iter().enumerate() {
            l.regs[off + i] = *b as _;
        }
    }

    fn vm_with_two_vcpus(kvm: &kvm_ioctls::Kvm) -> (VmFd, Vec<VcpuFd>) {
        let vm = kvm.create_vm().unwrap();
        vm.create_irq_chip().unwrap();
        let vcpus = (0..2).map(|i| vm.create_vcpu(i).unwrap()).collect();
        (vm, vcpus)
    }

    /// A two-vCPU VM's state moves whole: vCPU 0 running with its registers, vCPU 1 halted
    /// in the guest's idle loop with an interrupt pending in its local APIC's IRR. Each
    /// comes back on the new VM's vCPU of the same id, halted and still pending.
    #[test]
    fn every_vcpu_moves_including_a_halted_one_with_an_interrupt_pending() {
        let kvm = kvm_ioctls::Kvm::new().expect("/dev/kvm is required by the vmm tests");
        let (vm, mut vcpus) = vm_with_two_vcpus(&kvm);
        let caps = KvmCaps::probe(&kvm, &vm);
        let mut regs = vcpus[0].get_regs().unwrap();
        regs.rip = 0x1000;
        regs.rax = 0xb5b0;
        vcpus[0].set_regs(&regs).unwrap();
        vcpus[0]
            .set_mp_state(kvm_mp_state {
                mp_state: kvm_bindings::KVM_MP_STATE_RUNNABLE,
            })
            .unwrap();
        let mut regs = vcpus[1].get_regs().unwrap();
        regs.rip = 0x2000;
        regs.rax = 0xa9;
        vcpus[1].set_regs(&regs).unwrap();
        let mut lapic = vcpus[1].get_lapic().unwrap();
        set_reg(&mut lapic, APIC_SVR, 0x1ff);
        let irr = APIC_IRR + (VECTOR / 32) * 0x10;
        set_reg(&mut lapic, irr, 1 << (VECTOR % 32));
        vcpus[1].set_lapic(&lapic).unwrap();
        vcpus[1]
            .set_mp_state(kvm_mp_state {
                mp_state: KVM_MP_STATE_HALTED,
            })
            .unwrap();

        let saved: Vec<VcpuState> = vcpus
            .iter_mut()
            .enumerate()
            .map(|(i, fd)| save_vcpu(fd, i as u8, &caps).unwrap())
            .collect();
        assert_eq!(saved.len(), 2);

        let (_vm2, vcpus2) = vm_with_two_vcpus(&kvm);
        for (fd, s) in vcpus2.iter().zip(&saved) {
            restore_vcpu(fd, s, &caps).unwrap();
        }
        let r0 = vcpus2[0].get_regs().unwrap();
        assert_eq!((r0.rip, r0.rax), (0x1000, 0xb5b0));
        let r1 = vcpus2[1].get_regs().unwrap();
        assert_eq!((r1.rip, r1.rax), (0x2000, 0xa9));
        assert_eq!(
            vcpus2[1].get_mp_state().unwrap().mp_state,
            KVM_MP_STATE_HALTED,
            "vCPU 1 is still halted"
        );
        let l1 = vcpus2[1].get_lapic().unwrap();
        assert_ne!(
            reg(&l1, irr) & (1 << (VECTOR % 32)),
            0,
            "vector {VECTOR:#x} is still pending in vCPU 1's IRR"
        );
        assert_eq!(reg(&l1, APIC_SVR) & 0x100, 0x100, "its LAPIC stays enabled");
        assert_ne!(
            vcpus2[0].get_mp_state().unwrap().mp_state,
            KVM_MP_STATE_HALTED,
            "vCPU 0 was not halted"
        );
    }
}
