//! KVM interrupt plumbing behind `pci::interrupt`: GSI allocation, the GSI routing table,
//! MSI/MSI-X groups (one irqfd per vector) and INTx groups (irqfd + resample).
//!
//! Cloud Hypervisor's shape: every route change pushes the *whole* table with
//! `KVM_SET_GSI_ROUTING` (the ioctl replaces the table, so the legacy PIC/IOAPIC routes of
//! GSIs 0..24 are always part of it); MSI GSIs are allocated above the IOAPIC pins, lazily on a
//! vector's first unmask, and freed when their group is dropped.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvm_bindings::{
    kvm_irq_routing_entry, kvm_irq_routing_entry__bindgen_ty_1, kvm_irq_routing_irqchip,
    kvm_irq_routing_msi, kvm_irq_routing_msi__bindgen_ty_1, KvmIrqRouting, KVM_IRQCHIP_IOAPIC,
    KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI,
    KVM_MSI_VALID_DEVID,
};
use kvm_ioctls::VmFd;
use pci::interrupt::{
    InterruptError, InterruptIndex, InterruptManager, InterruptSourceGroup, MsiIrqSourceConfig,
};
use vmm_sys_util::eventfd::EventFd;

use crate::id_alloc::IdAllocator;
use crate::layout::IOAPIC_PINS;

/// KVM's maximum number of GSI routes (entries of the routing table).
pub const MAX_ROUTES: u32 = 4096;
/// Entries the legacy interrupt controllers take in the table: the PICs' 16 pins and the
/// IOAPIC's 24 (GSIs 0-15 have an entry on each).
pub const LEGACY_ROUTES: u32 = 16 + IOAPIC_PINS;
/// MSI/MSI-X routes the table holds beside them: one GSI each, so the GSI allocator hands
/// out no more (a GSI past them would get a number but no route).
pub const MSI_ROUTES: u32 = MAX_ROUTES - LEGACY_ROUTES;

fn backend(op: &'static str, e: impl Into<std::io::Error>) -> InterruptError {
    InterruptError::Backend {
        op,
        source: e.into(),
    }
}

fn kvm_err(e: kvm_ioctls::Error) -> std::io::Error {
    std::io::Error::from_raw_os_error(e.errno())
}

/// Hands out GSIs in `[first, end)`, reusing freed ones (lowest first).
pub type GsiAllocator = IdAllocator;

/// A GSI owned by a value; dropping it returns the GSI to the allocator.
#[derive(Debug)]
pub struct Gsi {
    gsi: u32,
    alloc: Arc<Mutex<GsiAllocator>>,
}

impl Gsi {
    /// Allocates a GSI from `alloc`.
    pub fn allocate(alloc: &Arc<Mutex<GsiAllocator>>) -> Option<Gsi> {
        let gsi = alloc.lock().unwrap_or_else(|e| e.into_inner()).allocate()?;
        Some(Gsi {
            gsi,
            alloc: alloc.clone(),
        })
    }

    pub fn raw(&self) -> u32 {
        self.gsi
    }
}

impl Drop for Gsi {
    fn drop(&mut self) {
        self.alloc
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .release(self.gsi);
    }
}

/// Destination of one GSI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// A PIC or IOAPIC input pin.
    Irqchip { chip: u32, pin: u32 },
    /// An MSI message.
    Msi {
        address_lo: u32,
        address_hi: u32,
        data: u32,
        devid: Option<u32>,
    },
}

impl Route {
    /// The MSI route of an MSI/MSI-X message.
    pub fn msi(cfg: &MsiIrqSourceConfig, use_devid: bool) -> Self {
        Route::Msi {
            address_lo: cfg.low_addr,
            address_hi: cfg.high_addr,
            data: cfg.data,
            devid: use_devid.then_some(cfg.devid),
        }
    }

