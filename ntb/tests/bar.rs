//! The `bar` fabric: tcp links whose windows inside a shared region are mapped directly by
//! the peer (as a lender maps a borrower's RAM through an NTB BAR), and everything else as on
//! tcp. Both ends run here on one host and map the same file; in the nested-QEMU set-up the
//! lender maps it from the ivshmem device's sysfs `resource2` instead (scripts/test-vfio.sh).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use ntb::{
    connect_addr, listen_addr, ClusterConfig, ControlAddr, ControlPath, Endpoint, FabricError,
    FabricKind, Incoming, LinkConfig, Message, NodeId, RegionSpec, SharedMemory, SocketFabric,
};

const T: Duration = Duration::from_secs(5);

/// The lender's end and the borrower's.
type Pair = (Box<dyn Endpoint>, Box<dyn Endpoint>);

fn region_file(path: &Path, size: u64) {
    File::create(path).unwrap().set_len(size).unwrap();
}

fn cfg(region: Option<&Path>) -> LinkConfig {
    cfg_rings(region, ntb::region::DEFAULT_RING_SLOTS)
}

/// [`cfg`] with `rings` control-ring slots (0: `control_path = "tcp"`).
fn cfg_rings(region: Option<&Path>, rings: u32) -> LinkConfig {
    LinkConfig {
        heartbeat: Duration::from_millis(50),
        peer_timeout: Duration::from_millis(2000),
        region: region.map(|p| RegionSpec::file(p).unwrap().with_rings(rings).unwrap()),
        ..LinkConfig::default()
    }
}

/// Lender "a" listens with `lender_region`, borrower "b" connects with `borrower_region`.
fn pair(lender_region: Option<&Path>, borrower_region: Option<&Path>) -> Result<Pair, FabricError> {
    pair_within(lender_region, borrower_region, T)
}

/// [`pair`], the lender accepting for at most `accept` (short where the link must fail).
fn pair_within(
    lender_region: Option<&Path>,
    borrower_region: Option<&Path>,
    accept: Duration,
) -> Result<Pair, FabricError> {
    pair_cfg(cfg(lender_region), cfg(borrower_region), accept)
}

/// A lender with `lcfg` and a borrower with `bcfg`.
fn pair_cfg(lcfg: LinkConfig, bcfg: LinkConfig, accept: Duration) -> Result<Pair, FabricError> {
    let l = listen_addr(
        &ControlAddr::Tcp("127.0.0.1:0".parse().unwrap()),
        &NodeId::new("a").unwrap(),
        &lcfg,
    )
    .unwrap();
    let addr = l.local_addr();
    let t = std::thread::spawn(move || connect_addr(&addr, &NodeId::new("b").unwrap(), &bcfg));
    let a = l.accept(Some(accept));
    let b = t.join().unwrap()?;
    Ok((a?, b))
}

#[test]
fn windows_in_the_region_are_mapped_directly_and_others_go_by_message() {
    let dir = tempfile::tempdir().unwrap();
    let region = dir.path().join("ivshmem");
    region_file(&region, 4 << 20);
    let (lender, borrower) = pair(Some(&region), Some(&region)).unwrap();
    assert_eq!(lender.kind(), FabricKind::Bar);
    assert_eq!(borrower.kind(), FabricKind::Bar);
    assert!(
        matches!(borrower.control_path(), ControlPath::Ring { .. }),
        "{}",
        borrower.control_path()
    );

    // Guest RAM at 1 MiB into the region: the lender maps the same offset of its own view.
    let ram = File::options()
        .read(true)
        .write(true)
        .open(&region)
        .unwrap();
    let _w = borrower
        .export_window(ram.as_fd(), 1 << 20, 64 << 10, "ram0")
        .unwrap();
    let info = lender.wait_peer_window("ram0", T).unwrap();
    let m = lender.map_peer_window(info.id).unwrap();
    let p = m.as_ptr().unwrap();
    let before = lender.stats().window_io_frames;
    // SAFETY: `p` maps the window's 64 KiB; 5 bytes at offset 0x100 are inside it.
    unsafe { std::ptr::copy_nonoverlapping(b"hello".as_ptr(), p.add(0x100), 5) };
    let mut seen = [0u8; 5];
    ram.read_exact_at(&mut seen, (1 << 20) + 0x100).unwrap();
    assert_eq!(
        &seen, b"hello",
        "the store landed in the region at the window's offset"
    );
    m.write_at(0x200, b"world").unwrap();
    ram.read_exact_at(&mut seen, (1 << 20) + 0x200).unwrap();
    assert_eq!(&seen, b"world");
    assert_eq!(
        lender.stats().window_io_frames,
        before,
        "direct accesses send no window messages"
    );

    // Memory outside the region (a device BAR, a memfd) is served by messages, as on tcp.
    let mem = SharedMemory::new("bar", 1 << 16).unwrap();
    let _x = lender.export_window(mem.fd(), 0, 1 << 16, "bar0").unwrap();
    let w = borrower
        .map_peer_window(borrower.wait_peer_window("bar0", T).unwrap().id)
        .unwrap();
    let e = w.as_ptr().unwrap_err();
    assert!(
        matches!(e, FabricError::DirectMappingUnsupported { .. }),
        "{e}"
    );
    w.write_at(8, b"trapped").unwrap();
    let mut back = [0u8; 7];
    mem.read_at(8, &mut back).unwrap();
    assert_eq!(&back, b"trapped");

    // No fds cross a bar link.
    let e = borrower.peer_doorbell_eventfd(0).unwrap_err();
    assert!(
        matches!(e, FabricError::DirectMappingUnsupported { .. }),
        "{e}"
    );
}

