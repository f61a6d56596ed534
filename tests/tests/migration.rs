//! Live migration between two `lendvm` processes over a Unix socket (no lent devices). The
//! guest is the bare-metal test guest in `tests=ticker` mode (tests/guest/src/ticker.rs:
//! `TICK n ticks=t marker=ok` every 50 ms, a 4 KiB memory marker checked each time; with
//! `churn=1` it keeps rewriting 2 MiB between ticks and checks every word it overwrites).
//!
//! * `live_migration_continues_the_ticker_exactly`: the destination is a `lendvm` started
//!   with only `--api-socket`, told `vm.receive-migration`; the source is told
//!   `vm.send-migration`, answers once the destination has the VM and exits 0. The guest's
//!   output across both processes counts up by one with no gap and no repeat, its marker is
//!   intact, it did not reboot, and the host's mailbox write into the destination's RAM
//!   ends it. Source events: started, iterations (round 0 = all RAM), completed.
//! * `a_guest_dirtying_memory_during_precopy_arrives_intact`: `churn=1`: precopy needs
//!   dirty rounds (KVM's dirty log finds the rewritten pages), and the guest on the
//!   destination finds every word of its 2 MiB buffer as it left it (`churn=ok`, its
//!   generation goes on).
//! * `a_paused_vm_arrives_paused`: and stays paused until `vm.resume` on the destination.
//! * `live_migration_over_tcp_with_lendctl`: loopback TCP, driven by `lendctl`; both VMMs
//!   hold the cluster secret (`--token`), which a tcp migration needs.
//! * `a_wrong_secret_source_is_refused_and_the_destination_goes_on_listening`: over tcp, a
//!   source with another secret is refused (500 naming it, and it runs on); the destination
//!   goes on listening, takes a source with the right secret, and then stops listening.
//! * `a_migrated_vm_keeps_its_console_configuration`: a source writing its console to a file
//!   migrates to a destination started without `--serial`: the guest's output goes on in the
//!   same file (appended, nothing before lost), none on the destination's stdout; a further
//!   migration to a destination whose own `--serial stdout` overrides it moves the console
//!   there.
//! * `a_relay_in_the_middle_sees_no_guest_ram`: a plain tcp relay between the two records
//!   every byte; the migration succeeds through it, and the guest's marker pattern is
//!   nowhere in what it relayed (the stream runs inside TLS).
//! * `failed_migrations_leave_the_source_running`: bad urls (400 naming them; a tcp url
//!   without the cluster secret, 400 naming it), nobody
//!   listening, a destination that refuses the version, a destination that dies after
//!   1 MiB of RAM, and a real destination lendvm SIGKILLed mid-transfer: each time the
//!   source answers 500 naming the cause, emits `migration-failed`, and keeps running and
//!   ticking; a real destination refuses a hello of a future version naming both. Then a
//!   migration of the same source succeeds.

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

/// (n, ticks, line) of every `TICK` line of `text`.
fn ticks_of(text: &str) -> Vec<(u64, u64, String)> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("TICK ")?;
            let (n, tail) = rest.split_once(" ticks=")?;
            let t = tail.split(' ').next()?.parse().ok()?;
            Some((n.parse().ok()?, t, l.to_string()))
        })
        .collect()
}

fn wait_ticks(vm: &Vm, count: usize) -> usize {
    poll(T, || {
        let n = ticks_of(&vm.stdout()).len();
        (n >= count).then_some(n)
    })
    .unwrap_or_else(|| {
        panic!(
            "fewer than {count} TICK lines\n--- console\n{}--- stderr\n{}",
            vm.stdout(),
            vm.stderr()
        )
    })
}

fn boot(dir: &Path, extra: &str) -> Vm {
    boot_with(dir, extra, "64M")
}

fn boot_with(dir: &Path, extra: &str, memory: &str) -> Vm {
    let line = format!("tests=ticker seed={SEED} period_ms=50{extra}");
    Vm::start_source(dir, memory, "src-events.jsonl", &line)
}

