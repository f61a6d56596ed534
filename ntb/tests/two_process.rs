//! Two `ntb-node` processes on the shm and tcp backends.

mod common;

use common::{run_basic, run_die};

#[test]
fn shm_two_processes_window_pattern_and_doorbell() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    run_basic("shm", sock.to_str().unwrap(), &[], &[]);
}

#[test]
fn tcp_two_processes_window_pattern_and_doorbell() {
    run_basic("tcp", "127.0.0.1:0", &[], &[]);
}

#[test]
fn shm_killed_exporter_is_peer_gone_and_mapping_severed() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let gone = run_die("shm", sock.to_str().unwrap(), libc::SIGKILL);
    assert!(gone.contains("connection closed"), "{gone}");
}

#[test]
fn tcp_killed_peer_is_peer_gone() {
    let gone = run_die("tcp", "127.0.0.1:0", libc::SIGKILL);
    assert!(gone.contains("connection closed"), "{gone}");
}

#[test]
fn shm_hung_peer_is_peer_gone_by_heartbeat_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    // SIGSTOP keeps the socket open: only the missing heartbeats reveal the loss.
    let gone = run_die("shm", sock.to_str().unwrap(), libc::SIGSTOP);
    assert!(gone.contains("no heartbeat"), "{gone}");
}
