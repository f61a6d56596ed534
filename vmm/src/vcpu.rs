//! vCPUs: creation and boot state, one thread per vCPU running `KVM_RUN`, exit dispatch to the
//! PIO/MMIO buses, and the signal kick that gets a vCPU out of `KVM_RUN`.
//!
//! With the in-kernel irqchip a guest `hlt` blocks inside `KVM_RUN`, so a stop request alone
//! cannot reach a halted vCPU. [`Vcpus::stop`] therefore raises the stop flag and sends
//! [`kick_signal`] to each vCPU thread repeatedly until the thread has left its loop: the signal
//! makes `KVM_RUN` return `EINTR` (or, if it lands just before the ioctl, the next kick does),
//! and the loop checks the flag before every entry.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{CpuId, KVM_INTERNAL_ERROR_EMULATION, KVM_SYSTEM_EVENT_CRASH};
use kvm_ioctls::{VcpuExit, VcpuFd, VmFd};
use pci::Bus;
use vm_memory::{Bytes, GuestAddress};

use crate::arch::{self, ArchError};
use crate::cpuid::{self, CpuidError};
use crate::exit::{ExitNotifier, VmExit};
use crate::memory::GuestMemory;
use crate::stats::{self, StatsError, VcpuStats};

/// Errors of vCPU creation.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("cannot create vCPU {id}")]
    Create {
        id: u8,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("vCPU {id}: CPUID")]
    Cpuid {
        id: u8,
        #[source]
        source: CpuidError,
    },
    #[error("vCPU {id}: KVM rejected the CPUID table")]
    SetCpuid {
        id: u8,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("vCPU {id}: boot state")]
    Arch {
        id: u8,
        #[source]
        source: ArchError,
    },
    #[error("cannot spawn the thread of vCPU {id}")]
    Spawn {
        id: u8,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot install the vCPU kick signal handler")]
    Signal(#[source] vmm_sys_util::errno::Error),
    #[error("only {parked} of {count} vCPUs paused in time")]
    PauseTimeout { parked: usize, count: usize },
    #[error("the vCPUs are not paused")]
    NotPaused,
    #[error("only {done} of {count} vCPUs ran their job in time")]
    JobTimeout { done: usize, count: usize },
}

/// Real-time signal used to kick vCPU threads out of `KVM_RUN`.
pub fn kick_signal() -> i32 {
    vmm_sys_util::signal::SIGRTMIN()
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

fn install_kick_handler() -> Result<(), VcpuError> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = vmm_sys_util::signal::register_signal_handler(kick_signal(), kick_handler)
            .map_err(VcpuError::Signal);
    });
    result
}

/// Creates vCPU `id` of `count` with the filtered CPUID. Returns the fd and the names of
/// masked features KVM still reports after `KVM_SET_CPUID2` (read back on vCPU 0 only; PVM
/// overrides leaves 1 and 7). Boot registers are set later by [`setup_boot_state`].
pub fn create_vcpu(
    vm: &VmFd,
    supported: &CpuId,
    model: cpuid::CpuModel,
    id: u8,
    count: u8,
) -> Result<(VcpuFd, Vec<&'static str>), VcpuError> {
    let fd = vm
        .create_vcpu(u64::from(id))
        .map_err(|source| VcpuError::Create { id, source })?;
    let cpuid = cpuid::filter(supported, model, id, count)
        .map_err(|source| VcpuError::Cpuid { id, source })?;
    fd.set_cpuid2(&cpuid)
        .map_err(|source| VcpuError::SetCpuid { id, source })?;
    let mut visible = Vec::new();
    if id == 0 {
        if let Ok(back) = fd.get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES) {
            visible = cpuid::overridden(back.as_slice(), model);
            if !visible.is_empty() {
                log::info!(
                    "KVM kept these CPUID features visible despite the VMM's mask for CPU \
                     model {model} (PVM overrides leaves 1, 7 and 0xD): {}",
                    visible.join(" ")
                );
            }
        }
    }
    Ok((fd, visible))
}

