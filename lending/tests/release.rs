//! A dead borrower's lease: how long the lender takes to get it back, and what it shows
//! meanwhile. The borrower is a re-executed copy of this test binary (so that it can be
//! SIGKILLed or SIGSTOPped); the lender runs in this process, on the shm fabric, lending a
//! dmatest whose reset and BAR reads can be held (the release work, and a request the
//! session is still serving when its borrower dies).
//!
//! From the moment the lender knows the borrower's link is down until the device is
//! available again, `list` shows `releasing (was lent to node/vm)` (a version 7 session:
//! `resetting`), the state gauge counts it as `releasing`, and a borrow is refused with
//! `DEVICE_BUSY` saying that it is being released. The bound (docs/RELIABILITY.md): the link's
//! `peer_timeout` for a borrower that goes silent (at once for a killed one), then the
//! request in progress, then the release work.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use emulated::NotifyMode;
use lending::backend::emulated::EmulatedBackend;
use lending::backend::{BackendError, BarExport, DeviceBackend, IrqTrigger, PeerExport};
use lending::client::ClientError;
use lending::inventory::Inventory;
use lending::iommu::IommuDomain;
use lending::metrics::lender::LenderMetrics;
use lending::protocol::{
    code, DeviceInfo, DeviceState, DoorbellKicks, IrqKind, LeaseCounters, RELEASING_STATE_VERSION,
};
use lending::server::{BackgroundLender, Lender};
use lending::LenderClient;
use ntb::{ClusterConfig, Fabric, NodeId, SocketFabric};
use vmm_sys_util::eventfd::EventFd;

// The shared test harness (std only), as the other tests of this crate include it.
#[path = "../src/testing.rs"]
mod testing;

const TOKEN: &str = "r3leasing-cluster-token";
const DEV: &str = "0000:00:06.0";
/// How long a gate holds at most (a failing test must not hang).
const GATE_LIMIT: Duration = Duration::from_secs(20);
/// Scheduling slack on a loaded two-core machine, beyond the lender's own poll period.
const SLACK: Duration = Duration::from_millis(1500);

/// Holds whoever passes while closed (bounded by [`GATE_LIMIT`]) and tells whether someone
/// tried.
#[derive(Default)]
struct Gate {
    /// (closed, entered)
    state: Mutex<(bool, bool)>,
    cv: Condvar,
}

impl Gate {
    fn close(&self) {
        self.state.lock().unwrap().0 = true;
    }

    fn open(&self) {
        self.state.lock().unwrap().0 = false;
        self.cv.notify_all();
    }

    fn pass(&self) {
        let mut st = self.state.lock().unwrap();
        st.1 = true;
        let (_st, _) = self.cv.wait_timeout_while(st, GATE_LIMIT, |s| s.0).unwrap();
    }

    fn entered(&self) -> bool {
        self.state.lock().unwrap().1
    }
}

/// The dmatest with a gate on its reset (the release work) and on its BAR reads (a request
/// the session serves when its borrower dies).
struct Gated {
    inner: Arc<EmulatedBackend>,
    reset: Gate,
    bar_read: Gate,
}

impl DeviceBackend for Gated {
    fn kind(&self) -> &str {
        self.inner.kind()
    }
    fn describe(&self, id: &str) -> DeviceInfo {
        self.inner.describe(id)
    }
    fn config_size(&self) -> u16 {
        self.inner.config_size()
    }
    fn config_read(&self, offset: u16, buf: &mut [u8]) -> Result<(), BackendError> {
        self.inner.config_read(offset, buf)
    }
    fn config_write(&self, offset: u16, data: &[u8]) -> Result<(), BackendError> {
        self.inner.config_write(offset, data)
    }
    fn bar_export(&self, bar: u8) -> Option<BarExport<'_>> {
        self.inner.bar_export(bar)
    }
    fn peer_export(&self, bar: u8) -> Option<PeerExport<'_>> {
        self.inner.peer_export(bar)
    }
    fn bar_read(&self, bar: u8, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        self.bar_read.pass();
        self.inner.bar_read(bar, offset, buf)
    }
    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        self.inner.bar_write(bar, offset, data)
    }
    fn notify_eventfd(&self) -> Option<EventFd> {
        self.inner.notify_eventfd()
    }
    fn set_irqs(
        &self,
        kind: IrqKind,
        targets: Vec<Option<Arc<dyn IrqTrigger>>>,
    ) -> Result<(), BackendError> {
        self.inner.set_irqs(kind, targets)
    }
    fn clear_irqs(&self) {
        self.inner.clear_irqs()
    }
    fn set_bus_master(&self, enable: bool) -> Result<(), BackendError> {
        self.inner.set_bus_master(enable)
    }
    fn reset(&self) -> Result<(), BackendError> {
        self.reset.pass();
        self.inner.reset()
    }
    fn domain(&self) -> Arc<dyn IommuDomain> {
        self.inner.domain()
    }
    fn counters(&self) -> LeaseCounters {
        self.inner.counters()
    }
    fn kick_doorbells(&self) -> DoorbellKicks {
        self.inner.kick_doorbells()
    }
    fn kick_generation(&self) -> u64 {
        self.inner.kick_generation()
    }
    fn set_kick_listener(&self, listener: Option<emulated::KickListener>) {
        self.inner.set_kick_listener(listener)
    }
    fn renew_exports(&self) -> Result<(), BackendError> {
        self.inner.renew_exports()
    }
}