/// A lendvm with only an API socket, told to listen at `dir/<name>.mig`.
fn destination(dir: &Path, name: &str) -> (Vm, String) {
    let sock = dir.join(format!("{name}.sock")).display().to_string();
    let events = format!(
        "path={}",
        dir.join(format!("{name}-events.jsonl")).display()
    );
    let vm = Vm::start_args(&["--api-socket", &sock, "--event-monitor", &events], "warn");
    vm.wait_api();
    let url = format!("unix:{}", dir.join(format!("{name}.mig")).display());
    vm.api()
        .receive_migration(&VmReceiveMigrationData {
            receiver_url: url.clone(),
        })
        .unwrap();
    (vm, url)
}

/// A source VM (as `boot`) holding the cluster secret `token`, its API on `dir/src.sock`.
fn source_with_token(dir: &Path, token: &str) -> Vm {
    std::fs::create_dir_all(dir).unwrap();
    let sock = dir.join("src.sock").display().to_string();
    let line = format!("tests=ticker seed={SEED} period_ms=50");
    let vm = Vm::start(
        "64M",
        &[
            "--cpus",
            "2",
            "--api-socket",
            &sock,
            "--cmdline",
            &line,
            "--token",
            token,
        ],
    );
    vm.wait_api();
    vm
}

/// A free loopback port (the tiny window before lendvm binds it is harmless here).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A destination lendvm holding `token`, listening on a loopback tcp port.
fn tcp_destination(dir: &Path, token: &str) -> (Vm, String) {
    let sock = dir.join("dst.sock").display().to_string();
    let vm = Vm::start_args(&["--api-socket", &sock, "--token", token], "info");
    vm.wait_api();
    let url = format!("tcp:127.0.0.1:{}", free_port());
    vm.api()
        .receive_migration(&VmReceiveMigrationData {
            receiver_url: url.clone(),
        })
        .unwrap();
    (vm, url)
}

fn send(api: &ApiClient, url: &str) -> Result<(), ClientError> {
    api.send_migration(&VmSendMigrationData {
        destination_url: url.into(),
        local: false,
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

fn events(dir: &Path, file: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join(file))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn named<'a>(evs: &'a [serde_json::Value], name: &str) -> Vec<&'a serde_json::Value> {
    evs.iter().filter(|e| e["event"] == name).collect()
}

/// Migrates `src` to a fresh destination and checks the guest's count goes on exactly.
/// Returns the destination and both consoles joined.
fn migrate_and_check(dir: &Path, src: Vm, mailbox: u64) -> (Vm, String) {
    let (dst, url) = destination(dir, "dst");
    send(&src.api(), &url).unwrap();
    check_migrated(src, dst, mailbox)
}

/// The guest's console across both processes: the destination's output continues the
/// source's; if it does not start with a `TICK` line, it is the rest of the line the
/// migration cut (the source's last line is glued to it).
fn continued(before: &str, after: &str) -> String {
    match before.strip_suffix('\n') {
        Some(b) if !after.is_empty() && !after.starts_with("TICK ") => format!("{b}{after}"),
        _ => format!("{before}{after}"),
    }
}

/// The source exited 0 and the destination goes on exactly where it left off.
fn check_migrated(mut src: Vm, mut dst: Vm, mailbox: u64) -> (Vm, String) {
    src.expect_exit(0, T);
    let before = src.stdout();
    let n_before = ticks_of(&before).len();
    assert!(n_before >= 3, "{before}");
    // The destination goes on printing (a line the migration cut continues there).
    poll(T, || {
        (ticks_of(&continued(&before, &dst.stdout())).len() >= n_before + 3).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "the migrated guest does not tick\n--- console\n{}--- stderr\n{}",
            dst.stdout(),
            dst.stderr()
        )
    });
    let all = continued(&before, &dst.stdout());
    let ticks = ticks_of(&all);
    for w in ticks.windows(2) {
        assert_eq!(
            w[1].0,
            w[0].0 + 1,
            "gap or repeat: {:?} then {:?}",
            w[0],
            w[1]
        );
        assert!(w[1].1 > w[0].1, "the LAPIC tick went back: {w:?}");
    }
    assert!(!all.contains("marker=bad"), "marker damaged:\n{all}");
    assert!(
        !dst.stdout().contains("lendvm test guest"),
        "the guest rebooted on the destination"
    );
    let info = dst.api().info().unwrap();
    assert_eq!(info.state, VmState::Running);
    assert_eq!(info.config.cpus, 2);
    // The guest's RAM lives in the destination now: the mailbox write there ends it.
    dst.write_guest_u64(mailbox, 1);
    dst.expect_ok("ticker", T);
    dst.expect_exit(0, T);
    let all = continued(&before, &dst.stdout());
    (dst, all)
}

