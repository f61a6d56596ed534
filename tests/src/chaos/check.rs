//! The checker: reads a whole history ([`super::history`]) and decides whether the cluster
//! kept its promises while faults ran. Each promise is an [`Invariant`]; a broken one is a
//! [`Violation`] naming what, when and which entries.
//!
//! What is decided, and how (the rules are deliberately simple, so that a violation is
//! always a real one and a harness bug shows up as a violation, not as a pass):
//!
//! - **No acknowledged write lost** ([`Invariant::LostWrite`], [`Invariant::CorruptRead`]).
//!   Sequence numbers of one block grow with time (the harness writes them so). A read of a
//!   block must find the newest write acknowledged before the read began, or a newer one
//!   (a write that was not acknowledged may or may not have landed); never an older one,
//!   never a sequence number no write wrote, never a checksum other than that write's. Every
//!   acknowledged write must be read back after it ended, by a guest or, for a device that
//!   was declared lost, from its lender's backing file; one that never is is reported too.
//! - **Exclusive leases** ([`Invariant::DoubleLease`], [`Invariant::FenceOrder`],
//!   [`Invariant::FencedServe`]), by the lenders' own records: two leases of one device held
//!   by different holders never overlap (a lease runs from its grant to its end); fencing
//!   tokens of one device grow with every grant; no lease is served after it ended.
//! - **Liveness** ([`Invariant::Recovery`], [`Invariant::StuckCall`]). At every *quiet
//!   point* (a heal after which no fault is active) each VM that holds a device must, within
//!   [`Bounds::recover_ms`], either use it successfully or be told it is lost (or remove it).
//!   Every API call answers within [`Bounds::api_ms`]; one that never answers is stuck. A
//!   fault that is never healed, and a history that ends before a bound has run out, are
//!   violations too: the harness must heal everything and wait.
//! - **No leak** ([`Invariant::Leak`]): each daemon's final resource counts are at most its
//!   baseline's; resident memory (`rss_kib`) may grow by [`Bounds::rss_slack_kib`] or a
//!   tenth, whichever is larger.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use super::history::{DeviceEvent, Entry, Op, Outcome, Phase};

/// The limits the liveness and leak rules use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// After a quiet point, how long a VM may take to use its device again or be told it is
    /// lost.
    pub recover_ms: u64,
    /// How long an API call may take.
    pub api_ms: u64,
    /// How much a daemon's resident memory may grow over the run, at least.
    pub rss_slack_kib: u64,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            // A lender's peer timeout (5 s) plus a claim's TTL (10 s) plus a Linux driver's
            // own timeout and re-probe, on a loaded 2-core machine.
            recover_ms: 60_000,
            api_ms: 10_000,
            rss_slack_kib: 16 << 10,
        }
    }
}

/// The promises a history is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Invariant {
    /// An acknowledged write not found where it must be.
    LostWrite,
    /// A read that found what no write wrote.
    CorruptRead,
    /// Two holders' leases of one device overlapping.
    DoubleLease,
    /// A fencing token that did not grow.
    FenceOrder,
    /// A lease served after it ended.
    FencedServe,
    /// A VM neither working again nor told, within the bound after a quiet point.
    Recovery,
    /// An API call that never answered or answered too late.
    StuckCall,
    /// A daemon holding more at the end than at its baseline.
    Leak,
}

impl Invariant {
    /// Every invariant, in report order.
    pub const ALL: [Invariant; 8] = [
        Invariant::LostWrite,
        Invariant::CorruptRead,
        Invariant::DoubleLease,
        Invariant::FenceOrder,
        Invariant::FencedServe,
        Invariant::Recovery,
        Invariant::StuckCall,
        Invariant::Leak,
    ];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Invariant::LostWrite => "no acknowledged write lost",
            Invariant::CorruptRead => "reads find only what was written",
            Invariant::DoubleLease => "one holder per device",
            Invariant::FenceOrder => "fencing tokens grow",
            Invariant::FencedServe => "no lease served after its end",
            Invariant::Recovery => "every VM recovers or is told",
            Invariant::StuckCall => "every call answers in time",
            Invariant::Leak => "no leak",
        }
    }
}

