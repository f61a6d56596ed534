//! The lease's live-migration requests (protocol version 4) as a [`LeaseMigration`].

use std::sync::Arc;

use lending::client::Lease;

use super::link_err;
use crate::link::{DeviceDirtyPages, HandoverState, LeaseMigration, LeaseTicket, LinkError};

/// The lease's version 4 migration requests.
pub(super) struct LendingMigration {
    pub(super) lease: Arc<Lease>,
}

impl LeaseMigration for LendingMigration {
    fn lease_id(&self) -> u64 {
        self.lease.id()
    }

    fn start_dirty_log(&self) -> Result<bool, LinkError> {
        self.lease
            .start_dirty_log()
            .map_err(|e| link_err("dirty log start", e))
    }

    fn fetch_dirty_log(&self) -> Result<DeviceDirtyPages, LinkError> {
        let d = self
            .lease
            .fetch_dirty_log(0, 0)
            .map_err(|e| link_err("dirty log fetch", e))?;
        Ok(DeviceDirtyPages {
            iova: d.iova,
            pages: d.pages,
            bits: d.bits,
            whole_window: d.whole_window,
        })
    }

    fn stop_dirty_log(&self) -> Result<(), LinkError> {
        self.lease
            .stop_dirty_log()
            .map_err(|e| link_err("dirty log stop", e))
    }

    fn quiesce_for_handover(&self, timeout_ms: u32) -> Result<HandoverState, LinkError> {
        let q = self
            .lease
            .quiesce_for_handover(timeout_ms)
            .map_err(|e| link_err("hand-over quiesce", e))?;
        Ok(HandoverState {
            drained: q.drained,
            pending_msix: q.pending_msix,
            pending_intx: q.pending_intx,
        })
    }

    fn resume_after_handover(&self) -> Result<(), LinkError> {
        self.lease
            .quiesce(false)
            .map_err(|e| link_err("hand-over resume", e))
    }

    fn create_transfer(&self, to_node: &str, to_vm: &str) -> Result<LeaseTicket, LinkError> {
        let t = self
            .lease
            .create_transfer(to_node, to_vm)
            .map_err(|e| link_err("transfer create", e))?;
        Ok(LeaseTicket {
            lease: t.lease,
            ticket: t.ticket,
            expires_in_ms: t.expires_in_ms,
            // A claim is the directory's business, not the link's: the VMM adds it.
            claim: None,
        })
    }

    fn cancel_transfer(&self) -> Result<(), LinkError> {
        self.lease
            .cancel_transfer()
            .map_err(|e| link_err("transfer cancel", e))
    }

    fn mark_moved(&self) {
        self.lease.mark_moved();
    }
}
