//! The `GET /metrics` listener: bounded in connections, idle time and renders.
//!
//! The endpoint is unauthenticated and reachable by every local user (loopback TCP or a
//! Unix socket), so nothing a scraper does may cost the daemon without bound:
//! - at most [`MAX_CONNECTIONS`] connections are served at once; one more is accepted and
//!   closed at once (so it holds no descriptor and the listen backlog does not fill), and
//!   the refusals are logged rate-limited;
//! - a connection that sends nothing for [`IDLE`] (slow headers, an idle keep-alive) is
//!   closed, and none lives longer than [`LIFETIME`];
//! - [`coalesced`] makes one render serve every scrape that asks within its age, so a flood
//!   of scrapes costs lendvm's VMM thread (and the lenders behind it) one report per age.
//!
//! With lenderd's 1024 descriptors (a systemd service's soft limit) the metrics listener so
//! holds at most [`MAX_CONNECTIONS`] + 1 of them (docs/SCALING.md, the descriptor budget).

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::serve::Listener;
use axum::Router;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;

use super::{Format, MetricsAddr, MetricsError};

/// Connections served at once. Prometheus uses one per target; a few more leave room for an
/// operator's curl and a second scraper.
pub const MAX_CONNECTIONS: usize = 16;

/// A connection that sends nothing for this long is closed (headers, or the next request of
/// a keep-alive connection). Longer than the slowest render (lendvm's: 5 s at most).
const IDLE: Duration = Duration::from_secs(10);

/// No connection lives longer (a scraper that trickles bytes to dodge [`IDLE`]).
const LIFETIME: Duration = Duration::from_secs(60);

/// Renders the text for one scrape in a format (called on a blocking thread of the
/// listener).
pub type Render = Arc<dyn Fn(Format) -> Result<String, String> + Send + Sync>;

/// A running `GET /metrics` listener. Dropping it stops it (and removes its Unix socket).
#[derive(Debug)]
pub struct MetricsServer {
    addr: String,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    unix: Option<(PathBuf, ntb::sock::SocketFile)>,
}

enum Bound {
    Tcp(std::net::TcpListener),
    Unix(std::os::unix::net::UnixListener),
}

impl MetricsServer {
    /// Binds `addr` (errors name it) and serves `GET /metrics` from `render` on a thread of
    /// its own.
    pub fn start(addr: &MetricsAddr, render: Render) -> Result<MetricsServer, MetricsError> {
        let (bound, unix, shown) = match addr {
            MetricsAddr::Tcp(a) => {
                let l = std::net::TcpListener::bind(a).map_err(|source| MetricsError::Bind {
                    addr: a.to_string(),
                    source,
                })?;
                let shown = l
                    .local_addr()
                    .map_or_else(|_| a.to_string(), |a| a.to_string());
                (Bound::Tcp(l), None, shown)
            }
            MetricsAddr::Unix(p) => {
                let (l, file) = ntb::sock::bind_private(p).map_err(MetricsError::BindUnix)?;
                (Bound::Unix(l), Some((p.clone(), file)), addr.to_string())
            }
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(MetricsError::Start)?;
        let render = coalesced(render, COALESCE);
        let app = Router::new().route(
            "/metrics",
            get(move |headers: axum::http::HeaderMap| {
                let render = Arc::clone(&render);
                let format =
                    Format::from_accept(headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()));
                async move { scrape(render, format).await }
            }),
        );
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let name = shown.clone();
        let thread = std::thread::Builder::new()
            .name("metrics-http".into())
            .spawn(move || {
                runtime.block_on(serve(bound, app, stop_rx, name));
                // A render still running (lendvm's waits for its VMM thread) is left to
                // finish on its own rather than hold up the stop.
                runtime.shutdown_timeout(DRAIN);
            })
            .map_err(MetricsError::Start)?;
        log::info!("metrics: serving GET /metrics at {shown}");
        Ok(MetricsServer {
            addr: shown,
            stop: Some(stop_tx),
            thread: Some(thread),
            unix,
        })
    }

    /// The address it listens at (the bound port for `:0`).
    pub fn addr(&self) -> &str {
        &self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some((p, f)) = &self.unix {
            f.remove_if_ours(p);
        }
    }
}

async fn scrape(render: Render, format: Format) -> Response {
    match tokio::task::spawn_blocking(move || render(format)).await {
        Ok(Ok(text)) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, format.content_type())],
            text,
        )
            .into_response(),
        Ok(Err(e)) => (StatusCode::SERVICE_UNAVAILABLE, e).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("metrics: rendering failed: {e}"),
        )
            .into_response(),
    }
}

/// How long a stop waits for scrapes in flight. Prometheus keeps its connection open between
/// scrapes, so a graceful shutdown alone could wait for ever.
const DRAIN: Duration = Duration::from_secs(1);

