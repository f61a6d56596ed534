//! Hot-plug of remote devices into a running `lendvm` through its REST API, with the
//! bare-metal test guest as the OS: it takes the GED interrupt, reads the PCI hotplug
//! controller's slot bitmaps, runs its driver on an added function and quiesces + ejects a
//! removed one (`tests=hotplug rounds=N`, `tests=idle`; see `tests/guest/src/hotplug.rs`).
//!
//! * `hot_add_io_remove_and_re_add`: add an NVMe from a running lender, the guest does
//!   verified I/O on it, remove, the guest ejects, the lender gets the lease back; adding it
//!   again works (Cloud Hypervisor bug #7328) and the backing file holds the guest's data.
//! * `fifty_add_remove_cycles_leak_nothing`: 50 cycles with the dmatest device (each with a
//!   DMA copy and an MSI-X interrupt in the guest) leave the VMM's fd count, locked memory
//!   (VmLck) and `vm.info` counters (devices, leases, memslots, GSIs, irqfds, ioeventfds,
//!   pinned bytes) where they were before the first add.
//! * `a_lenders_idle_session_serves_re_adds_then_closes`: with `--lender-idle-ms`, the link
//!   to a lender outlives its last device: re-adds reuse it (the lender sees one link for
//!   several adds), `vm.info` does not count it, and it closes once idle for that long.
//! * `a_vm_of_one_slot_refuses_a_second_device_by_name`: `--pci-slots` bounds the hot-adds.
//! * `api_abuse_gets_4xx_and_the_vm_keeps_running`: malformed JSON, unknown fields, unknown
//!   node, bad BDF, missing device, duplicate id, busy device, remove of an unknown id, double
//!   remove, wrong method, oversized body, add while shutting down → 4xx with a message that
//!   names the problem; the VM keeps running throughout.
//! * `lender_death_is_a_surprise_removal`: SIGKILL lenderd while its device is attached:
//!   `vm.info` shows the lease lost, the guest gets the removal event and ejects, the VM keeps
//!   running, and a restarted lender's device can be hot-added again.
//!
//! Guest work: ~20 k instructions per dmatest cycle, ~300 k per NVMe add (pattern fill and
//! compare of 32 KiB), plus console output; the rest of the time the guest is halted.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use api::client::ApiClient;
use api::types::{LeaseState, VmCounters, VmInfo, VmState};
use common::*;
use lending::protocol::DeviceState;

const SLBA: u64 = 16;
const T: Duration = BOOT_TIMEOUT;

fn info(api: &ApiClient) -> VmInfo {
    api.info().unwrap()
}

/// Waits until `vm.info` lists no remote device (the guest ejected and the VMM tore down).
fn wait_no_devices(api: &ApiClient) {
    let mut last = None;
    let gone = poll(Duration::from_secs(10), || {
        let i = info(api);
        let empty = i.remote_devices.is_empty();
        last = Some(i);
        empty.then_some(())
    });
    assert!(gone.is_some(), "devices still listed: {last:?}");
}

