//! `lendctl`: control a running lendvm VMM over its REST socket, and list lendable devices.
//!
//! ```text
//! lendctl --api-socket S ping|info|counters|pause|resume|shutdown|shutdown-vmm
//!                        |add-remote-device node3:0000:81:00.0 [--id X] [--mode M] [--replace-lost]
//!                        |remove-device X [--force]|events [--since SEQ] [--no-follow]
//!                        |snapshot file:///abs/dir
//!                        |send-migration unix:/path|tcp:host:port
//!                        |receive-migration unix:/path|tcp:host:port
//! lendctl --cluster F [--token T | --token-file PATH] [--node NAME] lenders|list
//! lendctl --cluster F --lender NODE list|status
//! lendctl --cluster etcd://HOST:PORT[,...] list|watch|lenders    (or a file with [directory])
//! ```
//!
//! With an etcd directory `list` is one range read of the directory (every device, its
//! state and its claim holder; no lender is contacted), `watch` prints every change as it
//! happens, and `--lender NODE list|status` still asks that one lender directly (its address
//! comes from the directory).
//!
//! Tables by default, `--json` prints the server's JSON (lender commands: see
//! [`api::lenders`]). Exit codes: 0 ok, 1 the server (or the connection, or a lender) reported
//! an error, 2 usage error. `lenders` lists unreachable lenders and still exits 0; `list`
//! exits 1 if any lender was unreachable (after printing the devices of the others).
//!
//! The cluster token comes from `--token`, else `--token-file` (mode 0600 or stricter), else
//! `$LENDVM_TOKEN`, else the cluster file's `token`/`token_file`; a token shorter than
//! `ntb::config::MIN_TOKEN_LEN` bytes (or too repetitive) is refused.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use api::client::{ApiClient, ClientError};
use api::events::VmEvent;
use api::lenders::{self, table, DeviceList, LenderRow, Session};
use api::types::{
    validate_device_id, RemoteDeviceMode, RemoteDeviceSpec, VmAddRemoteDeviceData, VmInfo,
    VmRemoveDeviceData,
};
use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "lendctl",
    version,
    about = "Control a lendvm VMM and list lendable devices"
)]
struct Cli {
    /// The VMM's REST socket (lendvm --api-socket).
    #[arg(long, global = true, value_name = "PATH")]
    api_socket: Option<PathBuf>,
    /// Cluster config file (talk to every lender in it), or an etcd directory
    /// (`etcd://host:port[,host:port...]`, or a file with a `[directory]` table).
    #[arg(long, global = true, value_name = "FILE|etcd://...")]
    cluster: Option<PathBuf>,
    /// Talk to one lender (node name from the cluster config).
    #[arg(long, global = true, value_name = "NODE")]
    lender: Option<String>,
    /// Cluster auth token for lenders (visible in `ps`; prefer --token-file or
    /// $LENDVM_TOKEN; else the cluster file's token).
    #[arg(
        long,
        global = true,
        value_name = "TOKEN",
        conflicts_with = "token_file"
    )]
    token: Option<String>,
    /// File holding the cluster auth token (surrounding whitespace ignored); it must not be
    /// readable by group or others (mode 0600 or stricter).
    #[arg(long, global = true, value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// Our node name on the fabric when talking to lenders (default lendctl-<pid>; need not
    /// be in the cluster file).
    #[arg(long, global = true, value_name = "NAME")]
    node: Option<String>,
    /// Print raw JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// Socket read/write timeout in seconds.
    #[arg(long, global = true, default_value_t = 35, value_name = "SECS")]
    timeout: u64,
    #[command(subcommand)]
    command: Command,
}

