//! The guest's PCI tree: root buses (bus 0 and one per NUMA node with devices) and switches
//! (a PCI-to-PCI bridge in a root bus's slot, one lender's devices on its secondary bus).
//!
//! Every bus has an *index* (root buses first, then switches), and a slot is named by its
//! *slot number* `index * 32 + device` as before, so the API, snapshots, migration and the
//! hot-plug controller (PSEG selects an index) keep their `u8` slot numbers. What the guest
//! sees is the bus *number*: a root bus's switches take the numbers right after it, so that
//! its `_CRS` bus range `[root, root + switches]` is contiguous (Linux reads one range per
//! host bridge, and keeps firmware-assigned bridge numbers only when they fall in it).
//! Without switches, index and number agree.

use crate::root::{PciBdf, MAX_ROOT_BUSES, NUM_DEVICE_SLOTS};

/// What a bus is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BusKind {
    /// A root bus: a host bridge of its own in the guest's ACPI tables.
    Root,
    /// The secondary bus of a switch: its bridge sits in slot number `bridge_slot` of root
    /// bus `root` (an index); devices go in device numbers `0..ports`.
    Switch {
        root: u8,
        bridge_slot: u8,
        ports: u8,
    },
}

/// One bus: its number as the guest sees it, and its kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BusEntry {
    pub number: u8,
    pub kind: BusKind,
}

/// Why a layout cannot be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TopologyError {
    #[error(
        "{roots} root bus(es) and {switches} switch(es) make {} buses: at most {MAX_ROOT_BUSES} \
         fit (slot numbers are bus * 32 + device in a byte)",
        roots + switches
    )]
    TooManyBuses { roots: usize, switches: usize },
    #[error("a switch on root bus {root}: this VM has root buses 0 to {}", roots - 1)]
    NoSuchRoot { root: u8, roots: u8 },
    #[error("a switch with {0} ports: a switch has 1 to 32")]
    Ports(u8),
    #[error("root bus {root} has {switches} switches and only {slots} slots")]
    NoSlotForBridge { root: u8, switches: u8, slots: u8 },
}

/// A switch to make: on which root bus (an index), with how many ports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwitchSpec {
    pub root: u8,
    pub ports: u8,
}

/// The buses of a guest, by index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BusLayout {
    buses: Vec<BusEntry>,
    roots: u8,
}

impl BusLayout {
    /// Root buses `0..roots` (at least one), no switches.
    pub fn roots(roots: u8) -> Self {
        let roots = roots.clamp(1, MAX_ROOT_BUSES);
        Self {
            buses: (0..roots)
                .map(|number| BusEntry {
                    number,
                    kind: BusKind::Root,
                })
                .collect(),
            roots,
        }
    }

    /// Root buses `0..roots` and `switches` (in order: bus indexes `roots..`). A root bus's
    /// switches' bridges take its lowest slots, 1 up, before any device is plugged.
    /// `slots`: the slots for devices of each root bus.
    pub fn new(roots: u8, switches: &[SwitchSpec], slots: u8) -> Result<Self, TopologyError> {
        if roots == 0 || usize::from(roots) + switches.len() > usize::from(MAX_ROOT_BUSES) {
            return Err(TopologyError::TooManyBuses {
                roots: usize::from(roots),
                switches: switches.len(),
            });
        }
        let mut per_root = vec![0u8; usize::from(roots)];
        for s in switches {
            if s.root >= roots {
                return Err(TopologyError::NoSuchRoot {
                    root: s.root,
                    roots,
                });
            }
            if s.ports == 0 || s.ports > NUM_DEVICE_SLOTS {
                return Err(TopologyError::Ports(s.ports));
            }
            per_root[usize::from(s.root)] += 1;
        }
        if let Some((root, &n)) = per_root.iter().enumerate().find(|(_, &n)| n > slots) {
            return Err(TopologyError::NoSlotForBridge {
                root: root as u8,
                switches: n,
                slots,
            });
        }
        let mut buses: Vec<BusEntry> = Vec::with_capacity(usize::from(roots) + switches.len());
        let mut switch_entries = vec![None; switches.len()];
        let mut next = 0u8;
        for root in 0..roots {
            buses.push(BusEntry {
                number: next,
                kind: BusKind::Root,
            });
            next += 1;
            let own = switches.iter().enumerate().filter(|(_, s)| s.root == root);
            for (device, (i, s)) in (1u8..).zip(own) {
                switch_entries[i] = Some(BusEntry {
                    number: next,
                    kind: BusKind::Switch {
                        root,
                        bridge_slot: crate::root::slot_number(root, device),
                        ports: s.ports,
                    },
                });
                next += 1;
            }
        }
        buses.extend(switch_entries.into_iter().flatten());
        Ok(Self { buses, roots })
    }

    /// Root buses: indexes `0..this`.
    pub fn root_count(&self) -> u8 {
        self.roots
    }

    /// All buses, by index.
    pub fn entries(&self) -> &[BusEntry] {
        &self.buses
    }

    /// Bus index `index`.
    pub fn entry(&self, index: u8) -> Option<&BusEntry> {
        self.buses.get(usize::from(index))
    }

    /// The index of the bus the guest numbers `number`.
    pub fn index_of(&self, number: u8) -> Option<u8> {
        self.buses
            .iter()
            .position(|b| b.number == number)
            .map(|i| i as u8)
    }

    /// The guest's address of slot number `slot` (its bus's number); `None` past the buses.
    pub fn bdf_of(&self, slot: u8) -> Option<PciBdf> {
        let e = self.entry(crate::root::slot_bus(slot))?;
        Some(PciBdf::new(e.number, crate::root::slot_device(slot), 0))
    }

