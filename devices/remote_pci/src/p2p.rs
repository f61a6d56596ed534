//! Peer-to-peer DMA between borrowed devices of one VM that come from the same lender.
//!
//! A guest driver may give device *source* a bus address that lies in a BAR of device
//! *target* (a guest-physical address). For the transfer to reach *target*, source's
//! lender must map target's BAR into source's IOMMU domain at IOVA = that guest-physical
//! address ([`P2pPort::map`], protocol P2P_MAP).
//!
//! [`P2pRouter`] is the VM's one table of that (the VMM makes one per VM and gives every
//! `RemotePciDevice` a [`P2pMember`] of it): per device its lender and lease, the memory
//! BARs it decodes and where, whether it masters the bus, and the peer mappings it holds as
//! a source. It keeps them in line:
//!
//! * a source sets Bus Master Enable → every decoded lender-backed memory BAR of every other
//!   device of the same lender is mapped for it; clearing BME (or reset, removal) drops them;
//! * a target BAR starts decoding, moves or stops decoding (Command.Memory, BAR program,
//!   reset, removal) → the mapping at the old address is dropped in every source *before*
//!   the change takes effect, the one at the new address made *after*.
//!
//! Mappings are values ([`PeerMapping`]) whose `Drop` unmaps; the router holds them on
//! behalf of their source. A failed map is logged (rate-limited: the guest can repeat it)
//! and leaves the address unmapped, so a DMA there faults on the lender as any DMA outside
//! the device's windows does.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use log::{info, warn};

use crate::link::LinkError;

/// A peer-to-peer mapping in the source's IOMMU domain; dropping it unmaps it.
pub trait PeerMapping: Send {}

