//! TLS 1.3 on tcp links (rustls, ring provider).
//!
//! Every tcp link runs inside TLS (and so does the live-migration stream on tcp, through
//! [`client`] and [`server`]): control messages, BAR accesses and the window data that
//! carries guest memory are encrypted and integrity-protected. Each process presents a
//! self-signed certificate made at start-up, and neither side checks the other's
//! certificate chain: who the peer is, is decided above, by the cluster token
//! (`lending::auth`), whose proofs include this session's [channel binding](channel_binding)
//! (the TLS exporter, RFC 8446 §7.5). A relay in the middle holds two TLS sessions with two
//! different exporters, so proofs made through it do not verify: it cannot pass
//! authentication, and after authentication it cannot read or change the traffic. The
//! cluster token stays the only secret; there are no certificates to distribute or rotate.
//! (rustls has no TLS 1.3 PSK mode to derive keys from the token directly.)
//!
//! A fabric link reads and writes its frames through [`stream::TlsStream`]: the rustls
//! connection behind a lock, driven by the link's own reader and writers, with no thread of
//! its own. The live-migration stream wants a plain socket: there [`pump`] moves bytes
//! between the TCP socket and one end of a Unix socket pair.

mod pump;
pub(crate) mod stream;

use std::io;
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, ClientConnection, Connection, DigitallySignedStruct, ServerConfig};
use rustls::{ServerConnection, SignatureScheme};

use crate::fabric::{FabricError, Result};

/// Length of the channel binding.
pub const BINDING_LEN: usize = 32;
/// The exporter label of the channel binding.
const BINDING_LABEL: &[u8] = b"EXPORTER-lendvm-fabric-channel-binding";
/// The name both sides use in SNI and the certificate (no meaning: chains are not checked).
pub const NAME: &str = "lendvm-fabric";
/// How long a closing link waits for the peer to close its side: closing a TCP socket with
/// unread data sends a reset, which can destroy our last records (the fabric's GOODBYE) in
/// the peer's receive queue before it reads them.
const LINGER: Duration = Duration::from_secs(1);

fn provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    // AES-128-GCM with SHA-256 first: a link set-up costs about a fifth less CPU than with
    // ring's first choice, AES-256-GCM with SHA-384 (measured: docs/BENCHMARKS.md, fabric
    // section), because SHA-256 runs on the CPU's SHA extensions where SHA-384 has none,
    // and AES-128 has 10 rounds to AES-256's 14. It is TLS 1.3's mandatory suite, and its
    // 128-bit level is the level of the X25519 key exchange every link uses anyway. ChaCha20
    // stays for a peer without AES instructions.
    p.cipher_suites = vec![
        rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256,
        rustls::crypto::ring::cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
    ];
    Arc::new(p)
}

fn tls_err(what: &str, e: impl std::fmt::Display) -> FabricError {
    FabricError::Handshake(format!("tls {what}: {e}"))
}

/// One `write_tls` of the handshake. A signal without SA_RESTART (a vCPU kick, in lendvm)
/// that interrupted the call before anything moved is not a failure: the caller sends again.
/// CI lost a handshake so.
fn handshake_send(conn: &mut Connection, sock: &mut impl io::Write) -> Result<()> {
    match conn.write_tls(sock) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
        Err(e) => Err(tls_err("handshake send", e)),
    }
}

/// Accepts any certificate but checks that the peer holds its key (the handshake
/// signature): identity is proven by the cluster token over the channel binding.
#[derive(Debug)]
struct BindingOnly(Arc<CryptoProvider>);

