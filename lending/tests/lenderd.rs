//! Multi-process tests: the real `lenderd` binary on the shm fabric, the test process (or a
//! re-executed copy of it) as the borrower, and a `dmatest` device.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use emulated::dmatest::{
    CMD_START, REG_CMD, REG_DST, REG_FAULTS, REG_IRQ_VECTOR, REG_LEN, REG_SRC, REG_STATUS,
    STATUS_DONE, STATUS_ERROR,
};
use lending::client::{ClientError, ClientIrq, LenderClient};
use lending::protocol::{code, DeviceState, IrqKind};
use ntb::{ClusterConfig, PeerWindow, SharedMemory};
use vmm_sys_util::eventfd::EventFd;

const TOKEN: &str = "s3cret-cluster-token-8f3a61c2d4b7e9051a6c";
const DEV: &str = "0000:00:04.0";
const PAGE: u64 = 0x1000;
const GUARD: u8 = 0xA5;

// The same lenderd harness the api and lendvm-tests crates get from `lending::testing`.
#[path = "../src/testing.rs"]
mod testing;
use testing::Lenderd;

struct Cluster {
    dir: tempfile::TempDir,
    cfg: ClusterConfig,
    path: PathBuf,
}

fn cluster() -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    // No [link] section: the default heartbeat/peer timeout is what is being tested.
    let src = format!(
        "version = 1\n\
         [[node]]\nname = \"node3\"\nfabric = \"shm\"\ncontrol = \"{d}/node3.sock\"\n\
         [[node]]\nname = \"node1\"\nfabric = \"shm\"\ncontrol = \"{d}/node1.sock\"\n\
         [[node]]\nname = \"node2\"\nfabric = \"shm\"\ncontrol = \"{d}/node2.sock\"\n"
    );
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, &src).unwrap();
    let cfg = ClusterConfig::load(&path).unwrap();
    Cluster { dir, cfg, path }
}

fn start_lenderd(c: &Cluster, tag: &str) -> Lenderd {
    Lenderd::command(env!("CARGO_BIN_EXE_lenderd"), "node3", &c.path)
        .log(c.dir.path().join(format!("lenderd-{tag}.log")))
        .device(format!("{DEV}=dmatest"))
        .token(TOKEN)
        .spawn_until_listening(&c.dir.path().join("node3.sock"))
}

fn connect(c: &Cluster, node: &str) -> LenderClient {
    let t0 = Instant::now();
    loop {
        match LenderClient::connect(&c.cfg, node, "node3", TOKEN, "test") {
            Ok(cl) => return cl,
            Err(e) if t0.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("connect: {e}"),
        }
    }
}

fn state(cl: &LenderClient) -> DeviceState {
    cl.list().unwrap()[0].state.clone()
}

/// Waits for an eventfd to become readable (bounded).
fn wait_fd(fd: &EventFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, timeout.as_millis() as i32) };
    n == 1
}

/// Guest RAM of 16 pages filled with the guard pattern; the window exported to the lender
/// covers pages 4..12 only.
struct GuestRam {
    mem: SharedMemory,
}

const WIN_OFF: u64 = 4 * PAGE;
const WIN_SIZE: u64 = 8 * PAGE;
const IOVA: u64 = 0x10_0000;

impl GuestRam {
    fn new() -> Self {
        let mem = SharedMemory::new("guest-ram", 16 * PAGE).unwrap();
        mem.write_at(0, &vec![GUARD; 16 * PAGE as usize]).unwrap();
        GuestRam { mem }
    }

    fn read(&self, off: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mem.read_at(off, &mut v).unwrap();
        v
    }

    fn assert_guards_intact(&self) {
        let below = self.read(0, WIN_OFF as usize);
        let above = self.read(
            WIN_OFF + WIN_SIZE,
            (16 * PAGE - WIN_OFF - WIN_SIZE) as usize,
        );
        assert!(
            below.iter().all(|&b| b == GUARD),
            "memory below the window touched"
        );
        assert!(
            above.iter().all(|&b| b == GUARD),
            "memory above the window touched"
        );
    }
}