/// Why a peer BAR was not mapped.
#[derive(Debug, thiserror::Error)]
pub enum P2pMapError {
    /// The lender refused this BAR at this address for good (it has no memory a peer may
    /// reach, or the address is not usable): not asked again until the BAR moves.
    #[error("refused: {0}")]
    Refused(#[source] LinkError),
    /// The request failed (link down, lease lost, an older lender): asked again at the next
    /// change.
    #[error(transparent)]
    Failed(LinkError),
}

/// A lease's peer-to-peer side, shareable across threads (the router calls it from
/// whichever vCPU changes a BAR or Bus Master Enable).
pub trait P2pPort: Send + Sync {
    /// Identity of the lender (node name): only devices of one lender map each other.
    fn lender(&self) -> &str;
    /// The lease on that lender.
    fn lease(&self) -> u64;
    /// BAR indices the lender has device memory behind (what a peer may map).
    fn peer_bars(&self) -> Vec<u8>;
    /// Maps BAR `bar` of lease `target` (same lender, same VM) at `iova` in this lease's
    /// IOMMU domain.
    fn map(&self, target: u64, bar: u8, iova: u64) -> Result<Box<dyn PeerMapping>, P2pMapError>;
}

struct Member {
    port: Arc<dyn P2pPort>,
    /// Lender-backed memory BARs and the guest address each decodes at now.
    bars: Vec<(u8, u64)>,
    /// Bus Master Enable set (and DMA mapped).
    master: bool,
    /// Held as a source: (target device, BAR) → mapping.
    out: HashMap<(String, u8), Box<dyn PeerMapping>>,
    /// (BAR, address) of this device the lender refused for good as a peer target.
    refused: Vec<(u8, u64)>,
}

#[derive(Default)]
struct State {
    members: HashMap<String, Member>,
}

/// The VM's peer-to-peer table (see the module docs).
#[derive(Default)]
pub struct P2pRouter {
    state: Mutex<State>,
    /// Failed maps (logged rate-limited).
    failures: AtomicU64,
    /// Maps made over the router's life.
    maps: AtomicU64,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl P2pRouter {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Enters device `id` (its lease behind `port`) until the member is dropped.
    pub fn join(self: &Arc<Self>, id: &str, port: Arc<dyn P2pPort>) -> P2pMember {
        lock(&self.state).members.insert(
            id.to_string(),
            Member {
                port,
                bars: Vec::new(),
                master: false,
                out: HashMap::new(),
                refused: Vec::new(),
            },
        );
        P2pMember {
            router: Arc::clone(self),
            id: id.to_string(),
        }
    }

    /// Peer mappings held now, over all sources.
    pub fn live_mappings(&self) -> usize {
        lock(&self.state)
            .members
            .values()
            .map(|m| m.out.len())
            .sum()
    }

    /// Peer mappings made since the router was created.
    pub fn maps_made(&self) -> u64 {
        self.maps.load(Ordering::Relaxed)
    }

    /// Maps that failed since the router was created.
    pub fn map_failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Maps `target`'s BAR `bar` at `gpa` for `source` (both members, same lender).
    fn map_one(&self, st: &mut State, source: &str, target: &str, bar: u8, gpa: u64) {
        let Some(t) = st.members.get(target) else {
            return;
        };
        if t.refused.contains(&(bar, gpa)) {
            return;
        }
        let lease = t.port.lease();
        let Some(s) = st.members.get_mut(source) else {
            return;
        };
        match s.port.map(lease, bar, gpa) {
            Ok(m) => {
                self.maps.fetch_add(1, Ordering::Relaxed);
                info!("{source}: peer bar {bar} of {target} mapped at {gpa:#x}");
                s.out.insert((target.to_string(), bar), m);
            }
            Err(P2pMapError::Refused(e)) => {
                info!("{source}: peer bar {bar} of {target} at {gpa:#x} not mappable: {e}");
                if let Some(t) = st.members.get_mut(target) {
                    t.refused.push((bar, gpa));
                }
            }
            Err(P2pMapError::Failed(e)) => {
                // Guest-triggerable (BME and BAR writes in a loop): first 16, then 1 in 1024.
                let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
                if n <= 16 || n.is_multiple_of(1024) {
                    warn!(
                        "{source}: peer bar {bar} of {target} at {gpa:#x} not mapped: {e} \
                         (failure #{n}); dma there will fault"
                    );
                }
            }
        }
    }

    fn same_lender(st: &State, a: &str, b: &str) -> bool {
        match (st.members.get(a), st.members.get(b)) {
            (Some(x), Some(y)) => x.port.lender() == y.port.lender(),
            _ => false,
        }
    }

    fn set_master(&self, id: &str, on: bool) {
        let mut st = lock(&self.state);
        let Some(m) = st.members.get_mut(id) else {
            return;
        };
        if m.master == on {
            return;
        }
        m.master = on;
        if !on {
            // Dropping the values unmaps them on the lender.
            let n = std::mem::take(&mut m.out).len();
            if n > 0 {
                info!("{id}: {n} peer mappings dropped (bus master off)");
            }
            return;
        }
        let peers: Vec<(String, u8, u64)> = st
            .members
            .iter()
            .filter(|(other, _)| other.as_str() != id && Self::same_lender(&st, id, other))
            .flat_map(|(other, t)| t.bars.iter().map(move |&(b, g)| (other.clone(), b, g)))
            .collect();
        for (target, bar, gpa) in peers {
            self.map_one(&mut st, id, &target, bar, gpa);
        }
    }

    fn set_bars(&self, id: &str, bars: Vec<(u8, u64)>) {
        let mut st = lock(&self.state);
        let Some(m) = st.members.get_mut(id) else {
            return;
        };
        if m.bars == bars {
            return;
        }
        let old = std::mem::replace(&mut m.bars, bars.clone());
        // First every mapping of an address that goes away (before the change takes
        // effect), then the new ones.
        let gone: Vec<u8> = old
            .iter()
            .filter(|o| !bars.contains(o))
            .map(|&(b, _)| b)
            .collect();
        for src in st.members.values_mut() {
            for &b in &gone {
                src.out.remove(&(id.to_string(), b));
            }
        }
        let added: Vec<(u8, u64)> = bars.into_iter().filter(|b| !old.contains(b)).collect();
        if added.is_empty() {
            return;
        }
        let sources: Vec<String> = st
            .members
            .iter()
            .filter(|(s, m)| s.as_str() != id && m.master && Self::same_lender(&st, id, s))
            .map(|(s, _)| s.clone())
            .collect();
        for s in sources {
            for &(bar, gpa) in &added {
                self.map_one(&mut st, &s, id, bar, gpa);
            }
        }
    }

    fn leave(&self, id: &str) {
        let mut st = lock(&self.state);
        // As a target first (peers stop reaching its BARs), then as a source.
        for src in st.members.values_mut() {
            src.out.retain(|(t, _), _| t != id);
        }
        st.members.remove(id);
    }
}

/// A device's membership in the [`P2pRouter`]; dropping it unmaps everything the device
/// holds as a source and every peer mapping of its BARs.
pub struct P2pMember {
    router: Arc<P2pRouter>,
    id: String,
}

impl P2pMember {
    /// Bus Master Enable (with DMA mapped) turned on or off.
    pub fn set_master(&self, on: bool) {
        self.router.set_master(&self.id, on);
    }

