//! Test support (cargo feature `testing`): etcd members on loopback, started by the test
//! itself (Debian's `etcd-server`, binary `etcd`) on free ports with temporary data
//! directories, and killed by pid when the guard is dropped.
//!
//! Test-only code: failures panic with the member's log, every wait is bounded.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ntb::DirectoryConfig;

/// How long a member (or the cluster) may take to serve.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A port nobody listens on right now (bind to 0, read it back, close).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One etcd member process.
pub struct Member {
    pub name: String,
    pub client_port: u16,
    pub peer_port: u16,
    child: Option<Child>,
    log: PathBuf,
}

impl Member {
    /// `127.0.0.1:port` of its client listener.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// Its pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILLs it and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One or more etcd members forming one cluster; dropping it kills every member and removes
/// the data directories.
pub struct EtcdCluster {
    pub members: Vec<Member>,
    /// Key prefix for this test's records (unique per cluster object).
    pub prefix: String,
    _dir: tempfile::TempDir,
}

fn etcd_binary() -> PathBuf {
    for d in ["/usr/bin", "/usr/local/bin", "/usr/sbin"] {
        let p = PathBuf::from(d).join("etcd");
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "etcd is not installed: the directory tests need Debian's etcd-server \
         (scripts/setup.sh installs it)"
    );
}

impl EtcdCluster {
    /// A single member.
    pub fn single() -> Self {
        Self::start(1)
    }

    /// `n` members on loopback, waiting until the cluster has a leader.
    pub fn start(n: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let bin = etcd_binary();
        let mut members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: free_port(),
                peer_port: free_port(),
                child: None,
                log: dir.path().join(format!("m{i}.log")),
            })
            .collect();
        let initial: Vec<String> = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect();
        let initial = initial.join(",");
        for m in members.iter_mut() {
            let log = std::fs::File::create(&m.log).unwrap();
            let client = format!("http://127.0.0.1:{}", m.client_port);
            let peer = format!("http://127.0.0.1:{}", m.peer_port);
            let child = Command::new(&bin)
                .arg("--name")
                .arg(&m.name)
                .arg("--data-dir")
                .arg(dir.path().join(&m.name))
                .args(["--listen-client-urls", &client])
                .args(["--advertise-client-urls", &client])
                .args(["--listen-peer-urls", &peer])
                .args(["--initial-advertise-peer-urls", &peer])
                .args(["--initial-cluster", &initial])
                .args(["--initial-cluster-state", "new"])
                .args(["--initial-cluster-token", "lendvm-test"])
                .args(["--heartbeat-interval", "100", "--election-timeout", "1000"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap();
            m.child = Some(child);
        }
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let prefix = format!(
            "/lendvm-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        );
        let c = EtcdCluster {
            members,
            prefix,
            _dir: dir,
        };
        c.wait_leader(START_TIMEOUT);
        c
    }

    /// Every member's client endpoint.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(Member::endpoint).collect()
    }

    /// A directory config for this cluster with `ttl`.
    pub fn config(&self, ttl: Duration) -> DirectoryConfig {
        DirectoryConfig {
            etcd: self.endpoints(),
            prefix: self.prefix.clone(),
            lease_ttl: ttl,
        }
    }

    /// The index of the current leader among the running members, if one answers.
    pub fn leader(&self) -> Option<usize> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            for m in self.members.iter().filter(|m| m.child.is_some()) {
                let conn = tokio::time::timeout(
                    Duration::from_secs(2),
                    etcd_client::Client::connect([m.endpoint()], None),
                )
                .await;
                let Ok(Ok(mut c)) = conn else { continue };
                let Ok(Ok(st)) = tokio::time::timeout(Duration::from_secs(2), c.status()).await
                else {
                    continue;
                };
                let Some(me) = st.header().map(|h| h.member_id()) else {
                    continue;
                };
                if st.leader() == me {
                    return self.members.iter().position(|x| x.name == m.name);
                }
            }
            None
        })
    }

    /// Waits (bounded) until some member is the leader; panics with the logs otherwise.
    pub fn wait_leader(&self, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.leader() {
                return i;
            }
            if Instant::now() > deadline {
                let logs: Vec<String> = self
                    .members
                    .iter()
                    .map(|m| format!("--- {} ---\n{}", m.name, m.log()))
                    .collect();
                panic!("no etcd leader within {timeout:?}\n{}", logs.join("\n"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}
