//! The VMM's control plane with real processes: `lenderd` lending emulated devices over shm,
//! `lendvm` running the bare-metal test guest (`tests=hotplug`, see tests/guest/src/hotplug.rs).
//!
//! * `device_lost_is_an_event_within_a_bound_of_the_lenders_death`: SIGKILL lenderd while
//!   its device is attached; `device-lost` (with the cause) reaches a `vm.events` follower
//!   and the `--event-monitor` file. The time from the kill to the event is measured and
//!   printed. The assertions: the cause is the link's end, not the heartbeat timeout it
//!   would otherwise fall back to, and a gross 5 s bound (1 s was seen missed with both
//!   cores busy; the 100 ms target is a benchmark's). The event loop has no timer, so this is
//!   the link's event thread → eventfd → event-manager path.
//! * `pause_mid_io_then_resume_loses_no_interrupt`: a hot-added NVMe makes the guest run its
//!   driver (verified writes and reads, MSI-X completions); the VM is paused right after the
//!   add, while that I/O is in flight. While paused the guest prints nothing; after
//!   `vm.resume` its I/O completes with its MSI-X completion interrupts delivered, and the
//!   backing file holds its data.
//!
//! Both run the debug `lendvm`, in which a lender round trip of teardown or lease return on
//! a vCPU thread aborts the process (`vmm::vcpu::assert_not_on_vcpu`), so their hot-plug and
//! teardown paths also check that.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use api::client::ApiClient;
use api::events::VmEvent;
use api::types::VmState;
use common::*;

const T: Duration = BOOT_TIMEOUT;
const SLBA: u64 = 16;

/// Follows `vm.events` on a thread; events arrive on the receiver.
fn follow(api: ApiClient) -> mpsc::Receiver<VmEvent> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = api.follow_events(Some(0), |line| {
            serde_json::from_str(line).map_or(true, |ev| tx.send(ev).is_ok())
        });
    });
    rx
}

fn wait_event(rx: &mpsc::Receiver<VmEvent>, name: &str, timeout: Duration) -> VmEvent {
    let deadline = Instant::now() + timeout;
    let mut seen = Vec::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(ev) if ev.event == name => return ev,
            Ok(ev) => seen.push(ev.event),
            Err(_) => break,
        }
    }
    panic!("no {name} event within {timeout:?}; saw {seen:?}");
}

#[test]
fn device_lost_is_an_event_within_a_bound_of_the_lenders_death() {
    let cluster = Cluster::new(Fabric::Shm);
    let mut lender = cluster.start_lenderd(&[format!("{DMATEST_BDF}=dmatest")]);
    let monitor = cluster.file("events.jsonl");
    let monitor_arg = format!("path={}", monitor.display());
    let mut vm = boot_with_api(
        &cluster,
        &format!("tests=hotplug rounds=2 seed={SEED:#x} eject_delay_ms=500"),
        &["--event-monitor", &monitor_arg],
    );
    let api = vm.api();
    let events = follow(vm.api());
    wait_event(&events, "vm-booted", T);
    vm.expect_line("HOTPLUG ready", T);
    add(&api, DMATEST_BDF, "d0");
    let added = wait_event(&events, "device-added", T);
    assert_eq!(added.properties["id"], "d0");
    vm.expect_ok("dmatest-copy", T);
    // The guest's driver set Bus Master Enable: the DMA window was mapped.
    let mapped = wait_event(&events, "dma-mapped", T);
    assert_eq!(mapped.properties["id"], "d0");
    assert!(mapped.properties["pinned_bytes"].as_u64().unwrap() >= 64 << 20);

    let killed = Instant::now();
    lender.kill();
    let lost = wait_event(&events, "device-lost", Duration::from_secs(10));
    let took = killed.elapsed();
    println!(
        "device-lost {:.1} ms after SIGKILL of lenderd",
        took.as_secs_f64() * 1e3
    );
    assert_eq!(lost.properties["id"], "d0");
    // Event-driven: the link's end (the lender's socket closed with it) is the cause, not the
    // heartbeat timeout (1.5 s) that a missed end would fall back to. The time bound is a
    // gross one (milliseconds when idle; seconds with both cores busy): the speed is
    // measured in docs/BENCHMARKS.md, not here.
    let cause = lost.properties["cause"].as_str().unwrap_or_default();
    assert!(
        !cause.is_empty() && !cause.contains("heartbeat"),
        "device-lost should come from the link's end: {lost:?}"
    );
    assert!(
        took < Duration::from_secs(5),
        "device-lost {took:?} after the lender died"
    );
    // The guest ejects the slot; the lost entry goes with it.
    vm.expect_line("HOTPLUG eject ", T);
    let removed = wait_event(&events, "device-removed", T);
    assert_eq!(removed.properties["id"], "d0");
    assert!(vm.running(), "the VM died with its lender: {}", vm.stderr());
    api.shutdown().unwrap();
    vm.wait_exit(T).expect("lendvm exits after vm.shutdown");
    // The monitor file has the whole story in order, ending with vm-shutdown.
    let text = std::fs::read_to_string(&monitor).unwrap();
    let names: Vec<String> = text
        .lines()
        .map(|l| serde_json::from_str::<VmEvent>(l).unwrap().event)
        .collect();
    for want in [
        "vm-booted",
        "device-added",
        "dma-mapped",
        "device-lost",
        "device-removed",
        "vm-shutdown",
    ] {
        assert!(
            names.contains(&want.to_string()),
            "{want} missing: {names:?}"
        );
    }
    assert_eq!(names.last().map(String::as_str), Some("vm-shutdown"));
    let pos = |n: &str| names.iter().position(|x| x == n).unwrap();
    assert!(pos("device-added") < pos("device-lost"));
    assert!(pos("device-lost") < pos("device-removed"));
    assert!(!names.contains(&"lease-returned".to_string()), "{names:?}");
}

