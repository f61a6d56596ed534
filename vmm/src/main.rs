//! `lendvm`: boot a kernel (ELF or bzImage) in a KVM VM.
//!
//! Exit status: the guest's debug-exit code (port 0xf4), 0 on a guest shutdown, 1 on a VMM or
//! guest error, 2 on bad command-line values.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::mpsc::channel;
use std::sync::Arc;

use api::events::{EventBus, MonitorTarget};
use api::request::{serve_pending, ApiError, ApiHandler, ApiReply, ApiRequest, ApiResponse};
use api::server::{ApiServer, ApiServerConfig};
use api::types::{RemoteDeviceConfig, VmConfigInfo};
use clap::{CommandFactory, FromArgMatches};
use ntb::ClusterConfig;
use serde_json::Value;
use std::cell::RefCell;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use vmm::config::{self, SerialConfig, VmConfig};
use vmm::control::{Controller, VmHandles};
use vmm::device_manager::{LenderSwitch, PCI_MMIO64_SIZE};
use vmm::event_loop::{ApiChannel, EventLoop};
use vmm::migration::auth::StreamAuth;
use vmm::migration::receive::{Incoming, Received};
use vmm::migration::MigrationError;
use vmm::remote::{AttachError, FabricIdentity, LenderSource, LinkSource};
use vmm::{Vm, VmError, VmExit};
use vmm_sys_util::eventfd::EventFd;

/// `--pci-mmio64-size`: `None` is `auto` (one value for clap, which would take an `Option`
/// field for an optional flag).
#[derive(Clone, Copy, Debug)]
struct Mmio64Size(Option<u64>);

