//! `lendctl lenders|list|status` against the real `lenderd` binary on the shm fabric with a
//! `dmatest` device.
//!
//! lenderd is a binary of the `lending` crate, which `cargo test -p api` does not build: run
//! `cargo build --workspace --bins` (or `cargo build -p lending --bins`) first.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use lending::client::LenderClient;
use lending::testing::{lenderd_binary, Lenderd};
use ntb::ClusterConfig;
use serde_json::Value;

const TOKEN: &str = "lendctl-test-token-8f3a61c2d4b7e9051a6c";
/// A token of the accepted strength that is not the cluster's.
const WRONG: &str = "wrong-but-strong-token-0f9e8d7c6b5a4321";
const DEV: &str = "0000:00:04.0";

/// A cluster in a temp dir: node3 runs lenderd, node1 is the test's borrower, node2 runs
/// nothing. The cluster file carries the token as a relative `token_file`.
struct Cluster {
    dir: tempfile::TempDir,
    path: PathBuf,
    cfg: ClusterConfig,
}

fn cluster(token_line: &str) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let src = format!(
        "version = 1\n{token_line}\n\
         [[node]]\nname = \"node3\"\nfabric = \"shm\"\ncontrol = \"{d}/node3.sock\"\n\
         [[node]]\nname = \"node1\"\nfabric = \"shm\"\ncontrol = \"{d}/node1.sock\"\n\
         [[node]]\nname = \"node2\"\nfabric = \"shm\"\ncontrol = \"{d}/node2.sock\"\n"
    );
    let tok = dir.path().join("cluster.token");
    std::fs::write(&tok, format!("{TOKEN}\n")).unwrap();
    std::fs::set_permissions(&tok, std::fs::Permissions::from_mode(0o600)).unwrap();
    let path = dir.path().join("cluster.toml");
    ntb::config::write_private_file(&path, &src).unwrap();
    let cfg = ClusterConfig::load(&path).unwrap();
    Cluster { dir, path, cfg }
}

/// lenderd on node3 lending a dmatest device, once its socket is bound; killed on drop.
fn start_lenderd(c: &Cluster) -> Lenderd {
    Lenderd::command(lenderd_binary(), "node3", &c.path)
        .log(c.dir.path().join("lenderd.log"))
        .device(format!("{DEV}=dmatest"))
        .token(TOKEN)
        .spawn_until_listening(&c.dir.path().join("node3.sock"))
}

fn lendctl(c: &Cluster, args: &[&str], env_token: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lendctl"));
    cmd.arg("--cluster").arg(&c.path).args(args);
    cmd.env("RUST_LOG", "off").env_remove("LENDVM_TOKEN");
    if let Some(t) = env_token {
        cmd.env("LENDVM_TOKEN", t);
    }
    cmd.output().unwrap()
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        out(o),
        err(o)
    );
    out(o)
}

fn row<'a>(text: &'a str, first: &str) -> &'a str {
    text.lines()
        .find(|l| l.split_whitespace().next() == Some(first))
        .unwrap_or_else(|| panic!("no row {first:?} in\n{text}"))
}

#[test]
fn lenders_shows_reachable_and_unreachable_nodes() {
    let c = cluster("token_file = \"cluster.token\"");
    let _d = start_lenderd(&c);
    let o = lendctl(&c, &["lenders"], None);
    let t = ok(&o);
    let header = t.lines().next().unwrap();
    assert!(
        header.starts_with("NODE") && header.contains("FABRIC") && header.contains("REACHABLE"),
        "{t}"
    );
    let r3 = row(&t, "node3");
    let sock3 = c.dir.path().join("node3.sock");
    for cell in ["shm", &sock3.display().to_string(), " 1 ", "yes"] {
        assert!(r3.contains(cell), "{cell:?} missing in {r3:?}");
    }
    let r2 = row(&t, "node2");
    assert!(r2.contains(" - ") && r2.contains("no: "), "{r2}");
    assert!(
        r2.contains("node2.sock"),
        "the error names the address: {r2}"
    );

    let o = lendctl(&c, &["--json", "lenders"], None);
    let v: Value = serde_json::from_str(&ok(&o)).unwrap();
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 3);
    let n3 = rows.iter().find(|r| r["node"] == "node3").unwrap();
    assert_eq!(n3["reachable"], true);
    assert_eq!(n3["devices"], 1);
    assert_eq!(n3["fabric"], "shm");
    assert!(n3["error"].is_null());
    let n2 = rows.iter().find(|r| r["node"] == "node2").unwrap();
    assert_eq!(n2["reachable"], false);
    assert!(n2["devices"].is_null());
    assert!(!n2["error"].as_str().unwrap().is_empty());

    // One lender only.
    let t = ok(&lendctl(&c, &["--lender", "node3", "lenders"], None));
    assert_eq!(t.lines().count(), 2, "{t}");
}