impl ServerCertVerifier for BindingOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        // Only TLS 1.3 is offered.
        Err(rustls::Error::PeerIncompatible(
            rustls::PeerIncompatible::Tls12NotOffered,
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The client side of the fabric's one TLS set-up (TLS 1.3 only, ring provider, no chain
/// check). Public so the fabric benchmark measures a plain rustls stream with exactly the
/// link's configuration and cipher suite as the limit of an encrypted link; links use
/// [`client`] and [`server`].
pub fn client_config() -> Result<Arc<ClientConfig>> {
    static CFG: OnceLock<std::result::Result<Arc<ClientConfig>, String>> = OnceLock::new();
    CFG.get_or_init(|| {
        let p = provider();
        ClientConfig::builder_with_provider(p.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())
            .map(|b| {
                Arc::new(
                    b.dangerous()
                        .with_custom_certificate_verifier(Arc::new(BindingOnly(p)))
                        .with_no_client_auth(),
                )
            })
    })
    .clone()
    .map_err(|e| tls_err("client config", e))
}

/// The server side of [`client_config`]: the process's self-signed certificate.
pub fn server_config() -> Result<Arc<ServerConfig>> {
    static CFG: OnceLock<std::result::Result<Arc<ServerConfig>, String>> = OnceLock::new();
    CFG.get_or_init(|| {
        let ck = rcgen::generate_simple_self_signed(vec![NAME.to_string()])
            .map_err(|e| format!("self-signed certificate: {e}"))?;
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.key_pair.serialize_der()));
        ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(vec![ck.cert.der().clone()], key)
            .map(Arc::new)
            .map_err(|e| e.to_string())
    })
    .clone()
    .map_err(|e| tls_err("server config", e))
}

/// Fills `buf` from the TLS provider's secure random source (the control rings' nonces).
pub(crate) fn random(buf: &mut [u8]) -> Result<()> {
    provider()
        .secure_random
        .fill(buf)
        .map_err(|e| tls_err("random", format!("{e:?}")))
}

/// Runs the TLS handshake on `tcp` (as the client when `initiator`), done by `deadline`
/// however slowly the peer sends, and starts the pump.
fn wrap(tcp: TcpStream, initiator: bool, deadline: Instant) -> Result<pump::TlsLink> {
    let (conn, binding) = handshake(&tcp, initiator, deadline)?;
    pump::start(conn, tcp, binding)
}

/// Runs the TLS handshake on `tcp` (as the client when `initiator`), done by `deadline`
/// however slowly the peer sends; returns the connection and its channel binding. The socket
/// is left blocking, with the handshake's timeouts.
pub(crate) fn handshake(
    tcp: &TcpStream,
    initiator: bool,
    deadline: Instant,
) -> Result<(Connection, Vec<u8>)> {
    let mut conn: Connection = if initiator {
        let name = ServerName::try_from(NAME).map_err(|e| tls_err("server name", e))?;
        ClientConnection::new(client_config()?, name)
            .map_err(|e| tls_err("client", e))?
            .into()
    } else {
        ServerConnection::new(server_config()?)
            .map_err(|e| tls_err("server", e))?
            .into()
    };
    let mut sock = tcp;
    while conn.is_handshaking() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(tls_err("handshake", "timed out"));
        }
        tcp.set_read_timeout(Some(left))
            .and_then(|_| tcp.set_write_timeout(Some(left)))
            .map_err(|e| tls_err("socket timeouts", e))?;
        if conn.wants_write() {
            handshake_send(&mut conn, &mut sock)?;
            continue;
        }
        let mut peek = [0u8; 4];
        if !initiator {
            // A peer from before TLS starts with a plain fabric frame: say so.
            if let Ok(4) = tcp.peek(&mut peek) {
                if peek == crate::wire::MAGIC {
                    return Err(tls_err(
                        "handshake",
                        "the peer speaks the fabric without TLS (an older lendvm); refused",
                    ));
                }
            }
        }
        match conn.read_tls(&mut sock) {
            Ok(0) => return Err(tls_err("handshake", "peer closed the connection")),
            Ok(_) => {
                if let Err(e) = conn.process_new_packets() {
                    // Tell the peer why (best effort).
                    let _ = conn.write_tls(&mut sock);
                    return Err(tls_err("handshake", e));
                }
            }
            // Interrupted by a signal before anything arrived: wait again (see
            // `handshake_send`).
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(tls_err("handshake receive", e)),
        }
    }
    while conn.wants_write() {
        handshake_send(&mut conn, &mut sock)?;
    }
    let binding = conn
        .export_keying_material([0u8; BINDING_LEN], BINDING_LABEL, None)
        .map_err(|e| tls_err("exporter", e))?
        .to_vec();
    conn.set_buffer_limit(None);
    log::debug!(
        "tls handshake done ({:?}, {:?})",
        conn.handshake_kind(),
        conn.negotiated_cipher_suite().map(|s| s.suite())
    );
    Ok((conn, binding))
}