#[derive(clap::Parser, Debug)]
#[command(
    name = "lendvm",
    version,
    about = "KVM hypervisor with remote (lent) PCI devices"
)]
struct Cli {
    /// Kernel image: ELF (vmlinux, test guest) or bzImage. Without --kernel and --restore,
    /// lendvm waits on --api-socket for vm.receive-migration (an incoming live migration).
    #[arg(
        long,
        value_name = "PATH",
        required_unless_present_any = ["restore", "api_socket"]
    )]
    kernel: Option<PathBuf>,
    /// Restore the VM from a snapshot (`vm.snapshot`): file:///abs/dir or a path. The vCPUs
    /// count, RAM size and command line come from the snapshot (--kernel, --cmdline,
    /// --initramfs, --memory's size and --cpus are not used). The VM starts paused: send
    /// vm.resume (Cloud Hypervisor's behaviour).
    #[arg(
        long,
        value_name = "URL",
        conflicts_with_all = ["kernel", "initramfs", "remote_device"]
    )]
    restore: Option<String>,
    /// Kernel command line.
    #[arg(long, value_name = "STR", default_value = "")]
    cmdline: String,
    /// Initramfs image.
    #[arg(long, value_name = "PATH")]
    initramfs: Option<PathBuf>,
    /// Guest RAM size (K/M/G suffixes) and backing: `8G,hugepages=on` (hugetlbfs; needs
    /// reserved huge pages), `8G,thp=on` (transparent huge pages), `128M,shared=PATH,offset=N`
    /// (inside the shared region of a `bar` fabric: the file behind the lender's BAR).
    #[arg(
        long,
        value_name = "SIZE[,hugepages=on][,thp=on][,shared=PATH[,offset=N]]",
        default_value = "512M",
        value_parser = config::parse_memory
    )]
    memory: config::MemoryConfig,
    /// Number of vCPUs.
    #[arg(long, value_name = "N", default_value = "1", value_parser = parse_cpus)]
    cpus: u8,
    /// A guest NUMA node (repeatable): its vCPUs, its share of --memory and its distance to
    /// other nodes (10 is local; 20 when not given). With --numa, ids run from 0, every vCPU
    /// is in one node and the nodes' memory adds up to --memory; the guest reads them from
    /// ACPI SRAT and SLIT. A restored or migrated VM keeps its own.
    #[arg(
        long,
        value_name = "id=N[,cpus=A[-B]]...,memory=SIZE[,distance=M:D]...",
        value_parser = |s: &str| vmm::numa::parse(s)
    )]
    numa: Vec<vmm::numa::NumaNodeConfig>,
    /// Serial console: stdout (the default), off or file=PATH. A VM received by live
    /// migration keeps its source's console configuration (a file is appended to) unless
    /// this is given.
    #[arg(long, value_name = "stdout|file=PATH|off")]
    serial: Option<SerialConfig>,
    /// REST API socket (Unix socket, root /api/v1).
    #[arg(long, value_name = "PATH")]
    api_socket: Option<PathBuf>,
    /// Borrow a remote device at boot (repeatable): NODE:BDF[,id=ID][,mode=direct|trapped].
    #[arg(long, value_name = "NODE:BDF[,id=ID][,mode=direct|trapped]")]
    remote_device: Vec<RemoteDeviceConfig>,
    /// Cluster description (nodes, control addresses, token); needed to borrow devices. Or an
    /// etcd cluster directory: `etcd://host:port[,host:port...]` (or a file with a
    /// `[directory]` table), where lenders register and devices are claimed.
    #[arg(long, value_name = "FILE|etcd://...")]
    cluster: Option<PathBuf>,
    /// This VMM's node name on the fabric (default lendvm-<pid>; need not be in the cluster).
    #[arg(long, value_name = "NAME")]
    node: Option<String>,
    /// VM name given to lenders (default vm-<pid>).
    #[arg(long, value_name = "NAME")]
    name: Option<String>,
    /// How long the link to a lender stays open after its last device was removed, so that
    /// the next device borrowed there (a re-add, a replacement) skips the link set-up (tcp:
    /// TLS), AUTH and HELLO. 0: the link closes with the last device.
    #[arg(long, value_name = "MS", default_value_t = vmm::remote::SESSION_IDLE_MS)]
    lender_idle_ms: u64,
    /// Cluster auth token (visible in `ps`; prefer --token-file, $LENDVM_TOKEN or the cluster
    /// file's token). It also authenticates live migrations (needed for tcp ones), with or
    /// without --cluster.
    #[arg(long, value_name = "TOKEN", conflicts_with = "token_file")]
    token: Option<String>,
    /// File holding the cluster auth token (surrounding whitespace is ignored); it must not be
    /// readable by group or others (mode 0600 or stricter). lendvm@.service passes the
    /// credential systemd loads for it (`LoadCredential=`), so that a VM running as a user
    /// of its own reads a token file that only root may read.
    #[arg(long, value_name = "PATH")]
    token_file: Option<std::path::PathBuf>,
    /// Do not append `noxsave clearcpuid=...` to a Linux kernel's command line when KVM
    /// ignores the VMM's CPUID masks.
    #[arg(long)]
    no_cpuid_cmdline: bool,
    /// The CPU model the guest sees: `host` (the host's CPUID minus what this host's KVM
    /// cannot run) or `qemu64` (QEMU's qemu64 feature set, minus the same). A restored or
    /// migrated VM keeps its own.
    #[arg(long, value_name = "host|qemu64", default_value = "host")]
    cpu_model: vmm::cpuid::CpuModel,
    /// Size of the guest's 64-bit PCI window (after RAM): every 64-bit BAR of every device,
    /// attached at launch or hot-added, must fit in it. `auto`: up to the end of the guest's
    /// physical address space, at most 1 TiB (room for eight 128 GiB GPU apertures); a size
    /// keeps it smaller. A restored or migrated VM keeps its own.
    #[arg(long, value_name = "auto|SIZE", default_value = "auto", value_parser = |s: &str| config::check_mmio64_size(s).map(Mmio64Size))]
    pci_mmio64_size: Mmio64Size,
    /// How many slots of the root bus take devices, 1 to 31: launch devices and hot-adds
    /// share them (slot 0 is the host bridge's). The guest's ACPI tables describe only
    /// these, and a guest kernel spends some boot time on each: fewer boot faster, more
    /// leave room to hot-add. A restored or migrated VM keeps its own.
    #[arg(long, value_name = "N", default_value = "31", value_parser = config::check_pci_slots)]
    pci_slots: u8,
    /// Write the VMM's events as JSON lines to FILE (appended) or an inherited fd (also
    /// readable as GET /api/v1/vm.events).
    #[arg(long, value_name = "path=FILE|fd=N")]
    event_monitor: Option<String>,
    /// Read options from a TOML file whose keys are the long options (`kernel`, `memory`,
    /// `cpus`, `remote_devices = [...]`, `api_socket`, `metrics`, ...); the command line
    /// overrides it. A key that is no option, or a file group or others can write, is
    /// refused.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Also serve the VM's metrics (the text of GET /api/v1/metrics) at GET /metrics on a
    /// loopback ip:port or a Unix socket path. If it cannot listen, lendvm logs the error and
    /// runs the VM anyway.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<lending::metrics::MetricsAddr>,
}

/// The `--metrics` renderer: asks the VMM thread for the text like the API server does;
/// while that thread is busy (sending a live migration) the scrape gets the migration's
/// progress alone after a few seconds. The listener coalesces scrapes
/// (`lending::metrics::coalesced`: one render per second and format, one at a time), and a
/// request the VMM has not answered yet is waited on again by the next scrape rather than
/// queued a second time: at most one metrics request per format waits in the VMM's channel,
/// however many scrapes arrive.
fn metrics_render(
    tx: std::sync::mpsc::Sender<api::request::ApiMessage>,
    evt: EventFd,
    progress: Arc<vmm::metrics::MigrationProgress>,
    vm: String,
) -> lending::metrics::Render {
    type Reply = tokio::sync::oneshot::Receiver<api::request::ApiReply>;
    let pending: std::sync::Mutex<Vec<(lending::metrics::Format, Reply)>> =
        std::sync::Mutex::new(Vec::new());
    Arc::new(move |format| {
        let mut pending = pending.lock().unwrap_or_else(|e| e.into_inner());
        let mut reply = match pending.iter().position(|(f, _)| *f == format) {
            Some(i) => pending.swap_remove(i).1,
            None => {
                let (msg, reply) = api::request::ApiMessage::new(ApiRequest::VmMetrics(format));
                if tx.send(msg).is_err() {
                    return Err("the vmm is not accepting requests".into());
                }
                evt.write(1)
                    .map_err(|e| format!("cannot signal the vmm: {e}"))?;
                reply
            }
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            match reply.try_recv() {
                Ok(Ok(ApiResponse::Metrics(t))) => return Ok(t),
                Ok(Ok(other)) => return Err(format!("the vmm answered {other:?}")),
                Ok(Err(e)) => return Err(e.message),
                Err(tokio::sync::oneshot::error::TryRecvError::Empty)
                    if std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {
                    // Still queued: the next scrape waits on this one.
                    pending.push((format, reply));
                    return Ok(vmm::metrics::migration_only(&vm, &progress).encode_as(format));
                }
                Err(tokio::sync::oneshot::error::TryRecvError::Closed) => {
                    return Err("the vmm dropped the request".into())
                }
            }
        }
    })
}