/// One broken promise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Which.
    pub invariant: Invariant,
    /// When it shows (ms since the run began).
    pub at_ms: u64,
    /// What, naming the entries.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ms: {}: {}",
            self.at_ms,
            self.invariant.name(),
            self.message
        )
    }
}

/// What the checker found.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Entries read.
    pub entries: usize,
    /// Entries by op (`write`, `lease-grant`, ...).
    pub ops: BTreeMap<&'static str, usize>,
    /// Faults injected, by kind.
    pub faults: BTreeMap<String, usize>,
    /// Every violation, in time order.
    pub violations: Vec<Violation>,
}

impl Report {
    /// True when no invariant was broken.
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// How many times `inv` was broken.
    pub fn count(&self, inv: Invariant) -> usize {
        self.violations
            .iter()
            .filter(|v| v.invariant == inv)
            .count()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} entries", self.entries)?;
        writeln!(f, "| op | count |\n|---|---|")?;
        for (op, n) in &self.ops {
            writeln!(f, "| {op} | {n} |")?;
        }
        writeln!(f, "\n| fault | injected |\n|---|---|")?;
        for (kind, n) in &self.faults {
            writeln!(f, "| {kind} | {n} |")?;
        }
        writeln!(f, "\n| invariant | result |\n|---|---|")?;
        for inv in Invariant::ALL {
            match self.count(inv) {
                0 => writeln!(f, "| {} | held |", inv.name())?,
                n => writeln!(f, "| {} | **{n} violation(s)** |", inv.name())?,
            }
        }
        for v in &self.violations {
            writeln!(f, "{v}")?;
        }
        Ok(())
    }
}

/// Checks `history` against every invariant.
pub fn check(history: &[Entry], bounds: &Bounds) -> Report {
    let mut entries: Vec<&Entry> = history.iter().collect();
    entries.sort_by_key(|e| (e.start_ms, e.end_ms));
    let mut report = Report {
        entries: entries.len(),
        ..Report::default()
    };
    for e in &entries {
        *report.ops.entry(e.kind()).or_default() += 1;
        if let Op::Fault { kind, .. } = &e.op {
            *report.faults.entry(kind.clone()).or_default() += 1;
        }
    }
    let mut v = Vec::new();
    writes_and_reads(&entries, &mut v);
    leases(&entries, &mut v);
    recovery(&entries, bounds, &mut v);
    calls(&entries, bounds, &mut v);
    leaks(&entries, bounds, &mut v);
    v.sort_by_key(|x| (x.at_ms, x.invariant));
    report.violations = v;
    report
}

fn violation(invariant: Invariant, at_ms: u64, message: String) -> Violation {
    Violation {
        invariant,
        at_ms,
        message,
    }
}

/// A write of one block, as the checker needs it.
struct BlockWrite {
    seq: u64,
    sum: u32,
    start: u64,
    /// End of an acknowledged write; `None` for one that was not acknowledged.
    acked_at: Option<u64>,
    vm: String,
}

