//! Snapshot and restore with real processes: `lendvm` running the bare-metal test guest in
//! `tests=ticker` mode (tests/guest/src/ticker.rs: `TICK n ticks=t marker=ok` every 50 ms,
//! a 4 KiB memory marker checked each time, ends when the host writes its mailbox).
//!
//! * `snapshot_then_restore_in_a_new_process_continues_the_guest`: a snapshot of the
//!   running VM (paused and resumed by `vm.snapshot`; the source keeps ticking), bad
//!   destinations refused with 400 while the source keeps running, then a snapshot of the
//!   paused VM, the source SIGKILLed, and `lendvm --restore` in a new process: it starts
//!   paused, and after `vm.resume` the guest continues its count exactly after the last
//!   line the source printed (no reboot banner), its LAPIC timer keeps ticking, its marker
//!   is intact (in the snapshot's RAM file too), and it exits 0 when the host writes the
//!   mailbox of the restored VM.
//! * `snapshot_with_a_lent_nvme_reborrows_it_and_the_guest_does_io_again` (shm) and
//!   `snapshot_with_a_lent_nvme_over_tcp`: the guest runs `tests=nvme-loop` (verified I/O
//!   every 50 ms) on a boot-time lent NVMe; the paused VM is snapshotted (the document holds
//!   the lease identity, slot and MSI-X table); a restore while the source still holds the
//!   lease fails with exit 2 and leaves the source its lease; the source is SIGKILLed, the
//!   lender frees the device, and the restored process borrows it again (the lender shows
//!   it lent to the new VM before the guest runs). After `vm.resume` the guest finds the
//!   controller reset, re-initialises it and continues its verified rounds where it was.
//! * `restore_refuses_corrupt_snapshots_with_clear_errors`: truncated RAM, a flipped RAM
//!   byte, a future format version, a missing directory and a non-file url: exit 2 with a
//!   message naming the problem.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use api::client::{ApiClient, ClientError};
use api::types::{VmSnapshotConfig, VmState};
use common::*;

const T: Duration = BOOT_TIMEOUT;

fn cmdline() -> String {
    format!("tests=ticker seed={SEED} period_ms=50")
}

/// `TICK <n> ...` lines (a line cut by the snapshot may lack its start: parse the number
/// before ` ticks=`).
fn tick_numbers(vm: &Vm) -> Vec<(u64, u64)> {
    vm.lines()
        .iter()
        .filter_map(|l| {
            let (head, tail) = l.split_once(" ticks=")?;
            let n = head.rsplit(' ').next()?.parse().ok()?;
            let t = tail.split(' ').next()?.parse().ok()?;
            Some((n, t))
        })
        .collect()
}

fn wait_ticks(vm: &Vm, count: usize) -> Vec<(u64, u64)> {
    let got = poll(T, || {
        let t = tick_numbers(vm);
        (t.len() >= count).then_some(t)
    });
    got.unwrap_or_else(|| {
        panic!(
            "fewer than {count} TICK lines\n--- console\n{}--- stderr\n{}",
            vm.stdout(),
            vm.stderr()
        )
    })
}

fn snapshot(api: &ApiClient, dest: &Path) -> Result<(), ClientError> {
    api.snapshot(&VmSnapshotConfig {
        destination_url: format!("file://{}", dest.display()),
    })
}

fn status_of(r: Result<(), ClientError>) -> (u16, String) {
    match r {
        Err(ClientError::Status {
            status, message, ..
        }) => (status, message),
        other => panic!("expected an error status, got {other:?}"),
    }
}

/// Two vCPUs (the test guest runs on the first; the second waits for INIT/SIPI), so every
/// snapshot saves and restores more than one vCPU. Events go to `events.jsonl`.
fn boot(dir: &Path) -> Vm {
    Vm::start_source(dir, "64M", "events.jsonl", &cmdline())
}

