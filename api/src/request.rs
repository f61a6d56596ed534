//! The internal API between the HTTP server thread and the VMM loop.
//!
//! The server turns each HTTP request into an [`ApiRequest`], sends an [`ApiMessage`] (request +
//! one-shot reply slot) over a `std::sync::mpsc` channel and writes `1` to an `EventFd` so the
//! VMM's epoll loop wakes. The VMM answers every message with [`ApiMessage::respond`] and an
//! [`ApiReply`]. The simplest way to do that is to implement [`ApiHandler`] and call
//! [`serve_pending`] whenever the eventfd is readable:
//!
//! ```no_run
//! use api::request::{serve_pending, ApiHandler, ApiMessage, ApiReply, ApiRequest, ApiResponse};
//! struct Vmm;
//! impl ApiHandler for Vmm {
//!     fn handle(&mut self, request: ApiRequest) -> ApiReply {
//!         match request {
//!             ApiRequest::VmmPing => Ok(ApiResponse::Pong(api::types::VmmPingResponse {
//!                 version: "0.1.0".into(),
//!                 pid: 1,
//!                 features: vec![],
//!             })),
//!             _ => Err(api::request::ApiError::internal("not implemented")),
//!         }
//!     }
//! }
//! # fn main() -> std::io::Result<()> {
//! let evt = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK)?;
//! let (tx, rx) = std::sync::mpsc::channel::<ApiMessage>();
//! // ... give `tx` and `evt.try_clone()?` to api::server::ApiServer::start, add `evt` to epoll ...
//! // on EPOLLIN for evt:
//! serve_pending(&rx, &evt, &mut Vmm);
//! # Ok(()) }
//! ```
//!
//! The reply slot is a `tokio::sync::oneshot` sender wrapped in [`ApiMessage`]: sending on it is
//! an ordinary non-blocking call from the VMM thread, and the server can await it with a timeout
//! without parking a thread per request.

use std::fmt;
use std::sync::mpsc::Receiver;

use thiserror::Error;
use tokio::sync::oneshot;
use vmm_sys_util::eventfd::EventFd;

use crate::types::{
    PciDeviceInfo, VmAddRemoteDeviceData, VmCountersReport, VmInfo, VmReceiveMigrationData,
    VmRemoveDeviceData, VmSendMigrationData, VmSnapshotConfig, VmState, VmmPingResponse,
};

/// What a client asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiRequest {
    VmmPing,
    VmInfo,
    VmAddRemoteDevice(VmAddRemoteDeviceData),
    VmRemoveDevice(VmRemoveDeviceData),
    VmShutdown,
    VmCounters,
    VmPause,
    VmResume,
    VmSnapshot(VmSnapshotConfig),
    VmSendMigration(VmSendMigrationData),
    VmReceiveMigration(VmReceiveMigrationData),
    VmmShutdown,
    /// `GET /api/v1/metrics`: the VM's figures as OpenMetrics (or Prometheus) text.
    VmMetrics(lending::metrics::Format),
}

impl ApiRequest {
    /// The endpoint name (`vm.info`), for logs and error messages.
    pub fn endpoint(&self) -> &'static str {
        match self {
            ApiRequest::VmmPing => "vmm.ping",
            ApiRequest::VmInfo => "vm.info",
            ApiRequest::VmAddRemoteDevice(_) => "vm.add-remote-device",
            ApiRequest::VmRemoveDevice(_) => "vm.remove-device",
            ApiRequest::VmShutdown => "vm.shutdown",
            ApiRequest::VmCounters => "vm.counters",
            ApiRequest::VmPause => "vm.pause",
            ApiRequest::VmResume => "vm.resume",
            ApiRequest::VmSnapshot(_) => "vm.snapshot",
            ApiRequest::VmSendMigration(_) => "vm.send-migration",
            ApiRequest::VmReceiveMigration(_) => "vm.receive-migration",
            ApiRequest::VmmShutdown => "vmm.shutdown",
            ApiRequest::VmMetrics(_) => "metrics",
        }
    }
}

