//! Writing a history while the cluster runs: every operation is begun (its start taken on
//! the recorder's one monotonic clock) and finished (its end and outcome), and written as one
//! line when it finishes. An operation still open when the recorder is closed is written
//! without an end: that is how the checker sees a call that never answered.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use super::history::{self, Entry, HistoryError, Op, Outcome};

/// An operation begun and not finished yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Pending(u64);

struct State {
    out: BufWriter<File>,
    open: BTreeMap<u64, (u64, Op)>,
    next: u64,
}

/// The history file of one run, shared by every thread of the harness.
pub struct Recorder {
    t0: Instant,
    state: Mutex<State>,
}

impl Recorder {
    /// Creates `path` (it must not exist: a history is never appended to another run's).
    pub fn create(path: &Path) -> Result<Self, HistoryError> {
        let f = File::options().write(true).create_new(true).open(path)?;
        Ok(Self {
            t0: Instant::now(),
            state: Mutex::new(State {
                out: BufWriter::new(f),
                open: BTreeMap::new(),
                next: 0,
            }),
        })
    }

    /// Milliseconds since the run began.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.t0.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Begins `op` now.
    pub fn begin(&self, op: Op) -> Pending {
        let start = self.now_ms();
        let mut st = self.lock();
        let id = st.next;
        st.next += 1;
        st.open.insert(id, (start, op));
        Pending(id)
    }

    /// Finishes a begun operation with `outcome`, now, and writes it. An op may replace
    /// what was begun (a read learns what it found only when it finishes).
    pub fn finish(&self, p: Pending, outcome: Outcome, op: Option<Op>) -> Result<(), HistoryError> {
        let end = self.now_ms();
        let mut st = self.lock();
        let Some((start, begun)) = st.open.remove(&p.0) else {
            return Ok(()); // finished twice: the first one counts
        };
        let e = Entry::span(start, end, outcome, op.unwrap_or(begun));
        history::write(&mut st.out, &e)
    }

    /// Records an observation that happened at one instant (a lease grant a lender logged,
    /// a fault injected).
    pub fn observe(&self, outcome: Outcome, op: Op) -> Result<(), HistoryError> {
        let e = Entry::at(self.now_ms(), outcome, op);
        history::write(&mut self.lock().out, &e)
    }

    /// Writes every operation still open without an end, flushes and closes the file.
    pub fn close(self) -> Result<(), HistoryError> {
        let mut st = self.state.into_inner().unwrap_or_else(|e| e.into_inner());
        let open = std::mem::take(&mut st.open);
        for (_, (start, op)) in open {
            let e = Entry {
                start_ms: start,
                end_ms: None,
                outcome: Outcome::Info,
                op,
            };
            history::write(&mut st.out, &e)?;
        }
        st.out.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::check::{check, Bounds, Invariant};

    #[test]
    fn begun_finished_and_open_operations_reach_the_checker() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.jsonl");
        let r = Recorder::create(&path).unwrap();
        let call = |c: &str| Op::Api {
            process: "b1-vm0".into(),
            call: c.into(),
        };
        let info = r.begin(call("vm.info"));
        let stuck = r.begin(call("vm.pause"));
        r.observe(
            Outcome::Info,
            Op::Fault {
                kind: "lender-kill".into(),
                target: "l1".into(),
            },
        )
        .unwrap();
        r.finish(info, Outcome::Ok, None).unwrap();
        r.finish(info, Outcome::Fail, None).unwrap(); // ignored
        r.observe(
            Outcome::Info,
            Op::Heal {
                kind: "lender-kill".into(),
                target: "l1".into(),
            },
        )
        .unwrap();
        r.close().unwrap();
        assert!(
            Recorder::create(&path).is_err(),
            "a history is never reused"
        );

        let h = history::read(std::io::BufReader::new(File::open(&path).unwrap())).unwrap();
        assert_eq!(h.len(), 4);
        let ok = h.iter().find(|e| e.op == call("vm.info")).unwrap();
        assert_eq!(ok.outcome, Outcome::Ok);
        assert!(ok.end_ms.is_some_and(|end| end >= ok.start_ms));
        let open = h.iter().find(|e| e.op == call("vm.pause")).unwrap();
        assert_eq!(open.end_ms, None);
        // The open call is what the checker reports.
        let report = check(&h, &Bounds::default());
        assert_eq!(report.count(Invariant::StuckCall), 1, "{report}");
        assert_eq!(report.violations.len(), 1, "{report}");
        let _ = stuck;
    }
}
