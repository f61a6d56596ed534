//! Access control against an in-process lender (issue 13): mutual authentication by the
//! cluster token, per-address failure limits, and leases that only their session can touch.
//!
//! - a borrower with the wrong token is refused by the lender (wrong proof), and one that
//!   sends the plain token (a borrower from before challenge–response) too;
//! - a rogue lender that does not know the token is refused by the borrower, and learns
//!   nothing from it: the borrower sends it only a fresh nonce, never the token or a HELLO;
//!   replaying a real lender's answer does not help it;
//! - an address that fails too often is refused even with the right token, for a while;
//! - a second connection cannot touch a lease it does not hold, whatever lease id it forges.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use emulated::NotifyMode;
use lending::auth::{self, Role, Transcript};
use lending::backend::emulated::EmulatedBackend;
use lending::client::{authenticate, ClientError};
use lending::inventory::Inventory;
use lending::protocol::{
    self, code, opcode, AuthChallenge, AuthResponse, BarRead, BarWrite, Borrow, ConfigRead,
    ConfigWrite, DmaMap, DmaUnmap, Hello, LeaseRef, Quiesce, Request, PROTOCOL_VERSION,
};
use lending::server::{BackgroundLender, Lender};
use lending::LenderClient;
use ntb::wire::ErrorReply;
use ntb::{ClusterConfig, Endpoint, Fabric, FabricError, Incoming, Message, NodeId, SocketFabric};

const TOKEN: &str = "access-control-cluster-token-0123456789";
const DEV: &str = "0000:00:06.0";
const T: Duration = Duration::from_secs(5);

struct Rig {
    _dir: tempfile::TempDir,
    cfg: ClusterConfig,
    _lender: Option<BackgroundLender>,
}

/// A cluster of `lender`, `vmm` and `vmm2` on shm; a lender with `token` if `real`.
fn rig(real: Option<&str>) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let node = |n: &str| {
        format!("[[node]]\nname = \"{n}\"\nfabric = \"shm\"\ncontrol = \"{d}/{n}.sock\"\n")
    };
    let src = format!(
        "version = 1\n{}{}{}",
        node("lender"),
        node("vmm"),
        node("vmm2")
    );
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, src).unwrap();
    let cfg = ClusterConfig::load(&path).unwrap();
    let lender = real.map(|token| {
        let backend = Arc::new(EmulatedBackend::dmatest("acl", NotifyMode::Interrupt).unwrap());
        let inv = Arc::new(Inventory::new(vec![(DEV.to_string(), backend as _)]).unwrap());
        let listener = SocketFabric::from_cluster(&cfg, "lender")
            .unwrap()
            .listen()
            .unwrap();
        BackgroundLender::start(Lender::new(inv, "lender", token), listener).unwrap()
    });
    Rig {
        _dir: dir,
        cfg,
        _lender: lender,
    }
}

fn link(cfg: &ClusterConfig, local: &str) -> Box<dyn Endpoint> {
    SocketFabric::from_cluster(cfg, local)
        .unwrap()
        .connect(&NodeId::new("lender").unwrap())
        .unwrap()
}

fn call(ep: &dyn Endpoint, op: u16, payload: Vec<u8>) -> Result<Message, ErrorReply> {
    match ep.request(Message::raw(op, payload), T) {
        Ok(m) => Ok(m),
        Err(FabricError::Remote(e)) => Err(e),
        Err(e) => panic!("{e}"),
    }
}

fn req(ep: &dyn Endpoint, r: &Request) -> Result<Message, ErrorReply> {
    let (op, p) = r.encode_versioned(PROTOCOL_VERSION).unwrap();
    call(ep, op, p)
}

fn hello(token: String) -> Request {
    Request::Hello(Hello {
        version: PROTOCOL_VERSION,
        token,
        client: "acl-test".into(),
    })
}

/// AUTH with a fresh nonce; the lender's answer and our nonce.
fn challenge(ep: &dyn Endpoint) -> (AuthResponse, [u8; auth::NONCE_LEN]) {
    let nb = auth::nonce().unwrap();
    let p = protocol::encode_reply(opcode::AUTH, &AuthChallenge { nonce: nb.to_vec() }).unwrap();
    let m = call(ep, opcode::AUTH, p).unwrap();
    (
        protocol::decode_reply(opcode::AUTH, &m.payload).unwrap(),
        nb,
    )
}

