//! The lender's part of live migration, with the real `lenderd` lending an emulated NVMe and
//! this process playing the borrowers (source VM A and destination VM B, each with its own
//! "guest RAM" memfd and its own session): the device dirty log (a page written only by the
//! device's DMA is logged, nothing else is; fetch clears; nothing is lost while the device
//! keeps writing), the hand-over quiesce (in-flight commands drain, held interrupts are
//! reported and replayed), and the lease transfer (B continues A's device state without a
//! reset; A is told the lease moved) with its failure cases (no accept, destination gone,
//! forged, misdirected and replayed tickets, the lender killed mid-hand-over).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use emulated::testing::{DriverConfig, GuestBar, GuestIrq, GuestRam, NvmeDriver};
use lending::backend::emulated::EmulatedBackend;
use lending::backend::{BackendError, BarExport, DeviceBackend, Drained, IrqTrigger, PeerExport};
use lending::client::{ClientError, ClientIrq, Lease, LenderClient};
use lending::inventory::Inventory;
use lending::iommu::{
    DirtyLogError, DirtyPages, DmaBacking, FaultListener, IommuDomain, IommuError, MappingInfo,
};
use lending::protocol::migration::code::BAD_TICKET;
use lending::protocol::{
    AcceptMap, DeviceInfo, DeviceState, DoorbellKicks, Event, IrqKind, LeaseCounters,
    TransferTicket,
};
use lending::server::{BackgroundLender, Lender};
use ntb::{ExportedWindow, Fabric, FabricKind};
use vmm_sys_util::eventfd::EventFd;

const DEV: &str = "0000:82:00.0";
const RAM: u64 = 16 << 20;
const PAGE: u64 = 4096;

/// Guest RAM, BAR and interrupts that can be re-pointed from the source to the destination
/// under a running driver (the guest driver does not notice a migration).
struct Switch<T: ?Sized>(Mutex<Arc<T>>);

impl<T: ?Sized> Switch<T> {
    fn new(v: Arc<T>) -> Arc<Self> {
        Arc::new(Switch(Mutex::new(v)))
    }
    fn get(&self) -> Arc<T> {
        self.0.lock().unwrap().clone()
    }
    fn set(&self, v: Arc<T>) {
        *self.0.lock().unwrap() = v;
    }
}

impl GuestRam for Switch<MemfdRam> {
    fn read(&self, addr: u64, buf: &mut [u8]) {
        self.get().read(addr, buf)
    }
    fn write(&self, addr: u64, buf: &[u8]) {
        self.get().write(addr, buf)
    }
}

impl GuestBar for Switch<TrappedBar> {
    fn read32(&self, off: u64) -> u32 {
        self.get().read32(off)
    }
    fn write32(&self, off: u64, v: u32) {
        self.get().write32(off, v)
    }
    fn read64(&self, off: u64) -> u64 {
        self.get().read64(off)
    }
    fn write64(&self, off: u64, v: u64) {
        self.get().write64(off, v)
    }
}

impl GuestIrq for Switch<FdIrq> {
    fn wait(&self, vector: u16, timeout: Duration) -> bool {
        self.get().wait(vector, timeout)
    }
}

/// One borrower VM: its session, its RAM window, its lease and interrupt eventfds.
struct Vm {
    client: LenderClient,
    ram: Arc<MemfdRam>,
    window: ExportedWindow,
    irq: Arc<FdIrq>,
}

fn vm(c: &Cluster) -> Vm {
    vm_on(c, connect(c))
}

/// A VM on another node of the cluster (it holds the cluster token, as every member does).
fn vm_as(c: &Cluster, node: &str) -> Vm {
    let client = LenderClient::connect(&c.cfg, node, LENDER, TOKEN, "nvme-lent").unwrap();
    vm_on(c, client)
}

fn vm_on(_c: &Cluster, client: LenderClient) -> Vm {
    let ram = MemfdRam::new(RAM);
    let window = client
        .endpoint()
        .export_window(ram.mem.fd(), 0, RAM, "vm-ram")
        .unwrap();
    let irq = FdIrq::new(
        (0..3)
            .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
            .collect(),
    );
    Vm {
        client,
        ram,
        window,
        irq,
    }
}

fn targets(irq: &FdIrq) -> Vec<ClientIrq<'_>> {
    irq.fds.iter().map(ClientIrq::EventFd).collect()
}

/// The source: borrows, maps its RAM, wires interrupts, brings the controller up with one
/// I/O queue pair (vector 1).
struct Rig {
    a: Vm,
    lease: Arc<Lease>,
    ram: Arc<Switch<MemfdRam>>,
    bar: Arc<Switch<TrappedBar>>,
    irq: Arc<Switch<FdIrq>>,
    driver: NvmeDriver,
}

fn rig(c: &Cluster) -> Rig {
    let a = vm(c);
    let lease = Arc::new(a.client.borrow(DEV, "vm0").unwrap());
    lease.map_dma(0, RAM, a.window.id()).unwrap();
    lease.set_irqs(IrqKind::Msix, &targets(&a.irq)).unwrap();
    let ram = Switch::new(a.ram.clone());
    let bar = Switch::new(Arc::new(TrappedBar(Arc::clone(&lease))));
    let irq = Switch::new(a.irq.clone());
    let driver = polled_driver(bar.clone(), ram.clone(), irq.clone());
    Rig {
        a,
        lease,
        ram,
        bar,
        irq,
        driver,
    }
}

