//! The REST server: HTTP/1.1 over a Unix socket, root `/api/v1`, JSON bodies.
//!
//! # Why axum on a current-thread tokio runtime
//!
//! Cloud Hypervisor uses `micro_http`, which is not on crates.io. axum 0.8 is the well-kept
//! choice that speaks HTTP/1.1 over a `tokio::net::UnixListener` directly, gives us routing with
//! 404/405 fallbacks, and is built on hyper, so header parsing and keep-alive are not ours to get wrong. All of it runs on one
//! dedicated thread with a current-thread runtime: the VMM never sees tokio, only an
//! `std::sync::mpsc` channel and an `EventFd` (see [`crate::request`]). Many slow clients cost
//! tasks, not threads, and a request the VMM never answers is bounded by `request_timeout`.
//!
//! # Status codes
//!
//! | case | status | body |
//! |---|---|---|
//! | success with data (`vmm.ping`, `vm.info`, `vm.add-remote-device`) | 200 | JSON |
//! | `metrics` | 200 | OpenMetrics text |
//! | success without data (`vm.remove-device`, `vm.shutdown`, `vm.pause`, `vm.resume`, `vm.snapshot`, `vm.send-migration`, `vm.receive-migration`, `vmm.shutdown`) | 204 | empty |
//! | `vm.events` | 200 | JSON lines, chunked, until the VMM shuts down (`follow=false`: what is retained) |
//! | malformed JSON, unknown field, bad BDF/node/id syntax, empty body | 400 | text |
//! | VMM said bad request (unknown node, no such device on the lender) | 400 | text |
//! | unknown path | 404 | text |
//! | VMM said not found (unknown id, double remove) | 404 | text |
//! | wrong method on a known path | 405 | text, `Allow` header |
//! | VMM said conflict (duplicate id, device already attached or still being released, VM shutting down) | 409 | text |
//! | body not delivered within `body_timeout` (10 s) | 408 | text |
//! | body larger than the limit (64 KiB by default), declared or actual | 413 | text |
//! | VMM internal error, or a response that does not fit the request | 500 | text |
//! | the lender a hot-add needs failed (unreachable, refused the connection, gone mid-borrow) | 502 | text |
//! | VMM gone (channel closed, message dropped) or said unavailable | 503 | text |
//! | VMM did not answer within `request_timeout` | 504 | text |
//!
//! Cloud Hypervisor answers every VMM-side failure with 500; lendvm refines that into
//! 400/404/409/502/503 so clients can tell a typo or a failed lender (a gateway-type failure:
//! the VMM is fine, the upstream lender is not) from a failure of the VMM, and keeps 500 for
//! real VMM-internal failures.

use std::io;

use ntb::sock::{bind_private, BindError, SocketFile};
use std::os::unix::net::UnixListener as StdUnixListener;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use axum::Router;
use http_body_util::BodyExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use thiserror::Error;
use tokio::sync::oneshot;
use vmm_sys_util::eventfd::EventFd;

use crate::events::{EventBus, VmEvent};
use crate::request::{ApiError, ApiMessage, ApiRequest, ApiResponse};
use crate::types::{
    SpecError, VmAddRemoteDeviceData, VmReceiveMigrationData, VmRemoveDeviceData,
    VmSendMigrationData, VmSnapshotConfig,
};