fn parse_id(s: &str) -> Result<String, String> {
    validate_device_id(s).map_err(|e| e.to_string())?;
    Ok(s.to_string())
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Check that the VMM answers (vmm.ping).
    Ping,
    /// Show the VM config, state and remote devices (vm.info).
    Info,
    /// Hot-add a device from a lender (vm.add-remote-device).
    AddRemoteDevice {
        /// NODE:DDDD:BB:DD.F, e.g. node3:0000:81:00.0
        device: RemoteDeviceSpec,
        /// Device id (the VMM picks one if absent).
        #[arg(long, value_parser = parse_id)]
        id: Option<String>,
        /// BAR access mode: direct or trapped.
        #[arg(long)]
        mode: Option<RemoteDeviceMode>,
        /// Clear a lost entry of the same device or id first (after a surprise removal).
        #[arg(long)]
        replace_lost: bool,
        /// The guest NUMA node the device sits in (the VM's --numa nodes): it goes on that
        /// node's root bus.
        #[arg(long, value_name = "N")]
        numa_node: Option<u32>,
    },
    /// Ask the guest to eject a device (vm.remove-device).
    RemoveDevice {
        #[arg(value_parser = parse_id)]
        id: String,
        /// Remove now, without waiting for the guest.
        #[arg(long)]
        force: bool,
    },
    /// Shut the VM down (vm.shutdown).
    Shutdown,
    /// Tear the VM down and end the VMM process (vmm.shutdown).
    ShutdownVmm,
    /// Stop the vCPUs and quiesce lent devices (vm.pause).
    Pause,
    /// Restart the vCPUs and re-arm lent devices (vm.resume).
    Resume,
    /// Write a snapshot of the VM to URL (vm.snapshot): file:///abs/dir or a path, a new or
    /// empty directory. A running VM is paused for it and resumed after.
    Snapshot {
        #[arg(value_name = "URL")]
        url: String,
    },
    /// Live-migrate the VM to the lendvm listening at URL (vm.send-migration): unix:/path or
    /// tcp:host:port. Prints the migration's events as they come; the source VMM exits once
    /// the destination has the VM.
    SendMigration {
        #[arg(value_name = "URL")]
        url: String,
        /// Same-host fast path (unix urls): pass guest RAM's memfd instead of copying it.
        #[arg(long)]
        local: bool,
    },
    /// Make a lendvm started with only --api-socket listen at URL for a migrating VM
    /// (vm.receive-migration): unix:/path or tcp:host:port. Returns once it listens.
    ReceiveMigration {
        #[arg(value_name = "URL")]
        url: String,
    },
    /// Per-device and KVM counters (vm.counters).
    Counters,
    /// Print the VMM's events as they happen (vm.events), until it shuts down.
    Events {
        /// Replay the retained events after this sequence number first (0: all retained).
        #[arg(long, value_name = "SEQ")]
        since: Option<u64>,
        /// Print what is retained and exit instead of following.
        #[arg(long)]
        no_follow: bool,
    },
    /// List the lenders of the cluster (--cluster).
    Lenders,
    /// List devices across all lenders (--cluster) or of one lender (--lender).
    List,
    /// Show one lender's status (--lender).
    Status,
    /// Stream directory changes (etcd directory): lenders, devices and claims coming and
    /// going, one line each.
    Watch {
        /// Stop after this many events.
        #[arg(long, value_name = "N")]
        count: Option<usize>,
        /// Stop after this many seconds.
        #[arg(long, value_name = "SECS")]
        seconds: Option<u64>,
    },
}

fn usage_error(msg: &str) -> ! {
    Cli::command()
        .error(ErrorKind::MissingRequiredArgument, msg)
        .exit()
}

/// A command failure: message for stderr.
struct Failure(String);

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Self {
        match e {
            ClientError::Status {
                status,
                reason,
                message,
            } => Failure(format!("{message} (http {status} {reason})")),
            other => Failure(other.to_string()),
        }
    }
}

fn print_json(body: &[u8]) {
    println!("{}", String::from_utf8_lossy(body).trim_end());
}

fn human_size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, size) in UNITS {
        if bytes >= size && bytes & (size - 1) == 0 {
            return format!("{} {unit}", bytes / size);
        }
    }
    format!("{bytes} B")
}