/// The CPU model a snapshot or migration document names (`host` when it names none: the
/// only model of the lendvms that wrote no name).
fn doc_cpu_model(
    c: &vmm::snapshot::format::MachineConfig,
) -> Result<vmm::cpuid::CpuModel, vmm::cpuid::CpuidError> {
    c.cpu_model
        .as_deref()
        .map_or(Ok(Default::default()), str::parse)
}

fn parse_cpus(s: &str) -> Result<u8, String> {
    let n: u32 = s.parse().map_err(|_| format!("'{s}' is not a CPU count"))?;
    config::check_cpus(n).map_err(|e| e.to_string())
}

static STOP_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn on_stop_signal(sig: libc::c_int) {
    STOP_SIGNAL.store(sig, std::sync::atomic::Ordering::SeqCst);
}

/// SIGTERM/SIGINT request a clean shutdown of the VM (see `main`).
fn watch_stop_signals(exit: Arc<vmm::exit::ExitNotifier>) {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(
            libc::SIGTERM,
            on_stop_signal as *const () as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGINT,
            on_stop_signal as *const () as libc::sighandler_t,
        );
    }
    let spawned = std::thread::Builder::new()
        .name("stop-signals".into())
        .spawn(move || loop {
            let sig = STOP_SIGNAL.load(std::sync::atomic::Ordering::SeqCst);
            if sig != 0 {
                let name = if sig == libc::SIGTERM {
                    "SIGTERM"
                } else {
                    "SIGINT"
                };
                log::info!("{name}: shutting the vm down");
                exit.request(VmExit::Shutdown(format!("{name} received")));
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        });
    if let Err(e) = spawned {
        log::warn!("cannot watch for SIGTERM ({e}): it will kill the vmm without a clean stop");
    }
}

/// Bad input: one line on stderr, exit status 2.
fn usage_error(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("lendvm: {msg}");
    ExitCode::from(2)
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = c.source();
    }
    s
}

/// Starts the API server on `path` with the VMM end of its request channel.
/// What else sends requests to the VMM thread besides the API server (`--metrics`).
type ExtraSender = (std::sync::mpsc::Sender<api::request::ApiMessage>, EventFd);

fn start_api(
    path: &std::path::Path,
    events: &Arc<EventBus>,
) -> Result<(ApiServer, Rc<ApiChannel>, ExtraSender), String> {
    let evt = EventFd::new(libc::EFD_NONBLOCK)
        .and_then(|e| Ok((e.try_clone()?, e)))
        .map_err(|e| format!("api eventfd: {e}"))?;
    let extra_evt = evt.0.try_clone().map_err(|e| format!("api eventfd: {e}"))?;
    let (tx, rx) = channel();
    let mut cfg = ApiServerConfig::new(path);
    cfg.events = Some(events.clone());
    let server = ApiServer::start(cfg, tx.clone(), evt.0).map_err(|e| e.to_string())?;
    Ok((
        server,
        Rc::new(ApiChannel { rx, evt: evt.1 }),
        (tx, extra_evt),
    ))
}

/// The API of a lendvm that has no VM yet: it waits for `vm.receive-migration`.
struct Waiting {
    incoming: Option<Incoming>,
    shutdown: bool,
    /// How sources must authenticate.
    auth: StreamAuth,
}

impl ApiHandler for Waiting {
    fn handle(&mut self, request: ApiRequest) -> ApiReply {
        match request {
            ApiRequest::VmmPing => Ok(ApiResponse::Pong(api::types::VmmPingResponse {
                version: env!("CARGO_PKG_VERSION").to_string(),
                pid: i64::from(std::process::id()),
                features: vec!["migration".into()],
            })),
            ApiRequest::VmReceiveMigration(d) => {
                if let Some(i) = &self.incoming {
                    return Err(ApiError::conflict(format!(
                        "already listening for a migration at {}",
                        i.url()
                    )));
                }
                let i = Incoming::listen(&d.receiver_url, self.auth.clone())
                    .map_err(|e| ApiError::bad_request(chain(&e)))?;
                self.incoming = Some(i);
                Ok(ApiResponse::Empty)
            }
            ApiRequest::VmmShutdown => {
                self.shutdown = true;
                Ok(ApiResponse::Empty)
            }
            other => Err(ApiError::conflict(format!(
                "no vm yet: this lendvm waits for vm.receive-migration ({} refused)",
                other.endpoint()
            ))),
        }
    }
}

