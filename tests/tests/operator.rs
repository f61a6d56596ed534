//! Running lendvm as an operator does (systemd units, config files, `systemctl stop`):
//!
//! * `lenderd_sigterm_returns_leases_and_leaves_the_directory`: lenderd registered in etcd
//!   lends a dmatest to a VM; SIGTERM (what `systemctl stop` sends) makes it take the lease
//!   back (device reset and available), revoke its registration (its node and device
//!   records are gone from etcd at once, long before their TTL) and exit 0; the VM sees the
//!   device lost.
//! * `lendvm_sigterm_returns_its_leases`: SIGTERM shuts the VM down like vm.shutdown: exit 0,
//!   the lease returned to the lender (not taken back after a link loss).
//! * `config_files`: `--config` with the example files parses; an unknown key and a file
//!   others can write are refused by name; a lender configured only by its file lends and
//!   serves metrics.
//! * `systemd_units_verify`: `systemd-analyze verify` passes on both units without a warning.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use lending::directory::etcd::EtcdDirectory;
use lending::directory::testing::EtcdCluster;
use lending::directory::Directory;

const T: Duration = Duration::from_secs(30);

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

fn sigterm(pid: u32) {
    // SAFETY: kill(2) on a child this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
}

/// Waits for `child` to exit; its status.
fn wait_exit(child: &mut std::process::Child, timeout: Duration) -> std::process::ExitStatus {
    poll(timeout, || child.try_wait().unwrap()).expect("did not exit")
}

#[test]
fn lenderd_sigterm_returns_leases_and_leaves_the_directory() {
    // A TTL far longer than the test: records vanish only if the registration is revoked.
    const TTL_S: u64 = 120;
    let etcd = EtcdCluster::single();
    let dir = tempfile::tempdir().unwrap();
    let file = directory_file(
        dir.path(),
        &etcd,
        TTL_S,
        "[link]\nheartbeat_ms = 100\npeer_timeout_ms = 1000\nconnect_timeout_ms = 2000\n",
    );
    let sock = dir.path().join("node1.sock");
    let metrics = dir.path().join("metrics.sock");
    let mut lender = Lenderd::command(binary("lenderd"), LENDER, &file)
        .log(dir.path().join("lenderd.log"))
        .arg("--control")
        .arg(&sock)
        .arg("--metrics")
        .arg(&metrics)
        .device(format!("{DMATEST_BDF}=dmatest"))
        .spawn_until_listening(&sock);
    // Read-only: no claim is signed, so no cluster secret.
    let directory = EtcdDirectory::connect(&etcd.config(Duration::from_secs(TTL_S)), None).unwrap();
    let registered = |d: &EtcdDirectory| {
        let s = d.snapshot().unwrap();
        (
            s.nodes.iter().any(|n| n.name == LENDER),
            s.devices.iter().filter(|r| r.node == LENDER).count(),
        )
    };
    poll(T, || (registered(&directory) == (true, 1)).then_some(()))
        .expect("lenderd did not register");
    let api_sock = dir.path().join("api.sock");
    let dev = format!("{LENDER}:{DMATEST_BDF},id=d0");
    let vm = Vm::start(
        "64M",
        &[
            "--cluster",
            &file.display().to_string(),
            "--remote-device",
            &dev,
            "--api-socket",
            &api_sock.display().to_string(),
            "--cmdline",
            "tests=idle total_ms=120000",
        ],
    );
    vm.wait_api();
    let api = vm.api();
    let i = api.info().unwrap();
    assert!(
        i.remote_devices.first().map(|d| d.lease_state) == Some(api::types::LeaseState::Active),
        "{i:?}\n{}",
        vm.stderr()
    );
    assert!(lender.log().contains("lent to"), "{}", lender.log());
    // The directory's side in the metrics (over the Unix socket): registered, with the
    // keep-alive's round trip.
    let scrape = || {
        use std::io::{Read, Write};
        let mut s = std::os::unix::net::UnixStream::connect(&metrics).ok()?;
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").ok()?;
        let mut b = String::new();
        s.read_to_string(&mut b).ok()?;
        Some(b)
    };
    let body = poll(T, || {
        scrape()
            .filter(|b| b.contains("lenderd_directory_keepalive_latency_seconds{node=\"node1\"}"))
    })
    .expect("no keep-alive latency in the metrics");
    assert!(
        body.contains("lenderd_directory_registered{node=\"node1\"} 1"),
        "{body}"
    );
    assert!(body.contains("lenderd_leases{node=\"node1\"} 1"), "{body}");

    let t0 = Instant::now();
    sigterm(lender.child.id());
    let st = wait_exit(&mut lender.child, T);
    let stopped_in = t0.elapsed();
    let log = lender.log();
    assert!(st.success(), "lenderd exited with {st}: {log}");
    // The lease was taken back (device reset, available again) before lenderd exited...
    assert!(
        log.contains("taken back from") && log.contains("now available"),
        "{log}"
    );
    // ...and the registration revoked: no record left, long before the TTL.
    assert!(log.contains("left the directory"), "{log}");
    assert_eq!(registered(&directory), (false, 0), "{log}");
    assert!(!metrics.exists(), "the metrics socket was left behind");
    assert!(
        stopped_in < Duration::from_secs(TTL_S / 4),
        "{stopped_in:?}"
    );
    // The borrower knows: the device is lost (then gone from its table).
    poll(T, || {
        let i = api.info().unwrap();
        i.remote_devices
            .iter()
            .all(|d| d.lease_state == api::types::LeaseState::Lost)
            .then_some(())
    })
    .expect("the vm did not see its device go");
}

