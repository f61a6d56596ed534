//! `lendvm-chaos`: the fault-injection harness's command line (issue 34).
//!
//! ```text
//! lendvm-chaos check HISTORY [--recover-ms N] [--api-ms N]   # exit 0: every invariant held; 1: violations
//! lendvm-chaos schedule --seed S --minutes N [--faults a,b|all] [--settle-ms N]
//! ```
//! Bad input (an unknown fault, a seed that is not a number, an unreadable history line)
//! exits 2 with a message naming it.

use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use lendvm_tests::chaos::check::{check, Bounds};
use lendvm_tests::chaos::history;
use lendvm_tests::chaos::schedule::{parse_minutes, parse_seed, FaultKind, Schedule, Topology};

#[derive(Parser)]
#[command(
    name = "lendvm-chaos",
    about = "lendvm's fault-injection harness: schedules and the history checker"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Checks a history (one JSON entry per line) against every invariant.
    Check {
        /// The history file.
        history: PathBuf,
        /// How long a VM may take, after a quiet point, to use its device again or be told.
        #[arg(long, default_value_t = Bounds::default().recover_ms)]
        recover_ms: u64,
        /// How long an API call may take.
        #[arg(long, default_value_t = Bounds::default().api_ms)]
        api_ms: u64,
    },
    /// Prints the fault schedule a seed gives.
    Schedule {
        /// The seed (a decimal integer).
        #[arg(long, value_parser = |s: &str| parse_seed(s))]
        seed: u64,
        /// The run's length in whole minutes (1 to 1440).
        #[arg(long, value_parser = |s: &str| parse_minutes(s))]
        minutes: u64,
        /// Fault kinds, comma-separated, or `all`.
        #[arg(long, default_value = "all", value_parser = |s: &str| FaultKind::parse_list(s).map(Kinds))]
        faults: Kinds,
        /// Quiet time kept after the last heal.
        #[arg(long, default_value_t = Bounds::default().recover_ms)]
        settle_ms: u64,
    },
}

/// A parsed `--faults` list (one value for clap, not one per occurrence).
#[derive(Clone)]
struct Kinds(Vec<FaultKind>);

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Check {
            history: path,
            recover_ms,
            api_ms,
        } => {
            let entries = match File::open(&path)
                .map_err(history::HistoryError::from)
                .and_then(|f| history::read(BufReader::new(f)))
            {
                Ok(e) => e,
                Err(e) => {
                    eprintln!("lendvm-chaos: {}: {e}", path.display());
                    return ExitCode::from(2);
                }
            };
            let bounds = Bounds {
                recover_ms,
                api_ms,
                ..Bounds::default()
            };
            let report = check(&entries, &bounds);
            print!("{report}");
            if report.ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Cmd::Schedule {
            seed,
            minutes,
            faults,
            settle_ms,
        } => {
            let kinds = faults.0;
            match Schedule::generate(
                seed,
                minutes * 60_000,
                settle_ms,
                &kinds,
                &Topology::default(),
            ) {
                Ok(s) => {
                    print!("{s}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("lendvm-chaos: {e}");
                    ExitCode::from(2)
                }
            }
        }
    }
}