/// Serves the API until `vm.receive-migration` names a url, then receives the VM there: from
/// the first source that authenticates (a peer that does not is dropped and listening goes
/// on). `Ok(None)`: `vmm.shutdown` came first.
fn wait_for_migration(
    chan: &ApiChannel,
    cli: &Cli,
    identity: vmm::migration::protocol::Identity,
    auth: StreamAuth,
) -> Result<Option<Received<Vm>>, String> {
    let mut w = Waiting {
        incoming: None,
        shutdown: false,
        auth,
    };
    loop {
        // API requests keep being answered until a source connects.
        let mut fds = [
            libc::pollfd {
                fd: chan.evt.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: w.incoming.as_ref().map_or(-1, Incoming::listen_fd),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds for the duration of the call (a negative fd is ignored).
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, 1000) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(format!("waiting for api requests: {e}"));
            }
        }
        serve_pending(&chan.rx, &chan.evt, &mut w);
        if w.shutdown {
            return Ok(None);
        }
        if fds[1].revents == 0 {
            continue;
        }
        let Some(incoming) = w.incoming.as_mut() else {
            continue;
        };
        let got = incoming.receive(identity.clone(), |c, memfd| {
            let cpus = config::check_cpus(u32::from(c.cpus))
                .map_err(|e| MigrationError::Mismatch(e.to_string()))?;
            let cfg = VmConfig {
                memory_size: c.memory_size,
                ram_backing: cli.memory.backing.clone(),
                cpus,
                kernel: PathBuf::from(&c.kernel),
                cmdline: c.cmdline.clone(),
                initramfs: None,
                serial: migrated_serial(cli, c)?,
                cpuid_cmdline: false,
                cpu_model: doc_cpu_model(c).map_err(|e| MigrationError::Mismatch(e.to_string()))?,
                pci_mmio64_size: Some(c.pci_mmio64_size.unwrap_or(PCI_MMIO64_SIZE)),
                numa: c.numa.clone(),
                pci_slots: c.pci_slots(),
                switches: c.switches.clone(),
            };
            match memfd {
                Some(f) => Vm::for_migration_on(&cfg, f),
                None => Vm::for_migration(&cfg),
            }
            .map_err(|e| MigrationError::Build(Box::new(e)))
        });
        match got {
            Ok(r) => return Ok(Some(r)),
            // Logged (rate-limited) by `receive`; the listener goes on.
            Err(MigrationError::NotAuthenticated { .. }) => continue,
            Err(e) => {
                return Err(format!(
                    "incoming migration at {}: {}",
                    incoming.url(),
                    chain(&e)
                ))
            }
        }
    }
}

/// Where a migrated VM's console goes: `--serial` if given, else where the source's said.
fn migrated_serial(
    cli: &Cli,
    c: &vmm::snapshot::format::MachineConfig,
) -> Result<SerialConfig, MigrationError> {
    let source = match &c.serial {
        None => None,
        Some(s) => Some(s.parse::<SerialConfig>().map_err(|e| {
            MigrationError::Mismatch(format!("the source's serial console '{s}': {e}"))
        })?),
    };
    Ok(SerialConfig::for_migrated(
        cli.serial.as_ref(),
        source.as_ref(),
    ))
}

/// Devices cannot be borrowed without a cluster file.
struct NoCluster;

impl LinkSource for NoCluster {
    fn check_node(&self, node: &str) -> Result<(), AttachError> {
        Err(AttachError::UnknownNode {
            node: node.to_string(),
            known: "none: lendvm was started without --cluster".into(),
        })
    }

    fn borrow(
        &self,
        spec: &api::types::RemoteDeviceSpec,
    ) -> Result<Box<dyn remote_pci::RemoteDeviceLink>, AttachError> {
        self.check_node(&spec.node)?;
        Err(AttachError::UnknownNode {
            node: spec.node.clone(),
            known: String::new(),
        })
    }
}

/// The cluster token: `--token`, else `--token-file`, else `$LENDVM_TOKEN`, else the cluster
/// file's.
fn token(cli: &Cli, cluster: &ClusterConfig) -> Result<Option<String>, String> {
    let strong = |t: String, from: &str| {
        ntb::config::check_token(&t, from)
            .map(|()| Some(t))
            .map_err(|e| e.to_string())
    };
    if let Some(t) = &cli.token {
        return strong(t.clone(), "--token");
    }
    if let Some(p) = &cli.token_file {
        // read_token_file refuses a readable-by-others file and checks the token's strength.
        return ntb::config::read_token_file(p)
            .map(Some)
            .map_err(|e| format!("--token-file: {e}"));
    }
    if let Ok(t) = std::env::var("LENDVM_TOKEN") {
        if !t.trim().is_empty() {
            return strong(t, "$LENDVM_TOKEN");
        }
    }
    // The cluster file's token is checked when it is read.
    cluster.auth_token().map_err(|e| e.to_string())
}

