//! Lenders' own records into the history: `lenderd --audit-log` lines (`lending::audit`)
//! become `lease-grant`, `lease-serve` and `lease-end` entries, so that the checker decides
//! "one holder per device", "fencing tokens grow" and "no lease served after its end" by what
//! the lenders did, not by what the harness believes they did.
//!
//! The audit log's `mono_ms` is `CLOCK_MONOTONIC`; the history's times are ms since the run
//! began on the harness's clock, which is the same clock ([`monotonic_ms`] at the run's
//! start is the offset). A device is named `node:bdf` in the history, as VMs name it. Lease
//! ids start at 1 in every run of lenderd, and a live migration's transfer grants an id again
//! to its new holder, so a history's lease id carries the run (the record's `boot`,
//! numbered per node in order of appearance) in bits 48-63 and the grant of that id in bits
//! 32-47.

use lending::audit::{AuditEvent, AuditRecord};

use super::history::{Entry, HistoryError, Op, Outcome};

pub use lending::audit::monotonic_ms;

/// The history entries of one lender's audit log `text`, for a run that began at
/// `t0_mono_ms`. A line that is not an audit record, a grant without a fencing token (a
/// lender without a directory fences nothing) and a record from before the run are errors
/// naming the line.
pub fn entries(text: &str, t0_mono_ms: u64) -> Result<Vec<Entry>, HistoryError> {
    let mut out = Vec::new();
    // Lease ids start at 1 in every run of lenderd: the history's lease is the run's index
    // (in order of appearance, per node) in the high 32 bits and the lenderd's id below.
    let mut runs: Vec<(String, u64)> = Vec::new();
    // A transfer grants a lease id again, to its new holder: each grant of an id is a lease
    // of its own in the history (the grant's number in bits 32-47).
    let mut grants: std::collections::BTreeMap<(usize, u64), u64> = Default::default();
    // Leases granted and not ended, by (node, history lease id): their device.
    let mut open: std::collections::BTreeMap<(String, u64), String> = Default::default();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let bad = |message: String| HistoryError::Parse { line, message };
        let a: AuditRecord = serde_json::from_str(raw)
            .map_err(|e| bad(format!("not an audit record ({e}): {raw}")))?;
        let at = a.mono_ms.checked_sub(t0_mono_ms).ok_or_else(|| {
            bad(format!(
                "record at {} ms is from before the run began ({t0_mono_ms} ms)",
                a.mono_ms
            ))
        })?;
        let device = format!("{}:{}", a.node, a.device);
        let run = match runs.iter().position(|r| r.0 == a.node && r.1 == a.boot) {
            Some(i) => i,
            None => {
                // A new run of this node's lenderd: the previous one is gone (killed: it
                // wrote no `end`), and so are its leases, at the latest when this one began.
                let ended_by = a.boot.saturating_sub(t0_mono_ms);
                open.retain(|(node, lease), device: &mut String| {
                    if *node != a.node {
                        return true;
                    }
                    out.push(Entry::at(
                        ended_by,
                        Outcome::Ok,
                        Op::LeaseEnd {
                            lender: node.clone(),
                            device: device.clone(),
                            lease: *lease,
                            reason: "its lenderd run ended (the next one started)".into(),
                        },
                    ));
                    false
                });
                runs.push((a.node.clone(), a.boot));
                runs.len() - 1
            }
        };
        let id = a.lease & 0xffff_ffff;
        if a.event == AuditEvent::Grant {
            grants.entry((run, id)).and_modify(|g| *g += 1).or_insert(0);
        }
        let nth = grants.get(&(run, id)).copied().unwrap_or(0) & 0xffff;
        let lease = ((run as u64) << 48) | (nth << 32) | id;
        match a.event {
            AuditEvent::Grant => {
                open.insert((a.node.clone(), lease), device.clone());
            }
            AuditEvent::End => {
                open.remove(&(a.node.clone(), lease));
            }
            AuditEvent::Serve => {}
        }
        let op = match a.event {
            AuditEvent::Grant => {
                let fence = a.fence.ok_or_else(|| {
                    bad(format!(
                        "lease {} was granted without a fencing token: the lender has no directory",
                        a.lease
                    ))
                })?;
                Op::LeaseGrant {
                    lender: a.node,
                    device,
                    lease,
                    holder: a.holder,
                    fence: u64::try_from(fence)
                        .map_err(|_| bad(format!("negative fencing token {fence}")))?,
                    transfer: a.transfer,
                }
            }
            AuditEvent::Serve => Op::LeaseServe {
                lender: a.node,
                device,
                lease,
            },
            AuditEvent::End => Op::LeaseEnd {
                lender: a.node,
                device,
                lease,
                reason: format!("ended by the lender (holder {})", a.holder),
            },
        };
        out.push(Entry::at(at, Outcome::Ok, op));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::check::{check, Bounds, Invariant};

    fn rec(ms: u64, event: &str, lease: u64, holder: &str, fence: i64) -> String {
        format!(
            r#"{{"mono_ms":{ms},"node":"l1","event":"{event}","device":"0000:82:00.0","lease":{lease},"holder":"{holder}","fence":{fence}}}"#
        )
    }

    /// `r` as written by the lenderd run that started at `boot`.
    fn with_boot(r: String, boot: u64) -> String {
        r.replacen(
            "\"node\":\"l1\"",
            &format!("\"node\":\"l1\",\"boot\":{boot}"),
            1,
        )
    }

    #[test]
    fn audit_records_become_lease_entries_the_checker_decides() {
        let t0 = 1_000;
        let good = [
            rec(1_100, "grant", 1, "b1/vm0", 10),
            rec(1_200, "serve", 1, "b1/vm0", 10),
            rec(1_300, "end", 1, "b1/vm0", 10),
            rec(1_400, "grant", 2, "b2/vm1", 12),
            rec(1_500, "end", 2, "b2/vm1", 12),
        ]
        .join("\n");
        let h = entries(&good, t0).unwrap();
        assert_eq!(h.len(), 5);
        assert_eq!(h[0].start_ms, 100);
        assert!(
            matches!(&h[0].op, Op::LeaseGrant { device, fence: 10, .. } if device == "l1:0000:82:00.0")
        );
        let r = check(&h, &Bounds::default());
        assert!(r.ok(), "{r}");

        // A paused lender that serves lease 1 after its end, and grants with an older token.
        let bad = [
            rec(1_100, "grant", 1, "b1/vm0", 10),
            rec(1_300, "end", 1, "b1/vm0", 10),
            rec(1_350, "serve", 1, "b1/vm0", 10),
            rec(1_400, "grant", 2, "b2/vm1", 9),
            rec(1_500, "end", 2, "b2/vm1", 9),
        ]
        .join("\n");
        let r = check(&entries(&bad, t0).unwrap(), &Bounds::default());
        assert_eq!(r.count(Invariant::FencedServe), 1, "{r}");
        assert_eq!(r.count(Invariant::FenceOrder), 1, "{r}");
    }

    #[test]
    fn a_restarted_lenders_lease_ids_are_its_own() {
        // lenderd restarted (boot 5000): its lease 1 is not the first run's lease 1, which
        // ended before; serving it is no serve after an end.
        let text = [
            with_boot(rec(1_100, "grant", 1, "b1/vm0", 10), 1_000),
            with_boot(rec(1_300, "end", 1, "b1/vm0", 10), 1_000),
            with_boot(rec(5_100, "grant", 1, "b2/vm1", 12), 5_000),
            with_boot(rec(5_200, "serve", 1, "b2/vm1", 12), 5_000),
            with_boot(rec(5_300, "end", 1, "b2/vm1", 12), 5_000),
        ]
        .join("\n");
        let h = entries(&text, 1_000).unwrap();
        let r = check(&h, &Bounds::default());
        assert!(r.ok(), "{r}");
        assert!(matches!(h[2].op, Op::LeaseGrant { lease, .. } if lease == (1 << 48) | 1));
    }

    #[test]
    fn a_transferred_lease_is_a_new_lease_with_the_same_token() {
        // Live migration: lease 3 moves from b1/vm0 to b2/vm0 with its claim (fence 20),
        // and serves its new holder afterwards.
        let transfer = rec(1_300, "grant", 3, "b2/vm0", 20).replacen(
            "\"fence\":20",
            "\"fence\":20,\"transfer\":true",
            1,
        );
        let text = [
            rec(1_100, "grant", 3, "b1/vm0", 20),
            rec(1_200, "serve", 3, "b1/vm0", 20),
            rec(1_300, "end", 3, "b1/vm0", 20),
            transfer,
            rec(1_400, "serve", 3, "b2/vm0", 20),
            rec(1_500, "end", 3, "b2/vm0", 20),
        ]
        .join("\n");
        let h = entries(&text, 1_000).unwrap();
        let r = check(&h, &Bounds::default());
        assert!(r.ok(), "{r}");
        let ids: Vec<u64> = h
            .iter()
            .filter_map(|e| match e.op {
                Op::LeaseGrant { lease, .. } => Some(lease),
                _ => None,
            })
            .collect();
        assert_eq!(ids, [3, (1 << 32) | 3]);
        // The same token without the transfer mark is a fence that did not grow.
        let plain = text.replace(",\"transfer\":true", "");
        let r = check(&entries(&plain, 1_000).unwrap(), &Bounds::default());
        assert_eq!(r.count(Invariant::FenceOrder), 1, "{r}");
    }

    #[test]
    fn a_killed_lenders_leases_end_when_its_next_run_begins() {
        // lenderd killed while lease 1 was lent to b1/vm0 (no `end`); the next run (boot
        // 5000) lends the device to b2/vm1: no double lease, and lease 1 ended by then.
        let text = [
            with_boot(rec(1_100, "grant", 1, "b1/vm0", 10), 1_000),
            with_boot(rec(5_100, "grant", 1, "b2/vm1", 12), 5_000),
            with_boot(rec(5_300, "end", 1, "b2/vm1", 12), 5_000),
        ]
        .join("\n");
        let h = entries(&text, 1_000).unwrap();
        let r = check(&h, &Bounds::default());
        assert!(r.ok(), "{r}");
        assert!(h
            .iter()
            .any(|e| matches!(&e.op, Op::LeaseEnd { lease: 1, reason, .. }
            if reason.contains("next one started"))
                && e.start_ms == 4_000));
    }

    #[test]
    fn unreadable_or_unfenced_records_are_errors_naming_the_line() {
        let e = entries("{\"x\":1}", 0).unwrap_err().to_string();
        assert!(
            e.contains("line 1") && e.contains("not an audit record"),
            "{e}"
        );
        let unfenced =
            r#"{"mono_ms":5,"node":"l1","event":"grant","device":"d","lease":1,"holder":"h"}"#;
        let e = entries(&format!("\n{unfenced}"), 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 2") && e.contains("without a fencing token"),
            "{e}"
        );
        let e = entries(&rec(5, "grant", 1, "h", 1), 10)
            .unwrap_err()
            .to_string();
        assert!(e.contains("before the run began"), "{e}");
        let e = entries(&rec(15, "meteor", 1, "h", 1), 10)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 1") && e.contains("unknown variant `meteor`"),
            "{e}"
        );
    }
}
