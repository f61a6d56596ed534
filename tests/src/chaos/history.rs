//! The history of a chaos run: one JSON object per line, one line per operation or
//! observation, written by the harness and read back by the checker ([`super::check`]).
//!
//! Every entry has the time it started and, when it finished, the time it ended (ms since
//! the run began, on the harness's one monotonic clock), an outcome in Jepsen's terms
//! ([`Outcome`]) and what it was ([`Op`]). Entries may be written in any order; the checker
//! sorts by time. A line that is not an entry is an error naming the line, never skipped:
//! a history the checker cannot read whole proves nothing.
//!
//! ```text
//! {"start_ms":1200,"end_ms":1214,"outcome":"ok","op":"write","vm":"b1-vm0","device":"l1:0000:82:00.0","block":7,"seq":3,"sum":2864434397}
//! {"start_ms":1300,"end_ms":1300,"outcome":"info","op":"lease-grant","lender":"l1","device":"l1:0000:82:00.0","lease":9,"holder":"b1/vm0","fence":4}
//! ```

use std::collections::BTreeMap;
use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize};

/// Errors reading or writing a history.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    /// A line is not a history entry.
    #[error("history line {line}: {message}")]
    Parse {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
    /// An entry is well-formed but impossible (ends before it starts).
    #[error("history line {line}: ends at {end_ms} ms, before its start at {start_ms} ms")]
    EndsBeforeStart {
        /// 1-based line number.
        line: usize,
        /// Start.
        start_ms: u64,
        /// End.
        end_ms: u64,
    },
    /// Reading or writing the file failed.
    #[error("history i/o")]
    Io(#[from] std::io::Error),
}

/// What came of an operation, as Jepsen says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// It happened and the caller was told so (an acknowledged write).
    Ok,
    /// It did not happen, and the caller knows it.
    Fail,
    /// Unknown: it may or may not have happened (a timeout, a lost link, an observation
    /// that is neither).
    Info,
}

/// What a VM saw of one of its devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceEvent {
    /// Attached (at launch or by hot-add) and working.
    Attached,
    /// Removed on purpose (hot-remove).
    Detached,
    /// Lost: the VM was told (a device-lost event, the device ejected).
    Lost,
}

/// Which resource snapshot of a daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Before the first fault.
    Baseline,
    /// After the last heal and the end of every workload.
    Final,
}

/// One operation or observation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Op {
    /// A guest wrote `block` of `device` with sequence number `seq` (per device, growing)
    /// and checksum `sum` of the block's contents.
    Write {
        vm: String,
        device: String,
        block: u64,
        seq: u64,
        sum: u32,
    },
    /// A guest read `block` of `device`: the sequence number and checksum it found (0 and 0
    /// for a block never written).
    Read {
        vm: String,
        device: String,
        block: u64,
        seq: u64,
        sum: u32,
    },
    /// After the run, `block` of a device that was declared lost, read from its lender's
    /// backing file.
    BackingRead {
        lender: String,
        device: String,
        block: u64,
        seq: u64,
        sum: u32,
    },
    /// A call to a daemon's API (a VM's REST API, lenderd's metrics, an etcd request):
    /// `end_ms` absent means it never answered.
    Api { process: String, call: String },
    /// A lender granted a lease on `device` to `holder` with fencing token `fence`;
    /// `transfer`: a live migration moved the previous holder's lease (and its claim, whose
    /// revision stays the token) to this one.
    LeaseGrant {
        lender: String,
        device: String,
        lease: u64,
        holder: String,
        fence: u64,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        transfer: bool,
    },
    /// A lender ended a lease (returned, fenced by a newer claim, reclaimed after its peer
    /// timeout, transferred).
    LeaseEnd {
        lender: String,
        device: String,
        lease: u64,
        reason: String,
    },
    /// A lender served a request (a BAR access, a DMA map, a doorbell) on a lease.
    LeaseServe {
        lender: String,
        device: String,
        lease: u64,
    },
    /// A VM's device event.
    Device {
        vm: String,
        device: String,
        event: DeviceEvent,
    },
    /// A fault began (`target`: what it hit, e.g. `l2`, `etcd-1`, `b1<->etcd`).
    Fault { kind: String, target: String },
    /// A fault was healed.
    Heal { kind: String, target: String },
    /// Counts of a daemon's resources (leases, windows, pins, fds, rss_kib, ...).
    Resources {
        daemon: String,
        phase: Phase,
        counts: BTreeMap<String, u64>,
    },
}

/// One history entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// When it started (ms since the run began).
    pub start_ms: u64,
    /// When it ended; `None`: never (a call still waiting when the run ended).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_ms: Option<u64>,
    /// What came of it.
    pub outcome: Outcome,
    /// What it was.
    #[serde(flatten)]
    pub op: Op,
}

