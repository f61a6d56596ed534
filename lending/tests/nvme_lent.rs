//! The emulated NVMe controller lent by the real `lenderd` and driven from this process, which
//! plays the guest on the borrower side (`emulated::testing::NvmeDriver` over the adapters in
//! `common`): bring-up, identify, two I/O queue pairs, 1000 random LBAs written and read back
//! with checksums, flush, interrupts on the vectors' eventfds; on the shm fabric (direct BAR
//! window, interrupt and polling mode, and the trapped slow path) and on the tcp fabric
//! (trapped BAR, DMA and interrupts as messages); crash consistency across a SIGKILLed
//! lenderd; and how lenderd takes its cluster token.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use emulated::testing::{DataBuf, NvmeDriver};
use ntb::FabricKind;
use rand::{Rng, SeedableRng};

const DEV: &str = "0000:82:00.0";
const DISK: &str = "64M";
const BLOCKS: u64 = (64 << 20) / 512;
/// Blocks per I/O (4 KiB).
const NLB: u32 = 8;
/// Commands in flight per queue per batch.
const BATCH: usize = 16;
const RAM: u64 = 32 << 20;

/// One 4 KiB extent: starting LBA and the CRC32 of its contents.
#[derive(Debug, Clone, Copy)]
struct Extent {
    lba: u64,
    crc: u32,
}

/// `n` distinct, non-overlapping 4 KiB extents at random LBAs (not 4 KiB aligned).
fn random_lbas(n: usize, seed: u64, avoid: &HashSet<u64>) -> Vec<u64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut used: HashSet<u64> = avoid.clone();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        // Slots of 9 blocks leave room for a random start inside each slot.
        let slot = rng.random_range(0..BLOCKS / 9);
        if used.insert(slot) {
            out.push(slot * 9 + rng.random_range(0..=1));
        }
    }
    out
}

/// Brings the controller up and checks what identify says; creates two queue pairs on
/// vectors 1 and 2. Returns the namespace size in blocks.
fn bring_up(d: &mut NvmeDriver) -> u64 {
    d.enable(32).unwrap();
    let id = d.identify_controller().unwrap();
    assert_eq!(id.vid, 0x1b36);
    assert_eq!(id.serial, "LENDVM000082000");
    assert_eq!(id.nn, 1);
    assert_eq!((id.sqes, id.cqes), (0x66, 0x44));
    assert_ne!(id.vwc & 1, 0, "volatile write cache reported");
    let (nsze, lba) = d.identify_namespace(1).unwrap();
    assert_eq!((nsze, lba), (BLOCKS, 512));
    let (sq, cq) = d.set_num_queues(2).unwrap();
    assert!(sq >= 2 && cq >= 2, "granted {sq}/{cq} queues");
    d.create_io_queue_pair(1, 64, 1).unwrap();
    d.create_io_queue_pair(2, 64, 2).unwrap();
    nsze
}

struct Bufs {
    q: [Vec<DataBuf>; 2],
}

fn alloc_bufs(d: &mut NvmeDriver) -> Bufs {
    let mut mk = || {
        (0..BATCH)
            .map(|_| d.alloc_data(4096, 0, false).unwrap())
            .collect()
    };
    Bufs { q: [mk(), mk()] }
}

/// Runs `lbas` through both queues (alternating) in batches of `BATCH` per queue, writing
/// `data(lba)` or reading into the buffers; `check` sees every read extent.
fn run(
    d: &mut NvmeDriver,
    bufs: &Bufs,
    lbas: &[u64],
    write: bool,
    data: &dyn Fn(u64) -> Vec<u8>,
    check: &mut dyn FnMut(u64, &[u8]),
) {
    for chunk in lbas.chunks(2 * BATCH) {
        let mut placed = [Vec::new(), Vec::new()];
        for (i, &lba) in chunk.iter().enumerate() {
            let q = i % 2;
            let buf = &bufs.q[q][placed[q].len()];
            if write {
                buf.fill(d.ram(), &data(lba));
            } else {
                buf.fill(d.ram(), &[0xEE; 4096]);
            }
            d.push(q as u16 + 1, NvmeDriver::rw_sqe(write, lba, NLB, buf))
                .unwrap();
            placed[q].push(lba);
        }
        for (q, p) in placed.iter().enumerate() {
            if !p.is_empty() {
                d.ring(q as u16 + 1).unwrap();
            }
        }
        for (q, p) in placed.iter().enumerate() {
            let mut out = Vec::new();
            d.wait(q as u16 + 1, &mut out, p.len()).unwrap();
            assert_eq!(out.len(), p.len());
            for e in &out {
                assert_eq!(
                    e.code(),
                    0,
                    "{} failed: {e:?}",
                    if write { "write" } else { "read" }
                );
            }
            if !write {
                for (k, &lba) in p.iter().enumerate() {
                    check(lba, &bufs.q[q][k].read(d.ram()));
                }
            }
        }
    }
}

