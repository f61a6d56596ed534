//! Test helper: plays node A (`serve`) or node B (`client`) of a two-process fabric test.
//!
//! Usage: `ntb-node serve|client shm|tcp ADDR SCENARIO`
//!
//! `serve` listens at ADDR (a Unix socket path, or ip:port; port 0 picks one) and prints
//! `LISTEN <addr>`; `client` connects to ADDR. Scenarios:
//!
//! * `basic`: A exports a 1 MiB window "buf"; B maps it and writes a pattern; A sees it in
//!   its own memory without any message; B rings A's doorbell 3, A answers on doorbell 1; B
//!   asks A (a request) for a checksum of the window; B checks scratchpads both ways.
//! * `die`: A exports "buf" and idles; the test kills (or stops) A after B prints `MAPPED`;
//!   B reports how the loss was seen (`GONE …`) and that its mapping was severed safely.
//!
//! Every result line starts with a word the test looks for; failures exit non-zero.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use ntb::{
    connect_addr, listen_addr, ControlAddr, Endpoint, FabricError, FabricKind, Incoming,
    LinkConfig, Message, NodeId, SharedMemory,
};

const WINDOW: u64 = 1 << 20;
const T: Duration = Duration::from_secs(10);
const OP_CHECKSUM: u16 = 0x100;

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 8)) as u8
}

fn checksum(mem: &SharedMemory) -> Result<u64, String> {
    let mut buf = vec![0u8; mem.len() as usize];
    mem.read_at(0, &mut buf).map_err(|e| e.to_string())?;
    Ok(buf.iter().enumerate().fold(0u64, |a, (i, &b)| {
        a.wrapping_add((i as u64 + 1) * u64::from(b))
    }))
}