fn writes_and_reads(entries: &[&Entry], v: &mut Vec<Violation>) {
    let mut writes: BTreeMap<(&str, u64), Vec<BlockWrite>> = BTreeMap::new();
    for e in entries {
        if let Op::Write {
            vm,
            device,
            block,
            seq,
            sum,
        } = &e.op
        {
            writes
                .entry((device.as_str(), *block))
                .or_default()
                .push(BlockWrite {
                    seq: *seq,
                    sum: *sum,
                    start: e.start_ms,
                    acked_at: (e.outcome == Outcome::Ok).then_some(e.end_ms).flatten(),
                    vm: vm.clone(),
                });
        }
    }
    // Reads (by a guest, or of a lost device's backing file) that finished with a result.
    let mut last_read: BTreeMap<(&str, u64), u64> = BTreeMap::new();
    for e in entries {
        let (who, device, block, seq, sum) = match &e.op {
            Op::Read {
                vm,
                device,
                block,
                seq,
                sum,
            } => (vm.as_str(), device.as_str(), *block, *seq, *sum),
            Op::BackingRead {
                lender,
                device,
                block,
                seq,
                sum,
            } => (lender.as_str(), device.as_str(), *block, *seq, *sum),
            _ => continue,
        };
        if e.outcome != Outcome::Ok {
            continue;
        }
        let Some(read_end) = e.end_ms else { continue };
        let kind = e.kind();
        let slot = last_read.entry((device, block)).or_default();
        *slot = (*slot).max(e.start_ms);
        let ws = writes
            .get(&(device, block))
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        // The newest write acknowledged before this read began.
        let must = ws
            .iter()
            .filter(|w| w.acked_at.is_some_and(|a| a < e.start_ms))
            .max_by_key(|w| w.seq);
        if seq == 0 {
            if sum != 0 {
                v.push(violation(
                    Invariant::CorruptRead,
                    e.start_ms,
                    format!(
                        "{kind} by {who} of {device} block {block} found checksum {sum:#x} \
                         in a block never written"
                    ),
                ));
            }
        } else {
            match ws.iter().find(|w| w.seq == seq) {
                None => v.push(violation(
                    Invariant::CorruptRead,
                    e.start_ms,
                    format!(
                        "{kind} by {who} of {device} block {block} found seq {seq}, which no \
                         write of that block wrote"
                    ),
                )),
                Some(w) if w.sum != sum => v.push(violation(
                    Invariant::CorruptRead,
                    e.start_ms,
                    format!(
                        "{kind} by {who} of {device} block {block} found seq {seq} with \
                         checksum {sum:#x}; {} wrote it with {:#x}",
                        w.vm, w.sum
                    ),
                )),
                Some(w) if w.start > read_end => v.push(violation(
                    Invariant::CorruptRead,
                    e.start_ms,
                    format!(
                        "{kind} by {who} of {device} block {block} ending at {read_end} ms \
                         found seq {seq}, written only from {} ms",
                        w.start
                    ),
                )),
                Some(_) => {}
            }
        }
        if let Some(m) = must.filter(|m| m.seq > seq) {
            v.push(violation(
                Invariant::LostWrite,
                e.start_ms,
                format!(
                    "{device} block {block}: write seq {} by {} acknowledged at {} ms is lost: \
                     {kind} by {who} from {} ms found seq {seq}",
                    m.seq,
                    m.vm,
                    m.acked_at.unwrap_or_default(),
                    e.start_ms
                ),
            ));
        }
    }
    // Every acknowledged write must have been read back after it.
    for ((device, block), ws) in &writes {
        let read_from = last_read.get(&(*device, *block)).copied();
        for w in ws {
            let Some(acked) = w.acked_at else { continue };
            if read_from.is_none_or(|r| r <= acked) {
                v.push(violation(
                    Invariant::LostWrite,
                    acked,
                    format!(
                        "{device} block {block}: write seq {} by {} acknowledged at {acked} ms \
                         was never read back (the harness reads every written block at the end)",
                        w.seq, w.vm
                    ),
                ));
            }
        }
    }
}

/// One lease as the lenders recorded it.
struct Lease<'a> {
    lender: &'a str,
    id: u64,
    holder: &'a str,
    fence: u64,
    transfer: bool,
    granted: u64,
    ended: Option<u64>,
}