async fn serve(bound: Bound, app: Router, stop: oneshot::Receiver<()>, name: String) {
    let (stopping_tx, stopping_rx) = oneshot::channel::<()>();
    let signal = async move {
        // Also fires when the MetricsServer is dropped (sender gone).
        let _ = stop.await;
        let _ = stopping_tx.send(());
    };
    let deadline = async move {
        if stopping_rx.await.is_ok() {
            tokio::time::sleep(DRAIN).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    let shown = name.clone();
    let server = async move {
        match bound {
            Bound::Tcp(l) => match l
                .set_nonblocking(true)
                .and_then(|()| tokio::net::TcpListener::from_std(l))
            {
                Ok(l) => {
                    axum::serve(Bounded::new(l, shown), app)
                        .with_graceful_shutdown(signal)
                        .await
                }
                Err(e) => Err(e),
            },
            Bound::Unix(l) => match l
                .set_nonblocking(true)
                .and_then(|()| tokio::net::UnixListener::from_std(l))
            {
                Ok(l) => {
                    axum::serve(Bounded::new(l, shown), app)
                        .with_graceful_shutdown(signal)
                        .await
                }
                Err(e) => Err(e),
            },
        }
    };
    tokio::select! {
        r = server => {
            if let Err(e) = r {
                log::error!("metrics: the listener at {name} failed: {e}");
            }
        }
        _ = deadline => log::debug!("metrics: open connections at {name} dropped at stop"),
    }
}

/// How old a rendered text may be when it answers another scrape ([`coalesced`]).
/// Prometheus scrapes every 15 s or more; two scrapers within a second see the same figures.
const COALESCE: Duration = Duration::from_secs(1);

/// `render` behind a cache of one text per format, at most `max_age` old: renders run one
/// at a time, and a scrape that arrives while one runs waits for it and takes its text. So
/// however many scrapes arrive, `render` runs at most once per `max_age` and format (lendvm's
/// asks the VMM thread, which asks each lender for its counters).
pub fn coalesced(render: Render, max_age: Duration) -> Render {
    let cache: Mutex<HashMap<Format, (Instant, String)>> = Mutex::new(HashMap::new());
    Arc::new(move |format| {
        let asked = Instant::now();
        // Held across the render: the scrapes that queue here are the ones it serves.
        let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, text)) = cache.get(&format) {
            if asked.saturating_duration_since(*at) <= max_age {
                return Ok(text.clone());
            }
        }
        let started = Instant::now();
        let text = render(format)?;
        cache.insert(format, (started, text.clone()));
        Ok(text)
    })
}

/// A listener that serves at most a semaphore's worth of connections at once, each wrapped
/// in [`Limited`]; one beyond that is closed as soon as it is accepted.
struct Bounded<L> {
    inner: L,
    slots: Arc<Semaphore>,
    refused: ntb::RateLimit,
    name: String,
}

impl<L> Bounded<L> {
    /// `inner` with [`MAX_CONNECTIONS`] slots; `name` is its address in the log.
    fn new(inner: L, name: String) -> Self {
        Bounded {
            inner,
            slots: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
            refused: ntb::RateLimit::new(Duration::from_secs(10)),
            name,
        }
    }
}