/// URL prefix of every endpoint.
pub const API_ROOT: &str = "/api/v1";
/// Default request body limit.
pub const DEFAULT_BODY_LIMIT: usize = 64 * 1024;
/// Default time the server waits for the VMM to answer one request.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Default time a client has to deliver a request body.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the server waits for the VMM to answer `vm.send-migration` (it answers once
/// the whole migration is done).
pub const MIGRATION_TIMEOUT: Duration = Duration::from_secs(600);
/// How long shutdown waits for in-flight requests before dropping them.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Every endpoint: (name, method).
pub const ENDPOINTS: &[(&str, &str)] = &[
    ("vmm.ping", "GET"),
    ("vm.info", "GET"),
    ("vm.add-remote-device", "PUT"),
    ("vm.remove-device", "PUT"),
    ("vm.shutdown", "PUT"),
    ("vm.counters", "GET"),
    ("vm.pause", "PUT"),
    ("vm.resume", "PUT"),
    ("vm.snapshot", "PUT"),
    ("vm.send-migration", "PUT"),
    ("vm.receive-migration", "PUT"),
    ("vm.events", "GET"),
    ("vmm.shutdown", "PUT"),
    ("metrics", "GET"),
];

/// Errors starting or stopping the server.
#[derive(Debug, Error)]
pub enum ServerError {
    #[error("api socket {0} is in use by another process")]
    InUse(PathBuf),
    #[error("api socket path {0} exists and is not a socket")]
    NotASocket(PathBuf),
    #[error("cannot remove stale api socket {0}: {1}")]
    RemoveStale(PathBuf, io::Error),
    #[error("cannot bind api socket {0}: {1}")]
    Bind(PathBuf, io::Error),
    #[error("cannot set up api socket {0}: {1}")]
    Setup(PathBuf, io::Error),
    #[error("cannot create the api runtime: {0}")]
    Runtime(io::Error),
    #[error("cannot spawn the api thread: {0}")]
    Spawn(io::Error),
    #[error("the api thread panicked")]
    ThreadPanicked,
}

/// Server settings.
#[derive(Debug, Clone)]
pub struct ApiServerConfig {
    pub socket_path: PathBuf,
    /// Bodies larger than this get 413.
    pub body_limit: usize,
    /// A request the VMM has not answered after this gets 504.
    pub request_timeout: Duration,
    /// A request body not fully received after this gets 408.
    pub body_timeout: Duration,
    /// The VMM's event bus, streamed by `vm.events` (404 without one).
    pub events: Option<Arc<EventBus>>,
}

impl ApiServerConfig {
    pub fn new(socket_path: impl Into<PathBuf>) -> Self {
        ApiServerConfig {
            socket_path: socket_path.into(),
            body_limit: DEFAULT_BODY_LIMIT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            events: None,
        }
    }
}

/// A running server. [`ApiServer::shutdown`] (or drop) stops it, joins its thread and removes
/// the socket file.
#[derive(Debug)]
pub struct ApiServer {
    socket_path: PathBuf,
    /// The socket file this server created (removed only if still there).
    file: SocketFile,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Clone)]
struct AppState {
    tx: Sender<ApiMessage>,
    evt: Arc<EventFd>,
    timeout: Duration,
    body_limit: usize,
    body_timeout: Duration,
    events: Option<Arc<EventBus>>,
}

fn text(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        message.into(),
    )
        .into_response()
}

fn json<T: Serialize>(value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode the response: {e}"),
        ),
    }
}

fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.kind.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    text(status, e.message.clone())
}

