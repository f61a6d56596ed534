//! `resources/grafana/lendvm.json` queries only metrics the daemons export: every metric
//! name in a panel's PromQL is one of lenderd's ([`lending::metrics::lender::NAMES`]) or
//! lendvm's ([`vmm::metrics::NAMES`]). `tests/tests/prometheus.rs` checks the same names
//! against real scrapes of both daemons.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

/// The `lenderd_*` / `lendvm_*` identifiers of a PromQL expression.
pub fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let b = expr.as_bytes();
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    let mut i = 0;
    while i < b.len() {
        if word(b[i]) && (i == 0 || !word(b[i - 1])) {
            let mut j = i;
            while j < b.len() && word(b[j]) {
                j += 1;
            }
            let w = &expr[i..j];
            if w.starts_with("lenderd_") || w.starts_with("lendvm_") {
                out.insert(w.to_string());
            }
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

fn dashboard_exprs() -> Vec<String> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../resources/grafana/lendvm.json"
    );
    let d: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap())
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut exprs = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            exprs.push(t["expr"].as_str().unwrap().to_string());
        }
    }
    exprs
}

#[test]
fn every_metric_the_dashboard_queries_is_exported() {
    let exported: BTreeSet<&str> = lending::metrics::lender::NAMES
        .iter()
        .chain(vmm::metrics::NAMES)
        .copied()
        .collect();
    let exprs = dashboard_exprs();
    assert!(exprs.len() >= 10, "{exprs:?}");
    let mut used = BTreeSet::new();
    for e in &exprs {
        let names = metric_names(e);
        assert!(
            !names.is_empty(),
            "panel query {e:?} names no lendvm metric"
        );
        for n in names {
            assert!(
                exported.contains(n.as_str()),
                "the dashboard queries {n} ({e}), which neither daemon exports"
            );
            used.insert(n);
        }
    }
    // It shows what the issue asks: devices and holders, per-lease I/O and interrupts, DMA
    // faults, auth failures, pinned memory, migrations.
    for n in [
        "lenderd_devices",
        "lenderd_lease_age_seconds",
        "lenderd_lease_commands_total",
        "lenderd_lease_interrupts_total",
        "lenderd_lease_dma_faults_total",
        "lenderd_auth_failures_total",
        "lendvm_pinned_bytes",
        "lendvm_migrations_total",
    ] {
        assert!(used.contains(n), "the dashboard does not show {n}");
    }
}

#[test]
fn names_are_found_in_promql() {
    assert_eq!(
        metric_names(
            "sum by (vm) (rate(lendvm_kvm_exits_total{reason=\"mmio\"}[1m])) / lenderd_up"
        ),
        ["lenderd_up", "lendvm_kvm_exits_total"]
            .into_iter()
            .map(String::from)
            .collect()
    );
}
