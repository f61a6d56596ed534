//! The real `lenderd`, with the default cluster link settings, refuses to map a borrower's DMA
//! window whose memfd could shrink under it (`require_sealed_windows` is on by default), with
//! an error that says why, and maps a sealed one on the same lease.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::fd::{AsFd, FromRawFd, OwnedFd};

use common::{Cluster, Fabric, DMATEST_BDF, LENDER, TOKEN};
use lending::client::{ClientError, LenderClient};
use ntb::SharedMemory;

const SIZE: u64 = 0x10000;
const IOVA: u64 = 0x10_0000;

/// A memfd as a careless exporter makes it: sealing allowed, but no seals added.
fn unsealed_memfd() -> OwnedFd {
    // SAFETY: valid NUL-terminated name; the result is checked.
    let raw = unsafe {
        libc::memfd_create(
            c"unsealed-ram".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    assert!(raw >= 0, "{}", std::io::Error::last_os_error());
    // SAFETY: a fresh fd nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    std::fs::File::from(fd.try_clone().unwrap())
        .set_len(SIZE)
        .unwrap();
    fd
}

#[test]
fn lenderd_refuses_an_unsealed_dma_window_by_default() {
    let cluster = Cluster::new(Fabric::Shm);
    assert!(
        !std::fs::read_to_string(&cluster.path)
            .unwrap()
            .contains("require_sealed_windows"),
        "the cluster file must leave the setting at its default"
    );
    let _lender = cluster.start_lenderd(&[format!("{DMATEST_BDF}=dmatest")]);
    let cl = LenderClient::connect(&cluster.cfg, "node9", LENDER, TOKEN, "seal-test").unwrap();
    let lease = cl.borrow(DMATEST_BDF, "sealtest").unwrap();

    let fd = unsealed_memfd();
    let win = cl
        .endpoint()
        .export_window(fd.as_fd(), 0, SIZE, "unsealed-ram")
        .unwrap();
    let e = lease.map_dma(IOVA, SIZE, win.id()).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, ClientError::Remote { .. }), "{m}");
    assert!(
        m.contains("\"unsealed-ram\"")
            && m.contains("without F_SEAL_SHRINK")
            && m.contains("refusing to map it"),
        "{m}"
    );
    assert!(cluster.device(DMATEST_BDF).dma_maps.is_empty());

    // The lease and the link survive; a sealed window maps.
    let mem = SharedMemory::new("sealed-ram", SIZE).unwrap();
    let win2 = cl
        .endpoint()
        .export_window(mem.fd(), 0, SIZE, "sealed-ram")
        .unwrap();
    lease.map_dma(IOVA, SIZE, win2.id()).unwrap();
    assert_eq!(cluster.device(DMATEST_BDF).dma_maps.len(), 1);
    lease.return_device().unwrap();
    drop((win, win2));
}
