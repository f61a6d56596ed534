//! Guest NUMA nodes (`--numa`): their parsing, the checks against the VM's vCPUs and RAM, and
//! their layout on guest physical memory for ACPI SRAT and SLIT.
//!
//! A node is `id=N[,cpus=A[-B]]...[,memory=SIZE][,distance=M:D]...`: its vCPUs, its share of
//! `--memory` and its distance to other nodes (SLIT's scale: 10 is a node to itself, 20 the
//! usual remote socket; one direction is enough, the matrix is symmetric). The nodes' RAM is
//! laid out in id order from guest physical address 0, across the 32-bit PCI hole, so node 0
//! holds low memory, as on real machines. A node may have no vCPUs (a memory-only node, the
//! shape of a GPU's or CXL memory), but every node has memory: Linux drops nodes without it.

use serde::{Deserialize, Serialize};

use crate::memory::RamRegion;

/// Smallest RAM of a node and its granule: Linux ignores nodes under 4 MiB
/// (`NODE_MIN_SIZE`), and 2 MiB keeps each node's memory in whole huge pages.
pub const NUMA_MIN_MEMORY: u64 = 4 << 20;
const NUMA_MEMORY_ALIGN: u64 = 2 << 20;
/// Distance between two nodes when `distance=` does not say (SLIT's usual remote value).
pub const NUMA_DEFAULT_DISTANCE: u8 = 20;

/// Errors in `--numa` values and in how the nodes fit the VM.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NumaError {
    #[error(
        "invalid --numa '{0}': expected id=N[,cpus=A[-B]]...,memory=SIZE[,distance=M:D]... \
         (e.g. id=1,cpus=2-3,memory=2G,distance=0:20)"
    )]
    Syntax(String),
    #[error("invalid --numa '{spec}': {why}")]
    Value { spec: String, why: String },
    #[error("--numa: {0}")]
    Layout(String),
}

/// One `--numa` node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaNodeConfig {
    pub id: u32,
    /// Its vCPUs (indices, which are also their local APIC ids).
    #[serde(default)]
    pub cpus: Vec<u8>,
    /// Its share of guest RAM, in bytes.
    pub memory: u64,
    /// (other node, distance) as given; [`check`] makes the matrix whole.
    #[serde(default)]
    pub distances: Vec<(u32, u8)>,
}

/// Parses one `--numa` value.
pub fn parse(spec: &str) -> Result<NumaNodeConfig, NumaError> {
    let syntax = || NumaError::Syntax(spec.to_owned());
    let value = |why: String| NumaError::Value {
        spec: spec.to_owned(),
        why,
    };
    let (mut id, mut memory) = (None, None);
    let (mut cpus, mut distances) = (Vec::new(), Vec::new());
    for opt in spec.split(',') {
        let (key, v) = opt.split_once('=').ok_or_else(syntax)?;
        match key {
            "id" => id = Some(v.parse::<u32>().map_err(|_| syntax())?),
            "memory" => {
                memory = Some(crate::config::parse_size(v).map_err(|e| value(e.to_string()))?)
            }
            "cpus" => {
                let (a, b) = v.split_once('-').unwrap_or((v, v));
                let a: u8 = a.parse().map_err(|_| syntax())?;
                let b: u8 = b.parse().map_err(|_| syntax())?;
                if a > b {
                    return Err(value(format!("cpus={v}: the range runs backwards")));
                }
                cpus.extend(a..=b);
            }
            "distance" => {
                let (node, d) = v.split_once(':').ok_or_else(syntax)?;
                let node: u32 = node.parse().map_err(|_| syntax())?;
                let d: u8 = d.parse().map_err(|_| {
                    value(format!(
                        "distance={v}: a distance is a number from 11 to 254"
                    ))
                })?;
                distances.push((node, d));
            }
            _ => return Err(syntax()),
        }
    }
    let (Some(id), Some(memory)) = (id, memory) else {
        return Err(value("id= and memory= are both required".into()));
    };
    Ok(NumaNodeConfig {
        id,
        cpus,
        memory,
        distances,
    })
}

