//! Prometheus metrics: the `--metrics ADDR` listener of `lenderd` and `lendvm`, and the text
//! both serve.
//!
//! The figures are not kept twice: each scrape reads what the daemon already counts (the
//! inventory, the leases' device counters, the directory registration; in lendvm what
//! `vm.counters` computes) into a [`Families`] snapshot, which the official client,
//! `prometheus-client`, encodes as OpenMetrics text (one [`Collector`] called per scrape).
//!
//! # Label cardinality
//!
//! Every series is of something alive now: a device of the inventory (bounded by the
//! lender's configuration), a lease (at most one per device), an auth failure reason (a fixed
//! set). A lease that ends, or a device removed from a VM, is simply not in the next scrape,
//! so Prometheus marks its series stale; nothing accumulates per lease, per borrower or per
//! peer address (the address is never a label). The `vm` label of a lease is the borrower's
//! VM name, which the lender already bounds to [`crate::protocol::MAX_STRING`] bytes.
//!
//! # Where it listens
//!
//! `ADDR` is a loopback `ip:port` or a Unix socket path (absolute, or `unix:PATH`): the
//! endpoint is unauthenticated, so it is never offered beyond the host; a Prometheus on
//! another host scrapes through a local agent or proxy of the operator's choice.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use thiserror::Error;

pub mod lender;
mod server;

pub use server::{coalesced, MetricsServer, Render, MAX_CONNECTIONS};

/// The content type of the OpenMetrics text format.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Which text a scraper gets: OpenMetrics when its `Accept` names it (Prometheus does), else
/// the classic Prometheus text format 0.0.4 (curl, `promtool check metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// `application/openmetrics-text; version=1.0.0`.
    OpenMetrics,
    /// `text/plain; version=0.0.4`.
    Text,
}

impl Format {
    /// The format an `Accept` header asks for.
    pub fn from_accept(accept: Option<&str>) -> Format {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::Text,
        }
    }

    /// Its `Content-Type`.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => CONTENT_TYPE,
            Format::Text => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
        }
    }
}

/// Errors of the metrics listener.
#[derive(Debug, Error)]
pub enum MetricsError {
    /// `ADDR` is neither a loopback ip:port nor a Unix socket path.
    #[error(
        "metrics address {0:?}: expected a loopback ip:port (127.0.0.1:9464, [::1]:9464) or an \
         absolute Unix socket path"
    )]
    BadAddress(String),
    /// A tcp address off the host.
    #[error(
        "metrics address {0}: not a loopback address (the metrics endpoint is unauthenticated; \
         scrape it through a local agent)"
    )]
    NotLoopback(SocketAddr),
    /// The address cannot be bound.
    #[error("cannot listen for metrics at {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The Unix socket path cannot be bound.
    #[error("cannot listen for metrics: {0}")]
    BindUnix(#[source] ntb::sock::BindError),
    /// Runtime or thread set-up.
    #[error("cannot start the metrics server: {0}")]
    Start(#[source] std::io::Error),
}

/// Where `--metrics` listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricsAddr {
    /// A loopback tcp address.
    Tcp(SocketAddr),
    /// A Unix socket path.
    Unix(PathBuf),
}

impl FromStr for MetricsAddr {
    type Err = MetricsError;

    fn from_str(s: &str) -> Result<Self, MetricsError> {
        let s = s.trim();
        if let Some(p) = s.strip_prefix("unix:") {
            if p.starts_with('/') {
                return Ok(MetricsAddr::Unix(PathBuf::from(p)));
            }
            return Err(MetricsError::BadAddress(s.to_string()));
        }
        if s.starts_with('/') {
            return Ok(MetricsAddr::Unix(PathBuf::from(s)));
        }
        let a: SocketAddr = s
            .parse()
            .map_err(|_| MetricsError::BadAddress(s.to_string()))?;
        if !a.ip().is_loopback() {
            return Err(MetricsError::NotLoopback(a));
        }
        Ok(MetricsAddr::Tcp(a))
    }
}

impl std::fmt::Display for MetricsAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MetricsAddr::Tcp(a) => write!(f, "{a}"),
            MetricsAddr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// A series' labels, in order.
pub type Labels = Vec<(String, String)>;

/// One metric family of a snapshot.
#[derive(Debug, Clone)]
pub struct Family {
    /// Name without the `_total` (counters) or unit suffix (both are added on encoding).
    pub name: &'static str,
    /// Help text.
    pub help: &'static str,
    /// Unit (appended to the name: `_bytes`, `_seconds`).
    pub unit: Option<Unit>,
    /// Counter (monotonic) or gauge.
    pub counter: bool,
    /// Its series.
    pub samples: Vec<(Labels, f64)>,
}

/// A snapshot of metric families, built per scrape.
#[derive(Debug, Default, Clone)]
pub struct Families(Vec<Family>);

impl Families {
    /// Empty.
    pub fn new() -> Self {
        Families::default()
    }