fn mailbox_of(vm: &Vm) -> u64 {
    let l = vm.expect_line("MAILBOX ", T);
    u64::from_str_radix(l.trim_start_matches("MAILBOX 0x").trim(), 16).unwrap()
}

#[test]
fn live_migration_continues_the_ticker_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let src = boot(dir.path(), "");
    let mailbox = mailbox_of(&src);
    wait_ticks(&src, 3);
    let (_dst, _) = migrate_and_check(dir.path(), src, mailbox);

    let evs = events(dir.path(), "src-events.jsonl");
    let order: Vec<&str> = evs
        .iter()
        .filter_map(|e| e["event"].as_str())
        .filter(|e| e.starts_with("migration-"))
        .collect();
    assert_eq!(order.first(), Some(&"migration-started"), "{order:?}");
    assert_eq!(order.last(), Some(&"migration-completed"), "{order:?}");
    let iters = named(&evs, "migration-memory-iteration");
    assert!(iters.len() >= 2, "{iters:?}");
    // Round 0 is all of RAM.
    assert_eq!(iters[0]["properties"]["round"], 0);
    assert_eq!(iters[0]["properties"]["pages"], (64 << 20) / 4096);
    let done = named(&evs, "migration-completed");
    assert!(done[0]["properties"]["ram_bytes"].as_u64().unwrap() >= 64 << 20);
    let dst_evs = events(dir.path(), "dst-events.jsonl");
    assert_eq!(named(&dst_evs, "vm-migrated").len(), 1, "{dst_evs:?}");
}

fn lendctl(socket: &Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(binary("lendctl"))
        .arg("--api-socket")
        .arg(socket)
        .args(args)
        .output()
        .unwrap()
}

/// The same over TCP on the loopback, driven by `lendctl receive-migration` and
/// `lendctl send-migration`.
#[test]
fn live_migration_over_tcp_with_lendctl() {
    let dir = tempfile::tempdir().unwrap();
    let src = source_with_token(dir.path(), "migration-test-secret-0123456789abcdef");
    let mailbox = mailbox_of(&src);
    wait_ticks(&src, 3);
    let dsock = dir.path().join("dst.sock");
    let url = format!("tcp:127.0.0.1:{}", free_port());
    // Without the cluster secret a tcp migration is refused up front, naming what is missing.
    let bare = Vm::start_args(
        &[
            "--api-socket",
            dir.path().join("bare.sock").to_str().unwrap(),
        ],
        "warn",
    );
    bare.wait_api();
    let out = lendctl(&dir.path().join("bare.sock"), &["receive-migration", &url]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("needs the cluster secret"),
        "{out:?}"
    );
    drop(bare);
    let dst = Vm::start_args(
        &[
            "--api-socket",
            dsock.to_str().unwrap(),
            "--token",
            "migration-test-secret-0123456789abcdef",
        ],
        "warn",
    );
    dst.wait_api();
    // No vm yet: anything but receive-migration (and ping, shutdown) is refused.
    let (st, msg) = status_of(dst.api().info().map(|_| ()));
    assert_eq!(st, 409, "{msg}");
    assert!(msg.contains("waits for vm.receive-migration"), "{msg}");
    let out = lendctl(&dsock, &["receive-migration", &url]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("listening"),
        "{out:?}"
    );
    // A second receive on the same VMM is refused.
    let again = lendctl(&dsock, &["receive-migration", &url]);
    assert_eq!(again.status.code(), Some(1), "{again:?}");
    let out = lendctl(&dir.path().join("src.sock"), &["send-migration", &url]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("vm migrated to {url}")), "{text}");
    check_migrated(src, dst, mailbox);
}

