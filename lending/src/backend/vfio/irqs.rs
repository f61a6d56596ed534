//! Interrupts: `VFIO_DEVICE_SET_IRQS` with the borrower's eventfds, or with local eventfds
//! relayed to doorbells/messages.

use std::sync::Arc;

use vfio_bindings::bindings::vfio::{
    VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_MSI_IRQ_INDEX,
};
use vmm_sys_util::eventfd::EventFd;

use super::{VfioBackend, VfioDeviceOps};
use crate::backend::irq::IrqRelay;
use crate::backend::{BackendError, IrqTrigger};
use crate::protocol::IrqKind;

fn irq_index(kind: IrqKind) -> u32 {
    match kind {
        IrqKind::Intx => VFIO_PCI_INTX_IRQ_INDEX,
        IrqKind::Msi => VFIO_PCI_MSI_IRQ_INDEX,
        IrqKind::Msix => VFIO_PCI_MSIX_IRQ_INDEX,
    }
}

/// What is wired for one IRQ kind: the eventfds VFIO signals and the relay, if any.
pub(super) struct Wiring {
    _targets: Vec<Option<Arc<dyn IrqTrigger>>>,
    _local: Vec<EventFd>,
    _relay: Option<IrqRelay>,
}

impl<D: VfioDeviceOps> VfioBackend<D> {
    pub(super) fn wiring(&self) -> std::sync::MutexGuard<'_, Vec<(IrqKind, Wiring)>> {
        match self.wiring.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Wires `targets` to IRQ index `kind` ([`crate::backend::DeviceBackend::set_irqs`]).
    pub(super) fn wire_irqs(
        &self,
        kind: IrqKind,
        targets: Vec<Option<Arc<dyn IrqTrigger>>>,
    ) -> Result<(), BackendError> {
        let index = irq_index(kind);
        let max = self.dev.irq_count(index);
        if targets.len() > max as usize {
            return Err(BackendError::TooManyVectors {
                kind,
                count: targets.len(),
                max,
            });
        }
        let mut wiring = self.wiring();
        wiring.retain(|(k, _)| *k != kind);
        if targets.is_empty() {
            self.dev.disable_irq(index)?;
            return Ok(());
        }
        // Borrower eventfds go to VFIO directly; anything else gets a local eventfd that a
        // relay thread forwards.
        let mut local = Vec::new();
        let mut relay_src = Vec::new();
        let mut relay_dst = Vec::new();
        let mut slots: Vec<Option<usize>> = Vec::new(); // index into `local`
        for t in &targets {
            match t {
                Some(t) if t.eventfd().is_none() => {
                    let e =
                        EventFd::new(libc::EFD_NONBLOCK).map_err(|source| BackendError::Os {
                            what: "irq relay eventfd",
                            source,
                        })?;
                    let dup = e.try_clone().map_err(|source| BackendError::Os {
                        what: "irq relay eventfd",
                        source,
                    })?;
                    relay_src.push(dup);
                    relay_dst.push(Arc::clone(t));
                    slots.push(Some(local.len()));
                    local.push(e);
                }
                _ => slots.push(None),
            }
        }
        // Unwired vectors still need an fd for VFIO: give them a local sink.
        let sink = EventFd::new(libc::EFD_NONBLOCK).map_err(|source| BackendError::Os {
            what: "irq sink eventfd",
            source,
        })?;
        let fds: Vec<&EventFd> = targets
            .iter()
            .zip(&slots)
            .map(|(t, s)| match (t, s) {
                (_, Some(i)) => &local[*i],
                (Some(t), None) => t.eventfd().unwrap_or(&sink),
                (None, None) => &sink,
            })
            .collect();
        self.dev.enable_irq(index, &fds)?;
        drop(fds);
        let relay = if relay_src.is_empty() {
            None
        } else {
            Some(
                IrqRelay::start(&self.name, relay_src, relay_dst).map_err(|source| {
                    BackendError::Os {
                        what: "irq relay thread",
                        source,
                    }
                })?,
            )
        };
        local.push(sink);
        wiring.push((
            kind,
            Wiring {
                _targets: targets,
                _local: local,
                _relay: relay,
            },
        ));
        Ok(())
    }

    /// Disables every wired IRQ index ([`crate::backend::DeviceBackend::clear_irqs`]).
    pub(super) fn unwire_irqs(&self) {
        let mut w = self.wiring();
        for (k, _) in w.iter() {
            if let Err(e) = self.dev.disable_irq(irq_index(*k)) {
                log::warn!("{}: disabling {k:?}: {e}", self.name);
            }
        }
        w.clear();
    }
}