    fn to_kvm(self, gsi: u32) -> kvm_irq_routing_entry {
        match self {
            Route::Irqchip { chip, pin } => kvm_irq_routing_entry {
                gsi,
                type_: KVM_IRQ_ROUTING_IRQCHIP,
                flags: 0,
                pad: 0,
                u: kvm_irq_routing_entry__bindgen_ty_1 {
                    irqchip: kvm_irq_routing_irqchip { irqchip: chip, pin },
                },
            },
            Route::Msi {
                address_lo,
                address_hi,
                data,
                devid,
            } => kvm_irq_routing_entry {
                gsi,
                type_: KVM_IRQ_ROUTING_MSI,
                flags: if devid.is_some() {
                    KVM_MSI_VALID_DEVID
                } else {
                    0
                },
                pad: 0,
                u: kvm_irq_routing_entry__bindgen_ty_1 {
                    msi: kvm_irq_routing_msi {
                        address_lo,
                        address_hi,
                        data,
                        __bindgen_anon_1: kvm_irq_routing_msi__bindgen_ty_1 {
                            devid: devid.unwrap_or(0),
                        },
                    },
                },
            },
        }
    }
}

/// KVM's default routes: GSI 0..16 to the PICs, GSI 0..24 to the IOAPIC pins.
pub fn legacy_routes() -> Vec<(u32, Route)> {
    let mut v = Vec::new();
    for gsi in 0..IOAPIC_PINS {
        if gsi < 16 {
            let chip = if gsi < 8 {
                KVM_IRQCHIP_PIC_MASTER
            } else {
                KVM_IRQCHIP_PIC_SLAVE
            };
            v.push((gsi, Route::Irqchip { chip, pin: gsi % 8 }));
        }
        v.push((
            gsi,
            Route::Irqchip {
                chip: KVM_IRQCHIP_IOAPIC,
                pin: gsi,
            },
        ));
    }
    v
}

/// The full routing table: legacy routes followed by the MSI routes in GSI order (pure).
pub fn build_table(msi: &BTreeMap<u32, Route>) -> Vec<(u32, Route)> {
    let mut v = legacy_routes();
    v.extend(msi.iter().map(|(g, r)| (*g, *r)));
    v
}

/// The VM's GSI routing table; every change is pushed to KVM as a whole.
pub struct RouteTable {
    vm: Arc<VmFd>,
    msi: Mutex<BTreeMap<u32, Route>>,
}

impl RouteTable {
    pub fn new(vm: Arc<VmFd>) -> Self {
        Self {
            vm,
            msi: Mutex::new(BTreeMap::new()),
        }
    }

    fn push(&self, msi: &BTreeMap<u32, Route>) -> Result<(), InterruptError> {
        let entries: Vec<kvm_irq_routing_entry> = build_table(msi)
            .into_iter()
            .map(|(g, r)| r.to_kvm(g))
            .collect();
        let routing = KvmIrqRouting::from_entries(&entries).map_err(|_| {
            InterruptError::Exhausted(format!("{} GSI routes exceed the table", entries.len()))
        })?;
        self.vm
            .set_gsi_routing(&routing)
            .map_err(|e| backend("KVM_SET_GSI_ROUTING", kvm_err(e)))
    }

    /// Installs (or replaces) the route of `gsi`.
    pub fn set(&self, gsi: u32, route: Route) -> Result<(), InterruptError> {
        let mut msi = self.msi.lock().unwrap_or_else(|e| e.into_inner());
        if msi.get(&gsi) == Some(&route) {
            return Ok(());
        }
        let old = msi.insert(gsi, route);
        if let Err(e) = self.push(&msi) {
            match old {
                Some(o) => msi.insert(gsi, o),
                None => msi.remove(&gsi),
            };
            return Err(e);
        }
        Ok(())
    }

    /// Removes the routes of `gsis` (one push).
    pub fn remove(&self, gsis: &[u32]) -> Result<(), InterruptError> {
        let mut msi = self.msi.lock().unwrap_or_else(|e| e.into_inner());
        let mut changed = false;
        for g in gsis {
            changed |= msi.remove(g).is_some();
        }
        if changed {
            self.push(&msi)?;
        }
        Ok(())
    }