fn leases(entries: &[&Entry], v: &mut Vec<Violation>) {
    let mut ends: BTreeMap<(&str, u64), u64> = BTreeMap::new();
    for e in entries {
        if let Op::LeaseEnd { lender, lease, .. } = &e.op {
            ends.entry((lender.as_str(), *lease)).or_insert(e.start_ms);
        }
    }
    let mut by_device: BTreeMap<&str, Vec<Lease>> = BTreeMap::new();
    for e in entries {
        if let Op::LeaseGrant {
            lender,
            device,
            lease,
            holder,
            fence,
            transfer,
        } = &e.op
        {
            by_device.entry(device.as_str()).or_default().push(Lease {
                lender,
                id: *lease,
                holder,
                fence: *fence,
                transfer: *transfer,
                granted: e.start_ms,
                ended: ends.get(&(lender.as_str(), *lease)).copied(),
            });
        }
    }
    for (device, ls) in &by_device {
        // `entries` is in time order, so each device's grants are too.
        for pair in ls.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            // A transfer keeps the token it moved with (the same claim); any other grant
            // needs a newer one.
            if b.fence < a.fence || (b.fence == a.fence && !b.transfer) {
                v.push(violation(
                    Invariant::FenceOrder,
                    b.granted,
                    format!(
                        "{device}: lease {} to {} at {} ms has fence {}, not above lease {}'s {}",
                        b.id, b.holder, b.granted, b.fence, a.id, a.fence
                    ),
                ));
            }
        }
        for (i, a) in ls.iter().enumerate() {
            for b in &ls[i + 1..] {
                let overlaps = a.ended.is_none_or(|end| end > b.granted);
                if overlaps && a.holder != b.holder {
                    v.push(violation(
                        Invariant::DoubleLease,
                        b.granted,
                        format!(
                            "{device}: lease {} of {} to {} granted at {} ms while lease {} of \
                             {} to {} (granted at {} ms) {}",
                            b.id,
                            b.lender,
                            b.holder,
                            b.granted,
                            a.id,
                            a.lender,
                            a.holder,
                            a.granted,
                            match a.ended {
                                Some(end) => format!("ran until {end} ms"),
                                None => "never ended".into(),
                            }
                        ),
                    ));
                }
            }
        }
    }
    let granted: BTreeSet<(&str, u64)> = by_device
        .values()
        .flatten()
        .map(|l| (l.lender, l.id))
        .collect();
    for e in entries {
        if let Op::LeaseServe {
            lender,
            device,
            lease,
        } = &e.op
        {
            let key = (lender.as_str(), *lease);
            if !granted.contains(&key) {
                v.push(violation(
                    Invariant::FencedServe,
                    e.start_ms,
                    format!("{lender} served lease {lease} of {device}, which it never granted"),
                ));
            } else if let Some(&end) = ends.get(&key).filter(|&&end| e.start_ms > end) {
                v.push(violation(
                    Invariant::FencedServe,
                    e.start_ms,
                    format!(
                        "{lender} served lease {lease} of {device} at {} ms, after it ended at \
                         {end} ms",
                        e.start_ms
                    ),
                ));
            }
        }
    }
}

/// The times at which a heal left no fault active, and every fault never healed.
fn quiet_points<'a>(entries: &[&'a Entry]) -> (Vec<u64>, Vec<(&'a str, &'a str, u64)>) {
    let mut active: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    let mut quiet = Vec::new();
    for e in entries {
        match &e.op {
            Op::Fault { kind, target } => {
                active.insert((kind.as_str(), target.as_str()), e.start_ms);
            }
            Op::Heal { kind, target }
                if active.remove(&(kind.as_str(), target.as_str())).is_some()
                    && active.is_empty() =>
            {
                quiet.push(e.end_ms.unwrap_or(e.start_ms));
            }
            _ => {}
        }
    }
    let open = active.into_iter().map(|((k, t), s)| (k, t, s)).collect();
    (quiet, open)
}