#[test]
fn snapshot_then_restore_in_a_new_process_continues_the_guest() {
    let dir = tempfile::tempdir().unwrap();
    let mut src = boot(dir.path());
    let api = src.api();
    let hex = |l: String, p: &str| u64::from_str_radix(l.trim_start_matches(p).trim(), 16).unwrap();
    let mailbox = hex(src.expect_line("MAILBOX ", T), "MAILBOX 0x");
    let marker = hex(src.expect_line("MARKER ", T), "MARKER 0x");
    wait_ticks(&src, 3);

    // 1. A running VM: paused for the snapshot and resumed; it keeps ticking.
    let a = dir.path().join("a");
    snapshot(&api, &a).unwrap();
    assert!(a.join("state.json").is_file() && a.join("ram-0.bin").is_file());
    let events = poll(T, || {
        let e = std::fs::read_to_string(dir.path().join("events.jsonl")).ok()?;
        e.contains("snapshot-completed").then_some(e)
    })
    .expect("no snapshot-completed event");
    // In this order: the snapshot pauses the running VM and resumes it before completing.
    let at: Vec<Option<usize>> = [
        "snapshot-started",
        "vm-paused",
        "vm-resumed",
        "snapshot-completed",
    ]
    .iter()
    .map(|w| events.find(&format!("\"{w}\"")))
    .collect();
    assert!(
        at.iter().all(Option::is_some) && at.windows(2).all(|w| w[0] < w[1]),
        "{at:?}\n{events}"
    );
    assert_eq!(api.info().unwrap().state, VmState::Running);
    let n = tick_numbers(&src).len();
    wait_ticks(&src, n + 2);

    // 2. Bad destinations: 400 with a message naming the problem; the VM keeps running.
    let (st, msg) = status_of(snapshot(&api, &a));
    assert_eq!(st, 400, "{msg}");
    assert!(msg.contains("not empty"), "{msg}");
    let file = dir.path().join("plain-file");
    std::fs::write(&file, "x").unwrap();
    let (st, msg) = status_of(snapshot(&api, &file.join("sub")));
    assert_eq!(st, 400, "{msg}");
    assert!(
        msg.contains("plain-file/sub") && msg.contains("Not a directory"),
        "{msg}"
    );
    let (st, msg) = status_of(api.snapshot(&VmSnapshotConfig {
        destination_url: "tcp://127.0.0.1:9/x".into(),
    }));
    assert_eq!(st, 400, "{msg}");
    assert!(msg.contains("scheme 'tcp'"), "{msg}");
    assert_eq!(api.info().unwrap().state, VmState::Running);
    let n = tick_numbers(&src).len();
    wait_ticks(&src, n + 2);

    // 3. A paused VM stays paused; its last TICK is where the restored guest must go on.
    api.pause().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let last = *tick_numbers(&src).last().unwrap();
    let b = dir.path().join("b");
    snapshot(&api, &b).unwrap();
    assert_eq!(api.info().unwrap().state, VmState::Paused);
    assert_eq!(
        tick_numbers(&src).last(),
        Some(&last),
        "the paused guest ran"
    );
    let _ = src.wait_exit(Duration::ZERO); // SIGKILL: the source is gone for good.

    // The marker is in the snapshot's RAM (low RAM: file offset = GPA).
    let ram = std::fs::read(b.join("ram-0.bin")).unwrap();
    let want = pattern(SEED, 4096);
    assert_eq!(
        &ram[marker as usize..marker as usize + 4096],
        &want[..],
        "marker at {marker:#x} not in the snapshot's RAM"
    );
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(b.join("state.json")).unwrap()).unwrap();
    assert_eq!(doc["format"], "lendvm-snapshot");
    assert_eq!(doc["version"], 1);
    assert_eq!(doc["config"]["memory_size"], 64 << 20);
    assert_eq!(doc["vcpus"].as_array().unwrap().len(), 2);

    // 4. Restore in a new process: paused until vm.resume.
    let sock = dir.path().join("dst.sock").display().to_string();
    let url = format!("file://{}", b.display());
    let mut dst = Vm::start_args(&["--restore", &url, "--api-socket", &sock], "warn");
    dst.wait_api();
    let dapi = dst.api();
    let info = dapi.info().unwrap();
    assert_eq!(info.state, VmState::Paused);
    assert_eq!(info.config.memory_size, 64 << 20);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        tick_numbers(&dst).is_empty(),
        "a restored VM ran before vm.resume:\n{}",
        dst.stdout()
    );
    dapi.resume().unwrap();
    let ticks = wait_ticks(&dst, 3);
    // The first line may be the rest of one the snapshot cut; the second is whole.
    assert_eq!(
        ticks[1].0,
        last.0 + 2,
        "the guest did not continue its count\n--- console\n{}",
        dst.stdout()
    );
    assert!(
        ticks[2].1 > last.1,
        "the LAPIC tick did not advance: {ticks:?} after {last:?}"
    );
    assert!(
        !dst.stdout().contains("lendvm test guest"),
        "the guest rebooted"
    );
    assert!(
        !dst.stdout().contains("marker=bad"),
        "marker damaged:\n{}",
        dst.stdout()
    );
    // The restored guest's RAM is live: the host's mailbox write (at the address the source
    // announced) ends it.
    dst.write_guest_u64(mailbox, 1);
    dst.expect_ok("ticker", T);
    dst.expect_exit(0, T);
}