    /// The GSI routed to the MSI message `address_lo`/`data`, if any (inspection).
    pub fn gsi_of_msi(&self, address_lo: u32, data: u32) -> Option<u32> {
        let msi = self.msi.lock().unwrap_or_else(|e| e.into_inner());
        msi.iter().find_map(|(g, r)| match r {
            Route::Msi {
                address_lo: a,
                data: d,
                ..
            } if *a == address_lo && *d == data => Some(*g),
            _ => None,
        })
    }

    /// Number of non-legacy routes installed.
    pub fn msi_routes(&self) -> usize {
        self.msi.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// Pushes the legacy-only table (called once at VM creation).
    pub fn install_legacy(&self) -> Result<(), InterruptError> {
        let msi = self.msi.lock().unwrap_or_else(|e| e.into_inner());
        self.push(&msi)
    }
}

/// The VM's interrupt manager: creates MSI and INTx groups.
pub struct KvmInterruptManager {
    vm: Arc<VmFd>,
    /// vCPUs of the VM: their local APIC ids are 0..vcpus (the MADT's).
    vcpus: u8,
    gsis: Arc<Mutex<GsiAllocator>>,
    routes: Arc<RouteTable>,
    use_devid: bool,
    irqfds: Arc<AtomicUsize>,
}

impl KvmInterruptManager {
    /// Creates the manager of a VM with `vcpus` vCPUs and pushes the legacy routing table.
    pub fn new(vm: Arc<VmFd>, vcpus: u8) -> Result<Self, InterruptError> {
        let routes = Arc::new(RouteTable::new(vm.clone()));
        routes.install_legacy()?;
        let use_devid = vm.check_extension(kvm_ioctls::Cap::MsiDevid);
        Ok(Self {
            vm,
            vcpus,
            gsis: Arc::new(Mutex::new(GsiAllocator::new(
                "GSI",
                IOAPIC_PINS,
                IOAPIC_PINS + MSI_ROUTES,
            ))),
            routes,
            use_devid,
            irqfds: Arc::default(),
        })
    }

    /// Irqfds currently registered with KVM by the groups of this manager (leak accounting).
    pub fn irqfds_registered(&self) -> usize {
        self.irqfds.load(Ordering::SeqCst)
    }

    /// The routing table (for inspection in tests).
    pub fn routes(&self) -> &Arc<RouteTable> {
        &self.routes
    }

    /// The GSI allocator (for leak accounting).
    pub fn gsi_allocator(&self) -> &Arc<Mutex<GsiAllocator>> {
        &self.gsis
    }
}

impl InterruptManager for KvmInterruptManager {
    fn create_msi_group(
        &self,
        count: InterruptIndex,
    ) -> Result<Arc<dyn InterruptSourceGroup>, InterruptError> {
        if count == 0 || count > 2048 {
            return Err(InterruptError::Exhausted(format!(
                "an MSI group of {count} vectors (1..=2048 allowed)"
            )));
        }
        let mut irqfds = Vec::with_capacity(count as usize);
        for _ in 0..count {
            irqfds.push(EventFd::new(libc::EFD_NONBLOCK).map_err(|e| backend("eventfd", e))?);
        }
        Ok(Arc::new(KvmMsiGroup {
            vm: self.vm.clone(),
            vcpus: self.vcpus,
            gsis: self.gsis.clone(),
            routes: self.routes.clone(),
            use_devid: self.use_devid,
            registered: self.irqfds.clone(),
            irqfds,
            state: Mutex::new((0..count).map(|_| VectorState::masked()).collect()),
            enabled: AtomicBool::new(false),
            #[cfg(test)]
            fail_unregister: AtomicBool::new(false),
        }))
    }

