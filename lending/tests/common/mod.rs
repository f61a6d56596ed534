//! Shared by `tests/nvme_lent.rs` and `benches/nvme_lent.rs`: runs the real `lenderd`, borrows
//! its emulated NVMe controller and drives it with `emulated::testing::NvmeDriver` through
//! adapters that play the guest's role on the borrower side:
//!
//! * [`MemfdRam`]: "guest RAM" in a memfd, exported as a fabric window mapped at IOVA = GPA.
//! * [`WindowRegs`] (+ `emulated::testing::DirectBar`): BAR0 as the lender's fabric window,
//!   direct loads/stores (shm), each store followed by a write to the lease's notify eventfd in
//!   interrupt mode (what a KVM ioeventfd does for a guest).
//! * [`TrappedBar`]: every register access is a BAR_READ/BAR_WRITE message (tcp, or the shm
//!   slow path).
//! * [`FdIrq`]: one eventfd per vector, as a VMM's irqfds.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use emulated::testing::{DirectBar, DriverConfig, GuestBar, GuestIrq, GuestRam, NvmeDriver};
use emulated::MappedRegisters;
use lending::client::{ClientIrq, Lease, LenderClient};
use lending::protocol::IrqKind;
use ntb::{ClusterConfig, ExportedWindow, FabricKind, PeerWindow, SharedMemory};
use vmm_sys_util::eventfd::EventFd;

pub const TOKEN: &str = "nvme-lent-cluster-token-8f3a61c2d4b7e9051a6c";
pub const LENDER: &str = "node3";
pub const BORROWER: &str = "node1";
/// Where the driver allocates queues and buffers from (below: nothing, like low guest RAM).
pub const RAM_BASE: u64 = 1 << 20;

/// How lenderd gets the cluster token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenVia {
    Flag,
    File,
    Env,
}

// The same lenderd harness the api and lendvm-tests crates get from `lending::testing`.
#[path = "../../src/testing.rs"]
mod testing;
pub use testing::Lenderd;

/// A two-node cluster (lender node3, borrower node1) in a temp dir.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub cfg: ClusterConfig,
    pub path: PathBuf,
    pub kind: FabricKind,
}

fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn cluster(kind: FabricKind) -> Cluster {
    cluster_in(tempfile::tempdir().unwrap(), kind)
}

pub fn cluster_in(dir: tempfile::TempDir, kind: FabricKind) -> Cluster {
    let d = dir.path().display();
    let node = |name: &str| match kind {
        FabricKind::Shm => {
            format!(
                "[[node]]\nname = \"{name}\"\nfabric = \"shm\"\ncontrol = \"{d}/{name}.sock\"\n"
            )
        }
        FabricKind::Tcp | FabricKind::Bar => format!(
            "[[node]]\nname = \"{name}\"\nfabric = \"tcp\"\ncontrol = \"127.0.0.1:{}\"\n",
            free_tcp_port()
        ),
    };
    let src = format!("version = 1\n{}{}", node(LENDER), node(BORROWER));
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, &src).unwrap();
    let cfg = ClusterConfig::load(&path).unwrap();
    Cluster {
        dir,
        cfg,
        path,
        kind,
    }
}

/// Starts lenderd lending `devices` (`BDF=SPEC`), passing the token `via`.
pub fn start_lenderd(c: &Cluster, tag: &str, devices: &[String], via: TokenVia) -> Lenderd {
    let _ = std::fs::remove_file(c.dir.path().join(format!("{LENDER}.sock")));
    // `LENDVM_BIN_DIR`: binaries carried to another machine (`scripts/bench-device.sh`).
    let exe = std::env::var_os("LENDVM_BIN_DIR").map_or_else(
        || std::path::PathBuf::from(env!("CARGO_BIN_EXE_lenderd")),
        |d| std::path::PathBuf::from(d).join("lenderd"),
    );
    let mut cmd = Lenderd::command(exe, LENDER, &c.path)
        .log(c.dir.path().join(format!("lenderd-{tag}.log")))
        .devices(devices)
        .env_remove("LENDVM_TOKEN")
        .env(
            "RUST_LOG",
            std::env::var("LENDERD_LOG").unwrap_or_else(|_| "info".into()),
        );
    cmd = match via {
        TokenVia::Flag => cmd.token(TOKEN),
        TokenVia::File => {
            let f = c.dir.path().join("token");
            ntb::config::write_token_file(&f, &format!("{TOKEN}\n")).unwrap();
            cmd.arg("--token-file").arg(f)
        }
        TokenVia::Env => cmd.env("LENDVM_TOKEN", TOKEN),
    };
    cmd.spawn_until("listening", |d| d.log().contains("listening at"))
}