#[test]
fn a_window_beyond_the_peers_region_is_refused_and_ones_beyond_ours_are_not_sent() {
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small");
    let big = dir.path().join("big");
    region_file(&small, 1 << 20);
    region_file(&big, 4 << 20);
    // The borrower believes in a 4 MiB region, the lender's view is 1 MiB: a window at 2 MiB
    // names memory the lender cannot reach, and the lender refuses it (it never appears).
    // (Two views that disagree cannot share control rings either: control stays on tcp.)
    let (lender, borrower) =
        pair_cfg(cfg_rings(Some(&small), 0), cfg_rings(Some(&big), 0), T).unwrap();
    assert_eq!(borrower.control_path(), ControlPath::Tls);
    let f = File::options().read(true).write(true).open(&big).unwrap();
    let _w = borrower
        .export_window(f.as_fd(), 2 << 20, 64 << 10, "far")
        .unwrap();
    let _ok = borrower
        .export_window(f.as_fd(), 0, 64 << 10, "near")
        .unwrap();
    lender.wait_peer_window("near", T).unwrap();
    let e = lender
        .wait_peer_window("far", Duration::from_millis(300))
        .unwrap_err();
    assert!(matches!(e, FabricError::Timeout { .. }), "{e}");
    assert!(lender.is_up(), "a refused window does not end the link");

    // The exporter checks its own side first: a range past the end of its region.
    let e = borrower
        .export_window(f.as_fd(), 4 << 20, 4096, "past")
        .unwrap_err();
    assert!(
        e.to_string().contains("4194304") || e.to_string().contains("0x400"),
        "{e}"
    );
}

#[test]
fn bad_regions_and_mismatched_kinds_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let odd = dir.path().join("odd");
    region_file(&odd, 3 << 20);
    let good = dir.path().join("good");
    region_file(&good, 1 << 20);

    // A region whose size is not a power of two cannot be a BAR: the link says so.
    let e = pair_within(Some(&good), Some(&odd), Duration::from_millis(500))
        .err()
        .expect("refused");
    assert!(e.to_string().contains("not a power of two"), "{e}");
    assert!(e.to_string().contains("odd"), "names the file: {e}");

    // A bar lender and a tcp borrower do not link.
    let e = pair_within(Some(&good), None, Duration::from_millis(500))
        .err()
        .expect("refused");
    assert!(e.to_string().contains("bar"), "{e}");
}