    fn create_intx_group(&self, irq: u32) -> Result<Arc<dyn InterruptSourceGroup>, InterruptError> {
        if irq >= IOAPIC_PINS {
            return Err(InterruptError::InvalidIndex {
                index: irq,
                count: IOAPIC_PINS,
            });
        }
        let group = KvmIntxGroup {
            vm: self.vm.clone(),
            irq,
            irqfd: EventFd::new(libc::EFD_NONBLOCK).map_err(|e| backend("eventfd", e))?,
            resample: EventFd::new(libc::EFD_NONBLOCK).map_err(|e| backend("eventfd", e))?,
            registered: Mutex::new(false),
            count: self.irqfds.clone(),
        };
        group.enable()?;
        Ok(Arc::new(group))
    }
}

#[derive(Debug)]
struct VectorState {
    config: MsiIrqSourceConfig,
    masked: bool,
    gsi: Option<Gsi>,
    registered: bool,
}

impl VectorState {
    /// Vectors start masked (MSI-X reset state).
    fn masked() -> Self {
        Self {
            config: MsiIrqSourceConfig::default(),
            masked: true,
            gsi: None,
            registered: false,
        }
    }
}

/// MSI / MSI-X vectors of one device: an irqfd per vector, GSI + route on first unmask.
pub struct KvmMsiGroup {
    vm: Arc<VmFd>,
    vcpus: u8,
    gsis: Arc<Mutex<GsiAllocator>>,
    routes: Arc<RouteTable>,
    use_devid: bool,
    /// The manager's count of registered irqfds.
    registered: Arc<AtomicUsize>,
    irqfds: Vec<EventFd>,
    state: Mutex<Vec<VectorState>>,
    enabled: AtomicBool,
    /// Tests: make `KVM_IRQFD` deassign fail, as a kernel could.
    #[cfg(test)]
    fail_unregister: AtomicBool,
}

impl KvmMsiGroup {
    fn check(&self, index: InterruptIndex) -> Result<usize, InterruptError> {
        if (index as usize) < self.irqfds.len() {
            Ok(index as usize)
        } else {
            Err(InterruptError::InvalidIndex {
                index,
                count: self.irqfds.len() as u32,
            })
        }
    }

    /// Routes and registers vector `i` if it is unmasked and the group is enabled.
    fn arm(&self, i: usize, v: &mut VectorState) -> Result<(), InterruptError> {
        if v.masked {
            return Ok(());
        }
        if v.gsi.is_none() {
            v.gsi = Some(Gsi::allocate(&self.gsis).ok_or_else(|| {
                let in_use = self.gsis.lock().map_or(0, |a| a.in_use());
                InterruptError::Exhausted(format!(
                    "no free GSI for MSI vector {i}: the VM's {in_use} GSIs for MSI/MSI-X \
                     (KVM's {MAX_ROUTES} routes less the {LEGACY_ROUTES} of the PICs and the \
                     IOAPIC) are all in use by enabled vectors; this vector stays unrouted"
                ))
            })?);
        }
        let gsi = v.gsi.as_ref().map(Gsi::raw).unwrap_or(0);
        self.routes
            .set(gsi, Route::msi(&v.config, self.use_devid))?;
        if self.enabled.load(Ordering::SeqCst) && !v.registered {
            self.vm
                .register_irqfd(&self.irqfds[i], gsi)
                .map_err(|e| backend("KVM_IRQFD", kvm_err(e)))?;
            v.registered = true;
            self.registered.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }

    fn disarm(&self, i: usize, v: &mut VectorState) -> Result<(), InterruptError> {
        if let (true, Some(gsi)) = (v.registered, v.gsi.as_ref()) {
            #[cfg(test)]
            if self.fail_unregister.load(Ordering::SeqCst) {
                return Err(backend(
                    "KVM_IRQFD deassign",
                    std::io::Error::other("injected"),
                ));
            }
            self.vm
                .unregister_irqfd(&self.irqfds[i], gsi.raw())
                .map_err(|e| backend("KVM_IRQFD deassign", kvm_err(e)))?;
            v.registered = false;
            self.registered.fetch_sub(1, Ordering::SeqCst);
        }
        Ok(())
    }

    /// GSI of vector `index`, if allocated.
    pub fn gsi(&self, index: InterruptIndex) -> Option<u32> {
        let st = self.state.lock().ok()?;
        st.get(index as usize)?.gsi.as_ref().map(Gsi::raw)
    }
}

impl InterruptSourceGroup for KvmMsiGroup {
    fn trigger(&self, index: InterruptIndex) -> Result<(), InterruptError> {
        let i = self.check(index)?;
        self.irqfds[i]
            .write(1)
            .map_err(|e| backend("eventfd write", e))
    }

