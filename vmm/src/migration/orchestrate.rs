//! The migration's orchestration, both sides: `vm.send-migration` (lent devices' dirty
//! logs, precopy rounds, the hand-over quiesce, transfer tickets, the final pass, and undoing
//! all of it on failure) and the destination's taking over of the lent devices.
//!
//! It runs on the controller's thread and borrows what it needs of the controller through
//! [`MigrationHost`], so the controller ([`crate::control`]) keeps the device table, its
//! lifecycle and the API verbs, and this module the order of a migration's steps.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use api::events::EventBus;
use api::request::ApiError;
use api::types::{VmAddRemoteDeviceData, VmSendMigrationData, VmState};
use remote_pci::RemotePciDevice;
use serde_json::Value;

use super::protocol::{DeviceHandover, MigrationUrl};
use super::send::{DirtyLog, Sender, CONVERGED_PAGES, MAX_ROUNDS};
use super::MigrationError;
use crate::control::error_chain;
use crate::snapshot::devices::LentDevice;
use crate::snapshot::SnapshotSource;

/// How long a lent device may take to drain its DMA for a migration hand-over.
const HANDOVER_DRAIN_MS: u32 = 5_000;

/// What the orchestration needs of the controller (implemented by
/// [`crate::control::Controller`]).
pub trait MigrationHost {
    /// The VM's state as the API reports it.
    fn vm_state(&self) -> VmState;
    /// The event bus migration events go to.
    fn event_bus(&self) -> &EventBus;
    /// The devices that hold a lease now (lost ones have none), by id.
    fn leased_devices(&self) -> Vec<(String, Arc<Mutex<RemotePciDevice>>)>;
    /// What the migration reads of the VM (absent in unit tests without a KVM VM).
    fn snapshot_source(&self) -> Option<SnapshotSource>;
    /// How the migration stream is authenticated (see [`super::auth`]).
    fn stream_auth(&self) -> super::auth::StreamAuth;
    /// The lent devices' lease identities and guest-visible PCI state (VM paused).
    fn save_lent_devices(&self) -> Result<Vec<LentDevice>, crate::snapshot::SnapshotError>;
    /// Parks the vCPUs only (the devices are handed over, not paused).
    fn pause_vcpus(&mut self) -> Result<(), ApiError>;
    /// `vm.resume`.
    fn resume(&mut self) -> Result<(), ApiError>;
    /// Device `id`'s lease is gone (as on any lease loss).
    fn lose(&mut self, id: &str, why: String);
    /// The destination runs the VM now: this VMM stops.
    fn migrated_away(&mut self, to: &MigrationUrl);
    /// Takes device `data` over with `ticket` into `slot` (destination); returns it.
    fn take_over(
        &mut self,
        data: VmAddRemoteDeviceData,
        slot: u8,
        ticket: &remote_pci::LeaseTicket,
    ) -> Result<Arc<Mutex<RemotePciDevice>>, ApiError>;
    /// Puts the guest-visible PCI state of `d` back (BARs, MSI-X, Command).
    fn replay_lent(&self, d: &LentDevice) -> Result<(), ApiError>;
    /// The outgoing migration's progress, which metrics scrapes read while it runs.
    fn progress(&self) -> &crate::metrics::MigrationProgress;

    /// The longest one lender request may take (the links' `request_timeout`): the wait
    /// for the destination's restore grows by it per lent device.
    fn lender_request_timeout(&self) -> std::time::Duration {
        ntb::fabric::DEFAULT_REQUEST_TIMEOUT
    }
}

