//! Test harness: a real `ApiServer` on a temp socket in front of a `FakeVmmThread`, raw HTTP
//! helpers, the `lendctl` binary, and a checker for responses against `api/openapi.yaml`.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod openapi;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use api::client::{parse_response, ApiClient, HttpResponse};
use api::fake::{FakeVmmConfig, FakeVmmThread};
use api::server::{ApiServer, ApiServerConfig};

pub use openapi::OpenApi;

/// Fields drop in order: server, then VMM, then the temp dir.
pub struct Harness {
    pub server: Option<ApiServer>,
    /// The bus `vm.events` streams (the tests emit on it as the VMM would).
    pub events: std::sync::Arc<api::events::EventBus>,
    pub vmm: FakeVmmThread,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub openapi: OpenApi,
}

impl Harness {
    pub fn start() -> Self {
        Self::with(FakeVmmConfig::default(), Duration::from_secs(10))
    }

    pub fn with(config: FakeVmmConfig, request_timeout: Duration) -> Self {
        let _ = env_logger::builder().is_test(true).try_init();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("api.sock");
        let vmm = FakeVmmThread::spawn(config).unwrap();
        let mut cfg = ApiServerConfig::new(&socket);
        cfg.request_timeout = request_timeout;
        let events = api::events::EventBus::new();
        cfg.events = Some(events.clone());
        let server = ApiServer::start(cfg, vmm.api_sender(), vmm.api_event().unwrap()).unwrap();
        Harness {
            dir,
            socket,
            server: Some(server),
            vmm,
            events,
            openapi: OpenApi::load(),
        }
    }

    pub fn client(&self) -> ApiClient {
        ApiClient::new(&self.socket, Duration::from_secs(10))
    }

    /// One request through the real client; the response is checked against openapi.yaml.
    pub fn call(&self, method: &str, endpoint: &str, body: Option<&str>) -> HttpResponse {
        let resp = self
            .client()
            .request(method, endpoint, body.map(str::as_bytes))
            .unwrap();
        self.openapi.check_response(method, endpoint, &resp);
        resp
    }

    /// Asserts a 4xx/5xx with a plain-text message containing `needle`, then that the server
    /// (and the VMM behind it) still answer.
    pub fn expect_error(
        &self,
        method: &str,
        endpoint: &str,
        body: Option<&str>,
        status: u16,
        needle: &str,
    ) -> String {
        let resp = self.call(method, endpoint, body);
        let text = resp.body_text();
        assert_eq!(resp.status, status, "{method} {endpoint} {body:?}: {text}");
        assert!(
            resp.header("content-type")
                .is_some_and(|c| c.starts_with("text/plain")),
            "error bodies are text: {:?}",
            resp.headers
        );
        assert!(
            text.contains(needle),
            "message {text:?} should contain {needle:?}"
        );
        self.assert_alive();
        text
    }

    pub fn assert_alive(&self) {
        let ping = self.call("GET", "vmm.ping", None);
        assert_eq!(ping.status, 200, "{}", ping.body_text());
        let info = self.call("GET", "vm.info", None);
        assert_eq!(info.status, 200, "{}", info.body_text());
    }

    pub fn info(&self) -> serde_json::Value {
        serde_json::from_slice(&self.call("GET", "vm.info", None).body).unwrap()
    }

    /// Sends raw bytes on a new connection and reads the reply to EOF (bounded by a timeout).
    pub fn raw(&self, bytes: &[u8]) -> HttpResponse {
        let mut s = UnixStream::connect(&self.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(bytes);
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e) if !out.is_empty() && e.kind() == std::io::ErrorKind::ConnectionReset => {
                    break
                }
                Err(e) => panic!("read failed after {} bytes: {e}", out.len()),
            }
        }
        parse_response(&out).unwrap()
    }

    pub fn lendctl(&self, args: &[&str]) -> Output {
        let mut full = vec!["--api-socket", self.socket.to_str().unwrap()];
        full.extend_from_slice(args);
        lendctl(&full)
    }

    pub fn stop_server(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown().unwrap();
        }
    }
}

pub fn lendctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lendctl"))
        .args(args)
        .env("RUST_LOG", "off")
        .output()
        .unwrap()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
