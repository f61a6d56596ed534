//! Fabric faults on the tcp fabric (TLS), between two network namespaces joined by a veth pair
//! (169.254.78.1 <-> 169.254.78.2): `lenderd` in one, `lendvm` with the bare-metal test guest
//! in the other. The test makes the namespaces itself and deletes them on drop, also after a
//! failure; without the privilege to make them it fails under `CI` and is skipped, with a
//! message, elsewhere.
//!
//! * `tcp_link_faults_heartbeats_and_lease_policy`: the guest gets a lent NVMe disk through a
//!   hot-add and does verified I/O on it (write + read back, pattern in the lender's file).
//!   Then, on the same lease:
//!   1. **short cut**: the borrower's veth end goes down for 500 ms, well under the configured
//!      peer timeout, and comes back: TCP retransmits, no side declares the peer gone, the
//!      lease survives on both sides (same lease, no new grant on the lender, `active` in
//!      `vm.info`, no `device-lost` event) and a control round trip (the lender counters of
//!      `vm.info`) works;
//!   2. **degraded link**: netem 30 % loss and 200 ms delay on both veth ends for 2 s, then
//!      removed (where the kernel has no netem, as on the development host: iptables' random
//!      drop of 30 % plus a 32 kbit/s tbf rate limit): the link is slow but never silent for a
//!      whole peer timeout, so the lease survives the same way, and a control round trip
//!      during the degradation completes;
//!   3. **long cut**: the borrower's veth end goes down and stays down. Both sides' heartbeats
//!      detect it within the configured bound (peer timeout + slack): lendvm reports the
//!      device lost (`vm.info` lease state `lost`, `device-lost` event) and asks the guest
//!      to eject it, which it does (after holding it back 3 s so the `lost` state shows); lenderd ends the lease and resets the device (available
//!      again). A `vm.info` issued while the link is down (it asks the lender for counters
//!      over the dead link) returns within the bound instead of hanging. Neither process dies.
//!   4. The link comes back: the device can be hot-added again, the guest's I/O goes through
//!      (its pattern is back in the lender's file after the test zeroed it), and the VM ends
//!      cleanly.
//!
//! The lease policy this shows (docs/RELIABILITY.md): a lender keeps a lease exactly as long
//! as its link lives; an outage shorter than the peer timeout is invisible (TCP carries the
//! frames across it), and the first peer timeout of silence ends the lease at once (no grace
//! period): the lender resets the device and lends it again, and the borrower must hot-add it
//! anew.
//!
//! Figures (detection times, the `vm.info` time during the cut) go to
//! `target/reliability/fabric_faults.json`. Every wait and loop is bounded.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use api::client::ApiClient;
use api::types::{LeaseState, VmCounters};
use common::*;
use lending::protocol::{DeviceState, DeviceStatus};
use lendvm_tests::capture::last_lines;

const SLBA: u64 = 16;
const T: Duration = BOOT_TIMEOUT;
/// The cluster's link settings (both processes read them from the cluster file).
const HEARTBEAT_MS: u64 = 250;
const PEER_TIMEOUT_MS: u64 = 5000;
/// Slack on top of the peer timeout for detection to show: the loss is noticed by a reader
/// thread, then handled by the control loop (VMM) or the session thread plus a device reset
/// (lender), all on a loaded 2-core host, and seen by the test's 20 ms polling.
const DETECT_SLACK: Duration = Duration::from_secs(3);
const LENDER_ADDR: &str = "169.254.78.1";
const BORROWER_ADDR: &str = "169.254.78.2";
const PORT: u16 = 7780;

fn ip(args: &[&str]) -> Result<(), String> {
    run("ip", args)
}

