//! SR-IOV used as MR-IOV: the real `lenderd` lends an emulated NVMe PF with `vfs=2`, and its
//! functions go to different borrowers (each its own link and VM name), driven from this
//! process by `emulated::testing::NvmeDriver` (see `common`).
//!
//! * The inventory lists the PF and both VFs (kinds `nvme` and `nvme-vf`).
//! * VF 1 to `vm-a`, VF 2 to `vm-b`; VF 1 is busy for anyone else, and the PF is refused
//!   while a VF is lent (a PF reset would take the VFs away; see `lending::sriov`).
//! * Concurrent verified I/O: A and B (two threads) write different data to the *same* LBAs
//!   and read it back; each sees only its own. The backing file holds each function's data
//!   in its own slice.
//! * Resetting A, and then returning A's lease, while B keeps writing and verifying: B never
//!   sees an error, its controller stays ready; A's data survives both (reset, re-borrow).
//! * Once no VF is lent the PF goes to `vm-p`, writes its own slice (the VFs' data stays),
//!   and the VFs are refused while it is lent.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use emulated::nvme::spec::{REG_CSTS, REG_VS};
use emulated::testing::{DataBuf, NvmeDriver};
use lending::client::Lease;
use lending::protocol::DeviceState;
use ntb::FabricKind;
use rand::{Rng, SeedableRng};

const PF: &str = "0000:82:00.0";
const VF1: &str = "0000:82:00.1";
const VF2: &str = "0000:82:00.2";
/// Each function's namespace.
const NS_BYTES: u64 = 8 << 20;
const BLOCKS: u64 = NS_BYTES / 512;
/// 4 KiB extents at these LBAs (the same LBAs on every function).
const EXTENTS: u64 = 96;
const NLB: u32 = 8;
const BATCH: usize = 16;
const RAM: u64 = 16 << 20;

fn lba(i: u64) -> u64 {
    // Spread over the namespace, not 4 KiB aligned, last one ending at the last block.
    if i == EXTENTS - 1 {
        BLOCKS - u64::from(NLB)
    } else {
        i * 83 + 1
    }
}

fn data(seed: u64, lba: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ lba.wrapping_mul(0x9e37_79b9));
    let mut v = vec![0u8; 4096];
    rng.fill(&mut v[..]);
    v
}

fn bring_up(d: &mut NvmeDriver, serial: &str) {
    d.enable(32).unwrap();
    let id = d.identify_controller().unwrap();
    assert_eq!(id.serial, serial);
    assert_eq!(d.identify_namespace(1).unwrap(), (BLOCKS, 512));
    let (sq, cq) = d.set_num_queues(1).unwrap();
    assert!(sq >= 1 && cq >= 1);
    d.create_io_queue_pair(1, 64, 1).unwrap();
}

/// Writes (`write`) or reads and checks every extent with `seed`'s data, `BATCH` commands in
/// flight at a time.
fn pass(d: &mut NvmeDriver, bufs: &[DataBuf], seed: u64, write: bool) {
    let all: Vec<u64> = (0..EXTENTS).map(lba).collect();
    for chunk in all.chunks(BATCH) {
        for (k, &l) in chunk.iter().enumerate() {
            if write {
                bufs[k].fill(d.ram(), &data(seed, l));
            } else {
                bufs[k].fill(d.ram(), &[0xee; 4096]);
            }
            d.push(1, NvmeDriver::rw_sqe(write, l, NLB, &bufs[k]))
                .unwrap();
        }
        d.ring(1).unwrap();
        let mut out = Vec::new();
        d.wait(1, &mut out, chunk.len()).unwrap();
        assert_eq!(out.len(), chunk.len());
        for e in &out {
            assert_eq!(e.code(), 0, "{e:?}");
        }
        if !write {
            for (k, &l) in chunk.iter().enumerate() {
                assert!(
                    bufs[k].read(d.ram()) == data(seed, l),
                    "lba {l}: not the data written with seed {seed:#x}"
                );
            }
        }
    }
    if write {
        d.flush(1).unwrap();
    }
}

fn bufs(d: &mut NvmeDriver) -> Vec<DataBuf> {
    (0..BATCH)
        .map(|_| d.alloc_data(4096, 0, false).unwrap())
        .collect()
}

