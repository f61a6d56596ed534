//! Pre-authentication exhaustion against an in-process lender on tcp (issue 25, item 4):
//! - 200 silent or slow peers from one address do not keep a real borrower from another
//!   address out (each source holds at most its share of the handshake slots);
//! - links that complete the fabric handshake and then never authenticate are capped per
//!   source, and each is closed at the AUTH deadline, which gives its place back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use emulated::NotifyMode;
use lending::backend::emulated::EmulatedBackend;
use lending::inventory::Inventory;
use lending::server::{BackgroundLender, Lender, MAX_UNAUTHENTICATED_PER_SOURCE};
use lending::LenderClient;
use ntb::{ClusterConfig, Endpoint, Fabric, NodeId, SocketFabric};

const TOKEN: &str = "preauth-cluster-token-0123456789abcdef";
const DEV: &str = "0000:00:06.0";
const T: Duration = Duration::from_secs(10);

struct Rig {
    cfg: ClusterConfig,
    lender: BackgroundLender,
}

/// A lender and a borrower node `vmm` on tcp (loopback).
fn rig() -> Rig {
    let port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let (pl, pv) = (port(), port());
    let src = format!(
        "version = 1\n\
         [[node]]\nname = \"lender\"\nfabric = \"tcp\"\ncontrol = \"127.0.0.1:{pl}\"\n\
         [[node]]\nname = \"vmm\"\nfabric = \"tcp\"\ncontrol = \"127.0.0.1:{pv}\"\n"
    );
    let cfg = ClusterConfig::parse(&src, "preauth.toml").unwrap();
    let backend = Arc::new(EmulatedBackend::dmatest("preauth", NotifyMode::Interrupt).unwrap());
    let inv = Arc::new(Inventory::new(vec![(DEV.to_string(), backend as _)]).unwrap());
    let listener = SocketFabric::from_cluster(&cfg, "lender")
        .unwrap()
        .listen()
        .unwrap();
    let lender = BackgroundLender::start(Lender::new(inv, "lender", TOKEN), listener).unwrap();
    Rig { cfg, lender }
}

impl Rig {
    fn lender_addr(&self) -> SocketAddr {
        match &self.cfg.node("lender").unwrap().control {
            ntb::ControlAddr::Tcp(a) => *a,
            other => panic!("{other}"),
        }
    }

    /// A real borrower: connects, authenticates, borrows, reads config space.
    fn borrower_works(&self) {
        let lender = self.cfg.node("lender").unwrap();
        let c = LenderClient::connect_node(
            &self.cfg,
            lender,
            &NodeId::new("vmm").unwrap(),
            T,
            TOKEN,
            "preauth-test",
        )
        .unwrap();
        assert_eq!(c.list().unwrap().len(), 1);
        let lease = c.borrow(DEV, "vm0").unwrap();
        assert_eq!(lease.config_read(0, 4).unwrap().len(), 4);
        lease.return_device().unwrap();
    }

    /// A link that completes the fabric handshake (TLS and hello) and then sends nothing.
    fn silent_link(&self) -> Box<dyn Endpoint> {
        let lender = self.cfg.node("lender").unwrap();
        ntb::connect_addr(&lender.control, &NodeId::new("vmm").unwrap(), &lender.link).unwrap()
    }
}

/// A tcp connection to `to` from `from` (another loopback address).
fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(&from.parse::<SocketAddr>().unwrap().into()).unwrap();
    s.connect(&to.into()).unwrap();
    s.into()
}

#[test]
fn two_hundred_silent_or_slow_peers_from_one_address_do_not_keep_a_borrower_out() {
    let r = rig();
    let to = r.lender_addr();
    // 200 peers from 127.0.0.2: half never send a byte, half start a TLS record and stall.
    let mut peers = Vec::new();
    for i in 0..200 {
        let mut s = connect_from("127.0.0.2:0", to);
        if i % 2 == 1 {
            s.write_all(&[0x16, 0x03]).unwrap();
        }
        peers.push(s);
    }
    // While they all hold their connections, a borrower from 127.0.0.1 gets in and works.
    r.borrower_works();
    // And again, after the lender has seen every one of them.
    std::thread::sleep(Duration::from_millis(200));
    r.borrower_works();
    drop(peers);
}

/// Waits (bounded) until `ep` is down.
fn gone_within(ep: &dyn Endpoint, limit: Duration) -> bool {
    ep.wait_gone(limit).is_ok()
}

#[test]
fn links_that_never_authenticate_are_capped_per_source() {
    let r = rig();
    r.lender.lender().set_auth_timeout(Duration::from_secs(120));
    let extra = 4;
    let links: Vec<Box<dyn Endpoint>> = (0..MAX_UNAUTHENTICATED_PER_SOURCE + extra)
        .map(|_| r.silent_link())
        .collect();
    // The links beyond the source's share are closed by the lender at once (bounded wait);
    // the others stay up, waiting for an AUTH that does not come.
    let t0 = Instant::now();
    let mut down = 0;
    while t0.elapsed() < T {
        down = links.iter().filter(|l| !l.is_up()).count();
        if down >= extra {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(down, extra, "links closed for being over the share");
    std::thread::sleep(Duration::from_millis(300));
    let down = links.iter().filter(|l| !l.is_up()).count();
    assert_eq!(down, extra, "the lender closed links within the share");
    // Once they go, the source's share is free again.
    drop(links);
    let t0 = Instant::now();
    loop {
        let lender = r.cfg.node("lender").unwrap();
        match LenderClient::connect_node(
            &r.cfg,
            lender,
            &NodeId::new("vmm").unwrap(),
            T,
            TOKEN,
            "preauth-test",
        ) {
            Ok(c) => {
                assert_eq!(c.list().unwrap().len(), 1);
                break;
            }
            Err(e) => assert!(t0.elapsed() < T, "borrower still refused: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_peer_that_completes_the_handshake_and_sends_nothing_is_dropped_at_its_deadline() {
    let r = rig();
    // A short deadline keeps the test short; the wait below is a bound, not a speed target.
    r.lender
        .lender()
        .set_auth_timeout(Duration::from_millis(500));
    let silent = r.silent_link();
    assert!(
        gone_within(silent.as_ref(), Duration::from_secs(30)),
        "the lender kept a link that never authenticated"
    );
    // Its place was given back: a full share of new silent links is still taken, and a real
    // borrower works.
    let more: Vec<Box<dyn Endpoint>> = (0..MAX_UNAUTHENTICATED_PER_SOURCE - 1)
        .map(|_| r.silent_link())
        .collect();
    r.borrower_works();
    drop(more);
}