impl AppState {
    /// Sends `request` to the VMM and turns its answer into an HTTP response.
    async fn forward(&self, request: ApiRequest) -> Response {
        let endpoint = request.endpoint();
        let (msg, reply) = ApiMessage::new(request.clone());
        if self.tx.send(msg).is_err() {
            log::warn!("api: {endpoint}: the vmm is not accepting requests");
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                "the vmm is not accepting requests (it is shutting down or has exited)",
            );
        }
        if let Err(e) = self.evt.write(1) {
            log::error!("api: {endpoint}: cannot signal the vmm: {e}");
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot signal the vmm: {e}"),
            );
        }
        // A live migration answers when the destination has the VM: give it longer.
        let timeout = if matches!(request, ApiRequest::VmSendMigration(_)) {
            self.timeout.max(MIGRATION_TIMEOUT)
        } else {
            self.timeout
        };
        let answer = match tokio::time::timeout(timeout, reply).await {
            Err(_) => {
                log::error!("api: {endpoint}: no answer from the vmm");
                return text(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!(
                        "the vmm did not answer {endpoint} within {} ms",
                        timeout.as_millis()
                    ),
                );
            }
            Ok(Err(_)) => {
                return text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("the vmm dropped the {endpoint} request without answering"),
                );
            }
            Ok(Ok(answer)) => answer,
        };
        match (&request, answer) {
            (_, Err(e)) => {
                log::info!("api: {endpoint}: {} {}", e.kind.status(), e.message);
                error_response(&e)
            }
            (ApiRequest::VmmPing, Ok(ApiResponse::Pong(p))) => json(&p),
            (ApiRequest::VmInfo, Ok(ApiResponse::VmInfo(i))) => json(&i),
            (ApiRequest::VmAddRemoteDevice(_), Ok(ApiResponse::DeviceAdded(d))) => {
                log::info!("api: added remote device {} at {}", d.id, d.bdf);
                json(&d)
            }
            (ApiRequest::VmCounters, Ok(ApiResponse::Counters(c))) => json(&c),
            (ApiRequest::VmMetrics(f), Ok(ApiResponse::Metrics(t))) => (
                StatusCode::OK,
                [(header::CONTENT_TYPE, f.content_type())],
                t,
            )
                .into_response(),
            (
                ApiRequest::VmRemoveDevice(_)
                | ApiRequest::VmShutdown
                | ApiRequest::VmPause
                | ApiRequest::VmResume
                | ApiRequest::VmSnapshot(_)
                | ApiRequest::VmSendMigration(_)
                | ApiRequest::VmReceiveMigration(_)
                | ApiRequest::VmmShutdown,
                Ok(ApiResponse::Empty),
            ) => StatusCode::NO_CONTENT.into_response(),
            (_, Ok(other)) => {
                log::error!("api: {endpoint}: vmm answered with a mismatched {other:?}");
                text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("internal error: the vmm answered {endpoint} with the wrong kind of response"),
                )
            }
        }
    }

    fn too_large(&self) -> Response {
        text(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "request body is larger than the {} byte limit",
                self.body_limit
            ),
        )
    }

    /// Reads the body up to the limit: a declared or actual length over it is 413, a body not
    /// delivered in time is 408.
    async fn read_body(&self, headers: &HeaderMap, body: Body) -> Result<Bytes, Response> {
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|len| len > self.body_limit as u64) {
            return Err(self.too_large());
        }
        let mut body = body;
        let mut buf = Vec::new();
        let collect = async {
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| {
                    text(
                        StatusCode::BAD_REQUEST,
                        format!("cannot read the request body: {e}"),
                    )
                })?;
                if let Some(data) = frame.data_ref() {
                    if buf.len() + data.len() > self.body_limit {
                        return Err(self.too_large());
                    }
                    buf.extend_from_slice(data);
                }
            }
            Ok(())
        };
        match tokio::time::timeout(self.body_timeout, collect).await {
            Err(_) => Err(text(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "request body not received within {} ms",
                    self.body_timeout.as_millis()
                ),
            )),
            Ok(Err(r)) => Err(r),
            Ok(Ok(())) => Ok(Bytes::from(buf)),
        }
    }

    /// Reads, parses and `validate`s a JSON request body, mapping every failure to a 4xx with
    /// a clear message.
    async fn parse_body<T: DeserializeOwned>(
        &self,
        headers: &HeaderMap,
        body: Body,
        validate: fn(&T) -> Result<(), SpecError>,
    ) -> Result<T, Response> {
        let body = self.read_body(headers, body).await?;
        if body.iter().all(u8::is_ascii_whitespace) {
            return Err(text(
                StatusCode::BAD_REQUEST,
                "missing request body: expected a JSON object",
            ));
        }
        let invalid = |e: &dyn std::fmt::Display| {
            text(
                StatusCode::BAD_REQUEST,
                format!("invalid request body: {e}"),
            )
        };
        let data = from_json(&body).map_err(|e| invalid(&e))?;
        validate(&data).map_err(|e| invalid(&e))?;
        Ok(data)
    }
}