#[test]
fn restore_refuses_corrupt_snapshots_with_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let src = boot(dir.path());
    let api = src.api();
    wait_ticks(&src, 2);
    let good = dir.path().join("good");
    snapshot(&api, &good).unwrap();
    drop(src);

    let copy = |name: &str| {
        let d = dir.path().join(name);
        std::fs::create_dir(&d).unwrap();
        for f in ["state.json", "ram-0.bin"] {
            std::fs::copy(good.join(f), d.join(f)).unwrap();
        }
        d
    };
    let restore_fails = |d: &Path, want: &[&str]| {
        let url = format!("file://{}", d.display());
        let sock = d.with_extension("sock").display().to_string();
        let mut vm = Vm::start_args(&["--restore", &url, "--api-socket", &sock], "warn");
        let st = vm.wait_exit(T);
        let err = vm.stderr();
        assert_eq!(st.and_then(|s| s.code()), Some(2), "{err}");
        for w in want {
            assert!(err.contains(w), "expected {w:?} in: {err}");
        }
    };

    let truncated = copy("truncated");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(truncated.join("ram-0.bin"))
        .unwrap();
    f.set_len(1 << 20).unwrap();
    restore_fails(&truncated, &["ram-0.bin", "truncated"]);

    let flipped = copy("flipped");
    let mut ram = std::fs::read(flipped.join("ram-0.bin")).unwrap();
    ram[0x10_0000] ^= 0xff;
    std::fs::write(flipped.join("ram-0.bin"), ram).unwrap();
    restore_fails(&flipped, &["ram-0.bin", "CRC-32", "corrupt"]);

    let future = copy("future");
    let text = std::fs::read_to_string(future.join("state.json")).unwrap();
    std::fs::write(
        future.join("state.json"),
        text.replacen("\"version\": 1", "\"version\": 99", 1),
    )
    .unwrap();
    restore_fails(&future, &["version 99", "version 1"]);

    let garbage = copy("garbage");
    std::fs::write(garbage.join("state.json"), "{\"format\":").unwrap();
    restore_fails(&garbage, &["not a lendvm snapshot document"]);

    restore_fails(&dir.path().join("missing"), &["cannot read", "state.json"]);
    let sock = dir.path().join("x.sock").display().to_string();
    let mut vm = Vm::start_args(
        &["--restore", "tcp://127.0.0.1:1/x", "--api-socket", &sock],
        "warn",
    );
    assert_eq!(vm.wait_exit(T).and_then(|s| s.code()), Some(2));
    assert!(vm.stderr().contains("scheme 'tcp'"), "{}", vm.stderr());
    // Without an API socket nothing could resume the restored VM.
    let url = format!("file://{}", good.display());
    let mut vm = Vm::start_args(&["--restore", &url], "warn");
    assert_eq!(vm.wait_exit(T).and_then(|s| s.code()), Some(2));
    assert!(vm.stderr().contains("--api-socket"), "{}", vm.stderr());
}