#[test]
fn a_guest_dirtying_memory_during_precopy_arrives_intact() {
    let dir = tempfile::tempdir().unwrap();
    let src = boot(dir.path(), " churn=1");
    let mailbox = mailbox_of(&src);
    wait_ticks(&src, 3);
    let (_dst, all) = migrate_and_check(dir.path(), src, mailbox);
    let ticks = ticks_of(&all);
    assert!(
        ticks.iter().all(|t| t.2.contains("churn=ok")),
        "a churned word was wrong after the migration:\n{all}"
    );
    // The churn went on (the guest kept rewriting on the destination): generation and word.
    let progress = |l: &str| -> (u64, u64) {
        (
            field(l, "gen").unwrap().parse().unwrap(),
            field(l, "pos").unwrap().parse().unwrap(),
        )
    };
    for w in ticks.windows(2) {
        assert!(
            progress(&w[1].2) > progress(&w[0].2),
            "churn stood still: {w:?}"
        );
    }
    // Precopy found the rewritten pages through KVM's dirty log: at least one dirty round
    // (after round 0) carried pages.
    let evs = events(dir.path(), "src-events.jsonl");
    let iters = named(&evs, "migration-memory-iteration");
    let dirty: u64 = iters
        .iter()
        .filter(|e| e["properties"]["round"].as_u64().unwrap() >= 1)
        .map(|e| e["properties"]["pages"].as_u64().unwrap())
        .sum();
    assert!(iters.len() >= 3 && dirty > 0, "{iters:?}");
}

/// A fake destination: answers the hello with `answer` (ACK or REFUSED), then reads up to
/// `read` bytes and drops the connection.
fn fake_destination(
    path: &Path,
    refuse: Option<&str>,
    read: usize,
    late_refusal: Option<&str>,
) -> std::thread::JoinHandle<()> {
    let l = UnixListener::bind(path).unwrap();
    let refuse = refuse.map(str::to_string);
    let late = late_refusal.map(str::to_string);
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut h = [0u8; 16];
        s.read_exact(&mut h).unwrap();
        assert_eq!(
            u32::from_le_bytes(h[0..4].try_into().unwrap()),
            1,
            "hello first"
        );
        let len = u64::from_le_bytes(h[8..16].try_into().unwrap()) as usize;
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).unwrap();
        let hello: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(hello["magic"], "lendvm-migration");
        let frame = |kind: u32, body: &[u8]| {
            let mut f = Vec::new();
            f.extend_from_slice(&kind.to_le_bytes());
            f.extend_from_slice(&0u32.to_le_bytes());
            f.extend_from_slice(&(body.len() as u64).to_le_bytes());
            f.extend_from_slice(body);
            f
        };
        match &refuse {
            Some(reason) => {
                let b = serde_json::to_vec(&serde_json::json!({ "reason": reason })).unwrap();
                s.write_all(&frame(3, &b)).unwrap();
            }
            None => {
                s.write_all(&frame(2, &[])).unwrap();
                // IDENTITY (protocol version 2): no fabric identity, no lent devices taken;
                // then ACK for the CONFIG to come (the vm is built).
                s.write_all(&frame(7, b"{}")).unwrap();
                s.write_all(&frame(2, &[])).unwrap();
                let mut got = 0;
                let mut buf = vec![0u8; 64 << 10];
                while got < read {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got += n,
                    }
                }
                if let Some(reason) = &late {
                    let b = serde_json::to_vec(&serde_json::json!({ "reason": reason })).unwrap();
                    s.write_all(&frame(3, &b)).unwrap();
                }
            }
        }
        // Dropping `s` is the destination dying.
    })
}