/// The switches of a new VM: its launch devices' lenders and root buses, as the controller
/// will place them (a `numa_node=` it will refuse by name counts as bus 0 here), through
/// [`vmm::device_manager::plan_switches`].
fn launch_switches(cli: &Cli, source: &dyn LinkSource) -> Vec<LenderSwitch> {
    let nodes = cli.numa.len();
    let roots = vmm::device_manager::root_buses(nodes);
    let devices: Vec<(String, u8)> = cli
        .remote_device
        .iter()
        .map(|d| {
            let node = d
                .numa_node
                .or_else(|| source.default_numa_node(d.device.node.as_str()));
            let root = node
                .filter(|&n| (n as usize) < nodes)
                .and_then(|n| u8::try_from(n).ok())
                .filter(|&n| n < roots)
                .unwrap_or(0);
            (d.device.node.as_str().to_owned(), root)
        })
        .collect();
    vmm::device_manager::plan_switches(&devices, roots)
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    if let Err(e) = lending::cli::set_not_dumpable() {
        log::warn!("cannot make this process non-dumpable (PR_SET_DUMPABLE): {e}");
    }
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(dir) = lending::cli::generate_assets_requested(&argv) {
        return match lending::cli::generate_assets(Cli::command(), &dir) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => usage_error(format!("{}: {e}", dir.display())),
        };
    }
    let cmd = Cli::command().args_override_self(true);
    let argv = match lending::cli::expand_config(&cmd, argv) {
        Ok(a) => a,
        Err(e) => return usage_error(e),
    };
    let cli = match cmd
        .try_get_matches_from(argv)
        .and_then(|m| Cli::from_arg_matches(&m))
    {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            let text = e.to_string();
            let first = text.lines().next().unwrap_or("invalid arguments");
            return usage_error(first.strip_prefix("error: ").unwrap_or(first));
        }
    };
    if !cli.numa.is_empty() {
        if cli.kernel.is_none() {
            return usage_error(
                "--numa shapes a VM that boots (--kernel): a restored or migrated VM keeps \
                 the nodes it was built with",
            );
        }
        if let Err(e) = vmm::numa::check(&cli.numa, cli.cpus, cli.memory.size) {
            return usage_error(e);
        }
    }
    if cli.remote_device.len() > usize::from(cli.pci_slots) {
        return usage_error(format!(
            "{} --remote-device options for {} PCI slots (--pci-slots {}): every device takes a \
             slot of the root bus",
            cli.remote_device.len(),
            cli.pci_slots,
            cli.pci_slots
        ));
    }
    if let Some(k) = &cli.kernel {
        if !k.is_file() {
            return usage_error(format!(
                "kernel file {} does not exist or is not a file",
                k.display()
            ));
        }
    }
    if cli.restore.is_some() && cli.api_socket.is_none() {
        return usage_error(
            "--restore needs --api-socket: a restored VM starts paused and runs after vm.resume",
        );
    }
    let restored = match &cli.restore {
        None => None,
        Some(url) => match vmm::snapshot::load(url) {
            Ok(s) => Some(s),
            Err(e) => return usage_error(format!("--restore {url}: {}", chain(&e))),
        },
    };
    if let Some(p) = &cli.initramfs {
        if !p.is_file() {
            return usage_error(format!(
                "initramfs file {} does not exist or is not a file",
                p.display()
            ));
        }
    }
    let events = match &cli.event_monitor {
        None => EventBus::new(),
        Some(spec) => match spec
            .parse::<MonitorTarget>()
            .and_then(|t| EventBus::with_monitor(&t))
        {
            Ok(b) => b,
            Err(e) => return usage_error(format!("--event-monitor: {}", chain(&e))),
        },
    };
    let pid = std::process::id();
    // The migration stream's secret: the cluster token, from wherever it came.
    let mut secret = None;
    let source: Box<dyn LinkSource> = match &cli.cluster {
        None => {
            // Without a cluster file the token is only the migration stream's secret: it
            // gets the same strength check (a weak one is refused by name, not used).
            let no_file = ClusterConfig {
                nodes: Vec::new(),
                token: None,
                directory: None,
            };
            secret = match token(&cli, &no_file) {
                Ok(t) => t,
                Err(e) => return usage_error(e),
            };
            if let Some(d) = cli.remote_device.first() {
                return usage_error(format!(
                    "--remote-device {} needs --cluster FILE to find node {}",
                    d.device, d.device.node
                ));
            }
            Box::new(NoCluster)
        }
        Some(path) => {
            let text = path.to_string_lossy();
            let (cluster, directory) = if text.starts_with("etcd://") {
                match ntb::DirectoryConfig::from_url(&text) {
                    Ok(d) => (
                        ClusterConfig {
                            nodes: Vec::new(),
                            token: None,
                            directory: None,
                        },
                        Some(d),
                    ),
                    Err(e) => return usage_error(format!("--cluster: {e}")),
                }
            } else {
                match ClusterConfig::load(path) {
                    Ok(c) => {
                        let d = c.directory.clone();
                        (c, d)
                    }
                    Err(e) => return usage_error(format!("cluster file: {e}")),
                }
            };
            let token =
                match token(&cli, &cluster) {
                    Ok(Some(t)) => t,
                    Ok(None) if cli.remote_device.is_empty() => {
                        log::warn!(
                            "no cluster token (--token, --token-file, $LENDVM_TOKEN or the cluster \
                         file's token/token_file): lenders will refuse hot-added devices"
                        );
                        String::new()
                    }
                    Ok(None) => return usage_error(
                        "no cluster token: pass --token or --token-file, set LENDVM_TOKEN or put \
                         token/token_file in the cluster file",
                    ),
                    Err(e) => return usage_error(e),
                };
            if !token.is_empty() {
                secret = Some(token.clone());
            }
            let id = FabricIdentity {
                local: cli.node.clone().unwrap_or_else(|| format!("lendvm-{pid}")),
                vm_name: cli.name.clone().unwrap_or_else(|| format!("vm-{pid}")),
                token,
            };
            let mut source = match directory {
                None => LenderSource::new(cluster, id),
                Some(d) => {
                    match lending::directory::etcd::EtcdDirectory::connect(
                        &d,
                        // Claims are signed with the cluster token; without one, none are made.
                        Some(id.token.as_str()).filter(|t| !t.is_empty()),
                    ) {
                        Ok(dir) => LenderSource::with_directory(cluster, id, Arc::new(dir)),
                        Err(e) => return usage_error(format!("cluster directory: {e}")),
                    }
                }
            };
            source.set_session_idle(std::time::Duration::from_millis(cli.lender_idle_ms));
            for d in &cli.remote_device {
                if let Err(e) = source.check_node(&d.device.node) {
                    return usage_error(e);
                }
            }
            Box::new(source)
        }
    };
    // No kernel and no snapshot: the VM comes from a live migration (vm.receive-migration).
    let incoming = cli.kernel.is_none() && cli.restore.is_none();
    if incoming && !cli.remote_device.is_empty() {
        return usage_error(
            "--remote-device needs --kernel: a migrating vm brings its own devices",
        );
    }
    let mut early_api = None;
    let mut migrated = None;
    if incoming {
        let Some(path) = &cli.api_socket else {
            return usage_error("--kernel, --restore or --api-socket is needed");
        };
        let (server, chan, extra) = match start_api(path, &events) {
            Ok(x) => x,
            Err(e) => return usage_error(e),
        };
        let identity = match source.identity() {
            Some((node, vm)) => vmm::migration::protocol::Identity {
                node: Some(node),
                vm: Some(vm),
            },
            None => vmm::migration::protocol::Identity::default(),
        };
        let auth = StreamAuth {
            secret: secret.clone(),
            node: identity.node.clone(),
        };
        let got = wait_for_migration(&chan, &cli, identity, auth);
        match got {
            Ok(Some(r)) => migrated = Some(r),
            Ok(None) | Err(_) => {
                let code = match got {
                    Err(e) => {
                        eprintln!("lendvm: {e}");
                        ExitCode::from(1)
                    }
                    _ => ExitCode::SUCCESS,
                };
                events.close();
                if let Err(e) = server.shutdown() {
                    log::warn!("api server: {e}");
                }
                return code;
            }
        }
        early_api = Some((server, chan, extra));
    }
    let cfg = match (&restored, &migrated) {
        (_, Some(m)) => VmConfig {
            memory_size: m.doc.config.memory_size,
            ram_backing: cli.memory.backing.clone(),
            cpus: m.doc.config.cpus,
            kernel: PathBuf::from(&m.doc.config.kernel),
            cmdline: m.doc.config.cmdline.clone(),
            initramfs: None,
            // As the VM was built with (the CONFIG frame carries the same machine config).
            serial: match migrated_serial(&cli, &m.doc.config) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("lendvm: incoming migration: {}", chain(&e));
                    return ExitCode::from(1);
                }
            },
            cpuid_cmdline: false,
            cpu_model: match doc_cpu_model(&m.doc.config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("lendvm: incoming migration: {e}");
                    return ExitCode::from(1);
                }
            },
            pci_mmio64_size: Some(m.doc.config.pci_mmio64_size.unwrap_or(PCI_MMIO64_SIZE)),
            numa: m.doc.config.numa.clone(),
            pci_slots: m.doc.config.pci_slots(),
            switches: m.doc.config.switches.clone(),
        },
        (Some(s), None) => VmConfig {
            memory_size: s.doc.config.memory_size,
            ram_backing: cli.memory.backing.clone(),
            cpus: s.doc.config.cpus,
            kernel: PathBuf::from(&s.doc.config.kernel),
            cmdline: s.doc.config.cmdline.clone(),
            initramfs: None,
            serial: cli.serial.clone().unwrap_or(SerialConfig::Stdout),
            cpuid_cmdline: false,
            cpu_model: match doc_cpu_model(&s.doc.config) {
                Ok(c) => c,
                Err(e) => {
                    return usage_error(format!(
                        "--restore {}: {e}",
                        cli.restore.as_deref().unwrap_or_default()
                    ))
                }
            },
            pci_mmio64_size: Some(s.doc.config.pci_mmio64_size.unwrap_or(PCI_MMIO64_SIZE)),
            numa: s.doc.config.numa.clone(),
            pci_slots: s.doc.config.pci_slots(),
            switches: s.doc.config.switches.clone(),
        },
        (None, None) => VmConfig {
            memory_size: cli.memory.size,
            ram_backing: cli.memory.backing.clone(),
            cpus: cli.cpus,
            kernel: cli.kernel.clone().unwrap_or_default(),
            cmdline: cli.cmdline.clone(),
            initramfs: cli.initramfs.clone(),
            serial: cli.serial.clone().unwrap_or(SerialConfig::Stdout),
            cpuid_cmdline: !cli.no_cpuid_cmdline,
            cpu_model: cli.cpu_model,
            pci_mmio64_size: cli.pci_mmio64_size.0,
            numa: cli.numa.clone(),
            pci_slots: cli.pci_slots,
            switches: launch_switches(&cli, source.as_ref()),
        },
    };
    let migrated_from = migrated.as_ref().map(|m| (m.bytes, m.paused));
    // The source waits for our verdict until its lent devices are ours (below).
    let mut handover = None;
    let built = match (&restored, migrated) {
        (_, Some(m)) => {
            handover = Some((m.reply, m.doc.devices.lent, m.handover));
            Ok(m.vm)
        }
        (Some(s), None) => Vm::restore(&cfg, s),
        (None, None) => Vm::new(&cfg),
    };
    let mut vm = match built {
        Ok(vm) => vm,
        Err(e @ VmError::Restore(_)) => {
            return usage_error(format!(
                "--restore {}: {}",
                cli.restore.as_deref().unwrap_or_default(),
                chain(&e)
            ));
        }
        Err(
            e
            @ (VmError::KvmOpen(_) | VmError::KvmApi(_) | VmError::Loader(_) | VmError::Memory(_)),
        ) => {
            return usage_error(chain(&e));
        }
        Err(e) => {
            eprintln!("lendvm: {}", chain(&e));
            return ExitCode::from(1);
        }
    };
    let Some(ejects) = vm.platform_mut().take_ejects() else {
        eprintln!("lendvm: internal error: the eject channel is gone");
        return ExitCode::from(1);
    };
    let handles = VmHandles {
        devices: vm.devices().clone(),
        interrupts: vm.interrupt_manager(),
        vm_ops: vm.vm_ops(),
        hotplug: vm.platform().hotplug().clone(),
        exit: vm.exit_notifier().clone(),
        vcpus: vm.vcpu_control().clone(),
        events: events.clone(),
    };
    let info = VmConfigInfo {
        cpus: u32::from(cfg.cpus),
        memory_size: cfg.memory_size,
        kernel: cfg.kernel.display().to_string(),
        cmdline: vm.cmdline().to_string(),
        initramfs: cfg.initramfs.as_ref().map(|p| p.display().to_string()),
        remote_devices: cli.remote_device.clone(),
        pci_slots: Some(u32::from(cfg.pci_slots)),
        numa_nodes: vmm::numa::info(&cfg.numa, cfg.cpus, cfg.memory_size),
        switches: vm.devices().switch_info(),
    };
    let machine = vmm::snapshot::format::MachineConfig {
        cpus: cfg.cpus,
        memory_size: cfg.memory_size,
        kernel: cfg.kernel.display().to_string(),
        cmdline: vm.cmdline().to_string(),
        // Moves with the VM on a migration (the destination's --serial may override it).
        serial: Some(cfg.serial.to_string()),
        cpu_model: Some(cfg.cpu_model.name().to_owned()),
        pci_mmio64_size: Some(vm.pci_mmio64().1),
        numa: cfg.numa.clone(),
        pci_slots: Some(cfg.pci_slots),
        switches: cfg.switches.clone(),
    };
    let migration_node = source.identity().map(|(node, _)| node);
    let mut ctl = Controller::new(handles, source, info);
    ctl.set_migration_auth(StreamAuth {
        secret,
        node: migration_node,
    });
    ctl.set_snapshot_source(vm.snapshot_source(machine));
    if let Err(e) = ctl.attach_boot_devices(&cli.remote_device) {
        ctl.teardown_all();
        return usage_error(e.message);
    }
    if let Some(s) = &restored {
        if let Err(e) = ctl.restore_lent_devices(&s.doc.devices.lent) {
            ctl.teardown_all();
            return usage_error(format!(
                "--restore {}: lent devices: {}",
                cli.restore.as_deref().unwrap_or_default(),
                e.message
            ));
        }
    }
    if let Some((reply, lent, tickets)) = handover {
        ctl.adopt_prepinned_ram(vm.take_prepinned_ram());
        // The commit point: the source stops once we acknowledge. A failure here refuses
        // (the source keeps the VM; a lease already taken over is returned by the teardown
        // and the source reports that device lost).
        if let Err(e) = ctl.take_over_lent_devices(&lent, &tickets) {
            let why = format!("taking the lent devices over: {}", e.message);
            reply.refuse(&why);
            ctl.teardown_all();
            events.emit(
                "migration",
                "migration-failed",
                [("error", Value::from(why.clone()))],
            );
            eprintln!("lendvm: incoming migration: {why}");
            events.close();
            return ExitCode::from(1);
        }
        if let Err(e) = reply.ack() {
            // The source did not hear it and resumes its VM: this one must not run too.
            ctl.teardown_all();
            eprintln!("lendvm: incoming migration: acknowledging: {}", chain(&e));
            events.close();
            return ExitCode::from(1);
        }
    }
    let ctl = Rc::new(RefCell::new(ctl));
    let mut api = None;
    let mut server = None;
    let mut extra = None;
    if let Some((s, chan, x)) = early_api {
        server = Some(s);
        api = Some(chan);
        extra = Some(x);
    } else if cli.api_socket.is_some() || cli.metrics.is_some() {
        let evt = match EventFd::new(libc::EFD_NONBLOCK)
            .and_then(|e| Ok((e.try_clone()?, e.try_clone()?, e)))
        {
            Ok(e) => e,
            Err(e) => {
                eprintln!("lendvm: api eventfd: {e}");
                return ExitCode::from(1);
            }
        };
        let (tx, rx) = channel();
        if let Some(path) = &cli.api_socket {
            let mut cfg = ApiServerConfig::new(path);
            cfg.events = Some(events.clone());
            match ApiServer::start(cfg, tx.clone(), evt.0) {
                Ok(s) => server = Some(s),
                Err(e) => {
                    ctl.borrow_mut().teardown_all();
                    return usage_error(e);
                }
            }
        }
        extra = Some((tx, evt.1));
        api = Some(Rc::new(ApiChannel { rx, evt: evt.2 }));
    }
    // Metrics are an observer: a listener that cannot start is logged and the VM runs.
    let _metrics = match (&cli.metrics, extra) {
        (Some(addr), Some((tx, evt))) => {
            let render = metrics_render(
                tx,
                evt,
                ctl.borrow().migration_progress(),
                ctl.borrow().vm_name(),
            );
            match lending::metrics::MetricsServer::start(addr, render) {
                Ok(m) => Some(m),
                Err(e) => {
                    log::error!("{e}; the vm runs without --metrics");
                    eprintln!("lendvm: {e}; the vm runs without --metrics");
                    None
                }
            }
        }
        _ => None,
    };
    let mut event_loop =
        match EventLoop::new(ctl.clone(), api.clone(), ejects, vm.exit_notifier().clone()) {
            Ok(l) => l,
            Err(e) => {
                ctl.borrow_mut().teardown_all();
                eprintln!("lendvm: {}", chain(&e));
                return ExitCode::from(1);
            }
        };
    let started = std::time::Instant::now();
    if let Err(e) = vm.start() {
        ctl.borrow_mut().teardown_all();
        eprintln!("lendvm: {}", chain(&e));
        return ExitCode::from(1);
    }
    // `systemctl stop` (SIGTERM) and ^C end the VM like vm.shutdown: leases returned,
    // claims released. The handler only sets a flag; a thread turns it into the request.
    watch_stop_signals(vm.exit_notifier().clone());
    // Readiness for systemd (Type=notify): the VM runs and its API socket listens.
    let ready = format!("vm {} running", ctl.borrow().vm_name());
    if let Err(e) = sd_notify::notify(
        false,
        &[
            sd_notify::NotifyState::Ready,
            sd_notify::NotifyState::Status(&ready),
        ],
    ) {
        log::warn!("sd_notify: {e}");
    }
    if let Some((bytes, paused)) = migrated_from {
        // The source has stopped: the guest runs on here at once, unless it was paused there.
        ctl.borrow_mut().set_restored_paused();
        if !paused {
            if let Err(e) = ctl.borrow_mut().resume() {
                log::error!("resuming the migrated vm: {e}");
            }
        }
        log::info!(
            "migrated vm {} ({bytes} bytes of RAM received)",
            if paused {
                "paused, as on the source"
            } else {
                "running"
            }
        );
        events.emit(
            "migration",
            "vm-migrated",
            [
                ("cpus", Value::from(cfg.cpus)),
                ("memory", Value::from(cfg.memory_size)),
                ("ram_bytes", Value::from(bytes)),
                ("paused", Value::from(paused)),
            ],
        );
    } else if let Some(s) = &restored {
        ctl.borrow_mut().set_restored_paused();
        log::info!("restored from {}: paused until vm.resume", s.dir.display());
        events.emit(
            "vm",
            "vm-restored",
            [
                ("source", Value::from(s.dir.display().to_string())),
                ("cpus", Value::from(cfg.cpus)),
                ("memory", Value::from(cfg.memory_size)),
            ],
        );
    } else {
        ctl.borrow_mut().set_running();
        events.emit(
            "vm",
            "vm-booted",
            [
                ("cpus", Value::from(cli.cpus)),
                ("memory", Value::from(cli.memory.size)),
                ("remote_devices", Value::from(cli.remote_device.len())),
            ],
        );
    }
    let exit = event_loop.run();
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    drop(event_loop);
    vm.stop();
    ctl.borrow_mut().teardown_all();
    if let Some(a) = &api {
        // Requests that came in while the VM stopped get the shut-down answers.
        serve_pending(&a.rx, &a.evt, &mut *ctl.borrow_mut());
    }
    events.emit(
        "vm",
        "vm-shutdown",
        [
            ("reason", Value::from(format!("{exit:?}"))),
            ("exit_code", Value::from(exit.exit_code())),
        ],
    );
    // Followers of vm.events see the end of the stream before the server goes.
    events.close();
    if let Some(s) = server {
        if let Err(e) = s.shutdown() {
            log::warn!("api server: {e}");
        }
    }
    log::info!("guest ran {:?}: {exit:?}", started.elapsed());
    match &exit {
        VmExit::DebugExit(_) => {}
        VmExit::Shutdown(why) => eprintln!("lendvm: {why}"),
        VmExit::Error(why) => eprintln!("lendvm: error: {why}"),
    }
    ExitCode::from(exit.exit_code() as u8)
}
