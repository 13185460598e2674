//! The plan layer: before any weight byte is read, decide which weight groups stay resident on
//! the device and which stream every step, lay out the activation arena and the weight pool, and
//! predict every byte of host and device memory the run will use. One function does both: the
//! residency is chosen by laying out each candidate ([`layout::Layout::new`]), so the plan's
//! figures are the layout's, and the executor allocates exactly what the plan printed. An
//! impossible budget is refused with the smallest budget that would work.
//!
//! Owns: budgets, [`MemoryPlan`], the [`layout::Layout`] of arena and pool.
//! May import: `backend` (its address types and capabilities), `graph`, `stream`, `io`, `format`,
//! `error`.

pub mod budget;
pub mod layout;
mod planner;

pub use planner::{min_device_bytes, plan_graph, resident_device_bytes, spread_order, Planner};

use crate::backend::{Backend, OpShapes};
use crate::error::{Error, Result};
use crate::format::bnb::{Bnb4bitKeys, QuantStateJson, QuantizationConfig};
use crate::format::dtype::{dtype_name, Dtype};
use crate::format::safetensors::TensorEntry;
pub use crate::format::size::{fmt_bytes, parse_size};
use crate::graph::{ElemType, Graph, Source};
use crate::io::model::ModelIndex;
use layout::{Layout, LayoutInput, Q4Scratch};

pub use crate::stream::ring::MIN_SLOT_BYTES;

/// What the user allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budgets {
    /// Device memory for the weight pool and the activation arena (resident weights, the two
    /// stream slots, activations, KV cache).
    pub device_bytes: u64,
    /// Staging ring slots.
    pub ring_slots: u64,
    /// Bytes per ring slot (a larger tensor streams through in chunks).
    pub slot_bytes: u64,
    /// Host memory for the host tier: groups the device budget does not hold, kept in RAM after
    /// their first read so that later steps upload them without reading the source (0: none).
    /// A backend whose device memory is host memory gets none (its device budget is that
    /// memory already).
    pub host_tier_bytes: u64,
}

/// Where a group lives during the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Uploaded once, kept on the device.
    Resident,
    /// Read through the ring every step.
    Streamed,
    /// The host tier: read from the source once, kept in host memory, uploaded through the ring
    /// every step without reading the source again.
    Host,
}

/// One weight group (usually one layer's weights) in the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupPlan {
    /// Name for messages, e.g. `model.layers.3`.
    pub name: String,
    /// Bytes read from the source when it loads (every component of its 4-bit weights, its
    /// dense tensors; a tensor a resident group already holds is not read again).
    pub bytes: u64,
    /// Where it lives.
    pub placement: Placement,
    /// Resident in every plan whatever the budget (a LoRA adapter's tensors).
    pub pinned: bool,
}

/// What a backend's layout must respect, and what it can do with host memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rules {
    /// Every arena slice starts at a multiple of this many 4-byte words.
    pub arena_align_words: usize,
    /// Every pool region starts at a multiple of this many bytes.
    pub pool_align_bytes: u64,
    /// The backend reads bf16 dense weights as stored and reads streamed weights in place from
    /// ring slots (the host-memory capability, [`crate::backend::HostMemory`]).
    pub host_memory: bool,
    /// Host bytes of the backend's kernel workspace for the graph ([`Backend::workspace`]).
    pub workspace_bytes: u64,
    /// Device bytes of the backend's kernel workspace for the graph, allocated with the arena
    /// and the pool.
    pub device_workspace_bytes: u64,
    /// The first op the backend does not run with its operands' shapes
    /// ([`Backend::supports`]), said as the planner's error.
    pub unsupported: Option<String>,
    /// The device's memory is RAM ([`crate::backend::DeviceInfo::memory_is_host`]).
    pub device_in_ram: bool,
}