#[test]
fn wrong_token_and_plain_token_are_refused_by_the_lender() {
    let r = rig(Some(TOKEN));
    // A proof made with the wrong token: "bad token", and the link is closed.
    let ep = link(&r.cfg, "vmm");
    let (a, nb) = challenge(&*ep);
    let t = Transcript {
        borrower_nonce: &nb,
        lender_nonce: &a.nonce,
        borrower: "vmm",
        lender: "lender",
        binding: &[],
    };
    let bad = t.prove("not-the-token", Role::Borrower).unwrap();
    let e = req(&*ep, &hello(auth::encode_proof(&bad))).unwrap_err();
    assert_eq!(e.code, code::BAD_TOKEN, "{e}");
    assert_eq!(e.message, "bad token");
    assert!(ep.wait_gone(T).is_ok(), "the lender closes the link");

    // The plain token (a borrower from before challenge-response) is refused, with or
    // without an AUTH first: the token itself never authenticates.
    for with_auth in [false, true] {
        let ep = link(&r.cfg, "vmm");
        if with_auth {
            challenge(&*ep);
        }
        let e = req(&*ep, &hello(TOKEN.into())).unwrap_err();
        assert_eq!(e.code, code::BAD_TOKEN, "{e}");
        assert!(e.message.starts_with("bad token"), "{e}");
    }

    // A proof for another session (replayed) does not verify in a new one.
    let ep = link(&r.cfg, "vmm");
    let (a, nb) = challenge(&*ep);
    let old = Transcript {
        borrower_nonce: &nb,
        lender_nonce: &a.nonce,
        borrower: "vmm",
        lender: "lender",
        binding: &[],
    }
    .prove(TOKEN, Role::Borrower)
    .unwrap();
    req(&*ep, &hello(auth::encode_proof(&old))).unwrap();
    let ep2 = link(&r.cfg, "vmm");
    challenge(&*ep2);
    let e = req(&*ep2, &hello(auth::encode_proof(&old))).unwrap_err();
    assert_eq!(e.code, code::BAD_TOKEN, "{e}");

    // Requests before authenticating are refused.
    let ep = link(&r.cfg, "vmm");
    let e = req(&*ep, &Request::List).unwrap_err();
    assert_eq!(e.code, code::NO_HELLO, "{e}");

    // The right token works.
    let c = LenderClient::connect(&r.cfg, "vmm", "lender", TOKEN, "acl").unwrap();
    assert_eq!(c.list().unwrap().len(), 1);
}

#[test]
fn failed_authentications_lock_the_address_out() {
    let r = rig(Some(TOKEN));
    for _ in 0..auth::MAX_FAILURES {
        let e = LenderClient::connect(&r.cfg, "vmm", "lender", "guess", "acl")
            .err()
            .unwrap();
        assert!(
            matches!(e, ClientError::LenderNotAuthenticated { .. }),
            "{e}"
        );
    }
    // Same address (this uid on shm): refused even with the right token, for a while.
    let e = LenderClient::connect(&r.cfg, "vmm", "lender", TOKEN, "acl")
        .err()
        .unwrap();
    match &e {
        ClientError::Remote {
            code: c, message, ..
        } => {
            assert_eq!(*c, code::BAD_TOKEN);
            assert!(
                message.contains("too many failed authentications from uid="),
                "{message}"
            );
        }
        other => panic!("{other}"),
    }
}

/// A rogue lender at the lender's address, not knowing the token: records everything a
/// borrower sends and answers AUTH with `answer`.
fn rogue(
    cfg: &ClusterConfig,
    answer: impl Fn(&AuthChallenge) -> AuthResponse + Send + 'static,
) -> (Arc<Mutex<Vec<Message>>>, std::thread::JoinHandle<()>) {
    let listener = SocketFabric::from_cluster(cfg, "lender")
        .unwrap()
        .listen()
        .unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = Arc::clone(&seen);
    let h = std::thread::spawn(move || {
        let ep = listener.accept(Some(T)).unwrap();
        while let Ok(i) = ep.recv(Duration::from_secs(2)) {
            let Incoming::Request { id, msg } = i else {
                continue;
            };
            let reply = if msg.opcode == opcode::AUTH {
                let c: AuthChallenge = protocol::decode_reply(opcode::AUTH, &msg.payload).unwrap();
                let a = answer(&c);
                Ok(Message::raw(
                    opcode::AUTH,
                    protocol::encode_reply(opcode::AUTH, &a).unwrap(),
                ))
            } else {
                Err(ErrorReply::new(code::INTERNAL, "rogue"))
            };
            s2.lock().unwrap().push(msg);
            let _ = ep.reply(id, reply);
        }
    });
    (seen, h)
}

