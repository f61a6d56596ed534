//! Peer-to-peer DMA between borrowed devices of one VM, from the same lender or from
//! different lenders.
//!
//! A guest driver may give device *source* a bus address that lies in a BAR of device
//! *target* (a guest-physical address). For the transfer to reach *target*, source's
//! lender must map target's BAR into source's IOMMU domain at IOVA = that guest-physical
//! address ([`P2pPort::map`], protocol P2P_MAP). When *target* is on another lender, the
//! router first asks target's lender to grant source's lender access to that BAR
//! ([`P2pPort::grant`], P2P_GRANT: a grant id and a capability secret, for that lender and
//! that lease only), then hands the grant to source's lender ([`P2pPort::map_remote`],
//! P2P_MAP_REMOTE), which reaches target's lender over its own lender-to-lender link and
//! maps the window. The router holds both as one value: dropping it unmaps on source's
//! lender first, then revokes the grant on target's lender.
//!
//! [`P2pRouter`] is the VM's one table of that (the VMM makes one per VM and gives every
//! `RemotePciDevice` a [`P2pMember`] of it): per device its lender and lease, the memory
//! BARs it decodes and where, whether it masters the bus, and the peer mappings it holds as
//! a source. It keeps them in line:
//!
//! * a source sets Bus Master Enable → every decoded lender-backed memory BAR of every other
//!   device (any lender) is mapped for it; clearing BME (or reset, removal) drops them;
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
    /// Target side across lenders: grants lender `grantee` access to this lease's BAR
    /// `bar`; the returned value revokes the grant when dropped. Default: not supported.
    fn grant(
        &self,
        bar: u8,
        grantee: &str,
    ) -> Result<(PeerGrant, Box<dyn PeerMapping>), P2pMapError> {
        let _ = (bar, grantee);
        Err(P2pMapError::Failed(LinkError::Unsupported {
            op: "p2p grant",
            reason: "the lender does not support peer-to-peer dma across lenders".into(),
        }))
    }
    /// Whether a peer of the same lender needs this lease's capability (a grant to the
    /// lender itself) to map it (tcp, protocol version 6). Default: no.
    fn needs_capability(&self) -> bool {
        false
    }
    /// Like [`P2pPort::map`], presenting the target's capability `grant`. Default: `map`.
    fn map_granted(
        &self,
        target: u64,
        bar: u8,
        iova: u64,
        grant: &PeerGrant,
    ) -> Result<Box<dyn PeerMapping>, P2pMapError> {
        let _ = grant;
        self.map(target, bar, iova)
    }
    /// Source side across lenders: maps BAR `bar` of lease `target` on lender `lender`,
    /// granted as `grant`, at `iova` in this lease's IOMMU domain. Default: not supported.
    fn map_remote(
        &self,
        lender: &str,
        target: u64,
        bar: u8,
        iova: u64,
        grant: &PeerGrant,
    ) -> Result<Box<dyn PeerMapping>, P2pMapError> {
        let _ = (lender, target, bar, iova, grant);
        Err(P2pMapError::Failed(LinkError::Unsupported {
            op: "p2p map remote",
            reason: "the lender does not support peer-to-peer dma across lenders".into(),
        }))
    }
}

/// A grant of a target BAR to another lender (its id and capability secret).
#[derive(Clone)]
pub struct PeerGrant {
    /// Grant id on the target's lender.
    pub grant: u64,
    /// Capability secret.
    pub secret: Vec<u8>,
}

impl std::fmt::Debug for PeerGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret.
        f.debug_struct("PeerGrant")
            .field("grant", &self.grant)
            .finish_non_exhaustive()
    }
}

/// A mapping made with a grant (across lenders, or the same-lender capability): the source
/// lender's mapping, then the target lender's grant (fields drop in order: unmapped on the
/// source's lender before the grant is revoked).
struct CrossLender {
    _map: Box<dyn PeerMapping>,
    _grant: Box<dyn PeerMapping>,
}