fn render_info(info: &VmInfo) -> String {
    let c = &info.config;
    let mut out = format!(
        "state:   {}\ncpus:    {}\nmemory:  {}\nkernel:  {}\ncmdline: {}\n",
        info.state,
        c.cpus,
        human_size(c.memory_size),
        c.kernel,
        c.cmdline
    );
    if let Some(n) = c.pci_slots {
        out.push_str(&format!("pci:     slots 1 to {n} for devices\n"));
    }
    for node in &c.numa_nodes {
        let cpus: Vec<String> = node.cpus.iter().map(u32::to_string).collect();
        let dist: Vec<String> = node.distances.iter().map(u32::to_string).collect();
        out.push_str(&format!(
            "numa:    node {}: cpus {}, memory {}, distances {}\n",
            node.id,
            if cpus.is_empty() {
                "none".to_string()
            } else {
                cpus.join(",")
            },
            human_size(node.memory_size),
            dist.join(" ")
        ));
    }
    for sw in &c.switches {
        out.push_str(&format!(
            "switch:  lender {} at {} (bus {:02x}, {} ports)\n",
            sw.lender, sw.bridge, sw.bus, sw.ports
        ));
    }
    if info.remote_devices.is_empty() {
        out.push_str("\nno remote devices");
        return out;
    }
    let rows: Vec<Vec<String>> = info
        .remote_devices
        .iter()
        .map(|d| {
            vec![
                d.id.clone(),
                d.node.clone(),
                d.lender_bdf.to_string(),
                d.guest_bdf.to_string(),
                d.mode.to_string(),
                d.lease_state.to_string(),
                if d.dma_window.mapped {
                    format!("yes ({})", human_size(d.dma_window.size))
                } else {
                    "no".into()
                },
                format!(
                    "{}/{}/{}",
                    d.interrupts.intx, d.interrupts.msi, d.interrupts.msix
                ),
            ]
        })
        .collect();
    out.push('\n');
    out.push_str(&table(
        &[
            "ID",
            "NODE",
            "LENDER BDF",
            "GUEST BDF",
            "MODE",
            "LEASE",
            "DMA WINDOW",
            "IRQS INTX/MSI/MSIX",
        ],
        &rows,
    ));
    out
}

/// `vm.counters` as one table per group: the `vm` group first, then devices.
fn render_counters(c: &api::types::VmCountersReport) -> String {
    if c.is_empty() {
        return "no counters".into();
    }
    let mut groups: Vec<&String> = c.keys().collect();
    groups.sort_by_key(|g| (g.as_str() != "vm", g.as_str()));
    let mut out = Vec::new();
    for g in groups {
        let rows: Vec<Vec<String>> = c[g]
            .iter()
            .map(|(k, v)| vec![k.clone(), v.to_string()])
            .collect();
        out.push(format!("[{g}]\n{}", table(&["COUNTER", "VALUE"], &rows)));
    }
    out.join("\n\n")
}

/// One event: its JSON line with `--json`, else `time  event  source  key=value ...`.
fn print_event(json: bool, ev: &VmEvent) {
    if json {
        match serde_json::to_string(ev) {
            Ok(l) => println!("{l}"),
            Err(e) => eprintln!("lendctl: cannot encode event {}: {e}", ev.seq),
        }
        return;
    }
    let props: Vec<String> = ev
        .properties
        .iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => format!("{k}={s}"),
            other => format!("{k}={other}"),
        })
        .collect();
    println!(
        "{:>6}.{:03}  {:<26} {:<8} {}",
        ev.timestamp.secs,
        ev.timestamp.nanos / 1_000_000,
        ev.event,
        ev.source,
        props.join(" ")
    );
}

