//! The destination side: listen, build an empty VM of the source's shape, take its RAM and
//! state; the caller takes the lent devices over and then acknowledges ([`Reply::ack`]) or
//! refuses ([`Reply::refuse`]): the source stops only on the acknowledgement. Only a source
//! that authenticates is taken ([`super::auth`]), and only one.

use std::os::unix::fs::FileExt;

use super::protocol::{
    self, kind, Frame, Listener, MigrationError, MigrationUrl, Refusal, Stream, MAX_RUN,
};
use crate::memory::GuestRam;
use crate::snapshot::format::{MachineConfig, VmSnapshot};

/// How long a connecting source has for TLS and authentication: the destination takes one
/// connection at a time, so a peer that says nothing holds it only this long.
pub const AUTH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A listening destination (`vm.receive-migration`); the socket goes when this is dropped,
/// or as soon as a source authenticated (one migration, once).
pub struct Incoming {
    url: MigrationUrl,
    listener: Option<Listener>,
    auth: super::auth::StreamAuth,
    /// Refused peers are logged at most once a second (a peer can retry at will).
    refusals: ntb::RateLimit,
    /// [`AUTH_TIMEOUT`] (shorter in tests).
    auth_timeout: std::time::Duration,
}

/// What arrived: the VM (restored, vCPUs parked) and the state document it was restored from.
pub struct Received<V> {
    pub vm: V,
    pub doc: VmSnapshot,
    /// The lent devices' hand-over tickets.
    pub handover: Vec<protocol::DeviceHandover>,
    /// The source waits on this for the verdict.
    pub reply: Reply,
    /// The VM was paused on the source: leave it paused (vCPUs parked) until `vm.resume`.
    pub paused: bool,
    /// Guest RAM bytes received (pages sent more than once count each time).
    pub bytes: u64,
}

/// What the destination needs of the VM it builds (implemented by [`crate::Vm`]).
pub trait MigrationTarget: Sized {
    /// Its guest RAM, written as pages arrive.
    fn ram(&self) -> &GuestRam;
    /// Puts the state document in (everything but RAM); the VM stays paused.
    fn restore(&self, doc: &VmSnapshot) -> Result<(), MigrationError>;
    /// Readies the built VM before the source starts sending (while the guest still runs
    /// there): pins guest RAM (or at least faults it in), so a lent device's Bus Master
    /// Enable at the hand-over does not pin it during the downtime.
    fn prepare(&self) {}
}

/// The stream back to the source, waiting for the destination's verdict. Dropped without
/// one, the source sees the stream close: the migration failed.
pub struct Reply {
    stream: Stream,
}

impl Reply {
    /// The destination has the VM and its devices: the source may stop.
    pub fn ack(mut self) -> Result<(), MigrationError> {
        protocol::write_empty(&mut self.stream, kind::ACK, "acknowledging the vm")
    }

    /// The destination cannot run the VM: the source keeps it (best effort, the source may
    /// be gone).
    pub fn refuse(mut self, reason: &str) {
        let _ = protocol::write_json(
            &mut self.stream,
            kind::REFUSED,
            "refusal",
            &Refusal {
                reason: reason.to_string(),
            },
        );
    }
}

impl Incoming {
    /// Parses `url` and listens there; sources must authenticate as `auth` says (a tcp url
    /// needs the cluster secret).
    pub fn listen(url: &str, auth: super::auth::StreamAuth) -> Result<Self, MigrationError> {
        let url = protocol::parse_url(url)?;
        if matches!(url, MigrationUrl::Tcp(_)) && !auth.has_secret() {
            return Err(MigrationError::NoSecret);
        }
        let listener = Listener::bind(&url)?;
        log::info!("waiting for a migrating vm at {url}");
        Ok(Self {
            url,
            listener: Some(listener),
            auth,
            refusals: ntb::RateLimit::new(std::time::Duration::from_secs(1)),
            auth_timeout: AUTH_TIMEOUT,
        })
    }