fn run(prog: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(prog)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {prog} (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{prog} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Network namespaces this test made; deleted on drop (which also deletes the veth ends in
/// them and their qdiscs), also when the test panics.
struct Netns {
    names: Vec<String>,
}

impl Netns {
    fn add(&mut self, name: &str) -> Result<(), String> {
        ip(&["netns", "add", name])?;
        self.names.push(name.to_string());
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            if let Err(e) = ip(&["netns", "del", n]) {
                eprintln!("fabric_faults: cannot delete network namespace {n}: {e}");
            }
        }
    }
}

/// Runs `f` on a thread that has entered network namespace `ns` (a namespace is per thread:
/// the sockets it opens and the processes it spawns live in `ns`).
fn in_netns<R: Send>(ns: &str, f: impl FnOnce() -> R + Send) -> R {
    lending::directory::testing::in_netns(Some(ns), f)
}

/// A cluster file with one tcp lender at `LENDER_ADDR:PORT` and this test's link settings.
fn cluster() -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let src = format!(
        "version = 1\ntoken = \"{TOKEN}\"\n\
         [link]\nheartbeat_ms = {HEARTBEAT_MS}\npeer_timeout_ms = {PEER_TIMEOUT_MS}\n\
         connect_timeout_ms = 3000\n\
         [[node]]\nname = \"{LENDER}\"\nfabric = \"tcp\"\ncontrol = \"{LENDER_ADDR}:{PORT}\"\n"
    );
    Cluster::from_text(dir, &src, Fabric::Tcp)
}

const NETEM: &str = "netem loss 30% delay 200 ms";
const FALLBACK: &str = "iptables random drop 30% + tbf 32 kbit/s";

/// Degrades both `(namespace, veth)` ends for a while: netem 30 % loss and 200 ms delay where
/// the kernel has `sch_netem`; where it has not (this project's development host runs a kernel
/// without it), iptables' `statistic` match drops 30 % of the incoming packets at random (as if
/// lost on the wire) and a
/// `tbf` qdisc limits the rate to 32 kbit/s (a queueing delay instead of a fixed one).
/// Returns which of the two it applied.
fn degrade(ends: &[(&str, &str)]) -> &'static str {
    let netem = |n: &str, v: &str| {
        run(
            "tc",
            &[
                "-n", n, "qdisc", "add", "dev", v, "root", "netem", "loss", "30%", "delay", "200ms",
            ],
        )
    };
    let (n0, v0) = ends[0];
    match netem(n0, v0) {
        Ok(()) => {
            for (n, v) in &ends[1..] {
                netem(n, v).unwrap();
            }
            NETEM
        }
        Err(e) => {
            assert!(e.contains("qdisc kind is unknown"), "netem: {e}");
            eprintln!("fabric_faults: no netem in this kernel ({e}); using {FALLBACK}");
            for (n, v) in ends {
                run(
                    "ip",
                    &[
                        "netns",
                        "exec",
                        n,
                        "iptables-legacy",
                        "-A",
                        "INPUT",
                        "-i",
                        v,
                        "-m",
                        "statistic",
                        "--mode",
                        "random",
                        "--probability",
                        "0.3",
                        "-j",
                        "DROP",
                    ],
                )
                .unwrap();
                run(
                    "tc",
                    &[
                        "-n", n, "qdisc", "add", "dev", v, "root", "tbf", "rate", "32kbit",
                        "burst", "4kb", "latency", "400ms",
                    ],
                )
                .unwrap();
            }
            FALLBACK
        }
    }
}

/// Undoes [`degrade`].
fn undegrade(ends: &[(&str, &str)], how: &str) {
    for (n, v) in ends {
        run("tc", &["-n", n, "qdisc", "del", "dev", v, "root"]).unwrap();
        if how == FALLBACK {
            run(
                "ip",
                &["netns", "exec", n, "iptables-legacy", "-F", "INPUT"],
            )
            .unwrap();
        }
    }
}

fn device_lost_events(api: &ApiClient) -> usize {
    api.events(0)
        .unwrap()
        .iter()
        .filter(|e| e.event == "device-lost")
        .count()
}

fn lease_state(api: &ApiClient, id: &str) -> Option<LeaseState> {
    api.info()
        .unwrap()
        .remote_devices
        .iter()
        .find(|d| d.id == id)
        .map(|d| d.lease_state)
}

