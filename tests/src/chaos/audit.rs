//! Lenders' own records into the history: `lenderd --audit-log` lines (`lending::audit`)
//! become `lease-grant`, `lease-serve` and `lease-end` entries, so that the checker decides
//! "one holder per device", "fencing tokens grow" and "no lease served after its end" by what
//! the lenders did, not by what the harness believes they did.
//!
//! The audit log's `mono_ms` is `CLOCK_MONOTONIC`; the history's times are ms since the run
//! began on the harness's clock, which is the same clock ([`monotonic_ms`] at the run's
//! start is the offset). A device is named `node:bdf` in the history, as VMs name it. Lease
//! ids start at 1 in every run of lenderd, so a history's lease id carries the run (the
//! record's `boot`, numbered per node in order of appearance) in its high 32 bits.

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
                runs.push((a.node.clone(), a.boot));
                runs.len() - 1
            }
        };
        let lease = ((run as u64) << 32) | (a.lease & 0xffff_ffff);
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
        let with_boot = |r: String, boot: u64| {
            r.replacen(
                "\"node\":\"l1\"",
                &format!("\"node\":\"l1\",\"boot\":{boot}"),
                1,
            )
        };
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
        assert!(matches!(h[2].op, Op::LeaseGrant { lease, .. } if lease == (1 << 32) | 1));
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
