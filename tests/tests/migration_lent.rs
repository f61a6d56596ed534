//! Live migration of a VM holding a lent NVMe (shm fabric): the device stays on its lender
//! and is never reset; only the borrower end moves (DMA window, interrupt targets, BARs).
//!
//! The guest runs `tests=nvme-loop` (tests/guest/src/nvmeloop.rs): every 50 ms it writes a
//! page to the lent NVMe, reads it back into a page only the device writes and verifies it
//! (`IO n ok ... irqs=i missed=m stale=s`): `missed` counts completions whose MSI-X never
//! came, `stale` rounds where the device-only page did not hold the previous round's data.
//!
//! * `live_migration_hands_the_lent_nvme_over_without_reset`: source and destination are
//!   two lendvm processes on the same host, migrating over a unix socket. Every round
//!   before, during and after verifies, their numbers go on with no gap, no interrupt is
//!   missed, the device-only page arrives with the device's data (the lender's dirty log
//!   reported pages the device wrote: `device_pages` > 0), the guest never sees a controller
//!   reset, the source exits 0 and the lender shows the lease held by the destination's VM.
//!   Hand-over events on both sides.
//! * `local_migration_shares_ram_and_hands_the_lent_nvme_over`: the same with the memfd
//!   fast path (`local: true`): guest RAM's memfd over SCM_RIGHTS, 0 bytes of RAM copied,
//!   and the lender keeps its DMA window (its log: the window is the same memory; the
//!   copying migration's is not).
//! * `live_migration_over_tcp_between_network_namespaces`: lenderd on the tcp fabric and the
//!   destination in one network namespace, the source in another, joined by a veth pair;
//!   migration over tcp with RAM copied under dirty tracking while the device keeps writing.
//! * `a_paused_vm_with_a_lent_nvme_arrives_paused_and_resumes_its_io`: paused before the
//!   migration, it arrives paused; after `vm.resume` its verified I/O goes on.
//! * `a_destination_killed_mid_transfer_leaves_the_source_its_device`: the destination is
//!   SIGKILLed once it has built the VM (RAM arriving): the source answers 500, keeps running with its device
//!   (rounds go on verified), the lease stays the source's; a second migration then works.
//! * `a_destination_dying_with_an_unused_ticket_leaves_the_source_its_lease`: a fake
//!   destination receives the state and the ticket, then closes the stream: the source
//!   withdraws the ticket, resumes the device (never reset) and runs on; the lease is its own.
//! * `a_destination_failing_after_taking_the_lease_orphans_nothing`: the fake destination
//!   takes the lease with the ticket, then fails: the source reports the device lost and runs
//!   on, the destination's lease ends with its link and the lender has the device back.
//! * `a_lender_killed_mid_handover_loses_the_device_not_the_vm`: lenderd is SIGKILLed while
//!   the destination holds the ticket (device quiesced, the source waiting for the verdict):
//!   the migration fails, the source VM keeps running (the device is reported lost, as on
//!   any lender death).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

use api::client::{ApiClient, ClientError};
use api::types::{VmReceiveMigrationData, VmSendMigrationData, VmState};
use common::*;

const T: Duration = BOOT_TIMEOUT;

/// One `IO n ok ...` line.
#[derive(Debug, Clone, Copy)]
struct Round {
    n: u64,
    missed: u64,
    stale: u64,
}

fn rounds_of(text: &str) -> Vec<Round> {
    text.lines()
        .filter_map(|l| {
            let (head, tail) = l.split_once(" ok reinits=")?;
            let n = head.rsplit(' ').next()?.parse().ok()?;
            Some(Round {
                n,
                missed: field(tail, "missed")?.parse().ok()?,
                stale: field(tail, "stale")?.parse().ok()?,
            })
        })
        .collect()
}

fn wait_rounds(text: impl Fn() -> String, count: usize, what: &str) -> Vec<Round> {
    poll(T, || {
        let r = rounds_of(&text());
        (r.len() >= count).then_some(r)
    })
    .unwrap_or_else(|| panic!("fewer than {count} verified NVMe rounds {what}\n{}", text()))
}

fn lent_to(cluster: &Cluster) -> Option<String> {
    cluster.lent_to(NVME_BDF)
}