/// The first op of `ops` that `backend` does not run, with why.
fn unsupported<B: Backend + ?Sized>(backend: &B, ops: &[OpShapes<'_>]) -> Option<String> {
    ops.iter().find_map(|o| {
        backend.supports(o).err().map(|why| {
            format!(
                "{} with inputs {:?} does not run on {}: {why}",
                o.op.name(),
                o.inputs.iter().map(|i| &i.shape).collect::<Vec<_>>(),
                backend.name()
            )
        })
    })
}

impl Rules {
    /// The rules of `backend` for `graph`.
    pub fn of<B: Backend + ?Sized>(backend: &mut B, graph: &Graph) -> Self {
        let info = backend.device_info();
        let owned = crate::backend::graph_ops(graph);
        let ops = crate::backend::op_shapes(&owned);
        let ws = backend.workspace(&ops);
        Rules {
            arena_align_words: info.alignment.arena_words.max(1),
            pool_align_bytes: info.alignment.pool_bytes.max(4),
            host_memory: backend.host_memory().is_some(),
            workspace_bytes: ws.host_bytes,
            device_workspace_bytes: ws.device_bytes,
            unsupported: unsupported(backend, &ops),
            device_in_ram: info.memory_is_host(),
        }
    }
}

/// The plan.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    /// The groups, in declaration (schedule) order.
    pub groups: Vec<GroupPlan>,
    /// The budgets it was made for.
    pub budgets: Budgets,
    /// Device bytes of the weight pool: resident 4-bit weights and the two stream slots.
    pub pool_bytes: u64,
    /// Device bytes of the activation arena, resident dense weights and state included.
    pub arena_bytes: u64,
    /// Of the arena: persistent state (KV cache).
    pub state_bytes: u64,
    /// Of the arena: resident dense weights (f32, or bf16 where the backend reads bf16).
    pub resident_dense_bytes: u64,
    /// Ring bytes (slots x slot size).
    pub ring_bytes: u64,
    /// Host buffers of the loader besides the ring: the loading group's small quant-state
    /// tensors, one decoded absmax, and on a device backend the pieces dense weights are
    /// widened in ([`DENSE_PIECE_HOST_BYTES`]).
    pub loader_bytes: u64,
    /// Reads kept in flight ahead of the consumer (one per ring slot).
    pub prefetch_depth: u64,
    /// Bytes uploaded through the ring per step: the streamed and host-tier groups.
    pub streamed_bytes_per_step: u64,
    /// Of those, the bytes read from the source per step after the first (the streamed groups;
    /// the host tier's come from host memory).
    pub source_bytes_per_step: u64,
    /// Host memory holding the host tier's groups (their bytes, read once).
    pub host_tier_bytes: u64,
    /// Of those, the most that kernels read in place from the ring slots instead of copying
    /// them (packed weights no larger than a slot, on a backend that reads host memory: the
    /// optimized CPU backend); a slot is lent only while another stays free, so a run may read
    /// fewer.
    pub in_place_bytes_per_step: u64,
    /// Peak device bytes: pool + arena, allocated once.
    pub peak_device_bytes: u64,
    /// Host bytes of the backend's kernel workspace ([`Backend::workspace`]).
    pub workspace_bytes: u64,
    /// Device bytes of the backend's kernel workspace (in `peak_device_bytes`).
    pub device_workspace_bytes: u64,
    /// Peak host bytes the plan adds: ring + loader buffers + kernel workspace + host tier.
    pub peak_host_bytes: u64,
    /// Host and device are the same memory (the CPU backends): the host tier is merged into the
    /// device budget.
    pub shared_memory: bool,
    /// The device memory is host RAM: on the CPU backends, and on a device whose memory is RAM
    /// (a CPU renderer such as lavapipe, an integrated GPU: they keep their own buffers, so
    /// the tiers stay apart): its bytes count in the predicted RSS and against the host budget.
    pub device_in_host_memory: bool,
}

/// One tier of a plan: where its groups' bytes come from each step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tier {
    /// `device`, `host` or `source`.
    pub name: &'static str,
    /// Its groups, by name, in schedule order.
    pub groups: Vec<String>,
    /// Their bytes.
    pub bytes: u64,
    /// The largest group's bytes (0 for none): the streamed tiers' groups pass through the
    /// ring, which holds one of them at best.
    pub largest_group_bytes: u64,
    /// Bytes moved from it per step after the first: 0 on the device, uploaded from host
    /// memory for the host tier, read from the source for the streamed groups.
    pub bytes_per_step: u64,
}