fn pattern(seed: u64) -> impl Fn(u64) -> Vec<u8> {
    move |lba| {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ lba.wrapping_mul(0x9e37_79b9));
        let mut v = vec![0u8; 4096];
        rng.fill(&mut v[..]);
        v
    }
}

/// Writes `lbas`, flushes, returns the checksums written.
fn write_and_flush(d: &mut NvmeDriver, bufs: &Bufs, lbas: &[u64], seed: u64) -> Vec<Extent> {
    let data = pattern(seed);
    run(d, bufs, lbas, true, &data, &mut |_, _| {});
    d.flush(1).unwrap();
    d.flush(2).unwrap();
    lbas.iter()
        .map(|&lba| Extent {
            lba,
            crc: crc32fast::hash(&data(lba)),
        })
        .collect()
}

/// Reads every extent back (both queues) and compares checksums.
fn verify(d: &mut NvmeDriver, bufs: &Bufs, extents: &[Extent]) {
    let lbas: Vec<u64> = extents.iter().map(|e| e.lba).collect();
    let want: std::collections::HashMap<u64, u32> =
        extents.iter().map(|e| (e.lba, e.crc)).collect();
    let mut checked = 0;
    let nodata = |_: u64| Vec::new();
    run(d, bufs, &lbas, false, &nodata, &mut |lba, got| {
        assert_eq!(
            crc32fast::hash(got),
            want[&lba],
            "lba {lba}: checksum mismatch"
        );
        checked += 1;
    });
    assert_eq!(checked, extents.len());
}

/// The must-show workload on a lent controller; checks interrupts on vectors 0..=2.
fn workload(rig: &mut LentRig, n: usize, expect_irqs: bool) {
    let d = &mut rig.driver;
    bring_up(d);
    let bufs = alloc_bufs(d);
    let lbas = random_lbas(n, 0x1000 + n as u64, &HashSet::new());
    let ext = write_and_flush(d, &bufs, &lbas, 7);
    verify(d, &bufs, &ext);
    // Nothing else was overwritten: a block between extents still reads as zeroes.
    let spare = d.alloc_data(512, 0, false).unwrap();
    let used: HashSet<u64> = lbas.iter().map(|l| l / 9).collect();
    let free_slot = (0..BLOCKS / 9).find(|s| !used.contains(s)).unwrap();
    let e = d.rw(1, false, free_slot * 9 + 4, 1, &spare).unwrap();
    assert_eq!(e.code(), 0);
    assert!(spare.read(d.ram()).iter().all(|&b| b == 0));
    d.shutdown().unwrap();
    for v in 0..3 {
        let n = rig.irq.total(v);
        if expect_irqs {
            assert!(n > 0, "no interrupt arrived on vector {v}'s eventfd");
        }
    }
    let st = rig.client.status().unwrap();
    assert_eq!(st.devices[0].iommu_faults, 0, "{st:?}");
}

fn nvme_lenderd(c: &Cluster, polling: bool, via: TokenVia) -> Lenderd {
    let disk = c.dir.path().join("disk.img");
    start_lenderd(c, "nvme", &[nvme_spec(DEV, &disk, DISK, polling)], via)
}

