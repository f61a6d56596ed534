//! Fault schedules: which fault, on what, from when to when, drawn from a seed.
//!
//! A schedule is a pure function of (seed, length, fault kinds, topology), drawn with
//! ChaCha8 (a generator whose output the `rand_chacha` crate keeps stable across versions,
//! unlike `StdRng`), so a failing seed replays the same faults at the same times. Rules
//! that keep a schedule meaningful:
//! - at most [`MAX_ACTIVE`] faults at once, and never two on one target (a lender killed
//!   while paused says nothing);
//! - every fault is healed, and the last heal comes [`Schedule::settle_ms`] before the end,
//!   so that the checker's liveness bound can run out inside the history.

use std::fmt;
use std::str::FromStr;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// At most this many faults are active at once.
pub const MAX_ACTIVE: usize = 2;

/// Bad input to the harness.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScheduleError {
    /// A fault name the harness does not know.
    #[error("unknown fault {name:?}; known faults: {known}")]
    UnknownFault {
        /// What was given.
        name: String,
        /// Every known name.
        known: String,
    },
    /// A seed that is not a number.
    #[error("seed {0:?} is not a number (a decimal integer from 0 to 18446744073709551615)")]
    Seed(String),
    /// A length that is not a whole number of minutes in range.
    #[error("minutes {0:?} is not a whole number from 1 to 1440")]
    Minutes(String),
    /// No fault kinds to draw from.
    #[error("no fault kinds given")]
    NoFaults,
    /// The run is too short to inject anything and still settle.
    #[error("a run of {length_ms} ms leaves no time for faults before the {settle_ms} ms settle")]
    TooShort {
        /// The run's length.
        length_ms: u64,
        /// The quiet time kept at the end.
        settle_ms: u64,
    },
}

/// A kind of fault (or disturbance: a migration, a restart, hot-plug churn).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// A lender SIGKILLed, then restarted.
    LenderKill,
    /// A lender SIGSTOPped for longer than its lease timeout, then continued.
    LenderPause,
    /// The etcd leader killed, then restarted.
    EtcdLeaderKill,
    /// One etcd member of three lost (the cluster keeps quorum).
    EtcdMinority,
    /// Two etcd members of three lost (no quorum).
    EtcdMajority,
    /// A lender cut from etcd.
    PartitionLenderEtcd,
    /// A lender cut from its borrowers.
    PartitionLenderBorrowers,
    /// A borrower host cut from etcd.
    PartitionBorrowerEtcd,
    /// Packet loss on a lender-borrower link (iptables `statistic`).
    LinkLoss,
    /// Delay on a lender-borrower link (the harness's fault proxy).
    LinkDelay,
    /// Reordering on a lender-borrower link (the harness's fault proxy).
    LinkReorder,
    /// A lender's backing store full.
    LenderDiskFull,
    /// A VM migrated live to the other borrower host.
    Migrate,
    /// A VMM restarted through `--local` migration.
    VmmRestart,
    /// Hot-remove and hot-add of a VM's devices, repeated.
    HotplugChurn,
}

impl FaultKind {
    /// Every kind, in the order of docs/RELIABILITY.md's table.
    pub const ALL: [FaultKind; 15] = [
        FaultKind::LenderKill,
        FaultKind::LenderPause,
        FaultKind::EtcdLeaderKill,
        FaultKind::EtcdMinority,
        FaultKind::EtcdMajority,
        FaultKind::PartitionLenderEtcd,
        FaultKind::PartitionLenderBorrowers,
        FaultKind::PartitionBorrowerEtcd,
        FaultKind::LinkLoss,
        FaultKind::LinkDelay,
        FaultKind::LinkReorder,
        FaultKind::LenderDiskFull,
        FaultKind::Migrate,
        FaultKind::VmmRestart,
        FaultKind::HotplugChurn,
    ];