impl Entry {
    /// An entry that happened at one instant (an observation).
    pub fn at(ms: u64, outcome: Outcome, op: Op) -> Self {
        Self {
            start_ms: ms,
            end_ms: Some(ms),
            outcome,
            op,
        }
    }

    /// An entry from `start_ms` to `end_ms`.
    pub fn span(start_ms: u64, end_ms: u64, outcome: Outcome, op: Op) -> Self {
        Self {
            start_ms,
            end_ms: Some(end_ms),
            outcome,
            op,
        }
    }

    /// The op's name as written in the history (`write`, `lease-grant`, ...).
    pub fn kind(&self) -> &'static str {
        match self.op {
            Op::Write { .. } => "write",
            Op::Read { .. } => "read",
            Op::BackingRead { .. } => "backing-read",
            Op::Api { .. } => "api",
            Op::LeaseGrant { .. } => "lease-grant",
            Op::LeaseEnd { .. } => "lease-end",
            Op::LeaseServe { .. } => "lease-serve",
            Op::Device { .. } => "device",
            Op::Fault { .. } => "fault",
            Op::Heal { .. } => "heal",
            Op::Resources { .. } => "resources",
        }
    }
}

/// Reads a whole history; the first bad line is an error naming it. Blank lines are
/// allowed (a history cut while a line was being written ends with one).
pub fn read(r: impl BufRead) -> Result<Vec<Entry>, HistoryError> {
    let mut out = Vec::new();
    for (i, line) in r.lines().enumerate() {
        let line_no = i + 1;
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let e: Entry = serde_json::from_str(&line).map_err(|e| HistoryError::Parse {
            line: line_no,
            message: e.to_string(),
        })?;
        if let Some(end_ms) = e.end_ms.filter(|&end| end < e.start_ms) {
            return Err(HistoryError::EndsBeforeStart {
                line: line_no,
                start_ms: e.start_ms,
                end_ms,
            });
        }
        out.push(e);
    }
    Ok(out)
}

/// Appends `entry` as one line.
pub fn write(mut w: impl Write, entry: &Entry) -> Result<(), HistoryError> {
    let line = serde_json::to_string(entry).map_err(|e| HistoryError::Parse {
        line: 0,
        message: format!("cannot encode entry: {e}"),
    })?;
    writeln!(w, "{line}")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_through_a_line_each() {
        let entries = vec![
            Entry::span(
                10,
                14,
                Outcome::Ok,
                Op::Write {
                    vm: "b1-vm0".into(),
                    device: "l1:0000:82:00.0".into(),
                    block: 7,
                    seq: 3,
                    sum: 0xaabb_ccdd,
                },
            ),
            Entry {
                start_ms: 20,
                end_ms: None,
                outcome: Outcome::Info,
                op: Op::Api {
                    process: "b1-vm0".into(),
                    call: "vm.info".into(),
                },
            },
            Entry::at(
                30,
                Outcome::Info,
                Op::Resources {
                    daemon: "l1".into(),
                    phase: Phase::Baseline,
                    counts: [("fds".to_string(), 40u64)].into_iter().collect(),
                },
            ),
        ];
        let mut buf = Vec::new();
        for e in &entries {
            write(&mut buf, e).unwrap();
        }
        assert_eq!(String::from_utf8_lossy(&buf).lines().count(), 3);
        assert!(String::from_utf8_lossy(&buf).contains("\"op\":\"write\""));
        assert_eq!(read(&buf[..]).unwrap(), entries);
    }

    #[test]
    fn a_bad_line_is_an_error_naming_it() {
        let good =
            r#"{"start_ms":1,"end_ms":2,"outcome":"ok","op":"api","process":"p","call":"c"}"#;
        let text = format!("{good}\n\n{good}\nnot json\n{good}\n");
        let e = read(text.as_bytes()).unwrap_err();
        assert!(matches!(e, HistoryError::Parse { line: 4, .. }), "{e}");
        assert!(e.to_string().starts_with("history line 4:"), "{e}");

        let unknown = r#"{"start_ms":1,"end_ms":2,"outcome":"ok","op":"teleport"}"#;
        let e = read(unknown.as_bytes()).unwrap_err();
        assert!(e.to_string().contains("teleport"), "{e}");

        let backwards =
            r#"{"start_ms":5,"end_ms":2,"outcome":"ok","op":"api","process":"p","call":"c"}"#;
        let e = read(backwards.as_bytes()).unwrap_err();
        assert!(
            matches!(e, HistoryError::EndsBeforeStart { line: 1, .. }),
            "{e}"
        );
    }
}
