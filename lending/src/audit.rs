//! The lender's lease audit log (`lenderd --audit-log FILE`): one JSON object per line for
//! every lease granted, every lease ended, and the requests a lease serves, so that an
//! operator (or the fault-injection harness's checker, `tests/src/chaos`) can tell from the
//! lender's own records who held which device when, under which fencing token, and whether
//! a lease served anything after it ended.
//!
//! ```text
//! {"mono_ms":81234,"node":"l1","boot":2210,"event":"grant","device":"0000:82:00.0","lease":3,"holder":"b1/vm0","fence":412}
//! {"mono_ms":81240,"node":"l1","boot":2210,"event":"serve","device":"0000:82:00.0","lease":3,"holder":"b1/vm0","fence":412}
//! {"mono_ms":90007,"node":"l1","boot":2210,"event":"end","device":"0000:82:00.0","lease":3,"holder":"b1/vm0","fence":412}
//! ```
//!
//! * `mono_ms` is `CLOCK_MONOTONIC` in milliseconds: one clock for every process of a host,
//!   so records of several lenders and a harness on one machine line up; it never jumps.
//! * `boot` tells runs of lenderd apart (lease ids start at 1 again after a restart).
//! * `fence` is the directory claim's revision the lease was granted under (absent without a
//!   directory).
//! * `serve` is written when a lease's request is handled, at most once per
//!   [`SERVE_INTERVAL`] per lease (a guest's I/O rate never turns into log lines), and always
//!   for the first request after a pause of the session (a lender stopped and continued
//!   writes one at once).
//! * Each line is written whole with one `write` to a file opened with `O_APPEND`, so a
//!   SIGKILLed lender leaves complete lines, and a restarted one appends to them.
//!
//! A write that fails (disk full) is logged, rate-limited, and lending goes on: the audit log
//! is an observer, like the metrics.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Errors of the audit log.
#[derive(Debug, Error)]
pub enum AuditError {
    /// The file cannot be opened for appending.
    #[error("audit log {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Least time between two `serve` records of one lease.
pub const SERVE_INTERVAL: Duration = Duration::from_millis(250);

/// What happened to a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AuditEvent {
    /// Granted (BORROW or BORROW_CLAIMED answered).
    Grant,
    /// A request of the lease was handled.
    Serve,
    /// Ended (returned, its link lost, its claim gone, lenderd stopping).
    End,
}

/// One line of the audit log, as written and as a reader parses it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditRecord {
    /// `CLOCK_MONOTONIC` in ms ([`monotonic_ms`]).
    pub mono_ms: u64,
    /// The lender's node name.
    pub node: String,
    /// Which run of lenderd wrote it: `CLOCK_MONOTONIC` in ms when it opened the log.
    /// Lease ids start again at 1 when lenderd restarts; `(node, boot, lease)` names one
    /// lease for good.
    #[serde(default)]
    pub boot: u64,
    /// What happened.
    pub event: AuditEvent,
    /// The device's id on the lender.
    pub device: String,
    /// The lease id.
    pub lease: u64,
    /// `node/vm` of the borrower.
    pub holder: String,
    /// The directory claim's revision the lease was granted under; absent without a
    /// directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<i64>,
    /// A `grant` that is a live migration's transfer of the lease to a new holder: the
    /// claim moved with it and keeps its revision, so `fence` is the previous holder's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub transfer: bool,
}

/// `CLOCK_MONOTONIC` in milliseconds.
pub fn monotonic_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the valid timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1000) + (ts.tv_nsec as u64) / 1_000_000
}

/// An open audit log.
pub struct AuditLog {
    node: String,
    boot: u64,
    file: Mutex<File>,
    path: PathBuf,
    /// The last write failure's report (rate limit).
    last_error: Mutex<Option<Instant>>,
}

impl AuditLog {
    /// Opens (creates, mode 0640) `path` for appending.
    pub fn open(path: &Path, node: &str) -> Result<AuditLog, AuditError> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o640)
            .open(path)
            .map_err(|source| AuditError::Open {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(AuditLog {
            node: node.to_string(),
            boot: monotonic_ms(),
            file: Mutex::new(file),
            path: path.to_path_buf(),
            last_error: Mutex::new(None),
        })
    }

    /// Writes one record (`transfer`: a grant that moves the lease, see [`AuditRecord`]).
    pub fn record(&self, event: AuditEvent, lease: &AuditedLease, transfer: bool) {
        let line = AuditRecord {
            mono_ms: monotonic_ms(),
            node: self.node.clone(),
            boot: self.boot,
            event,
            device: lease.device.clone(),
            lease: lease.lease,
            holder: lease.holder.clone(),
            fence: lease.fence,
            transfer,
        };
        let Ok(mut text) = serde_json::to_vec(&line) else {
            return;
        };
        text.push(b'\n');
        let r = match self.file.lock() {
            Ok(mut f) => f.write_all(&text),
            Err(p) => p.into_inner().write_all(&text),
        };
        if let Err(e) = r {
            let mut last = self
                .last_error
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                *last = Some(Instant::now());
                log::error!(
                    "audit log {}: {e}; lending goes on (one report per 10 s)",
                    self.path.display()
                );
            }
        }
    }
}