    /// The listening socket (readable once a source connects), for the caller's poll; -1
    /// once a source was taken.
    pub fn listen_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.listener.as_ref().map_or(-1, |l| l.as_raw_fd())
    }

    /// Where this listens.
    pub fn url(&self) -> &MigrationUrl {
        &self.url
    }

    /// TLS (tcp), the peer's credentials (unix) and the source's proof of the secret, all
    /// within [`AUTH_TIMEOUT`] however slowly the peer sends; a failure is answered with a
    /// refusal naming it (best effort) and returned.
    fn admit(&self, raw: Stream, identity: &protocol::Identity) -> Result<Stream, MigrationError> {
        // The watchdog cuts the connection at the deadline unless told the peer got in.
        let arming = |source| MigrationError::Io {
            step: "arming the authentication deadline",
            source,
        };
        let cutter = raw.cutter().map_err(arming)?;
        let (done, wait) = std::sync::mpsc::channel::<()>();
        let deadline = self.auth_timeout;
        let watchdog = std::thread::Builder::new()
            .name("mig-auth-deadline".into())
            .spawn(move || {
                if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(deadline)
                {
                    cutter.cut();
                }
            })
            .map_err(arming)?;
        let r = self.admit_within(raw, identity);
        // Disarmed whatever the outcome (a failed peer is dropped anyway).
        let _ = done.send(());
        let _ = watchdog.join();
        r
    }

    fn admit_within(
        &self,
        raw: Stream,
        identity: &protocol::Identity,
    ) -> Result<Stream, MigrationError> {
        let mut stream = raw.into_tls(false, self.auth_timeout)?;
        stream
            .set_timeout(Some(self.auth_timeout))
            .map_err(|source| MigrationError::Io {
                step: "setting the stream timeout",
                source,
            })?;
        let r = stream
            .check_peer_user()
            .and_then(|()| super::auth::verify_source(&mut stream, &self.auth, identity));
        if let Err(e) = r {
            let _ = protocol::write_json(
                &mut stream,
                kind::REFUSED,
                "refusal",
                &Refusal {
                    reason: crate::control::error_chain(&e),
                },
            );
            return Err(e);
        }
        Ok(stream)
    }

    /// Accepts one source and receives its VM. Anything wrong is answered with a refusal
    /// naming it (when the stream still works) and returned. A peer that does not
    /// authenticate is dropped with [`MigrationError::NotAuthenticated`]: the caller may
    /// call this again, the listener goes on. The first source that authenticates closes
    /// the listener: a later call fails with [`MigrationError::AlreadyReceived`].
    /// `build` makes an empty VM of the announced shape (no kernel loaded).
    /// `identity`: this VMM's fabric node and VM name (leases are moved to them).
    pub fn receive<V: MigrationTarget>(
        &mut self,
        identity: protocol::Identity,
        build: impl FnOnce(&MachineConfig, Option<std::fs::File>) -> Result<V, MigrationError>,
    ) -> Result<Received<V>, MigrationError> {
        let Some(listener) = &self.listener else {
            return Err(MigrationError::AlreadyReceived);
        };
        let (raw, peer) = listener.accept()?;
        let mut stream = match self.admit(raw, &identity) {
            Ok(s) => s,
            Err(e) => {
                if let Some(held) = self.refusals.hit() {
                    log::warn!(
                        "migration: refused {peer}: {} ({held} refusals not logged since the \
                         last)",
                        crate::control::error_chain(&e)
                    );
                }
                return Err(MigrationError::NotAuthenticated {
                    peer,
                    source: Box::new(e),
                });
            }
        };
        // One source, once.
        self.listener = None;
        stream
            .set_timeout(Some(super::send::IO_TIMEOUT))
            .map_err(|source| MigrationError::Io {
                step: "setting the stream timeout",
                source,
            })?;
        match receive_on(&mut stream, &identity, build) {
            Ok((vm, doc, paused, bytes, handover)) => Ok(Received {
                vm,
                doc,
                handover,
                reply: Reply { stream },
                paused,
                bytes,
            }),
            Err(e) => {
                let reason = crate::control::error_chain(&e);
                log::error!("incoming migration failed: {reason}");
                // Best effort: the source may be gone already.
                let _ = protocol::write_json(
                    &mut stream,
                    kind::REFUSED,
                    "refusal",
                    &Refusal { reason },
                );
                Err(e)
            }
        }
    }
}

fn unexpected(step: &'static str, f: &Frame) -> MigrationError {
    MigrationError::Unexpected {
        step,
        got: protocol::kind_of(f),
    }
}

type Arrived<V> = (V, VmSnapshot, bool, u64, Vec<protocol::DeviceHandover>);