fn recovery(entries: &[&Entry], bounds: &Bounds, v: &mut Vec<Violation>) {
    let (quiet, open) = quiet_points(entries);
    for (kind, target, start) in open {
        v.push(violation(
            Invariant::Recovery,
            start,
            format!("fault {kind} on {target} from {start} ms was never healed"),
        ));
    }
    let last = entries
        .iter()
        .map(|e| e.end_ms.unwrap_or(e.start_ms))
        .max()
        .unwrap_or(0);
    for q in quiet {
        // What each VM held at the quiet point: its devices' last events before it.
        let mut held: BTreeMap<(&str, &str), DeviceEvent> = BTreeMap::new();
        for e in entries.iter().filter(|e| e.start_ms <= q) {
            if let Op::Device { vm, device, event } = &e.op {
                held.insert((vm.as_str(), device.as_str()), *event);
            }
        }
        let deadline = q.saturating_add(bounds.recover_ms);
        for ((vm, device), _) in held.iter().filter(|(_, ev)| **ev == DeviceEvent::Attached) {
            let in_time = |t: u64| t >= q && t <= deadline;
            let answered = entries.iter().any(|e| match &e.op {
                Op::Write {
                    vm: w, device: d, ..
                }
                | Op::Read {
                    vm: w, device: d, ..
                } => {
                    w == vm
                        && d == device
                        && e.outcome == Outcome::Ok
                        && e.start_ms >= q
                        && e.end_ms.is_some_and(in_time)
                }
                Op::Device {
                    vm: w,
                    device: d,
                    event,
                } => {
                    w == vm && d == device && *event != DeviceEvent::Attached && in_time(e.start_ms)
                }
                _ => false,
            });
            if answered {
                continue;
            }
            let message = if last < deadline {
                format!(
                    "{vm} held {device} at the quiet point {q} ms; the history ends at {last} \
                     ms, before the {} ms bound ran out, with no successful I/O and no loss \
                     event (the harness must wait the bound after its last heal)",
                    bounds.recover_ms
                )
            } else {
                format!(
                    "{vm} held {device} at the quiet point {q} ms and within {} ms neither \
                     used it successfully nor was told it is lost",
                    bounds.recover_ms
                )
            };
            v.push(violation(Invariant::Recovery, q, message));
        }
    }
}

fn calls(entries: &[&Entry], bounds: &Bounds, v: &mut Vec<Violation>) {
    for e in entries {
        let Op::Api { process, call } = &e.op else {
            continue;
        };
        match e.end_ms {
            None => v.push(violation(
                Invariant::StuckCall,
                e.start_ms,
                format!("{call} to {process} from {} ms never answered", e.start_ms),
            )),
            Some(end) if end - e.start_ms > bounds.api_ms => v.push(violation(
                Invariant::StuckCall,
                e.start_ms,
                format!(
                    "{call} to {process} took {} ms (bound {} ms)",
                    end - e.start_ms,
                    bounds.api_ms
                ),
            )),
            Some(_) => {}
        }
    }
}

fn leaks(entries: &[&Entry], bounds: &Bounds, v: &mut Vec<Violation>) {
    // Per daemon: (time, counts) of its baseline and its final snapshot.
    type Snapshot<'a> = Option<(u64, &'a BTreeMap<String, u64>)>;
    let mut snaps: BTreeMap<&str, [Snapshot; 2]> = BTreeMap::new();
    for e in entries {
        if let Op::Resources {
            daemon,
            phase,
            counts,
        } = &e.op
        {
            let slot = &mut snaps.entry(daemon.as_str()).or_default()[match phase {
                Phase::Baseline => 0,
                Phase::Final => 1,
            }];
            // The first baseline and the last final snapshot count.
            if slot.is_none() || *phase == Phase::Final {
                *slot = Some((e.start_ms, counts));
            }
        }
    }
    for (daemon, [base, fin]) in snaps {
        let (Some((_, base)), Some((at, fin))) = (base, fin) else {
            let at = base.or(fin).map(|s| s.0).unwrap_or_default();
            v.push(violation(
                Invariant::Leak,
                at,
                format!("{daemon} has no baseline or no final resource snapshot"),
            ));
            continue;
        };
        for (key, &now) in fin {
            let was = base.get(key).copied().unwrap_or(0);
            let allowed = if key == "rss_kib" {
                was + bounds.rss_slack_kib.max(was / 10)
            } else {
                was
            };
            if now > allowed {
                v.push(violation(
                    Invariant::Leak,
                    at,
                    format!("{daemon}: {key} is {now} at the end, {was} at the baseline"),
                ));
            }
        }
    }
}