/// MSRs, registers (entry at `entry`), sregs, FPU and LAPIC of the 64-bit boot state.
pub fn setup_boot_state(fd: &VcpuFd, id: u8, entry: u64) -> Result<(), VcpuError> {
    let arch = |source| VcpuError::Arch { id, source };
    let msrs = arch::setup_msrs(fd).map_err(arch)?;
    log::debug!("vCPU {id}: boot MSRs accepted: {msrs:?}");
    arch::setup_regs(fd, entry).map_err(arch)?;
    arch::setup_sregs(fd).map_err(arch)?;
    arch::setup_fpu(fd).map_err(arch)?;
    arch::setup_lapic(fd).map_err(arch)?;
    Ok(())
}

/// Puts an application processor in its reset state, waiting for INIT and SIPI from the
/// guest (`KVM_MP_STATE_UNINITIALIZED`); its LAPIC keeps KVM's reset values (every LVT
/// masked: LINT0 as ExtINT is the bootstrap processor's alone).
pub fn hold_in_reset(fd: &VcpuFd, id: u8) -> Result<(), VcpuError> {
    fd.set_mp_state(kvm_bindings::kvm_mp_state {
        mp_state: kvm_bindings::KVM_MP_STATE_UNINITIALIZED,
    })
    .map_err(|source| VcpuError::Arch {
        id,
        source: ArchError::Kvm {
            what: "MP state (reset)",
            source,
        },
    })
}