fn vmm_command(cli: &Cli, client: &ApiClient) -> Result<(), Failure> {
    match &cli.command {
        Command::Ping => {
            let resp = client.request("GET", "vmm.ping", None)?.ok()?;
            if cli.json {
                print_json(&resp.body);
            } else {
                let p: api::types::VmmPingResponse = serde_json::from_slice(&resp.body)
                    .map_err(|e| Failure(format!("cannot decode the vmm.ping response: {e}")))?;
                println!(
                    "lendvm {} (pid {}) is alive; features: {}",
                    p.version,
                    p.pid,
                    if p.features.is_empty() {
                        "none".to_string()
                    } else {
                        p.features.join(", ")
                    }
                );
            }
        }
        Command::Info => {
            let resp = client.request("GET", "vm.info", None)?.ok()?;
            if cli.json {
                print_json(&resp.body);
            } else {
                let info: VmInfo = serde_json::from_slice(&resp.body)
                    .map_err(|e| Failure(format!("cannot decode the vm.info response: {e}")))?;
                println!("{}", render_info(&info));
            }
        }
        Command::AddRemoteDevice {
            device,
            id,
            mode,
            replace_lost,
            numa_node,
        } => {
            let data = VmAddRemoteDeviceData {
                device: device.clone(),
                id: id.clone(),
                mode: *mode,
                replace_lost: *replace_lost,
                numa_node: *numa_node,
            };
            let body = serde_json::to_vec(&data).map_err(|e| Failure(e.to_string()))?;
            let resp = client
                .request("PUT", "vm.add-remote-device", Some(&body))?
                .ok()?;
            if cli.json {
                print_json(&resp.body);
            } else {
                let d: api::types::PciDeviceInfo =
                    serde_json::from_slice(&resp.body).map_err(|e| {
                        Failure(format!(
                            "cannot decode the vm.add-remote-device response: {e}"
                        ))
                    })?;
                println!("added {} as {} at guest {}", device, d.id, d.bdf);
            }
        }
        Command::RemoveDevice { id, force } => {
            client.remove_device(&VmRemoveDeviceData {
                id: id.clone(),
                force: *force,
            })?;
            if cli.json {
                println!("{{}}");
            } else if *force {
                println!("removed {id}");
            } else {
                println!(
                    "removal of {id} requested; the guest ejects it, then its lease goes back \
                     to the lender (`lendctl events` shows device-released)"
                );
            }
        }
        Command::Shutdown => {
            client.shutdown()?;
            if cli.json {
                println!("{{}}");
            } else {
                println!("vm shutdown requested");
            }
        }
        Command::ShutdownVmm | Command::Pause | Command::Resume => {
            let (done, what) = match &cli.command {
                Command::Pause => (client.pause(), "vm paused"),
                Command::Resume => (client.resume(), "vm resumed"),
                _ => (client.vmm_shutdown(), "vmm shutdown requested"),
            };
            done?;
            if cli.json {
                println!("{{}}");
            } else {
                println!("{what}");
            }
        }
        Command::Snapshot { url } => {
            client.snapshot(&api::types::VmSnapshotConfig {
                destination_url: url.clone(),
            })?;
            if cli.json {
                println!("{{}}");
            } else {
                println!("snapshot written to {url}");
            }
        }
        Command::SendMigration { url, local } => {
            if !cli.json {
                // Progress: the migration's events, printed by a follower of vm.events (it
                // ends with the source VMM's event stream).
                let follower = client.clone();
                std::thread::spawn(move || {
                    let _ = follower.follow_events(None, |line| {
                        if let Ok(ev) = serde_json::from_str::<VmEvent>(line) {
                            if ev.event.starts_with("migration-") {
                                print_event(false, &ev);
                            }
                        }
                        true
                    });
                });
            }
            // The answer comes when the migration is done: wait as long as the server does.
            let client = ApiClient::new(
                client.socket().to_path_buf(),
                api::server::MIGRATION_TIMEOUT.max(Duration::from_secs(cli.timeout)),
            );
            client.send_migration(&api::types::VmSendMigrationData {
                destination_url: url.clone(),
                local: *local,
            })?;
            if cli.json {
                println!("{{}}");
            } else {
                println!("vm migrated to {url}");
            }
        }
        Command::ReceiveMigration { url } => {
            client.receive_migration(&api::types::VmReceiveMigrationData {
                receiver_url: url.clone(),
            })?;
            if cli.json {
                println!("{{}}");
            } else {
                println!("listening for a migrating vm at {url}");
            }
        }
        Command::Counters => {
            let resp = client.request("GET", "vm.counters", None)?.ok()?;
            if cli.json {
                print_json(&resp.body);
            } else {
                let c: api::types::VmCountersReport = serde_json::from_slice(&resp.body)
                    .map_err(|e| Failure(format!("cannot decode the vm.counters response: {e}")))?;
                println!("{}", render_counters(&c));
            }
        }
        Command::Events { since, no_follow } => {
            if *no_follow {
                for ev in client.events(since.unwrap_or(0))? {
                    print_event(cli.json, &ev);
                }
            } else {
                client.follow_events(*since, |line| {
                    match serde_json::from_str::<VmEvent>(line) {
                        Ok(ev) => print_event(cli.json, &ev),
                        // A line this lendctl does not know (e.g. a newer VMM): show it raw.
                        Err(_) => println!("{line}"),
                    }
                    true
                })?;
            }
        }
        Command::Lenders | Command::List | Command::Status | Command::Watch { .. } => {
            return Err(Failure("internal: not a vmm command".into()))
        }
    }
    Ok(())
}