/// Connects the plaintext side of a TLS session to `tcp` as the client: for the other
/// secret-bearing streams of the tree (the live-migration stream, `vmm::migration`), so that
/// there is one TLS set-up, and for tests and tools that speak the wire format by hand.
/// Returns the plaintext stream and the session's channel binding, which the caller's
/// authentication must cover (as `lending::auth` does) for the session to be safe from a
/// relay in the middle.
pub fn client(tcp: TcpStream, timeout: Duration) -> Result<(UnixStream, Vec<u8>)> {
    let l = wrap(tcp, true, Instant::now() + timeout)?;
    // The pump runs detached; it ends when the returned stream is closed.
    drop(l.pump);
    Ok((l.plain, l.binding))
}

/// [`client`]'s other end: runs the server side of the handshake on an accepted `tcp`.
pub fn server(tcp: TcpStream, timeout: Duration) -> Result<(UnixStream, Vec<u8>)> {
    let l = wrap(tcp, false, Instant::now() + timeout)?;
    drop(l.pump);
    Ok((l.plain, l.binding))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::mpsc;
    use std::time::Duration;

    extern "C" fn ignore(_: libc::c_int) {}

    /// A signal whose handler has no SA_RESTART (as lendvm's vCPU kick) makes a blocked
    /// read or write return EINTR. The handshake waits on: CI of record once lost a
    /// link set-up to "tls handshake receive: Interrupted system call".
    #[test]
    fn a_signal_during_the_handshake_does_not_end_it() {
        // SAFETY: all-zero is a valid sigaction (no flags, empty mask); filled below.
        let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
        sa.sa_sigaction = ignore as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // No SA_RESTART: the point of the test.
        sa.sa_flags = 0;
        // SAFETY: `sa` is a valid sigaction whose handler does nothing; SIGUSR2 is used by
        // nothing else in this test binary.
        let rc = unsafe {
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGUSR2, &sa, std::ptr::null_mut())
        };
        assert_eq!(rc, 0, "sigaction");

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (tid_tx, tid_rx) = mpsc::channel();
        let server = std::thread::spawn(move || {
            let (tcp, _) = listener.accept().unwrap();
            // SAFETY: pthread_self has no preconditions.
            tid_tx.send(unsafe { libc::pthread_self() }).unwrap();
            handshake(&tcp, false, Instant::now() + Duration::from_secs(20)).map(|_| ())
        });
        let client = TcpStream::connect(addr).unwrap();
        let tid = tid_rx.recv().unwrap();
        // The server now waits for the ClientHello: interrupt its wait, several times so
        // that both its peek and its read are hit.
        for _ in 0..8 {
            std::thread::sleep(Duration::from_millis(50));
            // SAFETY: `tid` is the server thread, not joined before the loop ends, so the id
            // stays valid even once it has returned (then the kill does nothing).
            unsafe { libc::pthread_kill(tid, libc::SIGUSR2) };
        }
        let ours = handshake(&client, true, Instant::now() + Duration::from_secs(20));
        let theirs = server.join().unwrap();
        assert!(theirs.is_ok(), "the server's handshake: {:?}", theirs.err());
        assert!(
            ours.is_ok(),
            "the client's handshake: {:?}",
            ours.err().map(|e| e.to_string())
        );
    }
}
