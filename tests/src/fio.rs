//! The console protocol of the initramfs' fio runner (`tests/linux/initramfs/init`,
//! `lendvm_fio=<job>@<disk>,...`) and the parts of fio's JSON output the tests use.
//!
//! The runner prints, per run:
//!
//! ```text
//! LENDVM-FIO run i=<i> job=<job> disk=<disk>
//! LENDVM-FIO ran i=<i> rc=<fio's exit code>
//! LENDVM-FIO json-begin i=<i>
//! { ...fio --output-format=json... }
//! LENDVM-FIO json-end i=<i>
//! ```
//!
//! and `LENDVM-FIO done runs=<n> failed=<n>` at the end. Kernel messages may land between the
//! JSON lines on the shared console; they are recognised by their printk time stamp
//! (`[   12.345678] `) and dropped. So are the lines of a rerun of the `cat` that prints the
//! JSON, when the emulator's TLS fault killed it before it printed anything: the shell's
//! `Segmentation fault` and `/init`'s `LENDVM-FLAKE ...` (the host holds the latter to the
//! kernel's fault report: crate::flake).

use serde_json::Value;

/// Prefix of every line of the runner.
pub const MARKER: &str = "LENDVM-FIO ";

/// What can be wrong with the runner's output.
#[derive(Debug, thiserror::Error)]
pub enum FioError {
    #[error("no `LENDVM-FIO ran i={0}` line")]
    NoRan(usize),
    #[error("run {index}: no complete JSON block (json-begin/json-end)")]
    NoJson { index: usize },
    #[error("run {index}: fio's JSON does not parse: {source}")]
    BadJson {
        index: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("run {index}: fio's JSON has no {what}")]
    Missing { index: usize, what: String },
    #[error("no `LENDVM-FIO run` line: the runner did not start a job")]
    NoRuns,
}

/// `key=value` out of a marker line.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// Whether `line` is a kernel message (`[  12.345678] ...`).
fn is_printk(line: &str) -> bool {
    let Some(rest) = line.trim_start().strip_prefix('[') else {
        return false;
    };
    let Some((stamp, _)) = rest.split_once(']') else {
        return false;
    };
    let stamp = stamp.trim();
    !stamp.is_empty() && stamp.chars().all(|c| c.is_ascii_digit() || c == '.')
}

/// A line that a rerun of a killed process puts on the console: the shell's report of the
/// death (ash prints the signal's name) and the runner's `LENDVM-FLAKE` line. Neither can be
/// a line of fio's JSON.
fn is_rerun_noise(line: &str) -> bool {
    let l = line.trim();
    l == "Segmentation fault" || l.starts_with("LENDVM-FLAKE ")
}

/// Index of the first line `"LENDVM-FIO <what> i=<index>..."` (exact index).
pub fn marker_line(lines: &[String], what: &str, index: usize) -> Option<usize> {
    let want = index.to_string();
    lines.iter().position(|l| {
        l.find(MARKER)
            .map(|p| &l[p + MARKER.len()..])
            .and_then(|rest| rest.strip_prefix(what))
            .is_some_and(|rest| rest.starts_with(' ') && field(rest, "i") == Some(want.as_str()))
    })
}

/// The directions of one fio job's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    Read,
    Write,
}

impl Dir {
    fn key(self) -> &'static str {
        match self {
            Dir::Read => "read",
            Dir::Write => "write",
        }
    }
}

/// Figures of one direction of one fio job.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DirStats {
    pub total_ios: u64,
    pub io_bytes: u64,
    pub iops: f64,
    /// Bytes per second.
    pub bw_bytes: f64,
    /// Completion latency percentiles, nanoseconds (`percentile_list=50:99`).
    pub clat_p50_ns: Option<u64>,
    pub clat_p99_ns: Option<u64>,
}

/// One run of the runner: its marker fields and fio's JSON.
#[derive(Debug, Clone)]
pub struct FioRun {
    pub index: usize,
    pub job: String,
    pub disk: String,
    /// fio's exit code as the runner printed it (`nodev` when the disk never appeared).
    pub rc: String,
    pub json: Value,
}