/// Parses a JSON body like `serde_json::from_slice`, but an error inside a field names it
/// (`field mode: unknown variant ...`): serde_json's own messages give only a line and
/// column, which says little to a client that built the body programmatically.
fn from_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let data = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path.is_empty() || path == "." {
            inner.to_string()
        } else {
            format!("field {path}: {inner}")
        }
    })?;
    // Trailing characters after the object are an error, as in `from_slice`.
    de.end().map_err(|e| e.to_string())?;
    Ok(data)
}

async fn vmm_ping(State(s): State<AppState>) -> Response {
    s.forward(ApiRequest::VmmPing).await
}

async fn vm_info(State(s): State<AppState>) -> Response {
    s.forward(ApiRequest::VmInfo).await
}

async fn vm_add_remote_device(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match s
        .parse_body(&headers, body, VmAddRemoteDeviceData::validate)
        .await
    {
        Ok(data) => s.forward(ApiRequest::VmAddRemoteDevice(data)).await,
        Err(r) => r,
    }
}

async fn vm_remove_device(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match s
        .parse_body(&headers, body, VmRemoveDeviceData::validate)
        .await
    {
        Ok(data) => s.forward(ApiRequest::VmRemoveDevice(data)).await,
        Err(r) => r,
    }
}

async fn vm_snapshot(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match s
        .parse_body(&headers, body, VmSnapshotConfig::validate)
        .await
    {
        Ok(data) => s.forward(ApiRequest::VmSnapshot(data)).await,
        Err(r) => r,
    }
}

async fn vm_send_migration(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match s
        .parse_body(&headers, body, VmSendMigrationData::validate)
        .await
    {
        Ok(data) => s.forward(ApiRequest::VmSendMigration(data)).await,
        Err(r) => r,
    }
}

async fn vm_receive_migration(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match s
        .parse_body(&headers, body, VmReceiveMigrationData::validate)
        .await
    {
        Ok(data) => s.forward(ApiRequest::VmReceiveMigration(data)).await,
        Err(r) => r,
    }
}

async fn vm_shutdown(State(s): State<AppState>) -> Response {
    // Like Cloud Hypervisor, vm.shutdown takes no body; anything sent is ignored.
    s.forward(ApiRequest::VmShutdown).await
}

async fn vm_counters(State(s): State<AppState>) -> Response {
    s.forward(ApiRequest::VmCounters).await
}

async fn vm_metrics(State(s): State<AppState>, headers: HeaderMap) -> Response {
    let format = lending::metrics::Format::from_accept(
        headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()),
    );
    s.forward(ApiRequest::VmMetrics(format)).await
}

async fn vm_pause(State(s): State<AppState>) -> Response {
    s.forward(ApiRequest::VmPause).await
}

async fn vm_resume(State(s): State<AppState>) -> Response {
    s.forward(ApiRequest::VmResume).await
}

async fn vmm_shutdown(State(s): State<AppState>) -> Response {
    s.forward(ApiRequest::VmmShutdown).await
}

/// `vm.events` query: `since=SEQ` replays the retained events after SEQ (0: all retained);
/// `follow=false` answers with what is retained and ends instead of streaming.
fn events_query(uri: &Uri) -> Result<(Option<u64>, bool), String> {
    let mut since = None;
    let mut follow = true;
    for pair in uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "since" => {
                since = Some(
                    v.parse::<u64>()
                        .map_err(|_| format!("since={v:?} is not an event sequence number"))?,
                )
            }
            "follow" => {
                follow = match v {
                    "true" | "1" | "" => true,
                    "false" | "0" => false,
                    _ => return Err(format!("follow={v:?}: expected true or false")),
                }
            }
            _ => return Err(format!("unknown query parameter {k:?} (since, follow)")),
        }
    }
    Ok((since, follow))
}

