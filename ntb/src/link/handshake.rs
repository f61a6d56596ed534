//! The link handshake: hello exchange and checks, then the threads start.

use super::*;

pub(super) fn check_hello(
    h: &msg::Hello,
    kind: FabricKind,
    nfds: usize,
    cfg: &LinkConfig,
) -> std::result::Result<NodeId, String> {
    if h.version != VERSION {
        return Err(format!(
            "peer speaks version {}, this node {VERSION}",
            h.version
        ));
    }
    if h.kind != kind {
        return Err(format!("peer expects a {} link, this is {kind}", h.kind));
    }
    let node = NodeId::new(&h.node).map_err(|e| e.to_string())?;
    let peer_cfg = LinkConfig {
        limits: h.limits,
        doorbells: h.doorbells,
        scratchpads: h.scratchpads,
        heartbeat: Duration::from_millis(u64::from(h.heartbeat_ms)),
        peer_timeout: Duration::from_millis(u64::from(h.heartbeat_ms) * 2 + 1),
        connect_timeout: cfg.connect_timeout,
        request_timeout: cfg.request_timeout,
        require_sealed_windows: cfg.require_sealed_windows,
        region: None,
        preauth: cfg.preauth,
        control_group: None,
    };
    peer_cfg.validate().map_err(|e| e.to_string())?;
    if peer_cfg.heartbeat * 2 >= cfg.peer_timeout {
        return Err(format!(
            "peer heartbeat {:?} is too slow for this node's peer timeout {:?}",
            peer_cfg.heartbeat, cfg.peer_timeout
        ));
    }
    let want = match kind {
        FabricKind::Shm => h.doorbells as usize + 1,
        FabricKind::Tcp | FabricKind::Bar => 0,
    };
    if nfds != want {
        return Err(format!("hello carries {nfds} fds, expected {want}"));
    }
    Ok(node)
}

/// Checks that a peer's memory fd cannot shrink under a mapping of it: a memfd must carry
/// `F_SEAL_SHRINK`; fds that cannot be sealed pass only if their extent is fixed (sysfs BAR
/// resource files, character devices). Otherwise the mapping is refused when
/// [`LinkConfig::require_sealed_windows`] is set, and logged as a warning when not.
pub(crate) fn check_sealed(
    fd: BorrowedFd<'_>,
    cfg: &LinkConfig,
    peer: &NodeId,
    what: &str,
) -> Result<()> {
    let problem = match fd_seals(fd)? {
        Some(s) if s & libc::F_SEAL_SHRINK != 0 => return Ok(()),
        Some(s) => format!("a memfd without F_SEAL_SHRINK (seals {s:#x})"),
        None if fd_has_fixed_extent(fd)? => return Ok(()),
        None => "a file that cannot be sealed and can be truncated".to_string(),
    };
    if cfg.require_sealed_windows {
        return Err(FabricError::UnsealedWindow {
            what: what.to_string(),
            peer: peer.to_string(),
            problem,
        });
    }
    log::warn!(
        "mapping {what} from {peer}, {problem}: if the exporter shrinks it, accesses raise \
         SIGBUS here (set require_sealed_windows to refuse such windows)"
    );
    Ok(())
}

/// What the caller knows about a connection beyond its stream.
#[derive(Default)]
pub(crate) struct LinkOpts {
    /// Names the peer when the caller knows better than the socket (a Unix socket's peer
    /// name is where it was bound, not the path it was connected by; a TLS link's plaintext
    /// end has no peer).
    pub(crate) peer_addr: Option<String>,
    /// The TLS session's channel binding (tcp).
    pub(crate) binding: Vec<u8>,
    /// The control rings' pump thread (`bar`), joined with the link's threads.
    pub(crate) pump: Option<crate::workers::Worker>,
    /// When the handshake must be done (default: `connect_timeout` from now).
    pub(crate) deadline: Option<Instant>,
    /// A `bar` link's region, opened before the fabric hello (its control rings are there).
    pub(crate) region: Option<Arc<Region>>,
    /// Where the link's control messages go (default: by the stream's kind).
    pub(crate) control: Option<ControlPath>,
}