struct Rig {
    dir: tempfile::TempDir,
    cfg: ClusterConfig,
    lender: BackgroundLender,
    dev: Arc<Gated>,
    obs: LenderClient,
}

/// The lender (node `lender`) and an observer (node `obs`); the borrower will be `node2`.
fn rig(tag: &str) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let path = testing::shm_cluster_file(dir.path(), &["lender", "node2", "obs"]);
    let cfg = ClusterConfig::load(&path).unwrap();
    let dev = Arc::new(Gated {
        inner: Arc::new(EmulatedBackend::dmatest(tag, NotifyMode::Interrupt).unwrap()),
        reset: Gate::default(),
        bar_read: Gate::default(),
    });
    let inv = Arc::new(Inventory::new(vec![(DEV.to_string(), dev.clone() as _)]).unwrap());
    let listener = SocketFabric::from_cluster(&cfg, "lender")
        .unwrap()
        .listen()
        .unwrap();
    let lender = BackgroundLender::start(Lender::new(inv, "lender", TOKEN), listener).unwrap();
    let obs = LenderClient::connect(&cfg, "obs", "lender", TOKEN, "obs").unwrap();
    Rig {
        dir,
        cfg,
        lender,
        dev,
        obs,
    }
}

impl Rig {
    fn state(&self) -> DeviceState {
        self.obs.list().unwrap()[0].state.clone()
    }