fn event_line(ev: &VmEvent) -> Bytes {
    let mut line = serde_json::to_vec(ev).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

/// `GET vm.events`: JSON lines, chunked; the stream ends when the VMM shuts down.
async fn vm_events(State(s): State<AppState>, uri: Uri) -> Response {
    let Some(bus) = &s.events else {
        return text(StatusCode::NOT_FOUND, "this vmm has no event stream");
    };
    let (since, follow) = match events_query(&uri) {
        Ok(q) => q,
        Err(e) => return text(StatusCode::BAD_REQUEST, e),
    };
    let sub = bus.subscribe(since.or(if follow { None } else { Some(0) }));
    let backlog: Vec<Bytes> = sub.backlog.iter().map(|e| event_line(e)).collect();
    let live = if follow { sub.live } else { None };
    let head = futures_util::stream::iter(backlog.into_iter().map(Ok::<_, std::io::Error>));
    let tail = futures_util::stream::unfold(live, |rx| async move {
        let mut rx = rx?;
        match rx.recv().await {
            Ok(ev) => Some((Ok(event_line(&ev)), Some(rx))),
            Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                // This follower fell behind by `n` events: say so in the stream.
                let note = format!(
                    "{{\"event\":\"events-lost\",\"source\":\"api\",\"properties\":{{\"count\":{n}}}}}\n"
                );
                Some((Ok(Bytes::from(note)), Some(rx)))
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => None,
        }
    });
    use futures_util::StreamExt;
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(head.chain(tail)),
    )
        .into_response()
}

async fn unknown_endpoint(uri: Uri) -> Response {
    text(
        StatusCode::NOT_FOUND,
        format!("unknown endpoint {}", uri.path()),
    )
}

async fn wrong_method(method: Method, uri: Uri) -> Response {
    let name = uri
        .path()
        .strip_prefix(API_ROOT)
        .and_then(|p| p.strip_prefix('/'))
        .unwrap_or("");
    let allowed = ENDPOINTS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, m)| *m)
        .unwrap_or("another method");
    text(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "method {method} is not allowed on {}: use {allowed}",
            uri.path()
        ),
    )
}

fn router(state: AppState) -> Router {
    Router::new()
        .route(&format!("{API_ROOT}/vmm.ping"), get(vmm_ping))
        .route(&format!("{API_ROOT}/vm.info"), get(vm_info))
        .route(
            &format!("{API_ROOT}/vm.add-remote-device"),
            put(vm_add_remote_device),
        )
        .route(
            &format!("{API_ROOT}/vm.remove-device"),
            put(vm_remove_device),
        )
        .route(&format!("{API_ROOT}/vm.shutdown"), put(vm_shutdown))
        .route(&format!("{API_ROOT}/vm.counters"), get(vm_counters))
        .route(&format!("{API_ROOT}/metrics"), get(vm_metrics))
        .route(&format!("{API_ROOT}/vm.pause"), put(vm_pause))
        .route(&format!("{API_ROOT}/vm.snapshot"), put(vm_snapshot))
        .route(
            &format!("{API_ROOT}/vm.send-migration"),
            put(vm_send_migration),
        )
        .route(
            &format!("{API_ROOT}/vm.receive-migration"),
            put(vm_receive_migration),
        )
        .route(&format!("{API_ROOT}/vm.resume"), put(vm_resume))
        .route(&format!("{API_ROOT}/vm.events"), get(vm_events))
        .route(&format!("{API_ROOT}/vmm.shutdown"), put(vmm_shutdown))
        .fallback(unknown_endpoint)
        .method_not_allowed_fallback(wrong_method)
        .with_state(state)
}