/// 100 ms heartbeats, a 1 s peer timeout unless `NTB_NODE_PEER_TIMEOUT_MS` says otherwise
/// (a test of a killed peer gives it longer, so that the link's end, not a starved heartbeat
/// check, is what a busy machine reports first).
fn link_config() -> LinkConfig {
    let peer_timeout = std::env::var("NTB_NODE_PEER_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_millis(1000), Duration::from_millis);
    LinkConfig {
        heartbeat: Duration::from_millis(100),
        peer_timeout,
        ..LinkConfig::default()
    }
}

fn fail(msg: String) -> ExitCode {
    eprintln!("ntb-node: {msg}");
    println!("FAIL {msg}");
    ExitCode::from(1)
}

fn serve(addr: &ControlAddr, scenario: &str) -> Result<(), String> {
    let me = NodeId::new("nodeA").map_err(|e| e.to_string())?;
    let l = listen_addr(addr, &me, &link_config()).map_err(|e| format!("listen: {e}"))?;
    println!("LISTEN {}", l.local_addr());
    let ep = l.accept(Some(T)).map_err(|e| format!("accept: {e}"))?;
    let mem = SharedMemory::new("nodeA-buf", WINDOW).map_err(|e| e.to_string())?;
    let win = ep
        .export_window(mem.fd(), 0, WINDOW, "buf")
        .map_err(|e| format!("export: {e}"))?;
    println!("EXPORTED id={} peer={}", win.id(), ep.peer_node());
    if scenario == "die" {
        // Idle until killed; bounded so a broken test cannot leave it behind.
        let _ = ep.wait_gone(Duration::from_secs(30));
        return Ok(());
    }
    // Wait for B's pattern to appear in our own memory: no message is involved on shm.
    let start = Instant::now();
    let received_before = ep.stats().frames_received;
    let mut last = [0u8; 1];
    loop {
        mem.read_at(WINDOW - 1, &mut last)
            .map_err(|e| e.to_string())?;
        if last[0] == pattern(WINDOW as usize - 1) && last[0] != 0 {
            break;
        }
        if start.elapsed() > T {
            return Err("pattern never appeared".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut buf = vec![0u8; WINDOW as usize];
    mem.read_at(0, &mut buf).map_err(|e| e.to_string())?;
    if let Some(i) = (0..buf.len()).find(|&i| buf[i] != pattern(i)) {
        return Err(format!("pattern mismatch at {i}"));
    }
    println!(
        "PATTERN_SEEN frames_received_meanwhile={}",
        ep.stats().frames_received - received_before
    );
    let bits = ep
        .wait_doorbell(1 << 3, T)
        .map_err(|e| format!("doorbell: {e}"))?;
    println!("DOORBELL {bits:#x}");
    ep.ring_peer(1 << 1).map_err(|e| format!("ring: {e}"))?;
    ep.write_peer_spad(2, 0xA11C_E000)
        .map_err(|e| format!("spad: {e}"))?;
    // Serve requests until B leaves.
    let deadline = Instant::now() + T;
    while Instant::now() < deadline {
        match ep.recv(Duration::from_millis(200)) {
            Ok(Incoming::Request { id, msg }) if msg.opcode == OP_CHECKSUM => {
                let reply =
                    Message::new(OP_CHECKSUM, &checksum(&mem)?).map_err(|e| e.to_string())?;
                ep.reply(id, Ok(reply)).map_err(|e| e.to_string())?;
            }
            Ok(Incoming::Request { id, msg }) => {
                let e = ntb::ErrorReply::new(
                    ntb::wire::code::UNKNOWN_OPCODE,
                    format!("opcode {:#x}", msg.opcode),
                );
                ep.reply(id, Err(e)).map_err(|e| e.to_string())?;
            }
            Ok(_) | Err(FabricError::Timeout(_)) => {}
            Err(e) if e.is_peer_gone() => {
                println!("SPAD_FROM_PEER {:#x}", ep.read_spad(5).unwrap_or(0));
                println!("DONE");
                return Ok(());
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Err("client never left".into())
}

fn client(addr: &ControlAddr, kind: FabricKind, scenario: &str) -> Result<(), String> {
    let me = NodeId::new("nodeB").map_err(|e| e.to_string())?;
    let ep: Box<dyn Endpoint> =
        connect_addr(addr, &me, &link_config()).map_err(|e| format!("connect: {e}"))?;
    let info = ep
        .wait_peer_window("buf", T)
        .map_err(|e| format!("window: {e}"))?;
    let w = ep
        .map_peer_window(info.id)
        .map_err(|e| format!("map: {e}"))?;
    match (kind, w.as_ptr()) {
        (FabricKind::Shm, Ok(_)) => {}
        (FabricKind::Tcp, Err(FabricError::DirectMappingUnsupported { .. })) => {}
        (k, r) => return Err(format!("{k} as_ptr gave {:?}", r.map(|p| p as usize))),
    }
    if scenario == "die" {
        println!("MAPPED");
        let start = Instant::now();
        let reason = ep
            .wait_gone(T)
            .map_err(|e| format!("peer never reported gone: {e}"))?;
        let ms = start.elapsed().as_millis();
        let err = w
            .read_at(0, &mut [0u8; 8])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        if w.is_live() || !err.contains("gone") {
            return Err(format!("window still live after peer loss (read: {err:?})"));
        }
        if kind == FabricKind::Shm {
            // The old host range is still safe to touch (severed, not unmapped under us).
            let p = (ep.peer_windows().len(), w.as_ptr().is_err());
            if p != (0, true) {
                return Err(format!("peer windows/ptr after loss: {p:?}"));
            }
        }
        println!("GONE after_ms={ms} reason={reason}");
        return Ok(());
    }
    let before = ep.stats();
    let data: Vec<u8> = (0..WINDOW as usize).map(pattern).collect();
    match w.as_ptr() {
        Ok(p) => {
            // Plain stores into the peer's memory, like posted TLPs through an NTB window.
            for (i, b) in data.iter().enumerate() {
                // SAFETY: p maps WINDOW bytes of the peer window while `w` lives.
                unsafe { std::ptr::write_volatile(p.add(i), *b) };
            }
        }
        Err(_) => w.write_at(0, &data).map_err(|e| format!("write: {e}"))?,
    }
    let after = ep.stats();
    println!(
        "WROTE frames_sent={} window_io_frames={}",
        after.frames_sent - before.frames_sent,
        after.window_io_frames - before.window_io_frames
    );
    let mut back = vec![0u8; WINDOW as usize];
    w.read_at(0, &mut back).map_err(|e| format!("read: {e}"))?;
    if back != data {
        return Err("read back differs".into());
    }
    ep.ring_peer(1 << 3).map_err(|e| format!("ring: {e}"))?;
    let bits = ep
        .wait_doorbell(1 << 1, T)
        .map_err(|e| format!("wait ack: {e}"))?;
    println!("ACKED {bits:#x}");
    let spad_deadline = Instant::now() + T;
    while ep.read_spad(2).map_err(|e| e.to_string())? != 0xA11C_E000 {
        if Instant::now() > spad_deadline {
            return Err("scratchpad never written".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    ep.write_peer_spad(5, 0xB0B)
        .map_err(|e| format!("spad: {e}"))?;
    if ep.read_peer_spad(5).map_err(|e| e.to_string())? != 0xB0B {
        return Err("peer scratchpad readback".into());
    }
    let r = ep
        .request(Message::raw(OP_CHECKSUM, Vec::new()), T)
        .map_err(|e| format!("request: {e}"))?;
    let remote: u64 = r.decode().map_err(|e| e.to_string())?;
    let local = data.iter().enumerate().fold(0u64, |a, (i, &b)| {
        a.wrapping_add((i as u64 + 1) * u64::from(b))
    });
    if remote != local {
        return Err(format!("checksum {remote:#x} != {local:#x}"));
    }
    println!("CHECKSUM_OK");
    match ep.request(Message::raw(0x1ff, Vec::new()), T) {
        Err(FabricError::Remote(e)) => println!("ERROR_REPLY {}", e.code),
        other => return Err(format!("unknown request answered {other:?}")),
    }
    drop(w);
    ep.close();
    println!("DONE");
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        return fail("usage: ntb-node serve|client shm|tcp ADDR basic|die".into());
    }
    let kind = match args[2].as_str() {
        "shm" => FabricKind::Shm,
        "tcp" => FabricKind::Tcp,
        k => return fail(format!("unknown kind {k}")),
    };
    let addr = match ControlAddr::parse(kind, &args[3]) {
        Ok(a) => a,
        Err(e) => return fail(e),
    };
    let r = match args[1].as_str() {
        "serve" => serve(&addr, &args[4]),
        "client" => client(&addr, kind, &args[4]),
        r => Err(format!("unknown role {r}")),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}