/// A polling driver with the controller up and one I/O queue pair (vector 1).
fn polled_driver(
    bar: Arc<dyn GuestBar>,
    ram: Arc<dyn GuestRam>,
    irq: Arc<dyn GuestIrq>,
) -> NvmeDriver {
    let mut driver = NvmeDriver::new(
        bar,
        ram,
        irq,
        DriverConfig {
            ram_base: RAM_BASE,
            ram_len: RAM - RAM_BASE,
            use_interrupts: false,
            timeout: Duration::from_secs(10),
        },
    );
    driver.enable(32).unwrap();
    driver.set_num_queues(1).unwrap();
    driver.create_io_queue_pair(1, 64, 1).unwrap();
    driver
}

fn lenderd(c: &Cluster, tag: &str) -> Lenderd {
    let disk = c.dir.path().join("disk.img");
    start_lenderd(
        c,
        tag,
        &[nvme_spec(DEV, &disk, "16M", false)],
        TokenVia::Flag,
    )
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn pages_of(buf: &emulated::testing::DataBuf) -> Vec<u64> {
    let mut v: Vec<u64> = buf
        .segs
        .iter()
        .flat_map(|&(a, l)| (a / PAGE..=(a + l as u64 - 1) / PAGE).map(|p| p * PAGE))
        .collect();
    v.dedup();
    v
}

#[test]
fn device_written_pages_are_logged_and_nothing_else() {
    let c = cluster(FabricKind::Shm);
    let _d = lenderd(&c, "dirty");
    let mut r = rig(&c);
    let src = r.driver.alloc_data(16 * 1024, 0, false).unwrap();
    let dst = r.driver.alloc_data(16 * 1024, 0, true).unwrap();
    src.fill(&*r.ram, &pattern(7, 16 * 1024));
    r.driver.rw(1, true, 64, 32, &src).unwrap();

    assert!(r.lease.start_dirty_log().unwrap(), "software domain: exact");
    assert_eq!(r.lease.fetch_dirty_log(0, 0).unwrap().iovas().len(), 0);
    // The guest writes a page itself (KVM's log would see it, the device log must not) and
    // the device reads the source buffer: neither is a device write.
    r.ram.write(dst.segs[0].0, &[0xee; 64]);
    r.driver.rw(1, true, 128, 32, &src).unwrap();
    let after_write = r.lease.fetch_dirty_log(0, 0).unwrap();
    assert!(!after_write.whole_window);
    let w = after_write.iovas();
    assert!(w.len() <= 1, "only the completion queue page: {w:x?}");
    let cq_page = w.first().copied();
    for p in pages_of(&src).iter().chain(&pages_of(&dst)) {
        assert!(!w.contains(p), "page {p:#x} is not a device write");
    }
    // A read command: the device writes the (scattered) destination pages.
    r.driver.rw(1, false, 64, 32, &dst).unwrap();
    assert_eq!(dst.read(&*r.ram), pattern(7, 16 * 1024));
    let got = r.lease.fetch_dirty_log(0, RAM).unwrap().iovas();
    let mut want = pages_of(&dst);
    want.extend(cq_page);
    want.sort();
    want.dedup();
    assert_eq!(got, want, "exactly the pages the device wrote");
    // Fetch cleared them; a stopped log refuses fetches.
    assert!(r.lease.fetch_dirty_log(0, RAM).unwrap().iovas().is_empty());
    r.lease.stop_dirty_log().unwrap();
    let e = r.lease.fetch_dirty_log(0, RAM).unwrap_err();
    assert_eq!(
        e.code(),
        Some(lending::protocol::migration::code::DIRTY_LOG_OFF),
        "{e}"
    );
}

#[test]
fn no_device_write_is_lost_while_the_log_is_fetched_concurrently() {
    let c = cluster(FabricKind::Shm);
    let _d = lenderd(&c, "race");
    let mut r = rig(&c);
    let lease = Arc::clone(&r.lease);
    let bufs: Vec<_> = (0..32)
        .map(|_| r.driver.alloc_data(8192, 0, true).unwrap())
        .collect();
    lease.start_dirty_log().unwrap();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fetcher = {
        let (lease, done) = (Arc::clone(&lease), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut seen = std::collections::BTreeSet::new();
            let mut fetches = 0;
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                seen.extend(lease.fetch_dirty_log(0, RAM).unwrap().iovas());
                fetches += 1;
            }
            (seen, fetches)
        })
    };
    let mut read_into = std::collections::BTreeSet::new();
    for round in 0..300u64 {
        let b = &bufs[(round % 32) as usize];
        r.driver.rw(1, false, round * 16, 16, b).unwrap();
        read_into.extend(pages_of(b));
    }
    done.store(true, std::sync::atomic::Ordering::Release);
    let (mut seen, fetches) = fetcher.join().unwrap();
    // The final pass (the device is idle now) picks up what the last rounds raced with.
    seen.extend(lease.fetch_dirty_log(0, RAM).unwrap().iovas());
    assert!(
        fetches > 1,
        "the fetcher ran concurrently ({fetches} fetches)"
    );
    let lost: Vec<_> = read_into.difference(&seen).collect();
    assert!(
        lost.is_empty(),
        "device-written pages never reported: {lost:x?}"
    );
}