/// Binds `path` with mode 0600 from the start (the API can attach devices and stop the VM:
/// owner only), replacing a stale socket file nobody listens on, refusing a live one or a
/// non-socket file ([`ntb::sock::bind_private`]: bound in a private 0700 directory, then
/// renamed into place).
fn bind(path: &Path) -> Result<(StdUnixListener, SocketFile), ServerError> {
    let (listener, file) = bind_private(path).map_err(|e| match e {
        BindError::NotASocket(p) => ServerError::NotASocket(p),
        BindError::InUse(p) => ServerError::InUse(p),
        BindError::Io { source, .. } => ServerError::Bind(path.to_path_buf(), source),
        // (only bind_shared looks a group up)
        e @ BindError::NoSuchGroup(_) => ServerError::Bind(
            path.to_path_buf(),
            std::io::Error::new(std::io::ErrorKind::NotFound, e.to_string()),
        ),
    })?;
    let setup = |e| ServerError::Setup(path.to_path_buf(), e);
    listener.set_nonblocking(true).map_err(setup)?;
    Ok((listener, file))
}

impl ApiServer {
    /// Binds the socket and starts serving on a thread named `api-http`. Each request is sent to
    /// `api_tx` and `api_evt` is written to wake the VMM.
    pub fn start(
        config: ApiServerConfig,
        api_tx: Sender<ApiMessage>,
        api_evt: EventFd,
    ) -> Result<ApiServer, ServerError> {
        let (listener, file) = bind(&config.socket_path)?;
        let cleanup = |e: ServerError| {
            file.remove_if_ours(&config.socket_path);
            e
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| cleanup(ServerError::Runtime(e)))?;
        let state = AppState {
            tx: api_tx,
            evt: Arc::new(api_evt),
            timeout: config.request_timeout,
            body_limit: config.body_limit,
            body_timeout: config.body_timeout,
            events: config.events.clone(),
        };
        let app = router(state);
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let path = config.socket_path.clone();
        let thread = std::thread::Builder::new()
            .name("api-http".into())
            .spawn(move || runtime.block_on(serve(listener, app, stop_rx, path)))
            .map_err(|e| cleanup(ServerError::Spawn(e)))?;
        log::info!("api: listening on {}", config.socket_path.display());
        Ok(ApiServer {
            socket_path: config.socket_path,
            file,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    pub fn socket_path(&self) -> &Path {
        &self.socket_path
    }

    /// Stops accepting connections, lets in-flight requests finish (at most 2 s), joins the
    /// thread and removes the socket file.
    pub fn shutdown(mut self) -> Result<(), ServerError> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<(), ServerError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let joined = match self.thread.take() {
            Some(t) => t.join().map_err(|_| ServerError::ThreadPanicked),
            None => Ok(()),
        };
        self.file.remove_if_ours(&self.socket_path);
        joined
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if self.thread.is_some() {
            if let Err(e) = self.stop_and_join() {
                log::error!("api: {e}");
            }
        }
    }
}

async fn serve(
    listener: StdUnixListener,
    app: Router,
    stop_rx: oneshot::Receiver<()>,
    path: PathBuf,
) {
    let listener = match tokio::net::UnixListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            log::error!("api: cannot register socket {}: {e}", path.display());
            return;
        }
    };
    let (drain_tx, drain_rx) = oneshot::channel::<()>();
    let signal = async move {
        // Also fires when the ApiServer is dropped (sender gone).
        let _ = stop_rx.await;
        let _ = drain_tx.send(());
    };
    let server = axum::serve(listener, app).with_graceful_shutdown(signal);
    let deadline = async move {
        if drain_rx.await.is_ok() {
            tokio::time::sleep(DRAIN_TIMEOUT).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        r = server => {
            if let Err(e) = r {
                log::error!("api: server failed: {e}");
            }
        }
        _ = deadline => log::warn!("api: in-flight requests dropped at shutdown"),
    }
    log::info!("api: stopped serving {}", path.display());
}