/// Checks that `nodes` describe this VM: ids 0..n each once, every vCPU of `cpus` in exactly
/// one node, the nodes' memory adding up to `memory_size`, distances to nodes that exist, and
/// returns the distance matrix (row per node, by id).
pub fn check(
    nodes: &[NumaNodeConfig],
    cpus: u8,
    memory_size: u64,
) -> Result<Vec<Vec<u8>>, NumaError> {
    let err = |s: String| Err(NumaError::Layout(s));
    let n = nodes.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    if n > acpi::MAX_NUMA_NODES {
        return err(format!("{n} nodes, at most {}", acpi::MAX_NUMA_NODES));
    }
    let mut by_id = vec![None; n];
    for node in nodes {
        match by_id.get_mut(node.id as usize) {
            None => {
                return err(format!(
                    "node ids run from 0 to {} ({n} nodes): id {} is out of that range",
                    n.saturating_sub(1),
                    node.id
                ))
            }
            Some(Some(_)) => return err(format!("node {} is given twice", node.id)),
            Some(slot) => *slot = Some(node),
        }
    }
    let mut owner = vec![None; usize::from(cpus)];
    let mut total = 0u64;
    for node in nodes {
        for &cpu in &node.cpus {
            match owner.get_mut(usize::from(cpu)) {
                None => {
                    return err(format!(
                        "node {}: vCPU {cpu} does not exist (--cpus {cpus})",
                        node.id
                    ))
                }
                Some(Some(other)) => {
                    return err(format!(
                        "vCPU {cpu} is in node {other} and node {}",
                        node.id
                    ))
                }
                Some(slot) => *slot = Some(node.id),
            }
        }
        if node.memory < NUMA_MIN_MEMORY || !node.memory.is_multiple_of(NUMA_MEMORY_ALIGN) {
            return err(format!(
                "node {}: memory {} must be a multiple of 2M, at least 4M",
                node.id,
                pci::device::human(node.memory)
            ));
        }
        total = total.saturating_add(node.memory);
    }
    if let Some(cpu) = owner.iter().position(Option::is_none) {
        return err(format!(
            "vCPU {cpu} is in no node (with --numa, every vCPU of --cpus {cpus} is in one)"
        ));
    }
    if total != memory_size {
        return err(format!(
            "the nodes' memory adds up to {}, --memory is {}",
            pci::device::human(total),
            pci::device::human(memory_size)
        ));
    }
    let mut matrix = vec![vec![NUMA_DEFAULT_DISTANCE; n]; n];
    let mut given = vec![vec![false; n]; n];
    for (i, row) in matrix.iter_mut().enumerate() {
        row[i] = acpi::NUMA_LOCAL_DISTANCE;
    }
    for node in nodes {
        let a = node.id as usize;
        for &(other, d) in &node.distances {
            let b = other as usize;
            if b >= n {
                return err(format!(
                    "node {}: distance to node {other}, which does not exist",
                    node.id
                ));
            }
            if a == b {
                return err(format!(
                    "node {}: a node's distance to itself is always {}",
                    node.id,
                    acpi::NUMA_LOCAL_DISTANCE
                ));
            }
            if !(acpi::NUMA_LOCAL_DISTANCE + 1..=acpi::NUMA_MAX_DISTANCE).contains(&d) {
                return err(format!(
                    "node {}: distance {d} to node {other}: a distance between two nodes is \
                     from {} to {}",
                    node.id,
                    acpi::NUMA_LOCAL_DISTANCE + 1,
                    acpi::NUMA_MAX_DISTANCE
                ));
            }
            if given[a][b] && matrix[a][b] != d {
                return err(format!(
                    "nodes {a} and {b}: two distances given ({} and {d}); the matrix is \
                     symmetric",
                    matrix[a][b]
                ));
            }
            matrix[a][b] = d;
            matrix[b][a] = d;
            given[a][b] = true;
            given[b][a] = true;
        }
    }
    Ok(matrix)
}