/// Group names as ranges: `model.layers.0-11` for a run of numbered siblings, and
/// `model.layers.{0-3,5,7-11}` for siblings with gaps (the groups another tier holds).
pub fn name_ranges(names: &[String]) -> String {
    let split = |n: &str| -> Option<(String, u64)> {
        let (head, num) = n.rsplit_once('.')?;
        Some((head.to_string(), num.parse().ok()?))
    };
    // Per run of names with one head: its numbers as ranges.
    let mut out: Vec<String> = Vec::new();
    let mut run: Option<(String, Vec<(u64, u64)>)> = None;
    let flush = |run: &mut Option<(String, Vec<(u64, u64)>)>, out: &mut Vec<String>| {
        if let Some((h, ranges)) = run.take() {
            let r: Vec<String> = ranges
                .iter()
                .map(|&(a, b)| {
                    if a == b {
                        format!("{a}")
                    } else {
                        format!("{a}-{b}")
                    }
                })
                .collect();
            out.push(if r.len() == 1 {
                format!("{h}.{}", r[0])
            } else {
                format!("{h}.{{{}}}", r.join(","))
            });
        }
    };
    for n in names {
        match (split(n), run.as_mut()) {
            (Some((h, k)), Some((rh, ranges))) if *rh == h => match ranges.last_mut() {
                Some((_, b)) if k == *b + 1 => *b = k,
                _ => ranges.push((k, k)),
            },
            (Some((h, k)), _) => {
                flush(&mut run, &mut out);
                run = Some((h, vec![(k, k)]));
            }
            (None, _) => {
                flush(&mut run, &mut out);
                out.push(n.clone());
            }
        }
    }
    flush(&mut run, &mut out);
    out.join(", ")
}

impl MemoryPlan {
    /// Number of groups (resident, streamed through the ring: from the source or the host
    /// tier).
    pub fn counts(&self) -> (usize, usize) {
        let c = |p| self.groups.iter().filter(|g| g.placement == p).count();
        (
            c(Placement::Resident),
            c(Placement::Streamed) + c(Placement::Host),
        )
    }

    /// The three tiers: on the device, in host memory, streamed from the source.
    pub fn tiers(&self) -> Vec<Tier> {
        let tier = |name, p: Placement, per_step: bool| {
            let groups: Vec<&GroupPlan> = self.groups.iter().filter(|g| g.placement == p).collect();
            let bytes = groups.iter().map(|g| g.bytes).sum();
            Tier {
                name,
                groups: groups.iter().map(|g| g.name.clone()).collect(),
                bytes,
                largest_group_bytes: groups.iter().map(|g| g.bytes).max().unwrap_or(0),
                bytes_per_step: if per_step { bytes } else { 0 },
            }
        };
        vec![
            tier("device", Placement::Resident, false),
            tier("host", Placement::Host, true),
            tier("source", Placement::Streamed, true),
        ]
    }

    /// Host memory the plan adds to the process: its host bytes, and its device bytes where
    /// the device memory is host RAM.
    pub fn host_bytes_with_device(&self) -> u64 {
        self.peak_host_bytes
            + if self.device_in_host_memory {
                self.peak_device_bytes
            } else {
                0
            }
    }

    /// Bytes read once, before the first step: the resident groups.
    pub fn resident_read_bytes(&self) -> u64 {
        self.groups
            .iter()
            .filter(|g| g.placement == Placement::Resident)
            .map(|g| g.bytes)
            .sum()
    }

    /// Bytes a run of `passes` steps (or decoded tokens) reads from the source: the resident
    /// and host-tier groups once, the streamed ones every pass.
    pub fn read_bytes(&self, passes: u64) -> u64 {
        if passes == 0 {
            return self.resident_read_bytes();
        }
        self.resident_read_bytes() + self.host_tier_bytes + self.source_bytes_per_step * passes
    }