impl FioRun {
    /// The first (only) job of this run's JSON.
    pub fn job_json(&self) -> Result<&Value, FioError> {
        self.json
            .get("jobs")
            .and_then(|j| j.get(0))
            .ok_or_else(|| self.missing("jobs[0]"))
    }

    fn missing(&self, what: &str) -> FioError {
        FioError::Missing {
            index: self.index,
            what: what.to_string(),
        }
    }

    /// fio's per-job `error` (0 = none; e.g. 84 EILSEQ for a verify mismatch).
    pub fn error(&self) -> Result<i64, FioError> {
        self.job_json()?
            .get("error")
            .and_then(Value::as_i64)
            .ok_or_else(|| self.missing("jobs[0].error"))
    }

    /// The figures of one direction.
    pub fn dir(&self, dir: Dir) -> Result<DirStats, FioError> {
        let d = self
            .job_json()?
            .get(dir.key())
            .ok_or_else(|| self.missing(&format!("jobs[0].{}", dir.key())))?;
        let u = |k: &str| {
            d.get(k)
                .and_then(Value::as_u64)
                .ok_or_else(|| self.missing(&format!("jobs[0].{}.{k}", dir.key())))
        };
        let f = |k: &str| {
            d.get(k)
                .and_then(Value::as_f64)
                .ok_or_else(|| self.missing(&format!("jobs[0].{}.{k}", dir.key())))
        };
        let pct = |p: &str| {
            d.get("clat_ns")
                .and_then(|c| c.get("percentile"))
                .and_then(|c| c.get(p))
                .and_then(Value::as_u64)
        };
        Ok(DirStats {
            total_ios: u("total_ios")?,
            io_bytes: u("io_bytes")?,
            iops: f("iops")?,
            bw_bytes: f("bw_bytes")?,
            clat_p50_ns: pct("50.000000"),
            clat_p99_ns: pct("99.000000"),
        })
    }
}

