//! `lenderd`: lends this node's PCI devices to VMs on other nodes over the fabric.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use clap::Parser;
use lending::inventory::Inventory;
use lending::server::Lender;
use lending::spec::DeviceSpec;
use ntb::{ClusterConfig, Fabric, SocketFabric};

/// Lends this node's PCI devices over the NTB fabric.
#[derive(Parser, Debug)]
#[command(name = "lenderd", version)]
struct Args {
    /// This node's name in the cluster file.
    #[arg(long)]
    node: String,
    /// Cluster description (TOML).
    #[arg(long)]
    cluster: PathBuf,
    /// A device to lend: BDF=vfio | BDF=nvme:path=FILE,size=1G[,lba=512|4096][,mode=interrupt|polling] | BDF=dmatest[:mode=...]
    #[arg(long = "device", value_name = "SPEC")]
    devices: Vec<DeviceSpec>,
    /// Cluster auth token (visible in `ps`; prefer --token-file or $LENDVM_TOKEN).
    #[arg(long, conflicts_with = "token_file")]
    token: Option<String>,
    /// File holding the cluster auth token (surrounding whitespace is ignored); it must not be
    /// readable by group or others (mode 0600 or stricter).
    #[arg(long)]
    token_file: Option<PathBuf>,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// The cluster token: `--token`, else `--token-file`, else `$LENDVM_TOKEN`, else the cluster
/// file's `token`/`token_file`; never empty.
fn token(args: &Args, cluster: &ClusterConfig) -> Result<String, String> {
    let (t, from) = if let Some(t) = &args.token {
        (t.clone(), "--token".to_string())
    } else if let Some(p) = &args.token_file {
        // Refuses a file group or others can read, naming it and its mode.
        let t = ntb::config::read_token_file(p).map_err(|e| e.to_string())?;
        (t, format!("token file {}", p.display()))
    } else if let Ok(t) = std::env::var("LENDVM_TOKEN") {
        (t, "$LENDVM_TOKEN".to_string())
    } else if let Some(t) = cluster.auth_token().map_err(|e| e.to_string())? {
        (t, format!("cluster file {}", args.cluster.display()))
    } else {
        return Err(
            "no cluster token: pass --token, --token-file, set LENDVM_TOKEN or put token_file in the cluster file"
                .into(),
        );
    };
    if t.trim().is_empty() {
        return Err(format!("the cluster token from {from} is empty"));
    }
    Ok(t)
}

fn run(args: Args) -> Result<(), String> {
    let cluster = ClusterConfig::load(&args.cluster).map_err(|e| e.to_string())?;
    let token = token(&args, &cluster)?;
    let fabric = SocketFabric::from_cluster(&cluster, &args.node)
        .map_err(|e| format!("node {}: {e}", args.node))?;
    let mut devices = Vec::new();
    for spec in &args.devices {
        let b = lending::open_backend(spec).map_err(|e| format!("device {}: {e}", spec.id))?;
        log::info!("device {} ({}) available", spec.id, b.kind());
        devices.push((spec.id.clone(), b));
    }
    let inventory = Arc::new(Inventory::new(devices).map_err(|e| e.to_string())?);
    let listener = fabric.listen().map_err(|e| format!("listen: {e}"))?;
    let lender = Lender::new(inventory, &args.node, &token);
    let stop = lender.stop_flag();
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
    let watcher = std::thread::spawn(move || {
        while !STOP.load(Ordering::SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        stop.store(true, Ordering::SeqCst);
    });
    log::info!(
        "lenderd {} listening at {} with {} devices",
        args.node,
        listener.local_addr(),
        args.devices.len()
    );
    let r = lender.serve(listener.as_ref()).map_err(|e| e.to_string());
    STOP.store(true, Ordering::SeqCst);
    let _ = watcher.join();
    log::info!("lenderd {} stopped", args.node);
    r
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log::error!("{e}");
            eprintln!("lenderd: {e}");
            ExitCode::FAILURE
        }
    }
}