/// CSTS through a BAR_READ (the driver may be busy on another thread).
fn csts(lease: &Lease) -> u32 {
    u32::from_le_bytes(lease.bar_read(0, REG_CSTS, 4).unwrap().try_into().unwrap())
}

fn state(c: &Cluster, id: &str) -> DeviceState {
    connect(c)
        .list()
        .unwrap()
        .into_iter()
        .find(|d| d.id == id)
        .unwrap_or_else(|| panic!("lender lists no {id}"))
        .state
}

#[test]
fn two_vfs_two_borrowers_concurrent_io_isolation_and_reset_the_pf_refused_while_they_are_lent() {
    let c = cluster(FabricKind::Shm);
    let disk = c.dir.path().join("pf.img");
    let _d = start_lenderd(
        &c,
        "sriov",
        &[format!(
            "{PF}=nvme:path={},size={NS_BYTES},vfs=2",
            disk.display()
        )],
        TokenVia::Flag,
    );
    let list = connect(&c).list().unwrap();
    let rows: Vec<(&str, &str, u16)> = list
        .iter()
        .map(|d| (d.id.as_str(), d.kind.as_str(), d.device_id))
        .collect();
    assert_eq!(
        rows,
        [
            (PF, "nvme", 0x0010),
            (VF1, "nvme-vf", 0x0010),
            (VF2, "nvme-vf", 0x0010)
        ]
    );

    let direct = BarPath::Direct { notify: true };
    let mut a = lent_rig_as(&c, VF1, "vm-a", RAM, direct, &[], 2, true);
    let mut b = lent_rig_as(&c, VF2, "vm-b", RAM, direct, &[], 2, true);
    let e = connect(&c).borrow(VF1, "vm-b").err().unwrap().to_string();
    assert!(e.contains("busy") && e.contains("vm-a"), "{e}");
    // The PF is refused while its VFs are lent, with the reason, and stays available.
    let e = connect(&c).borrow(PF, "vm-p").err().unwrap().to_string();
    assert!(
        e.contains(&format!(
            "{PF} cannot be lent while its virtual function {VF1} is lent to"
        )) && e.contains("never lent at the same time"),
        "{e}"
    );
    assert_eq!(state(&c, PF), DeviceState::Available);
    // A VF has no INTx.
    assert_eq!(a.lease.info().irqs.intx, 0);

    bring_up(&mut a.driver, "LENDVM000082001");
    bring_up(&mut b.driver, "LENDVM000082002");
    let (ba, bb) = (bufs(&mut a.driver), bufs(&mut b.driver));

    // Phase 1: A and B write the same LBAs at the same time, then read back their own.
    let (sa, sb, sp) = (0xa1, 0xb1, 0x91);
    std::thread::scope(|s| {
        let ta = s.spawn(|| {
            pass(&mut a.driver, &ba, sa, true);
            pass(&mut a.driver, &ba, sa, false);
        });
        pass(&mut b.driver, &bb, sb, true);
        pass(&mut b.driver, &bb, sb, false);
        ta.join().unwrap();
    });

    // Phase 2: B keeps writing and verifying while A is reset, re-enabled, then returned and
    // borrowed again by another VM.
    let stop = AtomicBool::new(false);
    let rounds = AtomicU64::new(0);
    let last = std::thread::scope(|s| {
        let tb = s.spawn(|| {
            let t0 = Instant::now();
            let mut seed = 0xb2;
            // At least two full rounds, and until A's side is done (bounded).
            while (rounds.load(Ordering::Relaxed) < 2 || !stop.load(Ordering::Relaxed))
                && t0.elapsed() < Duration::from_secs(60)
            {
                pass(&mut b.driver, &bb, seed, true);
                pass(&mut b.driver, &bb, seed, false);
                rounds.fetch_add(1, Ordering::Relaxed);
                seed += 1;
            }
            seed - 1
        });
        assert_ne!(csts(&a.lease) & 1, 0, "a ready before the reset");
        a.lease.reset().unwrap();
        assert_eq!(csts(&a.lease) & 1, 0, "a's controller is reset");
        assert_eq!(
            a.driver.bar().read32(REG_VS),
            emulated::nvme::identify::VERSION,
            "registers back"
        );
        assert_ne!(csts(&b.lease) & 1, 0, "b is still ready");
        // A comes back up after its reset and its data is still there.
        bring_up(&mut a.driver, "LENDVM000082001");
        pass(&mut a.driver, &ba, sa, false);
        // A's VM goes away: the lease ends (BME off, DMA unmapped, FLR) and VF 1 is free.
        drop(a);
        let t0 = Instant::now();
        while state(&c, VF1) != DeviceState::Available && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(state(&c, VF1), DeviceState::Available);
        assert!(matches!(state(&c, VF2), DeviceState::Lent { ref vm, .. } if vm == "vm-b"));
        let mut a2 = lent_rig_as(&c, VF1, "vm-c", RAM, direct, &[], 2, true);
        bring_up(&mut a2.driver, "LENDVM000082001");
        let ba2 = bufs(&mut a2.driver);
        pass(&mut a2.driver, &ba2, sa, false);
        stop.store(true, Ordering::Relaxed);
        let last = tb.join().unwrap();
        assert!(rounds.load(Ordering::Relaxed) >= 2);
        assert_ne!(csts(&b.lease) & 1, 0, "b never lost its controller");
        drop(a2);
        last
    });
    // B's last data, and nothing of A's, on B's namespace.
    pass(&mut b.driver, &bb, last, false);
    let e = connect(&c).borrow(PF, "vm-p").err().unwrap().to_string();
    assert!(
        e.contains(&format!("virtual function {VF2} is lent to")),
        "{e}"
    );

    // Phase 3: no VF lent, the PF goes to vm-p (it has INTx) and writes its own slice; the
    // VFs are refused meanwhile.
    drop(b);
    let t0 = Instant::now();
    while state(&c, VF2) != DeviceState::Available && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut p = lent_rig_as(&c, PF, "vm-p", RAM, direct, &[], 2, true);
    assert_eq!(p.lease.info().irqs.intx, 1);
    let e = connect(&c).borrow(VF1, "vm-a").err().unwrap().to_string();
    assert!(
        e.contains(&format!(
            "{VF1} cannot be lent while its physical function {PF} is lent to"
        )),
        "{e}"
    );
    bring_up(&mut p.driver, "LENDVM000082000");
    let bp = bufs(&mut p.driver);
    pass(&mut p.driver, &bp, sp, true);
    pass(&mut p.driver, &bp, sp, false);
    // Each function's data sits in its own slice of the backing file.
    let f = std::fs::File::open(&disk).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 3 * NS_BYTES);
    for (slice, seed) in [(0, sp), (1, sa), (2, last)] {
        for i in [0, EXTENTS / 2, EXTENTS - 1] {
            let mut got = vec![0u8; 4096];
            f.read_exact_at(&mut got, slice * NS_BYTES + lba(i) * 512)
                .unwrap();
            assert!(got == data(seed, lba(i)), "slice {slice}, lba {}", lba(i));
        }
    }
    drop(p);
    let st = connect(&c).status().unwrap();
    for d in &st.devices {
        assert_eq!(d.iommu_faults, 0, "{d:?}");
    }
}