    /// Polls until the device's state is `want`; returns when it was seen, or `None` if not
    /// within `limit`.
    fn wait_state(&self, want: &DeviceState, limit: Duration) -> Option<Instant> {
        let t0 = Instant::now();
        while t0.elapsed() < limit {
            if self.state() == *want {
                return Some(Instant::now());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// The helper borrower: borrows DEV as node2/victim; with `read`, then reads BAR 0 (held
    /// by the gate on the lender).
    fn spawn_borrower(&self, read: bool) -> Child {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "helper_borrower",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("LENDING_RELEASE_DIR", self.dir.path())
            .env("LENDING_RELEASE_READ", if read { "1" } else { "0" })
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.contains("READY") {
                    let _ = tx.send(());
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(20))
            .expect("the helper borrower did not get ready");
        child
    }

    /// The releasing state's every face: state, refusal, older sessions, metrics.
    fn assert_releasing(&self) {
        let releasing = DeviceState::Releasing {
            node: "node2".into(),
            vm: "victim".into(),
        };
        assert_eq!(self.state(), releasing);
        assert_eq!(
            releasing.to_string(),
            "releasing (was lent to node2/victim)"
        );
        let e = self.obs.borrow(DEV, "vm-next").err().expect("borrowed");
        assert_eq!(e.code(), Some(code::DEVICE_BUSY), "{e}");
        let ClientError::Remote { message, .. } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(
            message,
            "device 0000:00:06.0 is being released (was lent to node2/victim): the lender is \
             taking the lease back (unmapping its DMA, resetting the device); borrow it again \
             once it is available"
        );
        // A session before the state existed reads `resetting` (its decoder would refuse the
        // whole reply otherwise).
        let ep = SocketFabric::from_cluster(&self.cfg, "obs")
            .unwrap()
            .connect(&NodeId::new("lender").unwrap())
            .unwrap();
        let old =
            LenderClient::from_endpoint_with_version(ep, TOKEN, "old", RELEASING_STATE_VERSION - 1)
                .unwrap();
        assert_eq!(old.list().unwrap()[0].state, DeviceState::Resetting);
        assert_eq!(
            old.status().unwrap().devices[0].summary.state,
            DeviceState::Resetting
        );
        let m = LenderMetrics::new(Arc::clone(self.lender.lender()), None, None)
            .render(lending::metrics::Format::Text);
        assert!(
            m.contains("lenderd_devices{node=\"lender\",state=\"releasing\"} 1"),
            "{m}"
        );
        assert!(
            m.contains("lenderd_devices{node=\"lender\",state=\"lent\"} 0"),
            "{m}"
        );
        assert!(
            m.lines()
                .any(|l| l.starts_with("lenderd_device_state{")
                    && l.contains("state=\"releasing\"} 1")),
            "{m}"
        );
    }
}

/// Not a test on its own: the borrower process (re-executed with LENDING_RELEASE_DIR set).
#[test]
fn helper_borrower() {
    let Ok(dir) = std::env::var("LENDING_RELEASE_DIR") else {
        return;
    };
    let cfg = ClusterConfig::load(&Path::new(&dir).join("cluster.toml")).unwrap();
    let cl = LenderClient::connect(&cfg, "node2", "lender", TOKEN, "helper").unwrap();
    let lease = cl.borrow(DEV, "victim").unwrap();
    println!("READY");
    std::io::stdout().flush().unwrap();
    if std::env::var("LENDING_RELEASE_READ").as_deref() == Ok("1") {
        let _ = lease.bar_read(0, 0, 4);
    }
    std::thread::sleep(Duration::from_secs(60));
}

/// A borrower killed while the lender serves its request (a long DMA map in real life): the
/// device shows `releasing` within the lender's poll period, though the session only ends
/// the lease after that request; it stays `releasing` through the release work and is
/// available right after.
#[test]
fn a_killed_borrowers_device_is_releasing_at_once_even_mid_request_then_available() {
    let r = rig("release-kill");
    r.dev.bar_read.close();
    r.dev.reset.close();
    let mut helper = r.spawn_borrower(true);
    let t = Instant::now();
    while !r.dev.bar_read.entered() {
        assert!(t.elapsed() < Duration::from_secs(10), "no bar read arrived");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        r.state(),
        DeviceState::Lent {
            node: "node2".into(),
            vm: "victim".into()
        }
    );
    helper.kill().unwrap(); // SIGKILL: the socket closes, the request is still served
    let _ = helper.wait();
    let t0 = Instant::now();
    let releasing = DeviceState::Releasing {
        node: "node2".into(),
        vm: "victim".into(),
    };
    let seen = r.wait_state(&releasing, SLACK).unwrap_or_else(|| {
        panic!(
            "not releasing within {SLACK:?} of the kill while the request is served: {:?}",
            r.state()
        )
    });
    assert!(seen - t0 <= SLACK);
    eprintln!(
        "killed borrower mid-request: releasing {:.0} ms after SIGKILL",
        (seen - t0).as_secs_f64() * 1e3
    );
    r.assert_releasing();
    // The request ends; the session ends the lease; the reset is the release work.
    r.dev.bar_read.open();
    let t = Instant::now();
    while !r.dev.reset.entered() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the lease was not ended"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    r.assert_releasing();
    r.dev.reset.open();
    let t1 = Instant::now();
    let back = r
        .wait_state(&DeviceState::Available, SLACK)
        .expect("not available after the release work");
    assert!(back - t1 <= SLACK);
    r.obs
        .borrow(DEV, "vm-next")
        .unwrap()
        .return_device()
        .unwrap();
}

/// A borrower that goes silent (SIGSTOP: the socket stays open, heartbeats stop) is known
/// gone after the link's `peer_timeout`: from then on its device is `releasing`, and available
/// once the release work is done. This is the bound docs/RELIABILITY.md states.
#[test]
fn a_silent_borrowers_lease_is_taken_back_within_peer_timeout_plus_the_release_work() {
    let r = rig("release-stop");
    let peer_timeout = r.cfg.node("lender").unwrap().link.peer_timeout;
    r.dev.reset.close();
    let mut helper = r.spawn_borrower(false);
    // SAFETY: signalling our own child by pid.
    unsafe { libc::kill(helper.id() as i32, libc::SIGSTOP) };
    let t0 = Instant::now();
    let releasing = DeviceState::Releasing {
        node: "node2".into(),
        vm: "victim".into(),
    };
    let bound = peer_timeout + SLACK;
    let seen = r.wait_state(&releasing, bound);
    let _ = helper.kill();
    let _ = helper.wait();
    let seen = seen.unwrap_or_else(|| {
        panic!(
            "not releasing within peer_timeout {peer_timeout:?} + {SLACK:?}: {:?}",
            r.state()
        )
    });
    assert!(seen - t0 <= bound, "{:?}", seen - t0);
    eprintln!(
        "silent borrower: releasing {:.0} ms after SIGSTOP (peer_timeout {peer_timeout:?})",
        (seen - t0).as_secs_f64() * 1e3
    );
    r.assert_releasing();
    r.dev.reset.open();
    let t1 = Instant::now();
    let back = r
        .wait_state(&DeviceState::Available, SLACK)
        .expect("not available after the release work");
    assert!(back - t1 <= SLACK);
    // Never available before the release work was done.
    assert!(r.dev.reset.entered());
}
