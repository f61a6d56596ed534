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

/// Where a member runs: its address, and the network namespace it runs in when a harness
/// made one per host (`None`: this process's, on loopback).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberHost {
    pub ip: String,
    pub netns: Option<String>,
}

impl MemberHost {
    /// A member on loopback.
    pub fn loopback() -> Self {
        Self {
            ip: "127.0.0.1".into(),
            netns: None,
        }
    }
}

/// Runs `f` on a thread that joined network namespace `ns` (`/var/run/netns/NS`), or on a
/// plain thread when `ns` is `None`; sockets it opens and processes it starts live there.
pub fn in_netns<R: Send>(ns: Option<&str>, f: impl FnOnce() -> R + Send) -> R {
    use std::os::fd::AsRawFd;
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            if let Some(ns) = ns {
                let path = format!("/var/run/netns/{ns}");
                let nsf = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
                // SAFETY: setns on a valid namespace fd, for this thread only; no memory
                // involved.
                let rc = unsafe { libc::setns(nsf.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(
                    rc,
                    0,
                    "setns into {ns}: {}",
                    std::io::Error::last_os_error()
                );
            }
            f()
        });
        match h.join() {
            Ok(v) => v,
            Err(p) => std::panic::resume_unwind(p),
        }
    })
}

/// One etcd member process.
pub struct Member {
    pub name: String,
    pub host: MemberHost,
    pub client_port: u16,
    pub peer_port: u16,
    child: Option<Child>,
    log: PathBuf,
    /// The command line that starts it (again, after a kill: same data directory).
    argv: Vec<std::ffi::OsString>,
}

impl Member {
    /// `ip:port` of its client listener.
    pub fn endpoint(&self) -> String {
        format!("{}:{}", self.host.ip, self.client_port)
    }

    /// Starts it (again: a member killed keeps its data directory and rejoins).
    pub fn start(&mut self) {
        if self.child.is_some() {
            return;
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(&self.argv[0])
            .args(&self.argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// Whether it runs (was started and not killed).
    pub fn running(&self) -> bool {
        self.child.is_some()
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
    /// The network namespace this process's own checks (the leader, `enable_auth`) run in
    /// when the members live in namespaces: the first member's.
    probe_netns: Option<String>,
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
    /// A CA, a server certificate for `names` (addresses or host names) and a client
    /// certificate, in `dir`.
    pub fn make(dir: &std::path::Path, names: Vec<String>, client_cert_auth: bool) -> TlsFiles {
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
        let leaf = |names: Vec<String>, cn: &str, usages: Vec<ExtendedKeyUsagePurpose>| {
            let mut p = CertificateParams::new(names).unwrap();
            p.distinguished_name.push(DnType::CommonName, cn);
            p.extended_key_usages = usages;
            let k = KeyPair::generate().unwrap();
            let c = p.signed_by(&k, &ca, &ca_key).unwrap();
            (c.pem(), k.serialize_pem())
        };
        // The members' certificate serves clients and peers, and is the client certificate
        // a member shows its peers (`--peer-client-cert-auth`): both usages, as etcd's
        // guide makes peer certificates.
        let (server, server_key) = leaf(
            names,
            "etcd",
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        );
        let (client, client_key) = leaf(
            Vec::new(),
            "lendvm-test-client",
            vec![ExtendedKeyUsagePurpose::ClientAuth],
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
        Self::start_on(&vec![MemberHost::loopback(); n], tls, client_cert_auth)
    }

    /// One member per host of `hosts`: on loopback with free ports, or in a host's network
    /// namespace on its address with etcd's usual ports (2379 clients, 2380 peers). With
    /// `tls`, clients and peers talk TLS, and a member accepts only peers with a certificate
    /// of the cluster's CA (`--peer-client-cert-auth`), as in production.
    pub fn start_on(hosts: &[MemberHost], tls: bool, client_cert_auth: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let bin = etcd_binary();
        let mut names: Vec<String> = hosts.iter().map(|h| h.ip.clone()).collect();
        names.sort();
        names.dedup();
        names.push("localhost".into());
        let tls = tls.then(|| TlsFiles::make(dir.path(), names, client_cert_auth));
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut members: Vec<Member> = hosts
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let (client_port, peer_port) = match h.netns {
                    Some(_) => (2379, 2380),
                    None => (free_port(), free_port()),
                };
                Member {
                    name: format!("m{i}"),
                    host: h.clone(),
                    client_port,
                    peer_port,
                    child: None,
                    log: dir.path().join(format!("m{i}.log")),
                    argv: Vec::new(),
                }
            })
            .collect();
        let initial: Vec<String> = members
            .iter()
            .map(|m| format!("{}={scheme}://{}:{}", m.name, m.host.ip, m.peer_port))
            .collect();
        let initial = initial.join(",");
        for m in members.iter_mut() {
            let client = format!("{scheme}://{}", m.endpoint());
            let peer = format!("{scheme}://{}:{}", m.host.ip, m.peer_port);
            let mut argv: Vec<std::ffi::OsString> = Vec::new();
            if let Some(ns) = &m.host.netns {
                argv.extend(["ip", "netns", "exec", ns.as_str()].map(Into::into));
            }
            argv.push(bin.clone().into());
            if let Some(t) = &tls {
                argv.push("--cert-file".into());
                argv.push(t.server_cert.clone().into());
                argv.push("--key-file".into());
                argv.push(t.server_key.clone().into());
                argv.push("--trusted-ca-file".into());
                argv.push(t.ca.clone().into());
                if t.client_cert_auth {
                    argv.push("--client-cert-auth".into());
                }
                for (k, v) in [
                    ("--peer-cert-file", &t.server_cert),
                    ("--peer-key-file", &t.server_key),
                    ("--peer-trusted-ca-file", &t.ca),
                ] {
                    argv.push(k.into());
                    argv.push(v.clone().into());
                }
                argv.push("--peer-client-cert-auth".into());
            }
            let data = dir.path().join(&m.name);
            for (k, v) in [
                ("--name", m.name.as_str()),
                ("--data-dir", data.to_str().unwrap()),
                ("--listen-client-urls", &client),
                ("--advertise-client-urls", &client),
                ("--listen-peer-urls", &peer),
                ("--initial-advertise-peer-urls", &peer),
                ("--initial-cluster", &initial),
                ("--initial-cluster-state", "new"),
                ("--initial-cluster-token", "lendvm-test"),
                ("--heartbeat-interval", "100"),
                ("--election-timeout", "1000"),
            ] {
                argv.push(k.into());
                argv.push(v.into());
            }
            m.argv = argv;
            m.start();
        }
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let prefix = format!(
            "/lendvm-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        );
        let probe_netns = hosts.iter().find_map(|h| h.netns.clone());
        let c = EtcdCluster {
            members,
            prefix,
            tls,
            user: None,
            dir,
            probe_netns,
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
        let this = &*self;
        in_netns(this.probe_netns.as_deref(), || {
            rt.block_on(async {
                let mut c = this.raw_client().await;
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
            })
        });
        let pw = self.dir.path().join(format!("{user}.password"));
        write_private(&pw, &format!("{password}\n"));
        self.user = Some((user.to_string(), pw));
    }

    /// The index of the current leader among the running members, if one answers.
    pub fn leader(&self) -> Option<usize> {
        in_netns(self.probe_netns.as_deref(), || self.leader_here())
    }

    fn leader_here(&self) -> Option<usize> {
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