fn lender_command(cli: &Cli) -> Result<(), Failure> {
    let cluster_path = match (&cli.command, &cli.cluster, &cli.lender) {
        (Command::Lenders, None, _) => usage_error("`lenders` needs --cluster FILE"),
        (Command::List, None, None) => usage_error("`list` needs --cluster FILE or --lender NODE"),
        (Command::Status, _, None) => usage_error("`status` needs --lender NODE"),
        (_, None, Some(_)) => {
            usage_error("--lender needs --cluster FILE (the lender's address comes from it)")
        }
        (_, Some(p), _) => p,
        (_, None, None) => usage_error("lender commands need --cluster FILE"),
    };
    let text = cluster_path.to_string_lossy();
    let file = if text.starts_with("etcd://") {
        None
    } else {
        Some(
            ntb::ClusterConfig::load(cluster_path)
                .map_err(|e| Failure(format!("cluster file {e}")))?,
        )
    };
    let directory = match &file {
        None => Some(ntb::DirectoryConfig::from_url(&text).map_err(Failure)?),
        Some(f) => f.directory.clone(),
    };
    if let Some(cfg) = directory {
        return directory_command(cli, &cfg, file.as_ref(), cluster_path);
    }
    if matches!(cli.command, Command::Watch { .. }) {
        usage_error(
            "`watch` needs an etcd directory (--cluster etcd://HOST:PORT or a [directory] table)",
        );
    }
    let local = match &cli.node {
        Some(n) => ntb::NodeId::new(n).unwrap_or_else(|e| usage_error(&format!("--node: {e}"))),
        None => ntb::NodeId::new(&format!("lendctl-{}", std::process::id()))
            .map_err(|e| Failure(e.to_string()))?,
    };
    let Some(cluster) = file else {
        return Err(Failure("internal: no cluster file".into()));
    };
    let token = cluster_token(cli, &cluster, cluster_path)?;
    let session = Session {
        local,
        token,
        connect_timeout: Duration::from_secs(cli.timeout.max(1)),
    };
    let fail = |e: lenders::LendersError| Failure(e.to_string());
    match (&cli.command, &cli.lender) {
        (Command::Status, Some(name)) => {
            let node = lenders::lender(&cluster, name).map_err(fail)?;
            let st = session.status(&cluster, node).map_err(fail)?;
            if cli.json {
                print_value(&st)?;
            } else {
                println!("{}", lenders::render_status(&st));
            }
            Ok(())
        }
        (Command::Lenders, _) => {
            let probes = match &cli.lender {
                Some(name) => {
                    let node = lenders::lender(&cluster, name).map_err(fail)?;
                    vec![lenders::Probe {
                        node,
                        result: session.probe(&cluster, node),
                    }]
                }
                None => session.probe_all(&cluster),
            };
            let rows: Vec<LenderRow> = probes.iter().map(LenderRow::new).collect();
            if cli.json {
                print_value(&rows)?;
            } else {
                println!("{}", lenders::render_lenders(&rows));
            }
            Ok(())
        }
        (Command::List, Some(name)) => {
            let node = lenders::lender(&cluster, name).map_err(fail)?;
            let devices = session.probe(&cluster, node).map_err(fail)?;
            let list = DeviceList::new(&[lenders::Probe {
                node,
                result: Ok(devices),
            }]);
            if cli.json {
                print_value(&list)?;
            } else {
                println!("{}", lenders::render_devices(&list.devices));
            }
            Ok(())
        }
        (Command::List, None) => {
            let list = DeviceList::new(&session.probe_all(&cluster));
            if cli.json {
                print_value(&list)?;
            } else {
                println!("{}", lenders::render_devices(&list.devices));
            }
            match list.unreachable.as_slice() {
                [] => Ok(()),
                down => {
                    for u in down {
                        eprintln!("lendctl: lender {} is unreachable: {}", u.node, u.error);
                    }
                    Err(Failure(format!(
                        "{} of {} lenders unreachable; the list is incomplete",
                        down.len(),
                        cluster.nodes.len()
                    )))
                }
            }
        }
        _ => Err(Failure("internal: not a lender command".into())),
    }
}