#[test]
fn list_and_status_follow_a_borrow() {
    let c = cluster("token_file = \"cluster.token\"");
    let _d = start_lenderd(&c);
    let t = ok(&lendctl(
        &c,
        &["--lender", "node3", "--node", "ops-console", "list"],
        None,
    ));
    let r = row(&t, "node3");
    for cell in [DEV, "dmatest", "1b36:1105", "available"] {
        assert!(r.contains(cell), "{cell:?} missing in {r:?}");
    }

    // The test borrows the device as node1/vm0 and keeps the lease while lendctl looks.
    let t0 = Instant::now();
    let cl = loop {
        match LenderClient::connect(&c.cfg, "node1", "node3", TOKEN, "test") {
            Ok(cl) => break cl,
            Err(e) => {
                assert!(t0.elapsed() < Duration::from_secs(10), "connect: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    let lease = cl.borrow(DEV, "vm0").unwrap();

    let t = ok(&lendctl(&c, &["--lender", "node3", "list"], None));
    assert!(row(&t, "node3").contains("lent to node1/vm0"), "{t}");

    let v: Value = serde_json::from_str(&ok(&lendctl(
        &c,
        &["--json", "--lender", "node3", "list"],
        None,
    )))
    .unwrap();
    let d = &v["devices"][0];
    assert_eq!(d["node"], "node3");
    assert_eq!(d["bdf"], DEV);
    assert_eq!(d["kind"], "dmatest");
    assert_eq!(d["state"], "lent");
    assert_eq!(d["lent_to"]["node"], "node1");
    assert_eq!(d["lent_to"]["vm"], "vm0");
    assert_eq!(v["unreachable"].as_array().unwrap().len(), 0);

    let t = ok(&lendctl(&c, &["--lender", "node3", "status"], None));
    assert!(t.starts_with("lender node3: up "), "{t}");
    assert!(
        t.contains("LEASES GRANTED") && t.contains("IOMMU FAULTS"),
        "{t}"
    );
    let r = row(&t, DEV);
    assert!(r.contains("lent to node1/vm0"), "{r}");
    let v: Value = serde_json::from_str(&ok(&lendctl(
        &c,
        &["--lender", "node3", "status", "--json"],
        None,
    )))
    .unwrap();
    assert_eq!(v["node"], "node3");
    assert_eq!(v["devices"][0]["leases_granted"], 1);
    assert_eq!(v["devices"][0]["iommu_faults"], 0);
    assert!(v["devices"][0]["dma_maps"].as_array().unwrap().is_empty());

    // Across the cluster: node3's devices, then exit 1 because node1/node2 run no lenderd.
    let o = lendctl(&c, &["list"], None);
    assert_eq!(o.status.code(), Some(1), "{}", err(&o));
    assert!(row(&out(&o), "node3").contains("lent to node1/vm0"));
    let e = err(&o);
    assert!(e.contains("lender node2 is unreachable"), "{e}");
    assert!(e.contains("2 of 3 lenders unreachable"), "{e}");
    let o = lendctl(&c, &["--json", "list"], None);
    assert_eq!(o.status.code(), Some(1));
    let v: Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(v["devices"].as_array().unwrap().len(), 1);
    assert_eq!(v["unreachable"].as_array().unwrap().len(), 2);

    lease.return_device().unwrap();
    let t = ok(&lendctl(&c, &["--lender", "node3", "list"], None));
    assert!(row(&t, "node3").contains("available"), "{t}");
}

#[test]
fn unreachable_or_unknown_lender_exits_1() {
    let c = cluster("token_file = \"cluster.token\"");
    for cmd in ["list", "status"] {
        let o = lendctl(&c, &["--lender", "node2", cmd], None);
        assert_eq!(o.status.code(), Some(1), "{cmd}: {}", out(&o));
        let e = err(&o);
        assert!(
            e.starts_with("lendctl: error: lender node2 is unreachable: ")
                && e.contains("node2.sock"),
            "{e}"
        );
    }
    let o = lendctl(&c, &["--lender", "node9", "list"], None);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        err(&o).contains("lender node9 is not in the cluster file (nodes: node3, node1, node2)"),
        "{}",
        err(&o)
    );
    // Usage errors.
    let o = lendctl(&c, &["--node", "not a name", "lenders"], None);
    assert_eq!(o.status.code(), Some(2), "{}", err(&o));
    let o = Command::new(env!("CARGO_BIN_EXE_lendctl"))
        .args(["--lender", "node3", "list"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(err(&o).contains("--lender needs --cluster"), "{}", err(&o));
}

#[test]
fn token_sources_and_refusals() {
    let c = cluster("");
    let _d = start_lenderd(&c);
    // No token anywhere.
    let o = lendctl(&c, &["--lender", "node3", "list"], None);
    assert_eq!(o.status.code(), Some(1));
    assert!(err(&o).contains("no cluster token"), "{}", err(&o));
    // $LENDVM_TOKEN, and --token over it.
    ok(&lendctl(&c, &["--lender", "node3", "list"], Some(TOKEN)));
    let o = lendctl(&c, &["--lender", "node3", "list"], Some(WRONG));
    assert_eq!(o.status.code(), Some(1));
    // Mutual authentication: with the wrong token lendctl cannot verify the lender's proof.
    assert!(
        err(&o).contains("did not prove that it knows the cluster token"),
        "{}",
        err(&o)
    );
    ok(&lendctl(
        &c,
        &["--lender", "node3", "--token", TOKEN, "list"],
        Some(WRONG),
    ));
    // A bad token makes the lender unreachable in `lenders`, which still exits 0.
    let t = ok(&lendctl(&c, &["--token", WRONG, "lenders"], None));
    assert!(row(&t, "node3").contains("no: lender node3 at "), "{t}");
    assert!(row(&t, "node3").contains("did not prove"), "{t}");

    // Inline token in the cluster file.
    let c2 = cluster(&format!("token = \"{TOKEN}\""));
    let _d2 = start_lenderd(&c2);
    ok(&lendctl(&c2, &["--lender", "node3", "list"], None));
    // A token file group or others can read is refused, naming the file and its mode.
    let c4 = cluster("token_file = \"cluster.token\"");
    let tok4 = c4.dir.path().join("cluster.token");
    std::fs::set_permissions(&tok4, std::fs::Permissions::from_mode(0o640)).unwrap();
    let o = lendctl(&c4, &["--lender", "node3", "list"], None);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        err(&o).contains(&format!("token file {} has mode 0640", tok4.display())),
        "{}",
        err(&o)
    );
    // Inline in a cluster file group or others may read: refused, naming file and mode.
    std::fs::set_permissions(&c2.path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let o = lendctl(&c2, &["--lender", "node3", "list"], None);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        err(&o).contains(&format!(
            "{} holds an inline `token` and has mode 0644",
            c2.path.display()
        )),
        "{}",
        err(&o)
    );
    // --token-file: a private file works; one others may read is refused.
    let tf = c.dir.path().join("lendctl.token");
    ntb::config::write_token_file(&tf, &format!("{TOKEN}\n")).unwrap();
    let tfs = tf.to_str().unwrap();
    ok(&lendctl(
        &c,
        &["--lender", "node3", "--token-file", tfs, "list"],
        Some(WRONG),
    ));
    std::fs::set_permissions(&tf, std::fs::Permissions::from_mode(0o604)).unwrap();
    let o = lendctl(
        &c,
        &["--lender", "node3", "--token-file", tfs, "list"],
        None,
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(
        err(&o).contains(&format!("token file {tfs} has mode 0604")),
        "{}",
        err(&o)
    );
    // A weak token is refused before anything is sent, with the minimum.
    for (args, env) in [
        (vec!["--lender", "node3", "--token", "s3cret", "list"], None),
        (vec!["--lender", "node3", "list"], Some("s3cret")),
    ] {
        let o = lendctl(&c, &args, env);
        assert_eq!(o.status.code(), Some(1));
        assert!(
            err(&o).contains("is too weak: it is 6 bytes long, the minimum is 32"),
            "{}",
            err(&o)
        );
    }
    // A token file that is missing is named.
    let c3 = cluster("token_file = \"missing.token\"");
    let o = lendctl(&c3, &["--lender", "node3", "list"], None);
    assert_eq!(o.status.code(), Some(1));
    let missing = c3.dir.path().join("missing.token");
    assert!(
        err(&o).contains(&missing.display().to_string()),
        "{}",
        err(&o)
    );
}