#[test]
fn cluster_files_name_what_a_bar_node_lacks() {
    let base = |extra: &str| {
        format!(
            "token = \"0123456789abcdefghijklmnopqrstuvwxyzABCD\"\n[[node]]\nname = \"l1\"\n\
             fabric = \"bar\"\ncontrol = \"127.0.0.1:7000\"\n{extra}"
        )
    };
    let err = |s: &str| ClusterConfig::parse(s, "t.toml").unwrap_err().to_string();
    let e = err(&base(""));
    assert!(e.contains("needs its shared region"), "{e}");
    let e = err(&base("region = \"rel\"\n"));
    assert!(e.contains("absolute"), "{e}");
    let e = err(&base("region_device = \"00:03.0\"\n"));
    assert!(e.contains("not a PCI address"), "{e}");
    let e = err(&base("region = \"/dev/shm/x\"\nregion_bar = 2\n"));
    assert!(e.contains("region_bar needs region_device"), "{e}");
    let e = err(&base(
        "region = \"/dev/shm/x\"\nregion_device = \"0000:00:03.0\"\n",
    ));
    assert!(e.contains("not both"), "{e}");
    let e = err(
        "token = \"0123456789abcdefghijklmnopqrstuvwxyzABCD\"\n[[node]]\nname = \"t\"\n\
         fabric = \"tcp\"\ncontrol = \"127.0.0.1:7000\"\nregion = \"/dev/shm/x\"\n",
    );
    assert!(e.contains("tcp node has no shared region"), "{e}");

    let e = err(&base("region = \"/dev/shm/x\"\ncontrol_path = \"pipe\"\n"));
    assert!(e.contains("unknown control_path \"pipe\""), "{e}");
    let e = err(&base(
        "region = \"/dev/shm/x\"\ncontrol_path = \"tcp\"\ncontrol_rings = 4\n",
    ));
    assert!(
        e.contains("control_rings needs control_path = \"ring\""),
        "{e}"
    );
    let e = err(&base("region = \"/dev/shm/x\"\ncontrol_rings = 0\n"));
    assert!(e.contains("at least 1"), "{e}");
    let e = err(&base("region = \"/dev/shm/x\"\ncontrol_rings = 100000\n"));
    assert!(e.contains("more than 256 ring slots"), "{e}");
    let e = err(
        "token = \"0123456789abcdefghijklmnopqrstuvwxyzABCD\"\n[[node]]\nname = \"t\"\n\
         fabric = \"tcp\"\ncontrol = \"127.0.0.1:7000\"\ncontrol_path = \"ring\"\n",
    );
    assert!(
        e.contains("no shared region to put control rings in"),
        "{e}"
    );
    let rings = |extra: &str| {
        let c = ClusterConfig::parse(&base(extra), "t.toml").unwrap();
        c.node("l1").unwrap().link.region.as_ref().unwrap().rings()
    };
    assert_eq!(
        rings("region = \"/dev/shm/x\"\n"),
        ntb::region::DEFAULT_RING_SLOTS
    );
    assert_eq!(rings("region = \"/dev/shm/x\"\ncontrol_rings = 3\n"), 3);
    assert_eq!(
        rings("region = \"/dev/shm/x\"\ncontrol_path = \"tcp\"\n"),
        0
    );

    let c = ClusterConfig::parse(&base("region_device = \"0000:00:03.0\"\n"), "t.toml").unwrap();
    let n = c.node("l1").unwrap();
    assert_eq!(n.fabric, FabricKind::Bar);
    assert_eq!(
        n.link.region.as_ref().unwrap().path(),
        Path::new("/sys/bus/pci/devices/0000:00:03.0/resource2")
    );
    SocketFabric::from_cluster(&c, "l1").unwrap();
}

/// The u64 at `off` of `file`.
fn u64_in(file: &Path, off: u64) -> u64 {
    let mut b = [0u8; 8];
    File::open(file)
        .unwrap()
        .read_exact_at(&mut b, off)
        .unwrap();
    u64::from_le_bytes(b)
}