fn receive_on<V: MigrationTarget>(
    stream: &mut Stream,
    identity: &protocol::Identity,
    build: impl FnOnce(&MachineConfig, Option<std::fs::File>) -> Result<V, MigrationError>,
) -> Result<Arrived<V>, MigrationError> {
    let step = "waiting for the source's hello";
    let lent_devices = match protocol::read_frame(stream, step)? {
        Frame::Hello(h) => {
            h.check()?;
            h.lent_devices
        }
        Frame::Auth(_) => return Err(MigrationError::NoSecretHere),
        f => return Err(unexpected(step, &f)),
    };
    protocol::write_empty(stream, kind::ACK, "answering the hello")?;
    protocol::write_json(stream, kind::IDENTITY, "identity", identity)?;
    let step = "waiting for the vm's shape";
    let (config, memfd) = match protocol::read_frame_with_fd(stream, step)? {
        (Frame::Memfd, fd) => {
            let fd = fd.ok_or(MigrationError::NoMemfd)?;
            match protocol::read_frame(stream, step)? {
                Frame::Config(c) => (c, Some(fd)),
                f => return Err(unexpected(step, &f)),
            }
        }
        (Frame::Config(c), _) => (c, None),
        (f, _) => return Err(unexpected(step, &f)),
    };
    if memfd.is_some() {
        log::info!("same-host migration: guest ram shared through its memfd, not copied");
    }
    log::info!(
        "incoming vm: {} vCPUs, {:#x} bytes of RAM",
        config.cpus,
        config.memory_size
    );
    let vm = build(&config, memfd)?;
    if lent_devices > 0 {
        vm.prepare();
    }
    protocol::write_empty(stream, kind::ACK, "saying the vm is built")?;
    let mut buf = vec![0u8; MAX_RUN as usize];
    let mut bytes = 0u64;
    let step = "receiving guest memory and state";
    let state = loop {
        match protocol::read_frame(stream, step)? {
            Frame::Memory { gpa, len } => {
                let ram = vm.ram();
                let offset = ram
                    .regions()
                    .iter()
                    .find(|r| gpa >= r.gpa && gpa.saturating_add(len) <= r.gpa + r.size)
                    .map(|r| r.file_offset + (gpa - r.gpa))
                    .ok_or(MigrationError::OutOfRange { gpa, len })?;
                let data = &mut buf[..len as usize];
                protocol::read_exact(stream, data)?;
                ram.memfd()
                    .write_all_at(data, offset)
                    .map_err(|source| MigrationError::Ram { offset, source })?;
                bytes += len;
            }
            Frame::State(state) => break state,
            f => return Err(unexpected(step, &f)),
        }
    };
    let protocol::VmState {
        doc,
        paused,
        handover,
    } = *state;
    if doc.config.cpus != config.cpus || doc.config.memory_size != config.memory_size {
        return Err(MigrationError::Mismatch(format!(
            "announced {} vCPUs and {:#x} bytes, the state says {} and {:#x}",
            config.cpus, config.memory_size, doc.config.cpus, doc.config.memory_size
        )));
    }
    if let Some(h) = handover
        .iter()
        .find(|h| !doc.devices.lent.iter().any(|d| d.id == h.id))
    {
        return Err(MigrationError::Mismatch(format!(
            "a hand-over for device {}, which the state does not have",
            h.id
        )));
    }
    vm.restore(&doc)?;
    Ok((vm, doc, paused, bytes, handover))
}

impl MigrationTarget for crate::Vm {
    fn ram(&self) -> &GuestRam {
        crate::Vm::ram(self)
    }

    fn restore(&self, doc: &VmSnapshot) -> Result<(), MigrationError> {
        self.restore_migrated(doc)
            .map_err(|e| MigrationError::Build(Box::new(e)))
    }

    fn prepare(&self) {
        self.prepin_ram();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::time::{Duration, Instant};

    /// A peer that trickles a frame a byte at a time is cut at the authentication deadline
    /// (not only when one read stalls), and the listener goes on.
    #[test]
    fn a_trickling_peer_is_cut_at_the_deadline_and_listening_goes_on() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("m.sock");
        let auth = super::super::auth::StreamAuth {
            secret: Some("s3cret".into()),
            node: Some("node9".into()),
        };
        let mut incoming = Incoming::listen(&format!("unix:{}", path.display()), auth).unwrap();
        incoming.auth_timeout = Duration::from_millis(300);
        let peer = std::thread::spawn(move || {
            let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
            let mut h = Vec::new();
            h.extend_from_slice(&kind::AUTH.to_le_bytes());
            h.extend_from_slice(&0u32.to_le_bytes());
            h.extend_from_slice(&1000u64.to_le_bytes());
            s.write_all(&h).unwrap();
            // One byte every 100 ms: each read is quick, the whole never ends.
            for _ in 0..100 {
                if s.write_all(b"x").is_err() {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            false
        });
        let t0 = Instant::now();
        let e = incoming
            .receive(protocol::Identity::default(), |_, _| {
                Err::<crate::Vm, _>(MigrationError::NoMemfd)
            })
            .err()
            .unwrap();
        assert!(matches!(e, MigrationError::NotAuthenticated { .. }), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        assert!(peer.join().unwrap(), "the peer was not cut off");
        assert!(incoming.listen_fd() >= 0, "the listener went with the peer");
    }
}