    fn notifier(&self, index: InterruptIndex) -> Option<&EventFd> {
        self.irqfds.get(index as usize)
    }

    fn update(
        &self,
        index: InterruptIndex,
        config: MsiIrqSourceConfig,
        masked: bool,
    ) -> Result<(), InterruptError> {
        let i = self.check(index)?;
        log::debug!(
            "msi vector {i}: address {:#x} data {:#x}{}",
            config.low_addr,
            config.data,
            if masked { " (masked)" } else { "" }
        );
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let v = &mut st[i];
        v.config = config;
        v.masked = masked;
        if masked {
            self.disarm(i, v)
        } else {
            self.arm(i, v)
        }
    }

    fn enable(&self) -> Result<(), InterruptError> {
        self.enabled.store(true, Ordering::SeqCst);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for (i, v) in st.iter_mut().enumerate() {
            self.arm(i, v)?;
        }
        Ok(())
    }

    fn disable(&self) -> Result<(), InterruptError> {
        self.enabled.store(false, Ordering::SeqCst);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for (i, v) in st.iter_mut().enumerate() {
            self.disarm(i, v)?;
        }
        Ok(())
    }

    fn count(&self) -> InterruptIndex {
        self.irqfds.len() as InterruptIndex
    }

    fn destination_exists(&self, config: &MsiIrqSourceConfig) -> bool {
        msi_destination_exists(config.low_addr, self.vcpus)
    }
}

/// Whether an x86 MSI address (bits 19:12 destination id, bit 2 destination mode) names a
/// local APIC of a VM with `vcpus` vCPUs, whose APIC ids are 0..vcpus. Physical mode: that
/// id, or 0xff (broadcast). Logical mode: the guest programs the logical ids itself (flat or
/// cluster), so only an empty destination, which reaches no vCPU, is refused.
pub fn msi_destination_exists(low_addr: u32, vcpus: u8) -> bool {
    let dest = (low_addr >> 12) & 0xff;
    let logical = low_addr & (1 << 2) != 0;
    if logical {
        dest != 0
    } else {
        dest == 0xff || dest < u32::from(vcpus)
    }
}

impl Drop for KvmMsiGroup {
    fn drop(&mut self) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut gsis = Vec::new();
        for i in 0..st.len() {
            let v = &mut st[i];
            let Err(e) = self.disarm(i, v) else {
                if let Some(g) = v.gsi.as_ref() {
                    gsis.push(g.raw());
                }
                continue;
            };
            // The irqfd may still be attached to its GSI: if the number went back to the
            // allocator, the next device's vector could get it and receive this device's
            // stale interrupts. The number stays allocated for good (the leak counter shows
            // it) and only its route is removed, so the stale irqfd reaches nothing.
            if let Some(g) = v.gsi.take() {
                log::error!(
                    "MSI vector {i}: {e}; GSI {} stays out of use while its irqfd may live",
                    g.raw()
                );
                gsis.push(g.raw());
                std::mem::forget(g);
            }
        }
        if let Err(e) = self.routes.remove(&gsis) {
            log::warn!("removing MSI routes {gsis:?}: {e}");
        }
        // The `Gsi`s in `st` return their numbers to the allocator when `st` is dropped.
        for v in st.iter_mut() {
            v.gsi = None;
        }
    }
}

/// One level-triggered INTx line on an IOAPIC pin: irqfd with a resample eventfd.
pub struct KvmIntxGroup {
    vm: Arc<VmFd>,
    irq: u32,
    irqfd: EventFd,
    resample: EventFd,
    registered: Mutex<bool>,
    /// The manager's count of registered irqfds.
    count: Arc<AtomicUsize>,
}

impl InterruptSourceGroup for KvmIntxGroup {
    fn trigger(&self, index: InterruptIndex) -> Result<(), InterruptError> {
        if index != 0 {
            return Err(InterruptError::InvalidIndex { index, count: 1 });
        }
        self.irqfd.write(1).map_err(|e| backend("eventfd write", e))
    }