#[test]
fn pause_mid_io_then_resume_loses_no_interrupt() {
    let cluster = Cluster::new(Fabric::Shm);
    let disk = cluster.file("disk.img");
    let _lender =
        cluster.start_lenderd(&[format!("{NVME_BDF}=nvme:path={},size=4M", disk.display())]);
    let mut vm = boot_with_api(
        &cluster,
        &format!("tests=hotplug rounds=2 seed={SEED:#x} lba={SLBA}"),
        &[],
    );
    let api = vm.api();
    vm.expect_line("HOTPLUG ready", T);

    // Round 0, not paused: how many MSI-X interrupts the driver's I/O takes.
    add(&api, NVME_BDF, "nvme0");
    let baseline = vm.expect_nth_line("TEST nvme-msix ", 0, T);
    assert!(
        baseline.starts_with("TEST nvme-msix ok count="),
        "{baseline}"
    );
    check_counters_after_the_driver_io(&api);
    remove(&api, "nvme0");
    vm.expect_nth_line("HOTPLUG eject ", 0, T);
    cluster.wait_available(NVME_BDF);

    // Round 1: pause while the guest's driver is bringing the controller up and doing I/O.
    add(&api, NVME_BDF, "nvme0");
    api.pause().unwrap();
    assert_eq!(api.info().unwrap().state, VmState::Paused);
    let lines = vm.lines().len();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        vm.lines().len(),
        lines,
        "the guest printed while paused: {:?}",
        &vm.lines()[lines..]
    );
    let paused_at = vm.count_lines("TEST nvme-msix ");
    api.resume().unwrap();
    assert_eq!(api.info().unwrap().state, VmState::Running);
    let after = vm.expect_nth_line("TEST nvme-msix ", 1, T);
    assert_eq!(
        paused_at, 1,
        "the round-1 I/O finished before the pause took effect; the test did not pause mid-I/O"
    );
    // Completions that arrived while the vectors were masked at the VMM stayed pending in
    // the irqfd and were delivered on resume. (MSIs to one vector coalesce while pending, in
    // the LAPIC as on hardware, so the count may be lower than the unpaused round's; what
    // matters is that the driver got its completion interrupts and every I/O verified.)
    let count: u64 = field(&after, "count").unwrap().parse().unwrap();
    assert!(after.starts_with("TEST nvme-msix ok"), "{after}");
    assert!(
        count >= 1,
        "no I/O interrupt after resume: {after} (baseline {baseline})"
    );
    for name in ["nvme-write", "nvme-read"] {
        let l = vm.expect_nth_line(&format!("TEST {name} "), 1, Duration::ZERO);
        assert!(l.starts_with(&format!("TEST {name} ok")), "{l}");
    }
    let names: Vec<String> = api
        .events(0)
        .unwrap()
        .into_iter()
        .map(|e| e.event)
        .collect();
    let pos = |n: &str| names.iter().rposition(|x| x == n).unwrap();
    assert!(pos("vm-paused") < pos("vm-resumed"), "{names:?}");
    remove(&api, "nvme0");
    vm.expect_ok("hotplug", T);
    vm.expect_exit(0, T);
    cluster.wait_available(NVME_BDF);
    assert_backing_has_pattern(&disk, SLBA, 64, SEED);
}

/// After the guest driver's bring-up and its verified 64-LBA write and read-back (plus the
/// PRP-variant commands), the counters say what happened: the vCPUs exited (to user space
/// for trapped MMIO); the lender moved at least the written
/// and read data by DMA, signalled interrupts and received at least every kick the VMM
/// signalled (the others came through KVM ioeventfds straight to it). The exact per-command
/// figures are asserted against a host driver in remote_pci's `lender_link_events` test.
fn check_counters_after_the_driver_io(api: &ApiClient) {
    let c = api.counters().unwrap();
    let vm = &c["vm"];
    // (Port I/O of the console does not count as `io_exits` under this host's PVM; not
    // asserted.)
    assert!(vm["exits"] > 0 && vm["mmio_exits"] > 0, "{vm:?}");
    let d = &c["nvme0"];
    let data = 64 * 512;
    assert!(d["dma_bytes_read"] >= data, "{d:?}");
    assert!(d["dma_bytes_written"] >= data, "{d:?}");
    assert!(d["interrupts"] >= 1, "{d:?}");
    assert!(d["doorbell_kicks"] >= d["vmm_doorbell_kicks"], "{d:?}");
    assert!(d["trapped_bar_writes"] > 0, "{d:?}");
    assert_eq!(d["bme_transitions"], 1, "{d:?}");
    assert_eq!(d["iommu_faults"], 0, "{d:?}");
    let info = api.info().unwrap();
    let k = info.kvm.expect("kvm exit counts in vm.info");
    assert!(k.exits >= k.mmio_exits && k.mmio_exits > 0, "{k:?}");
    let dev = &info.remote_devices[0];
    let a = dev.access.expect("access counters in vm.info");
    let lender_kicks = a.lender_doorbell_kicks.expect("the lender reports kicks");
    assert!(lender_kicks >= d["doorbell_kicks"], "{a:?} vs {d:?}");
    assert!(a.trapped_bar_writes > 0, "{a:?}");
    assert!(
        dev.interrupts.msix >= 1,
        "lender-counted interrupts in vm.info: {dev:?}"
    );
}