#[test]
fn handover_quiesce_drains_in_flight_commands_and_holds_interrupts() {
    let c = cluster(FabricKind::Shm);
    let _d = lenderd(&c, "quiesce");
    let mut r = rig(&c);
    let bufs: Vec<_> = (0..16)
        .map(|_| r.driver.alloc_data(64 * 1024, 0, false).unwrap())
        .collect();
    // Whether the quiesce finds commands in flight is a race with the device here (the
    // in-process tests in `backend::emulated` make it certain with slow guest memory): each
    // round checks what must hold either way.
    for round in 0..10 {
        let irq = r.irq.get();
        for (i, b) in bufs.iter().enumerate() {
            r.driver
                .push(1, NvmeDriver::rw_sqe(false, i as u64 * 128, 128, b))
                .unwrap();
        }
        r.driver.ring(1).unwrap();
        // Quiesce once the device is working through the batch (the first completion is
        // in), so the rest is likely in flight.
        let mut cqes = Vec::new();
        let t0 = Instant::now();
        while cqes.is_empty() && t0.elapsed() < Duration::from_secs(5) {
            r.driver.poll(1, &mut cqes).unwrap();
        }
        let early = cqes.len();
        let before = irq.total(1);
        let q = r.lease.quiesce_for_handover(5000).unwrap();
        assert!(q.drained, "round {round}: {q:?}");
        // Every command the device fetched before the quiesce completed: its completion is
        // in guest RAM without a resume. Commands it had not fetched stay in the queue.
        r.driver.poll(1, &mut cqes).unwrap();
        let fetched = cqes.len();
        // Interrupts raised during the drain are held, not delivered...
        let delivered = irq.total(1) - before;
        let held = q.pending_msix.contains(&1);
        assert!(fetched >= early, "round {round}");
        std::thread::sleep(Duration::from_millis(20));
        r.driver.poll(1, &mut cqes).unwrap();
        assert_eq!(
            cqes.len(),
            fetched,
            "round {round}: nothing fetched while quiesced"
        );
        assert_eq!(
            irq.total(1) - before,
            delivered,
            "round {round}: held while quiesced"
        );
        // ...and delivered once the device resumes, which also takes up the rest.
        r.lease.quiesce(false).unwrap();
        if held {
            assert!(
                irq.wait(1, Duration::from_secs(2)),
                "round {round}: held vector 1 replayed"
            );
        }
        r.driver.wait(1, &mut cqes, bufs.len() - fetched).unwrap();
        assert_eq!(cqes.len(), bufs.len(), "round {round}");
        assert!(
            cqes.iter().all(|e| e.status == 0),
            "round {round}: {cqes:?}"
        );
        // Late interrupts of this round must not count in the next one.
        std::thread::sleep(Duration::from_millis(10));
        irq.total(1);
    }
    // The device works on.
    r.driver.rw(1, false, 0, 8, &bufs[0]).unwrap();
}

/// On tcp the VMM has the lender send its interrupts as IRQ events, which reach their
/// eventfds through the session's relay thread and then its event consumer (lendvm's session
/// pump), while a reply goes straight to the caller. An interrupt sent before the hand-over
/// quiesce's reply must be written before the quiesce returns: the VMM saves the vCPUs'
/// interrupt state next, and an interrupt written after that lands in a VM that is going
/// away (a loaded CI run lost one this way: `migration_lent`, "an interrupt was lost").
/// Here the consumer takes the interrupt and writes its eventfd 300 ms later.
#[test]
fn a_handover_quiesce_returns_after_the_interrupts_relayed_before_it() {
    let c = cluster(FabricKind::Tcp);
    let _d = lenderd(&c, "settle");
    let a = vm(&c);
    let lease = Arc::new(a.client.borrow(DEV, "vm0").unwrap());
    lease.map_dma(0, RAM, a.window.id()).unwrap();
    lease
        .set_irqs(
            IrqKind::Msix,
            &[ClientIrq::Event, ClientIrq::Event, ClientIrq::Event],
        )
        .unwrap();
    let mut driver = polled_driver(
        Arc::new(TrappedBar(Arc::clone(&lease))),
        a.ram.clone(),
        a.irq.clone(),
    );
    let buf = driver.alloc_data(4096, 0, false).unwrap();
    let written = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let waker = a.client.event_waker().unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (got_tx, got) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                match a.client.wait_event() {
                    Ok(Some(Event::Irq(i))) if i.vector == 1 => {
                        let _ = got_tx.send(());
                        std::thread::sleep(Duration::from_millis(300));
                        written.write(1).unwrap();
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
        });
        driver
            .push(1, NvmeDriver::rw_sqe(false, 0, 8, &buf))
            .unwrap();
        driver.ring(1).unwrap();
        // Checked after the consumer has stopped: a failed check must not leave it waiting.
        let seen = got.recv_timeout(Duration::from_secs(10));
        let t0 = Instant::now();
        let q = seen.is_ok().then(|| lease.quiesce_for_handover(5000));
        let at_return = (written.read().ok(), t0.elapsed());
        stop.store(true, std::sync::atomic::Ordering::Release);
        waker.wake();
        seen.expect("the completion's interrupt reached the consumer");
        let q = q.unwrap().unwrap();
        assert!(q.drained, "{q:?}");
        assert_eq!(
            at_return.0,
            Some(1),
            "the quiesce returned after {:?}, before the interrupt relayed ahead of its reply \
             reached its eventfd",
            at_return.1
        );
        lease.quiesce(false).unwrap();
    });
    let mut cqes = Vec::new();
    driver.wait(1, &mut cqes, 1).unwrap();
    assert_eq!(cqes[0].status, 0);
}

