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
    connect_addr, listen_addr, ClusterConfig, ControlAddr, Endpoint, FabricError, FabricKind,
    LinkConfig, NodeId, RegionSpec, SharedMemory, SocketFabric,
};

const T: Duration = Duration::from_secs(5);

/// The lender's end and the borrower's.
type Pair = (Box<dyn Endpoint>, Box<dyn Endpoint>);

fn region_file(path: &Path, size: u64) {
    File::create(path).unwrap().set_len(size).unwrap();
}

fn cfg(region: Option<&Path>) -> LinkConfig {
    LinkConfig {
        heartbeat: Duration::from_millis(50),
        peer_timeout: Duration::from_millis(2000),
        region: region.map(|p| RegionSpec::file(p).unwrap()),
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
    let l = listen_addr(
        &ControlAddr::Tcp("127.0.0.1:0".parse().unwrap()),
        &NodeId::new("a").unwrap(),
        &cfg(lender_region),
    )
    .unwrap();
    let addr = l.local_addr();
    let bcfg = cfg(borrower_region);
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
    let (lender, borrower) = pair(Some(&small), Some(&big)).unwrap();
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

    let c = ClusterConfig::parse(&base("region_device = \"0000:00:03.0\"\n"), "t.toml").unwrap();
    let n = c.node("l1").unwrap();
    assert_eq!(n.fabric, FabricKind::Bar);
    assert_eq!(
        n.link.region.as_ref().unwrap().path(),
        Path::new("/sys/bus/pci/devices/0000:00:03.0/resource2")
    );
    SocketFabric::from_cluster(&c, "l1").unwrap();
}