/// The `IO <n> ok` rounds of `tests=nvme-loop` (the first line after a restore may be cut).
fn io_rounds(vm: &Vm) -> Vec<u64> {
    vm.lines()
        .iter()
        .filter_map(|l| {
            let (head, _) = l.split_once(" ok reinits=")?;
            head.rsplit(' ').next()?.parse().ok()
        })
        .collect()
}

fn wait_rounds(vm: &Vm, count: usize) -> Vec<u64> {
    poll(T, || {
        let r = io_rounds(vm);
        (r.len() >= count).then_some(r)
    })
    .unwrap_or_else(|| {
        panic!(
            "fewer than {count} verified NVMe rounds\n--- console\n{}--- stderr\n{}",
            vm.stdout(),
            vm.stderr()
        )
    })
}

fn lent_to(cluster: &Cluster, vm: &str) -> bool {
    matches!(
        &cluster.device(NVME_BDF).summary.state,
        lending::protocol::DeviceState::Lent { vm: v, .. } if v == vm
    )
}

#[test]
fn snapshot_with_a_lent_nvme_reborrows_it_and_the_guest_does_io_again() {
    lent_nvme(Fabric::Shm);
}

/// The same over the tcp fabric (trapped BARs, interrupts relayed as messages).
#[test]
fn snapshot_with_a_lent_nvme_over_tcp() {
    lent_nvme(Fabric::Tcp);
}