/// Copies guest RAM from A to B (what precopy ends with) and accepts the transfer on B.
fn accept(b: &Vm, t: &TransferTicket, vm: &str) -> Result<Lease, ClientError> {
    b.client.accept_transfer(
        t,
        vm,
        &[AcceptMap {
            iova: 0,
            size: RAM,
            window: b.window.id(),
        }],
        &targets(&b.irq),
    )
}

fn refused(r: Result<Lease, ClientError>) -> ClientError {
    match r {
        Ok(l) => panic!("accepted lease {}", l.id()),
        Err(e) => e,
    }
}

fn copy_ram(from: &MemfdRam, to: &MemfdRam) {
    let mut buf = vec![0u8; 1 << 20];
    for off in (0..RAM).step_by(buf.len()) {
        from.read(off, &mut buf);
        to.write(off, &buf);
    }
}

fn wait_moved(c: &LenderClient, lease: u64) -> String {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        match c.next_event(Duration::from_millis(100)).unwrap() {
            Some(Event::LeaseMoved(m)) if m.lease == lease => return m.to,
            Some(Event::DeviceGone(g)) => panic!("lease reported lost: {g:?}"),
            _ => {}
        }
    }
    panic!("no lease-moved event");
}

#[test]
fn transfer_moves_the_lease_with_its_device_state() {
    transfer(FabricKind::Shm);
}

/// Over tcp: DMA through window messages, interrupts relayed as events.
#[test]
fn transfer_over_tcp() {
    transfer(FabricKind::Tcp);
}

fn transfer(kind: FabricKind) {
    let c = cluster(kind);
    let _d = lenderd(&c, "transfer");
    let mut r = rig(&c);
    let buf = r.driver.alloc_data(32 * 1024, 0, false).unwrap();
    buf.fill(&*r.ram, &pattern(1, 32 * 1024));
    r.driver.rw(1, true, 1000, 64, &buf).unwrap();
    let id = r.lease.id();

    let b = vm(&c);
    let q = r.lease.quiesce_for_handover(5000).unwrap();
    assert!(q.drained);
    let t = r.lease.create_transfer(BORROWER, "vm0-dst").unwrap();
    copy_ram(&r.a.ram, &b.ram);
    let t0 = Instant::now();
    let lb = Arc::new(accept(&b, &t, "vm0-dst").unwrap());
    eprintln!("{kind:?}: transfer accepted in {:?}", t0.elapsed());
    assert_eq!(lb.id(), id, "the same lease");
    assert_eq!(wait_moved(&r.a.client, id), format!("{BORROWER}/vm0-dst"));
    // The guest now runs on B: its RAM, B's lease for BAR access, B's interrupt eventfds.
    r.ram.set(b.ram.clone());
    r.bar.set(Arc::new(TrappedBar(Arc::clone(&lb))));
    r.irq.set(b.irq.clone());
    lb.quiesce(false).unwrap();
    // The I/O queue A created still exists (no reset): A's data reads back through it.
    let back = r.driver.alloc_data(32 * 1024, 0, false).unwrap();
    r.driver.rw(1, false, 1000, 64, &back).unwrap();
    assert_eq!(back.read(&*r.ram), pattern(1, 32 * 1024));
    buf.fill(&*r.ram, &pattern(2, 32 * 1024));
    r.driver.rw(1, true, 2000, 64, &buf).unwrap();
    r.driver.rw(1, false, 2000, 64, &back).unwrap();
    assert_eq!(back.read(&*r.ram), pattern(2, 32 * 1024));
    assert!(b.irq.total(1) > 0, "interrupts reach the destination");
    assert_eq!(r.a.ram.mem.len(), RAM);
    // The lender shows the destination as the holder; the source's lease is gone there.
    let st = b.client.status().unwrap();
    assert_eq!(
        st.devices[0].summary.state,
        DeviceState::Lent {
            node: BORROWER.into(),
            vm: "vm0-dst".into()
        }
    );
    let e = r.lease.bar_read(0, 0, 4).unwrap_err();
    assert_eq!(
        e.code(),
        Some(lending::protocol::code::UNKNOWN_LEASE),
        "{e}"
    );
    // A lets go of the handle without returning the device (it is B's now).
    let lease_a = Arc::try_unwrap(std::mem::replace(&mut r.lease, lb.clone()))
        .ok()
        .expect("only the rig holds A's lease");
    lease_a.moved();
    drop(r.driver);
    drop(r.bar);
    drop(r.lease);
    Arc::try_unwrap(lb).ok().unwrap().return_device().unwrap();
}

