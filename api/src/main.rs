//! `lendctl`: control a running lendvm VMM over its REST socket, and list lendable devices.
//!
//! ```text
//! lendctl --api-socket S ping|info|add-remote-device node3:0000:81:00.0 [--id X] [--mode M]
//!                        |remove-device X [--force]|shutdown
//! lendctl --cluster F lenders|list
//! lendctl --lender NODE list|status
//! ```
//!
//! Tables by default, `--json` prints the server's JSON. Exit codes: 0 ok, 1 the server (or the
//! connection) reported an error, 2 usage error.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use api::client::{ApiClient, ClientError};
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
    /// Cluster config file: talk to every lender in it.
    #[arg(long, global = true, value_name = "FILE")]
    cluster: Option<PathBuf>,
    /// Talk to one lender (node name from the cluster config).
    #[arg(long, global = true, value_name = "NODE")]
    lender: Option<String>,
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
    /// List the lenders of the cluster (--cluster).
    Lenders,
    /// List devices across all lenders (--cluster) or of one lender (--lender).
    List,
    /// Show one lender's status (--lender).
    Status,
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

/// Renders rows as space-separated columns padded to the widest cell.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                s.push_str(cell);
            } else {
                s.push_str(&format!("{cell:<w$}  "));
            }
        }
        s
    };
    let mut out = line(header.to_vec());
    for row in rows {
        out.push('\n');
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
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
        Command::AddRemoteDevice { device, id, mode } => {
            let data = VmAddRemoteDeviceData {
                device: device.clone(),
                id: id.clone(),
                mode: *mode,
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
                println!("removal of {id} requested; the guest ejects it");
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
        Command::Lenders | Command::List | Command::Status => {
            return Err(Failure("internal: not a vmm command".into()))
        }
    }
    Ok(())
}

fn lender_command(cli: &Cli) -> Result<(), Failure> {
    let name = match cli.command {
        Command::Lenders => "lenders",
        Command::List => "list",
        _ => "status",
    };
    match (&cli.command, &cli.cluster, &cli.lender) {
        (Command::Lenders, None, _) => usage_error("`lenders` needs --cluster FILE"),
        (Command::List, None, None) => usage_error("`list` needs --cluster FILE or --lender NODE"),
        (Command::Status, _, None) => usage_error("`status` needs --lender NODE"),
        _ => {}
    }
    Err(Failure(format!(
        "`{name}` is not yet supported: it needs the lender client library (lending::client), \
         which this build does not have yet"
    )))
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Lenders | Command::List | Command::Status => lender_command(&cli),
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