fn events(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn status_of(r: Result<(), ClientError>) -> (u16, String) {
    match r {
        Err(ClientError::Status {
            status, message, ..
        }) => (status, message),
        other => panic!("expected an error status, got {other:?}"),
    }
}

struct Setup {
    cluster: Cluster,
    lender: Option<lending::testing::Lenderd>,
    src: Vm,
    mailbox: u64,
}

/// The source VM `vm-src` (64 MiB, the `nvme-loop` guest on the lender's NVMe, API socket
/// `src.sock`, events in `src-events.jsonl`).
fn start_source(cluster: &Cluster) -> Vm {
    let c = cluster.path.display().to_string();
    let sock = cluster.file("src.sock").display().to_string();
    let ev = format!("path={}", cluster.file("src-events.jsonl").display());
    let dev = format!("{LENDER}:{NVME_BDF},id=nvme0");
    let line = format!("tests=nvme-loop seed={SEED:#x} lba=16 period_ms=20");
    Vm::start_with_log(
        &cluster.memory("64M"),
        &[
            "--cluster",
            &c,
            "--name",
            "vm-src",
            "--remote-device",
            &dev,
            "--api-socket",
            &sock,
            "--event-monitor",
            &ev,
            "--cmdline",
            &line,
        ],
        "info",
    )
}

/// Waits until the source's API answers and its guest has verified 3 rounds; returns the
/// guest's mailbox address.
fn source_running(src: &Vm) -> u64 {
    src.wait_api();
    let mailbox = src.expect_line("MAILBOX ", T);
    let mailbox = u64::from_str_radix(mailbox.trim_start_matches("MAILBOX 0x").trim(), 16).unwrap();
    wait_rounds(|| src.stdout(), 3, "on the source");
    mailbox
}

fn setup() -> Setup {
    setup_on(Fabric::Shm)
}

fn setup_on(fabric: Fabric) -> Setup {
    let cluster = Cluster::new(fabric);
    let disk = cluster.file("disk.img");
    let lender =
        cluster.start_lenderd(&[format!("{NVME_BDF}=nvme:path={},size=4M", disk.display())]);
    let src = start_source(&cluster);
    let mailbox = source_running(&src);
    assert_eq!(lent_to(&cluster).as_deref(), Some("vm-src"));
    Setup {
        cluster,
        lender: Some(lender),
        src,
        mailbox,
    }
}

/// A lendvm with the cluster file and an API socket, listening at `<name>.mig`.
fn destination(cluster: &Cluster, name: &str) -> (Vm, String) {
    let c = cluster.path.display().to_string();
    let sock = cluster.file(&format!("{name}.sock")).display().to_string();
    let ev = format!(
        "path={}",
        cluster.file(&format!("{name}-events.jsonl")).display()
    );
    let vm_name = format!("vm-{name}");
    let mut args = vec![
        "--cluster",
        &c,
        "--name",
        &vm_name,
        "--api-socket",
        &sock,
        "--event-monitor",
        &ev,
    ];
    // On bar the destination's RAM must be in the region too, beside the source's (which
    // runs until the switch-over): the second 64 MiB.
    let memory = format!(
        "64M,shared={},offset=64M",
        cluster.file(&format!("{LENDER}.region")).display()
    );
    if cluster.fabric == Fabric::Bar {
        args.extend(["--memory", &memory]);
    }
    let vm = Vm::start_args(&args, "info");
    vm.wait_api();
    let url = format!("unix:{}", cluster.file(&format!("{name}.mig")).display());
    vm.api()
        .receive_migration(&VmReceiveMigrationData {
            receiver_url: url.clone(),
        })
        .unwrap();
    (vm, url)
}

fn send(api: &ApiClient, url: &str) -> Result<(), ClientError> {
    send_opt(api, url, false)
}

fn send_opt(api: &ApiClient, url: &str, local: bool) -> Result<(), ClientError> {
    api.send_migration(&VmSendMigrationData {
        destination_url: url.into(),
        local,
    })
}

/// The consoles of both processes as one text: a line the migration cut (its start printed
/// by the source, its end by the destination) is glued back.
fn joined(before: &[String], after: &[String]) -> String {
    let mut lines: Vec<String> = before.to_vec();
    let mut rest = after;
    if let (Some(l), Some(f)) = (before.last(), after.first()) {
        let glued = format!("{l}{f}");
        if rounds_of(l).is_empty() && rounds_of(f).is_empty() && rounds_of(&glued).len() == 1 {
            lines.pop();
            lines.push(glued);
            rest = &after[1..];
        }
    }
    lines.extend_from_slice(rest);
    let mut s = lines.join("\n");
    s.push('\n');
    s
}

/// Every round verified, numbered without gap or repeat, no interrupt missed, no stale
/// device-only page, no controller reset seen by the guest.
fn check_rounds(all: &str) {
    let rounds = rounds_of(all);
    for w in rounds.windows(2) {
        assert_eq!(w[1].n, w[0].n + 1, "gap or repeat: {w:?}\n{all}");
    }
    let last = rounds.last().unwrap();
    assert_eq!(last.missed, 0, "an interrupt was lost: {last:?}\n{all}");
    assert_eq!(
        last.stale, 0,
        "the device-only page went stale: {last:?}\n{all}"
    );
    assert!(!all.contains(" fail reinits="), "a round failed:\n{all}");
    assert!(
        !all.contains("NVME controller reset"),
        "the guest saw its controller reset:\n{all}"
    );
}

/// Migrates the source to a fresh destination `name` (`local`: the memfd fast path) and
/// checks the guest's verified I/O goes on with the same device, never reset.
fn migrate_and_check(s: Setup, name: &str, local: bool) -> (Cluster, Vm) {
    let Setup {
        cluster,
        lender,
        mut src,
        mailbox,
    } = s;
    let (mut dst, url) = destination(&cluster, name);
    send_opt(&src.api(), &url, local)
        .unwrap_or_else(|e| panic!("{e}\n--- source\n{}", src.stderr()));
    src.expect_exit(0, T);
    // The moved lease is the destination's: the source's teardown neither returns it nor
    // unmaps its DMA window on the lender.
    assert!(!src.stderr().contains("unknown lease"), "{}", src.stderr());
    let before = src.lines();
    let n_before = rounds_of(&src.stdout()).len();
    let all = || joined(&before, &dst.lines());
    wait_rounds(all, n_before + 5, "after the migration");
    check_rounds(&all());
    assert!(
        !dst.stdout().contains("lendvm test guest"),
        "the guest rebooted"
    );
    assert_eq!(dst.api().info().unwrap().state, VmState::Running);
    // The lender shows the lease held by the destination's VM.
    assert_eq!(
        lent_to(&cluster).as_deref(),
        Some(format!("vm-{name}").as_str())
    );

    // Events: the source quiesced, ticketed and moved the device; the destination took it.
    let sev = events(&cluster.file("src-events.jsonl"));
    let phases: Vec<&str> = sev
        .iter()
        .filter(|e| e["event"] == "migration-device-handover")
        .filter_map(|e| e["properties"]["phase"].as_str())
        .collect();
    assert!(
        phases.ends_with(&["quiesced", "ticket", "moved"]),
        "{phases:?}"
    );
    let device_pages: u64 = sev
        .iter()
        .filter(|e| e["event"] == "migration-memory-iteration")
        .filter_map(|e| e["properties"]["device_pages"].as_u64())
        .sum();
    let ram_bytes = sev
        .iter()
        .rfind(|e| e["event"] == "migration-completed")
        .and_then(|e| e["properties"]["ram_bytes"].as_u64());
    // The lender kept its DMA window(s) exactly when the destination's window is the
    // source's memory (the memfd fast path): no IOMMU unmap and map again.
    let lender_log = lender.as_ref().map(|l| l.log()).unwrap_or_default();
    let kept = lender_log
        .lines()
        .filter(|l| l.contains("dma window(s) across the transfer (same memory)"))
        .count();
    if local {
        // The memfd fast path copies nothing: the destination maps the same RAM.
        assert_eq!(ram_bytes, Some(0), "{sev:?}");
        assert!(
            dst.stderr().contains("guest ram shared through its memfd"),
            "{}",
            dst.stderr()
        );
        assert_eq!(kept, 1, "the lender kept the dma window:\n{lender_log}");
    } else {
        assert_eq!(kept, 0, "another memory: mapped again:\n{lender_log}");
        // The lender's device dirty log found pages only the device wrote.
        assert!(device_pages > 0, "no device-written pages reported");
        assert!(ram_bytes.unwrap() >= 64 << 20, "{sev:?}");
    }
    let dev = events(&cluster.file(&format!("{name}-events.jsonl")));
    assert!(
        dev.iter().any(|e| e["event"] == "migration-device-handover"
            && e["properties"]["phase"] == "taken-over"),
        "{dev:?}"
    );
    assert!(
        dst.stderr().contains("device not reset"),
        "{}",
        dst.stderr()
    );
    // Guest RAM was pinned before the source paused; Bus Master Enable took that pin.
    assert!(
        dst.stderr().contains("were pinned ahead"),
        "{}",
        dst.stderr()
    );

    eprintln!(
        "migrated: {} rounds before, {:?} last; device_pages {device_pages}; phases {phases:?}",
        n_before,
        rounds_of(&all()).last()
    );
    if cluster.fabric == Fabric::Bar {
        // The destination's RAM is the region's second 64 MiB.
        use std::os::unix::fs::FileExt;
        let region = std::fs::OpenOptions::new()
            .write(true)
            .open(cluster.file(&format!("{LENDER}.region")))
            .unwrap();
        region
            .write_all_at(&1u64.to_le_bytes(), (64 << 20) + mailbox)
            .unwrap();
    } else {
        dst.write_guest_u64(mailbox, 1);
    }
    dst.expect_ok("nvme-loop", T);
    dst.expect_exit(0, T);
    cluster.wait_available(NVME_BDF);
    drop(lender);
    (cluster, dst)
}

#[test]
fn live_migration_hands_the_lent_nvme_over_without_reset() {
    let s = setup();
    migrate_and_check(s, "dst", false);
}

/// Over the bar fabric: both VMs' RAM in the lender's shared region, at different offsets; the
/// lender maps the destination's window directly and moves the device's DMA onto it.
#[test]
fn live_migration_over_the_bar_fabric_moves_dma_to_the_destinations_region_range() {
    let s = setup_on(Fabric::Bar);
    let (cluster, _dst) = migrate_and_check(s, "dst", false);
    let log = std::fs::read_to_string(cluster.file("lenderd.log")).unwrap();
    let direct = log
        .lines()
        .filter(|l| l.contains("borrower window") && l.contains("mapped directly"))
        .count();
    assert!(
        direct >= 2,
        "the source's and the destination's RAM windows:\n{log}"
    );
}

/// The same with the memfd fast path: guest RAM's memfd goes over SCM_RIGHTS, nothing is
/// copied, and the device is handed over the same way.
#[test]
fn local_migration_shares_ram_and_hands_the_lent_nvme_over() {
    let s = setup();
    migrate_and_check(s, "dst", true);
}

/// A VM paused before the migration (its MSI-X vectors masked by the VMM, interrupts of the
/// command in flight waiting in the irqfds) arrives paused with its device; after
/// `vm.resume` on the destination its I/O goes on verified, no interrupt missed.
#[test]
fn a_paused_vm_with_a_lent_nvme_arrives_paused_and_resumes_its_io() {
    let Setup {
        cluster,
        lender: _lender,
        mut src,
        mailbox,
    } = setup();
    src.api().pause().unwrap();
    let (mut dst, url) = destination(&cluster, "dst");
    send(&src.api(), &url).unwrap_or_else(|e| panic!("{e}\n--- source\n{}", src.stderr()));
    src.expect_exit(0, T);
    let dapi = dst.api();
    assert_eq!(dapi.info().unwrap().state, VmState::Paused);
    assert_eq!(lent_to(&cluster).as_deref(), Some("vm-dst"));
    let before = src.lines();
    let n_before = rounds_of(&src.stdout()).len();
    dapi.resume().unwrap();
    let all = || joined(&before, &dst.lines());
    wait_rounds(all, n_before + 5, "after the resume on the destination");
    check_rounds(&all());
    dst.write_guest_u64(mailbox, 1);
    dst.expect_ok("nvme-loop", T);
    dst.expect_exit(0, T);
    cluster.wait_available(NVME_BDF);
}

#[test]
fn a_destination_killed_mid_transfer_leaves_the_source_its_device() {
    let s = setup();
    let (mut dst, url) = destination(&s.cluster, "killed");
    let pid = dst.pid();
    let sender = {
        let api = s.src.api();
        std::thread::spawn(move || send(&api, &url))
    };
    // Kill it as soon as guest RAM starts to arrive.
    let base = proc_status_kb(pid, "VmRSS");
    poll(T, || {
        (proc_status_kb(pid, "VmRSS") > base + 4096).then_some(())
    });
    let _ = dst.wait_exit(Duration::ZERO);
    let (st, msg) = status_of(sender.join().unwrap());
    assert_eq!(st, 500, "{msg}");
    assert!(msg.contains("migration failed"), "{msg}");
    // The source runs on with its device; the lease is still its own.
    let n = rounds_of(&s.src.stdout()).len();
    wait_rounds(|| s.src.stdout(), n + 5, "after the failed migration");
    check_rounds(&s.src.stdout());
    assert_eq!(s.src.api().info().unwrap().state, VmState::Running);
    assert_eq!(lent_to(&s.cluster).as_deref(), Some("vm-src"));
    // And it still migrates.
    migrate_and_check(s, "dst2", false);
}

#[test]
fn a_lender_killed_mid_handover_loses_the_device_not_the_vm() {
    let mut s = setup();
    // The destination has the state and the ticket (the device is quiesced, the source
    // waits for the verdict) when the lender dies; then the destination gives up.
    let p = s.cluster.file("fake.mig");
    let fake = fake_destination(&p, "node-x", "vm-x");
    let api = s.src.api();
    let url = format!("unix:{}", p.display());
    let sender = std::thread::spawn(move || send(&api, &url));
    let (state, stream) = fake.join().unwrap();
    ticket_of(&state);
    s.lender.as_mut().unwrap().kill();
    drop(stream);
    let (st, msg) = status_of(sender.join().unwrap());
    assert_eq!(st, 500, "{msg}");
    // The device is lost as on any lender death; the VM runs on here.
    poll(T, || {
        events(&s.cluster.file("src-events.jsonl"))
            .iter()
            .any(|e| e["event"] == "device-lost")
            .then_some(())
    })
    .expect("the source did not report the device lost");
    let mut src = s.src;
    assert!(src.running(), "the source vm died");
    assert_eq!(src.api().info().unwrap().state, VmState::Running);
    src.write_guest_u64(s.mailbox, 1);
    src.wait_exit(T).expect("the guest did not end when asked");
}

/// A fake destination speaking the migration stream: proves the cluster secret as
/// `node`/`vm` (it is a member of the cluster, as a real destination), answers the hello and
/// announces the same fabric identity, swallows the VM's RAM and returns the state document
/// (with the hand-over tickets) and the stream, without answering it.
fn fake_destination(
    path: &Path,
    node: &str,
    vm: &str,
) -> std::thread::JoinHandle<(serde_json::Value, UnixStream)> {
    let l = UnixListener::bind(path).unwrap();
    let identity = serde_json::to_vec(&serde_json::json!({ "node": node, "vm": vm })).unwrap();
    let (node, vm) = (node.to_string(), vm.to_string());
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let frame = |kind: u32, body: &[u8]| {
            let mut f = Vec::new();
            f.extend_from_slice(&kind.to_le_bytes());
            f.extend_from_slice(&0u32.to_le_bytes());
            f.extend_from_slice(&(body.len() as u64).to_le_bytes());
            f.extend_from_slice(body);
            f
        };
        let mut buf = vec![0u8; 8 << 20];
        loop {
            let mut h = [0u8; 16];
            s.read_exact(&mut h).unwrap();
            let kind = u32::from_le_bytes(h[0..4].try_into().unwrap());
            let len = u64::from_le_bytes(h[8..16].try_into().unwrap()) as usize;
            let body = &mut buf[..len];
            s.read_exact(body).unwrap();
            match kind {
                // AUTH: prove the secret (no TLS on a unix socket: an empty binding).
                9 => {
                    let a: serde_json::Value = serde_json::from_slice(body).unwrap();
                    let bytes = |v: &serde_json::Value| -> Vec<u8> {
                        v.as_array()
                            .unwrap()
                            .iter()
                            .map(|b| b.as_u64().unwrap() as u8)
                            .collect()
                    };
                    let theirs = bytes(&a["nonce"]);
                    let ours = lending::auth::nonce().unwrap();
                    let source = a["node"].as_str().unwrap_or_default().to_string();
                    let me = format!("{node}/{vm}");
                    let proof = lending::auth::Transcript {
                        borrower_nonce: &theirs,
                        lender_nonce: &ours,
                        borrower: &source,
                        lender: &me,
                        binding: &[],
                    }
                    .prove(TOKEN, lending::auth::Role::MigrationDestination)
                    .unwrap();
                    let reply = serde_json::to_vec(&serde_json::json!({
                        "node": node, "vm": vm, "nonce": ours.to_vec(), "proof": proof.to_vec()
                    }))
                    .unwrap();
                    s.write_all(&frame(10, &reply)).unwrap();
                }
                // AUTH_PROOF: taken.
                11 => s.write_all(&frame(2, &[])).unwrap(),
                1 => {
                    s.write_all(&frame(2, &[])).unwrap();
                    s.write_all(&frame(7, &identity)).unwrap();
                }
                4 => s.write_all(&frame(2, &[])).unwrap(),
                5 => {}
                6 => return (serde_json::from_slice(body).unwrap(), s),
                other => panic!("unexpected frame {other}"),
            }
        }
    })
}