thread_local! {
    static ON_VCPU: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is a vCPU thread. The control plane uses it to check (in debug
/// builds) that no lender round trip of teardown or lease return runs on a vCPU.
pub fn on_vcpu_thread() -> bool {
    ON_VCPU.with(|v| v.get())
}

/// Debug-build guard for work that must never run on a vCPU thread (a lender RPC of teardown
/// or lease return): aborts the process, so a test that exercises such a path fails loudly.
/// Release builds only log.
#[track_caller]
pub fn assert_not_on_vcpu(what: &str) {
    if on_vcpu_thread() {
        let at = std::panic::Location::caller();
        log::error!("{what} on a vCPU thread ({at}): it must run on the control thread");
        if cfg!(debug_assertions) {
            std::process::abort();
        }
    }
}

/// Work for a parked vCPU thread on its own fd (snapshot: reading its KVM state).
pub type VcpuJob = Box<dyn FnOnce(&mut VcpuFd) + Send>;

#[derive(Default)]
struct PauseState {
    requested: bool,
    /// vCPU threads parked by the request.
    parked: usize,
    /// Per vCPU id: a job the parked thread runs on its fd.
    jobs: Vec<Option<VcpuJob>>,
}

/// What the control plane can do to running vCPUs: pause and resume them, and read their
/// KVM statistics. Shared (`Arc`) between the vCPU threads and the controller.
pub struct VcpuControl {
    count: usize,
    pause: Mutex<PauseState>,
    cv: Condvar,
    threads: Mutex<Vec<libc::pthread_t>>,
    stats: Vec<VcpuStats>,
}

impl VcpuControl {
    /// For `count` vCPUs, with the statistics fds that could be opened (a KVM without
    /// `KVM_GET_STATS_FD` gives none, and `vm.counters` then has no KVM figures).
    pub fn new(count: usize, stats: Vec<VcpuStats>) -> Self {
        Self {
            count,
            pause: Mutex::new(PauseState::default()),
            cv: Condvar::new(),
            threads: Mutex::new(Vec::new()),
            stats,
        }
    }

    fn state(&self) -> MutexGuard<'_, PauseState> {
        self.pause.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The vCPUs' KVM statistics, summed (`exits`, `mmio_exits`, `io_exits`, `halt_exits`, ...).
    pub fn kvm_stats(&self) -> Result<BTreeMap<String, u64>, StatsError> {
        stats::sum(&self.stats)
    }

    /// Each vCPU's KVM statistics, in vCPU order (what [`VcpuControl::kvm_stats`] sums).
    pub fn kvm_stats_per_vcpu(&self) -> Result<Vec<BTreeMap<String, u64>>, StatsError> {
        self.stats
            .iter()
            .map(|s| stats::sum(std::slice::from_ref(s)))
            .collect()
    }

    /// Whether KVM statistics are available.
    pub fn has_stats(&self) -> bool {
        !self.stats.is_empty()
    }

    /// Stops every vCPU outside `KVM_RUN` and waits (up to `timeout`) until all are parked.
    /// A halted vCPU is blocked inside KVM, so each thread is kicked with [`kick_signal`]
    /// until it parks.
    pub fn pause(&self, timeout: Duration) -> Result<(), VcpuError> {
        self.state().requested = true;
        let deadline = Instant::now() + timeout;
        loop {
            let parked = self.state().parked;
            let running = self.lock_threads().len();
            if parked >= running {
                log::info!("vcpus: {parked} of {} paused", self.count);
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(VcpuError::PauseTimeout {
                    parked,
                    count: running,
                });
            }
            for &t in self.lock_threads().iter() {
                // SAFETY: the pthread_t belongs to a vCPU thread that deregisters itself before
                // it exits, under the same lock; the signal has a no-op handler installed.
                unsafe { libc::pthread_kill(t, kick_signal()) };
            }
            let st = self.state();
            let _ = self
                .cv
                .wait_timeout(st, Duration::from_millis(5))
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Lets paused vCPUs run again.
    pub fn resume(&self) {
        self.state().requested = false;
        self.cv.notify_all();
        log::info!("vcpus: resumed");
    }

    /// Whether a pause is in effect.
    pub fn is_paused(&self) -> bool {
        self.state().requested
    }

    /// The number of vCPUs.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Makes vCPU threads park before their first `KVM_RUN` (a restored VM starts paused).
    pub fn start_paused(&self) {
        self.state().requested = true;
    }

    /// Runs `job(id, fd)` on every parked vCPU thread (the VM must be paused: only parked
    /// threads run jobs) and returns the results in vCPU order. A vCPU's fd belongs to its
    /// thread, so its KVM state is read there. Waits at most `timeout` in all.
    pub fn run_on_parked<T: Send + 'static>(
        &self,
        job: impl Fn(u8, &mut VcpuFd) -> T + Send + Sync + 'static,
        timeout: Duration,
    ) -> Result<Vec<T>, VcpuError> {
        let job = Arc::new(job);
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let mut st = self.state();
            if !st.requested {
                return Err(VcpuError::NotPaused);
            }
            st.jobs.resize_with(self.count, || None);
            for id in 0..self.count {
                let (job, tx) = (job.clone(), tx.clone());
                st.jobs[id] = Some(Box::new(move |fd: &mut VcpuFd| {
                    let _ = tx.send((id, job(id as u8, fd)));
                }));
            }
        }
        self.cv.notify_all();
        drop(tx);
        let deadline = Instant::now() + timeout;
        let mut out: Vec<Option<T>> = (0..self.count).map(|_| None).collect();
        let mut done = 0;
        while done < self.count {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((id, v)) => {
                    out[id] = Some(v);
                    done += 1;
                }
                Err(_) => {
                    // Jobs not taken yet must not run later, after the caller gave up.
                    self.state().jobs.iter_mut().for_each(|j| *j = None);
                    return Err(VcpuError::JobTimeout {
                        done,
                        count: self.count,
                    });
                }
            }
        }
        Ok(out.into_iter().flatten().collect())
    }

    fn lock_threads(&self) -> MutexGuard<'_, Vec<libc::pthread_t>> {
        self.threads.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Parks the calling vCPU thread while a pause is requested (or until `exit` stops it),
    /// running the jobs posted for it ([`VcpuControl::run_on_parked`]) meanwhile.
    fn park_if_paused(&self, id: u8, fd: &mut VcpuFd, exit: &ExitNotifier) {
        let mut st = self.state();
        if !st.requested {
            return;
        }
        st.parked += 1;
        self.cv.notify_all();
        while st.requested && !exit.should_stop() {
            if let Some(job) = st.jobs.get_mut(usize::from(id)).and_then(Option::take) {
                drop(st);
                job(fd);
                st = self.state();
                continue;
            }
            st = self
                .cv
                .wait_timeout(st, Duration::from_millis(50))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        st.parked -= 1;
    }
}

/// What a vCPU thread needs besides its fd.
#[derive(Clone)]
pub struct VcpuContext {
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub memory: GuestMemory,
    pub exit: Arc<ExitNotifier>,
    pub control: Arc<VcpuControl>,
}

/// Running vCPU threads.
pub struct Vcpus {
    threads: Vec<JoinHandle<()>>,
    exit: Arc<ExitNotifier>,
}

impl Vcpus {
    /// Starts one thread per vCPU fd.
    pub fn start(fds: Vec<VcpuFd>, ctx: VcpuContext) -> Result<Self, VcpuError> {
        install_kick_handler()?;
        let mut threads = Vec::new();
        let exit = ctx.exit.clone();
        for (id, fd) in fds.into_iter().enumerate() {
            let ctx = ctx.clone();
            let id = id as u8;
            let t = std::thread::Builder::new()
                .name(format!("vcpu{id}"))
                .spawn(move || run_loop(id, fd, ctx))
                .map_err(|source| VcpuError::Spawn { id, source })?;
            threads.push(t);
        }
        Ok(Self { threads, exit })
    }

    /// Raises the stop flag and kicks every vCPU thread until it exits, then joins them.
    pub fn stop(self) {
        use std::os::unix::thread::JoinHandleExt;
        self.exit
            .request(VmExit::Shutdown("stopped by the VMM".into()));
        for t in self.threads {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !t.is_finished() && Instant::now() < deadline {
                // SAFETY: the thread has not been joined, so its pthread_t is valid; the signal
                // has a no-op handler installed.
                unsafe { libc::pthread_kill(t.as_pthread_t(), kick_signal()) };
                std::thread::sleep(Duration::from_millis(5));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                log::error!("a vCPU thread did not stop within 10 s; leaving it");
            }
        }
    }
}

enum Next {
    Continue,
    Stop(VmExit),
    InternalError,
    FailEntry(u64),
}

fn run_loop(id: u8, mut fd: VcpuFd, ctx: VcpuContext) {
    log::debug!("vCPU {id} running");
    ON_VCPU.with(|v| v.set(true));
    // SAFETY: pthread_self has no preconditions.
    let me = unsafe { libc::pthread_self() };
    ctx.control.lock_threads().push(me);
    while !ctx.exit.should_stop() {
        ctx.control.park_if_paused(id, &mut fd, &ctx.exit);
        if ctx.exit.should_stop() {
            break;
        }
        let next = match fd.run() {
            Ok(VcpuExit::IoOut(port, data)) => {
                if ctx.pio.write(u64::from(port), data).is_err() {
                    log::trace!("vCPU {id}: out to unclaimed port {port:#x}");
                }
                Next::Continue
            }
            Ok(VcpuExit::IoIn(port, data)) => {
                if ctx.pio.read(u64::from(port), data).is_err() {
                    data.fill(0xff);
                }
                Next::Continue
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                if ctx.mmio.write(addr, data).is_err() {
                    log::trace!("vCPU {id}: write to unclaimed MMIO {addr:#x}");
                }
                Next::Continue
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                if ctx.mmio.read(addr, data).is_err() {
                    data.fill(0xff);
                }
                Next::Continue
            }
            Ok(VcpuExit::Shutdown) => Next::Stop(VmExit::Shutdown(format!(
                "vCPU {id}: guest shut down (KVM_EXIT_SHUTDOWN: triple fault or reset)"
            ))),
            Ok(VcpuExit::SystemEvent(kind, _)) if kind == KVM_SYSTEM_EVENT_CRASH => Next::Stop(
                VmExit::Error(format!("vCPU {id}: guest crashed (system event {kind})")),
            ),
            Ok(VcpuExit::SystemEvent(kind, _)) => Next::Stop(VmExit::Shutdown(format!(
                "vCPU {id}: guest system event {kind} (shutdown/reset)"
            ))),
            Ok(VcpuExit::Hlt) => Next::Stop(VmExit::Shutdown(format!("vCPU {id}: guest halted"))),
            Ok(VcpuExit::InternalError) => Next::InternalError,
            Ok(VcpuExit::FailEntry(reason, _)) => Next::FailEntry(reason),
            Ok(VcpuExit::Intr) => Next::Continue,
            Ok(other) => {
                log::warn!("vCPU {id}: unhandled exit {other:?}");
                Next::Continue
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => Next::Continue,
            Err(e) => Next::Stop(VmExit::Error(format!("vCPU {id}: KVM_RUN failed: {e}"))),
        };
        match next {
            Next::Continue => {}
            Next::Stop(reason) => ctx.exit.request(reason),
            Next::InternalError => {
                let msg = internal_error_report(id, &mut fd, &ctx.memory);
                ctx.exit.request(VmExit::Error(msg));
            }
            Next::FailEntry(reason) => {
                let msg = format!(
                    "vCPU {id}: KVM_EXIT_FAIL_ENTRY (hardware reason {reason:#x}); {}",
                    describe_state(&fd, &ctx.memory)
                );
                ctx.exit.request(VmExit::Error(msg));
            }
        }
    }
    ctx.control.lock_threads().retain(|t| *t != me);
    // A pause waiting for this thread counts it as gone.
    ctx.control.cv.notify_all();
    log::debug!("vCPU {id} stopped");
}

fn internal_error_report(id: u8, fd: &mut VcpuFd, mem: &GuestMemory) -> String {
    let run = fd.get_kvm_run();
    // SAFETY: the exit reason is KVM_EXIT_INTERNAL_ERROR, so `internal` is the live union field.
    let internal = unsafe { run.__bindgen_anon_1.internal };
    let n = (internal.ndata as usize).min(internal.data.len());
    let data: Vec<String> = internal.data[..n]
        .iter()
        .map(|d| format!("{d:#x}"))
        .collect();
    let what = if internal.suberror == KVM_INTERNAL_ERROR_EMULATION {
        "emulation failure: KVM's instruction emulator cannot run the instruction at RIP"
    } else {
        "internal error"
    };
    format!(
        "vCPU {id}: KVM_EXIT_INTERNAL_ERROR suberror {} ({what}); data [{}]; {}",
        internal.suberror,
        data.join(", "),
        describe_state(fd, mem)
    )
}

/// RIP, its physical address and the instruction bytes there, plus key registers.
pub fn describe_state(fd: &VcpuFd, mem: &GuestMemory) -> String {
    let (Ok(regs), Ok(sregs)) = (fd.get_regs(), fd.get_sregs()) else {
        return "registers unavailable".into();
    };
    let linear = sregs.cs.base.wrapping_add(regs.rip);
    let paging = sregs.cr0 & (1 << 31) != 0;
    let phys = if paging {
        arch::translate(mem, sregs.cr3, linear)
    } else {
        Some(linear)
    };
    let bytes = match phys {
        Some(p) => {
            let mut b = [0u8; 16];
            match mem.read_slice(&mut b, GuestAddress(p)) {
                Ok(()) => b
                    .iter()
                    .map(|x| format!("{x:02x}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                Err(_) => "not in guest RAM".into(),
            }
        }
        None => "RIP not mapped".into(),
    };
    format!(
        "RIP {:#x} (physical {}) bytes [{bytes}]; RSP {:#x} RAX {:#x} RCX {:#x} RDX {:#x} \
         RFLAGS {:#x} CR0 {:#x} CR3 {:#x} CR4 {:#x} EFER {:#x}",
        regs.rip,
        phys.map(|p| format!("{p:#x}"))
            .unwrap_or_else(|| "?".into()),
        regs.rsp,
        regs.rax,
        regs.rcx,
        regs.rdx,
        regs.rflags,
        sregs.cr0,
        sregs.cr3,
        sregs.cr4,
        sregs.efer
    )
}