impl<L: Listener> Listener for Bounded<L>
where
    L::Io: Unpin,
{
    type Io = Limited<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (io, addr) = self.inner.accept().await;
            match Arc::clone(&self.slots).try_acquire_owned() {
                Ok(permit) => return (Limited::new(io, permit), addr),
                Err(_) => {
                    drop(io);
                    if let Some(held) = self.refused.hit() {
                        log::warn!(
                            "metrics: {MAX_CONNECTIONS} connections at {} already; closing new \
                             ones ({held} more closed since the last line)",
                            self.name
                        );
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A served connection: holds its slot until dropped, and fails its reads once the peer
/// has sent nothing for [`IDLE`] or the connection is [`LIFETIME`] old.
pub struct Limited<T> {
    io: T,
    _slot: OwnedSemaphorePermit,
    idle: Pin<Box<Sleep>>,
    end: Pin<Box<Sleep>>,
}

impl<T> Limited<T> {
    fn new(io: T, slot: OwnedSemaphorePermit) -> Self {
        Limited {
            io,
            _slot: slot,
            idle: Box::pin(tokio::time::sleep(IDLE)),
            end: Box::pin(tokio::time::sleep(LIFETIME)),
        }
    }
}

fn timed_out(what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("metrics connection {what}"),
    )
}

impl<T: AsyncRead + Unpin> AsyncRead for Limited<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.end.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(timed_out("too old")));
        }
        let before = buf.filled().len();
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    let next = tokio::time::Instant::now() + IDLE;
                    self.idle.as_mut().reset(next);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                if self.idle.as_mut().poll(cx).is_ready() {
                    Poll::Ready(Err(timed_out("idle")))
                } else {
                    Poll::Pending
                }
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Limited<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn a_slow_scrape_in_flight_does_not_hold_up_the_stop() {
        use std::io::{Read, Write};
        use std::time::{Duration, Instant};
        let a = MetricsAddr::Tcp("127.0.0.1:0".parse().unwrap());
        let s = MetricsServer::start(&a, Arc::new(|f| Ok(format!("{f:?}\n")))).unwrap();
        let mut c = std::net::TcpStream::connect(s.addr()).unwrap();
        c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut reply = String::new();
        c.read_to_string(&mut reply).unwrap();
        assert!(
            reply.starts_with("HTTP/1.0 200") && reply.contains("Text"),
            "{reply}"
        );
        drop(s);
        // A render that takes far longer than the stop may wait (lendvm's waits for its
        // VMM thread): the stop is bounded all the same.
        let slow = MetricsServer::start(
            &a,
            Arc::new(|_| {
                std::thread::sleep(Duration::from_secs(20));
                Ok(String::new())
            }),
        )
        .unwrap();
        let addr = slow.addr().to_string();
        let client = std::thread::spawn(move || {
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
            let mut b = Vec::new();
            let _ = c.read_to_end(&mut b);
        });
        std::thread::sleep(Duration::from_millis(300));
        let t0 = Instant::now();
        drop(slow);
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        client.join().unwrap();
    }

    #[test]
    fn a_taken_address_is_a_clear_error() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = MetricsAddr::Tcp(l.local_addr().unwrap());
        let e = MetricsServer::start(&a, Arc::new(|_| Ok(String::new()))).unwrap_err();
        assert!(
            e.to_string().contains(&format!(
                "cannot listen for metrics at {}",
                l.local_addr().unwrap()
            )),
            "{e}"
        );
    }

    fn scrape_once(addr: &str) -> String {
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut reply = String::new();
        let _ = c.read_to_string(&mut reply);
        reply
    }

    #[test]
    fn connections_beyond_the_bound_are_closed_and_idle_ones_time_out() {
        let a = MetricsAddr::Tcp("127.0.0.1:0".parse().unwrap());
        let s = MetricsServer::start(&a, Arc::new(|_| Ok("up 1\n".into()))).unwrap();
        // The bound's worth of idle connections, then one more: that one is closed at once.
        let held: Vec<_> = (0..MAX_CONNECTIONS)
            .map(|_| std::net::TcpStream::connect(s.addr()).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let mut extra = std::net::TcpStream::connect(s.addr()).unwrap();
        extra
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut b = [0u8; 16];
        let n = extra.read(&mut b);
        assert!(
            matches!(n, Ok(0)) || n.is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
            "a connection beyond {MAX_CONNECTIONS} was not closed"
        );
        // The idle ones are closed after IDLE, and scrapes are served again.
        let t0 = Instant::now();
        for mut c in held {
            c.set_read_timeout(Some(IDLE * 3)).unwrap();
            let r = c.read(&mut b);
            assert!(matches!(r, Ok(0)) || r.is_err(), "{r:?}");
        }
        let waited = t0.elapsed();
        assert!(waited < IDLE * 2, "idle connections lived {waited:?}");
        let reply = scrape_once(s.addr());
        assert!(
            reply.starts_with("HTTP/1.0 200") && reply.contains("up 1"),
            "{reply}"
        );
    }

    #[test]
    fn coalesced_renders_once_for_a_burst_of_scrapes() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = Arc::clone(&calls);
        let render = coalesced(
            Arc::new(move |f| {
                let n = c.fetch_add(1, Ordering::SeqCst) + 1;
                std::thread::sleep(Duration::from_millis(200));
                Ok(format!("{f:?} {n}"))
            }),
            Duration::from_secs(5),
        );
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let r = Arc::clone(&render);
                std::thread::spawn(move || r(Format::Text).unwrap())
            })
            .collect();
        let texts: Vec<String> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(texts.iter().all(|t| t == "Text 1"), "{texts:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // Another format is its own text; an old one is made again.
        assert_eq!(render(Format::OpenMetrics).unwrap(), "OpenMetrics 2");
        let quick = coalesced(Arc::clone(&render), Duration::ZERO);
        let _ = quick(Format::Text);
        assert_eq!(
            calls.load(Ordering::SeqCst),
            2,
            "the inner cache still serves"
        );
        // An error is not cached.
        let fails = Arc::new(AtomicUsize::new(0));
        let f2 = Arc::clone(&fails);
        let failing = coalesced(
            Arc::new(move |_| {
                f2.fetch_add(1, Ordering::SeqCst);
                Err("the vmm is busy".into())
            }),
            Duration::from_secs(5),
        );
        assert!(failing(Format::Text).is_err());
        assert!(failing(Format::Text).is_err());
        assert_eq!(fails.load(Ordering::SeqCst), 2);
    }
}