/// The source's one lent device has a hand-over ticket in `state`; returns (lease, ticket).
fn ticket_of(state: &serde_json::Value) -> (u64, Vec<u8>) {
    let h = &state["handover"][0];
    assert_eq!(h["id"], "nvme0", "{state}");
    let ticket: Vec<u8> = h["ticket"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap() as u8)
        .collect();
    assert_eq!(ticket.len(), 32, "{h}");
    (h["lease"].as_u64().unwrap(), ticket)
}

/// The destination dies after it received the ticket, without using it: the source
/// withdraws the ticket, resumes the device and runs on with it; the lease is still its own
/// and the device was never reset.
#[test]
fn a_destination_dying_with_an_unused_ticket_leaves_the_source_its_lease() {
    let s = setup();
    let p = s.cluster.file("fake.mig");
    let fake = fake_destination(&p, "node-x", "vm-x");
    let api = s.src.api();
    let url = format!("unix:{}", p.display());
    let sender = std::thread::spawn(move || send(&api, &url));
    let (state, stream) = fake.join().unwrap();
    ticket_of(&state);
    drop(stream);
    let (st, msg) = status_of(sender.join().unwrap());
    assert_eq!(st, 500, "{msg}");
    let n = rounds_of(&s.src.stdout()).len();
    wait_rounds(|| s.src.stdout(), n + 5, "after the abandoned hand-over");
    check_rounds(&s.src.stdout());
    assert_eq!(lent_to(&s.cluster).as_deref(), Some("vm-src"));
    let phases: Vec<String> = events(&s.cluster.file("src-events.jsonl"))
        .iter()
        .filter(|e| e["event"] == "migration-device-handover")
        .filter_map(|e| e["properties"]["phase"].as_str().map(str::to_string))
        .collect();
    assert_eq!(phases, ["quiesced", "ticket", "cancelled"], "{phases:?}");
    migrate_and_check(s, "dst", true);
}