fn w32(bar: &dyn PeerWindow, off: u64, v: u32) {
    bar.write_at(off, &v.to_le_bytes()).unwrap();
}
fn w64(bar: &dyn PeerWindow, off: u64, v: u64) {
    bar.write_at(off, &v.to_le_bytes()).unwrap();
}
fn r32(bar: &dyn PeerWindow, off: u64) -> u32 {
    let mut b = [0u8; 4];
    bar.read_at(off, &mut b).unwrap();
    u32::from_le_bytes(b)
}

/// Programs a copy through the directly mapped BAR window and rings the notify eventfd. A
/// previous completion is acknowledged first (and the ack waited for, bounded).
fn start_copy(bar: &dyn PeerWindow, notify: &EventFd, src: u64, dst: u64, len: u32) {
    if r32(bar, REG_STATUS) & (STATUS_DONE | STATUS_ERROR) != 0 {
        w32(bar, REG_CMD, emulated::dmatest::CMD_ACK);
        notify.write(1).unwrap();
        let t0 = Instant::now();
        while r32(bar, REG_STATUS) & (STATUS_DONE | STATUS_ERROR) != 0
            && t0.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    w64(bar, REG_SRC, src);
    w64(bar, REG_DST, dst);
    w32(bar, REG_LEN, len);
    w32(bar, REG_IRQ_VECTOR, 0);
    w32(bar, REG_CMD, CMD_START);
    notify.write(1).unwrap();
}

fn wait_status(bar: &dyn PeerWindow, bits: u32) -> u32 {
    let t0 = Instant::now();
    loop {
        let s = r32(bar, REG_STATUS);
        if s & bits != 0 || t0.elapsed() > Duration::from_secs(10) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn borrow_copy_irq_return_and_borrow_again() {
    let c = cluster();
    let _d = start_lenderd(&c, "main");
    let cl = connect(&c, "node1");
    let list = cl.list().unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].id, DEV);
    assert_eq!(list[0].kind, "dmatest");
    assert_eq!(list[0].state, DeviceState::Available);

    let lease = cl.borrow(DEV, "vm0").unwrap();
    assert_eq!(
        state(&cl),
        DeviceState::Lent {
            node: "node1".into(),
            vm: "vm0".into()
        }
    );
    // Config space over the protocol matches the snapshot and the dmatest identity.
    let cfg = lease.config_read(0, 256).unwrap();
    assert_eq!(cfg, lease.info().config);
    assert_eq!(&cfg[0..4], &[0x36, 0x1b, 0x05, 0x11]);
    assert!(lease.info().caps.iter().any(|c| c.id == 0x11));
    assert_eq!(lease.info().irqs.msix, 2);

    // Guest RAM window mapped at IOVA = GPA.
    let ram = GuestRam::new();
    let src: Vec<u8> = (0..PAGE as usize).map(|i| (i * 7 + 3) as u8).collect();
    ram.mem.write_at(WIN_OFF, &src).unwrap();
    let win = cl
        .endpoint()
        .export_window(ram.mem.fd(), WIN_OFF, WIN_SIZE, "vm0-ram")
        .unwrap();
    lease.map_dma(IOVA, WIN_SIZE, win.id()).unwrap();
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    lease
        .set_irqs(IrqKind::Msix, &[ClientIrq::EventFd(&irq), ClientIrq::None])
        .unwrap();
    // BME was set by the lender when the window was mapped.
    assert_eq!(lease.config_read(4, 2).unwrap()[0] & 4, 4);

    let bar = lease.bar_window(0).unwrap();
    let notify = lease.notify_eventfd().unwrap();
    start_copy(bar.as_ref(), notify, IOVA, IOVA + 4 * PAGE, PAGE as u32);
    assert!(wait_fd(&irq, Duration::from_secs(10)), "no msi-x interrupt");
    assert_eq!(irq.read().unwrap(), 1);
    let s = r32(bar.as_ref(), REG_STATUS);
    assert_eq!(
        s & (STATUS_DONE | STATUS_ERROR),
        STATUS_DONE,
        "status {s:#x}"
    );
    assert_eq!(ram.read(WIN_OFF + 4 * PAGE, PAGE as usize), src);
    ram.assert_guards_intact();

    // The slow path reads the same registers.
    let st = lease.bar_read(0, REG_STATUS, 4).unwrap();
    assert_eq!(
        u32::from_le_bytes(st.try_into().unwrap()) & STATUS_DONE,
        STATUS_DONE
    );

    lease.return_device().unwrap();
    assert_eq!(state(&cl), DeviceState::Available);
    let st = cl.status().unwrap();
    assert!(st.devices[0].dma_maps.is_empty());

    // A second client borrows it next.
    let cl2 = connect(&c, "node2");
    let l2 = cl2.borrow(DEV, "vm1").unwrap();
    assert_eq!(
        state(&cl2),
        DeviceState::Lent {
            node: "node2".into(),
            vm: "vm1".into()
        }
    );
    // The device came back reset: registers cleared, no mappings.
    let st = l2.bar_read(0, REG_STATUS, 4).unwrap();
    assert_eq!(u32::from_le_bytes(st.try_into().unwrap()), 0);
    drop(l2);
    assert_eq!(state(&cl2), DeviceState::Available);
}

#[test]
fn exclusive_leases_bad_token_and_filtered_config() {
    let c = cluster();
    let _d = start_lenderd(&c, "excl");
    let a = connect(&c, "node1");
    let _lease = a.borrow(DEV, "vm0").unwrap();

    let b = connect(&c, "node2");
    let e = b.borrow(DEV, "vm7").err().unwrap();
    assert_eq!(e.code(), Some(code::DEVICE_BUSY));
    assert!(
        e.to_string().contains("device busy, lent to node1/vm0"),
        "{e}"
    );
    let e = b.borrow("0000:99:00.0", "vm7").err().unwrap();
    assert_eq!(e.code(), Some(code::UNKNOWN_DEVICE));
    assert!(e.to_string().contains("unknown device 0000:99:00.0"), "{e}");

    let e = LenderClient::connect(&c.cfg, "node2", "node3", "wrong", "test")
        .err()
        .unwrap();
    // Mutual authentication: the borrower with the wrong token cannot verify the lender's
    // proof and stops before sending anything derived from its token.
    assert!(
        matches!(&e, ClientError::LenderNotAuthenticated { lender, .. } if lender == "node3"),
        "{e}"
    );
    assert!(e.to_string().contains("did not prove"), "{e}");

    // The lender refuses config writes to BARs and the MSI-X capability.
    let e = _lease.config_write(0x10, &[0xff; 4]).err().unwrap();
    assert_eq!(e.code(), Some(code::FORBIDDEN), "{e}");
    let msix = _lease
        .info()
        .caps
        .iter()
        .find(|c| c.id == 0x11)
        .unwrap()
        .offset;
    let e = _lease.config_write(msix + 2, &[0, 0x80]).err().unwrap();
    assert!(e.to_string().contains("SET_IRQS"), "{e}");
    // Through the lender's per-lease config gate: extended config space (which this device
    // does not have) reads as 0 and writes there are dropped; a write no config cycle can be
    // is refused with a clear error; the status register's Capabilities List bit stays.
    _lease.config_write(0x100, &[0xff; 4]).unwrap();
    assert_eq!(_lease.config_read(0x100, 8).unwrap(), vec![0; 8]);
    let e = _lease.config_write(0x80, &[1; 8]).err().unwrap();
    assert_eq!(e.code(), Some(code::INVALID), "{e}");
    assert!(
        e.to_string().contains("1, 2 or 4 bytes inside one dword"),
        "{e}"
    );
    let e = _lease.config_write(0x82, &[1; 4]).err().unwrap();
    assert_eq!(e.code(), Some(code::INVALID), "{e}");
    _lease.config_write(6, &[0, 0]).unwrap();
    assert_eq!(_lease.config_read(6, 1).unwrap()[0] & 0x10, 0x10);
    let fresh = _lease.device_info().unwrap();
    assert!(fresh.caps.iter().any(|c| c.id == 0x11), "{:?}", fresh.caps);
    // Unknown lease ids are per link.
    let e = b.borrow(DEV, "x").err().unwrap();
    assert_eq!(e.code(), Some(code::DEVICE_BUSY));
}

#[test]
fn dma_outside_the_window_is_refused_counted_and_logged() {
    let c = cluster();
    let d = start_lenderd(&c, "fault");
    let cl = connect(&c, "node1");
    let lease = cl.borrow(DEV, "vm0").unwrap();
    let ram = GuestRam::new();
    let win = cl
        .endpoint()
        .export_window(ram.mem.fd(), WIN_OFF, WIN_SIZE, "vm0-ram")
        .unwrap();
    lease.map_dma(IOVA, WIN_SIZE, win.id()).unwrap();
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    lease
        .set_irqs(IrqKind::Msix, &[ClientIrq::EventFd(&irq)])
        .unwrap();
    let bar = lease.bar_window(0).unwrap();
    let notify = lease.notify_eventfd().unwrap();

    // Destination straddles the end of the window; then a source below it; then a
    // destination far away (where the guard pages would be if the IOMMU did not check).
    let cases = [
        (IOVA, IOVA + WIN_SIZE - 8, 64u32),
        (IOVA - PAGE, IOVA, 64),
        (IOVA, IOVA + WIN_SIZE + PAGE, 16),
    ];
    for (i, (src, dst, len)) in cases.into_iter().enumerate() {
        start_copy(bar.as_ref(), notify, src, dst, len);
        let s = wait_status(bar.as_ref(), STATUS_DONE | STATUS_ERROR);
        assert_ne!(s & STATUS_ERROR, 0, "case {i}: status {s:#x}");
        assert!(r32(bar.as_ref(), REG_FAULTS) as usize > i);
    }
    // The last bytes of the window were not written either (all-or-nothing).
    assert!(ram
        .read(WIN_OFF + WIN_SIZE - 8, 8)
        .iter()
        .all(|&b| b == GUARD));
    ram.assert_guards_intact();
    let st = cl.status().unwrap();
    assert!(st.devices[0].iommu_faults >= 3, "{st:?}");
    assert_eq!(st.devices[0].dma_maps, vec![(IOVA, WIN_SIZE)]);
    let t0 = Instant::now();
    while !d.log().contains("iommu fault") && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(d.log().contains("iommu fault"), "{}", d.log());

    // A window the borrower never exported, and an overlapping map, are refused.
    let e = lease.map_dma(0x9000_0000, PAGE, 999).err().unwrap();
    assert_eq!(e.code(), Some(code::UNKNOWN_WINDOW), "{e}");
    let e = lease.map_dma(IOVA + PAGE, PAGE, win.id()).err().unwrap();
    assert_eq!(e.code(), Some(code::IOMMU), "{e}");
}

/// Not a test on its own: the borrower process for the SIGKILL/SIGSTOP tests (re-executed
/// with LENDING_HELPER_DIR set). Borrows, maps a window, wires an interrupt, says READY and
/// waits to be killed.
#[test]
fn helper_borrower() {
    let Ok(dir) = std::env::var("LENDING_HELPER_DIR") else {
        return;
    };
    let cfg = ClusterConfig::load(&Path::new(&dir).join("cluster.toml")).unwrap();
    let cl = LenderClient::connect(&cfg, "node2", "node3", TOKEN, "helper").unwrap();
    let lease = cl.borrow(DEV, "victim").unwrap();
    let ram = GuestRam::new();
    let win = cl
        .endpoint()
        .export_window(ram.mem.fd(), WIN_OFF, WIN_SIZE, "victim-ram")
        .unwrap();
    lease.map_dma(IOVA, WIN_SIZE, win.id()).unwrap();
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    lease
        .set_irqs(IrqKind::Msix, &[ClientIrq::EventFd(&irq)])
        .unwrap();
    println!("READY");
    std::thread::sleep(Duration::from_secs(60));
}

fn spawn_helper(c: &Cluster) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "helper_borrower",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("LENDING_HELPER_DIR", c.dir.path())
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
        .expect("helper borrower did not get ready");
    child
}