/// A successful answer. Which variant fits which request:
///
/// | request | response | HTTP |
/// |---|---|---|
/// | `VmmPing` | `Pong` | 200 JSON |
/// | `VmInfo` | `VmInfo` | 200 JSON |
/// | `VmAddRemoteDevice` | `DeviceAdded` | 200 JSON `{"id","bdf"}` |
/// | `VmCounters` | `Counters` | 200 JSON `{id: {name: number}}` |
/// | `VmMetrics` | `Metrics` | 200 OpenMetrics text |
/// | `VmRemoveDevice`, `VmShutdown`, `VmPause`, `VmResume`, `VmSnapshot`, `VmSendMigration`, `VmReceiveMigration`, `VmmShutdown` | `Empty` | 204 |
///
/// Any other pairing is answered with 500 (a VMM bug).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiResponse {
    Pong(VmmPingResponse),
    // Boxed: the largest answer by far, and rare.
    VmInfo(Box<VmInfo>),
    DeviceAdded(PciDeviceInfo),
    Counters(VmCountersReport),
    /// Metrics text in the format asked for.
    Metrics(String),
    Empty,
}

/// HTTP status class of an [`ApiError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiErrorKind {
    /// 400: the request names something invalid (unknown node, device not on the lender, ...).
    BadRequest,
    /// 404: the device id does not exist (or was already removed).
    NotFound,
    /// 409: conflicts with the current state (duplicate id, device already attached or
    /// still being released, VM shutting down, removal already pending).
    Conflict,
    /// 503: the VMM cannot serve requests right now.
    ServiceUnavailable,
    /// 502: the lender the request needs failed: unreachable, refused the connection, went
    /// away or failed mid-request (the VMM itself is fine; retrying may help).
    BadGateway,
    /// 500: the VMM itself failed (cannot create or plug the device, ...).
    Internal,
}

impl ApiErrorKind {
    /// The HTTP status code.
    pub fn status(self) -> u16 {
        match self {
            ApiErrorKind::BadRequest => 400,
            ApiErrorKind::NotFound => 404,
            ApiErrorKind::Conflict => 409,
            ApiErrorKind::ServiceUnavailable => 503,
            ApiErrorKind::BadGateway => 502,
            ApiErrorKind::Internal => 500,
        }
    }
}

/// A failed answer: a status class and a short lower-case message naming the problem; the
/// message becomes the plain-text HTTP body.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{message}")]
pub struct ApiError {
    pub kind: ApiErrorKind,
    pub message: String,
}

impl ApiError {
    pub fn new(kind: ApiErrorKind, message: impl Into<String>) -> Self {
        ApiError {
            kind,
            message: message.into(),
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ApiErrorKind::BadRequest, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ApiErrorKind::NotFound, message)
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ApiErrorKind::Conflict, message)
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ApiErrorKind::ServiceUnavailable, message)
    }
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(ApiErrorKind::BadGateway, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ApiErrorKind::Internal, message)
    }
}

/// The 409 message for a lender device that is already in the table; a lost entry says how
/// to clear it (shared by the VMM and [`crate::fake::FakeVmm`]).
pub fn already_attached(spec: &impl fmt::Display, id: &str, lost: bool) -> String {
    if lost {
        format!(
            "{spec} is already attached as {id}, which is lost (its lease ended by surprise); \
             clear it with vm.remove-device {{\"id\":\"{id}\"}} (lendctl remove-device {id}) \
             or add again with \"replace_lost\": true (lendctl add-remote-device --replace-lost)"
        )
    } else {
        format!("{spec} is already attached as {id}")
    }
}

/// What the release of a removed lender device still waits for (the 409 of a re-add,
/// [`still_being_released`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseWait {
    /// `vm.remove-device` asked the guest to eject the device; it has not yet.
    GuestEject,
    /// Torn down, but a vCPU is still inside an access to it; then its lease goes back.
    VcpuAccess,
}