fn assert_learned_nothing(seen: &Mutex<Vec<Message>>) {
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1, "only the AUTH challenge reached the rogue");
    assert_eq!(seen[0].opcode, opcode::AUTH);
    for m in seen.iter() {
        assert!(
            !m.payload
                .windows(TOKEN.len())
                .any(|w| w == TOKEN.as_bytes()),
            "the token reached the rogue lender"
        );
    }
}

#[test]
fn rogue_lender_without_the_token_is_refused_and_learns_nothing() {
    let r = rig(None);
    // It guesses a token for its proof.
    let (seen, h) = rogue(&r.cfg, |c| {
        let nl = auth::nonce().unwrap();
        let proof = Transcript {
            borrower_nonce: &c.nonce,
            lender_nonce: &nl,
            borrower: "vmm",
            lender: "lender",
            binding: &[],
        }
        .prove("rogue-guess", Role::Lender)
        .unwrap();
        AuthResponse {
            node: "lender".into(),
            nonce: nl.to_vec(),
            proof: proof.to_vec(),
        }
    });
    let lender = r.cfg.node("lender").unwrap().clone();
    let e = LenderClient::connect_node(
        &r.cfg,
        &lender,
        &NodeId::new("vmm").unwrap(),
        T,
        TOKEN,
        "acl",
    )
    .err()
    .unwrap();
    match &e {
        ClientError::LenderNotAuthenticated {
            lender: l, addr, ..
        } => {
            assert_eq!(l, "lender");
            assert_eq!(addr, &lender.control.to_string(), "{e}");
        }
        other => panic!("{other}"),
    }
    let s = e.to_string();
    assert!(
        s.contains("lender lender at ") && s.contains("did not prove"),
        "{s}"
    );
    h.join().unwrap();
    assert_learned_nothing(&seen);
}

#[test]
fn replaying_a_real_lenders_answer_does_not_pass() {
    // Record a real lender's AUTH answer (for a nonce of our choosing)...
    let real = rig(Some(TOKEN));
    let ep = link(&real.cfg, "vmm");
    let (recorded, _) = challenge(&*ep);
    drop(ep);
    drop(real);
    // ...and replay it from a rogue at a fresh address: the borrower's nonce is new.
    let r = rig(None);
    let (seen, h) = rogue(&r.cfg, move |_| recorded.clone());
    let e = LenderClient::connect(&r.cfg, "vmm", "lender", TOKEN, "acl")
        .err()
        .unwrap();
    assert!(
        matches!(e, ClientError::LenderNotAuthenticated { .. }),
        "{e}"
    );
    h.join().unwrap();
    assert_learned_nothing(&seen);
}

