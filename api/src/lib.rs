//! The lendvm REST API: request/response types, the HTTP server that forwards requests to the
//! VMM loop, a blocking client (used by `lendctl`) and a fake VMM for tests.
//!
//! * [`types`]: serde types of every body, the `node3:0000:81:00.0` parser shared with the
//!   `lendvm --remote-device` option.
//! * [`request`]: what the VMM sees: [`request::ApiMessage`] over an mpsc channel + eventfd,
//!   answered with [`request::ApiReply`].
//! * [`server`]: [`server::ApiServer`] (axum on its own thread, Unix socket).
//! * [`events`]: [`events::EventBus`], the `--event-monitor` / `vm.events` stream.
//! * [`client`]: [`client::ApiClient`], blocking HTTP/1.1 over a Unix socket.
//! * [`fake`]: [`fake::FakeVmm`], the reference semantics, for tests.
//! * [`lenders`]: `lendctl`'s lender commands (`lenders`, `list`, `status`) over the fabric.
//!
//! The endpoints are described in `api/openapi.yaml`.

pub mod client;
pub mod events;
pub mod fake;
pub mod lenders;
pub mod request;
pub mod server;
pub mod types;

/// The OpenAPI document, for tools that want to serve or check it.
pub const OPENAPI_YAML: &str = include_str!("../openapi.yaml");