/// Polls until the device is available with no DMA mappings; returns whether that happened
/// before `deadline` elapsed.
fn wait_freed(cl: &LenderClient, deadline: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < deadline {
        let st = cl.status().unwrap();
        if st.devices[0].summary.state == DeviceState::Available
            && st.devices[0].dma_maps.is_empty()
        {
            return true;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    false
}

#[test]
fn killed_borrower_loses_its_lease_within_two_seconds() {
    let c = cluster();
    let d = start_lenderd(&c, "kill");
    let obs = connect(&c, "node1");
    let mut helper = spawn_helper(&c);
    let st = obs.status().unwrap();
    assert_eq!(
        st.devices[0].summary.state,
        DeviceState::Lent {
            node: "node2".into(),
            vm: "victim".into()
        }
    );
    assert_eq!(st.devices[0].dma_maps, vec![(IOVA, WIN_SIZE)]);
    helper.kill().unwrap(); // SIGKILL
    let _ = helper.wait();
    assert!(
        wait_freed(&obs, Duration::from_secs(2)),
        "device not back within 2 s: {:?}\n{}",
        obs.status().unwrap(),
        d.log()
    );
    assert!(
        d.log().contains("taken back from node2/victim"),
        "{}",
        d.log()
    );
    // And it can be borrowed again.
    obs.borrow(DEV, "vm0").unwrap().return_device().unwrap();
}

#[test]
fn stopped_borrower_loses_its_lease_after_missed_heartbeats() {
    let c = cluster();
    let d = start_lenderd(&c, "stop");
    let obs = connect(&c, "node1");
    let mut helper = spawn_helper(&c);
    // SIGSTOP: the socket stays open but heartbeats stop.
    // SAFETY: signalling our own child by pid.
    unsafe { libc::kill(helper.id() as i32, libc::SIGSTOP) };
    let freed = wait_freed(&obs, Duration::from_secs(4));
    let _ = helper.kill();
    let _ = helper.wait();
    assert!(
        freed,
        "lease not dropped after missed heartbeats\n{}",
        d.log()
    );
    assert!(
        d.log().contains("taken back from node2/victim"),
        "{}",
        d.log()
    );
}

#[test]
fn restarted_lenderd_has_no_stale_leases() {
    let c = cluster();
    let d = start_lenderd(&c, "r1");
    let cl = connect(&c, "node1");
    let lease = cl.borrow(DEV, "vm0").unwrap();
    drop(d); // SIGKILL, no cleanup
    std::mem::forget(lease); // the link is dead; nothing to return
    let _d2 = start_lenderd(&c, "r2");
    let cl2 = connect(&c, "node1");
    assert_eq!(state(&cl2), DeviceState::Available);
    cl2.borrow(DEV, "vm0").unwrap().return_device().unwrap();
}

/// lenderd is not dumpable: another process of its own user cannot open lenderd's fds (VFIO
/// device fds, backing files, guest RAM windows) or read its environment through `/proc`,
/// while it can a plain process of that user (so the check can fail). lenderd runs as
/// `nobody` here; the test must run as root to start it so.
#[test]
fn a_process_of_lenderds_own_user_cannot_open_its_fds() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test starts lenderd as another user: run it as root (CI does)"
    );
    const NOBODY: u32 = 65534;
    let c = cluster();
    std::os::unix::fs::chown(c.dir.path(), Some(NOBODY), Some(NOBODY)).unwrap();
    let lenderd = Lenderd::command(env!("CARGO_BIN_EXE_lenderd"), "node3", &c.path)
        .log(c.dir.path().join("lenderd-nobody.log"))
        .device(format!("{DEV}=dmatest"))
        .token(TOKEN)
        .user(NOBODY, NOBODY)
        .spawn_until_listening(&c.dir.path().join("node3.sock"));
    let as_nobody = |pid: u32| {
        use std::os::unix::process::CommandExt;
        Command::new("/bin/sh")
            .arg("-c")
            .arg(format!("ls /proc/{pid}/fd/ && cat /proc/{pid}/environ"))
            .uid(NOBODY)
            .gid(NOBODY)
            .output()
            .unwrap()
    };
    // A plain process of the same user: its fds are open to nobody.
    let mut plain = {
        use std::os::unix::process::CommandExt;
        Command::new("sleep")
            .arg("30")
            .uid(NOBODY)
            .gid(NOBODY)
            .spawn()
            .unwrap()
    };
    let o = as_nobody(plain.id());
    plain.kill().unwrap();
    plain.wait().unwrap();
    assert!(
        o.status.success(),
        "nobody cannot read its own plain process's /proc/PID/fd: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = as_nobody(lenderd.child.id());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("Permission denied"),
        "another process of lenderd's user read /proc/{}/fd: {}{err}",
        lenderd.child.id(),
        String::from_utf8_lossy(&o.stdout)
    );
}