#[test]
fn hot_add_io_remove_and_re_add() {
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
    assert!(info(&api).remote_devices.is_empty());

    for round in 0..2 {
        let added = add(&api, NVME_BDF, "nvme0");
        assert_eq!(added.id, "nvme0");
        let slot = added.bdf.device;
        // The guest sees the slot come up, finds the controller there and does verified I/O.
        let l = vm.expect_nth_line("HOTPLUG add ", round, T);
        assert_eq!(field(&l, "slot"), Some(slot.to_string().as_str()), "{l}");
        assert!(l.contains("id=1b36:0010 class=010802"), "{l}");
        let msix = vm.expect_nth_line("TEST nvme-msix ", round, T);
        assert!(msix.starts_with("TEST nvme-msix ok count="), "{msix}");
        for name in ["nvme-probe", "nvme-identify", "nvme-write", "nvme-read"] {
            let l = vm.expect_nth_line(&format!("TEST {name} "), round, Duration::ZERO);
            assert!(l.starts_with(&format!("TEST {name} ok")), "{l}");
        }
        let ident = vm.expect_nth_line("TEST nvme-identify ", round, Duration::ZERO);
        assert!(
            ident.contains(&format!("serial \"{NVME_SERIAL}\"")),
            "{ident}"
        );

        // Both sides agree the device is lent and DMA-capable.
        let d = cluster.device(NVME_BDF);
        assert!(matches!(d.summary.state, DeviceState::Lent { .. }), "{d:?}");
        assert!(!d.dma_maps.is_empty(), "{d:?}");
        let i = info(&api);
        let dev = i.remote_devices.iter().find(|d| d.id == "nvme0").unwrap();
        assert_eq!(dev.lease_state, LeaseState::Active, "{dev:?}");
        assert_eq!(dev.guest_bdf, added.bdf);
        assert!(dev.dma_window.mapped, "{dev:?}");
        // (`dev.interrupts` stays 0 on shm: the lender signals KVM's irqfd directly; the
        // guest's `nvme-msix count=` above is the proof of delivery.)

        // Remove: the guest quiesces and ejects; then the VMM tears down and returns the lease.
        remove(&api, "nvme0");
        let l = vm.expect_nth_line("HOTPLUG eject ", round, T);
        assert_eq!(field(&l, "slot"), Some(slot.to_string().as_str()), "{l}");
        if round == 0 {
            wait_no_devices(&api);
            cluster.wait_available(NVME_BDF);
            let c = info(&api).counters.unwrap();
            assert_eq!(c, VmCounters::default(), "resources left after removal");
        }
    }
    vm.expect_ok("hotplug", T);
    vm.expect_exit(0, T);
    cluster.wait_available(NVME_BDF);
    assert_backing_has_pattern(&disk, SLBA, 64, SEED);
}