    fn family(
        &mut self,
        name: &'static str,
        help: &'static str,
        unit: Option<Unit>,
        counter: bool,
    ) -> &mut Family {
        let i = match self.0.iter().position(|f| f.name == name) {
            Some(i) => i,
            None => {
                self.0.push(Family {
                    name,
                    help,
                    unit,
                    counter,
                    samples: Vec::new(),
                });
                self.0.len() - 1
            }
        };
        &mut self.0[i]
    }

    /// Declares a family with no series yet (shown with its help even when empty).
    pub fn declare(&mut self, name: &'static str, help: &'static str, counter: bool) {
        self.family(name, help, None, counter);
    }

    /// Adds a counter sample.
    pub fn counter(&mut self, name: &'static str, help: &'static str, labels: Labels, v: u64) {
        self.family(name, help, None, true)
            .samples
            .push((labels, v as f64));
    }

    /// Adds a gauge sample.
    pub fn gauge(&mut self, name: &'static str, help: &'static str, labels: Labels, v: f64) {
        self.family(name, help, None, false)
            .samples
            .push((labels, v));
    }

    /// Adds a sample with a unit.
    pub fn with_unit(
        &mut self,
        name: &'static str,
        help: &'static str,
        unit: Unit,
        counter: bool,
        labels: Labels,
        v: f64,
    ) {
        self.family(name, help, Some(unit), counter)
            .samples
            .push((labels, v));
    }

    /// The families.
    pub fn families(&self) -> &[Family] {
        &self.0
    }

    /// The names as exposed (`_total` and unit suffixes included).
    pub fn exposed_names(&self) -> Vec<String> {
        self.0.iter().map(exposed_name).collect()
    }

    /// The OpenMetrics text (ends with `# EOF`).
    pub fn encode(self) -> String {
        self.encode_as(Format::OpenMetrics)
    }

    /// The text in `format`.
    pub fn encode_as(self, format: Format) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Snapshot(self)));
        let mut out = String::new();
        // Writing into a String cannot fail; an encoder error would be a bug in a name.
        let r = match format {
            Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut out, &registry),
            Format::Text => {
                prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)
            }
        };
        if let Err(e) = r {
            log::error!("metrics: encoding failed: {e}");
        }
        out
    }
}

/// The name of a family as Prometheus sees it.
pub fn exposed_name(f: &Family) -> String {
    let mut n = f.name.to_string();
    if let Some(u) = &f.unit {
        n.push('_');
        n.push_str(u.as_str());
    }
    if f.counter {
        n.push_str("_total");
    }
    n
}

/// Labels from string pairs.
pub fn labels<const N: usize>(pairs: [(&str, &str); N]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[derive(Debug)]
struct Snapshot(Families);

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for f in &self.0 .0 {
            let ty = if f.counter {
                MetricType::Counter
            } else {
                MetricType::Gauge
            };
            let mut m = encoder.encode_descriptor(f.name, f.help, f.unit.as_ref(), ty)?;
            for (labels, v) in &f.samples {
                let e = m.encode_family(labels)?;
                if f.counter {
                    ConstCounter::new(*v).encode(e)?;
                } else {
                    ConstGauge::new(*v).encode(e)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_loopback_or_unix() {
        assert_eq!(
            "127.0.0.1:9464".parse::<MetricsAddr>().unwrap(),
            MetricsAddr::Tcp("127.0.0.1:9464".parse().unwrap())
        );
        assert!(matches!(
            "/run/lenderd/metrics.sock".parse::<MetricsAddr>().unwrap(),
            MetricsAddr::Unix(_)
        ));
        assert!(matches!(
            "unix:/tmp/m".parse::<MetricsAddr>().unwrap(),
            MetricsAddr::Unix(_)
        ));
        let e = "0.0.0.0:9464".parse::<MetricsAddr>().unwrap_err();
        assert!(e.to_string().contains("not a loopback"), "{e}");
        let e = "localhost".parse::<MetricsAddr>().unwrap_err();
        assert!(e.to_string().contains("\"localhost\""), "{e}");
    }

    #[test]
    fn snapshot_encodes_counters_gauges_and_units() {
        let mut f = Families::new();
        f.counter("x_commands", "Commands.", labels([("lease", "1")]), 7);
        f.gauge("x_devices", "Devices.", labels([("state", "lent")]), 2.0);
        f.with_unit(
            "x_age",
            "Age.",
            Unit::Seconds,
            false,
            labels([("lease", "1")]),
            1.5,
        );
        assert_eq!(
            f.exposed_names(),
            ["x_commands_total", "x_devices", "x_age_seconds"]
        );
        let t = f.encode();
        assert!(t.contains("# TYPE x_commands counter"), "{t}");
        assert!(t.contains("x_commands_total{lease=\"1\"} 7"), "{t}");
        assert!(t.contains("x_devices{state=\"lent\"} 2"), "{t}");
        assert!(t.contains("# UNIT x_age_seconds seconds"), "{t}");
        assert!(t.contains("x_age_seconds{lease=\"1\"} 1.5"), "{t}");
        assert!(t.ends_with("# EOF\n"), "{t}");
    }
}