#[test]
fn failed_migrations_leave_the_source_running() {
    let dir = tempfile::tempdir().unwrap();
    // 512 MiB, so that the transfer to the destination killed below takes a while.
    let src = boot_with(dir.path(), "", "512M");
    let mailbox = mailbox_of(&src);
    let api = src.api();
    wait_ticks(&src, 2);
    let keeps_running = |what: &str| {
        assert_eq!(api.info().unwrap().state, VmState::Running, "{what}");
        let n = ticks_of(&src.stdout()).len();
        wait_ticks(&src, n + 2);
    };
    // The event monitor's file is written by its own thread: wait for the count.
    let failed_events = |want: usize| {
        let n = poll(T, || {
            let n = named(&events(dir.path(), "src-events.jsonl"), "migration-failed").len();
            (n >= want).then_some(n)
        });
        assert_eq!(n, Some(want), "migration-failed events");
    };

    // Bad urls: 400 naming them, nothing started.
    for (url, want) in [
        ("ftp://host/x", "scheme 'ftp'"),
        ("unix:relative.sock", "absolute"),
        ("tcp:127.0.0.1", "no port"),
    ] {
        let (st, msg) = status_of(send(&api, url));
        assert_eq!(st, 400, "{url}: {msg}");
        assert!(msg.contains(url) && msg.contains(want), "{url}: {msg}");
    }
    // Over tcp without the cluster secret: 400 naming it, nothing started.
    let (st, msg) = status_of(send(&api, "tcp:127.0.0.1:9"));
    assert_eq!(st, 400, "{msg}");
    assert!(msg.contains("needs the cluster secret"), "{msg}");
    std::thread::sleep(Duration::from_millis(100));
    assert!(named(&events(dir.path(), "src-events.jsonl"), "migration-failed").is_empty());

    // Nobody listening.
    let nobody = format!("unix:{}", dir.path().join("nobody.mig").display());
    let (st, msg) = status_of(send(&api, &nobody));
    assert_eq!(st, 500, "{msg}");
    assert!(
        msg.contains("cannot connect") && msg.contains("nobody.mig"),
        "{msg}"
    );
    failed_events(1);
    keeps_running("after nobody listened");

    // A destination refusing our version.
    let p = dir.path().join("refuse.mig");
    let fake = fake_destination(
        &p,
        Some("migration protocol version 1; this lendvm speaks 2"),
        0,
        None,
    );
    let (st, msg) = status_of(send(&api, &format!("unix:{}", p.display())));
    fake.join().unwrap();
    assert_eq!(st, 500, "{msg}");
    assert!(msg.contains("refused") && msg.contains("speaks 2"), "{msg}");
    failed_events(2);
    keeps_running("after a refusal");

    // A destination that dies after 1 MiB of RAM.
    let p = dir.path().join("dies.mig");
    let fake = fake_destination(&p, None, 1 << 20, None);
    let (st, msg) = status_of(send(&api, &format!("unix:{}", p.display())));
    fake.join().unwrap();
    assert_eq!(st, 500, "{msg}");
    assert!(msg.contains("sending guest memory"), "{msg}");
    failed_events(3);
    keeps_running("after the destination died");

    // A destination that stops mid-stream saying why: the source reports its reason.
    let p = dir.path().join("full.mig");
    let fake = fake_destination(&p, None, 1 << 20, Some("no room for 512 MiB here"));
    let (st, msg) = status_of(send(&api, &format!("unix:{}", p.display())));
    fake.join().unwrap();
    assert_eq!(st, 500, "{msg}");
    assert!(
        msg.contains("refused: no room for 512 MiB here"),
        "{msg}\n{}",
        src.stderr()
    );
    failed_events(4);
    keeps_running("after the destination refused mid-stream");

    // A real destination refuses a hello of a future version, naming both versions.
    let (mut dst, url) = destination(dir.path(), "future");
    let mut s = UnixStream::connect(url.trim_start_matches("unix:")).unwrap();
    let body = serde_json::to_vec(&serde_json::json!({
        "magic": "lendvm-migration", "version": 99, "lendvm_version": "9.9.9"
    }))
    .unwrap();
    let mut f = Vec::new();
    f.extend_from_slice(&1u32.to_le_bytes());
    f.extend_from_slice(&0u32.to_le_bytes());
    f.extend_from_slice(&(body.len() as u64).to_le_bytes());
    f.extend_from_slice(&body);
    s.write_all(&f).unwrap();
    let mut h = [0u8; 16];
    s.read_exact(&mut h).unwrap();
    assert_eq!(
        u32::from_le_bytes(h[0..4].try_into().unwrap()),
        3,
        "REFUSED"
    );
    let mut body = vec![0u8; u64::from_le_bytes(h[8..16].try_into().unwrap()) as usize];
    s.read_exact(&mut body).unwrap();
    let why: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let why = why["reason"].as_str().unwrap();
    assert!(
        why.contains("version 99") && why.contains("version 3"),
        "{why}"
    );
    dst.expect_exit(1, T);
    assert!(dst.stderr().contains("version 99"), "{}", dst.stderr());

    // A real destination SIGKILLed while RAM is arriving.
    let (mut dst, url) = destination(dir.path(), "killed");
    let pid = dst.pid();
    let sender = {
        let api = api.clone();
        std::thread::spawn(move || send(&api, &url))
    };
    // Kill it as soon as guest RAM starts to arrive (its RSS grows past its own size).
    let base = proc_status_kb(pid, "VmRSS");
    poll(T, || {
        (proc_status_kb(pid, "VmRSS") > base + 4096).then_some(())
    });
    let _ = dst.wait_exit(Duration::ZERO);
    let (st, msg) = status_of(sender.join().unwrap());
    assert_eq!(st, 500, "{msg}");
    assert!(
        msg.contains("migration failed") && msg.contains("sending guest memory"),
        "{msg}"
    );
    failed_events(5);
    keeps_running("after the destination was killed");
    let last = named(&events(dir.path(), "src-events.jsonl"), "migration-failed")
        .last()
        .map(|e| {
            e["properties"]["error"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .unwrap();
    assert!(!last.is_empty());

    // The same source still migrates.
    std::fs::remove_file(dir.path().join("dst-events.jsonl")).ok();
    migrate_and_check(dir.path(), src, mailbox);
}

/// A VM paused on the source arrives paused (vCPUs parked until `vm.resume`), then goes on
/// exactly.
#[test]
fn a_paused_vm_arrives_paused() {
    let dir = tempfile::tempdir().unwrap();
    let src = boot(dir.path(), "");
    let mailbox = mailbox_of(&src);
    wait_ticks(&src, 3);
    src.api().pause().unwrap();
    let (dst, url) = destination(dir.path(), "dst");
    send(&src.api(), &url).unwrap();
    let dapi = dst.api();
    assert_eq!(dapi.info().unwrap().state, VmState::Paused);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        ticks_of(&dst.stdout()).is_empty(),
        "the paused vm ran on the destination:\n{}",
        dst.stdout()
    );
    dapi.resume().unwrap();
    check_migrated(src, dst, mailbox);
    let evs = events(dir.path(), "dst-events.jsonl");
    let m = named(&evs, "vm-migrated");
    assert_eq!(m[0]["properties"]["paused"], true, "{m:?}");
}

/// Over tcp a source that holds another secret is refused and runs on; the destination goes
/// on listening and takes the first source that proves the secret, then stops listening.
#[test]
fn a_wrong_secret_source_is_refused_and_the_destination_goes_on_listening() {
    let dir = tempfile::tempdir().unwrap();
    let (dst, url) = tcp_destination(dir.path(), "the-cluster-secret-0123456789abcdef");
    let wrong = source_with_token(
        &dir.path().join("wrong"),
        "a-guessed-secret-fedcba9876543210",
    );
    wait_ticks(&wrong, 2);
    let (st, msg) = status_of(send(&wrong.api(), &url));
    assert_eq!(st, 500, "{msg}");
    assert!(msg.contains("did not prove the cluster secret"), "{msg}");
    assert_eq!(wrong.api().info().unwrap().state, VmState::Running);
    // The destination still has no VM and still listens.
    let (st, msg) = status_of(dst.api().info().map(|_| ()));
    assert_eq!(st, 409, "{msg}");
    let src = source_with_token(
        &dir.path().join("right"),
        "the-cluster-secret-0123456789abcdef",
    );
    let mailbox = mailbox_of(&src);
    wait_ticks(&src, 3);
    send(&src.api(), &url).unwrap_or_else(|e| panic!("{e}\n--- destination\n{}", dst.stderr()));
    let port = url.rsplit(':').next().unwrap();
    let dst_log = dst.stderr();
    check_migrated(src, dst, mailbox);
    // One migration, once: nothing listens there any more.
    assert!(
        std::net::TcpStream::connect(format!("127.0.0.1:{port}")).is_err(),
        "the destination still listens after taking its vm"
    );
    assert!(dst_log.contains("refused"), "{dst_log}");
}

/// Copies `from` to `to`, appending every byte to `seen`, until either side closes.
fn relay_half(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    seen: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                seen.lock().unwrap().extend_from_slice(&buf[..n]);
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// A man in the middle that relays the tcp stream and records it sees no guest RAM.
#[test]
fn a_relay_in_the_middle_sees_no_guest_ram() {
    let dir = tempfile::tempdir().unwrap();
    let (dst, url) = tcp_destination(dir.path(), "the-cluster-secret-0123456789abcdef");
    let target = url.trim_start_matches("tcp:").to_string();
    let relay = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_url = format!("tcp:{}", relay.local_addr().unwrap());
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let relayer = {
        let seen = seen.clone();
        std::thread::spawn(move || {
            let (a, _) = relay.accept().unwrap();
            let b = std::net::TcpStream::connect(&target).unwrap();
            let (a2, b2) = (a.try_clone().unwrap(), b.try_clone().unwrap());
            let s2 = seen.clone();
            let back = std::thread::spawn(move || relay_half(b2, a2, s2));
            relay_half(a, b, seen);
            back.join().unwrap();
        })
    };
    let src = source_with_token(
        &dir.path().join("src"),
        "the-cluster-secret-0123456789abcdef",
    );
    let mailbox = mailbox_of(&src);
    wait_ticks(&src, 3);
    send(&src.api(), &relay_url)
        .unwrap_or_else(|e| panic!("{e}\n--- destination\n{}", dst.stderr()));
    check_migrated(src, dst, mailbox);
    relayer.join().unwrap();
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    // All of guest RAM went through the relay...
    assert!(
        seen.len() as u64 >= 64 << 20,
        "{} bytes relayed",
        seen.len()
    );
    // ...and not one run of the guest's marker (u64 word w = seed << 32 | w) in clear.
    let pattern: Vec<u8> = (100..108u64)
        .flat_map(|w| ((u64::from(SEED) << 32) | w).to_le_bytes())
        .collect();
    let found = seen
        .windows(pattern.len())
        .position(|w| w == pattern.as_slice());
    assert_eq!(found, None, "guest RAM crossed the relay in clear");
}

/// The guest's console configuration moves with the VM (as Cloud Hypervisor's VM config
/// does), unless the destination's own `--serial` overrides it.
#[test]
fn a_migrated_vm_keeps_its_console_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");
    let read_console = || std::fs::read_to_string(&console).unwrap_or_default();
    let src_sock = dir.path().join("src.sock").display().to_string();
    let serial = format!("file={}", console.display());
    let line = format!("tests=ticker seed={SEED} period_ms=50");
    let mut src = Vm::start_exact(
        &[
            "--kernel",
            TEST_GUEST,
            "--memory",
            "64M",
            "--cpus",
            "2",
            "--serial",
            &serial,
            "--api-socket",
            &src_sock,
            "--cmdline",
            &line,
        ],
        "warn",
    );
    src.wait_api();
    let ticks_in_file = |n: usize| {
        poll(T, || (ticks_of(&read_console()).len() >= n).then_some(()))
            .unwrap_or_else(|| panic!("fewer than {n} TICK lines in the console file"));
    };
    ticks_in_file(3);
    let mailbox = read_console()
        .lines()
        .find_map(|l| l.strip_prefix("MAILBOX 0x"))
        .map(|h| u64::from_str_radix(h.trim(), 16).unwrap())
        .unwrap();
    // A destination without --serial.
    let dst_sock = dir.path().join("dst.sock").display().to_string();
    let mut dst = Vm::start_exact(&["--api-socket", &dst_sock], "warn");
    dst.wait_api();
    let url = format!("unix:{}", dir.path().join("dst.mig").display());
    dst.api()
        .receive_migration(&VmReceiveMigrationData {
            receiver_url: url.clone(),
        })
        .unwrap();
    let written = read_console();
    send(&src.api(), &url).unwrap();
    src.expect_exit(0, T);
    let before = ticks_of(&read_console()).len();
    ticks_in_file(before + 3);
    let text = read_console();
    assert!(
        text.starts_with(&written),
        "the file was not appended to:\n{text}"
    );
    let ticks = ticks_of(&text);
    for w in ticks.windows(2) {
        assert_eq!(
            w[1].0,
            w[0].0 + 1,
            "gap or repeat: {:?} then {:?}",
            w[0],
            w[1]
        );
    }
    assert!(
        ticks_of(&dst.stdout()).is_empty(),
        "the destination wrote the console to its stdout:\n{}",
        dst.stdout()
    );
    // Onward to a destination whose own --serial stdout overrides the VM's configuration.
    let (dst2, url2) = destination(dir.path(), "dst2");
    send(&dst.api(), &url2).unwrap();
    dst.expect_exit(0, T);
    let in_file = ticks_of(&read_console()).len();
    wait_ticks(&dst2, 3);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        ticks_of(&read_console()).len(),
        in_file,
        "the console still went to the file"
    );
    dst2.write_guest_u64(mailbox, 1);
    let mut dst2 = dst2;
    dst2.expect_ok("ticker", T);
    dst2.expect_exit(0, T);
}