/// Our node name on the fabric: `--node`, else `lendctl-<pid>`.
fn local_node(cli: &Cli) -> Result<ntb::NodeId, Failure> {
    match &cli.node {
        Some(n) => Ok(ntb::NodeId::new(n).unwrap_or_else(|e| usage_error(&format!("--node: {e}")))),
        None => ntb::NodeId::new(&format!("lendctl-{}", std::process::id()))
            .map_err(|e| Failure(e.to_string())),
    }
}

/// The lender commands on an etcd directory.
fn directory_command(
    cli: &Cli,
    cfg: &ntb::DirectoryConfig,
    file: Option<&ntb::ClusterConfig>,
    cluster_path: &std::path::Path,
) -> Result<(), Failure> {
    use lending::directory::etcd::EtcdDirectory;
    use lending::directory::Directory;
    // Read-only views: no cluster secret, so no claims.
    let dir = EtcdDirectory::connect(cfg, None).map_err(|e| Failure(format!("directory: {e}")))?;
    let fail = |e: lenders::LendersError| Failure(e.to_string());
    // One lender, asked directly over the fabric (diagnosis): its address is in the directory.
    if let Some(name) = &cli.lender {
        let node = dir
            .lender(name)
            .map_err(|e| Failure(format!("{}: {e}", dir.describe())))?;
        let cluster = lending::directory::cluster_of(node);
        let token = match file {
            Some(f) => cluster_token(cli, f, cluster_path)?,
            None => given_token(cli)?.ok_or_else(|| {
                Failure("no cluster token: pass --token, --token-file or set LENDVM_TOKEN".into())
            })?,
        };
        let session = Session {
            local: local_node(cli)?,
            token,
            connect_timeout: Duration::from_secs(cli.timeout.max(1)),
        };
        let node = &cluster.nodes[0];
        return match &cli.command {
            Command::Status => {
                let st = session.status(&cluster, node).map_err(fail)?;
                if cli.json {
                    print_value(&st)
                } else {
                    println!("{}", lenders::render_status(&st));
                    Ok(())
                }
            }
            Command::List => {
                let devices = session.probe(&cluster, node).map_err(fail)?;
                let list = DeviceList::new(&[lenders::Probe {
                    node,
                    result: Ok(devices),
                }]);
                if cli.json {
                    print_value(&list)
                } else {
                    println!("{}", lenders::render_devices(&list.devices));
                    Ok(())
                }
            }
            _ => usage_error("--lender works with `list` and `status`"),
        };
    }
    match &cli.command {
        Command::List => {
            let snap = dir
                .snapshot()
                .map_err(|e| Failure(format!("{}: {e}", dir.describe())))?;
            let list = DeviceList::from_snapshot(&snap);
            if cli.json {
                print_value(&list)
            } else {
                println!("{}", lenders::render_devices(&list.devices));
                Ok(())
            }
        }
        Command::Lenders => {
            let snap = dir
                .snapshot()
                .map_err(|e| Failure(format!("{}: {e}", dir.describe())))?;
            let rows = lenders::directory_lenders(&snap);
            if cli.json {
                print_value(&rows)
            } else {
                println!("{}", lenders::render_lenders(&rows));
                Ok(())
            }
        }
        Command::Watch { count, seconds } => {
            let rx = dir
                .watch()
                .map_err(|e| Failure(format!("{}: {e}", dir.describe())))?;
            let deadline = seconds.map(|s| std::time::Instant::now() + Duration::from_secs(s));
            let mut seen = 0usize;
            while count.is_none_or(|c| seen < c) {
                let wait = match deadline {
                    Some(d) => d.saturating_duration_since(std::time::Instant::now()),
                    None => Duration::from_secs(3600),
                };
                if wait.is_zero() {
                    break;
                }
                let ev = match rx.recv_timeout(wait) {
                    Ok(ev) => ev.map_err(|e| Failure(e.to_string()))?,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                        return Err(Failure("the directory watch ended".into()))
                    }
                };
                if cli.json {
                    let line = serde_json::to_string(&ev)
                        .map_err(|e| Failure(format!("encoding JSON: {e}")))?;
                    println!("{line}");
                } else {
                    println!("{}", lenders::render_event(&ev));
                }
                seen += 1;
            }
            Ok(())
        }
        Command::Status => usage_error("`status` needs --lender NODE"),
        _ => Err(Failure("internal: not a lender command".into())),
    }
}