/// Requests, replies, events and doorbells of a bar link go through its ring slot at the
/// region's end: both ends name the same slot, the slot holds the ring's magic, and its
/// indices count the bytes that went by.
#[test]
fn control_goes_through_rings_at_the_regions_end() {
    let dir = tempfile::tempdir().unwrap();
    let region = dir.path().join("ivshmem");
    region_file(&region, 4 << 20);
    let (lender, borrower) = pair(Some(&region), Some(&region)).unwrap();
    let ControlPath::Ring { slot, offset } = borrower.control_path() else {
        panic!("control through {}", borrower.control_path());
    };
    assert_eq!(lender.control_path(), borrower.control_path());
    let area = u64::from(ntb::region::DEFAULT_RING_SLOTS) * ntb::region::RING_SLOT_SIZE;
    assert_eq!(
        offset,
        (4 << 20) - area + u64::from(slot) * ntb::region::RING_SLOT_SIZE
    );
    assert_eq!(&u64_in(&region, offset).to_le_bytes(), b"LVRING01");
    let before = u64_in(&region, offset + 0x40);

    // A request answered by the lender, many times, of growing sizes (past the ring's size).
    let server = std::thread::spawn(move || {
        for _ in 0..40 {
            match lender.recv(T).unwrap() {
                Incoming::Request { id, msg } => {
                    let mut p = msg.payload;
                    p.reverse();
                    lender.reply(id, Ok(Message::raw(0x101, p))).unwrap();
                }
                other => panic!("{other:?}"),
            }
        }
        lender.ring_peer(1 << 3).unwrap();
        lender
    });
    for i in 0..40usize {
        let p: Vec<u8> = (0..i * 1500).map(|b| (b * 7 + i) as u8).collect();
        let r = borrower.request(Message::raw(0x100, p.clone()), T).unwrap();
        let mut want = p;
        want.reverse();
        assert_eq!(r.payload, want, "reply {i}");
    }
    let lender = server.join().unwrap();
    assert_eq!(borrower.wait_doorbell(1 << 3, T).unwrap(), 1 << 3);
    let sent = u64_in(&region, offset + 0x40) - before;
    assert!(
        sent > (0..40u64).map(|i| i * 1500).sum::<u64>(),
        "the borrower's ring carried {sent} bytes"
    );
    assert!(lender.is_up() && borrower.is_up());
}

/// `control_path = "tcp"` on either side keeps a bar link's control on TLS (windows in the
/// region are still mapped directly).
#[test]
fn control_path_tcp_on_either_side_keeps_control_on_tls() {
    let dir = tempfile::tempdir().unwrap();
    let region = dir.path().join("ivshmem");
    region_file(&region, 4 << 20);
    for (l, b) in [(0, 8), (8, 0), (0, 0)] {
        let (lender, borrower) =
            pair_cfg(cfg_rings(Some(&region), l), cfg_rings(Some(&region), b), T).unwrap();
        assert_eq!(borrower.control_path(), ControlPath::Tls, "{l} {b}");
        assert_eq!(lender.control_path(), ControlPath::Tls, "{l} {b}");
        assert_eq!(lender.kind(), FabricKind::Bar);
        borrower.ring_peer(1).unwrap();
        assert_eq!(lender.wait_doorbell(1, T).unwrap(), 1);
    }
}