    /// The name used on command lines and in histories.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::LenderKill => "lender-kill",
            FaultKind::LenderPause => "lender-pause",
            FaultKind::EtcdLeaderKill => "etcd-leader-kill",
            FaultKind::EtcdMinority => "etcd-minority",
            FaultKind::EtcdMajority => "etcd-majority",
            FaultKind::PartitionLenderEtcd => "partition-lender-etcd",
            FaultKind::PartitionLenderBorrowers => "partition-lender-borrowers",
            FaultKind::PartitionBorrowerEtcd => "partition-borrower-etcd",
            FaultKind::LinkLoss => "link-loss",
            FaultKind::LinkDelay => "link-delay",
            FaultKind::LinkReorder => "link-reorder",
            FaultKind::LenderDiskFull => "lender-disk-full",
            FaultKind::Migrate => "migrate",
            FaultKind::VmmRestart => "vmm-restart",
            FaultKind::HotplugChurn => "hotplug-churn",
        }
    }

    /// How long the fault lasts, in ms (from, to). A lender pause outlasts the lease
    /// timeout (`link.peer_timeout_ms`, 5 s by default) so that its leases are fenced.
    fn duration_ms(self) -> (u64, u64) {
        match self {
            FaultKind::LenderKill | FaultKind::EtcdLeaderKill => (1_000, 8_000),
            FaultKind::LenderPause => (8_000, 15_000),
            FaultKind::EtcdMinority | FaultKind::EtcdMajority => (3_000, 15_000),
            FaultKind::PartitionLenderEtcd
            | FaultKind::PartitionLenderBorrowers
            | FaultKind::PartitionBorrowerEtcd => (2_000, 15_000),
            FaultKind::LinkLoss | FaultKind::LinkDelay | FaultKind::LinkReorder => (5_000, 20_000),
            FaultKind::LenderDiskFull => (3_000, 10_000),
            FaultKind::Migrate | FaultKind::VmmRestart => (1_000, 1_000),
            FaultKind::HotplugChurn => (5_000, 15_000),
        }
    }

    /// What it can hit in `topo`.
    fn targets(self, topo: &Topology) -> Vec<String> {
        let lenders = (1..=topo.lenders).map(|i| format!("l{i}"));
        let borrowers = (1..=topo.borrowers).map(|i| format!("b{i}"));
        let vms = (1..=topo.borrowers)
            .flat_map(|b| (0..topo.vms_per_borrower).map(move |v| format!("b{b}-vm{v}")));
        let links = (1..=topo.lenders)
            .flat_map(|l| (1..=topo.borrowers).map(move |b| format!("l{l}<->b{b}")));
        match self {
            FaultKind::LenderKill | FaultKind::LenderPause | FaultKind::LenderDiskFull => {
                lenders.collect()
            }
            // The etcd faults hit the cluster as a whole: one target, so never two at once.
            FaultKind::EtcdLeaderKill | FaultKind::EtcdMinority | FaultKind::EtcdMajority => {
                vec!["etcd".into()]
            }
            FaultKind::PartitionLenderEtcd => lenders.map(|l| format!("{l}|etcd")).collect(),
            FaultKind::PartitionLenderBorrowers => {
                lenders.map(|l| format!("{l}|borrowers")).collect()
            }
            FaultKind::PartitionBorrowerEtcd => borrowers.map(|b| format!("{b}|etcd")).collect(),
            FaultKind::LinkLoss | FaultKind::LinkDelay | FaultKind::LinkReorder => links.collect(),
            FaultKind::Migrate | FaultKind::VmmRestart | FaultKind::HotplugChurn => vms.collect(),
        }
    }

    /// Every known name, comma-separated (for errors and `--help`).
    pub fn known() -> String {
        Self::ALL.map(Self::name).join(", ")
    }

    /// Parses a comma-separated list of names (`all` for every kind).
    pub fn parse_list(s: &str) -> Result<Vec<FaultKind>, ScheduleError> {
        if s.trim() == "all" {
            return Ok(Self::ALL.to_vec());
        }
        let kinds = s
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::parse)
            .collect::<Result<Vec<_>, _>>()?;
        if kinds.is_empty() {
            return Err(ScheduleError::NoFaults);
        }
        Ok(kinds)
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for FaultKind {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| ScheduleError::UnknownFault {
                name: s.to_string(),
                known: Self::known(),
            })
    }
}

/// Parses a seed: a decimal `u64`, nothing else.
pub fn parse_seed(s: &str) -> Result<u64, ScheduleError> {
    s.trim()
        .parse()
        .map_err(|_| ScheduleError::Seed(s.to_string()))
}

/// Parses a run length in whole minutes, 1 to 1440.
pub fn parse_minutes(s: &str) -> Result<u64, ScheduleError> {
    s.trim()
        .parse()
        .ok()
        .filter(|m| (1..=1440).contains(m))
        .ok_or_else(|| ScheduleError::Minutes(s.to_string()))
}

/// The cluster a schedule is drawn for (the issue's: 3 etcd members, 3 lenders, 2 borrower
/// hosts with 2 VMs each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    /// Lender hosts (`l1`..).
    pub lenders: usize,
    /// Borrower hosts (`b1`..).
    pub borrowers: usize,
    /// VMs per borrower host (`b1-vm0`..).
    pub vms_per_borrower: usize,
}

impl Default for Topology {
    fn default() -> Self {
        Self {
            lenders: 3,
            borrowers: 2,
            vms_per_borrower: 2,
        }
    }
}

/// One fault of a schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// When it is injected (ms since the run began).
    pub at_ms: u64,
    /// When it is healed.
    pub heal_ms: u64,
    /// What.
    pub kind: FaultKind,
    /// On what.
    pub target: String,
}

/// A seeded schedule of faults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// The seed it was drawn from.
    pub seed: u64,
    /// The run's length.
    pub length_ms: u64,
    /// Quiet time kept after the last heal.
    pub settle_ms: u64,
    /// The faults, by injection time.
    pub steps: Vec<Step>,
}

