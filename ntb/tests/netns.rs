//! The tcp backend between two processes in separate network namespaces joined by a veth
//! pair (169.254.77.1 <-> 169.254.77.2). The test makes and deletes the namespaces itself;
//! it is skipped, with a message, only when `ip netns add` is refused.

mod common;

use std::process::Command;

struct Netns {
    names: Vec<String>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Netns {
    fn add(&mut self, name: &str) -> Result<(), String> {
        ip(&["netns", "add", name])?;
        self.names.push(name.to_string());
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            // Deleting a namespace also deletes the veth end inside it.
            let _ = ip(&["netns", "del", n]);
        }
    }
}

#[test]
fn tcp_between_network_namespaces_over_veth() {
    let id = std::process::id() % 100_000;
    let (na, nb) = (format!("ntbA{id}"), format!("ntbB{id}"));
    let (va, vb) = (format!("vntbA{id}"), format!("vntbB{id}"));
    let mut ns = Netns { names: Vec::new() };
    if let Err(e) = ns.add(&na) {
        // The project's CI machine allows network namespaces: there this is a failure.
        assert!(
            std::env::var_os("CI").is_none(),
            "network namespaces refused in CI: {e}"
        );
        eprintln!("SKIP tcp_between_network_namespaces_over_veth: this machine forbids network namespaces ({e})");
        return;
    }
    ns.add(&nb).unwrap();
    ip(&[
        "link", "add", &va, "netns", &na, "type", "veth", "peer", "name", &vb, "netns", &nb,
    ])
    .unwrap();
    for (n, v, a) in [(&na, &va, "169.254.77.1/24"), (&nb, &vb, "169.254.77.2/24")] {
        ip(&["-n", n, "addr", "add", a, "dev", v]).unwrap();
        ip(&["-n", n, "link", "set", v, "up"]).unwrap();
        ip(&["-n", n, "link", "set", "lo", "up"]).unwrap();
    }
    let serve_prefix = ["ip", "netns", "exec", na.as_str()];
    let client_prefix = ["ip", "netns", "exec", nb.as_str()];
    common::run_basic("tcp", "169.254.77.1:0", &serve_prefix, &client_prefix);
}