/// The destination takes the lease with the ticket and then fails before acknowledging:
/// the source cannot withdraw the ticket any more, reports the device lost (ordinary
/// surprise removal) and keeps running; the destination's lease ends with its link, so the
/// lender has the device back: no lease is orphaned.
#[test]
fn a_destination_failing_after_taking_the_lease_orphans_nothing() {
    let s = setup();
    let p = s.cluster.file("fake.mig");
    let fake = fake_destination(&p, "node-x", "vm-x");
    let api = s.src.api();
    let url = format!("unix:{}", p.display());
    let sender = std::thread::spawn(move || send(&api, &url));
    let (state, stream) = fake.join().unwrap();
    let (lease, ticket) = ticket_of(&state);
    {
        let lender = s.cluster.cfg.node(LENDER).unwrap();
        let client = lending::client::LenderClient::connect_node(
            &s.cluster.cfg,
            lender,
            &ntb::NodeId::new("node-x").unwrap(),
            Duration::from_secs(5),
            TOKEN,
            "fake-destination",
        )
        .unwrap();
        let t = lending::protocol::TransferTicket {
            lease,
            ticket,
            expires_in_ms: 0,
        };
        let taken = client.accept_transfer(&t, "vm-x", &[], &[]).unwrap();
        assert_eq!(lent_to(&s.cluster).as_deref(), Some("vm-x"));
        // The fake destination fails: it says so and lets go of everything.
        drop(stream);
        drop(taken);
    }
    let (st, msg) = status_of(sender.join().unwrap());
    assert_eq!(st, 500, "{msg}");
    poll(T, || {
        events(&s.cluster.file("src-events.jsonl"))
            .iter()
            .any(|e| e["event"] == "device-lost")
            .then_some(())
    })
    .expect("the source did not report the moved device lost");
    s.cluster.wait_available(NVME_BDF);
    let mut src = s.src;
    assert!(src.running(), "the source vm died");
    assert_eq!(src.api().info().unwrap().state, VmState::Running);
    src.write_guest_u64(s.mailbox, 1);
    src.wait_exit(T).expect("the guest did not end when asked");
}