#[test]
fn without_an_accept_the_source_keeps_its_lease() {
    let c = cluster(FabricKind::Shm);
    let _d = lenderd(&c, "noaccept");
    let mut r = rig(&c);
    let buf = r.driver.alloc_data(4096, 0, false).unwrap();
    // The destination connects and dies before accepting.
    let t = r.lease.create_transfer(BORROWER, "vm0-dst").unwrap();
    drop(vm(&c));
    r.driver.rw(1, false, 0, 8, &buf).unwrap();
    // A second ticket while one is outstanding is refused; cancelled, the ticket is dead.
    let e = r.lease.create_transfer(BORROWER, "x").unwrap_err();
    assert_eq!(
        e.code(),
        Some(lending::protocol::migration::code::TRANSFER_PENDING)
    );
    r.lease.cancel_transfer().unwrap();
    let b = vm(&c);
    let e = refused(accept(&b, &t, "vm0-dst"));
    assert_eq!(e.code(), Some(BAD_TICKET), "{e}");
    // A hand-over quiesce that is not followed by a transfer ends with a resume.
    r.lease.quiesce_for_handover(1000).unwrap();
    r.lease.quiesce(false).unwrap();
    r.driver.rw(1, false, 0, 8, &buf).unwrap();
    let st = b.client.status().unwrap();
    assert_eq!(
        st.devices[0].summary.state,
        DeviceState::Lent {
            node: BORROWER.into(),
            vm: "vm0".into()
        }
    );
}

#[test]
fn forged_misdirected_and_replayed_tickets_are_refused() {
    let c = cluster(FabricKind::Shm);
    let d = lenderd(&c, "forged");
    let mut r = rig(&c);
    let buf = r.driver.alloc_data(4096, 0, false).unwrap();
    let t = r.lease.create_transfer(BORROWER, "vm0-dst").unwrap();
    let b = vm(&c);
    let forged = TransferTicket {
        ticket: vec![0x5a; t.ticket.len()],
        ..t.clone()
    };
    let other_lease = TransferTicket {
        lease: t.lease + 1,
        ..t.clone()
    };
    for (what, tk, vm) in [
        ("forged", &forged, "vm0-dst"),
        ("wrong vm", &t, "vm9"),
        ("another lease", &other_lease, "vm0-dst"),
    ] {
        let e = refused(accept(&b, tk, vm));
        assert_eq!(e.code(), Some(BAD_TICKET), "{what}: {e}");
    }
    // Presented on the source's own link.
    let e = refused(r.a.client.accept_transfer(&t, "vm0-dst", &[], &[]));
    assert_eq!(e.code(), Some(BAD_TICKET), "{e}");
    // The lease is untouched: A's I/O goes on.
    r.driver.rw(1, false, 0, 8, &buf).unwrap();
    // The real ticket works once; replayed, it is refused.
    let lb = accept(&b, &t, "vm0-dst").unwrap();
    let e = refused(accept(&b, &t, "vm0-dst"));
    assert_eq!(e.code(), Some(BAD_TICKET), "{e}");
    assert!(
        d.log().contains("refusal #5"),
        "refusals are counted in the log"
    );
    lb.return_device().unwrap();
}

/// A ticket is bound to the node it was issued for: another node of the cluster (which holds
/// the token, and could have read a ticket off a plain migration stream) presenting it, even
/// for the right VM name, is refused, and the lease stays with its holder; the node it names
/// takes it.
#[test]
fn a_ticket_presented_under_another_nodes_name_is_refused() {
    let mut c = cluster(FabricKind::Tcp);
    // A third member of the cluster.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut text = std::fs::read_to_string(&c.path).unwrap();
    text.push_str(&format!(
        "[[node]]\nname = \"node7\"\nfabric = \"tcp\"\ncontrol = \"127.0.0.1:{port}\"\n"
    ));
    std::fs::write(&c.path, text).unwrap();
    c.cfg = ntb::ClusterConfig::load(&c.path).unwrap();
    let _d = lenderd(&c, "othernode");
    let mut r = rig(&c);
    let buf = r.driver.alloc_data(4096, 0, false).unwrap();
    let t = r.lease.create_transfer(BORROWER, "vm0-dst").unwrap();
    let thief = vm_as(&c, "node7");
    let e = refused(accept(&thief, &t, "vm0-dst"));
    assert_eq!(e.code(), Some(BAD_TICKET), "{e}");
    assert!(
        e.to_string().contains("node1/vm0-dst") && e.to_string().contains("node7"),
        "{e}"
    );
    // The lease is untouched and the ticket not used up.
    r.driver.rw(1, false, 0, 8, &buf).unwrap();
    let b = vm(&c);
    let lb = accept(&b, &t, "vm0-dst").unwrap();
    assert_eq!(
        wait_moved(&r.a.client, t.lease),
        format!("{BORROWER}/vm0-dst")
    );
    drop(r.driver);
    drop(r.bar);
    let lease_a = Arc::try_unwrap(r.lease)
        .ok()
        .expect("only the rig holds A's lease");
    lease_a.moved();
    lb.return_device().unwrap();
}