#[test]
fn a_second_connection_cannot_touch_a_lease_it_does_not_hold() {
    let r = rig(Some(TOKEN));
    let owner = LenderClient::connect(&r.cfg, "vmm", "lender", TOKEN, "owner").unwrap();
    let lease = owner.borrow(DEV, "vm0").unwrap();
    let id = lease.id();
    let before = lease.config_read(0, 4).unwrap();

    // An authenticated second session, speaking the protocol by hand to forge ids.
    let ep = link(&r.cfg, "vmm2");
    let proof = authenticate(&*ep, TOKEN, T).unwrap();
    req(&*ep, &hello(proof)).unwrap();
    let e = req(
        &*ep,
        &Request::Borrow(Borrow {
            device: DEV.into(),
            vm: "thief".into(),
        }),
    )
    .unwrap_err();
    assert_eq!(e.code, code::DEVICE_BUSY, "{e}");
    for forged in [id, id.wrapping_add(1), id.wrapping_sub(1), 0, u64::MAX] {
        let l = LeaseRef { lease: forged };
        let attempts = [
            Request::DeviceInfo(l),
            Request::ConfigRead(ConfigRead {
                lease: forged,
                offset: 0,
                len: 4,
            }),
            Request::ConfigWrite(ConfigWrite {
                lease: forged,
                offset: 4,
                data: vec![0, 0],
            }),
            Request::BarRead(BarRead {
                lease: forged,
                bar: 0,
                offset: 0,
                len: 4,
            }),
            Request::BarWrite(BarWrite {
                lease: forged,
                bar: 0,
                offset: 0,
                data: vec![1, 2, 3, 4],
            }),
            Request::DmaMap(DmaMap {
                lease: forged,
                iova: 0,
                size: 4096,
                window: 1,
            }),
            Request::DmaUnmap(DmaUnmap {
                lease: forged,
                iova: 0,
                size: 4096,
            }),
            Request::Reset(l),
            Request::LeaseCounters(l),
            Request::Quiesce(Quiesce {
                lease: forged,
                stop: true,
            }),
            Request::Return(l),
        ];
        for a in &attempts {
            let e = req(&*ep, a).unwrap_err();
            assert_eq!(
                e.code,
                code::UNKNOWN_LEASE,
                "{a:?} with lease {forged}: {e}"
            );
        }
    }
    // The owner's lease is untouched and still works.
    assert_eq!(lease.config_read(0, 4).unwrap(), before);
    assert!(lease.info().bars.iter().any(|b| b.index == 0));
    lease.return_device().unwrap();
}

#[test]
fn a_relay_between_borrower_and_lender_cannot_pass_on_tcp() {
    // A real lender on tcp.
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
    let cfg = ClusterConfig::parse(&src, "relay.toml").unwrap();
    let backend = Arc::new(EmulatedBackend::dmatest("relay", NotifyMode::Interrupt).unwrap());
    let inv = Arc::new(Inventory::new(vec![(DEV.to_string(), backend as _)]).unwrap());
    let listener = SocketFabric::from_cluster(&cfg, "lender")
        .unwrap()
        .listen()
        .unwrap();
    let _l = BackgroundLender::start(Lender::new(inv, "lender", TOKEN), listener).unwrap();
    let real = cfg.node("lender").unwrap().clone();
    // The right token works directly.
    let vmm = NodeId::new("vmm").unwrap();
    LenderClient::connect_node(&cfg, &real, &vmm, T, TOKEN, "direct")
        .unwrap()
        .list()
        .unwrap();

    // A relay that answers as "lender" and forwards every request to the real lender over
    // its own link: it holds two TLS sessions.
    let link_cfg = real.link.clone();
    let relay = ntb::listen_addr(
        &ntb::ControlAddr::Tcp("127.0.0.1:0".parse().unwrap()),
        &NodeId::new("lender").unwrap(),
        &link_cfg,
    )
    .unwrap();
    let mut fake = real.clone();
    fake.control = relay.local_addr();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = Arc::clone(&seen);
    let (real_addr, c2) = (real.control.clone(), link_cfg.clone());
    let h = std::thread::spawn(move || {
        let b = relay.accept(Some(T)).unwrap();
        let up = ntb::connect_addr(&real_addr, &NodeId::new("vmm").unwrap(), &c2).unwrap();
        while let Ok(i) = b.recv(Duration::from_secs(2)) {
            let Incoming::Request { id, msg } = i else {
                continue;
            };
            s2.lock().unwrap().push(msg.opcode);
            let fwd = Message::raw(msg.opcode, msg.payload.clone());
            let r = match up.request(fwd, T) {
                Ok(m) => Ok(Message::raw(m.opcode, m.payload)),
                Err(FabricError::Remote(e)) => Err(e),
                Err(e) => Err(ErrorReply::new(code::INTERNAL, e.to_string())),
            };
            let _ = b.reply(id, r);
        }
    });
    let e = LenderClient::connect_node(&cfg, &fake, &vmm, T, TOKEN, "through-relay")
        .err()
        .unwrap();
    assert!(
        matches!(&e, ClientError::LenderNotAuthenticated { why, .. } if why.contains("does not verify")),
        "{e}"
    );
    h.join().unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        vec![opcode::AUTH],
        "the relay got no further than AUTH"
    );
}
