//! Test support (cargo feature `testing`): etcd members on loopback, started by the test
//! itself (Debian's `etcd-server`, binary `etcd`) on free ports with temporary data
//! directories, and killed by pid when the guard is dropped. [`EtcdCluster::start_tls`]
//! serves the clients over TLS (certificates made by the test with `rcgen`), optionally
//! requiring client certificates; [`EtcdCluster::enable_auth`] turns etcd's users on.
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
    /// The certificates, when the members serve clients over TLS.
    pub tls: Option<TlsFiles>,
    /// The etcd user and its password file, once [`EtcdCluster::enable_auth`] ran.
    pub user: Option<(String, PathBuf)>,
    dir: tempfile::TempDir,
}

/// A test CA, the members' certificate (for `127.0.0.1` and `localhost`) and a client
/// certificate, all PEM files in the cluster's temporary directory.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// Whether the members require a client certificate (`--client-cert-auth`).
    pub client_cert_auth: bool,
}

fn write_private(path: &std::path::Path, text: &str) {
    ntb::config::write_token_file(path, text).unwrap();
}

impl TlsFiles {
    fn make(dir: &std::path::Path, client_cert_auth: bool) -> TlsFiles {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
        };
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "lendvm test etcd CA");
        let ca_key = KeyPair::generate().unwrap();
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let leaf = |names: Vec<String>, cn: &str, usage: ExtendedKeyUsagePurpose| {
            let mut p = CertificateParams::new(names).unwrap();
            p.distinguished_name.push(DnType::CommonName, cn);
            p.extended_key_usages = vec![usage];
            let k = KeyPair::generate().unwrap();
            let c = p.signed_by(&k, &ca, &ca_key).unwrap();
            (c.pem(), k.serialize_pem())
        };
        let (server, server_key) = leaf(
            vec!["127.0.0.1".into(), "localhost".into()],
            "etcd",
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (client, client_key) = leaf(
            Vec::new(),
            "lendvm-test-client",
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        let f = TlsFiles {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server-key.pem"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client-key.pem"),
            client_cert_auth,
        };
        std::fs::write(&f.ca, ca.pem()).unwrap();
        std::fs::write(&f.server_cert, server).unwrap();
        write_private(&f.server_key, &server_key);
        std::fs::write(&f.client_cert, client).unwrap();
        write_private(&f.client_key, &client_key);
        f
    }
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
        Self::start_with(n, false, false)
    }

    /// `n` members serving clients over TLS (a CA and certificates made here);
    /// `client_cert_auth`: they refuse clients without a certificate of that CA.
    pub fn start_tls(n: usize, client_cert_auth: bool) -> Self {
        Self::start_with(n, true, client_cert_auth)
    }

    fn start_with(n: usize, tls: bool, client_cert_auth: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let bin = etcd_binary();
        let tls = tls.then(|| TlsFiles::make(dir.path(), client_cert_auth));
        let scheme = if tls.is_some() { "https" } else { "http" };
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
            let client = format!("{scheme}://127.0.0.1:{}", m.client_port);
            let peer = format!("http://127.0.0.1:{}", m.peer_port);
            let mut cmd = Command::new(&bin);
            if let Some(t) = &tls {
                cmd.arg("--cert-file")
                    .arg(&t.server_cert)
                    .arg("--key-file")
                    .arg(&t.server_key)
                    .arg("--trusted-ca-file")
                    .arg(&t.ca);
                if t.client_cert_auth {
                    cmd.arg("--client-cert-auth");
                }
            }
            let child = cmd
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
            tls,
            user: None,
            dir,
        };
        c.wait_leader(START_TIMEOUT);
        c
    }

    /// Every member's client endpoint.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(Member::endpoint).collect()
    }

    /// A directory config for this cluster with `ttl` (with its CA, client certificate and
    /// user when it has them).
    pub fn config(&self, ttl: Duration) -> DirectoryConfig {
        DirectoryConfig {
            etcd: self.endpoints(),
            prefix: self.prefix.clone(),
            lease_ttl: ttl,
            ca: self.tls.as_ref().map(|t| t.ca.clone()),
            cert: self.tls.as_ref().map(|t| t.client_cert.clone()),
            key: self.tls.as_ref().map(|t| t.client_key.clone()),
            user: self.user.as_ref().map(|u| u.0.clone()),
            password_file: self.user.as_ref().map(|u| u.1.clone()),
            allow_plain: false,
        }
    }

    /// Client options for this cluster's own checks: its TLS files and user.
    fn client_options(&self) -> etcd_client::ConnectOptions {
        let mut o = etcd_client::ConnectOptions::new();
        if let Some(t) = &self.tls {
            o = o.with_tls(
                etcd_client::TlsOptions::new()
                    .ca_certificate(etcd_client::Certificate::from_pem(
                        std::fs::read(&t.ca).unwrap(),
                    ))
                    .identity(etcd_client::Identity::from_pem(
                        std::fs::read(&t.client_cert).unwrap(),
                        std::fs::read(&t.client_key).unwrap(),
                    )),
            );
        }
        if let Some((u, p)) = &self.user {
            o = o.with_user(
                u.clone(),
                std::fs::read_to_string(p).unwrap().trim().to_string(),
            );
        }
        o
    }

    /// A raw etcd client of this cluster (TLS and user as configured), for tests that write
    /// straight into etcd.
    pub async fn raw_client(&self) -> etcd_client::Client {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let eps: Vec<String> = self
            .endpoints()
            .iter()
            .map(|e| format!("{scheme}://{e}"))
            .collect();
        etcd_client::Client::connect(eps, Some(self.client_options()))
            .await
            .unwrap()
    }

    /// Turns etcd's authentication on: a `root` user (etcd requires it), and user `user`
    /// with read-write access to every key, whose password goes to a mode-0600 file that
    /// [`EtcdCluster::config`] names from now on.
    pub fn enable_auth(&mut self, user: &str, password: &str) {
        use etcd_client::{Permission, PermissionType};
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut c = self.raw_client().await;
            c.user_add("root", format!("{password}-root"), None)
                .await
                .unwrap();
            c.role_add("root").await.unwrap();
            c.user_grant_role("root", "root").await.unwrap();
            c.user_add(user, password, None).await.unwrap();
            c.role_add("lendvm").await.unwrap();
            c.role_grant_permission(
                "lendvm",
                Permission::new(PermissionType::Readwrite, "/").with_prefix(),
            )
            .await
            .unwrap();
            c.user_grant_role(user, "lendvm").await.unwrap();
            c.auth_enable().await.unwrap();
        });
        let pw = self.dir.path().join(format!("{user}.password"));
        write_private(&pw, &format!("{password}\n"));
        self.user = Some((user.to_string(), pw));
    }

    /// The index of the current leader among the running members, if one answers.
    pub fn leader(&self) -> Option<usize> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            for m in self.members.iter().filter(|m| m.child.is_some()) {
                let scheme = if self.tls.is_some() { "https" } else { "http" };
                let conn = tokio::time::timeout(
                    Duration::from_secs(2),
                    etcd_client::Client::connect(
                        [format!("{scheme}://{}", m.endpoint())],
                        Some(self.client_options()),
                    ),
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