    /// The switches: `(bus index, entry)`.
    pub fn switches(&self) -> impl Iterator<Item = (u8, &BusEntry)> {
        self.buses
            .iter()
            .enumerate()
            .skip(usize::from(self.roots))
            .map(|(i, e)| (i as u8, e))
    }

    /// The switches of root bus `root`: `(bus index, entry)`.
    pub fn switches_of(&self, root: u8) -> impl Iterator<Item = (u8, &BusEntry)> {
        self.switches()
            .filter(move |(_, e)| matches!(e.kind, BusKind::Switch { root: r, .. } if r == root))
    }

    /// The last bus number under root bus `root` (its own if it has no switches): the end
    /// of its `_CRS` bus range.
    pub fn last_number_under(&self, root: u8) -> u8 {
        let own = self.entry(root).map_or(root, |e| e.number);
        self.switches_of(root)
            .map(|(_, e)| e.number)
            .max()
            .unwrap_or(own)
    }

    /// The last bus number of all (MCFG's end).
    pub fn last_number(&self) -> u8 {
        self.buses.iter().map(|b| b.number).max().unwrap_or(0)
    }

    /// The slot number whose INTx the guest routes a function in `slot` through: its own on
    /// a root bus; on a switch, its bridge's slot (the guest swizzles behind a bridge, and
    /// the root bus's `_PRT` gives every pin of a slot the same GSI).
    pub fn intx_slot(&self, slot: u8) -> u8 {
        match self.entry(crate::root::slot_bus(slot)).map(|e| e.kind) {
            Some(BusKind::Switch { bridge_slot, .. }) => bridge_slot,
            _ => slot,
        }
    }

    /// The root bus a slot number is under (its own bus, or its switch's root).
    pub fn root_of(&self, slot: u8) -> u8 {
        let bus = crate::root::slot_bus(slot);
        match self.entry(bus).map(|e| e.kind) {
            Some(BusKind::Switch { root, .. }) => root,
            _ => bus,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sw(root: u8, ports: u8) -> SwitchSpec {
        SwitchSpec { root, ports }
    }

    #[test]
    fn switches_take_the_numbers_after_their_root_and_its_lowest_slots() {
        let l = BusLayout::new(2, &[sw(0, 4), sw(1, 3), sw(0, 2)], 31).unwrap();
        let numbers: Vec<u8> = l.entries().iter().map(|e| e.number).collect();
        // Indexes: roots 0, 1; switches 2 (root 0), 3 (root 1), 4 (root 0).
        // Numbers: root 0 = 0, its switches 1 and 2, root 1 = 3, its switch 4.
        assert_eq!(numbers, vec![0, 3, 1, 4, 2]);
        assert_eq!(
            l.entry(2).unwrap().kind,
            BusKind::Switch {
                root: 0,
                bridge_slot: 1,
                ports: 4
            }
        );
        assert_eq!(
            l.entry(4).unwrap().kind,
            BusKind::Switch {
                root: 0,
                bridge_slot: 2,
                ports: 2
            }
        );
        assert_eq!(
            l.entry(3).unwrap().kind,
            BusKind::Switch {
                root: 1,
                bridge_slot: 33,
                ports: 3
            }
        );
        assert_eq!((l.last_number_under(0), l.last_number_under(1)), (2, 4));
        assert_eq!(l.last_number(), 4);
        assert_eq!(l.index_of(3), Some(1));
        assert_eq!(l.index_of(5), None);
        // Slot number 2*32+0: device 0 behind the first switch is 0000:01:00.0.
        assert_eq!(l.bdf_of(64).unwrap().to_string(), "0000:01:00.0");
        assert_eq!(l.bdf_of(33).unwrap().to_string(), "0000:03:01.0");
        assert_eq!((l.intx_slot(64 + 3), l.intx_slot(5)), (1, 5));
        assert_eq!((l.root_of(96), l.root_of(33)), (1, 1));
        assert_eq!(l.switches_of(0).count(), 2);
    }

    #[test]
    fn without_switches_index_and_number_agree() {
        let l = BusLayout::roots(3);
        assert_eq!(l, BusLayout::new(3, &[], 31).unwrap());
        assert!(l
            .entries()
            .iter()
            .enumerate()
            .all(|(i, e)| e.number == i as u8));
        assert_eq!(l.last_number(), 2);
        assert_eq!(l.switches().count(), 0);
    }

    #[test]
    fn layouts_that_cannot_be_made_are_refused_by_name() {
        let e = BusLayout::new(6, &[sw(0, 2), sw(1, 2), sw(2, 2)], 31).unwrap_err();
        assert_eq!(
            e.to_string(),
            "6 root bus(es) and 3 switch(es) make 9 buses: at most 8 fit (slot numbers are bus \
             * 32 + device in a byte)"
        );
        assert!(matches!(
            BusLayout::new(1, &[sw(1, 2)], 31),
            Err(TopologyError::NoSuchRoot { root: 1, roots: 1 })
        ));
        assert_eq!(
            BusLayout::new(1, &[sw(0, 33)], 31),
            Err(TopologyError::Ports(33))
        );
        assert_eq!(
            BusLayout::new(1, &[sw(0, 0)], 31),
            Err(TopologyError::Ports(0))
        );
        assert!(matches!(
            BusLayout::new(1, &[sw(0, 2), sw(0, 2)], 1),
            Err(TopologyError::NoSlotForBridge { .. })
        ));
    }
}