// ---- tcp between two network namespaces --------------------------------------------------

fn ip(args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Network namespaces this test made; deleted on drop (with their veth ends), also when the
/// test panics.
struct Netns(Vec<String>);

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.0 {
            if let Err(e) = ip(&["netns", "del", n]) {
                eprintln!("migration_lent: cannot delete network namespace {n}: {e}");
            }
        }
    }
}

/// Runs `f` on a thread inside network namespace `ns` (its sockets and children live there).
fn in_netns<R: Send>(ns: &str, f: impl FnOnce() -> R + Send) -> R {
    lending::directory::testing::in_netns(Some(ns), f)
}

/// Over tcp between two network namespaces joined by a veth pair: lenderd (tcp fabric) and
/// the destination lendvm in namespace A (169.254.79.1), the source lendvm in B
/// (169.254.79.2). The migration stream and the source's lender link cross the veth; guest
/// RAM is copied with dirty tracking while the device keeps writing (interrupts relayed as
/// messages on the tcp fabric). Every round verifies, no interrupt is missed, the page only
/// the device writes arrives with its data, the lender shows the lease at the destination.
#[test]
fn live_migration_over_tcp_between_network_namespaces() {
    let id = std::process::id() % 100_000;
    let (na, nb) = (format!("lmA{id}"), format!("lmB{id}"));
    let (va, vb) = (format!("vlmA{id}"), format!("vlmB{id}"));
    let mut ns = Netns(Vec::new());
    for n in [&na, &nb] {
        ip(&["netns", "add", n]).unwrap_or_else(|e| panic!("network namespaces: {e}"));
        ns.0.push(n.clone());
    }
    ip(&[
        "link", "add", &va, "netns", &na, "type", "veth", "peer", "name", &vb, "netns", &nb,
    ])
    .unwrap();
    for (n, v, a) in [(&na, &va, "169.254.79.1/24"), (&nb, &vb, "169.254.79.2/24")] {
        ip(&["-n", n, "addr", "add", a, "dev", v]).unwrap();
        ip(&["-n", n, "link", "set", v, "up"]).unwrap();
        ip(&["-n", n, "link", "set", "lo", "up"]).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let src_cfg = format!(
        "version = 1\ntoken = \"{TOKEN}\"\n\
         [link]\nheartbeat_ms = 250\npeer_timeout_ms = 5000\nconnect_timeout_ms = 3000\n\
         [[node]]\nname = \"{LENDER}\"\nfabric = \"tcp\"\ncontrol = \"169.254.79.1:7781\"\n"
    );
    let path = dir.path().join("cluster.toml");
    ntb::config::write_private_file(&path, &src_cfg).unwrap();
    let cluster = Cluster {
        cfg: ntb::ClusterConfig::load(&path).unwrap(),
        path,
        dir,
        fabric: Fabric::Tcp,
    };
    let disk = cluster.file("disk.img");
    let nvme = format!("{NVME_BDF}=nvme:path={},size=4M", disk.display());
    let _lender = in_netns(&na, || cluster.start_lenderd(std::slice::from_ref(&nvme)));
    let mut src = in_netns(&nb, || start_source(&cluster));
    let mailbox = source_running(&src);
    let lent = || in_netns(&na, || lent_to(&cluster));
    assert_eq!(lent().as_deref(), Some("vm-src"));

    let c = cluster.path.display().to_string();
    let (dsock, dev_ev) = (
        cluster.file("dst.sock").display().to_string(),
        format!("path={}", cluster.file("dst-events.jsonl").display()),
    );
    let mut dst = in_netns(&na, || {
        Vm::start_args(
            &[
                "--cluster",
                &c,
                "--name",
                "vm-dst",
                "--api-socket",
                &dsock,
                "--event-monitor",
                &dev_ev,
            ],
            "info",
        )
    });
    dst.wait_api();
    let url = "tcp:169.254.79.1:7791";
    dst.api()
        .receive_migration(&VmReceiveMigrationData {
            receiver_url: url.into(),
        })
        .unwrap();
    send(&src.api(), url).unwrap_or_else(|e| panic!("{e}\n--- source\n{}", src.stderr()));
    src.expect_exit(0, T);
    let before = src.lines();
    let n_before = rounds_of(&src.stdout()).len();
    let all = || joined(&before, &dst.lines());
    wait_rounds(all, n_before + 5, "after the migration over tcp");
    check_rounds(&all());
    assert_eq!(lent().as_deref(), Some("vm-dst"));
    let sev = events(&cluster.file("src-events.jsonl"));
    let device_pages: u64 = sev
        .iter()
        .filter(|e| e["event"] == "migration-memory-iteration")
        .filter_map(|e| e["properties"]["device_pages"].as_u64())
        .sum();
    assert!(
        device_pages > 0,
        "no device-written pages reported: {sev:?}"
    );
    assert!(
        dst.stderr().contains("device not reset"),
        "{}",
        dst.stderr()
    );
    dst.write_guest_u64(mailbox, 1);
    dst.expect_ok("nvme-loop", T);
    dst.expect_exit(0, T);
    in_netns(&na, || cluster.wait_available(NVME_BDF));
}

/// A lent NVMe borrowed under an etcd claim (the lender lends only under current claims,
/// fenced by the claim's revision) migrates with its claim: the destination takes the claim
/// over with the lease (same revision, its own etcd lease), so the source's exit, which
/// releases the source's etcd lease, leaves the claim and the lease in place. The guest's
/// verified I/O goes on past the directory's lease TTL.
#[test]
fn a_device_under_an_etcd_claim_migrates_with_its_claim() {
    use lending::directory::testing::EtcdCluster;
    const TTL_S: u64 = 2;
    let etcd = EtcdCluster::start(1);
    let dir = tempfile::tempdir().unwrap();
    let file = directory_file(dir.path(), &etcd, TTL_S, "");
    let fc = file.display().to_string();
    let lsock = dir.path().join("node1.sock");
    let disk = dir.path().join("disk.img");
    let _lender = Lenderd::command(binary("lenderd"), LENDER, &file)
        .log(dir.path().join("lenderd.log"))
        .arg("--control")
        .arg(&lsock)
        .device(format!("{NVME_BDF}=nvme:path={},size=4M", disk.display()))
        .spawn_until_listening(&lsock);
    let (directory, _) = lending::directory::open(
        &fc,
        lending::directory::static_file::FanOut {
            local: "migration-test".into(),
            token: TOKEN.into(),
            client: "migration-test".into(),
            connect_timeout: Duration::from_secs(2),
        },
    )
    .unwrap();
    let claimed_by = || {
        directory
            .snapshot()
            .unwrap()
            .claim(LENDER, NVME_BDF)
            .map(|c| (c.record.vm.clone(), c.revision))
    };
    // The lender registers right after it listens.
    let registered = poll(Duration::from_secs(10), || {
        directory
            .snapshot()
            .ok()
            .filter(|s| s.devices.iter().any(|d| d.device.id == NVME_BDF))
    });
    assert!(registered.is_some(), "the lender never registered its NVMe");

    let (src_sock, dst_sock) = (dir.path().join("src.sock"), dir.path().join("dst.sock"));
    let dev = format!("{LENDER}:{NVME_BDF},id=nvme0");
    let line = format!("tests=nvme-loop seed={SEED:#x} lba=16 period_ms=20");
    let mut src = Vm::start_with_log(
        "64M",
        &[
            "--cluster",
            &fc,
            "--name",
            "vm-src",
            "--remote-device",
            &dev,
            "--api-socket",
            &src_sock.display().to_string(),
            "--cmdline",
            &line,
        ],
        "info",
    );
    source_running(&src);
    let (vm, revision) = claimed_by().expect("the source's claim");
    assert_eq!(vm, "vm-src");

    // A destination without the directory cannot take the claim over: refused before the
    // ticket is used, so the source keeps its device and its claim.
    let plain = dir.path().join("plain.toml");
    ntb::config::write_private_file(
        &plain,
        &format!(
            "version = 1\ntoken = \"{TOKEN}\"\n[[node]]\nname = \"{LENDER}\"\nfabric = \"shm\"\n\
             control = \"{}\"\n",
            lsock.display()
        ),
    )
    .unwrap();
    let nodir_sock = dir.path().join("nodir.sock");
    let nodir = Vm::start_args(
        &[
            "--cluster",
            &plain.display().to_string(),
            "--name",
            "vm-nodir",
            "--api-socket",
            &nodir_sock.display().to_string(),
        ],
        "info",
    );
    nodir.wait_api();
    let nodir_url = format!("unix:{}", dir.path().join("nodir.mig").display());
    nodir
        .api()
        .receive_migration(&VmReceiveMigrationData {
            receiver_url: nodir_url.clone(),
        })
        .unwrap();
    let e = send(&src.api(), &nodir_url).unwrap_err().to_string();
    assert!(
        e.contains("claim"),
        "{e}\n--- destination\n{}",
        nodir.stderr()
    );
    drop(nodir);
    assert_eq!(src.api().info().unwrap().state, VmState::Running);
    assert_eq!(claimed_by(), Some(("vm-src".to_string(), revision)));
    let n = rounds_of(&src.stdout()).len();
    wait_rounds(|| src.stdout(), n + 3, "on the source after the refusal");

    let dst = Vm::start_args(
        &[
            "--cluster",
            &fc,
            "--name",
            "vm-dst",
            "--api-socket",
            &dst_sock.display().to_string(),
        ],
        "info",
    );
    dst.wait_api();
    let url = format!("unix:{}", dir.path().join("dst.mig").display());
    dst.api()
        .receive_migration(&VmReceiveMigrationData {
            receiver_url: url.clone(),
        })
        .unwrap();
    send(&src.api(), &url).unwrap_or_else(|e| {
        panic!(
            "{e}\n--- source\n{}\n--- destination\n{}",
            src.stderr(),
            dst.stderr()
        )
    });
    src.expect_exit(0, T);
    // Same claim (the lender's fencing token), now the destination's.
    assert_eq!(
        claimed_by(),
        Some(("vm-dst".to_string(), revision)),
        "--- source\n{}\n--- destination\n{}",
        src.stderr(),
        dst.stderr()
    );
    // Past the directory TTL the source's released etcd lease has taken nothing with it:
    // the claim stands, the lender has not ended the lease, the guest's I/O goes on.
    let before = src.lines();
    let n = rounds_of(&dst.stdout()).len();
    std::thread::sleep(Duration::from_secs(2 * TTL_S + 1));
    let all = || joined(&before, &dst.lines());
    wait_rounds(|| dst.stdout(), n + 5, "after the TTL");
    check_rounds(&all());
    assert_eq!(claimed_by(), Some(("vm-dst".to_string(), revision)));
    let info = dst.api().info().unwrap();
    assert_eq!(info.state, VmState::Running);
    assert!(
        info.remote_devices
            .iter()
            .all(|d| d.lease_state == api::types::LeaseState::Active),
        "{info:?}"
    );
}