#[test]
fn lendvm_sigterm_returns_its_leases() {
    let cluster = Cluster::new(Fabric::Shm);
    let lender = cluster.start_lenderd(&[format!("{DMATEST_BDF}=dmatest")]);
    let dev = format!("{LENDER}:{DMATEST_BDF},id=d0");
    let mut vm = boot_with_api(
        &cluster,
        "tests=idle total_ms=120000",
        &["--remote-device", &dev, "--name", "vm-term"],
    );
    assert!(matches!(
        cluster.device(DMATEST_BDF).summary.state,
        lending::protocol::DeviceState::Lent { .. }
    ));
    sigterm(vm.pid());
    let st = vm.wait_exit(T).expect("lendvm did not exit on SIGTERM");
    assert!(st.success(), "{st}: {}", vm.stderr());
    assert!(vm.stderr().contains("SIGTERM received"), "{}", vm.stderr());
    cluster.wait_available(DMATEST_BDF);
    // Returned by the VMM, not taken back after its link went down.
    let log = lender.log();
    assert!(log.contains("vm-term (returned by the borrower)"), "{log}");
}

fn write_private(path: &Path, text: &str, mode: u32) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn config_files() {
    // The shipped examples name only options.
    for (bin, example) in [
        ("lenderd", "resources/lenderd.example.toml"),
        ("lendvm", "resources/vm.example.toml"),
    ] {
        let out = Command::new(binary(bin))
            .arg("--config")
            .arg(repo(example))
            .arg("--help")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{bin} --config {example}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let cluster = Cluster::new(Fabric::Shm);
    let cfg = cluster.file("lenderd.toml");
    let refused = |bin: &str, needles: &[&str]| {
        let out = Command::new(binary(bin))
            .arg("--config")
            .arg(&cfg)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(2), "{bin}: {err}");
        for n in needles {
            assert!(err.contains(n), "{bin}: {err:?} lacks {n:?}");
        }
    };
    write_private(&cfg, "node = \"node1\"\nmetrcs = \"127.0.0.1:1\"\n", 0o600);
    let path = cfg.display().to_string();
    refused("lenderd", &["unknown key `metrcs`", &path, "metrics"]);
    refused("lendvm", &["unknown key `metrcs`", &path]);
    write_private(&cfg, "node = \"node1\"\n", 0o660);
    refused("lenderd", &["writable by group or others", &path]);
    write_private(&cfg, "node = \"node1\"\n", 0o646);
    refused("lendvm", &["writable by group or others", &path]);

    // A lender configured by its file alone.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    write_private(
        &cfg,
        &format!(
            "node = \"{LENDER}\"\ncluster = \"{}\"\nmetrics = \"127.0.0.1:{port}\"\n\
             devices = [\"{DMATEST_BDF}=dmatest\", \"{NVME_BDF}=nvme:path={},size=1M\"]\n",
            cluster.path.display(),
            cluster.file("disk.img").display()
        ),
        0o640,
    );
    let _ = std::fs::remove_file(cluster.file("node1.sock"));
    let mut cmd = Command::new(binary("lenderd"));
    cmd.arg("--config").arg(&cfg);
    let _lender = Lenderd {
        child: cmd
            .env("LENDVM_TOKEN", TOKEN)
            .stderr(std::fs::File::create(cluster.file("lenderd.log")).unwrap())
            .spawn()
            .unwrap(),
        log: cluster.file("lenderd.log"),
    };
    poll(T, || cluster.status().ok()).expect("lenderd from its config file does not answer");
    cluster.wait_available(DMATEST_BDF);
    cluster.wait_available(NVME_BDF);
    let body = poll(T, || {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        use std::io::{Read, Write};
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").ok()?;
        let mut b = String::new();
        s.read_to_string(&mut b).ok()?;
        Some(b)
    })
    .expect("no metrics at the configured address");
    assert!(
        body.contains("lenderd_devices{node=\"node1\",state=\"available\"} 2"),
        "{body}"
    );
}

#[test]
fn systemd_units_verify() {
    let analyze = ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .expect("systemd-analyze is not installed (Debian's systemd package; scripts/setup.sh)");
    // verify checks that ExecStart= is executable: point it at the built binaries.
    let dir = tempfile::tempdir().unwrap();
    let mut units = Vec::new();
    for (unit, bin) in [
        ("lenderd.service", "lenderd"),
        ("lendvm@.service", "lendvm"),
    ] {
        let text = std::fs::read_to_string(repo(&format!("resources/systemd/{unit}"))).unwrap();
        let exec = format!("/usr/bin/{bin} ");
        assert!(text.contains(&exec), "{unit} does not run {exec}");
        let text = text.replace(&exec, &format!("{} ", binary(bin).display()));
        // The template as an instance, as systemd runs it.
        let name = unit.replace("@.", "@vm1.");
        std::fs::write(dir.path().join(&name), text).unwrap();
        units.push(dir.path().join(name));
    }
    let out = Command::new(analyze)
        .args(["verify", "--man=no"])
        .args(&units)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.trim().is_empty(),
        "systemd-analyze verify: {}\n{err}",
        out.status
    );
}