/// `lenderd --audit-log`: the lender's own records of who held the device when. A lease
/// writes `grant` (holder, no fence without a directory), `serve` for its requests, and
/// `end` when returned, in that order; the next holder's `grant` comes after that `end`;
/// a borrower refused while the device is lent leaves no record.
#[test]
fn the_audit_log_records_grants_serving_and_ends_in_order() {
    let c = cluster();
    let audit = c.dir.path().join("audit.jsonl");
    let _d = Lenderd::command(env!("CARGO_BIN_EXE_lenderd"), "node3", &c.path)
        .log(c.dir.path().join("lenderd-audit.log"))
        .device(format!("{DEV}=dmatest"))
        .token(TOKEN)
        .arg("--audit-log")
        .arg(&audit)
        .spawn_until_listening(&c.dir.path().join("node3.sock"));
    let a = connect(&c, "node1");
    let lease = a.borrow(DEV, "vm0").unwrap();
    lease.config_read(0, 4).unwrap();
    let b = connect(&c, "node2");
    assert!(b.borrow(DEV, "vm7").is_err());
    drop(lease);
    assert!(wait_freed(&b, Duration::from_secs(10)), "device not freed");
    let second = b.borrow(DEV, "vm7").unwrap();
    drop(second);
    assert!(wait_freed(&a, Duration::from_secs(10)), "device not freed");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&audit)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let seen: Vec<(String, String)> = lines
        .iter()
        .map(|l| {
            (
                l["event"].as_str().unwrap().to_string(),
                l["holder"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let want = |e: &str, h: &str| (e.to_string(), h.to_string());
    assert_eq!(seen[0], want("grant", "node1/vm0"), "{seen:?}");
    assert!(seen.contains(&want("serve", "node1/vm0")), "{seen:?}");
    let end1 = seen
        .iter()
        .position(|s| *s == want("end", "node1/vm0"))
        .unwrap();
    let grant2 = seen
        .iter()
        .position(|s| *s == want("grant", "node2/vm7"))
        .unwrap();
    assert!(end1 < grant2, "{seen:?}");
    assert_eq!(seen.last(), Some(&want("end", "node2/vm7")), "{seen:?}");
    let times: Vec<u64> = lines
        .iter()
        .map(|l| l["mono_ms"].as_u64().unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    assert!(lines
        .iter()
        .all(|l| l["node"] == "node3" && l["device"] == DEV && l.get("fence").is_none()));
}
