//! `lendvm`: boot a kernel (ELF or bzImage) in a KVM VM.
//!
//! Exit status: the guest's debug-exit code (port 0xf4), 0 on a guest shutdown, 1 on a VMM or
//! guest error, 2 on bad command-line values.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use vmm::config::{self, SerialConfig, VmConfig};
use vmm::{Vm, VmError, VmExit};

#[derive(Parser, Debug)]
#[command(
    name = "lendvm",
    version,
    about = "KVM hypervisor with remote (lent) PCI devices"
)]
struct Cli {
    /// Kernel image: ELF (vmlinux, test guest) or bzImage.
    #[arg(long, value_name = "PATH")]
    kernel: PathBuf,
    /// Kernel command line.
    #[arg(long, value_name = "STR", default_value = "")]
    cmdline: String,
    /// Initramfs image.
    #[arg(long, value_name = "PATH")]
    initramfs: Option<PathBuf>,
    /// Guest RAM size (K/M/G suffixes).
    #[arg(long, value_name = "SIZE", default_value = "512M", value_parser = config::parse_size)]
    memory: u64,
    /// Number of vCPUs.
    #[arg(long, value_name = "N", default_value = "1", value_parser = parse_cpus)]
    cpus: u8,
    /// Serial console: stdout, off or file=PATH.
    #[arg(long, value_name = "stdout|file=PATH|off", default_value = "stdout")]
    serial: SerialConfig,
    /// REST API socket (not yet supported).
    #[arg(long, value_name = "PATH")]
    api_socket: Option<PathBuf>,
    /// Borrow a remote device NODE:BDF (not yet supported).
    #[arg(long, value_name = "NODE:BDF")]
    remote_device: Vec<String>,
    /// Cluster description (not yet supported).
    #[arg(long, value_name = "FILE")]
    cluster: Option<PathBuf>,
}

fn parse_cpus(s: &str) -> Result<u8, String> {
    let n: u32 = s.parse().map_err(|_| format!("'{s}' is not a CPU count"))?;
    config::check_cpus(n).map_err(|e| e.to_string())
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

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = match Cli::try_parse() {
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
    if cli.api_socket.is_some() {
        return usage_error("--api-socket is not yet supported");
    }
    if !cli.remote_device.is_empty() {
        return usage_error("--remote-device is not yet supported");
    }
    if cli.cluster.is_some() {
        return usage_error("--cluster is not yet supported");
    }
    if !cli.kernel.is_file() {
        return usage_error(format!(
            "kernel file {} does not exist or is not a file",
            cli.kernel.display()
        ));
    }
    if let Some(p) = &cli.initramfs {
        if !p.is_file() {
            return usage_error(format!(
                "initramfs file {} does not exist or is not a file",
                p.display()
            ));
        }
    }
    let cfg = VmConfig {
        memory_size: cli.memory,
        cpus: cli.cpus,
        kernel: cli.kernel,
        cmdline: cli.cmdline,
        initramfs: cli.initramfs,
        serial: cli.serial,
    };
    let vm = match Vm::new(&cfg) {
        Ok(vm) => vm,
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
    let started = std::time::Instant::now();
    match vm.run(None) {
        Ok(exit) => {
            log::info!("guest ran {:?}: {exit:?}", started.elapsed());
            match &exit {
                VmExit::DebugExit(_) => {}
                VmExit::Shutdown(why) => eprintln!("lendvm: {why}"),
                VmExit::Error(why) => eprintln!("lendvm: error: {why}"),
            }
            ExitCode::from(exit.exit_code() as u8)
        }
        Err(e) => {
            eprintln!("lendvm: {}", chain(&e));
            ExitCode::from(1)
        }
    }
}