    /// The device's lender-backed memory BARs decode at these guest addresses now (BAR
    /// index, address); anything not listed does not decode.
    pub fn set_bars(&self, bars: Vec<(u8, u64)>) {
        self.router.set_bars(&self.id, bars);
    }
}

impl Drop for P2pMember {
    fn drop(&mut self) {
        self.router.leave(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// Records the live mappings of a fake lender: (source lease, target lease, bar, iova).
    #[derive(Default)]
    struct FakeLender {
        live: Mutex<Vec<(u64, u64, u8, u64)>>,
        refuse: AtomicBool,
    }

    struct Port {
        lender: Arc<FakeLender>,
        name: String,
        lease: u64,
    }

    struct Mapping {
        lender: Arc<FakeLender>,
        key: (u64, u64, u8, u64),
    }

    impl PeerMapping for Mapping {}

    impl Drop for Mapping {
        fn drop(&mut self) {
            self.lender.live.lock().unwrap().retain(|k| *k != self.key);
        }
    }

    impl P2pPort for Port {
        fn lender(&self) -> &str {
            &self.name
        }
        fn lease(&self) -> u64 {
            self.lease
        }
        fn peer_bars(&self) -> Vec<u8> {
            vec![0, 2]
        }
        fn map(
            &self,
            target: u64,
            bar: u8,
            iova: u64,
        ) -> Result<Box<dyn PeerMapping>, P2pMapError> {
            if self.lender.refuse.load(Ordering::SeqCst) {
                return Err(P2pMapError::Failed(LinkError::Down("gone".into())));
            }
            if bar != 0 {
                return Err(P2pMapError::Refused(LinkError::Remote {
                    op: "p2p map",
                    message: "no peer memory".into(),
                }));
            }
            let key = (self.lease, target, bar, iova);
            self.lender.live.lock().unwrap().push(key);
            Ok(Box::new(Mapping {
                lender: self.lender.clone(),
                key,
            }))
        }
    }

    fn port(l: &Arc<FakeLender>, name: &str, lease: u64) -> Arc<dyn P2pPort> {
        Arc::new(Port {
            lender: l.clone(),
            name: name.into(),
            lease,
        })
    }

    fn live(l: &FakeLender) -> Vec<(u64, u64, u8, u64)> {
        let mut v = l.live.lock().unwrap().clone();
        v.sort();
        v
    }

    #[test]
    fn maps_follow_bus_master_bar_moves_and_removal() {
        let l = Arc::new(FakeLender::default());
        let r = P2pRouter::new();
        let a = r.join("a", port(&l, "L", 1));
        let b = r.join("b", port(&l, "L", 2));
        b.set_bars(vec![(0, 0xc000_0000)]);
        assert!(live(&l).is_empty(), "nobody masters the bus yet");
        a.set_master(true);
        assert_eq!(live(&l), vec![(1, 2, 0, 0xc000_0000)]);
        // The target moves: old gone, new there.
        b.set_bars(vec![(0, 0xc010_0000)]);
        assert_eq!(live(&l), vec![(1, 2, 0, 0xc010_0000)]);
        // Decoding off (reset, Command.Memory cleared): gone.
        b.set_bars(Vec::new());
        assert!(live(&l).is_empty());
        b.set_bars(vec![(0, 0xc010_0000)]);
        // Both master: each maps the other.
        a.set_bars(vec![(0, 0xc020_0000)]);
        b.set_master(true);
        assert_eq!(
            live(&l),
            vec![(1, 2, 0, 0xc010_0000), (2, 1, 0, 0xc020_0000)]
        );
        a.set_master(false);
        assert_eq!(live(&l), vec![(2, 1, 0, 0xc020_0000)]);
        a.set_master(true);
        assert_eq!(r.live_mappings(), 2);
        // Removal of the target: every mapping into it and of it goes.
        drop(b);
        assert!(live(&l).is_empty());
        assert_eq!(r.live_mappings(), 0);
        drop(a);
    }

    #[test]
    fn other_lenders_are_not_mapped_and_failures_are_counted() {
        let (l1, l2) = (
            Arc::new(FakeLender::default()),
            Arc::new(FakeLender::default()),
        );
        let r = P2pRouter::new();
        let a = r.join("a", port(&l1, "L1", 1));
        let c = r.join("c", port(&l2, "L2", 1));
        c.set_bars(vec![(0, 0xc000_0000)]);
        a.set_master(true);
        assert!(live(&l1).is_empty() && live(&l2).is_empty());
        let b = r.join("b", port(&l1, "L1", 2));
        l1.refuse.store(true, Ordering::SeqCst);
        b.set_bars(vec![(0, 0xc010_0000)]);
        assert_eq!(r.map_failures(), 1);
        assert_eq!(r.live_mappings(), 0);
        l1.refuse.store(false, Ordering::SeqCst);
        b.set_bars(Vec::new());
        b.set_bars(vec![(0, 0xc010_0000)]);
        assert_eq!(live(&l1), vec![(1, 2, 0, 0xc010_0000)]);
        // A BAR the lender refuses for good is asked for once, not at every change.
        let failures = r.map_failures();
        b.set_bars(vec![(0, 0xc010_0000), (2, 0xc020_0000)]);
        a.set_master(false);
        a.set_master(true);
        assert_eq!(live(&l1), vec![(1, 2, 0, 0xc010_0000)]);
        assert_eq!(r.map_failures(), failures, "refusals are not failures");
        assert_eq!(lock(&r.state).members["b"].refused, vec![(2, 0xc020_0000)]);
        drop((a, b, c));
    }
}