/// All runs the console shows, in order. Fails on the first run that started but has no
/// `ran` line or no parseable JSON block.
pub fn parse_runs(lines: &[String]) -> Result<Vec<FioRun>, FioError> {
    let mut runs = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let Some(rest) = line.find(MARKER).map(|p| &line[p + MARKER.len()..]) else {
            continue;
        };
        let Some(rest) = rest.strip_prefix("run ") else {
            continue;
        };
        let Some(index) = field(rest, "i").and_then(|i| i.parse::<usize>().ok()) else {
            continue;
        };
        let job = field(rest, "job").unwrap_or_default().to_string();
        let disk = field(rest, "disk").unwrap_or_default().to_string();
        let tail = &lines[n..];
        let ran = marker_line(tail, "ran", index).ok_or(FioError::NoRan(index))?;
        let rc = field(&tail[ran], "rc").unwrap_or_default().to_string();
        let begin = marker_line(tail, "json-begin", index).ok_or(FioError::NoJson { index })?;
        let end = marker_line(tail, "json-end", index).ok_or(FioError::NoJson { index })?;
        if end <= begin {
            return Err(FioError::NoJson { index });
        }
        let text: String = tail[begin + 1..end]
            .iter()
            .filter(|l| !is_printk(l) && !is_rerun_noise(l))
            .map(|l| format!("{l}\n"))
            .collect();
        let json =
            serde_json::from_str(&text).map_err(|source| FioError::BadJson { index, source })?;
        runs.push(FioRun {
            index,
            job,
            disk,
            rc,
            json,
        });
    }
    if runs.is_empty() {
        return Err(FioError::NoRuns);
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn console(json: &str) -> Vec<String> {
        let mut v: Vec<String> = [
            "[    1.000000] Run /init as init process",
            "LENDVM-FIO run i=1 job=verify disk=nvme0n1",
            "LENDVM-FIO ran i=1 rc=0",
            "LENDVM-FIO json-begin i=1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(json.lines().map(str::to_string));
        v.push("LENDVM-FIO json-end i=1".into());
        v.push("LENDVM-FIO done runs=1 failed=0".into());
        v
    }

    const JSON: &str = r#"{
  "fio version" : "fio-3.33",
  "jobs" : [
    {
      "jobname" : "verify",
      "error" : 0,
      "read" : { "io_bytes" : 1048576, "bw_bytes" : 5242880, "iops" : 1280.0, "total_ios" : 256,
        "clat_ns" : { "percentile" : { "50.000000" : 91648, "99.000000" : 7831552 } } },
[   12.345678] nvme nvme0: a kernel message in the middle
      "write" : { "io_bytes" : 1048576, "bw_bytes" : 1048576, "iops" : 256.5, "total_ios" : 256 }
    }
  ]
}"#;

    #[test]
    fn parses_a_run_and_drops_kernel_lines() {
        let runs = parse_runs(&console(JSON)).unwrap();
        assert_eq!(runs.len(), 1);
        let r = &runs[0];
        assert_eq!(
            (r.index, r.job.as_str(), r.disk.as_str(), r.rc.as_str()),
            (1, "verify", "nvme0n1", "0")
        );
        assert_eq!(r.error().unwrap(), 0);
        let rd = r.dir(Dir::Read).unwrap();
        assert_eq!(rd.total_ios, 256);
        assert_eq!(rd.clat_p50_ns, Some(91648));
        assert_eq!(rd.clat_p99_ns, Some(7_831_552));
        let wr = r.dir(Dir::Write).unwrap();
        assert_eq!(wr.total_ios, 256);
        assert_eq!(wr.iops, 256.5);
        assert_eq!(wr.clat_p50_ns, None);
    }

    /// CI, e176c64's loaded run: the emulator's TLS fault killed the `cat` that prints the
    /// JSON; the kernel's report, the shell's and the rerun's line came between json-begin
    /// and the JSON, and the case failed on a good run.
    #[test]
    fn a_rerun_of_the_json_cat_is_parsed() {
        let mut lines = console(JSON);
        let at = lines.iter().position(|l| l.contains("json-begin")).unwrap() + 1;
        for (i, l) in [
            "[  282.044996] exe[50]: segfault at 0 ip 00000000004a4d02 sp 00007ffd0deb9fa8 error 4 in busybox[401000+184000]",
            "[  282.138075] Code: 48 03 04 25 00 00 00 00 c3 66 66 2e 0f 1f 84 00 <48> 8b 00",
            "Segmentation fault",
            "LENDVM-FLAKE cat rc=139 attempt=1: died by signal 11, run again",
        ]
        .iter()
        .enumerate()
        {
            lines.insert(at + i, l.to_string());
        }
        let runs = parse_runs(&lines).unwrap();
        assert_eq!(runs[0].dir(Dir::Read).unwrap().total_ios, 256);
        // Anything else there is still an error.
        lines.insert(at, "cat: write error".to_string());
        assert!(matches!(
            parse_runs(&lines),
            Err(FioError::BadJson { index: 1, .. })
        ));
    }

    #[test]
    fn a_missing_or_cut_json_block_is_an_error() {
        let mut lines = console(JSON);
        lines.retain(|l| !l.contains("json-end"));
        assert!(matches!(
            parse_runs(&lines),
            Err(FioError::NoJson { index: 1 })
        ));
        let cut = console(&JSON[..JSON.len() / 2]);
        assert!(matches!(
            parse_runs(&cut),
            Err(FioError::BadJson { index: 1, .. })
        ));
        assert!(matches!(parse_runs(&[]), Err(FioError::NoRuns)));
        let no_ran: Vec<String> = console(JSON)
            .into_iter()
            .filter(|l| !l.contains(" ran "))
            .collect();
        assert!(matches!(parse_runs(&no_ran), Err(FioError::NoRan(1))));
    }

    #[test]
    fn markers_match_the_exact_index() {
        let lines: Vec<String> = ["LENDVM-FIO ran i=11 rc=0", "LENDVM-FIO ran i=1 rc=2"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(marker_line(&lines, "ran", 1), Some(1));
        assert_eq!(marker_line(&lines, "ran", 11), Some(0));
        assert_eq!(marker_line(&lines, "run", 1), None);
    }
}