    /// The plan as every JSON report gives it, in one shape (`nibble run --json`, `nibble plan
    /// --json`, the API server's `/v1/plan`, the browser): the tiers, the bytes per step from
    /// each, the ring, the peaks, and the printout (`text`).
    pub fn to_json(&self) -> serde_json::Value {
        let (resident, streamed) = self.counts();
        serde_json::json!({
            "resident_groups": resident,
            "streamed_groups": streamed,
            "tiers": self.tiers().iter().map(|t| serde_json::json!({
                "name": t.name, "groups": t.groups, "bytes": t.bytes,
                "largest_group_bytes": t.largest_group_bytes,
                "bytes_per_step": t.bytes_per_step,
            })).collect::<Vec<_>>(),
            "ring": {
                "slots": self.budgets.ring_slots,
                "slot_bytes": self.budgets.slot_bytes,
                "bytes": self.ring_bytes,
            },
            "ring_bytes": self.ring_bytes,
            "pool_bytes": self.pool_bytes,
            "resident_bytes": self.resident_read_bytes(),
            "device_budget": self.budgets.device_bytes,
            "host_tier_budget": self.budgets.host_tier_bytes,
            "source_bytes_per_step": self.source_bytes_per_step,
            "host_tier_bytes": self.host_tier_bytes,
            "streamed_bytes_per_step": self.streamed_bytes_per_step,
            "peak_device_bytes": self.peak_device_bytes,
            "peak_host_bytes": self.peak_host_bytes,
            "device_workspace_bytes": self.device_workspace_bytes,
            "device_bytes": self.peak_device_bytes,
            "shared_memory": self.shared_memory,
            "device_in_host_memory": self.device_in_host_memory,
            "text": self.explain(),
        })
    }

    /// [`MemoryPlan::to_json`] with the phase it plans (`"phase"`): a pipeline's plans, as
    /// `nibble run --json`, `nibble demo --json` and the browser give them.
    pub fn phase_json(&self, phase: &str) -> serde_json::Value {
        let mut v = self.to_json();
        v["phase"] = serde_json::json!(phase);
        v
    }