/// One lent device's hand-over in an outgoing migration: what has been done (undone on
/// failure by [`abandon_handover`]).
struct Handing {
    id: String,
    dev: Arc<Mutex<RemotePciDevice>>,
    mig: Arc<dyn remote_pci::LeaseMigration>,
    dirty_log: bool,
    /// The lender logs the device's writes page by page. `false` (VFIO without IOMMU dirty
    /// tracking): every fetch is the whole window, so the log is fetched once, at the final
    /// pass after the drain, and not in precopy rounds (they would never converge).
    exact: bool,
    quiesced: bool,
    ticket: bool,
    /// MSI-X vectors masked at the final pass with an interrupt waiting (taken from the
    /// device for the destination; put back on failure).
    undelivered: Vec<u32>,
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn emit<const N: usize>(
    host: &impl MigrationHost,
    source: &str,
    event: &str,
    props: [(&str, Value); N],
) {
    host.event_bus().emit(source, event, props);
}

/// `vm.send-migration`: live-migrates the VM to the lendvm listening at the url (precopy
/// with KVM dirty logging, see [`crate::migration`]). On success the destination runs the
/// VM and this VMM stops (exit 0); on any failure the VM runs on here (resumed if the
/// migration paused it, dirty logging off) and the error names the step. Lent devices stay
/// on their lenders and are handed over (see docs/ARCHITECTURE.md, "Life of a migration");
/// a device whose lender cannot hand over (protocol older than version 4) is refused with
/// 409. A device held under an etcd claim moves with its claim (the destination takes it
/// over with the lease).
pub fn send_migration(
    host: &mut impl MigrationHost,
    data: &VmSendMigrationData,
) -> Result<(), ApiError> {
    let state = host.vm_state();
    if !matches!(state, VmState::Running | VmState::Paused) {
        return Err(ApiError::conflict(format!(
            "cannot migrate the vm: it is {state}"
        )));
    }
    let url_text = data.destination_url.as_str();
    let url = super::parse_url(url_text).map_err(|e| ApiError::bad_request(error_chain(&e)))?;
    // What the request cannot have, refused before anything starts.
    if matches!(url, MigrationUrl::Tcp(_)) {
        if data.local {
            return Err(ApiError::bad_request(
                MigrationError::LocalNeedsUnix.to_string(),
            ));
        }
        if !host.stream_auth().has_secret() {
            return Err(ApiError::bad_request(MigrationError::NoSecret.to_string()));
        }
    }
    let mut devs = Vec::new();
    let mut refused = Vec::new();
    for (id, dev) in host.leased_devices() {
        let mig = lock(&dev).migration();
        match mig {
            Some(mig) => devs.push(Handing {
                id,
                dev,
                mig,
                dirty_log: false,
                exact: true,
                quiesced: false,
                ticket: false,
                undelivered: Vec::new(),
            }),
            None => refused.push(id),
        }
    }
    if !refused.is_empty() {
        return Err(ApiError::conflict(format!(
            "cannot migrate the vm: lent devices {} cannot be handed over (their lender \
             speaks a protocol older than version 4)",
            refused.join(", ")
        )));
    }
    // Each device's dirty log starts now (it runs until the lease moves, or is stopped by
    // `abandon_handover`). A lender that cannot log the device's writes page by page (VFIO
    // without IOMMU dirty tracking) reports the whole window: such a device's window is sent
    // again at the final pass, once its drain is confirmed.
    let mut untracked = Vec::new();
    let mut failed = None;
    for d in &mut devs {
        match d.mig.start_dirty_log() {
            Ok(exact) => {
                d.dirty_log = true;
                d.exact = exact;
                if !exact {
                    untracked.push(d.id.clone());
                }
            }
            Err(e) => {
                failed = Some(format!(
                    "cannot migrate the vm: starting the dirty log of lent device {}: {e}",
                    d.id
                ));
                break;
            }
        }
    }
    let stop_logs = |devs: &[Handing]| {
        for d in devs.iter().filter(|d| d.dirty_log) {
            if let Err(e) = d.mig.stop_dirty_log() {
                log::warn!("{}: stopping the device dirty log: {e}", d.id);
            }
        }
    };
    if let Some(why) = failed {
        stop_logs(&devs);
        return Err(ApiError::bad_gateway(why));
    }
    let Some(src) = host.snapshot_source() else {
        stop_logs(&devs);
        return Err(ApiError::internal("this vmm cannot migrate its vm"));
    };
    if !untracked.is_empty() && !data.local {
        log::info!(
            "migration: the lenders cannot track the DMA writes of lent devices {} (no IOMMU \
             dirty tracking): their whole DMA windows are sent again at the final pass, after \
             their drain is confirmed (longer downtime)",
            untracked.join(", ")
        );
    }
    let t0 = Instant::now();
    host.progress().start();
    emit(
        host,
        "migration",
        "migration-started",
        [
            ("destination_url", Value::from(url_text)),
            ("lent_devices", Value::from(devs.len())),
            // Devices whose dirty log is the whole window (sent again at the final pass;
            // nothing extra on the same-host fast path, which copies nothing).
            ("untracked_devices", Value::from(untracked)),
        ],
    );
    let was_running = state == VmState::Running;
    let mut paused_here = false;
    let r = migrate(
        host,
        &url,
        src,
        data.local,
        was_running,
        &mut paused_here,
        &mut devs,
    );
    match r {
        Ok((bytes, downtime)) => {
            host.progress().end(Some(downtime));
            log::info!(
                "vm migrated to {url} ({bytes} bytes of RAM sent, {:.1} ms paused)",
                downtime.as_secs_f64() * 1e3
            );
            emit(
                host,
                "migration",
                "migration-completed",
                [
                    ("destination_url", Value::from(url_text)),
                    ("ram_bytes", Value::from(bytes)),
                    ("took_ms", Value::from(t0.elapsed().as_millis() as u64)),
                    ("downtime_ms", Value::from(downtime.as_millis() as u64)),
                ],
            );
            // The leases are the destination's now: nothing to return at teardown (the
            // lender answers our RETURN with "unknown lease", harmlessly). The destination
            // runs the VM now: stop here (exit status 0).
            host.migrated_away(&url);
            Ok(())
        }
        Err(e) => {
            host.progress().end(None);
            let msg = error_chain(&e);
            log::error!("migration to {url} failed: {msg}; the vm keeps running here");
            abandon_handover(host, &devs);
            if paused_here {
                if let Err(e) = host.resume() {
                    log::error!("resuming after the failed migration: {e}");
                }
            }
            emit(
                host,
                "migration",
                "migration-failed",
                [
                    ("destination_url", Value::from(url_text)),
                    ("error", Value::from(msg.clone())),
                ],
            );
            Err(ApiError::internal(format!("migration failed: {msg}")))
        }
    }
}

/// A failed migration: each device's ticket is withdrawn (an unused ticket leaves the lease
/// ours), its dirty log stopped and its hand-over quiesce ended (the interrupts the lender
/// held go to our irqfds). A lease that cannot be withdrawn has moved to the destination
/// (which then failed and returns it) or was lost: the device is lost here, as on any lease
/// loss; nothing is left holding it.
fn abandon_handover(host: &mut impl MigrationHost, devs: &[Handing]) {
    let mut lost = Vec::new();
    for d in devs {
        if d.ticket {
            if let Err(e) = d.mig.cancel_transfer() {
                log::error!(
                    "{}: the transfer ticket cannot be withdrawn ({e}): the lease is no longer \
                     ours",
                    d.id
                );
                lost.push((
                    d.id.clone(),
                    format!("lease moved or lost in migration: {e}"),
                ));
                continue;
            }
        }
        if d.dirty_log {
            if let Err(e) = d.mig.stop_dirty_log() {
                log::warn!("{}: stopping the device dirty log: {e}", d.id);
            }
        }
        if !d.undelivered.is_empty() {
            lock(&d.dev).set_msix_pending(&d.undelivered);
        }
        if d.quiesced {
            if let Err(e) = d.mig.resume_after_handover() {
                log::error!("{}: resuming after the hand-over quiesce: {e}", d.id);
            }
        }
        emit_handover(host, &d.id, d.mig.lease_id(), "cancelled", []);
    }
    for (id, why) in lost {
        host.lose(&id, why);
    }
}

fn emit_handover<const N: usize>(
    host: &impl MigrationHost,
    id: &str,
    lease: u64,
    phase: &str,
    extra: [(&str, Value); N],
) {
    let mut props = serde_json::Map::new();
    props.insert("id".into(), Value::from(id));
    props.insert("lease".into(), Value::from(lease));
    props.insert("phase".into(), Value::from(phase));
    for (k, v) in extra {
        props.insert(k.into(), v);
    }
    host.event_bus()
        .emit("migration", "migration-device-handover", props);
}

fn emit_iteration(host: &impl MigrationHost, round: u32, pages: u64, device_pages: u64) {
    host.progress().round_sent(round, pages);
    log::info!("migration round {round}: {pages} pages ({device_pages} written by devices)");
    emit(
        host,
        "migration",
        "migration-memory-iteration",
        [
            ("round", Value::from(round)),
            ("pages", Value::from(pages)),
            ("device_pages", Value::from(device_pages)),
        ],
    );
}

/// Device dirty logs fetched and merged into `dirty` (one bitmap per RAM region); returns
/// the pages they added. A precopy round (`final_pass` false) fetches only the exact logs:
/// a whole-window log would set every page of the window every round, and precopy would
/// never converge. The final pass, after the hand-over quiesce confirmed every device
/// drained, fetches them all: a whole-window device's window is sent once more, complete.
fn merge_device_dirty(
    devs: &[Handing],
    regions: &[crate::memory::RamRegion],
    dirty: &mut [Vec<u64>],
    final_pass: bool,
) -> Result<u64, MigrationError> {
    let mut n = 0;
    for d in devs.iter().filter(|d| d.exact || final_pass) {
        let pages = d
            .mig
            .fetch_dirty_log()
            .map_err(|e| MigrationError::Handover {
                id: d.id.clone(),
                step: "fetching the device dirty log",
                reason: e.to_string(),
            })?;
        let added = super::send::merge_device_dirty(regions, dirty, &pages);
        if !d.exact {
            log::info!(
                "{}: whole dma window sent again at the final pass ({} pages, {added} not \
                 dirty otherwise)",
                d.id,
                pages
                    .bits
                    .iter()
                    .map(|w| u64::from(w.count_ones()))
                    .sum::<u64>()
            );
        }
        n += added;
    }
    Ok(n)
}

/// The migration proper; returns (RAM bytes sent, time paused). `paused_here` tells the
/// caller whether it must resume the VM after a failure; `devs` what each lent device's
/// hand-over has done so far (undone by the caller after a failure).
fn migrate(
    host: &mut impl MigrationHost,
    url: &MigrationUrl,
    src: SnapshotSource,
    local: bool,
    was_running: bool,
    paused_here: &mut bool,
    devs: &mut [Handing],
) -> Result<(u64, Duration), MigrationError> {
    use MigrationError as Me;
    let herr = |id: &str, step: &'static str, e: String| Me::Handover {
        id: id.to_string(),
        step,
        reason: e,
    };
    let auth = host.stream_auth();
    let mut sender = Sender::connect(url, src, local, devs.len() as u32, &auth)?;
    let to = match (&sender.identity.node, &sender.identity.vm) {
        (Some(n), Some(v)) => Some((n.clone(), v.clone())),
        _ => None,
    };
    if !devs.is_empty() && to.is_none() {
        return Err(Me::Refused(
            "the destination cannot take lent devices over (it was started without a \
             cluster file)"
                .into(),
        ));
    }
    let regions = sender.ram().regions().to_vec();
    // Same-host fast path: the destination maps this very RAM; nothing to copy, no dirty
    // log, straight to the final pass.
    let log = if local {
        None
    } else {
        Some(sender.dirty_log()?)
    };
    let mut round = 0;
    if let Some(log) = &log {
        precopy(host, &mut sender, log, devs, &regions, &mut round)?;
    }
    let t_pause = Instant::now();
    if was_running {
        // vCPUs only: the devices are quiesced for the hand-over below, which holds their
        // interrupts on the lender (what they raised before went into the irqfds and so
        // into the vCPUs' saved LAPIC state).
        host.pause_vcpus().map_err(|e| Me::Pause(e.message))?;
        *paused_here = true;
    }
    for d in devs.iter_mut() {
        let t = Instant::now();
        let q = d
            .mig
            .quiesce_for_handover(HANDOVER_DRAIN_MS)
            .map_err(|e| herr(&d.id, "quiescing for the hand-over", e.to_string()))?;
        d.quiesced = true;
        if !q.drained {
            return Err(herr(
                &d.id,
                "quiescing for the hand-over",
                format!(
                    "the lender cannot confirm that the device's DMA drained within \
                     {HANDOVER_DRAIN_MS} ms"
                ),
            ));
        }
        emit_handover(
            host,
            &d.id,
            d.mig.lease_id(),
            "quiesced",
            [
                ("took_us", Value::from(t.elapsed().as_micros() as u64)),
                ("pending_msix", Value::from(q.pending_msix.clone())),
                ("pending_intx", Value::from(q.pending_intx)),
                (
                    "dirty_log",
                    Value::from(if d.exact { "exact" } else { "whole-window" }),
                ),
            ],
        );
    }
    // Interrupts waiting on vectors the guest (or, for a VM paused before, the VMM) masked:
    // they go with the device.
    for d in devs.iter_mut() {
        d.undelivered = lock(&d.dev).take_undelivered_msix();
        if !d.undelivered.is_empty() {
            log::info!(
                "{}: masked msi-x vectors {:?} pending, carried over",
                d.id,
                d.undelivered
            );
        }
    }
    let lent = host.save_lent_devices().map_err(Me::Snapshot)?;
    let doc = sender.save_state(lent)?;
    // The devices are drained: their last fetch has every page they wrote (a whole-window
    // device's: its whole window, fetched for the first time here).
    if let Some(log) = &log {
        let mut dirty = log.take()?;
        let by_devices = merge_device_dirty(devs, &regions, &mut dirty, true)?;
        let pages = sender.send_dirty(&dirty)?;
        emit_iteration(host, round + 1, pages, by_devices);
    }
    let (node, vm) = to.unwrap_or_default();
    let mut handover = Vec::with_capacity(devs.len());
    for d in devs.iter_mut() {
        let t = d
            .mig
            .create_transfer(&node, &vm)
            .map_err(|e| herr(&d.id, "creating the lease transfer ticket", e.to_string()))?;
        d.ticket = true;
        emit_handover(
            host,
            &d.id,
            t.lease,
            "ticket",
            [("to", Value::from(format!("{node}/{vm}")))],
        );
        handover.push(DeviceHandover {
            id: d.id.clone(),
            lease: t.lease,
            ticket: t.ticket,
            expires_in_ms: t.expires_in_ms,
            pending_msix: d.undelivered.clone(),
            claim: t.claim.or_else(|| lock(&d.dev).claim_revision()),
        });
    }
    // The destination answers once it restored the VM and took every lease over: a borrow
    // and a DMA map per lent device, each a lender request (seconds, or minutes where the
    // lender's IOMMU walks a large window page by page).
    let restore_wait = super::send::IO_TIMEOUT
        + host
            .lender_request_timeout()
            .saturating_mul(2 * devs.len() as u32);
    sender.send_state(
        super::protocol::VmState {
            doc,
            paused: !was_running,
            handover,
        },
        restore_wait,
    )?;
    for d in devs.iter() {
        d.mig.mark_moved();
        emit_handover(
            host,
            &d.id,
            d.mig.lease_id(),
            "moved",
            [("to", Value::from(format!("{node}/{vm}")))],
        );
    }
    Ok((sender.bytes, t_pause.elapsed()))
}