/// `--token`, else `--token-file` (mode-checked), else `$LENDVM_TOKEN` (if not empty),
/// each checked for strength ([`ntb::config::check_token`]); `None` if none is given.
fn given_token(cli: &Cli) -> Result<Option<String>, Failure> {
    let (t, from) = if let Some(t) = &cli.token {
        (t.clone(), "--token".to_string())
    } else if let Some(p) = &cli.token_file {
        // Refuses a file group or others can read, naming it and its mode.
        let t = ntb::config::read_token_file(p).map_err(|e| Failure(e.to_string()))?;
        (t, format!("token file {}", p.display()))
    } else {
        match std::env::var("LENDVM_TOKEN") {
            Ok(t) if !t.is_empty() => (t, "$LENDVM_TOKEN".to_string()),
            _ => return Ok(None),
        }
    };
    ntb::config::check_token(&t, &from).map_err(|e| Failure(e.to_string()))?;
    Ok(Some(t))
}

/// [`given_token`], else the cluster file's token (checked when it is read).
fn cluster_token(
    cli: &Cli,
    cluster: &ntb::ClusterConfig,
    path: &std::path::Path,
) -> Result<String, Failure> {
    if let Some(t) = given_token(cli)? {
        return Ok(t);
    }
    cluster
        .auth_token()
        .map_err(|e| Failure(e.to_string()))?
        .ok_or_else(|| {
            Failure(format!(
                "no cluster token: pass --token, --token-file, set LENDVM_TOKEN, or set \
                 token/token_file in {}",
                path.display()
            ))
        })
}

/// Prints a lender view as pretty JSON.
fn print_value<T: serde::Serialize>(v: &T) -> Result<(), Failure> {
    let text =
        serde_json::to_string_pretty(v).map_err(|e| Failure(format!("encoding JSON: {e}")))?;
    println!("{text}");
    Ok(())
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(dir) = lending::cli::generate_assets_requested(&argv) {
        return match lending::cli::generate_assets(Cli::command(), &dir) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("lendctl: {}: {e}", dir.display());
                ExitCode::FAILURE
            }
        };
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Lenders | Command::List | Command::Status | Command::Watch { .. } => {
            lender_command(&cli)
        }
        _ => {
            let Some(socket) = cli.api_socket.clone() else {
                usage_error("this command needs --api-socket PATH");
            };
            let client = ApiClient::new(socket, Duration::from_secs(cli.timeout.max(1)));
            vmm_command(&cli, &client)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure(msg)) => {
            eprintln!("lendctl: error: {msg}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_pads_columns() {
        let t = table(&["A", "BB"], &[vec!["xxx".into(), "y".into()]]);
        assert_eq!(t, "A    BB\nxxx  y");
    }

    #[test]
    fn sizes_are_human() {
        assert_eq!(human_size(512 << 20), "512 MiB");
        assert_eq!(human_size(3 << 30), "3 GiB");
        assert_eq!(human_size(1000), "1000 B");
    }

    #[test]
    fn cli_parses() {
        Cli::command().debug_assert();
        let c = Cli::try_parse_from([
            "lendctl",
            "--api-socket",
            "/s",
            "add-remote-device",
            "node3:0000:81:00.0",
            "--id",
            "nvme1",
            "--mode",
            "trapped",
        ])
        .unwrap();
        assert!(matches!(c.command, Command::AddRemoteDevice { .. }));
        assert!(
            Cli::try_parse_from(["lendctl", "add-remote-device", "node3:0000:81:20.0"]).is_err()
        );
        assert!(Cli::try_parse_from(["lendctl", "remove-device", "a/b"]).is_err());
    }
}