#[test]
fn shm_interrupt_mode_direct_bar() {
    let c = cluster(FabricKind::Shm);
    let _d = nvme_lenderd(&c, false, TokenVia::File);
    let mut rig = lent_rig(&c, DEV, RAM, BarPath::Direct { notify: true }, &[], 3, true);
    workload(&mut rig, 1000, true);
}

#[test]
fn shm_polling_mode_direct_bar() {
    let c = cluster(FabricKind::Shm);
    let _d = nvme_lenderd(&c, true, TokenVia::Env);
    // No notify writes: the lender's controller polls the shared register window, and the
    // driver polls its completion queues.
    let mut rig = lent_rig(
        &c,
        DEV,
        RAM,
        BarPath::Direct { notify: false },
        &[],
        3,
        false,
    );
    workload(&mut rig, 1000, true);
}

#[test]
fn shm_trapped_bar_slow_path() {
    let c = cluster(FabricKind::Shm);
    let _d = nvme_lenderd(&c, false, TokenVia::Flag);
    let mut rig = lent_rig(&c, DEV, RAM, BarPath::Trapped, &[], 3, true);
    workload(&mut rig, 200, true);
}

#[test]
fn tcp_trapped_bar_message_dma_and_irqs() {
    let c = cluster(FabricKind::Tcp);
    let _d = nvme_lenderd(&c, false, TokenVia::File);
    // Vectors 0 and 1: eventfds signalled by the client's relay of IRQ event messages;
    // vector 2: a fabric doorbell bit (a message the link turns into its eventfd).
    let mut rig = lent_rig(
        &c,
        DEV,
        RAM,
        BarPath::Trapped,
        &[IrqVia::EventFd, IrqVia::EventFd, IrqVia::Doorbell],
        3,
        true,
    );
    assert!(rig.lease.notify_eventfd().is_none());
    assert!(rig.lease.bar_window(0).unwrap().as_ptr().is_err());
    workload(&mut rig, 1000, true);
    // Every relayed interrupt went to an eventfd; none was left for next_event.
    assert!(rig
        .client
        .next_event(Duration::from_millis(10))
        .unwrap()
        .is_none());
    let stats = rig.client.endpoint().stats();
    assert!(stats.frames_received > 2000, "{stats:?}");
}

#[test]
fn flushed_blocks_survive_a_sigkilled_lenderd() {
    let c = cluster(FabricKind::Shm);
    let mut d = nvme_lenderd(&c, false, TokenVia::File);
    let flushed = {
        let mut rig = lent_rig(&c, DEV, RAM, BarPath::Direct { notify: true }, &[], 3, true);
        let dr = &mut rig.driver;
        bring_up(dr);
        let bufs = alloc_bufs(dr);
        let lbas = random_lbas(400, 0xc0ffee, &HashSet::new());
        let flushed = write_and_flush(dr, &bufs, &lbas, 11);
        // More writes in flight, not flushed, when lenderd dies.
        let avoid: HashSet<u64> = lbas.iter().map(|l| l / 9).collect();
        let more = random_lbas(BATCH, 0xbad, &avoid);
        let data = pattern(12);
        for (k, &lba) in more.iter().enumerate() {
            let buf = &bufs.q[0][k];
            buf.fill(dr.ram(), &data(lba));
            dr.push(1, NvmeDriver::rw_sqe(true, lba, NLB, buf)).unwrap();
        }
        dr.ring(1).unwrap();
        d.kill(); // SIGKILL
        let gone = rig.client.endpoint().wait_gone(Duration::from_secs(5));
        assert!(gone.is_ok(), "link did not go down: {gone:?}");
        flushed
    };
    let _d2 = nvme_lenderd(&c, false, TokenVia::File);
    let mut rig = lent_rig(&c, DEV, RAM, BarPath::Direct { notify: true }, &[], 3, true);
    let dr = &mut rig.driver;
    bring_up(dr);
    let bufs = alloc_bufs(dr);
    verify(dr, &bufs, &flushed);
    dr.shutdown().unwrap();
}