/// The nodes as ACPI describes them: their vCPUs, their RAM laid out in id order over
/// `regions` (guest RAM, in address order), and their distances. `nodes` passed [`check`]
/// against these regions' total.
pub fn layout(
    nodes: &[NumaNodeConfig],
    regions: &[RamRegion],
    distances: &[Vec<u8>],
) -> Vec<acpi::NumaNode> {
    let mut sorted: Vec<&NumaNodeConfig> = nodes.iter().collect();
    sorted.sort_by_key(|n| n.id);
    let mut ranges = regions.iter().map(|r| (r.gpa, r.size));
    let mut current = ranges.next();
    sorted
        .iter()
        .zip(distances)
        .map(|(node, row)| {
            let mut memory = Vec::new();
            let mut left = node.memory;
            while left > 0 {
                let Some((gpa, size)) = current else { break };
                let take = left.min(size);
                memory.push((gpa, take));
                left -= take;
                current = if take == size {
                    ranges.next()
                } else {
                    Some((gpa + take, size - take))
                };
            }
            acpi::NumaNode {
                cpus: node.cpus.iter().map(|&c| u32::from(c)).collect(),
                memory,
                distances: row.clone(),
            }
        })
        .collect()
}

/// The nodes as `vm.info` reports them, in id order: vCPUs, memory and the whole distance
/// row. Empty with no nodes, or when they do not describe this VM (lendvm refuses to start
/// then, so a running VM's always do).
pub fn info(nodes: &[NumaNodeConfig], cpus: u8, memory_size: u64) -> Vec<api::types::NumaNodeInfo> {
    let Ok(distances) = check(nodes, cpus, memory_size) else {
        return Vec::new();
    };
    let mut sorted: Vec<&NumaNodeConfig> = nodes.iter().collect();
    sorted.sort_by_key(|n| n.id);
    sorted
        .iter()
        .zip(distances)
        .map(|(node, row)| api::types::NumaNodeInfo {
            id: node.id,
            cpus: node.cpus.iter().map(|&c| u32::from(c)).collect(),
            memory_size: node.memory,
            distances: row.into_iter().map(u32::from).collect(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::ram_regions;

    const G: u64 = 1 << 30;

    fn nodes(specs: &[&str]) -> Vec<NumaNodeConfig> {
        specs.iter().map(|s| parse(s).unwrap()).collect()
    }

    #[test]
    fn info_reports_whole_distance_rows_in_id_order() {
        let n = nodes(&[
            "id=1,cpus=1,memory=1G",
            "id=0,cpus=0,memory=1G,distance=1:31",
        ]);
        let info = info(&n, 2, 2 * G);
        assert_eq!(info.len(), 2);
        assert_eq!(
            (info[0].id, info[0].cpus.clone(), info[0].memory_size),
            (0, vec![0], G)
        );
        assert_eq!(info[0].distances, vec![10, 31]);
        assert_eq!(info[1].distances, vec![31, 10]);
        assert!(super::info(&n, 3, 2 * G).is_empty(), "not this VM's nodes");
    }

    #[test]
    fn parses_nodes() {
        assert_eq!(
            parse("id=1,cpus=2-3,cpus=5,memory=2G,distance=0:21").unwrap(),
            NumaNodeConfig {
                id: 1,
                cpus: vec![2, 3, 5],
                memory: 2 * G,
                distances: vec![(0, 21)],
            }
        );
        let memory_only = parse("id=2,memory=512M").unwrap();
        assert!(memory_only.cpus.is_empty());
        for bad in [
            "",
            "id=0",
            "memory=1G",
            "id=x,memory=1G",
            "id=0,memory=1G,cpus=a",
            "id=0,memory=1G,cpus=0-",
            "id=0,memory=1G,distance=1",
            "id=0,memory=1G,node=1",
            "id=0,memory=1G,",
            "id=0,memory=1G,distance=1:300",
            "id=0,memory=1G,cpus=3-1",
            "id=0,memory=lots",
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("invalid --numa '{bad}'")),
                "{bad}: {e}"
            );
        }
        assert!(parse("id=0,memory=1G,cpus=3-1")
            .unwrap_err()
            .to_string()
            .contains("runs backwards"));
    }

    #[test]
    fn nodes_that_do_not_describe_the_vm_are_refused_naming_why() {
        let ok = nodes(&[
            "id=0,cpus=0,memory=512M",
            "id=1,cpus=1,memory=512M,distance=0:31",
        ]);
        let m = check(&ok, 2, G).unwrap();
        assert_eq!(m, vec![vec![10, 31], vec![31, 10]]);
        assert!(check(&[], 2, G).unwrap().is_empty(), "no --numa: no nodes");
        let cases: &[(&[&str], u8, u64, &str)] = &[
            (
                &["id=0,cpus=0-1,memory=512M", "id=2,memory=512M"],
                2,
                G,
                "id 2 is out of that range",
            ),
            (
                &["id=0,cpus=0-1,memory=512M", "id=0,memory=512M"],
                2,
                G,
                "node 0 is given twice",
            ),
            (
                &["id=0,cpus=0-2,memory=1G"],
                2,
                G,
                "vCPU 2 does not exist (--cpus 2)",
            ),
            (
                &["id=0,cpus=0-1,memory=512M", "id=1,cpus=1,memory=512M"],
                2,
                G,
                "vCPU 1 is in node 0 and node 1",
            ),
            (&["id=0,cpus=0,memory=1G"], 2, G, "vCPU 1 is in no node"),
            (
                &["id=0,cpus=0-1,memory=512M", "id=1,memory=256M"],
                2,
                G,
                "adds up to 768 MiB, --memory is 1 GiB",
            ),
            (
                &["id=0,cpus=0-1,memory=1022M", "id=1,memory=2M"],
                2,
                G,
                "node 1: memory 2 MiB must be a multiple of 2M, at least 4M",
            ),
            (
                &[
                    "id=0,cpus=0-1,memory=512M,distance=2:20",
                    "id=1,memory=512M",
                ],
                2,
                G,
                "distance to node 2, which does not exist",
            ),
            (
                &[
                    "id=0,cpus=0-1,memory=512M,distance=0:20",
                    "id=1,memory=512M",
                ],
                2,
                G,
                "distance to itself is always 10",
            ),
            (
                &[
                    "id=0,cpus=0-1,memory=512M,distance=1:10",
                    "id=1,memory=512M",
                ],
                2,
                G,
                "from 11 to 254",
            ),
            (
                &[
                    "id=0,cpus=0-1,memory=512M,distance=1:20",
                    "id=1,memory=512M,distance=0:30",
                ],
                2,
                G,
                "two distances given (20 and 30)",
            ),
        ];
        for (specs, cpus, mem, want) in cases {
            let e = check(&nodes(specs), *cpus, *mem).unwrap_err().to_string();
            assert!(
                e.starts_with("--numa: ") && e.contains(want),
                "{specs:?}: {e}"
            );
        }
    }

    #[test]
    fn node_memory_is_laid_out_in_id_order_across_the_pci_hole() {
        // 4 GiB of RAM: 3 GiB below the 32-bit hole, 1 GiB from 4 GiB.
        let regions = ram_regions(4 * G);
        let cfg = nodes(&[
            "id=1,cpus=1,memory=2G,distance=0:21",
            "id=0,cpus=0,memory=2G",
        ]);
        let matrix = check(&cfg, 2, 4 * G).unwrap();
        let acpi = layout(&cfg, &regions, &matrix);
        assert_eq!(acpi.len(), 2);
        assert_eq!(acpi[0].cpus, [0]);
        assert_eq!(acpi[0].memory, [(0, 2 * G)]);
        assert_eq!(acpi[1].cpus, [1]);
        assert_eq!(acpi[1].memory, [(2 * G, G), (4 * G, G)]);
        assert_eq!(acpi[1].distances, [21, 10]);
        // What ACPI builds from it is a valid table set.
        acpi::create_acpi_tables(&acpi::AcpiConfig {
            num_vcpus: 2,
            numa: acpi,
            ..Default::default()
        })
        .unwrap();
    }
}