impl PeerMapping for CrossLender {}

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

    /// Maps `target`'s BAR `bar` at `gpa` for `source` (both members): directly on a
    /// shared lender, through a grant across lenders.
    fn map_one(&self, st: &mut State, source: &str, target: &str, bar: u8, gpa: u64) {
        let Some(t) = st.members.get(target) else {
            return;
        };
        if t.refused.contains(&(bar, gpa)) {
            return;
        }
        let tport = Arc::clone(&t.port);
        let Some(s) = st.members.get_mut(source) else {
            return;
        };
        let r = if s.port.lender() == tport.lender() && tport.needs_capability() {
            // Same lender on tcp: the target's grant to its own lender is the capability.
            tport.grant(bar, tport.lender()).and_then(|(g, guard)| {
                let m = s.port.map_granted(tport.lease(), bar, gpa, &g)?;
                Ok(Box::new(CrossLender {
                    _map: m,
                    _grant: guard,
                }) as Box<dyn PeerMapping>)
            })
        } else if s.port.lender() == tport.lender() {
            s.port.map(tport.lease(), bar, gpa)
        } else {
            tport.grant(bar, s.port.lender()).and_then(|(g, guard)| {
                let m = s
                    .port
                    .map_remote(tport.lender(), tport.lease(), bar, gpa, &g)?;
                Ok(Box::new(CrossLender {
                    _map: m,
                    _grant: guard,
                }) as Box<dyn PeerMapping>)
            })
        };
        match r {
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
            .filter(|(other, _)| other.as_str() != id)
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
            .filter(|(s, m)| s.as_str() != id && m.master)
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
        /// Grants given by this lender: (lease, bar, grantee, grant id).
        grants: Mutex<Vec<(u64, u8, String, u64)>>,
        /// Remote maps held by this lender: (source lease, lender, target, bar, iova, grant).
        remote: Mutex<Vec<RemoteRow>>,
        /// Every unmap and revoke, in order.
        log: Mutex<Vec<String>>,
    }

    struct Grant {
        lender: Arc<FakeLender>,
        id: u64,
    }

    impl PeerMapping for Grant {}

    impl Drop for Grant {
        fn drop(&mut self) {
            self.lender
                .grants
                .lock()
                .unwrap()
                .retain(|g| g.3 != self.id);
            self.lender
                .log
                .lock()
                .unwrap()
                .push(format!("revoke {}", self.id));
        }
    }

    struct Remote {
        lender: Arc<FakeLender>,
        grant: u64,
    }

    impl PeerMapping for Remote {}

    impl Drop for Remote {
        fn drop(&mut self) {
            self.lender
                .remote
                .lock()
                .unwrap()
                .retain(|r| r.5 != self.grant);
            self.lender
                .log
                .lock()
                .unwrap()
                .push(format!("unmap remote {}", self.grant));
        }
    }

    static NEXT_GRANT: AtomicU64 = AtomicU64::new(1);

    /// (source lease, lender, target, bar, iova, grant).
    type RemoteRow = (u64, String, u64, u8, u64, u64);

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
        fn grant(
            &self,
            bar: u8,
            grantee: &str,
        ) -> Result<(PeerGrant, Box<dyn PeerMapping>), P2pMapError> {
            if bar != 0 {
                return Err(P2pMapError::Refused(LinkError::Remote {
                    op: "p2p grant",
                    message: "no peer memory".into(),
                }));
            }
            let id = NEXT_GRANT.fetch_add(1, Ordering::SeqCst);
            self.lender
                .grants
                .lock()
                .unwrap()
                .push((self.lease, bar, grantee.to_string(), id));
            Ok((
                PeerGrant {
                    grant: id,
                    secret: vec![id as u8; 32],
                },
                Box::new(Grant {
                    lender: self.lender.clone(),
                    id,
                }),
            ))
        }
        fn map_remote(
            &self,
            lender: &str,
            target: u64,
            bar: u8,
            iova: u64,
            grant: &PeerGrant,
        ) -> Result<Box<dyn PeerMapping>, P2pMapError> {
            if self.lender.refuse.load(Ordering::SeqCst) {
                return Err(P2pMapError::Failed(LinkError::Down("gone".into())));
            }
            self.lender.remote.lock().unwrap().push((
                self.lease,
                lender.to_string(),
                target,
                bar,
                iova,
                grant.grant,
            ));
            Ok(Box::new(Remote {
                lender: self.lender.clone(),
                grant: grant.grant,
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
    fn failures_are_counted_and_refusals_asked_once() {
        let l1 = Arc::new(FakeLender::default());
        let r = P2pRouter::new();
        let a = r.join("a", port(&l1, "L1", 1));
        a.set_master(true);
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
        drop((a, b));
    }

    #[test]
    fn across_lenders_the_target_lender_grants_and_the_source_lender_maps() {
        let (l1, l2) = (
            Arc::new(FakeLender::default()),
            Arc::new(FakeLender::default()),
        );
        let r = P2pRouter::new();
        let a = r.join("a", port(&l1, "L1", 1));
        let c = r.join("c", port(&l2, "L2", 7));
        c.set_bars(vec![(0, 0xc000_0000), (2, 0xc100_0000)]);
        a.set_master(true);
        // L2 granted bar 0 of lease 7 to L1 (bar 2 has no peer memory: refused once), and
        // L1 mapped it with that grant at c's address.
        let g = l2.grants.lock().unwrap().clone();
        assert_eq!(g.len(), 1);
        assert_eq!((g[0].0, g[0].1, g[0].2.as_str()), (7, 0, "L1"));
        let m = l1.remote.lock().unwrap().clone();
        assert_eq!(m, vec![(1, "L2".into(), 7, 0, 0xc000_0000, g[0].3)]);
        assert_eq!(r.live_mappings(), 1);
        assert_eq!(lock(&r.state).members["c"].refused, vec![(2, 0xc100_0000)]);
        // The target moves: unmapped on L1 before the grant is revoked on L2, then a new
        // grant and map at the new address.
        c.set_bars(vec![(0, 0xc010_0000)]);
        let first = g[0].3;
        assert_eq!(
            l1.log.lock().unwrap().as_slice(),
            [format!("unmap remote {first}")]
        );
        assert_eq!(
            l2.log.lock().unwrap().as_slice(),
            [format!("revoke {first}")]
        );
        let m = l1.remote.lock().unwrap().clone();
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].4, 0xc010_0000);
        // A source lender that cannot map: counted, and the grant is not left behind.
        drop(c);
        assert!(l1.remote.lock().unwrap().is_empty());
        assert!(l2.grants.lock().unwrap().is_empty());
        let c = r.join("c", port(&l2, "L2", 8));
        l1.refuse.store(true, Ordering::SeqCst);
        c.set_bars(vec![(0, 0xc020_0000)]);
        assert_eq!(r.map_failures(), 1);
        assert!(l2.grants.lock().unwrap().is_empty(), "grant revoked");
        // Removal of the source: its mappings go, the grants with them.
        l1.refuse.store(false, Ordering::SeqCst);
        c.set_bars(Vec::new());
        c.set_bars(vec![(0, 0xc020_0000)]);
        assert_eq!(r.live_mappings(), 1);
        drop(a);
        assert!(l1.remote.lock().unwrap().is_empty());
        assert!(l2.grants.lock().unwrap().is_empty());
        assert_eq!(r.live_mappings(), 0);
        drop(c);
    }
}
