//! Summarises the fio runs of a guest console log (the initramfs' fio runner, see
//! `lendvm_tests::fio`): one line per run with fio's figures. Exits 1 when a run is missing
//! its JSON, fio failed, or fio reported an error. Used by `scripts/demo.sh`.
//!
//! `lendvm-fio-summary CONSOLE_LOG`

use std::process::ExitCode;

use lendvm_tests::fio::{parse_runs, Dir, DirStats, FioRun};

fn dir_text(name: &str, d: &DirStats) -> String {
    if d.total_ios == 0 {
        return String::new();
    }
    let us =
        |ns: Option<u64>| ns.map_or("n/a".to_string(), |v| format!("{:.0}", v as f64 / 1000.0));
    format!(
        "  {name} {} I/Os {:.0} IOPS {:.2} MiB/s clat p50 {} µs p99 {} µs",
        d.total_ios,
        d.iops,
        d.bw_bytes / f64::from(1u32 << 20),
        us(d.clat_p50_ns),
        us(d.clat_p99_ns)
    )
}

/// One run's line, or what is wrong with it.
fn summary(run: &FioRun) -> Result<String, String> {
    let err = run.error().map_err(|e| e.to_string())?;
    let r = run.dir(Dir::Read).map_err(|e| e.to_string())?;
    let w = run.dir(Dir::Write).map_err(|e| e.to_string())?;
    let line = format!(
        "fio {} on /dev/{}: exit {}, errors {err}{}{}",
        run.job,
        run.disk,
        run.rc,
        dir_text("write", &w),
        dir_text("read", &r)
    );
    if run.rc != "0" || err != 0 {
        Err(line)
    } else {
        Ok(line)
    }
}

fn main() -> ExitCode {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: lendvm-fio-summary CONSOLE_LOG");
        return ExitCode::from(2);
    };
    let text = match std::fs::read(&path) {
        Ok(t) => String::from_utf8_lossy(&t).into_owned(),
        Err(e) => {
            eprintln!("lendvm-fio-summary: cannot read {path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let lines: Vec<String> = text
        .lines()
        .map(|l| l.trim_end_matches('\r').to_string())
        .collect();
    let runs = match parse_runs(&lines) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("lendvm-fio-summary: {path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut ok = true;
    for run in &runs {
        match summary(run) {
            Ok(l) => println!("{l}"),
            Err(l) => {
                println!("FAILED {l}");
                ok = false;
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