#[test]
fn lender_killed_mid_handover_orphans_nothing() {
    let c = cluster(FabricKind::Shm);
    let mut d = lenderd(&c, "killed");
    let r = rig(&c);
    let t = r.lease.create_transfer(BORROWER, "vm0-dst").unwrap();
    r.lease.quiesce_for_handover(1000).unwrap();
    d.kill();
    // The source sees the lease lost as with any lender death.
    assert!(r.lease.quiesce(false).is_err());
    let _d2 = lenderd(&c, "restarted");
    let b = vm(&c);
    let st = b.client.status().unwrap();
    assert_eq!(st.devices[0].summary.state, DeviceState::Available);
    let e = refused(accept(&b, &t, "vm0-dst"));
    assert_eq!(e.code(), Some(BAD_TICKET), "{e}");
    // The device lends normally again.
    let l = b.client.borrow(DEV, "vm1").unwrap();
    l.return_device().unwrap();
}

#[test]
fn a_version_3_session_has_no_migration() {
    let c = cluster(FabricKind::Shm);
    let _d = lenderd(&c, "v3");
    let ep = ntb::SocketFabric::from_cluster(&c.cfg, BORROWER)
        .unwrap()
        .connect(&ntb::NodeId::new(LENDER).unwrap())
        .unwrap();
    let old = LenderClient::from_endpoint_with_version(ep, TOKEN, "v3", 3).unwrap();
    let lease = old.borrow(DEV, "vm0").unwrap();
    let e = lease.start_dirty_log().unwrap_err();
    assert!(
        matches!(e, ClientError::MigrationUnsupported { version: 3, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("does not support migration"), "{e}");
}

/// What the lender asked of a device's IOMMU domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DomainOp {
    Map(u64, u64),
    Unmap(u64, u64),
    /// A rebind and whether it kept the mapping.
    Rebind(u64, u64, bool),
}

/// The software domain of an emulated device, with every map, unmap and rebind recorded.
struct RecordingDomain {
    inner: Arc<lending::iommu::SoftIommu>,
    ops: Mutex<Vec<DomainOp>>,
}

impl RecordingDomain {
    fn take(&self) -> Vec<DomainOp> {
        std::mem::take(&mut *self.ops.lock().unwrap())
    }
}

impl IommuDomain for RecordingDomain {
    fn map(&self, iova: u64, size: u64, b: Arc<dyn DmaBacking>) -> Result<(), IommuError> {
        self.ops.lock().unwrap().push(DomainOp::Map(iova, size));
        self.inner.map(iova, size, b)
    }
    fn unmap(&self, iova: u64, size: u64) -> Result<(), IommuError> {
        self.ops.lock().unwrap().push(DomainOp::Unmap(iova, size));
        self.inner.unmap(iova, size)
    }
    fn rebind(&self, iova: u64, size: u64, b: Arc<dyn DmaBacking>) -> Result<(), IommuError> {
        let r = self.inner.rebind(iova, size, b);
        let op = DomainOp::Rebind(iova, size, r.is_ok());
        self.ops.lock().unwrap().push(op);
        r
    }
    fn unmap_all(&self) -> usize {
        self.inner.unmap_all()
    }
    fn mappings(&self) -> Vec<MappingInfo> {
        self.inner.mappings()
    }
    fn fault_count(&self) -> u64 {
        self.inner.fault_count()
    }
    fn dma_bytes(&self) -> Option<(u64, u64)> {
        self.inner.dma_bytes()
    }
    fn set_fault_listener(&self, l: Option<Arc<dyn FaultListener>>) {
        self.inner.set_fault_listener(l)
    }
    fn start_dirty_log(&self) -> bool {
        self.inner.start_dirty_log()
    }
    fn stop_dirty_log(&self) {
        self.inner.stop_dirty_log()
    }
    fn fetch_dirty(&self, iova: u64, len: u64) -> Result<DirtyPages, DirtyLogError> {
        self.inner.fetch_dirty(iova, len)
    }
}

/// A `dmatest` copy engine whose domain is a [`RecordingDomain`] (everything else is the
/// emulated backend's).
struct Recorded {
    dev: EmulatedBackend,
    dom: Arc<RecordingDomain>,
}

impl DeviceBackend for Recorded {
    fn kind(&self) -> &str {
        self.dev.kind()
    }
    fn describe(&self, id: &str) -> DeviceInfo {
        self.dev.describe(id)
    }
    fn config_size(&self) -> u16 {
        self.dev.config_size()
    }
    fn config_read(&self, offset: u16, buf: &mut [u8]) -> Result<(), BackendError> {
        self.dev.config_read(offset, buf)
    }
    fn config_write(&self, offset: u16, data: &[u8]) -> Result<(), BackendError> {
        self.dev.config_write(offset, data)
    }
    fn bar_export(&self, bar: u8) -> Option<BarExport<'_>> {
        self.dev.bar_export(bar)
    }
    fn peer_export(&self, bar: u8) -> Option<PeerExport<'_>> {
        self.dev.peer_export(bar)
    }
    fn bar_read(&self, bar: u8, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        self.dev.bar_read(bar, offset, buf)
    }
    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        self.dev.bar_write(bar, offset, data)
    }
    fn notify_eventfd(&self) -> Option<EventFd> {
        self.dev.notify_eventfd()
    }
    fn set_irqs(
        &self,
        kind: IrqKind,
        targets: Vec<Option<Arc<dyn IrqTrigger>>>,
    ) -> Result<(), BackendError> {
        self.dev.set_irqs(kind, targets)
    }
    fn clear_irqs(&self) {
        self.dev.clear_irqs()
    }
    fn intx_resample(&self) {
        self.dev.intx_resample()
    }
    fn set_bus_master(&self, enable: bool) -> Result<(), BackendError> {
        self.dev.set_bus_master(enable)
    }
    fn reset(&self) -> Result<(), BackendError> {
        self.dev.reset()
    }
    fn domain(&self) -> Arc<dyn IommuDomain> {
        Arc::clone(&self.dom) as Arc<dyn IommuDomain>
    }
    fn quiesce(&self, stop: bool) -> Result<(), BackendError> {
        self.dev.quiesce(stop)
    }
    fn quiesce_handover(&self, timeout: Duration) -> Result<Drained, BackendError> {
        self.dev.quiesce_handover(timeout)
    }
    fn counters(&self) -> LeaseCounters {
        self.dev.counters()
    }
    fn kick_doorbells(&self) -> DoorbellKicks {
        self.dev.kick_doorbells()
    }
    fn kick_generation(&self) -> u64 {
        self.dev.kick_generation()
    }
    fn set_kick_listener(&self, listener: Option<emulated::KickListener>) {
        self.dev.set_kick_listener(listener)
    }
}