/// A lease as the audit log knows it: writes `grant` when made and `end` when dropped, so
/// that no path that ends a lease can forget its record.
pub struct AuditedLease {
    log: Option<std::sync::Arc<AuditLog>>,
    device: String,
    lease: u64,
    holder: String,
    fence: Option<i64>,
    last_serve: Option<Instant>,
}

impl AuditedLease {
    /// Records the grant (when `log` is set).
    pub fn grant(
        log: Option<std::sync::Arc<AuditLog>>,
        device: &str,
        lease: u64,
        holder: &str,
        fence: Option<i64>,
    ) -> AuditedLease {
        let a = AuditedLease {
            log,
            device: device.to_string(),
            lease,
            holder: holder.to_string(),
            fence,
            last_serve: None,
        };
        if let Some(l) = &a.log {
            l.record(AuditEvent::Grant, &a, false);
        }
        a
    }

    /// The lease moved to `holder` (a live migration's transfer): `end` for the old holder,
    /// then `grant` (marked `transfer`) for the new one, in that order, so the records never
    /// show two holders.
    pub fn rehold(&mut self, holder: &str) {
        if let Some(l) = &self.log {
            l.record(AuditEvent::End, self, false);
        }
        self.holder = holder.to_string();
        self.last_serve = None;
        if let Some(l) = &self.log {
            l.record(AuditEvent::Grant, self, true);
        }
    }

    /// Notes a request the lease serves: recorded at most once per [`SERVE_INTERVAL`].
    pub fn serve(&mut self) {
        let Some(l) = self.log.clone() else {
            return;
        };
        let now = Instant::now();
        if self
            .last_serve
            .is_some_and(|t| now.duration_since(t) < SERVE_INTERVAL)
        {
            return;
        }
        self.last_serve = Some(now);
        l.record(AuditEvent::Serve, self, false);
    }
}

impl Drop for AuditedLease {
    fn drop(&mut self) {
        if let Some(l) = self.log.take() {
            l.record(AuditEvent::End, self, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn lines(p: &Path) -> Vec<serde_json::Value> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn a_lease_writes_grant_serves_at_most_per_interval_and_end_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("audit.jsonl");
        let log = Arc::new(AuditLog::open(&p, "l1").unwrap());
        let t0 = monotonic_ms();
        {
            let mut a =
                AuditedLease::grant(Some(log.clone()), "0000:82:00.0", 7, "b1/vm0", Some(41));
            for _ in 0..100 {
                a.serve();
            }
            std::thread::sleep(SERVE_INTERVAL + Duration::from_millis(20));
            a.serve();
        }
        let v = lines(&p);
        let events: Vec<&str> = v.iter().map(|l| l["event"].as_str().unwrap()).collect();
        assert_eq!(events, ["grant", "serve", "serve", "end"]);
        for l in &v {
            assert_eq!(l["node"], "l1");
            assert_eq!(l["device"], "0000:82:00.0");
            assert_eq!(l["lease"], 7);
            assert_eq!(l["holder"], "b1/vm0");
            assert_eq!(l["fence"], 41);
            assert!(l["mono_ms"].as_u64().unwrap() >= t0);
        }
        // A restarted lender appends; a lease without a fence has no `fence` key.
        let log = Arc::new(AuditLog::open(&p, "l1").unwrap());
        drop(AuditedLease::grant(Some(log), "d", 1, "h", None));
        let v = lines(&p);
        assert_eq!(v.len(), 6);
        assert!(v[4].get("fence").is_none());
    }

    #[test]
    fn without_a_log_nothing_is_written_and_a_bad_path_is_named() {
        let mut a = AuditedLease::grant(None, "d", 1, "h", None);
        a.serve();
        drop(a);
        let e = AuditLog::open(Path::new("/nonexistent-dir/audit.jsonl"), "l1")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("/nonexistent-dir/audit.jsonl"), "{e}");
    }
}