fn lent_nvme(fabric: Fabric) {
    let cluster = Cluster::new(fabric);
    let disk = cluster.file("disk.img");
    // A dmatest beside the disk: the lender's two launch devices sit behind its switch,
    // which the restored VM must rebuild (its bus numbers and windows) for the guest's
    // addresses to hold.
    let _lender = cluster.start_lenderd(&[
        format!("{NVME_BDF}=nvme:path={},size=4M", disk.display()),
        format!("{DMATEST_BDF}=dmatest"),
    ]);
    let c = cluster.path.display().to_string();
    let sock = cluster.file("src.sock").display().to_string();
    let dev = format!("{LENDER}:{NVME_BDF},id=nvme0");
    let peer = format!("{LENDER}:{DMATEST_BDF},id=dma0");
    let line = format!("tests=nvme-loop seed={SEED:#x} lba=16 period_ms=50");
    let mut src = Vm::start(
        "64M",
        &[
            "--cluster",
            &c,
            "--name",
            "vm-src",
            "--remote-device",
            &dev,
            "--remote-device",
            &peer,
            "--api-socket",
            &sock,
            "--cmdline",
            &line,
        ],
    );
    src.wait_api();
    let mailbox = src.expect_line("MAILBOX ", T);
    let mailbox = u64::from_str_radix(mailbox.trim_start_matches("MAILBOX 0x").trim(), 16).unwrap();
    wait_rounds(&src, 3);
    assert!(
        lent_to(&cluster, "vm-src"),
        "{:?}",
        cluster.device(NVME_BDF)
    );

    let api = src.api();
    // A snapshot of the running VM (paused and resumed around it, the device quiesced and
    // re-armed): the source's I/O goes on.
    snapshot(&api, &cluster.file("running")).unwrap();
    assert_eq!(api.info().unwrap().state, VmState::Running);
    let n = io_rounds(&src).len();
    wait_rounds(&src, n + 2);
    assert!(lent_to(&cluster, "vm-src"));

    api.pause().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let last = *io_rounds(&src).last().unwrap();
    let snap = cluster.file("snap");
    snapshot(&api, &snap).unwrap();
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(snap.join("state.json")).unwrap()).unwrap();
    let lent = doc["devices"]["lent"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["id"] == "nvme0")
        .unwrap_or_else(|| panic!("no nvme0 in {}", doc["devices"]));
    assert_eq!(lent["device"], format!("{LENDER}:{NVME_BDF}"), "{lent}");
    // Port 0 of the switch: bus index 1, slot number 32 (guest address 01:00.0).
    assert_eq!(lent["slot"], 32, "{lent}");
    assert_eq!(
        doc["config"]["switches"],
        serde_json::json!([{"lender": LENDER, "root": 0, "ports": 4}]),
        "{}",
        doc["config"]
    );
    assert!(
        lent["msix"]["table"].as_array().unwrap().len() >= 2,
        "{lent}"
    );
    // While the source still holds the lease, a restore cannot borrow the device: it fails
    // with a clear error and the source keeps its lease.
    let early_sock = cluster.file("early.sock").display().to_string();
    let url = format!("file://{}", snap.display());
    let mut early = Vm::start_args(
        &[
            "--restore",
            &url,
            "--cluster",
            &c,
            "--name",
            "vm-early",
            "--api-socket",
            &early_sock,
        ],
        "warn",
    );
    assert_eq!(
        early.wait_exit(T).and_then(|s| s.code()),
        Some(2),
        "{}",
        early.stderr()
    );
    assert!(
        early.stderr().contains("lent devices")
            && early.stderr().contains("device busy")
            && (early.stderr().contains(NVME_BDF) || early.stderr().contains(DMATEST_BDF)),
        "{}",
        early.stderr()
    );
    assert!(
        lent_to(&cluster, "vm-src"),
        "{:?}",
        cluster.device(NVME_BDF)
    );
    assert!(src.running());
    // SIGKILL the source: its lease goes with its link.
    let _ = src.wait_exit(Duration::ZERO);
    cluster.wait_available(NVME_BDF);
    cluster.wait_available(DMATEST_BDF);

    let dsock = cluster.file("dst.sock").display().to_string();
    let mut dst = Vm::start_args(
        &[
            "--restore",
            &url,
            "--cluster",
            &c,
            "--name",
            "vm-dst",
            "--api-socket",
            &dsock,
        ],
        "info",
    );
    dst.wait_api();
    let dapi = dst.api();
    assert_eq!(dapi.info().unwrap().state, VmState::Paused);
    // Re-borrowed by the new process before the guest runs.
    assert!(
        lent_to(&cluster, "vm-dst"),
        "{:?}",
        cluster.device(NVME_BDF)
    );
    assert!(
        dst.stderr().contains("guest PCI state re-applied"),
        "{}",
        dst.stderr()
    );
    // The same topology: both devices behind the rebuilt switch, at their old addresses.
    let info = dapi.info().unwrap();
    let sw = &info.config.switches;
    assert_eq!(
        sw.iter()
            .map(|s| format!("{} {} {} {}", s.lender, s.bridge, s.bus, s.ports))
            .collect::<Vec<_>>(),
        [format!("{LENDER} 0000:00:01.0 1 4")],
        "vm.info's switches"
    );
    let at: Vec<String> = info
        .remote_devices
        .iter()
        .map(|d| format!("{} {}", d.id, d.guest_bdf))
        .collect();
    assert_eq!(
        at,
        ["dma0 0000:01:01.0", "nvme0 0000:01:00.0"],
        "{}",
        dst.stderr()
    );
    assert!(
        dst.stderr().contains("pci: switch of lender"),
        "{}",
        dst.stderr()
    );
    dapi.resume().unwrap();
    dst.expect_line("NVME controller reset: reinitialising", T);
    let rounds = wait_rounds(&dst, 2);
    assert!(
        rounds.iter().all(|&r| r > last),
        "the guest restarted its count: {rounds:?} after {last}\n{}",
        dst.stdout()
    );
    assert!(
        !dst.stdout().contains("lendvm test guest"),
        "the guest rebooted"
    );
    dst.write_guest_u64(mailbox, 1);
    dst.expect_ok("nvme-loop", T);
    dst.expect_exit(0, T);
    eprintln!(
        "--- restored console\n{}--- restored stderr\n{}",
        dst.stdout(),
        dst.stderr()
    );
    cluster.wait_available(NVME_BDF);
    cluster.wait_available(DMATEST_BDF);
}