    fn notifier(&self, index: InterruptIndex) -> Option<&EventFd> {
        (index == 0).then_some(&self.irqfd)
    }

    fn update(
        &self,
        _index: InterruptIndex,
        _config: MsiIrqSourceConfig,
        _masked: bool,
    ) -> Result<(), InterruptError> {
        Err(InterruptError::Unsupported("update on an INTx group"))
    }

    fn enable(&self) -> Result<(), InterruptError> {
        let mut reg = self.registered.lock().unwrap_or_else(|e| e.into_inner());
        if !*reg {
            self.vm
                .register_irqfd_with_resample(&self.irqfd, &self.resample, self.irq)
                .map_err(|e| backend("KVM_IRQFD resample", kvm_err(e)))?;
            *reg = true;
            self.count.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }

    fn disable(&self) -> Result<(), InterruptError> {
        let mut reg = self.registered.lock().unwrap_or_else(|e| e.into_inner());
        if *reg {
            self.vm
                .unregister_irqfd(&self.irqfd, self.irq)
                .map_err(|e| backend("KVM_IRQFD deassign", kvm_err(e)))?;
            *reg = false;
            self.count.fetch_sub(1, Ordering::SeqCst);
        }
        Ok(())
    }

    fn count(&self) -> InterruptIndex {
        1
    }

    fn resample_notifier(&self, index: InterruptIndex) -> Option<&EventFd> {
        (index == 0).then_some(&self.resample)
    }
}

impl Drop for KvmIntxGroup {
    fn drop(&mut self) {
        if let Err(e) = self.disable() {
            log::warn!("INTx {}: {e}", self.irq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gsi_allocator_reuses_freed_and_stops_at_end() {
        let a = Arc::new(Mutex::new(GsiAllocator::new("GSI", 24, 27)));
        let g1 = Gsi::allocate(&a).unwrap();
        let g2 = Gsi::allocate(&a).unwrap();
        let g3 = Gsi::allocate(&a).unwrap();
        assert_eq!((g1.raw(), g2.raw(), g3.raw()), (24, 25, 26));
        assert!(Gsi::allocate(&a).is_none());
        assert_eq!(a.lock().unwrap().in_use(), 3);
        drop(g2);
        let g4 = Gsi::allocate(&a).unwrap();
        assert_eq!(g4.raw(), 25);
        drop((g1, g3, g4));
        assert_eq!(a.lock().unwrap().in_use(), 0);
    }

    #[test]
    fn route_table_keeps_legacy_routes_and_sorts_msi() {
        let mut msi = BTreeMap::new();
        let cfg = MsiIrqSourceConfig {
            high_addr: 0,
            low_addr: 0xfee0_0000,
            data: 0x41,
            devid: 0x10,
        };
        msi.insert(30, Route::msi(&cfg, false));
        msi.insert(24, Route::msi(&cfg, true));
        let t = build_table(&msi);
        assert_eq!(t.len(), 16 + 24 + 2);
        assert!(t.contains(&(
            4,
            Route::Irqchip {
                chip: KVM_IRQCHIP_IOAPIC,
                pin: 4
            }
        )));
        assert!(t.contains(&(
            9,
            Route::Irqchip {
                chip: KVM_IRQCHIP_PIC_SLAVE,
                pin: 1
            }
        )));
        assert_eq!(t[t.len() - 2].0, 24);
        assert_eq!(t[t.len() - 1].0, 30);
        let k = t[t.len() - 2].1.to_kvm(24);
        assert_eq!(k.type_, KVM_IRQ_ROUTING_MSI);
        assert_eq!(k.flags, KVM_MSI_VALID_DEVID);
        // SAFETY: the entry was built as an MSI route.
        let m = unsafe { k.u.msi };
        assert_eq!((m.address_lo, m.data), (0xfee0_0000, 0x41));
    }

    fn kvm() -> kvm_ioctls::Kvm {
        kvm_ioctls::Kvm::new().expect("/dev/kvm is required by the vmm tests")
    }

    /// A GSI whose irqfd could not be deassigned never goes back to the allocator (it would
    /// route this device's stale interrupts to the next user); its route is removed.
    #[test]
    fn gsi_is_kept_while_its_irqfd_may_live() {
        let vm = Arc::new(kvm().create_vm().unwrap());
        vm.create_irq_chip().unwrap();
        let mgr = KvmInterruptManager::new(vm, 2).unwrap();
        let group = Arc::new(KvmMsiGroup {
            vm: mgr.vm.clone(),
            vcpus: mgr.vcpus,
            gsis: mgr.gsis.clone(),
            routes: mgr.routes.clone(),
            use_devid: mgr.use_devid,
            registered: mgr.irqfds.clone(),
            irqfds: (0..2)
                .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
                .collect(),
            state: Mutex::new((0..2).map(|_| VectorState::masked()).collect()),
            enabled: AtomicBool::new(false),
            fail_unregister: AtomicBool::new(false),
        });
        let cfg = MsiIrqSourceConfig {
            low_addr: 0xfee0_0000,
            data: 0x40,
            ..Default::default()
        };
        group.enable().unwrap();
        group.update(0, cfg, false).unwrap();
        group.update(1, cfg, false).unwrap();
        let stuck = group.gsi(0).unwrap();
        assert_eq!(mgr.gsi_allocator().lock().unwrap().in_use(), 2);
        group.fail_unregister.store(true, Ordering::SeqCst);
        drop(group);
        assert_eq!(mgr.routes().msi_routes(), 0, "every route removed");
        assert_eq!(
            mgr.gsi_allocator().lock().unwrap().in_use(),
            2,
            "neither GSI returned while its irqfd may be attached"
        );
        // A new vector never gets the stuck number.
        let again = Gsi::allocate(mgr.gsi_allocator()).unwrap();
        assert_ne!(again.raw(), stuck);
    }

    /// Exercises the KVM side.
    #[test]
    fn msi_group_allocates_and_frees_gsis_with_kvm() {
        let kvm = kvm();
        let vm = Arc::new(kvm.create_vm().unwrap());
        vm.create_irq_chip().unwrap();
        let mgr = KvmInterruptManager::new(vm, 2).unwrap();
        let group = mgr.create_msi_group(4).unwrap();
        assert_eq!(group.count(), 4);
        let cfg = MsiIrqSourceConfig {
            low_addr: 0xfee0_0000,
            data: 0x40,
            ..Default::default()
        };
        group.update(1, cfg, false).unwrap();
        group.enable().unwrap();
        group.update(2, cfg, false).unwrap();
        assert_eq!(mgr.routes().msi_routes(), 2);
        group.update(2, cfg, true).unwrap();
        group.trigger(1).unwrap();
        assert!(group.update(4, cfg, false).is_err());
        group.disable().unwrap();
        drop(group);
        assert_eq!(mgr.routes().msi_routes(), 0);
        let alloc = mgr.gsi_allocator().lock().unwrap();
        assert_eq!(alloc.in_use(), 0, "both GSIs returned");
        drop(alloc);
        let intx = mgr.create_intx_group(5).unwrap();
        assert!(intx.resample_notifier(0).is_some());
        intx.trigger(0).unwrap();
        assert!(mgr.create_intx_group(24).is_err());
    }

    /// More MSI-X vectors than the VM can route: two functions of 2048 vectors each ask for
    /// more GSIs than KVM's 4096 routes leave after the IOAPIC's pins. Every vector up to the
    /// last free GSI is routed, the rest are refused by name (the function keeps working
    /// on the routed ones), and dropping one function gives its GSIs to the other.
    #[test]
    fn more_vectors_than_the_vm_can_route_are_refused_by_name() {
        let vm = Arc::new(kvm().create_vm().unwrap());
        vm.create_irq_chip().unwrap();
        let mgr = KvmInterruptManager::new(vm, 2).unwrap();
        let cfg = MsiIrqSourceConfig {
            low_addr: 0xfee0_0000,
            data: 0x40,
            ..Default::default()
        };
        let free = MSI_ROUTES as usize;
        let a = mgr.create_msi_group(2048).unwrap();
        let b = mgr.create_msi_group(2048).unwrap();
        for g in [&a, &b] {
            g.enable().unwrap();
        }
        let mut refused = Vec::new();
        for (name, g) in [("a", &a), ("b", &b)] {
            for i in 0..2048 {
                if let Err(e) = g.update(i, cfg, false) {
                    refused.push((name, i, e.to_string()));
                }
            }
        }
        assert_eq!(refused.len(), 4096 - free, "{:?}", refused.first());
        assert!(refused.iter().all(|(n, _, _)| *n == "b"));
        let (_, first, msg) = &refused[0];
        assert_eq!(*first as usize, free - 2048);
        assert!(msg.contains("no free GSI for MSI vector"), "{msg}");
        assert!(msg.contains(&format!("{free} GSIs")), "{msg}");
        assert_eq!(mgr.routes().msi_routes(), free);
        a.trigger(0).unwrap();
        drop(a);
        // b's refused vectors route now.
        for (_, i, _) in &refused {
            b.update(*i, cfg, false).unwrap();
        }
        assert_eq!(mgr.routes().msi_routes(), 2048);
        drop(b);
        assert_eq!(mgr.routes().msi_routes(), 0);
        assert_eq!(mgr.gsi_allocator().lock().unwrap().in_use(), 0);
    }

    /// Physical destinations are the vCPUs' APIC ids (0..n) or the broadcast id; logical ones
    /// only need some destination bit.
    #[test]
    fn msi_destinations_are_the_vcpus_apic_ids() {
        let phys = |id: u32| 0xfee0_0000 | (id << 12);
        let logical = |mask: u32| 0xfee0_0000 | (mask << 12) | (1 << 2);
        assert!(msi_destination_exists(phys(0), 2));
        assert!(msi_destination_exists(phys(1), 2));
        assert!(!msi_destination_exists(phys(2), 2), "no vCPU has APIC id 2");
        assert!(!msi_destination_exists(phys(0x7f), 8));
        assert!(msi_destination_exists(phys(0xff), 1), "broadcast");
        assert!(msi_destination_exists(logical(0b10), 2));
        assert!(
            !msi_destination_exists(logical(0), 2),
            "an empty logical set"
        );
    }

    /// An affinity change rewrites an unmasked vector's message: the vector keeps its GSI and
    /// its registered irqfd (the same eventfd), and only the route changes; a message aimed
    /// at an APIC id that no vCPU has is refused by the group.
    #[test]
    fn new_destination_reroutes_the_gsi_and_keeps_the_irqfd() {
        let kvm = kvm();
        let vm = Arc::new(kvm.create_vm().unwrap());
        vm.create_irq_chip().unwrap();
        let mgr = KvmInterruptManager::new(vm, 2).unwrap();
        let group = mgr.create_msi_group(2).unwrap();
        let to = |apic: u32| MsiIrqSourceConfig {
            low_addr: 0xfee0_0000 | (apic << 12),
            data: 0x41,
            ..Default::default()
        };
        group.enable().unwrap();
        group.update(0, to(0), false).unwrap();
        let gsi = mgr.routes().gsi_of_msi(0xfee0_0000, 0x41);
        assert!(gsi.is_some());
        assert_eq!(mgr.irqfds_registered(), 1);
        group.update(0, to(1), false).unwrap();
        assert_eq!(mgr.irqfds_registered(), 1, "the irqfd stayed registered");
        assert_eq!(
            mgr.routes().gsi_of_msi(0xfee0_1000, 0x41),
            gsi,
            "same GSI, new route"
        );
        assert_eq!(mgr.routes().gsi_of_msi(0xfee0_0000, 0x41), None);
        assert_eq!(mgr.routes().msi_routes(), 1);
        assert!(group.destination_exists(&to(1)));
        assert!(!group.destination_exists(&to(2)));
    }
}