const SMALL: u64 = 0x40000;

/// Copies `len` bytes of guest RAM from `src` to `dst` with the dmatest engine (the device
/// must be running); panics if the copy faulted.
fn dma_copy(dev: &EmulatedBackend, src: u64, dst: u64, len: u32) {
    use emulated::dmatest::{
        CMD_START, REG_CMD, REG_COMPLETED, REG_DST, REG_FAULTS, REG_LEN, REG_SRC,
    };
    let r32 = |off| {
        let mut b = [0u8; 4];
        dev.bar_read(0, off, &mut b).unwrap();
        u32::from_le_bytes(b)
    };
    let w32 = |off, v: u32| dev.bar_write(0, off, &v.to_le_bytes()).unwrap();
    let w64 = |off, v: u64| dev.bar_write(0, off, &v.to_le_bytes()).unwrap();
    // The engine publishes its counters asynchronously: wait on COMPLETED, not on STATUS
    // (which may still show the previous copy's done bit).
    let (done, faults) = (r32(REG_COMPLETED), r32(REG_FAULTS));
    w64(REG_SRC, src);
    w64(REG_DST, dst);
    w32(REG_LEN, len);
    w32(REG_CMD, CMD_START);
    let t0 = Instant::now();
    while r32(REG_COMPLETED) == done {
        assert!(t0.elapsed() < Duration::from_secs(5), "copy did not finish");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(r32(REG_FAULTS), faults, "the copy faulted");
}

/// An in-process lender of a `dmatest` engine whose domain calls are recorded.
fn recorded_lender(c: &Cluster) -> (Arc<Recorded>, Arc<RecordingDomain>, BackgroundLender) {
    let dev = EmulatedBackend::dmatest("keep", emulated::NotifyMode::Interrupt).unwrap();
    // The device's DMA goes through its own software domain: the lender's calls to it are
    // recorded on the way.
    let dom = Arc::new(RecordingDomain {
        inner: Arc::clone(dev.soft_iommu()),
        ops: Mutex::default(),
    });
    let backend = Arc::new(Recorded {
        dev,
        dom: Arc::clone(&dom),
    });
    let inv = Arc::new(Inventory::new(vec![(DEV.to_string(), backend.clone() as _)]).unwrap());
    let listener = ntb::SocketFabric::from_cluster(&c.cfg, LENDER)
        .unwrap()
        .listen()
        .unwrap();
    let l = BackgroundLender::start(Lender::new(inv, LENDER, TOKEN), listener).unwrap();
    (backend, dom, l)
}

/// A lease transfer on the memfd fast path (`same`: the destination exports the source's
/// guest-RAM memfd at the same offset) keeps the lender's DMA window — the domain is asked
/// for one rebind and never unmaps — and DMA after it reaches that memory even once the
/// source revoked its own window. With the destination's own memfd the window is unmapped
/// and mapped again, as for a copied migration. `in_accept`: the destination names its
/// window in TRANSFER_ACCEPT; else it maps it with DMA_MAP after the accept (as lendvm
/// does), and the source's mapping waits in the domain until then.
/// A source borrower of [`DEV`] with guest RAM (`a-ram`) exported and mapped at IOVA 0.
fn source_with_ram(
    c: &Cluster,
) -> (
    LenderClient,
    ntb::SharedMemory,
    ntb::ExportedWindow,
    lending::client::Lease,
) {
    let a = connect(c);
    let ram = ntb::SharedMemory::new("a-ram", SMALL).unwrap();
    let wa = a
        .endpoint()
        .export_window(ram.fd(), 0, SMALL, "a-ram")
        .unwrap();
    let lease = a.borrow(DEV, "vm0").unwrap();
    lease.map_dma(0, SMALL, wa.id()).unwrap();
    (a, ram, wa, lease)
}

fn transfer_keeping(same: bool, in_accept: bool) {
    let c = cluster(FabricKind::Shm);
    let (backend, dom, l) = recorded_lender(&c);

    let (a, ram, wa, lease) = source_with_ram(&c);
    ram.write_at(0x1000, &pattern(1, 4096)).unwrap();
    dma_copy(&backend.dev, 0x1000, 0x8000, 4096);
    let mut got = vec![0u8; 4096];
    ram.read_at(0x8000, &mut got).unwrap();
    assert_eq!(got, pattern(1, 4096), "DMA through the source's window");

    assert!(lease.quiesce_for_handover(1000).unwrap().drained);
    let t = lease.create_transfer(BORROWER, "vm0-dst").unwrap();
    let b = connect(&c);
    let own = ntb::SharedMemory::new("b-ram", SMALL).unwrap();
    let b_ram = if same { &ram } else { &own };
    if !same {
        let mut buf = vec![0u8; SMALL as usize];
        ram.read_at(0, &mut buf).unwrap();
        own.write_at(0, &buf).unwrap();
    }
    // On the fast path B holds the memfd A handed it (another descriptor of the same file).
    let b_fd = b_ram.fd().try_clone_to_owned().unwrap();
    let wb = b
        .endpoint()
        .export_window(b_fd.as_fd(), 0, SMALL, "b-ram")
        .unwrap();
    dom.take();
    let maps = [AcceptMap {
        iova: 0,
        size: SMALL,
        window: wb.id(),
    }];
    let lb = b
        .accept_transfer(&t, "vm0-dst", if in_accept { &maps } else { &[] }, &[])
        .unwrap();
    if !in_accept {
        assert_eq!(dom.take(), vec![], "the source's window waits for B's");
        assert_eq!(
            dom.mappings(),
            vec![MappingInfo {
                iova: 0,
                size: SMALL
            }]
        );
        assert_eq!(l.lender().dma_windows_kept(), 0);
        lb.map_dma(0, SMALL, wb.id()).unwrap();
    }
    let ops = dom.take();
    if same {
        assert_eq!(
            ops,
            vec![DomainOp::Rebind(0, SMALL, true)],
            "never unmapped"
        );
        assert_eq!(l.lender().dma_windows_kept(), 1);
    } else {
        assert_eq!(
            ops,
            vec![
                DomainOp::Rebind(0, SMALL, false),
                DomainOp::Unmap(0, SMALL),
                DomainOp::Map(0, SMALL),
            ]
        );
        assert_eq!(l.lender().dma_windows_kept(), 0);
    }
    assert_eq!(l.lender().transfers_done(), 1);
    assert_eq!(
        dom.mappings(),
        vec![MappingInfo {
            iova: 0,
            size: SMALL
        }]
    );
    assert_eq!(wait_moved(&a, lb.id()), format!("{BORROWER}/vm0-dst"));

    // A lets go: its lease handle without returning the device, then its window. A round
    // trip on A's link after the revocation: the lender has handled it (frames in order).
    lease.moved();
    drop(wa);
    a.status().unwrap();
    // The guest on B writes through its memfd; the device copies it by DMA.
    lb.quiesce(false).unwrap();
    b_ram.write_at(0x2000, &pattern(2, 4096)).unwrap();
    dma_copy(&backend.dev, 0x2000, 0x9000, 4096);
    b_ram.read_at(0x9000, &mut got).unwrap();
    assert_eq!(
        got,
        pattern(2, 4096),
        "DMA after the transfer (same: {same})"
    );
    if !same {
        ram.read_at(0x9000, &mut got).unwrap();
        assert_ne!(
            got,
            pattern(2, 4096),
            "the source's memory is no longer the window"
        );
    }
    assert_eq!(dom.fault_count(), 0);
    assert!(dom.take().is_empty());
    lb.return_device().unwrap();
    assert!(dom.mappings().is_empty());
}

#[test]
fn a_transfer_onto_the_same_memfd_keeps_the_dma_window() {
    transfer_keeping(true, true);
}

#[test]
fn a_transfer_onto_another_memfd_maps_the_dma_window_again() {
    transfer_keeping(false, true);
}

#[test]
fn a_dma_map_after_the_transfer_onto_the_same_memfd_keeps_the_dma_window() {
    transfer_keeping(true, false);
}

#[test]
fn a_dma_map_after_the_transfer_onto_another_memfd_maps_the_dma_window_again() {
    transfer_keeping(false, false);
}

/// The new holder resumes the device without mapping the range the source had mapped: the
/// source's mapping, left in the domain by an accept without windows, is unmapped then.
#[test]
fn a_resume_before_the_new_holder_maps_unmaps_the_old_window() {
    let c = cluster(FabricKind::Shm);
    let (_backend, dom, l) = recorded_lender(&c);
    let (_a, _ram, _wa, lease) = source_with_ram(&c);
    lease.quiesce_for_handover(1000).unwrap();
    let t = lease.create_transfer(BORROWER, "vm0-dst").unwrap();
    let b = connect(&c);
    let lb = b.accept_transfer(&t, "vm0-dst", &[], &[]).unwrap();
    dom.take();
    lb.quiesce(false).unwrap();
    assert_eq!(dom.take(), vec![DomainOp::Unmap(0, SMALL)]);
    assert!(dom.mappings().is_empty());
    assert_eq!(l.lender().dma_windows_kept(), 0);
    lease.moved();
    lb.return_device().unwrap();
}