    /// The text printed before a run.
    pub fn explain(&self) -> String {
        let (r, s) = self.counts();
        let total: u64 = self.groups.iter().map(|g| g.bytes).sum();
        let b = &self.budgets;
        let mut t = format!(
            "memory plan: {} weight groups, {} of weights\n",
            self.groups.len(),
            fmt_bytes(total)
        );
        t.push_str(&format!(
            "  device  budget {:>10}  allocated {:>10} = weight pool {} ({r} groups resident, {s} \
             streamed through 2 slots) + arena {} (activations {}, resident dense weights {}, KV \
             cache {})\n",
            fmt_bytes(b.device_bytes),
            fmt_bytes(self.peak_device_bytes),
            fmt_bytes(self.pool_bytes),
            fmt_bytes(self.arena_bytes),
            fmt_bytes(self.arena_bytes - self.state_bytes - self.resident_dense_bytes),
            fmt_bytes(self.resident_dense_bytes),
            fmt_bytes(self.state_bytes)
        ));
        if self.device_workspace_bytes > 0 {
            t.push_str(&format!(
                "          + kernel workspace {} (allocated with the arena)\n",
                fmt_bytes(self.device_workspace_bytes)
            ));
        }
        t.push_str(&format!(
            "  host    ring {} x {} = {}, loader buffers {}, kernel workspace {}, host tier {}: peak \
             {}\n",
            b.ring_slots,
            fmt_bytes(b.slot_bytes),
            fmt_bytes(self.ring_bytes),
            fmt_bytes(self.loader_bytes),
            fmt_bytes(self.workspace_bytes),
            fmt_bytes(self.host_tier_bytes),
            fmt_bytes(self.peak_host_bytes)
        ));
        let copied = if self.in_place_bytes_per_step > 0 {
            format!(
                "up to {} of it read in place from the ring and the rest copied into the weight pool",
                fmt_bytes(self.in_place_bytes_per_step)
            )
        } else {
            format!(
                "{} uploaded per step",
                fmt_bytes(self.streamed_bytes_per_step)
            )
        };
        let read = if self.host_tier_bytes > 0 {
            format!(
                "{} per step through the ring ({} read from the source, {} from the host tier)",
                fmt_bytes(self.streamed_bytes_per_step),
                fmt_bytes(self.source_bytes_per_step),
                fmt_bytes(self.host_tier_bytes)
            )
        } else {
            format!("{} read per step", fmt_bytes(self.streamed_bytes_per_step))
        };
        t.push_str(&format!(
            "  stream  {s} groups, {read}, {copied}, prefetch depth {}\n",
            self.prefetch_depth
        ));
        for g in self.groups.iter().filter(|g| g.pinned) {
            t.push_str(&format!(
                "  pinned  {}: {} resident in every plan\n",
                g.name,
                fmt_bytes(g.bytes)
            ));
        }
        let b = &self.budgets;
        for tier in self.tiers() {
            if tier.groups.is_empty() {
                continue;
            }
            let why = match tier.name {
                "device" => format!(
                    "on the device: {} of the {} budget",
                    fmt_bytes(tier.bytes),
                    fmt_bytes(b.device_bytes)
                ),
                "host" => format!(
                    "in host memory: {} of the {} host tier, uploaded every step",
                    fmt_bytes(tier.bytes),
                    fmt_bytes(b.host_tier_bytes)
                ),
                _ => format!(
                    "streamed from the source: {} per step",
                    fmt_bytes(tier.bytes)
                ),
            };
            t.push_str(&format!("  tier    {} {why}\n", name_ranges(&tier.groups)));
        }
        if self.shared_memory && b.host_tier_bytes > 0 {
            t.push_str(
                "  tier    host and device are the same memory on this backend: no host tier, \
                 the device budget holds what RAM can\n",
            );
        }
        t
    }
}

/// A dense weight goes to a backend without host memory this many 4-byte words at a time.
pub const DENSE_PIECE_WORDS: usize = 1 << 18;
/// The host bytes that takes at most: the widened floats, their words, and the backend's copy
/// of them for its upload (wgpu's bytes; the upload staging itself is the kernel workspace).
pub const DENSE_PIECE_HOST_BYTES: u64 = 3 * 4 * DENSE_PIECE_WORDS as u64;

#[cfg(test)]
mod tests {
    use super::{name_ranges, spread_order};

    #[test]
    fn spread_order_is_a_permutation_whose_prefixes_cover_the_range_evenly() {
        for n in [0usize, 1, 2, 3, 7, 30, 64, 100, 314] {
            let o = spread_order(n);
            let mut sorted = o.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "n = {n}");
            // The first k are spread: no run of indices outside them (or inside them) is longer
            // than twice the even spacing, plus one.
            for k in 1..n {
                let mut inside = vec![false; n];
                for &i in &o[..k] {
                    inside[i] = true;
                }
                let longest = |want: bool| {
                    inside
                        .split(|&x| x != want)
                        .map(|r| r.len())
                        .max()
                        .unwrap_or(0)
                };
                assert!(
                    longest(false) <= 2 * n / k + 1 && longest(true) <= 2 * n / (n - k) + 1,
                    "n = {n}, the first {k}: runs of {} outside, {} inside",
                    longest(false),
                    longest(true)
                );
            }
        }
    }

    #[test]
    fn name_ranges_merge_numbered_siblings_with_and_without_gaps() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            name_ranges(&names(&[
                "embed", "layers.0", "layers.1", "layers.2", "head"
            ])),
            "embed, layers.0-2, head"
        );
        assert_eq!(
            name_ranges(&names(&[
                "layers.0", "layers.2", "layers.3", "layers.7", "norm"
            ])),
            "layers.{0,2-3,7}, norm"
        );
        assert_eq!(name_ranges(&names(&["a.1", "b.2", "b.3"])), "a.1, b.2-3");
        assert_eq!(name_ranges(&[]), "");
    }
}