pub fn connect(c: &Cluster) -> LenderClient {
    let t0 = Instant::now();
    loop {
        match LenderClient::connect(&c.cfg, BORROWER, LENDER, TOKEN, "nvme-lent") {
            Ok(cl) => return cl,
            Err(e) if t0.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("connect: {e}"),
        }
    }
}

/// `BDF=nvme:path=…,size=…,mode=…`.
pub fn nvme_spec(bdf: &str, path: &std::path::Path, size: &str, polling: bool) -> String {
    format!(
        "{bdf}=nvme:path={},size={size},mode={}",
        path.display(),
        if polling { "polling" } else { "interrupt" }
    )
}

// ---- guest-role adapters ----------------------------------------------------------------------

/// Guest RAM in a memfd (file offset = GPA).
pub struct MemfdRam {
    pub mem: SharedMemory,
}

impl MemfdRam {
    pub fn new(len: u64) -> Arc<Self> {
        Arc::new(MemfdRam {
            mem: SharedMemory::new("guest-ram", len).unwrap(),
        })
    }
}

impl GuestRam for MemfdRam {
    fn read(&self, addr: u64, buf: &mut [u8]) {
        self.mem.read_at(addr, buf).unwrap();
    }
    fn write(&self, addr: u64, buf: &[u8]) {
        self.mem.write_at(addr, buf).unwrap();
    }
}

/// The lender's BAR window mapped here, as register memory (atomic loads/stores).
pub type WindowRegs = MappedRegisters<Box<dyn PeerWindow>>;

pub fn window_regs(win: Box<dyn PeerWindow>) -> WindowRegs {
    let ptr = win.as_ptr().unwrap();
    let len = win.len() as usize;
    // SAFETY: the shm peer window is a page-aligned shared mapping of `len` bytes that lives as
    // long as `win` (kept by the registers); the lender's device accesses it atomically too.
    unsafe { MappedRegisters::with_backing(win, ptr, len) }
}

/// BAR0 through BAR_READ/BAR_WRITE messages.
pub struct TrappedBar(pub Arc<Lease>);

impl GuestBar for TrappedBar {
    fn read32(&self, off: u64) -> u32 {
        u32::from_le_bytes(self.0.bar_read(0, off, 4).unwrap().try_into().unwrap())
    }
    fn write32(&self, off: u64, v: u32) {
        self.0.bar_write(0, off, &v.to_le_bytes()).unwrap();
    }
    fn read64(&self, off: u64) -> u64 {
        u64::from_le_bytes(self.0.bar_read(0, off, 8).unwrap().try_into().unwrap())
    }
    fn write64(&self, off: u64, v: u64) {
        self.0.bar_write(0, off, &v.to_le_bytes()).unwrap();
    }
}

/// One eventfd per vector; counts what the driver consumed.
pub struct FdIrq {
    pub fds: Vec<EventFd>,
    seen: Vec<AtomicU64>,
}

impl FdIrq {
    pub fn new(fds: Vec<EventFd>) -> Arc<Self> {
        let seen = fds.iter().map(|_| AtomicU64::new(0)).collect();
        Arc::new(FdIrq { fds, seen })
    }

    /// Signals seen on `vector` so far (consumed by the driver or still pending).
    pub fn total(&self, vector: usize) -> u64 {
        if let Ok(n) = self.fds[vector].read() {
            self.seen[vector].fetch_add(n, Ordering::Relaxed);
        }
        self.seen[vector].load(Ordering::Relaxed)
    }
}

impl GuestIrq for FdIrq {
    fn wait(&self, vector: u16, timeout: Duration) -> bool {
        let v = usize::from(vector);
        let Some(fd) = self.fds.get(v) else {
            std::thread::sleep(timeout);
            return false;
        };
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(n) = fd.read() {
                self.seen[v].fetch_add(n, Ordering::Relaxed);
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            let mut p = libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
            // SAFETY: one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut p, 1, ms) };
        }
    }
}