impl fmt::Display for ReleaseWait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReleaseWait::GuestEject => {
                "the guest has not ejected it yet (vm.remove-device with \"force\": true \
                 tears it down now)"
            }
            ReleaseWait::VcpuAccess => {
                "a vCPU is finishing an access to it, then its lease goes back to the lender"
            }
        })
    }
}

/// The 409 message for a lender device that was removed as `id` and is not released yet
/// (shared by the VMM and [`crate::fake::FakeVmm`]): the `device-released` event of `id`
/// says when a re-add can succeed.
pub fn still_being_released(spec: &impl fmt::Display, id: &str, wait: ReleaseWait) -> String {
    format!(
        "{spec} (removed as {id}) is still being released: {wait}; add it again after the \
         device-released event of {id} (lendctl events)"
    )
}

/// The 409 message for a device id that is taken (see [`already_attached`]).
pub fn id_in_use(id: &str, lost: bool) -> String {
    if lost {
        format!(
            "device id {id} is in use by a lost device (its lease ended by surprise); clear it \
             with vm.remove-device {{\"id\":\"{id}\"}} (lendctl remove-device {id}) or add \
             again with \"replace_lost\": true (lendctl add-remote-device --replace-lost)"
        )
    } else {
        format!("device id {id} is already in use")
    }
}

/// The 409 message for `vm.pause`/`vm.resume` in the wrong state.
pub fn pause_refusal(what: &str, state: VmState) -> String {
    match (what, state) {
        ("pause", VmState::Paused) => "the vm is already paused".into(),
        ("resume", VmState::Running) => "the vm is not paused".into(),
        _ => format!("cannot {what} the vm: it is {state}"),
    }
}

/// What the VMM sends back for one request.
pub type ApiReply = Result<ApiResponse, ApiError>;

/// One request in flight: the VMM must call [`ApiMessage::respond`] exactly once (dropping the
/// message unanswered makes the server answer 503).
pub struct ApiMessage {
    pub request: ApiRequest,
    reply: oneshot::Sender<ApiReply>,
}

impl fmt::Debug for ApiMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiMessage")
            .field("request", &self.request)
            .finish_non_exhaustive()
    }
}

impl ApiMessage {
    /// A message and the receiver its reply arrives on.
    pub fn new(request: ApiRequest) -> (Self, oneshot::Receiver<ApiReply>) {
        let (tx, rx) = oneshot::channel();
        (ApiMessage { request, reply: tx }, rx)
    }

    /// Sends the answer. Never blocks; if the client already went away (timed out) the reply is
    /// logged and dropped.
    pub fn respond(self, reply: ApiReply) {
        let endpoint = self.request.endpoint();
        if self.reply.send(reply).is_err() {
            log::warn!("api: {endpoint} answered after the client gave up; reply dropped");
        }
    }
}

/// Something that answers API requests on the VMM thread.
pub trait ApiHandler {
    fn handle(&mut self, request: ApiRequest) -> ApiReply;
}

/// Clears `evt` and answers every queued message with `handler`. Returns how many were served.
/// Call it when `evt` is readable; it never blocks (`evt` should be `EFD_NONBLOCK`).
pub fn serve_pending<H: ApiHandler + ?Sized>(
    rx: &Receiver<ApiMessage>,
    evt: &EventFd,
    handler: &mut H,
) -> usize {
    // Read first: a message queued after this read writes the eventfd again, so none is lost.
    if let Err(e) = evt.read() {
        if e.kind() != std::io::ErrorKind::WouldBlock {
            log::warn!("api: reading the api eventfd failed: {e}");
        }
    }
    let mut served = 0;
    while let Ok(ApiMessage { request, reply }) = rx.try_recv() {
        let endpoint = request.endpoint();
        log::debug!("api: serving {endpoint}");
        let answer = handler.handle(request);
        if reply.send(answer).is_err() {
            log::warn!("api: {endpoint} answered after the client gave up; reply dropped");
        }
        served += 1;
    }
    served
}
