//! Helpers to run `ntb-node` processes and read their result lines with bounded waits.
#![allow(dead_code, clippy::expect_used, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const NODE_BIN: &str = env!("CARGO_BIN_EXE_ntb-node");

/// A child process whose stdout lines arrive on a channel; killed on drop.
pub struct Node {
    pub name: &'static str,
    child: Child,
    lines: mpsc::Receiver<String>,
    pub seen: Vec<String>,
}

impl Node {
    /// Starts `prefix... ntb-node args...` (prefix: e.g. `ip netns exec NS`).
    /// [`Node::spawn`] without a prefix, with `env` set.
    pub fn spawn_env(name: &'static str, env: &[(&str, &str)], args: &[&str]) -> Node {
        Self::spawn_with(name, &[], env, args)
    }

    pub fn spawn(name: &'static str, prefix: &[&str], args: &[&str]) -> Node {
        Self::spawn_with(name, prefix, &[], args)
    }

    fn spawn_with(
        name: &'static str,
        prefix: &[&str],
        env: &[(&str, &str)],
        args: &[&str],
    ) -> Node {
        let mut cmd = match prefix.split_first() {
            Some((p0, rest)) => {
                let mut c = Command::new(p0);
                c.args(rest).arg(NODE_BIN);
                c
            }
            None => Command::new(NODE_BIN),
        };
        let mut child = cmd
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn ntb-node");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().take(10_000) {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Node {
            name,
            child,
            lines: rx,
            seen: Vec::new(),
        }
    }

    /// Waits (bounded) for a line starting with `prefix`; returns the rest of it.
    pub fn expect(&mut self, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if let Some(rest) = l.strip_prefix(prefix) {
                        return rest.trim().to_string();
                    }
                    assert!(
                        !l.starts_with("FAIL"),
                        "{}: {l} (seen {:?})",
                        self.name,
                        self.seen
                    );
                }
                Err(_) => panic!(
                    "{}: no line {prefix:?} within {timeout:?}; seen {:?}",
                    self.name, self.seen
                ),
            }
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.pid(), sig) };
    }

    /// Waits (bounded) for exit and returns success.
    pub fn wait_ok(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return st.success();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!(
            "{}: did not exit within {timeout:?}; seen {:?}",
            self.name, self.seen
        );
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub const T: Duration = Duration::from_secs(15);

/// Runs the `basic` scenario between a server started with `serve_prefix` and a client
/// started with `client_prefix`; `addr` is the server's listen address.
pub fn run_basic(kind: &str, addr: &str, serve_prefix: &[&str], client_prefix: &[&str]) {
    let mut a = Node::spawn("node A", serve_prefix, &["serve", kind, addr, "basic"]);
    let listen = a.expect("LISTEN", T);
    let mut b = Node::spawn("node B", client_prefix, &["client", kind, &listen, "basic"]);
    a.expect("EXPORTED", T);
    let wrote = b.expect("WROTE", T);
    let seen = a.expect("PATTERN_SEEN", T);
    if kind == "shm" {
        // Direct stores: not a single frame went over the control socket for the data.
        assert_eq!(wrote, "frames_sent=0 window_io_frames=0");
        assert_eq!(seen, "frames_received_meanwhile=0");
    } else {
        assert_eq!(
            wrote, "frames_sent=1 window_io_frames=1",
            "1 MiB is one tcp chunk"
        );
    }
    assert_eq!(a.expect("DOORBELL", T), "0x8");
    assert_eq!(b.expect("ACKED", T), "0x2");
    b.expect("CHECKSUM_OK", T);
    assert_eq!(b.expect("ERROR_REPLY", T), "2");
    b.expect("DONE", T);
    assert_eq!(a.expect("SPAD_FROM_PEER", T), "0xb0b");
    a.expect("DONE", T);
    assert!(b.wait_ok(T), "node B failed");
    assert!(a.wait_ok(T), "node A failed");
}

/// Runs the `die` scenario: A exports, B maps, A gets `sig`; B must report the loss.
pub fn run_die(kind: &str, addr: &str, sig: i32) -> String {
    let mut a = Node::spawn("node A", &[], &["serve", kind, addr, "die"]);
    let listen = a.expect("LISTEN", T);
    // A killed peer's link ends at once; with both cores busy the survivor's heartbeat
    // check could still run before its reader sees the end, so it gets 10 s there. A
    // stopped peer keeps its socket: only the 1 s timeout can tell.
    let b_env = if sig == libc::SIGSTOP {
        "1000"
    } else {
        "10000"
    };
    let mut b = Node::spawn_env(
        "node B",
        &[("NTB_NODE_PEER_TIMEOUT_MS", b_env)],
        &["client", kind, &listen, "die"],
    );
    b.expect("MAPPED", T);
    a.signal(sig);
    let gone = b.expect("GONE", T);
    assert!(b.wait_ok(T), "node B (the survivor) failed");
    gone
}