fn lenderd_status(c: &Cluster, args: &[&str], env: Option<&str>) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lenderd"));
    cmd.args(["--node", LENDER, "--cluster"])
        .arg(&c.path)
        .args(["--device", "0000:00:04.0=dmatest"])
        .args(args)
        .env_remove("LENDVM_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(t) = env {
        cmd.env("LENDVM_TOKEN", t);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn lenderd_token_sources() {
    let c = cluster(FabricKind::Shm);
    let (ok, err) = lenderd_status(&c, &[], None);
    assert!(!ok);
    assert!(err.contains("no cluster token"), "{err}");
    let empty = c.dir.path().join("empty");
    ntb::config::write_token_file(&empty, "  \n").unwrap();
    let (ok, err) = lenderd_status(&c, &["--token-file", empty.to_str().unwrap()], None);
    assert!(!ok);
    assert!(err.contains("is empty"), "{err}");
    let (ok, err) = lenderd_status(&c, &["--token-file", "/nonexistent/tok"], None);
    assert!(!ok);
    assert!(err.contains("token file /nonexistent/tok"), "{err}");
    let (ok, err) = lenderd_status(&c, &["--token", "a", "--token-file", "/x"], None);
    assert!(!ok);
    assert!(err.contains("cannot be used with"), "{err}");
    // A weak token is refused by name and minimum, from the flag or the environment.
    let (ok, err) = lenderd_status(&c, &["--token", "s3cret"], None);
    assert!(!ok);
    assert!(
        err.contains(
            "the cluster token from --token is too weak: it is 6 bytes long, the minimum is 32"
        ),
        "{err}"
    );
    let (ok, err) = lenderd_status(&c, &[], Some("abababababababababababababababab"));
    assert!(!ok);
    assert!(
        err.contains("from $LENDVM_TOKEN is too weak: it has 2 distinct characters"),
        "{err}"
    );

    // An explicit token file wins over a stale $LENDVM_TOKEN.
    let tok = c.dir.path().join("tok");
    // A token file others may read is refused, naming the file and its mode.
    std::fs::write(&tok, format!("{TOKEN}\n")).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tok, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let out = Command::new(env!("CARGO_BIN_EXE_lenderd"))
        .args(["--node", LENDER, "--cluster"])
        .arg(&c.path)
        .args(["--device", "0000:00:04.0=dmatest", "--token-file"])
        .arg(&tok)
        .env_remove("LENDVM_TOKEN")
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("token file {} has mode 0644", tok.display())),
        "{err}"
    );
    std::fs::remove_file(&tok).unwrap();
    ntb::config::write_token_file(&tok, &format!("{TOKEN}\n")).unwrap();
    let log = c.dir.path().join("lenderd-prec.log");
    let child = Command::new(env!("CARGO_BIN_EXE_lenderd"))
        .args(["--node", LENDER, "--cluster"])
        .arg(&c.path)
        .args(["--device", "0000:00:04.0=dmatest", "--token-file"])
        .arg(&tok)
        .env("LENDVM_TOKEN", "stale")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let _d = Lenderd { child, log };
    let cl = connect(&c);
    assert_eq!(cl.list().unwrap().len(), 1);
}

#[test]
fn lenderd_reads_the_token_from_the_cluster_file() {
    let c = cluster(FabricKind::Shm);
    let tok = c.dir.path().join("tok");
    ntb::config::write_token_file(&tok, &format!("{TOKEN}\n")).unwrap();
    // Top-level keys must precede the tables: put token_file first.
    let original = std::fs::read_to_string(&c.path).unwrap();
    std::fs::write(&c.path, format!("token_file = \"tok\"\n{original}")).unwrap();
    let log = c.dir.path().join("lenderd-cluster-token.log");
    let child = Command::new(env!("CARGO_BIN_EXE_lenderd"))
        .args(["--node", LENDER, "--cluster"])
        .arg(&c.path)
        .args(["--device", "0000:00:04.0=dmatest"])
        .env_remove("LENDVM_TOKEN")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let _d = Lenderd { child, log };
    let cl = connect(&c);
    assert_eq!(cl.list().unwrap().len(), 1);

    // A cluster file naming a missing token file is refused with its path.
    std::fs::remove_file(&tok).unwrap();
    let (ok, err) = lenderd_status(&c, &[], None);
    assert!(!ok);
    assert!(err.contains("tok"), "{err}");
}