impl LinkOpts {
    /// A tcp connection: runs the TLS handshake by `deadline`, then on a `bar` node (`cfg`
    /// has a region) agrees on the control path ([`crate::ring`]), and returns the plaintext
    /// stream with its options.
    pub(crate) fn tls(
        tcp: TcpStream,
        initiator: bool,
        deadline: Instant,
        cfg: &LinkConfig,
    ) -> Result<(Stream, LinkOpts)> {
        let peer_addr = tcp.peer_addr().map(|a| a.to_string()).ok();
        let (mut conn, binding) = crate::tls::handshake(&tcp, initiator, deadline)?;
        // The region is opened per link (an open and an fstat), so a region that went away
        // fails the link, not the node.
        let region = cfg
            .region
            .as_ref()
            .map(Region::open)
            .transpose()?
            .map(Arc::new);
        let ring = match &region {
            Some(r) => crate::ring::negotiate(&mut conn, &tcp, initiator, r, deadline)?,
            None => None,
        };
        let (stream, pump, control) = match ring {
            Some(ring) => {
                let path = ring.path();
                let who = peer_addr.clone().unwrap_or_default();
                let (plain, pump) = ring.spawn(conn, tcp, who)?;
                (Stream::Ring(plain), Some(pump), path)
            }
            None => (
                Stream::Tls(Arc::new(TlsStream::new(conn, tcp)?)),
                None,
                ControlPath::Tls,
            ),
        };
        Ok((
            stream,
            LinkOpts {
                peer_addr,
                binding,
                pump,
                deadline: Some(deadline),
                region,
                control: Some(control),
            },
        ))
    }
}

