//! `lenderd`: lends this node's PCI devices to VMs on other nodes over the fabric.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{CommandFactory, FromArgMatches, Parser};
use lending::directory::etcd::EtcdDirectory;
use lending::directory::{self, DeviceRecord, Directory, NodeRecord, Registration};
use lending::inventory::Inventory;
use lending::metrics::lender::LenderMetrics;
use lending::metrics::{MetricsAddr, MetricsServer};
use lending::server::Lender;
use lending::spec::DeviceSpec;
use ntb::{
    ClusterConfig, ControlAddr, DirectoryConfig, Fabric, FabricKind, LinkConfig, NodeConfig,
    NodeId, SocketFabric,
};

/// Lends this node's PCI devices over the NTB fabric.
#[derive(Parser, Debug)]
#[command(
    name = "lenderd",
    version,
    about = "Lends this node's PCI devices to VMs on other nodes over the NTB fabric"
)]
struct Args {
    /// Read options from a TOML file whose keys are the long options (`node`, `cluster`,
    /// `devices = [...]`, `metrics`, `token_file`, ...); the command line overrides it. A key
    /// that is no option, or a file group or others can write, is refused.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// This node's name in the cluster file.
    #[arg(long)]
    node: String,
    /// Cluster description: a TOML file (its `[directory]` table, if any, names etcd), or
    /// `etcd://host:port[,host:port...]` to register in etcd without a file (also
    /// `--directory`, the `directory` key of a config file).
    #[arg(long, visible_alias = "directory")]
    cluster: String,
    /// Where to listen, for a lender that is not in the cluster file (etcd directory): an
    /// absolute Unix socket path (shm fabric) or ip:port (tcp fabric).
    #[arg(long, value_name = "ADDR")]
    control: Option<String>,
    /// shm: the group whose members may connect to the control socket (mode 0660), as the
    /// cluster file's `control_group`, which it overrides: VMs that run as users of their own
    /// (lendvm@.service) reach a lender on their host through it. Default: mode 0600.
    #[arg(long, value_name = "GROUP")]
    control_group: Option<String>,
    /// A device to lend: BDF=vfio | BDF=nvme:path=FILE,size=1G[,lba=512|4096][,mode=interrupt|polling][,dbbuf=on|off][,vfs=N][,cmb=SIZE][,msix=N][,queues=N] | BDF=dmatest[:mode=...][,buf=SIZE][,rebar=SIZE] | BDF=epftest[:vectors=N]
    #[arg(long = "device", value_name = "SPEC")]
    devices: Vec<DeviceSpec>,
    /// Cluster auth token (visible in `ps`; prefer --token-file or $LENDVM_TOKEN).
    #[arg(long, conflicts_with = "token_file")]
    token: Option<String>,
    /// File holding the cluster auth token (surrounding whitespace is ignored); it must not be
    /// readable by group or others (mode 0600 or stricter).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Serve Prometheus metrics (OpenMetrics text, GET /metrics) at a loopback ip:port or a
    /// Unix socket path. Off by default. If it cannot listen, lenderd logs the error and
    /// lends anyway.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<MetricsAddr>,
    /// Append one JSON line to FILE for every lease granted, ended, and serving requests (at
    /// most one line per lease every 250 ms): who held which device when, under which fencing
    /// token (docs/RELIABILITY.md, "The lenders' audit log"). Off by default.
    #[arg(long, value_name = "FILE")]
    audit_log: Option<PathBuf>,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// The cluster token: `--token`, else `--token-file`, else `$LENDVM_TOKEN`, else the cluster
/// file's `token`/`token_file`; never empty.
fn token(args: &Args, cluster: Option<&ClusterConfig>) -> Result<String, String> {
    let (t, from) = if let Some(t) = &args.token {
        (t.clone(), "--token".to_string())
    } else if let Some(p) = &args.token_file {
        // Refuses a file group or others can read, naming it and its mode.
        let t = ntb::config::read_token_file(p).map_err(|e| e.to_string())?;
        (t, format!("token file {}", p.display()))
    } else if let Ok(t) = std::env::var("LENDVM_TOKEN") {
        (t, "$LENDVM_TOKEN".to_string())
    } else if let Some(t) = cluster
        .map(ClusterConfig::auth_token)
        .transpose()
        .map_err(|e| e.to_string())?
        .flatten()
    {
        (t, format!("cluster file {}", args.cluster))
    } else {
        return Err(
            "no cluster token: pass --token, --token-file, set LENDVM_TOKEN or put token_file in the cluster file"
                .into(),
        );
    };
    if t.trim().is_empty() {
        return Err(format!("the cluster token from {from} is empty"));
    }
    ntb::config::check_token(&t, &from).map_err(|e| e.to_string())?;
    Ok(t)
}

/// This node's config: from the cluster file, or (etcd directory) from `--control`; with
/// `--control-group` for its socket.
fn own_node(args: &Args, file: Option<&ClusterConfig>) -> Result<NodeConfig, String> {
    let mut node = own_node_of(args, file)?;
    if let Some(g) = &args.control_group {
        if node.fabric != FabricKind::Shm {
            return Err(format!(
                "--control-group {g}: only an shm node's control socket has a group (this node's fabric is {})",
                node.fabric
            ));
        }
        node.link.control_group = Some(g.clone());
    }
    Ok(node)
}

fn own_node_of(args: &Args, file: Option<&ClusterConfig>) -> Result<NodeConfig, String> {
    if let Some(addr) = &args.control {
        let kind = if addr.starts_with('/') {
            FabricKind::Shm
        } else {
            FabricKind::Tcp
        };
        let base = file
            .and_then(|f| f.nodes.first())
            .map_or_else(LinkConfig::default, |n| {
                // The cluster-wide timers; this node's own NTB resources are the defaults.
                LinkConfig {
                    limits: LinkConfig::default().limits,
                    doorbells: LinkConfig::default().doorbells,
                    scratchpads: LinkConfig::default().scratchpads,
                    ..n.link.clone()
                }
            });
        return Ok(NodeConfig {
            name: NodeId::new(&args.node).map_err(|e| format!("--node {}: {e}", args.node))?,
            fabric: kind,
            control: ControlAddr::parse(kind, addr).map_err(|e| format!("--control: {e}"))?,
            link: base,
            numa_node: None,
        });
    }
    match file.and_then(|f| f.node(&args.node)) {
        Some(n) => Ok(n.clone()),
        None => Err(format!(
            "node {} is not in the cluster file; pass --control ADDR to say where it listens",
            args.node
        )),
    }
}

/// The device records of the inventory, for the directory.
fn records(node: &str, inventory: &Inventory) -> Vec<DeviceRecord> {
    inventory
        .list()
        .into_iter()
        .map(|device| DeviceRecord {
            node: node.to_string(),
            device,
        })
        .collect()
}

fn run(args: Args) -> Result<(), String> {
    let (file, dir_cfg): (Option<ClusterConfig>, Option<DirectoryConfig>) =
        if args.cluster.starts_with("etcd://") {
            (None, Some(DirectoryConfig::from_url(&args.cluster)?))
        } else {
            let f = ClusterConfig::load(std::path::Path::new(&args.cluster))
                .map_err(|e| e.to_string())?;
            let d = f.directory.clone();
            (Some(f), d)
        };
    let token = token(&args, file.as_ref())?;
    let me = own_node(&args, file.as_ref())?;
    let fabric_cluster = match &file {
        Some(f) if args.control.is_none() => f.clone(),
        _ => directory::cluster_of(me.clone()),
    };
    let fabric = SocketFabric::from_cluster(&fabric_cluster, &args.node)
        .map_err(|e| format!("node {}: {e}", args.node))?;
    // Every function's address once, before any backend opens: a VF of one spec may land
    // on the address another spec names.
    let mut seen: Vec<(String, String)> = Vec::new();
    for spec in &args.devices {
        for (n, id) in spec.function_ids().into_iter().enumerate() {
            let what = match n {
                0 => format!("--device {id}"),
                n => format!("virtual function {n} of --device {}", spec.id),
            };
            if let Some((_, other)) = seen.iter().find(|(s, _)| *s == id) {
                return Err(format!("two devices at {id}: {what} and {other}"));
            }
            seen.push((id, what));
        }
    }
    let mut devices = Vec::new();
    for spec in &args.devices {
        let functions = lending::open_backends(spec, args.node.as_str())
            .map_err(|e| format!("device {}: {e}", spec.id))?;
        for (id, b) in functions {
            log::info!("device {id} ({}) available", b.kind());
            devices.push((id, b));
        }
    }
    let inventory = Arc::new(Inventory::new(devices).map_err(|e| e.to_string())?);
    let listener: Arc<dyn ntb::Listener> =
        Arc::from(fabric.listen().map_err(|e| format!("listen: {e}"))?);
    // Registered only once the control address listens, so a borrower that finds the
    // lender in the directory can connect.
    let dir: Option<Arc<dyn Directory>> = match &dir_cfg {
        None => None,
        Some(cfg) => Some(Arc::new(
            EtcdDirectory::connect(cfg, Some(&token)).map_err(|e| format!("directory: {e}"))?,
        )),
    };
    let registration: Option<Box<dyn Registration>> = match &dir {
        None => None,
        Some(dir) => Some(
            dir.register(
                &NodeRecord::from_config(&me),
                &records(&args.node, &inventory),
            )
            .map_err(|e| format!("registering in {}: {e}", dir.describe()))?,
        ),
    };
    let lender = match registration.as_ref().and_then(|r| r.claim_authority()) {
        Some(claims) => Lender::with_claims(Arc::clone(&inventory), &args.node, &token, claims),
        None => Lender::new(Arc::clone(&inventory), &args.node, &token),
    };
    if let Some(p) = &args.audit_log {
        let log = lending::audit::AuditLog::open(p, &args.node).map_err(|e| e.to_string())?;
        lender.set_audit(Arc::new(log));
        log::info!("lease audit log: {}", p.display());
    }
    // Peer-to-peer DMA across lenders: this lender finds the others in the cluster file,
    // and those it does not name in the directory.
    if let Some(f) = &file {
        lender.set_cluster(f.clone());
    }
    if let Some(d) = dir {
        lender.set_directory(d, fabric_cluster.clone());
    }
    let stop = lender.stop_flag();
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
    let registration = registration.map(Arc::<dyn Registration>::from);
    // Metrics are an observer: a listener that cannot start is an error in the log and the
    // service status, and lending goes on.
    let mut metrics_problem = None;
    let metrics: Option<MetricsServer> = args.metrics.as_ref().and_then(|addr| {
        let m = Arc::new(LenderMetrics::new(
            Arc::clone(&lender),
            registration.clone(),
            Some(Arc::clone(&listener)),
        ));
        match MetricsServer::start(addr, Arc::new(move |f| Ok(m.render(f)))) {
            Ok(s) => Some(s),
            Err(e) => {
                log::error!("{e}; lending continues without metrics");
                metrics_problem = Some(e.to_string());
                None
            }
        }
    });
    let reg = registration.clone();
    let node = args.node.clone();
    let inv = Arc::clone(&inventory);
    let watcher = std::thread::spawn(move || {
        // Device states are published from here (a change shows within ~0.5 s). Without a
        // directory it only passes a stop on, and wakes less often: on an emulated lender
        // (L1 in the VFIO tests) twenty wake-ups a second took 8% of its one vCPU.
        let tick = Duration::from_millis(if reg.is_some() { 50 } else { 250 });
        let mut published = Instant::now();
        while !STOP.load(Ordering::SeqCst) {
            std::thread::sleep(tick);
            if let Some(r) = &reg {
                if published.elapsed() >= Duration::from_millis(500) {
                    r.update_devices(&records(&node, &inv));
                    published = Instant::now();
                }
            }
        }
        stop.store(true, Ordering::SeqCst);
    });
    log::info!(
        "lenderd {} listening at {} with {} devices",
        args.node,
        listener.local_addr(),
        inventory.list().len()
    );
    let status = match &metrics_problem {
        None => format!("lending {} devices", inventory.list().len()),
        Some(p) => format!(
            "lending {} devices; metrics off: {p}",
            inventory.list().len()
        ),
    };
    // Readiness for systemd (Type=notify): the control address listens and the directory
    // has the lender. Outside systemd ($NOTIFY_SOCKET unset) this does nothing.
    if let Err(e) = sd_notify::notify(
        false,
        &[
            sd_notify::NotifyState::Ready,
            sd_notify::NotifyState::Status(&status),
        ],
    ) {
        log::warn!("sd_notify: {e}");
    }
    let r = lender.serve(listener.as_ref()).map_err(|e| e.to_string());
    let _ = sd_notify::notify(
        false,
        &[
            sd_notify::NotifyState::Stopping,
            sd_notify::NotifyState::Status("leases ended; leaving the directory"),
        ],
    );
    STOP.store(true, Ordering::SeqCst);
    let _ = watcher.join();
    drop(metrics);
    // Sessions have ended and devices are back: leave the directory now (revoke), not after
    // the TTL.
    drop(registration);
    log::info!("lenderd {} stopped", args.node);
    r
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    if let Err(e) = lending::cli::set_not_dumpable() {
        log::warn!("cannot make this process non-dumpable (PR_SET_DUMPABLE): {e}");
    }
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(dir) = lending::cli::generate_assets_requested(&argv) {
        return match lending::cli::generate_assets(Args::command(), &dir) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("lenderd: {}: {e}", dir.display());
                ExitCode::FAILURE
            }
        };
    }
    let cmd = Args::command().args_override_self(true);
    let argv = match lending::cli::expand_config(&cmd, argv) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("lenderd: {e}");
            return ExitCode::from(2);
        }
    };
    let args = match Args::from_arg_matches(&cmd.get_matches_from(argv)) {
        Ok(a) => a,
        Err(e) => e.exit(),
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log::error!("{e}");
            eprintln!("lenderd: {e}");
            ExitCode::FAILURE
        }
    }
}