/// How the borrower reaches BAR0 and gets interrupts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarPath {
    /// Direct window (shm); notify eventfd after each store when `notify`.
    Direct { notify: bool },
    /// BAR_READ/BAR_WRITE messages.
    Trapped,
}

/// Interrupt target per vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IrqVia {
    /// `ClientIrq::EventFd` (shm: the lender signals it; tcp: relayed event messages).
    EventFd,
    /// A fabric doorbell bit of the borrower = vector + 1, waited on through its eventfd.
    Doorbell,
}

/// A borrowed controller with guest RAM mapped for DMA and interrupts wired, and a driver.
pub struct LentRig {
    pub driver: NvmeDriver,
    pub irq: Arc<FdIrq>,
    pub ram: Arc<MemfdRam>,
    pub lease: Arc<Lease>,
    pub window: ExportedWindow,
    pub client: LenderClient,
}

/// Borrows `dev`, exports `ram_len` bytes of guest RAM mapped at IOVA 0, wires `vectors` MSI-X
/// vectors (each `irq_via[i]`, default EventFd) and builds a driver (controller not enabled).
pub fn lent_rig(
    c: &Cluster,
    dev: &str,
    ram_len: u64,
    bar: BarPath,
    irq_via: &[IrqVia],
    vectors: usize,
    use_interrupts: bool,
) -> LentRig {
    lent_rig_as(
        c,
        dev,
        "vm0",
        ram_len,
        bar,
        irq_via,
        vectors,
        use_interrupts,
    )
}

/// [`lent_rig`] for the VM called `vm` (one borrower per VM name, each on its own link).
#[allow(clippy::too_many_arguments)]
pub fn lent_rig_as(
    c: &Cluster,
    dev: &str,
    vm: &str,
    ram_len: u64,
    bar: BarPath,
    irq_via: &[IrqVia],
    vectors: usize,
    use_interrupts: bool,
) -> LentRig {
    let client = connect(c);
    let lease = Arc::new(client.borrow(dev, vm).unwrap());
    // An emulated NVMe: a whole controller, or an SR-IOV virtual function of one.
    assert!(
        ["nvme", "nvme-vf"].contains(&lease.info().kind.as_str()),
        "{dev}: {}",
        lease.info().kind
    );
    let ram = MemfdRam::new(ram_len);
    let window = client
        .endpoint()
        .export_window(ram.mem.fd(), 0, ram_len, &format!("{vm}-ram"))
        .unwrap();
    lease.map_dma(0, ram_len, window.id()).unwrap();
    let mut fds = Vec::new();
    let mut owned = Vec::new();
    for v in 0..vectors {
        match irq_via.get(v).copied().unwrap_or(IrqVia::EventFd) {
            IrqVia::EventFd => {
                fds.push(EventFd::new(libc::EFD_NONBLOCK).unwrap());
                owned.push(None);
            }
            IrqVia::Doorbell => {
                let bit = u8::try_from(v + 1).unwrap();
                fds.push(client.endpoint().doorbell_eventfd(u32::from(bit)).unwrap());
                owned.push(Some(bit));
            }
        }
    }
    let targets: Vec<ClientIrq<'_>> = fds
        .iter()
        .zip(&owned)
        .map(|(fd, bit)| match bit {
            Some(b) => ClientIrq::Doorbell(*b),
            None => ClientIrq::EventFd(fd),
        })
        .collect();
    lease.set_irqs(IrqKind::Msix, &targets).unwrap();
    let gbar: Arc<dyn GuestBar> = match bar {
        BarPath::Direct { notify } => {
            let regs = Arc::new(window_regs(lease.bar_window(0).unwrap()));
            let n = if notify {
                Some(
                    lease
                        .notify_eventfd()
                        .expect("shm lease has a notify eventfd"),
                )
            } else {
                None
            };
            Arc::new(DirectBar::new(regs, n).unwrap())
        }
        BarPath::Trapped => Arc::new(TrappedBar(Arc::clone(&lease))),
    };
    let irq = FdIrq::new(fds);
    let driver = NvmeDriver::new(
        gbar,
        ram.clone(),
        irq.clone(),
        DriverConfig {
            ram_base: RAM_BASE,
            ram_len: ram_len - RAM_BASE,
            use_interrupts,
            timeout: Duration::from_secs(10),
        },
    );
    LentRig {
        driver,
        irq,
        ram,
        lease,
        window,
        client,
    }
}