/// Runs the handshake on a connected stream and starts the link.
pub(crate) fn establish(
    stream: Stream,
    local: &NodeId,
    cfg: &LinkConfig,
    initiator: bool,
    opts: LinkOpts,
) -> Result<LinkEndpoint> {
    cfg.validate()?;
    // A node with a shared region speaks `bar` on its tcp links; the region is opened per
    // link (an open and an fstat), so a region that went away fails the link, not the node.
    let region = match (&cfg.region, stream.kind()) {
        (None, _) => None,
        (Some(_), FabricKind::Tcp) if opts.region.is_some() => opts.region.clone(),
        (Some(spec), FabricKind::Tcp) => Some(Arc::new(Region::open(spec)?)),
        (Some(spec), k) => {
            return Err(FabricError::BadRegion {
                path: spec.path().display().to_string(),
                problem: format!("a shared region needs a tcp control address, not {k}"),
            })
        }
    };
    let kind = if region.is_some() {
        FabricKind::Bar
    } else {
        stream.kind()
    };
    let doorbells = (0..cfg.doorbells)
        .map(|_| new_eventfd())
        .collect::<Result<Vec<_>>>()?;
    let spads = SharedMemory::new("ntb-spad", spad_bytes(cfg.scratchpads))?;
    let hello = msg::Hello {
        version: VERSION,
        node: local.to_string(),
        kind,
        limits: cfg.limits,
        doorbells: cfg.doorbells,
        scratchpads: cfg.scratchpads,
        heartbeat_ms: u32::try_from(cfg.heartbeat.as_millis()).unwrap_or(u32::MAX),
    };
    let hello_bytes = wire::encode_payload(&hello)?;
    let my_fds: Vec<RawFd> = match kind {
        FabricKind::Shm => doorbells
            .iter()
            .map(|e| e.as_raw_fd())
            .chain(std::iter::once(spads.fd().as_raw_fd()))
            .collect(),
        FabricKind::Tcp | FabricKind::Bar => Vec::new(),
    };
    stream
        .set_timeouts(cfg.connect_timeout)
        .map_err(FabricError::io("set socket timeouts"))?;
    // The whole handshake ends within connect_timeout, however slowly the peer sends.
    let deadline = opts
        .deadline
        .unwrap_or_else(|| Instant::now() + cfg.connect_timeout);
    let hs_err = |m: String| FabricError::Handshake(m);
    let read = |what: &str| {
        read_frame_until(&stream, Some(deadline)).map_err(|e| match e {
            // The stream's own wording is the running link's (a missed heartbeat); here
            // the bound is the handshake's.
            ReadError::TimedOut => hs_err(format!(
                "waiting for {what}: no answer within the connect timeout ({:?}, cluster \
                 file [link] connect_timeout_ms)",
                cfg.connect_timeout
            )),
            e => hs_err(format!("waiting for {what}: {e}")),
        })
    };
    let (peer_hello, peer_fds) = if initiator {
        send_raw(&stream, 0, op::HELLO, 1, &hello_bytes, &my_fds)?;
        let (h, p, fds) = read("the hello reply")?;
        if h.opcode != op::HELLO || !h.is_reply() || h.id != 1 {
            return Err(hs_err(format!(
                "unexpected frame opcode {:#x} in handshake",
                h.opcode
            )));
        }
        if h.is_error() {
            let e: ErrorReply = wire::decode_payload(&p)?;
            return Err(hs_err(format!("peer refused: {}", e.message)));
        }
        let ph: msg::Hello = wire::decode_payload(&p)?;
        (ph, fds)
    } else {
        let (h, p, fds) = read("the hello")?;
        if h.opcode != op::HELLO || h.is_reply() {
            return Err(hs_err(format!(
                "expected hello, got opcode {:#x}",
                h.opcode
            )));
        }
        // Tells the peer why its hello is refused (best effort: we fail either way).
        let refuse = |code: u32, message: String| -> Result<()> {
            let r = wire::encode_payload(&ErrorReply::new(code, message))?;
            let _ = send_raw(&stream, FLAG_REPLY | FLAG_ERROR, op::HELLO, h.id, &r, &[]);
            Ok(())
        };
        let ph: msg::Hello = match wire::decode_payload(&p) {
            Ok(v) => v,
            Err(e) => {
                refuse(code::INVALID, e.to_string())?;
                return Err(e.into());
            }
        };
        if let Err(m) = check_hello(&ph, kind, fds.len(), cfg) {
            refuse(code::VERSION, m.clone())?;
            return Err(hs_err(m));
        }
        send_raw(&stream, FLAG_REPLY, op::HELLO, h.id, &hello_bytes, &my_fds)?;
        (ph, fds)
    };
    let peer = check_hello(&peer_hello, kind, peer_fds.len(), cfg).map_err(hs_err)?;
    let (peer_doorbells, peer_spads) = match kind {
        FabricKind::Shm => {
            let mut fds = peer_fds;
            let spad_fd = fds.pop().ok_or_else(|| hs_err("no scratchpad fd".into()))?;
            let spad_len = spad_bytes(peer_hello.scratchpads);
            check_sealed(spad_fd.as_fd(), cfg, &peer, "scratchpad memfd")?;
            let have = fd_size(spad_fd.as_fd())?;
            if have < spad_len {
                return Err(hs_err(format!(
                    "peer scratchpad memfd is {have:#x} bytes, need {spad_len:#x}"
                )));
            }
            let map = Mapping::map_shared(spad_fd.as_fd(), 0, spad_len)?;
            let dbs = fds
                .into_iter()
                .map(|fd| {
                    // SAFETY: the fd came to us over SCM_RIGHTS; we own it and hand it to EventFd.
                    unsafe { EventFd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(fd)) }
                })
                .collect();
            (dbs, Some(map))
        }
        FabricKind::Tcp | FabricKind::Bar => (Vec::new(), None),
    };
    stream
        .set_timeouts(cfg.peer_timeout)
        .map_err(FabricError::io("set socket timeouts"))?;
    let reader_stream = stream
        .try_clone()
        .map_err(FabricError::io("clone socket"))?;
    let ctl = stream
        .try_clone()
        .map_err(FabricError::io("clone socket"))?;
    let (svc_tx, svc_rx) = mpsc::channel();
    let control = opts.control.unwrap_or(match kind {
        FabricKind::Shm => ControlPath::Socket,
        FabricKind::Tcp | FabricKind::Bar => ControlPath::Tls,
    });
    let inner = Arc::new(Inner {
        kind,
        local: local.clone(),
        peer: peer.clone(),
        peer_addr: opts.peer_addr.unwrap_or_else(|| stream.peer_desc()),
        binding: opts.binding,
        cfg: cfg.clone(),
        peer_hello,
        writer: Mutex::new(stream),
        ctl,
        state: Mutex::new(State {
            next_window: 1,
            ..State::default()
        }),
        cond: Condvar::new(),
        gone: AtomicBool::new(false),
        gone_evt: new_eventfd()?,
        next_id: AtomicU64::new(2),
        doorbells,
        peer_doorbells,
        spads,
        peer_spads,
        stats: Counters::default(),
        svc_tx: Mutex::new(Some(svc_tx)),
        abuse_log: RateLimit::new(Duration::from_secs(1)),
        region,
        control,
    });
    // Parked threads of ended links take these when there are any (`crate::workers`).
    let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
        crate::workers::spawn(name, f).map_err(FabricError::io("spawn link thread"))
    };
    let i1 = inner.clone();
    let t1 = spawn(
        format!("ntb-rx-{peer}"),
        Box::new(move || reader_loop(i1, reader_stream)),
    )?;
    let i2 = inner.clone();
    let t2 = spawn(
        format!("ntb-svc-{peer}"),
        Box::new(move || service_loop(i2, svc_rx)),
    )?;
    log::info!("ntb {kind} link {local} <-> {peer} up, control through {control}");
    let mut threads = vec![t1, t2];
    threads.extend(opts.pump);
    Ok(LinkEndpoint {
        inner,
        threads: Mutex::new(threads),
    })
}