/// Precopy: all RAM is sent, then rounds of what the vCPUs (KVM's log) and the devices (the
/// lenders' logs, started by [`send_migration`]) dirtied meanwhile.
fn precopy(
    host: &impl MigrationHost,
    sender: &mut Sender,
    log: &DirtyLog,
    devs: &mut [Handing],
    regions: &[crate::memory::RamRegion],
    round: &mut u32,
) -> Result<(), MigrationError> {
    // The devices' dirty logs run since `send_migration` started them; only the exact ones
    // are fetched here (see `merge_device_dirty`), so only they count towards convergence.
    let pages = sender.send_all()?;
    // Whatever the devices wrote during round 0 is in their first fetch.
    emit_iteration(host, 0, pages, 0);
    while *round < MAX_ROUNDS {
        *round += 1;
        let mut dirty = log.take()?;
        let by_devices = merge_device_dirty(devs, regions, &mut dirty, false)?;
        let pages = sender.send_dirty(&dirty)?;
        emit_iteration(host, *round, pages, by_devices);
        if pages <= CONVERGED_PAGES {
            break;
        }
    }
    Ok(())
}

/// The destination's side of the hand-over, before it acknowledges the migration: each lent
/// device's lease is taken over with its ticket (not reset), plugged into its old slot,
/// given the guest's PCI state (BARs, MSI-X table and control, Command: Bus Master Enable
/// maps this VMM's RAM as the DMA window at the same IOVAs, MSI-X hands our irqfds to the
/// lender), and resumed: the lender replays the interrupts it held.
pub fn take_over_lent_devices(
    host: &mut impl MigrationHost,
    lent: &[LentDevice],
    handover: &[DeviceHandover],
) -> Result<(), ApiError> {
    for d in lent {
        let t0 = Instant::now();
        let Some(h) = handover.iter().find(|h| h.id == d.id) else {
            return Err(ApiError::bad_request(format!(
                "{}: lent device without a hand-over ticket",
                d.id
            )));
        };
        let data = crate::control::lent_device_request(d)?;
        let ticket = remote_pci::LeaseTicket {
            lease: h.lease,
            ticket: h.ticket.clone(),
            expires_in_ms: h.expires_in_ms,
            claim: h.claim,
        };
        let dev = host.take_over(data, d.slot, &ticket)?;
        let t_accept = t0.elapsed();
        host.replay_lent(d)?;
        // Interrupts that waited on masked vectors at the source: pending here.
        lock(&dev).set_msix_pending(&h.pending_msix);
        let t_replay = t0.elapsed();
        let mig = lock(&dev).migration();
        let Some(mig) = mig else {
            return Err(ApiError::internal(format!(
                "{}: the taken-over lease has no migration side",
                d.id
            )));
        };
        mig.resume_after_handover()
            .map_err(|e| ApiError::bad_gateway(format!("{}: resuming the device: {e}", d.id)))?;
        log::info!(
            "{}: lease {} taken over and resumed in {:.1} ms; device not reset",
            d.id,
            h.lease,
            t0.elapsed().as_secs_f64() * 1e3
        );
        emit_handover(
            host,
            &d.id,
            h.lease,
            "taken-over",
            [
                ("took_us", Value::from(t0.elapsed().as_micros() as u64)),
                // Lease accepted and the device plugged (connect, accept, BAR windows).
                ("accept_us", Value::from(t_accept.as_micros() as u64)),
                // PCI state replayed: BARs, MSI-X (irqfds to the lender), Bus Master (guest
                // RAM pinned, exported and mapped as the DMA window).
                (
                    "replay_us",
                    Value::from((t_replay - t_accept).as_micros() as u64),
                ),
            ],
        );
    }
    Ok(())
}