impl Schedule {
    /// Draws a schedule of `length_ms` from `seed` over `kinds`, keeping the last
    /// `settle_ms` free of faults.
    pub fn generate(
        seed: u64,
        length_ms: u64,
        settle_ms: u64,
        kinds: &[FaultKind],
        topo: &Topology,
    ) -> Result<Schedule, ScheduleError> {
        if kinds.is_empty() {
            return Err(ScheduleError::NoFaults);
        }
        // Time for the cluster to come up and take its baseline first.
        const WARMUP_MS: u64 = 10_000;
        let last_heal = length_ms
            .checked_sub(settle_ms)
            .filter(|&l| l > WARMUP_MS)
            .ok_or(ScheduleError::TooShort {
                length_ms,
                settle_ms,
            })?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut steps: Vec<Step> = Vec::new();
        let mut t = WARMUP_MS;
        while t < last_heal {
            let kind = kinds[rng.random_range(0..kinds.len())];
            let (lo, hi) = kind.duration_ms();
            let heal = (t + rng.random_range(lo..=hi)).min(last_heal);
            let busy: Vec<&Step> = steps
                .iter()
                .filter(|s| s.heal_ms > t && s.at_ms < heal)
                .collect();
            let free: Vec<String> = kind
                .targets(topo)
                .into_iter()
                .filter(|target| busy.iter().all(|s| &s.target != target))
                .collect();
            if busy.len() < MAX_ACTIVE && !free.is_empty() && heal > t {
                let target = free[rng.random_range(0..free.len())].clone();
                steps.push(Step {
                    at_ms: t,
                    heal_ms: heal,
                    kind,
                    target,
                });
            }
            t += rng.random_range(1_000..=10_000);
        }
        Ok(Schedule {
            seed,
            length_ms,
            settle_ms,
            steps,
        })
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "# seed {} length {} ms settle {} ms: {} faults",
            self.seed,
            self.length_ms,
            self.settle_ms,
            self.steps.len()
        )?;
        for s in &self.steps {
            writeln!(
                f,
                "{:>8} {:>8} {:<26} {}",
                s.at_ms, s.heal_ms, s.kind, s.target
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draw(seed: u64) -> Schedule {
        Schedule::generate(seed, 300_000, 60_000, &FaultKind::ALL, &Topology::default()).unwrap()
    }

    #[test]
    fn a_seed_replays_the_same_schedule_and_another_seed_does_not() {
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7).steps, draw(8).steps);
        assert!(draw(7).steps.len() >= 10, "{}", draw(7));
    }

    #[test]
    fn schedules_keep_their_rules() {
        for seed in 0..200 {
            let s = draw(seed);
            for (i, a) in s.steps.iter().enumerate() {
                assert!(a.at_ms < a.heal_ms, "seed {seed}: {a:?}");
                assert!(a.heal_ms <= s.length_ms - s.settle_ms, "seed {seed}: {a:?}");
                let at_once: Vec<&Step> = s
                    .steps
                    .iter()
                    .filter(|b| b.at_ms <= a.at_ms && b.heal_ms > a.at_ms)
                    .collect();
                assert!(at_once.len() <= MAX_ACTIVE, "seed {seed}: {at_once:?}");
                for b in &s.steps[i + 1..] {
                    let overlap = b.at_ms < a.heal_ms && a.at_ms < b.heal_ms;
                    assert!(
                        !(overlap && a.target == b.target),
                        "seed {seed}: {a:?} {b:?}"
                    );
                }
            }
        }
        // Only the kinds asked for.
        let s = Schedule::generate(
            1,
            300_000,
            60_000,
            &[FaultKind::LinkLoss],
            &Topology::default(),
        )
        .unwrap();
        assert!(s.steps.iter().all(|x| x.kind == FaultKind::LinkLoss));
        assert!(!s.steps.is_empty());
    }

    #[test]
    fn bad_input_gets_a_clear_error() {
        let e = "lender-explode".parse::<FaultKind>().unwrap_err();
        assert!(
            e.to_string().contains("unknown fault \"lender-explode\""),
            "{e}"
        );
        assert!(e.to_string().contains("lender-kill"), "{e}");
        let e = FaultKind::parse_list("link-loss,nope").unwrap_err();
        assert!(e.to_string().contains("\"nope\""), "{e}");
        assert_eq!(FaultKind::parse_list(" , "), Err(ScheduleError::NoFaults));
        assert_eq!(
            FaultKind::parse_list("all").unwrap().len(),
            FaultKind::ALL.len()
        );
        for kind in FaultKind::ALL {
            assert_eq!(kind.name().parse::<FaultKind>(), Ok(kind));
        }

        assert_eq!(parse_seed("42"), Ok(42));
        let e = parse_seed("forty-two").unwrap_err();
        assert!(
            e.to_string().contains("seed \"forty-two\" is not a number"),
            "{e}"
        );
        assert!(parse_seed("-1").is_err());
        assert!(parse_seed("18446744073709551616").is_err());

        assert_eq!(parse_minutes("30"), Ok(30));
        for bad in ["0", "1441", "2.5", "x"] {
            let e = parse_minutes(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
        assert!(matches!(
            Schedule::generate(1, 60_000, 60_000, &FaultKind::ALL, &Topology::default()),
            Err(ScheduleError::TooShort { .. })
        ));
        assert_eq!(
            Schedule::generate(1, 300_000, 60_000, &[], &Topology::default()),
            Err(ScheduleError::NoFaults)
        );
    }
}