/// Bad `vfs=` values stop lenderd before it listens, with one line naming the problem; so
/// does a VF address that another `--device` already lends.
#[test]
fn bad_vfs_specs_are_refused_by_name() {
    let c = cluster(FabricKind::Shm);
    let disk = c.dir.path().join("pf.img");
    let d = disk.display();
    for (devs, needle) in [
        (
            vec![format!("{PF}=nvme:path={d},size=1M,vfs=64")],
            "vfs 64 is not in 1..=32",
        ),
        (
            vec![format!("{PF}=nvme:path={d},size=1M,vfs=x")],
            "vfs \"x\" is not a number of virtual functions",
        ),
        (vec![format!("{PF}=dmatest:vfs=2")], "dmatest has no sr-iov"),
        (
            vec![format!("{PF}=vfio:vfs=2")],
            "vfs=2 is not a vfio option",
        ),
        (
            vec![
                format!("{PF}=nvme:path={d},size=1M,vfs=2"),
                format!("{VF2}=dmatest"),
            ],
            "two devices at 0000:82:00.2: --device 0000:82:00.2 and virtual function 2 of \
             --device 0000:82:00.0",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lenderd"))
            .args(["--node", LENDER, "--cluster"])
            .arg(&c.path)
            .args(["--token", TOKEN])
            .args(devs.iter().flat_map(|s| ["--device", s.as_str()]))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{devs:?} accepted");
        assert!(err.contains(needle), "{devs:?}: {err}");
    }
}