/// Lines of the lender's log about a VMM's links: its node is `lendvm-<pid>` (the test's own
/// status requests come as `lendvm-tests`).
fn vmm_links(lender: &lending::testing::Lenderd, what: &str) -> usize {
    let key = format!("{what} lendvm-");
    lender
        .log()
        .lines()
        .filter(|l| {
            l.split(&key)
                .nth(1)
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .count()
}

#[test]
fn a_lenders_idle_session_serves_re_adds_then_closes() {
    let cluster = Cluster::new(Fabric::Shm);
    let lender = cluster.start_lenderd(&[format!("{DMATEST_BDF}=dmatest")]);

    // An idle time no cycle comes near: every re-add reuses the link.
    let mut vm = boot_with_api(
        &cluster,
        &format!("tests=hotplug rounds=3 seed={SEED:#x} wait_ms=120000"),
        &["--lender-idle-ms", "600000"],
    );
    let api = vm.api();
    vm.expect_line("HOTPLUG ready", T);
    for round in 0..2 {
        add(&api, DMATEST_BDF, "dma0");
        let l = vm.expect_nth_line("TEST dmatest-copy ", round, T);
        assert!(l.starts_with("TEST dmatest-copy ok"), "round {round}: {l}");
        remove(&api, "dma0");
        vm.expect_nth_line("HOTPLUG eject ", round, T);
        wait_no_devices(&api);
        cluster.wait_available(DMATEST_BDF);
    }
    assert_eq!(
        vmm_links(&lender, "link up from"),
        1,
        "two adds, one link:\n{}",
        lender.log()
    );
    assert_eq!(
        vmm_links(&lender, "session with"),
        0,
        "the idle link was closed:\n{}",
        lender.log()
    );
    // Idle, it is not a session in use.
    assert_eq!(info(&api).counters.unwrap(), VmCounters::default());
    add(&api, DMATEST_BDF, "dma0");
    vm.expect_nth_line("TEST dmatest-copy ok", 2, T);
    remove(&api, "dma0");
    vm.expect_ok("hotplug", T);
    vm.expect_exit(0, T);
    assert_eq!(vmm_links(&lender, "link up from"), 1, "{}", lender.log());
    cluster.wait_available(DMATEST_BDF);

    // A short idle time: the link closes while the VM runs on (its guest waits for a second
    // round), not only when it exits.
    let mut vm = boot_with_api(
        &cluster,
        &format!("tests=hotplug rounds=2 seed={SEED:#x} wait_ms=120000"),
        &["--lender-idle-ms", "200"],
    );
    let api = vm.api();
    vm.expect_line("HOTPLUG ready", T);
    add(&api, DMATEST_BDF, "dma0");
    vm.expect_nth_line("TEST dmatest-copy ok", 0, T);
    remove(&api, "dma0");
    vm.expect_nth_line("HOTPLUG eject ", 0, T);
    wait_no_devices(&api);
    let closed = poll(Duration::from_secs(20), || {
        (vmm_links(&lender, "session with") == 2).then_some(())
    });
    assert!(
        closed.is_some(),
        "the idle link stayed open:\n{}",
        lender.log()
    );
    assert_eq!(
        vm.child.try_wait().unwrap(),
        None,
        "the VM exited meanwhile"
    );
    // A new link serves the next add.
    add(&api, DMATEST_BDF, "dma0");
    vm.expect_nth_line("TEST dmatest-copy ok", 1, T);
    remove(&api, "dma0");
    vm.expect_ok("hotplug", T);
    vm.expect_exit(0, T);
    assert_eq!(vmm_links(&lender, "link up from"), 3, "{}", lender.log());
}

#[test]
fn fifty_add_remove_cycles_leak_nothing() {
    const CYCLES: usize = 50;
    let cluster = Cluster::new(Fabric::Shm);
    let _lender = cluster.start_lenderd(&[format!("{DMATEST_BDF}=dmatest")]);
    // One extra round after the measurement shows the VM still works and ends the guest.
    let mut vm = boot_with_api(
        &cluster,
        &format!("tests=hotplug rounds={} seed={SEED:#x}", CYCLES + 1),
        &[],
    );
    let api = vm.api();
    vm.expect_line("HOTPLUG ready", T);

    let fds = vm.fds();
    let locked = vm.proc_status_kb("VmLck");
    let counters = info(&api).counters.expect("vm.info has no counters");
    assert_eq!(counters, VmCounters::default());
    let status_before = cluster.device(DMATEST_BDF);

    let t0 = std::time::Instant::now();
    for i in 0..CYCLES {
        add(&api, DMATEST_BDF, "dma0");
        let l = vm.expect_nth_line("TEST dmatest-copy ", i, T);
        assert!(
            l.starts_with("TEST dmatest-copy ok") && l.contains("irq count=1"),
            "cycle {i}: {l}"
        );
        remove(&api, "dma0");
        vm.expect_nth_line("HOTPLUG eject ", i, T);
        wait_no_devices(&api);
        cluster.wait_available(DMATEST_BDF);
    }
    eprintln!(
        "{CYCLES} add/remove cycles in {:.1} s",
        t0.elapsed().as_secs_f64()
    );

    assert_eq!(info(&api).counters.unwrap(), VmCounters::default());
    // The API server closes its end of a `vm.info` connection asynchronously: give a
    // transient socket a moment to go away; a leaked descriptor stays. (One that was open
    // before the cycles, such as the connection of an earlier request, may be gone: no
    // leak.)
    let mut now = Vec::new();
    let same = poll(Duration::from_secs(3), || {
        now = vm.fds();
        now.iter().all(|f| fds.contains(f)).then_some(())
    });
    assert!(
        same.is_some(),
        "file descriptors leaked: before {fds:?}\nafter {now:?}"
    );
    assert_eq!(vm.proc_status_kb("VmLck"), locked, "locked memory leaked");
    let status_after = cluster.device(DMATEST_BDF);
    assert!(status_after.dma_maps.is_empty(), "{status_after:?}");
    assert_eq!(
        status_after.leases_granted,
        status_before.leases_granted + CYCLES as u64
    );
    assert_eq!(status_after.iommu_faults, status_before.iommu_faults);

    add(&api, DMATEST_BDF, "dma0");
    vm.expect_nth_line("TEST dmatest-copy ok", CYCLES, T);
    remove(&api, "dma0");
    vm.expect_ok("hotplug", T);
    vm.expect_exit(0, T);
    cluster.wait_available(DMATEST_BDF);
}

/// A cluster whose lender lends a `dmatest` and a 1 MiB NVMe.
fn dmatest_and_nvme_lender() -> (Cluster, lending::testing::Lenderd) {
    let cluster = Cluster::new(Fabric::Shm);
    let lender = cluster.start_lenderd(&[
        format!("{DMATEST_BDF}=dmatest"),
        format!(
            "{NVME_BDF}=nvme:path={},size=1M",
            cluster.file("disk.img").display()
        ),
    ]);
    (cluster, lender)
}

/// Sends a raw request; returns (status, body text).
fn raw(api: &ApiClient, method: &str, endpoint: &str, body: Option<&[u8]>) -> (u16, String) {
    let r = api.request(method, endpoint, body).unwrap();
    (r.status, r.body_text())
}

/// Asserts a 4xx (`status`) whose message contains every needle, and that the VM still runs.
fn expect_4xx(vm: &mut Vm, what: &str, got: (u16, String), status: u16, needles: &[&str]) {
    let (code, body) = got;
    eprintln!("{what}: {code} {}", body.trim());
    assert_eq!(code, status, "{what}: {code} {body}");
    assert!(!body.trim().is_empty(), "{what}: empty error body");
    for n in needles {
        assert!(body.contains(n), "{what}: {body:?} lacks {n:?}");
    }
    assert!(vm.running(), "{what}: the VMM exited: {}", vm.stderr());
    let i = info(&vm.api());
    assert_eq!(i.state, VmState::Running, "{what}");
}

#[test]
fn api_abuse_gets_4xx_and_the_vm_keeps_running() {
    let (cluster, _lender) = dmatest_and_nvme_lender();
    let mut vm = boot_with_api(&cluster, "tests=idle total_ms=120000", &[]);
    let api = vm.api();
    vm.expect_line("HOTPLUG ready", T);
    let add_ep = "vm.add-remote-device";
    let rm_ep = "vm.remove-device";
    let put = |body: &str| raw(&api, "PUT", add_ep, Some(body.as_bytes()));

    let r = put("{\"device\": ");
    expect_4xx(&mut vm, "truncated json", r, 400, &[]);
    let r = put("[1, 2]");
    expect_4xx(&mut vm, "json of the wrong shape", r, 400, &[]);
    let r = raw(&api, "PUT", add_ep, None);
    expect_4xx(&mut vm, "empty body", r, 400, &[]);
    let r = put(&format!(
        "{{\"device\":\"{LENDER}:{DMATEST_BDF}\",\"colour\":\"red\"}}"
    ));
    expect_4xx(&mut vm, "unknown field", r, 400, &["colour"]);
    let r = put(&format!("{{\"device\":\"node7:{DMATEST_BDF}\"}}"));
    expect_4xx(&mut vm, "unknown node", r, 400, &["node7"]);
    let r = put(&format!("{{\"device\":\"node9:{DMATEST_BDF}\"}}"));
    // A valid request whose lender is unreachable: 502 Bad Gateway (the upstream lender
    // failed), neither a client error nor a VMM-internal 500.
    assert_eq!(r.0, 502, "unreachable lender: {r:?}");
    assert!(
        r.1.contains("lender node9 is unreachable at ") && r.1.contains("node9.sock"),
        "{r:?}"
    );
    assert!(vm.running());
    let r = put(&format!("{{\"device\":\"{LENDER}:0000:83:00.9\"}}"));
    expect_4xx(&mut vm, "bad function", r, 400, &["0000:83:00.9"]);
    let r = put(&format!("{{\"device\":\"{LENDER}:0000:83:20.0\"}}"));
    expect_4xx(&mut vm, "bad device number", r, 400, &["20"]);
    let r = put(&format!("{{\"device\":\"{LENDER}:0000:99:00.0\"}}"));
    expect_4xx(
        &mut vm,
        "no such device on the lender",
        r,
        400,
        &["0000:99:00.0"],
    );
    let r = put(&format!(
        "{{\"device\":\"{LENDER}:{DMATEST_BDF}\",\"id\":\"bad id!\"}}"
    ));
    expect_4xx(&mut vm, "bad id", r, 400, &["bad id!"]);
    let r = put(&format!(
        "{{\"device\":\"{LENDER}:{DMATEST_BDF}\",\"mode\":\"fast\"}}"
    ));
    expect_4xx(&mut vm, "bad mode", r, 400, &["fast"]);
    let big = format!(
        "{{\"device\":\"{LENDER}:{DMATEST_BDF}\",\"id\":\"{}\"}}",
        "x".repeat(1 << 20)
    );
    let r = put(&big);
    expect_4xx(&mut vm, "oversized body", r, 413, &[]);
    let r = raw(&api, "GET", add_ep, None);
    expect_4xx(&mut vm, "wrong method", r, 405, &[]);
    let r = raw(&api, "GET", "vm.no-such-endpoint", None);
    expect_4xx(&mut vm, "unknown endpoint", r, 404, &[]);
    assert!(info(&api).remote_devices.is_empty());

    // A real device, then the same id again and the same device again.
    add(&api, DMATEST_BDF, "d0");
    vm.expect_line("HOTPLUG add slot=", T);
    let r = put(&format!(
        "{{\"device\":\"{LENDER}:{NVME_BDF}\",\"id\":\"d0\"}}"
    ));
    expect_4xx(&mut vm, "duplicate id", r, 409, &["d0"]);
    let r = put(&format!(
        "{{\"device\":\"{LENDER}:{DMATEST_BDF}\",\"id\":\"d1\"}}"
    ));
    expect_4xx(&mut vm, "device already attached", r, 409, &[DMATEST_BDF]);
    assert_eq!(info(&api).remote_devices.len(), 1);
    cluster.wait_device(DMATEST_BDF, "still lent", |d| {
        matches!(d.summary.state, DeviceState::Lent { .. })
    });

    // Removals: unknown id, malformed, then a double remove while the eject is pending.
    let r = raw(&api, "PUT", rm_ep, Some(b"{\"id\":\"nope\"}"));
    expect_4xx(&mut vm, "remove unknown id", r, 404, &["nope"]);
    let r = raw(&api, "PUT", rm_ep, Some(b"{\"id\":\"d0\",\"now\":true}"));
    expect_4xx(&mut vm, "remove with unknown field", r, 400, &["now"]);
    let r = raw(&api, "PUT", rm_ep, Some(b"{}"));
    expect_4xx(&mut vm, "remove without id", r, 400, &["id"]);
    remove(&api, "d0");
    let r = raw(&api, "PUT", rm_ep, Some(b"{\"id\":\"d0\"}"));
    // Either the eject is still pending (409) or it already happened (404).
    let code = r.0;
    assert!(code == 409 || code == 404, "double remove: {r:?}");
    expect_4xx(&mut vm, "double remove", r, code, &["d0"]);
    vm.expect_line("HOTPLUG eject slot=", T);
    wait_no_devices(&api);
    let r = raw(&api, "PUT", rm_ep, Some(b"{\"id\":\"d0\"}"));
    expect_4xx(&mut vm, "remove after eject", r, 404, &["d0"]);
    cluster.wait_available(DMATEST_BDF);

    // Still fully working after all that.
    add(&api, NVME_BDF, "n0");
    vm.expect_nth_line("HOTPLUG add slot=", 1, T);

    // Shutdown, then an add: refused (409) or the server is already gone; never accepted.
    api.shutdown().unwrap();
    match api.request(
        "PUT",
        add_ep,
        Some(format!("{{\"device\":\"{LENDER}:{DMATEST_BDF}\"}}").as_bytes()),
    ) {
        Ok(r) => assert!(
            r.status == 409 || r.status == 503,
            "add while shutting down: {} {}",
            r.status,
            r.body_text()
        ),
        Err(e) => eprintln!("add while shutting down: {e}"),
    }
    vm.expect_exit(0, T);
    assert!(
        vm.stderr().contains("vm.shutdown requested"),
        "{}",
        vm.stderr()
    );
    cluster.wait_available(NVME_BDF);
    cluster.wait_available(DMATEST_BDF);
}

/// `--pci-slots 1` (and two NUMA nodes, which `vm.info` reports with the slots): the guest's
/// tables describe one slot for devices, the first hot-add takes it, and a second is refused
/// with 409 naming the limit, before anything is borrowed: the lender keeps its device, and
/// the VM runs on.
#[test]
fn a_vm_of_one_slot_refuses_a_second_device_by_name() {
    let (cluster, _lender) = dmatest_and_nvme_lender();
    let mut vm = boot_with_api_log(
        &cluster,
        "tests=idle total_ms=120000",
        &[
            "--pci-slots",
            "1",
            "--numa",
            "id=0,cpus=0,memory=32M",
            "--numa",
            "id=1,memory=32M,distance=0:31",
        ],
        "info",
    );
    let api = vm.api();
    vm.expect_line("HOTPLUG ready", T);
    // vm.info reports both shapes: the slots, and the nodes with whole distance rows.
    let config = info(&api).config;
    assert_eq!(config.pci_slots, Some(1), "{config:?}");
    let nodes: Vec<_> = config
        .numa_nodes
        .iter()
        .map(|n| (n.id, n.cpus.clone(), n.memory_size, n.distances.clone()))
        .collect();
    assert_eq!(
        nodes,
        vec![
            (0, vec![0], 32 << 20, vec![10, 31]),
            (1, vec![], 32 << 20, vec![31, 10])
        ]
    );
    let added = add(&api, DMATEST_BDF, "d0");
    assert_eq!(added.bdf.device, 1, "{added:?}");
    vm.expect_line("HOTPLUG add slot=1", T);
    let r = raw(
        &api,
        "PUT",
        "vm.add-remote-device",
        Some(format!("{{\"device\":\"{LENDER}:{NVME_BDF}\",\"id\":\"n0\"}}").as_bytes()),
    );
    expect_4xx(
        &mut vm,
        "a device past the last slot",
        r,
        409,
        &["no free pci slot", "all 1 slots", "--pci-slots"],
    );
    let nvme = cluster.device(NVME_BDF);
    assert_eq!(nvme.summary.state, DeviceState::Available, "{nvme:?}");
    assert_eq!(info(&api).remote_devices.len(), 1);
    assert!(
        vm.stderr()
            .contains("pci: slots 1 to 1 of bus 0 take devices"),
        "{}",
        vm.stderr()
    );
    api.shutdown().unwrap();
    vm.expect_exit(0, T);
    cluster.wait_available(DMATEST_BDF);
}

#[test]
fn lender_death_is_a_surprise_removal() {
    let cluster = Cluster::new(Fabric::Shm);
    let mut lender = cluster.start_lenderd(&[format!("{DMATEST_BDF}=dmatest")]);
    // The guest holds its eject back 2 s so the `lost` state is observable.
    let mut vm = boot_with_api(
        &cluster,
        &format!("tests=hotplug rounds=2 seed={SEED:#x} eject_delay_ms=2000"),
        &[],
    );
    let api = vm.api();
    vm.expect_line("HOTPLUG ready", T);
    let added = add(&api, DMATEST_BDF, "d0");
    vm.expect_ok("dmatest-copy", T);

    lender.kill();
    // The VMM notices, tears the device down and tells the guest, which ejects the slot.
    let mut last = None;
    let lost = poll(Duration::from_secs(10), || {
        let i = info(&api);
        let lost = i
            .remote_devices
            .iter()
            .any(|d| d.id == "d0" && d.lease_state == LeaseState::Lost);
        last = Some(i);
        lost.then_some(())
    });
    assert!(lost.is_some(), "lease never reported lost: {last:?}");
    // Torn down locally right away: nothing pinned, mapped or wired any more.
    let c = info(&api).counters.unwrap();
    assert_eq!((c.memslots, c.gsis, c.pinned_bytes), (0, 0, 0), "{c:?}");
    // Removing a lost device is accepted.
    remove(&api, "d0");
    let ev = vm.expect_nth_line("HOTPLUG event ", 1, T);
    let down = format!("down={:#x}", 1u32 << added.bdf.device);
    assert!(ev.contains(&down), "guest not told about the removal: {ev}");
    let l = vm.expect_line("HOTPLUG eject ", T);
    assert_eq!(
        field(&l, "slot"),
        Some(added.bdf.device.to_string().as_str()),
        "{l}"
    );
    assert!(vm.running(), "the VM died with its lender: {}", vm.stderr());
    assert_eq!(info(&api).state, VmState::Running);
    wait_no_devices(&api);
    assert_eq!(info(&api).counters.unwrap(), VmCounters::default());

    // The VM goes on: a restarted lender's device can be hot-added and used.
    let _lender = cluster.start_lenderd(&[format!("{DMATEST_BDF}=dmatest")]);
    add(&api, DMATEST_BDF, "d0");
    vm.expect_nth_line("TEST dmatest-copy ok", 1, T);
    remove(&api, "d0");
    vm.expect_ok("hotplug", T);
    vm.expect_exit(0, T);
}