/// `target/reliability` (next to the profile directory of this test executable).
fn reliability_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let target = exe
        .parent()
        .and_then(|d| d.parent())
        .and_then(|d| d.parent())
        .unwrap();
    let dir = target.join("reliability");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn tcp_link_faults_heartbeats_and_lease_policy() {
    let id = std::process::id() % 100_000;
    let (na, nb) = (format!("lvA{id}"), format!("lvB{id}"));
    let (va, vb) = (format!("vlvA{id}"), format!("vlvB{id}"));
    let mut ns = Netns { names: Vec::new() };
    if let Err(e) = ns.add(&na) {
        // The project's CI machine allows network namespaces: there this is a failure.
        assert!(
            std::env::var_os("CI").is_none(),
            "network namespaces refused in CI: {e}"
        );
        eprintln!(
            "SKIP tcp_link_faults_heartbeats_and_lease_policy: this machine forbids network \
             namespaces ({e})"
        );
        return;
    }
    ns.add(&nb).unwrap();
    ip(&[
        "link", "add", &va, "netns", &na, "type", "veth", "peer", "name", &vb, "netns", &nb,
    ])
    .unwrap();
    for (n, v, a) in [
        (&na, &va, format!("{LENDER_ADDR}/24")),
        (&nb, &vb, format!("{BORROWER_ADDR}/24")),
    ] {
        ip(&["-n", n, "addr", "add", &a, "dev", v]).unwrap();
        ip(&["-n", n, "link", "set", v, "up"]).unwrap();
        ip(&["-n", n, "link", "set", "lo", "up"]).unwrap();
    }
    // The borrower's end of the link: cutting it leaves the lender's end (and so its local
    // address, which the test's status queries use) up.
    let cut = || ip(&["-n", &nb, "link", "set", &vb, "down"]).unwrap();
    let restore = || ip(&["-n", &nb, "link", "set", &vb, "up"]).unwrap();

    let cluster = cluster();
    let disk = cluster.file("disk.img");
    let nvme = format!("{NVME_BDF}=nvme:path={},size=4M", disk.display());
    let mut lender = in_netns(&na, || cluster.start_lenderd(std::slice::from_ref(&nvme)));
    let lender_device = || in_netns(&na, || cluster.device(NVME_BDF));
    let mut vm = in_netns(&nb, || {
        // The link's own account (up, down and why) on stderr, for a failure's message.
        boot_with_api_log(
            &cluster,
            &format!("tests=hotplug rounds=2 seed={SEED:#x} lba={SLBA} wait_ms=300000 eject_delay_ms=3000"),
            &[],
            "warn,ntb=info",
        )
    });
    let api = vm.api();
    vm.expect_line("HOTPLUG ready", T);

    // A lease over tcp+TLS across the veth, and verified guest I/O through it.
    let added = add(&api, NVME_BDF, "nvme0");
    vm.expect_ok("nvme-write", T);
    vm.expect_ok("nvme-read", T);
    assert_backing_has_pattern(&disk, SLBA, 64, SEED);
    let before = lender_device();
    assert!(
        matches!(&before.summary.state, DeviceState::Lent { .. }),
        "{before:?}"
    );
    assert_eq!(lease_state(&api, "nvme0"), Some(LeaseState::Active));

    // The lease is the same one as before (no new grant), lent, active, and nobody saw a loss.
    let survived = |what: &str, before: &DeviceStatus| {
        let now = lender_device();
        let vm_log = || last_lines(&vm.stderr(), 20);
        // On a failure, the lender's own account of the link and the lease.
        let lender_log = || {
            last_lines(
                &std::fs::read_to_string(cluster.file("lenderd.log")).unwrap_or_default(),
                40,
            )
        };
        assert_eq!(
            (&now.summary.state, now.leases_granted),
            (&before.summary.state, before.leases_granted),
            "lender's lease did not survive the {what}; lenderd log, last 40 lines:\n{}\n\
             lendvm's stderr, last 20 lines:\n{}",
            lender_log(),
            vm_log()
        );
        assert_eq!(
            lease_state(&api, "nvme0"),
            Some(LeaseState::Active),
            "borrower's lease after the {what}"
        );
        assert_eq!(device_lost_events(&api), 0, "device-lost after the {what}");
        // A control round trip over the link: the lender's counters in vm.info.
        let info = api.info().unwrap();
        let dev = info
            .remote_devices
            .iter()
            .find(|d| d.id == "nvme0")
            .unwrap();
        assert!(
            dev.access.and_then(|a| a.lender_doorbell_kicks).is_some(),
            "no lender counters in vm.info after the {what}: {dev:?}"
        );
    };

    // 1. A short cut, well under the peer timeout.
    cut();
    std::thread::sleep(Duration::from_millis(500));
    restore();
    // Past a whole peer timeout after the cut ended: a late detection would show now.
    std::thread::sleep(Duration::from_millis(PEER_TIMEOUT_MS) + Duration::from_secs(1));
    survived("500 ms cut", &before);

    // 2. A degraded link: loss and delay on both ends, then back to normal.
    let ends = [(na.as_str(), va.as_str()), (nb.as_str(), vb.as_str())];
    let degradation = degrade(&ends);
    // While degraded, a control round trip still completes (slowly).
    let t_degraded = Instant::now();
    let degraded_info = api.info();
    let degraded_info_s = t_degraded.elapsed().as_secs_f64();
    assert!(
        degraded_info.is_ok(),
        "vm.info on the degraded link ({degradation}): {degraded_info:?}"
    );
    std::thread::sleep(Duration::from_secs(2).saturating_sub(t_degraded.elapsed()));
    undegrade(&ends, degradation);
    std::thread::sleep(Duration::from_millis(PEER_TIMEOUT_MS) + Duration::from_secs(1));
    survived(
        &format!("{degradation} (a vm.info during it took {degraded_info_s:.2} s)"),
        &before,
    );

    // 3. A long cut: the link stays down until both sides have declared the peer gone.
    let bound = Duration::from_millis(PEER_TIMEOUT_MS) + DETECT_SLACK;
    let t_cut = Instant::now();
    cut();
    let (vmm_detect, vm_info_during, lender_detect) = std::thread::scope(|s| {
        // An operation outstanding on the dead link: vm.info asks the lender for counters.
        let info_during = s.spawn(|| {
            let t = Instant::now();
            let r = api.info();
            (t.elapsed(), r)
        });
        let lender_side = s.spawn(|| {
            in_netns(&na, || {
                poll(bound + Duration::from_secs(10), || {
                    let d = cluster.device(NVME_BDF);
                    (d.summary.state == DeviceState::Available).then(|| t_cut.elapsed())
                })
            })
        });
        let vmm = poll(bound + Duration::from_secs(10), || {
            // vm.info right after the event: the guest holds its eject back 3 s
            // (`eject_delay_ms`), so the device is still listed, as lost.
            (device_lost_events(&api) > 0).then(|| (t_cut.elapsed(), lease_state(&api, "nvme0")))
        });
        (
            vmm,
            info_during.join().unwrap(),
            lender_side.join().unwrap(),
        )
    });
    let (vmm_detect, state_at_event) = vmm_detect.expect("lendvm never reported the device lost");
    assert_eq!(
        state_at_event,
        Some(LeaseState::Lost),
        "vm.info right after the device-lost event"
    );
    let lender_detect = lender_detect.expect("lenderd never reclaimed the device");
    let (info_time, info_result) = vm_info_during;
    println!(
        "tcp_link_faults: long cut detected by lendvm after {:.2} s, lender reclaimed after \
         {:.2} s (peer timeout {PEER_TIMEOUT_MS} ms, heartbeat {HEARTBEAT_MS} ms); vm.info \
         during the cut took {:.2} s; vm.info on the degraded link {degraded_info_s:.2} s",
        vmm_detect.as_secs_f64(),
        lender_detect.as_secs_f64(),
        info_time.as_secs_f64()
    );
    assert!(
        vmm_detect <= bound && lender_detect <= bound,
        "detection beyond peer timeout + slack ({bound:?}): lendvm {vmm_detect:?}, lender {lender_detect:?}"
    );
    assert!(
        info_result.is_ok() && info_time <= bound,
        "vm.info during the cut: {info_result:?} after {info_time:?}"
    );
    // The lender took everything of the lease back: no DMA mapping is left.
    let reclaimed = lender_device();
    assert!(
        reclaimed.dma_maps.is_empty(),
        "DMA maps left after the reclaim: {reclaimed:?}"
    );
    // The borrower: lost in vm.info and in the event log, the guest told and ejecting.
    let ev = api.events(0).unwrap();
    let lost = ev.iter().find(|e| e.event == "device-lost").unwrap();
    assert_eq!(
        lost.properties.get("id").and_then(|v| v.as_str()),
        Some("nvme0"),
        "{lost:?}"
    );
    let l = vm.expect_line("HOTPLUG eject ", T);
    assert_eq!(
        field(&l, "slot"),
        Some(added.bdf.device.to_string().as_str()),
        "{l}"
    );
    assert!(
        vm.running(),
        "lendvm died on the link loss: {}",
        vm.stderr()
    );
    assert!(
        lender.child.try_wait().unwrap().is_none(),
        "lenderd died on the link loss: {}",
        lender.log()
    );
    // Removing the lost device (or its guest eject) leaves nothing behind.
    let _ = api.remove_device(&api::types::VmRemoveDeviceData {
        id: "nvme0".into(),
        force: false,
    });
    let gone = poll(Duration::from_secs(10), || {
        api.info().unwrap().remote_devices.is_empty().then_some(())
    });
    assert!(gone.is_some(), "lost device still listed: {:?}", api.info());
    assert_eq!(api.info().unwrap().counters.unwrap(), VmCounters::default());

    // 4. The link comes back: the device is borrowable again and works.
    restore();
    // Zero the guest's blocks so the pattern can only come from the new lease's I/O.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&disk).unwrap();
        f.write_all_at(&vec![0u8; 64 * 512], SLBA * 512).unwrap();
        f.sync_all().unwrap();
    }
    let re = poll(Duration::from_secs(20), || {
        api.add_remote_device(&api::types::VmAddRemoteDeviceData {
            device: spec(NVME_BDF),
            id: Some("nvme0".into()),
            mode: None,
            replace_lost: false,
            numa_node: None,
        })
        .ok()
    });
    assert!(re.is_some(), "no re-add after the link came back");
    vm.expect_nth_line("TEST nvme-write ok", 1, T);
    vm.expect_nth_line("TEST nvme-read ok", 1, T);
    assert_backing_has_pattern(&disk, SLBA, 64, SEED);
    remove(&api, "nvme0");
    vm.expect_ok("hotplug", T);
    vm.expect_exit(0, T);
    in_netns(&na, || cluster.wait_available(NVME_BDF));
    assert!(
        lender.child.try_wait().unwrap().is_none(),
        "{}",
        lender.log()
    );
    lender.kill();

    let json = serde_json::json!({
        "test": "tcp_link_faults_heartbeats_and_lease_policy",
        "fabric": "tcp+tls over veth between network namespaces",
        "heartbeat_ms": HEARTBEAT_MS,
        "peer_timeout_ms": PEER_TIMEOUT_MS,
        "faults_injected": {
            "link_down_500ms": 1,
            "degraded_link_2s": 1,
            "link_down_until_detected": 1
        },
        "degradation": degradation,
        "short_faults_survived": 2,
        "long_cut_vmm_detect_s": vmm_detect.as_secs_f64(),
        "long_cut_lender_reclaim_s": lender_detect.as_secs_f64(),
        "vm_info_during_cut_s": info_time.as_secs_f64(),
        "vm_info_degraded_s": degraded_info_s,
        "crashes": 0,
        "readd_after_restore": "ok"
    });
    let out = reliability_dir().join("fabric_faults.json");
    std::fs::write(&out, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    println!("tcp_link_faults: figures in {}", out.display());
}