/// More links than ring slots: the ones beyond run their control on TLS; a slot is free
/// again once its link is gone.
#[test]
fn links_beyond_the_ring_slots_fall_back_to_tls_and_slots_come_back() {
    let dir = tempfile::tempdir().unwrap();
    let region = dir.path().join("ivshmem");
    region_file(&region, 4 << 20);
    let l = listen_addr(
        &ControlAddr::Tcp("127.0.0.1:0".parse().unwrap()),
        &NodeId::new("a").unwrap(),
        &cfg_rings(Some(&region), 2),
    )
    .unwrap();
    let addr = l.local_addr();
    let mut links = Vec::new();
    for _ in 0..3 {
        let (a, bcfg) = (addr.clone(), cfg_rings(Some(&region), 2));
        let t = std::thread::spawn(move || connect_addr(&a, &NodeId::new("b").unwrap(), &bcfg));
        let lender = l.accept(Some(T)).unwrap();
        links.push((lender, t.join().unwrap().unwrap()));
    }
    let paths: Vec<_> = links.iter().map(|(_, b)| b.control_path()).collect();
    assert!(matches!(paths[0], ControlPath::Ring { .. }), "{paths:?}");
    assert!(matches!(paths[1], ControlPath::Ring { .. }), "{paths:?}");
    assert_ne!(paths[0], paths[1]);
    assert_eq!(paths[2], ControlPath::Tls, "{paths:?}");
    let (lender0, borrower0) = links.remove(0);
    borrower0.close();
    lender0.wait_gone(T).unwrap();
    drop((lender0, borrower0));
    // The slot comes back when the lender's pump ends (the TCP end follows the close).
    let t0 = std::time::Instant::now();
    loop {
        let (a, bcfg) = (addr.clone(), cfg_rings(Some(&region), 2));
        let t = std::thread::spawn(move || connect_addr(&a, &NodeId::new("b").unwrap(), &bcfg));
        let lender = l.accept(Some(T)).unwrap();
        let b = t.join().unwrap().unwrap();
        if b.control_path() == paths[0] {
            break;
        }
        assert!(
            t0.elapsed() < T,
            "slot 0 never came back: {}",
            b.control_path()
        );
        drop((lender, b));
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A borrower whose `region` is not the memory behind the lender's: the ring's nonce is not
/// where the lender put it, and the link fails at set-up saying so.
#[test]
fn a_borrower_whose_region_is_other_memory_is_told_at_link_set_up() {
    let dir = tempfile::tempdir().unwrap();
    let lenders = dir.path().join("lenders");
    let other = dir.path().join("other");
    region_file(&lenders, 4 << 20);
    region_file(&other, 4 << 20);
    let e = pair_within(Some(&lenders), Some(&other), Duration::from_millis(1500))
        .err()
        .expect("refused");
    let e = e.to_string();
    assert!(
        e.contains("not the memory behind the lender's") && e.contains("other"),
        "{e}"
    );
}

/// A region too small for its rings is refused when the link opens it, naming the numbers
/// and the settings to change.
#[test]
fn a_region_too_small_for_its_rings_is_a_clear_error_at_link_set_up() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = dir.path().join("tiny");
    region_file(&tiny, 256 << 10);
    let e = pair_within(Some(&tiny), Some(&tiny), Duration::from_millis(1500))
        .err()
        .expect("refused");
    let e = e.to_string();
    assert!(
        e.contains("too small for its 8 control rings")
            && e.contains("control_rings")
            && e.contains("tiny"),
        "{e}"
    );
}

/// A peer that writes garbage into the ring's indices: the link is dropped at once on both
/// ends (counted in `ntb::ring::violations`), the process lives on, and the next link over
/// the same region works.
#[test]
fn garbage_in_the_ring_drops_the_link_not_the_process_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let region = dir.path().join("ivshmem");
    region_file(&region, 4 << 20);
    let (lender, borrower) = pair(Some(&region), Some(&region)).unwrap();
    let ControlPath::Ring { offset, .. } = borrower.control_path() else {
        panic!("control through {}", borrower.control_path());
    };
    let before = ntb::ring::violations();
    // Every index and flag of both directions, as a wild peer (or a stray DMA) would.
    File::options()
        .write(true)
        .open(&region)
        .unwrap()
        .write_all_at(&[0xff; 0x1c0], offset + 0x40)
        .unwrap();
    let gone = lender.wait_gone(T).unwrap();
    borrower.wait_gone(T).unwrap();
    assert!(ntb::ring::violations() > before, "not counted");
    assert!(!lender.is_up() && !borrower.is_up(), "{gone}");
    // The region and this process are fine: a new link works.
    let (lender, borrower) = pair(Some(&region), Some(&region)).unwrap();
    borrower.ring_peer(1).unwrap();
    assert_eq!(lender.wait_doorbell(1, T).unwrap(), 1);
}

/// A flood of large one-way messages through a ring to a reader that takes them slowly: the
/// sender is held back (the ring and the sockets are bounded), and every byte arrives, in
/// order.
#[test]
fn a_full_ring_holds_the_sender_back_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let region = dir.path().join("ivshmem");
    region_file(&region, 4 << 20);
    let (lender, borrower) = pair(Some(&region), Some(&region)).unwrap();
    assert!(matches!(borrower.control_path(), ControlPath::Ring { .. }));
    const N: usize = 64;
    let sender = std::thread::spawn(move || {
        for i in 0..N {
            let p: Vec<u8> = (0..(256 << 10)).map(|b: usize| (b ^ i) as u8).collect();
            borrower.send(Message::raw(0x100, p)).unwrap();
        }
        borrower
    });
    for i in 0..N {
        if i % 8 == 0 {
            std::thread::sleep(Duration::from_millis(50));
        }
        match lender.recv(T).unwrap() {
            Incoming::Event(m) => {
                assert_eq!(m.payload.len(), 256 << 10, "message {i}");
                assert!(
                    m.payload
                        .iter()
                        .enumerate()
                        .all(|(b, &x)| x == (b ^ i) as u8),
                    "message {i} arrived changed"
                );
            }
            other => panic!("{other:?}"),
        }
    }
    let borrower = sender.join().unwrap();
    assert!(borrower.is_up() && lender.is_up());
}
