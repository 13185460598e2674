//! The executor: runs a [`Graph`] on a [`Backend`] with weights arriving through the streaming
//! pipeline. Before the first step it plans everything: which weight groups stay resident and
//! which stream (the [`MemoryPlan`]), where every activation lives in the arena (sized once from
//! the graph's lifetimes), where every weight lives in the pool (resident regions plus two
//! alternating stream slots). During a step it asks for weight group g just before the first op
//! that uses it and lets the next group two later reuse its pool slot once its ops have run.

use std::collections::HashMap;

use crate::backend::{host_words, ArenaSlice, Backend, Operand, PoolRegion, Q4View};
use crate::bnb::{find_4bit_weights, QuantState, QuantStateJson};
use crate::error::{Error, Result};
use crate::graph::{bf16_input_allowed, infer, ElemType, HostTensor, OpKind, Q4Info, ValueInfo};
use crate::index::{Dtype, ModelIndex, TensorEntry};
use crate::plan::{Allocation, Budgets, MemoryPlan, Placement, WeightGroup};
use crate::prefetch::{chunk_schedule, Chunk, ChunkSpec, Prefetcher, StepStats};
use crate::ring::{HostAllocator, StagingRing};
use crate::source::{ByteSource, ThreadedSource};

/// A value of the graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ValueId(pub usize);

/// A 4-bit weight of the graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WeightId(pub usize);

#[derive(Debug, Clone, PartialEq)]
enum Source {
    /// An input of program `.0`, written before each of its steps.
    Input(usize),
    Node,
    Dense {
        tensor: String,
        group: usize,
    },
    /// Persistent across steps and programs (a KV cache); zero at the start.
    State,
}

/// One op of the graph.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// What it does.
    pub op: OpKind,
    /// Its operands.
    pub inputs: Vec<ValueId>,
    /// Its 4-bit weight, for `LinearQ4` / `Dequant4`.
    pub weight: Option<WeightId>,
    /// Its result (for an in-place op, the state value it updates).
    pub output: ValueId,
}

#[derive(Debug, Clone, PartialEq)]
struct Q4Decl {
    tensor: String,
    group: usize,
    info: Q4Info,
}

/// One entry point of a graph: a run of nodes with its own inputs and outputs. Programs share
/// the weights and the state values, so that a language model's prefill (many tokens) and
/// decode (one token) run against one weight pool and one KV cache.
#[derive(Debug, Clone, PartialEq)]
struct Program {
    name: String,
    start: usize,
    end: usize,
    inputs: Vec<ValueId>,
    outputs: Vec<ValueId>,
}

/// A computation over activations and model weights, built op by op with shape checks.
#[derive(Debug, Clone)]
pub struct Graph {
    values: Vec<ValueInfo>,
    sources: Vec<Source>,
    /// Index of the node that defines each value (node outputs only).
    def_node: Vec<Option<usize>>,
    nodes: Vec<Node>,
    q4: Vec<Q4Decl>,
    groups: Vec<String>,
    programs: Vec<Program>,
}

impl Default for Graph {
    fn default() -> Self {
        Graph {
            values: Vec::new(),
            sources: Vec::new(),
            def_node: Vec::new(),
            nodes: Vec::new(),
            q4: Vec::new(),
            groups: Vec::new(),
            programs: vec![Program {
                name: "main".into(),
                start: 0,
                end: 0,
                inputs: Vec::new(),
                outputs: Vec::new(),
            }],
        }
    }
}

impl Graph {
    /// An empty graph with one program, "main".
    pub fn new() -> Self {
        Self::default()
    }

    /// The checkpoint tensors the graph reads: its dense weights and the base names of its
    /// 4-bit weights (whose components are `<base>.absmax`, `<base>.quant_state...`, ...).
    pub fn weight_names(&self) -> (Vec<&str>, Vec<&str>) {
        let dense = self
            .sources
            .iter()
            .filter_map(|s| match s {
                Source::Dense { tensor, .. } => Some(tensor.as_str()),
                _ => None,
            })
            .collect();
        (dense, self.q4.iter().map(|d| d.tensor.as_str()).collect())
    }

    /// Starts a new program (entry point); inputs, ops and outputs added from now on belong to
    /// it. Returns its index (the first program is 0). A graph whose first program has no nodes
    /// yet renames it instead.
    pub fn program(&mut self, name: &str) -> usize {
        let cur = self.programs.len() - 1;
        if self.programs[cur].start == self.nodes.len() && self.programs[cur].inputs.is_empty() {
            self.programs[cur].name = name.to_string();
            return cur;
        }
        self.programs.push(Program {
            name: name.to_string(),
            start: self.nodes.len(),
            end: self.nodes.len(),
            inputs: Vec::new(),
            outputs: Vec::new(),
        });
        self.programs.len() - 1
    }

    /// Number of programs.
    pub fn programs(&self) -> usize {
        self.programs.len()
    }

    /// Index of the program named `name`.
    pub fn program_index(&self, name: &str) -> Option<usize> {
        self.programs.iter().position(|p| p.name == name)
    }

    fn current(&self) -> usize {
        self.programs.len() - 1
    }

    /// Declares a weight group (e.g. one layer); weights are loaded a group at a time.
    pub fn group(&mut self, name: &str) -> usize {
        if let Some(i) = self.groups.iter().position(|g| g == name) {
            return i;
        }
        self.groups.push(name.to_string());
        self.groups.len() - 1
    }

    fn value(&mut self, info: ValueInfo, source: Source) -> ValueId {
        self.values.push(info);
        self.sources.push(source);
        self.def_node.push(None);
        ValueId(self.values.len() - 1)
    }

    /// An input of the current program, written by the caller before each step.
    pub fn input(&mut self, info: ValueInfo) -> ValueId {
        let p = self.current();
        let v = self.value(info, Source::Input(p));
        self.programs[p].inputs.push(v);
        v
    }

    /// A dense model tensor (F32/F16/BF16 on disk) as an f32 value of `shape`.
    pub fn dense_weight(&mut self, group: usize, tensor: &str, shape: &[usize]) -> ValueId {
        self.value(
            ValueInfo::f32(shape),
            Source::Dense {
                tensor: tensor.to_string(),
                group,
            },
        )
    }

    /// A value that persists across steps and programs (a KV cache), zero at the start and
    /// changed only by in-place ops such as [`OpKind::CacheWrite`].
    pub fn state(&mut self, info: ValueInfo) -> ValueId {
        self.value(info, Source::State)
    }

    /// A 4-bit model weight (`tensor` is its base name, e.g. `model.layers.0.mlp.up_proj.weight`).
    pub fn q4_weight(&mut self, group: usize, tensor: &str, info: Q4Info) -> WeightId {
        self.q4.push(Q4Decl {
            tensor: tensor.to_string(),
            group,
            info,
        });
        WeightId(self.q4.len() - 1)
    }

    /// Appends an op to the current program; its output's shape is checked and inferred now.
    /// An in-place op returns the state value it updates.
    pub fn op(
        &mut self,
        op: OpKind,
        inputs: &[ValueId],
        weight: Option<WeightId>,
    ) -> Result<ValueId> {
        let prog = self.current();
        let pstart = self.programs[prog].start;
        for v in inputs {
            let src = self
                .sources
                .get(v.0)
                .ok_or_else(|| Error::Invalid(format!("{}: unknown value {}", op.name(), v.0)))?;
            let ok = match src {
                Source::Input(p) => *p == prog,
                Source::Node => self.def_node[v.0].is_some_and(|n| n >= pstart),
                Source::Dense { .. } | Source::State => true,
            };
            if !ok {
                return Err(Error::Invalid(format!(
                    "{}: value {} belongs to another program than '{}'",
                    op.name(),
                    v.0,
                    self.programs[prog].name
                )));
            }
        }
        let infos: Vec<&ValueInfo> = inputs.iter().map(|v| &self.values[v.0]).collect();
        let q4 = weight
            .map(|w| {
                self.q4
                    .get(w.0)
                    .map(|d| &d.info)
                    .ok_or_else(|| Error::Invalid(format!("unknown weight {}", w.0)))
            })
            .transpose()?;
        let info = infer(&op, &infos, q4)?;
        let out = match op.in_place_input() {
            Some(i) => {
                let target = inputs[i];
                if self.sources[target.0] != Source::State || self.values[target.0] != info {
                    return Err(Error::Invalid(format!(
                        "{}: works in place on a state value of the output's shape",
                        op.name()
                    )));
                }
                target
            }
            None => {
                let v = self.value(info, Source::Node);
                self.def_node[v.0] = Some(self.nodes.len());
                v
            }
        };
        self.nodes.push(Node {
            op,
            inputs: inputs.to_vec(),
            weight,
            output: out,
        });
        self.programs[prog].end = self.nodes.len();
        Ok(out)
    }

    /// Marks a value as an output of the current program, read back after each step.
    pub fn output(&mut self, v: ValueId) {
        let p = self.current();
        self.programs[p].outputs.push(v);
    }

    /// Shape and type of a value.
    pub fn info(&self, v: ValueId) -> &ValueInfo {
        &self.values[v.0]
    }

    /// This graph as `backend` runs `model`, where that differs (`None`: as it is): on a backend
    /// that reads bf16 dense weights ([`Backend::dense_bf16`]), every dense weight that `model`
    /// stores as bf16 and that only ops reading bf16 take (the weight of `Linear`, the table of
    /// `Embedding`) becomes an [`ElemType::BF16`] value: half the device bytes and half the
    /// bytes read per use, the same results. The executor runs this; planners that size a
    /// budget for it ([`Graph::min_device_bytes`]) do too.
    pub fn for_backend<B: Backend + ?Sized>(
        &self,
        model: &ModelIndex,
        backend: &B,
    ) -> Option<Graph> {
        if !backend.dense_bf16() {
            return None;
        }
        let mut ok: Vec<bool> = self
            .sources
            .iter()
            .zip(&self.values)
            .map(|(s, info)| match s {
                Source::Dense { tensor, .. } => {
                    info.elem == ElemType::F32
                        && model.get(tensor).is_some_and(|e| e.dtype == Dtype::BF16)
                }
                _ => false,
            })
            .collect();
        for node in &self.nodes {
            for (i, v) in node.inputs.iter().enumerate() {
                if !bf16_input_allowed(&node.op, i) {
                    ok[v.0] = false;
                }
            }
        }
        for p in &self.programs {
            for v in &p.outputs {
                ok[v.0] = false;
            }
        }
        if !ok.contains(&true) {
            return None;
        }
        let mut g = self.clone();
        for (info, ok) in g.values.iter_mut().zip(ok) {
            if ok {
                info.elem = ElemType::BF16;
            }
        }
        Some(g)
    }

    /// Bytes of each weight group's tensors in `model` (every component of a 4-bit weight).
    pub fn group_bytes(&self, model: &ModelIndex) -> Result<Vec<u64>> {
        let keys = find_4bit_weights(model)?;
        let mut bytes = vec![0u64; self.groups.len()];
        for d in &self.q4 {
            let k =
                keys.iter()
                    .find(|k| k.base == d.tensor)
                    .ok_or_else(|| Error::NoSuchTensor {
                        file: model.root.clone(),
                        tensor: d.tensor.clone(),
                    })?;
            for name in k.all_keys() {
                bytes[d.group] += model.require(name)?.len;
            }
        }
        let mut seen = std::collections::HashSet::new();
        for s in &self.sources {
            if let Source::Dense { tensor, group } = s {
                if seen.insert((*group, tensor.clone())) {
                    bytes[*group] += model.require(tensor)?.len;
                }
            }
        }
        Ok(bytes)
    }

    /// Bytes every weight group takes on a device (4-bit codes + f32 absmax + code table, dense
    /// tensors as f32, or as bf16 in a graph from [`Graph::for_backend`]).
    pub fn group_device_bytes(&self) -> Vec<u64> {
        let mut bytes = vec![0u64; self.groups.len()];
        for d in &self.q4 {
            let n = d.info.shape.iter().product::<usize>() as u64;
            bytes[d.group] += n.div_ceil(2) + n.div_ceil(d.info.blocksize as u64) * 4 + 64;
        }
        for (vi, s) in self.sources.iter().enumerate() {
            if let Source::Dense { group, .. } = s {
                bytes[*group] += self.values[vi].words() as u64 * 4;
            }
        }
        bytes
    }

    /// Bytes of the persistent state values (KV cache).
    pub fn state_bytes(&self) -> u64 {
        (0..self.values.len())
            .filter(|&v| self.sources[v] == Source::State)
            .map(|v| self.values[v].words() as u64 * 4)
            .sum()
    }

    /// Device bytes of every value at once: an upper bound of the arena.
    pub fn activation_bytes(&self) -> u64 {
        self.values.iter().map(|v| v.words() as u64 * 4).sum()
    }

    /// Arena bytes for activations and state alone (dense weights left out), as laid out with
    /// word alignment `align_w`: what the planner charges besides weights.
    pub fn activation_arena_bytes(&self, align_w: usize) -> u64 {
        let all_resident = vec![true; self.groups.len()];
        let words = self.arena_layout(&all_resident, align_w).1 as u64;
        let owners = self.resident_dense_owners(&all_resident);
        let dense: u64 = owners
            .values()
            .map(|&v| self.values[v].words().div_ceil(align_w) as u64 * align_w as u64)
            .sum();
        (words.saturating_sub(dense)).max(1) * 4
    }

    /// The planner's view of the weight groups: bytes read per step (`stored`, from the model),
    /// device bytes when resident, pool-slot and arena bytes when streamed (pool regions aligned
    /// to `pa`).
    pub fn weight_groups(&self, stored: &[u64], pa: u64) -> Vec<WeightGroup> {
        let device = self.group_device_bytes();
        let dense = self.dense_device_bytes();
        // Dense tensors used by more than one group.
        let mut holders: HashMap<&str, Vec<(usize, u64)>> = HashMap::new();
        for (v, s) in self.sources.iter().enumerate() {
            if let Source::Dense { tensor, group } = s {
                holders
                    .entry(tensor.as_str())
                    .or_default()
                    .push((*group, self.values[v].words() as u64 * 4));
            }
        }
        (0..self.groups.len())
            .map(|g| {
                let align = 3 * pa * self.q4.iter().filter(|d| d.group == g).count() as u64;
                let mut shared = Vec::new();
                for h in holders.values().filter(|h| h.len() > 1) {
                    if let Some(&(_, bytes)) = h.iter().find(|(hg, _)| *hg == g) {
                        shared.extend(h.iter().filter(|(o, _)| *o != g).map(|(o, _)| (*o, bytes)));
                    }
                }
                WeightGroup {
                    name: self.groups[g].clone(),
                    bytes: stored.get(g).copied().unwrap_or(0),
                    device_bytes: device[g] + align,
                    slot_bytes: device[g] - dense[g] + align,
                    dense_bytes: dense[g],
                    shared,
                }
            })
            .collect()
    }

    /// The smallest device budget with which this graph runs `model` on `backend` (everything
    /// streamed), as the executor plans and lays it out.
    pub fn min_device_bytes<B: Backend + ?Sized>(&self, model: &ModelIndex, backend: &B) -> u64 {
        if let Some(g) = self.for_backend(model, backend) {
            return g.min_device_bytes(model, backend);
        }
        let n = self.groups.len();
        let align_w = backend.arena_align_words().max(1);
        let pa = backend.pool_align_bytes().max(4);
        let groups = self.weight_groups(&vec![0; n], pa);
        let all = vec![true; n];
        let planned =
            self.activation_arena_bytes(align_w) + crate::plan::stream_pool_bytes(&groups, &all);
        // The layout itself: the arena with every dense tensor transient, two pool slots.
        let arena = self.arena_layout(&vec![false; n], align_w).1.max(1) as u64 * 4;
        let mut slots = [0u64; 2];
        for (i, g) in groups.iter().filter(|g| g.slot_bytes > 0).enumerate() {
            slots[i % 2] = slots[i % 2].max(g.slot_bytes);
        }
        planned.max(arena + slots[0] + slots[1] + pa)
    }

    fn dense_device_bytes(&self) -> Vec<u64> {
        let mut bytes = vec![0u64; self.groups.len()];
        for (vi, s) in self.sources.iter().enumerate() {
            if let Source::Dense { group, .. } = s {
                bytes[*group] += self.values[vi].words() as u64 * 4;
            }
        }
        bytes
    }

    /// The ops.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    fn groups_of<'a>(&'a self, n: &'a Node) -> impl Iterator<Item = usize> + 'a {
        let w = n.weight.map(|w| self.q4[w.0].group);
        let d = n.inputs.iter().filter_map(|v| match &self.sources[v.0] {
            Source::Dense { group, .. } => Some(*group),
            _ => None,
        });
        w.into_iter().chain(d)
    }

    /// Per group: the first and last node of program `p` that use it.
    fn group_uses(&self, p: usize) -> Vec<Option<(usize, usize)>> {
        let mut uses: Vec<Option<(usize, usize)>> = vec![None; self.groups.len()];
        let pr = &self.programs[p];
        for ni in pr.start..pr.end {
            for g in self.groups_of(&self.nodes[ni]) {
                let u = uses[g].get_or_insert((ni, ni));
                u.1 = ni;
            }
        }
        uses
    }

    /// Live intervals of every value (inclusive node indices over all programs; a program's
    /// outputs live to its end, state and resident dense weights for the whole run).
    fn intervals(&self, resident_group: &[bool]) -> Vec<Vec<(usize, usize)>> {
        let n = self.nodes.len();
        let mut iv: Vec<Vec<(usize, usize)>> = vec![Vec::new(); self.values.len()];
        for (p, pr) in self.programs.iter().enumerate() {
            let uses = self.group_uses(p);
            // Per value: (first, last) within this program.
            let mut span: HashMap<usize, (usize, usize)> = HashMap::new();
            let mut touch = |v: usize, at: usize| {
                let e = span.entry(v).or_insert((at, at));
                e.0 = e.0.min(at);
                e.1 = e.1.max(at);
            };
            for &v in &pr.inputs {
                touch(v.0, pr.start);
            }
            for ni in pr.start..pr.end {
                let node = &self.nodes[ni];
                touch(node.output.0, ni);
                for v in &node.inputs {
                    touch(v.0, ni);
                }
            }
            for &v in &pr.outputs {
                touch(v.0, pr.end);
            }
            // Streamed dense weights are written when their group loads, whether or not this
            // program reads them.
            for (vi, s) in self.sources.iter().enumerate() {
                if let Source::Dense { group, .. } = s {
                    if let Some((first, last)) = uses[*group] {
                        touch(vi, first);
                        touch(vi, last);
                    }
                }
            }
            for (v, (a, b)) in span {
                let whole = match &self.sources[v] {
                    Source::State => true,
                    Source::Dense { group, .. } => resident_group[*group],
                    _ => false,
                };
                if !whole {
                    let lo = match &self.sources[v] {
                        Source::Dense { group, .. } => uses[*group].map_or(a, |u| u.0.min(a)),
                        _ => a,
                    };
                    iv[v].push((lo, b));
                }
            }
        }
        for (v, s) in self.sources.iter().enumerate() {
            let whole = match s {
                Source::State => true,
                Source::Dense { group, .. } => resident_group[*group],
                _ => false,
            };
            if whole {
                iv[v] = vec![(0, n)];
            }
        }
        iv
    }

    /// Per dense tensor held by a resident group: the value that stores it (the first such).
    fn resident_dense_owners(&self, resident_group: &[bool]) -> HashMap<&str, usize> {
        let mut owners = HashMap::new();
        for (v, src) in self.sources.iter().enumerate() {
            if let Source::Dense { tensor, group } = src {
                if resident_group[*group] {
                    owners.entry(tensor.as_str()).or_insert(v);
                }
            }
        }
        owners
    }

    /// Arena placement of every value (None: never live) and the arena's size in words, for a
    /// given residency of the groups and word alignment.
    fn arena_layout(
        &self,
        resident_group: &[bool],
        align_w: usize,
    ) -> (Vec<Option<ArenaSlice>>, usize) {
        let mut iv = self.intervals(resident_group);
        // A tensor that is a dense weight of two groups (tied embeddings) is stored once when one
        // of them is resident: every other use reads the resident copy.
        let owners = self.resident_dense_owners(resident_group);
        let mut alias: Vec<Option<usize>> = vec![None; self.values.len()];
        for (v, src) in self.sources.iter().enumerate() {
            if let Source::Dense { tensor, .. } = src {
                if let Some(&f) = owners.get(tensor.as_str()) {
                    if f != v && self.values[f] == self.values[v] {
                        alias[v] = Some(f);
                        iv[v].clear();
                    }
                }
            }
        }
        let overlap = |a: &[(usize, usize)], b: &[(usize, usize)]| {
            a.iter()
                .any(|&(s1, e1)| b.iter().any(|&(s2, e2)| s1 <= e2 && s2 <= e1))
        };
        let mut order: Vec<usize> = (0..self.values.len())
            .filter(|&v| !iv[v].is_empty())
            .collect();
        // Long-lived values first (they pin the bottom of the arena), then by first use.
        order.sort_by_key(|&v| {
            let first = iv[v].iter().map(|i| i.0).min().unwrap_or(0);
            let whole = iv[v] == [(0, self.nodes.len())];
            (!whole, first, v)
        });
        let mut placed: Vec<(usize, usize, usize)> = Vec::new(); // (offset, len, value)
        let mut slices = vec![None; self.values.len()];
        let mut words = 0usize;
        let mut conflicts: Vec<(usize, usize)> = Vec::new();
        for v in order {
            let len = self.values[v].words().max(1);
            conflicts.clear();
            conflicts.extend(
                placed
                    .iter()
                    .filter(|p| overlap(&iv[p.2], &iv[v]))
                    .map(|p| (p.0, p.1)),
            );
            conflicts.sort_unstable();
            let mut off = 0usize;
            for &(o, l) in &conflicts {
                if off + len <= o {
                    break;
                }
                off = off.max((o + l).div_ceil(align_w) * align_w);
            }
            placed.push((off, len, v));
            slices[v] = Some(ArenaSlice {
                offset: off,
                len: self.values[v].words(),
            });
            words = words.max(off + len);
        }
        for (v, a) in alias.iter().enumerate() {
            if let Some(f) = a {
                slices[v] = slices[*f];
            }
        }
        (slices, words)
    }
}

/// How to run: budgets and streaming knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExecOptions {
    /// Memory budgets (`device_other_bytes` is added to by the arena).
    pub budgets: Budgets,
    /// Reader threads.
    pub readers: usize,
    /// Stream every weight group each step, whatever the budget allows (the lowest-memory
    /// plan).
    pub stream_all: bool,
    /// Load streamed groups the way naive offloaders do (for comparison only): each step,
    /// each group read synchronously into a freshly allocated buffer that is dropped after.
    pub naive: bool,
}

#[derive(Debug, Clone)]
enum Role {
    Packed(usize),
    Absmax(usize),
    NestedAbsmax(usize),
    NestedMap(usize),
    QuantMap(usize),
    QuantState,
    Dense(ValueId, Dtype),
}

/// Where a 4-bit weight's small components land while its group loads: ranges of the shared
/// group buffer (one group loads at a time, so the buffer is as large as the largest group's).
#[derive(Debug, Clone, Default)]
struct Q4Scratch {
    absmax: std::ops::Range<usize>,
    nested_absmax: std::ops::Range<usize>,
    nested_map: std::ops::Range<usize>,
}

/// Per-step figures.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ExecStats {
    /// Streaming figures of the step (zero when everything is resident).
    pub stream: StepStats,
    /// Streamed bytes the backend read in place from ring slots instead of copying them into
    /// its pool (the optimized CPU backend; zero on GPUs).
    pub in_place_bytes: u64,
}

/// The resident groups' single pass, between planning and streaming.
struct ResidentLoad {
    pf: Prefetcher<Box<dyn ByteSource>>,
    groups: Vec<usize>,
    stream_chunks: Vec<ChunkSpec>,
    group_tensors: Vec<Vec<TensorEntry>>,
}

struct Naive {
    source: std::sync::Arc<dyn crate::source::RangeSource>,
    tensors: Vec<Vec<TensorEntry>>,
}

/// A graph bound to a model, a backend and a plan.
pub struct Executor<B: Backend> {
    graph: Graph,
    backend: B,
    plan: MemoryPlan,
    slices: Vec<Option<ArenaSlice>>,
    views: Vec<Q4View>,
    states: Vec<QuantStateJson>,
    /// What each (group, tensor) read feeds: a tensor used by two groups (tied embeddings) is
    /// read once for each.
    roles: HashMap<(usize, String), Role>,
    scratch: Vec<Q4Scratch>,
    /// The loading group's absmax / nested components (see [`Q4Scratch`]).
    group_buf: Vec<u8>,
    /// Per program: the non-resident groups as (first node, group), in the order a step loads
    /// them (the same group order in every program: the ring streams one schedule).
    stream_starts: Vec<Vec<(usize, usize)>>,
    prefetch: Option<Prefetcher<Box<dyn ByteSource>>>,
    arena_words: usize,
    pool_bytes: u64,
    /// Zeros written over the state values before the first step and on `reset_state`.
    state_slices: Vec<ArenaSlice>,
    /// Reused buffer for a streamed weight's f32 absmax.
    absmax_bytes: Vec<u8>,
    /// Reused buffer for a streamed weight's nested absmax, as f32.
    nested_scales: Vec<f32>,
    /// The staging ring when nothing streams (kept to hand on to a later phase).
    spare_ring: Option<StagingRing>,
    /// The naive offloader's mode: no ring for the streamed groups.
    naive: Option<Naive>,
    /// Per op kind (name, with the weight's shape for linears): calls and time, when profiling.
    profile: Option<HashMap<String, (u64, std::time::Duration)>>,
    /// Per group: streamed every step (its packed weights may be read in place from the slot).
    streamed_group: Vec<bool>,
    /// Per program and group: the last node that reads the group.
    group_last: Vec<Vec<Option<usize>>>,
    /// Ring slots whose packed weights the backend reads in place, until their group's last op.
    held: Vec<Held>,
    /// Bytes lent in place during the current step.
    in_place_bytes: u64,
}

/// A filled ring slot kept out of the ring while the backend reads weights from it in place
/// ([`Backend::borrow_weight`]).
struct Held {
    group: usize,
    offsets: Vec<u64>,
    slot: crate::ring::SlotGuard,
    fence: Option<Box<dyn crate::ring::Fence>>,
}

impl<B: Backend> std::fmt::Debug for Executor<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("backend", &self.backend.name())
            .field("arena_words", &self.arena_words)
            .finish()
    }
}

fn align(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

fn element_size(d: Dtype) -> usize {
    (crate::index::dtype_bits(d) / 8) as usize
}

/// Where everything lives for one residency choice.
struct Layout {
    slices: Vec<Option<ArenaSlice>>,
    arena_words: usize,
    views: Vec<Q4View>,
    pool_bytes: u64,
    streamed: Vec<usize>,
    stream_starts: Vec<Vec<(usize, usize)>>,
    resident_group: Vec<bool>,
}

impl Layout {
    fn allocation(&self, graph: &Graph) -> Allocation {
        let resident_dense: u64 = graph
            .sources
            .iter()
            .enumerate()
            .filter_map(|(v, s)| match s {
                Source::Dense { tensor, group } if self.resident_group[*group] => {
                    Some((tensor.as_str(), graph.values[v].words() as u64 * 4))
                }
                _ => None,
            })
            .collect::<HashMap<&str, u64>>()
            .values()
            .sum();
        Allocation {
            pool_bytes: self.pool_bytes,
            arena_bytes: self.arena_words.max(1) as u64 * 4,
            state_bytes: graph.state_bytes(),
            resident_dense_bytes: resident_dense,
        }
    }
}

/// Lays out the arena and the pool for a residency choice, and orders the streamed groups.
fn layout(
    graph: &Graph,
    states: &[QuantStateJson],
    resident_group: &[bool],
    align_w: usize,
    pa: u64,
) -> Result<Layout> {
    let n_groups = graph.groups.len();
    let (slices, arena_words) = graph.arena_layout(resident_group, align_w);
    // Streamed groups, in the order of their first use in program 0; every program must
    // use them in that order (the ring streams one schedule).
    let uses: Vec<Vec<Option<(usize, usize)>>> = (0..graph.programs.len())
        .map(|p| graph.group_uses(p))
        .collect();
    let is_streamed = |g: usize| !resident_group[g] && uses.iter().any(|u| u[g].is_some());
    let streamed: Vec<usize> = {
        let mut g: Vec<usize> = (0..n_groups).filter(|&g| is_streamed(g)).collect();
        g.sort_by_key(|&g| uses[0][g].map(|u| u.0).unwrap_or(usize::MAX));
        g
    };
    let mut stream_starts = Vec::with_capacity(graph.programs.len());
    for (p, u) in uses.iter().enumerate() {
        let pname = &graph.programs[p].name;
        let mut order: Vec<usize> = streamed
            .iter()
            .copied()
            .filter(|&g| u[g].is_some())
            .collect();
        order.sort_by_key(|&g| u[g].map(|x| x.0));
        if !order.is_empty() && order != streamed {
            return Err(Error::Invalid(format!(
                "program '{pname}' does not use the streamed weight groups in the order the ring streams them"
            )));
        }
        for w in order.windows(3) {
            let (a, c) = (u[w[0]].map(|x| x.1), u[w[2]].map(|x| x.0));
            if let (Some(last_a), Some(first_c)) = (a, c) {
                if last_a >= first_c {
                    return Err(Error::Invalid(format!(
                        "weight group '{}' is still used after group '{}' starts: streamed groups must be used in order",
                        graph.groups[w[0]], graph.groups[w[2]]
                    )));
                }
            }
        }
        stream_starts.push(
            order
                .iter()
                .filter_map(|&g| u[g].map(|x| (x.0, g)))
                .collect::<Vec<_>>(),
        );
    }

    // Pool: resident weights in their own regions; streamed ones in two alternating slots.
    let need = |s: &QuantStateJson| -> [u64; 3] { [s.packed_bytes(), s.num_blocks() * 4, 64] };
    let mut views = vec![
        Q4View {
            packed: Default::default(),
            absmax: Default::default(),
            code: Default::default(),
            shape: vec![],
            blocksize: 0
        };
        graph.q4.len()
    ];
    let mut cursor = 0u64;
    let place = |cursor: &mut u64, s: &QuantStateJson, d: &Q4Decl| -> Q4View {
        let [p, a, c] = need(s);
        let mut region = |len: u64| {
            let r = PoolRegion {
                offset: align(*cursor, pa),
                len,
            };
            *cursor = r.offset + len;
            r
        };
        Q4View {
            packed: region(p),
            absmax: region(a),
            code: region(c),
            shape: d.info.shape.clone(),
            blocksize: d.info.blocksize,
        }
    };
    for (wi, d) in graph.q4.iter().enumerate() {
        if resident_group[d.group] {
            views[wi] = place(&mut cursor, &states[wi], d);
        }
    }
    let slot_base = [align(cursor, pa), 0];
    let mut slot_len = [0u64; 2];
    let mut slot_views: Vec<(usize, Q4View)> = Vec::new();
    for (si, &g) in streamed.iter().enumerate() {
        let mut c = 0u64;
        for (wi, d) in graph.q4.iter().enumerate().filter(|(_, d)| d.group == g) {
            let v = place(&mut c, &states[wi], d);
            slot_views.push((wi, v));
        }
        slot_len[si % 2] = slot_len[si % 2].max(c);
    }
    let slot_base = [slot_base[0], align(slot_base[0] + slot_len[0], pa)];
    for (wi, mut v) in slot_views {
        let g = graph.q4[wi].group;
        let si = streamed.iter().position(|&x| x == g).unwrap_or(0) % 2;
        for r in [&mut v.packed, &mut v.absmax, &mut v.code] {
            r.offset += slot_base[si];
        }
        views[wi] = v;
    }
    let pool_bytes = align(slot_base[1] + slot_len[1], pa).max(pa);
    Ok(Layout {
        slices,
        arena_words,
        views,
        pool_bytes,
        streamed,
        stream_starts,
        resident_group: resident_group.to_vec(),
    })
}

/// Everything the executor decides before it allocates: the plan and where every value, weight
/// and streamed tensor goes.
struct Prepared {
    plan: MemoryPlan,
    scratch: Vec<Q4Scratch>,
    group_buf_len: usize,
    roles: HashMap<(usize, String), Role>,
    group_tensors: Vec<Vec<TensorEntry>>,
    states: Vec<QuantStateJson>,
    slices: Vec<Option<ArenaSlice>>,
    arena_words: usize,
    views: Vec<Q4View>,
    pool_bytes: u64,
    streamed: Vec<usize>,
    stream_starts: Vec<Vec<(usize, usize)>>,
    resident_group: Vec<bool>,
    state_slices: Vec<ArenaSlice>,
}

fn prepare<B: Backend + ?Sized>(
    graph: &Graph,
    model: &ModelIndex,
    backend: &B,
    opts: &ExecOptions,
) -> Result<Prepared> {
    // Which file tensors feed which weight.
    let keys = find_4bit_weights(model)?;
    let mut roles: HashMap<(usize, String), Role> = HashMap::new();
    let mut group_tensors: Vec<Vec<TensorEntry>> = vec![Vec::new(); graph.groups.len()];
    let mut states = Vec::with_capacity(graph.q4.len());
    for (wi, d) in graph.q4.iter().enumerate() {
        let k = keys
            .iter()
            .find(|k| k.base == d.tensor)
            .ok_or_else(|| Error::NoSuchTensor {
                file: model.root.clone(),
                tensor: d.tensor.clone(),
            })?;
        let state = QuantState::load(model, k)?;
        let shape: Vec<usize> = state.json.shape.iter().map(|&x| x as usize).collect();
        if shape != d.info.shape || state.json.blocksize as usize != d.info.blocksize {
            return Err(Error::Invalid(format!(
                "{}: the graph expects {:?} blocksize {}, the model has {:?} blocksize {}",
                d.tensor, d.info.shape, d.info.blocksize, shape, state.json.blocksize
            )));
        }
        states.push(state.json);
        roles.insert((d.group, k.base.clone()), Role::Packed(wi));
        roles.insert((d.group, k.absmax.clone()), Role::Absmax(wi));
        roles.insert((d.group, k.quant_map.clone()), Role::QuantMap(wi));
        roles.insert((d.group, k.quant_state.clone()), Role::QuantState);
        if let (Some(a), Some(m)) = (&k.nested_absmax, &k.nested_quant_map) {
            roles.insert((d.group, a.clone()), Role::NestedAbsmax(wi));
            roles.insert((d.group, m.clone()), Role::NestedMap(wi));
        }
        for name in k.all_keys() {
            group_tensors[d.group].push(model.require(name)?.clone());
        }
    }
    for (vi, s) in graph.sources.iter().enumerate() {
        if let Source::Dense { tensor, group } = s {
            let e = model.require(tensor)?;
            if e.numel() as usize != graph.values[vi].numel() {
                return Err(Error::Invalid(format!(
                    "{tensor}: {:?} in the model, {:?} in the graph",
                    e.shape, graph.values[vi].shape
                )));
            }
            if crate::bnb::FloatDtype::from_safetensors(e.dtype).is_none() && e.dtype != Dtype::F64
            {
                return Err(Error::WrongDtype {
                    file: model.shard_name(e.shard).into(),
                    tensor: tensor.clone(),
                    expected: "F32, F16 or BF16".into(),
                    actual: crate::index::dtype_name(e.dtype),
                });
            }
            if graph.values[vi].elem == ElemType::BF16
                && (e.dtype != Dtype::BF16 || !backend.dense_bf16())
            {
                return Err(Error::Invalid(format!(
                    "{tensor}: a bf16 value of the graph, but the model stores {} and {} reads bf16 weights: {}",
                    crate::index::dtype_name(e.dtype),
                    backend.name(),
                    backend.dense_bf16()
                )));
            }
            roles.insert((*group, tensor.clone()), Role::Dense(ValueId(vi), e.dtype));
            group_tensors[*group].push(e.clone());
        }
    }
    for ts in &mut group_tensors {
        ts.sort_by_key(|t| (t.shard, t.offset));
        ts.dedup_by(|a, b| a.name == b.name);
    }
    let group_bytes: Vec<u64> = group_tensors
        .iter()
        .map(|ts| ts.iter().map(|t| t.len).sum())
        .collect();

    // The plan decides residency against the arena every value needs when everything
    // streams; resident dense weights then move to whole-run slices.
    let align_w = backend.arena_align_words().max(1);
    let mut budgets = opts.budgets;
    budgets.device_other_bytes += graph.activation_arena_bytes(align_w);
    // The executor does not keep a host cache: plan without one, so the plan is true.
    budgets.host_cache_bytes = 0;
    let pa = backend.pool_align_bytes().max(4);
    let groups = graph.weight_groups(&group_bytes, pa);
    // Resident dense weights take whole-run arena slices, and the arena of the other values
    // need not shrink by as much: plan, lay out, and if the layout is over the budget, plan
    // again for a budget smaller by the excess.
    // When the layout comes out under the budget (a tied table counted twice, arena space
    // reused), plan again with the slack added, as long as the result still fits.
    let try_plan = |effective: u64| -> Result<(MemoryPlan, Layout, u64)> {
        let mut b = budgets;
        b.device_bytes = effective;
        let mut plan = if opts.stream_all {
            MemoryPlan::streaming_all(groups.clone(), b)?
        } else {
            MemoryPlan::new(groups.clone(), b)?
        };
        let resident_group: Vec<bool> = plan
            .placement
            .iter()
            .map(|p| *p == Placement::Resident)
            .collect();
        let lay = layout(graph, &states, &resident_group, align_w, pa)?;
        plan.budgets.device_bytes = budgets.device_bytes;
        let total = lay.pool_bytes + lay.arena_words.max(1) as u64 * 4;
        Ok((plan, lay, total))
    };
    let mut shrink = 0u64;
    let (mut plan, mut lay) = loop {
        let (mut plan, lay, total) = try_plan(budgets.device_bytes.saturating_sub(shrink))?;
        match plan.set_allocation(lay.allocation(graph)) {
            Ok(()) => break (plan, lay),
            Err(e) if plan.counts().0 == 0 => return Err(e),
            Err(_) => shrink += total.saturating_sub(budgets.device_bytes) + pa,
        }
    };
    let mut effective = budgets.device_bytes.saturating_sub(shrink);
    for _ in 0..4 {
        let used = plan.peak_device_bytes;
        let slack = budgets.device_bytes.saturating_sub(used);
        if opts.stream_all || slack < pa * 16 || plan.counts().1 + plan.counts().2 == 0 {
            break;
        }
        effective += slack;
        let Ok((mut p2, l2, _)) = try_plan(effective) else {
            break;
        };
        if p2.counts().0 <= plan.counts().0 || p2.set_allocation(l2.allocation(graph)).is_err() {
            break;
        }
        (plan, lay) = (p2, l2);
    }
    let Layout {
        slices,
        arena_words,
        views,
        pool_bytes,
        streamed,
        stream_starts,
        resident_group,
    } = lay;
    // Tensors served by a resident copy in another group are not read for this one.
    let mut stream_starts = stream_starts;
    {
        let owners = graph.resident_dense_owners(&resident_group);
        for (v, src) in graph.sources.iter().enumerate() {
            let Source::Dense { tensor, group } = src else {
                continue;
            };
            let Some(&owner) = owners.get(tensor.as_str()) else {
                continue;
            };
            let owner_group = match &graph.sources[owner] {
                Source::Dense { group, .. } => *group,
                _ => continue,
            };
            if owner == v || owner_group == *group {
                continue;
            }
            let before = group_tensors[*group].len();
            let mut freed = 0;
            group_tensors[*group].retain(|t| {
                let keep = t.name != *tensor;
                if !keep {
                    freed += t.len;
                }
                keep
            });
            if group_tensors[*group].len() != before {
                plan.served_elsewhere(*group, freed);
                roles.remove(&(*group, tensor.clone()));
            }
        }
        for starts in &mut stream_starts {
            starts.retain(|&(_, g)| !group_tensors[g].is_empty());
        }
    }
    let streamed: Vec<usize> = streamed
        .into_iter()
        .filter(|&g| !group_tensors[g].is_empty())
        .collect();
    if backend.reads_weights_in_place() && plan.budgets.ring_slots >= 2 {
        // What `take_chunk` may lend: a streamed packed weight that arrives whole in one slot
        // (while another slot stays with the readers).
        plan.in_place_bytes_per_step = streamed
            .iter()
            .flat_map(|&g| group_tensors[g].iter().map(move |t| (g, t)))
            .filter(|(g, t)| {
                t.len <= plan.budgets.slot_bytes
                    && matches!(roles.get(&(*g, t.name.clone())), Some(Role::Packed(_)))
            })
            .map(|(_, t)| t.len)
            .sum();
    }
    let state_slices: Vec<ArenaSlice> = (0..graph.values.len())
        .filter(|&v| graph.sources[v] == Source::State)
        .filter_map(|v| slices[v])
        .collect();
    // Ranges of the shared group buffer, per weight, laid out group by group.
    let mut scratch = vec![Q4Scratch::default(); graph.q4.len()];
    let mut group_cursor = vec![0usize; graph.groups.len()];
    let mut largest_absmax = 0usize;
    for (wi, d) in graph.q4.iter().enumerate() {
        let st = &states[wi];
        let nblocks = st.num_blocks() as usize;
        let c = &mut group_cursor[d.group];
        let mut take = |len: usize| {
            let r = *c..*c + len;
            *c += len;
            r
        };
        largest_absmax = largest_absmax.max(nblocks * 4);
        scratch[wi] = match &st.nested {
            None => Q4Scratch {
                absmax: take(nblocks * 4),
                ..Default::default()
            },
            Some(n) => Q4Scratch {
                absmax: take(nblocks),
                nested_absmax: take(nblocks.div_ceil(n.blocksize as usize) * 4),
                nested_map: take(256 * 4),
            },
        };
    }
    let group_buf_len = group_cursor.iter().copied().max().unwrap_or(0);
    plan.add_host_other((group_buf_len + largest_absmax) as u64);
    Ok(Prepared {
        plan,
        scratch,
        group_buf_len,
        roles,
        group_tensors,
        states,
        slices,
        arena_words,
        views,
        pool_bytes,
        streamed,
        stream_starts,
        resident_group,
        state_slices,
    })
}

impl<B: Backend> Executor<B> {
    /// Plans memory, allocates the backend's arena and pool once, and loads resident weights.
    pub fn new(graph: Graph, model: &ModelIndex, backend: B, opts: ExecOptions) -> Result<Self> {
        Self::with_ring(graph, model, backend, opts, None)
    }

    /// The plan [`Executor::new`] would make, without allocating or reading anything but the
    /// quant states (lets a pipeline print the plans of all its phases first).
    pub fn plan_only(
        graph: &Graph,
        model: &ModelIndex,
        backend: &B,
        opts: ExecOptions,
    ) -> Result<MemoryPlan> {
        let narrowed = graph.for_backend(model, backend);
        Ok(prepare(narrowed.as_ref().unwrap_or(graph), model, backend, &opts)?.plan)
    }

    /// [`Executor::new`] reusing a staging ring from an earlier phase (same slot count and
    /// size as the budgets), so that a pipeline's phases stream through one ring.
    pub fn with_ring(
        graph: Graph,
        model: &ModelIndex,
        backend: B,
        opts: ExecOptions,
        ring: Option<StagingRing>,
    ) -> Result<Self> {
        let readers = opts.readers;
        let src = model.source();
        Self::with_source(graph, model, backend, opts, ring, &mut || {
            Box::new(ThreadedSource::new(src.clone(), readers))
        })
    }

    /// [`Executor::with_ring`] reading weights through sources made by `make_source` (one for
    /// the resident groups' single pass, one for the stream) instead of reader threads.
    pub fn with_source(
        graph: Graph,
        model: &ModelIndex,
        backend: B,
        opts: ExecOptions,
        ring: Option<StagingRing>,
        make_source: &mut dyn FnMut() -> Box<dyn ByteSource>,
    ) -> Result<Self> {
        let (mut ex, mut load) = Self::build(graph, model, backend, &opts, ring, make_source)?;
        for g in std::mem::take(&mut load.groups) {
            ex.load_group(&mut load.pf, g)?;
        }
        ex.start_stream(load, model, &opts, make_source)?;
        Ok(ex)
    }

    /// [`Executor::with_source`] for an event loop (the browser): the resident groups' reads
    /// are awaited instead of waited for.
    pub async fn with_source_async(
        graph: Graph,
        model: &ModelIndex,
        backend: B,
        opts: ExecOptions,
        make_source: &mut dyn FnMut() -> Box<dyn ByteSource>,
    ) -> Result<Self> {
        let (mut ex, mut load) = Self::build(graph, model, backend, &opts, None, make_source)?;
        for g in std::mem::take(&mut load.groups) {
            ex.load_group_async(&mut load.pf, g).await?;
        }
        ex.start_stream(load, model, &opts, make_source)?;
        Ok(ex)
    }

    /// Plans, allocates, and sets up the resident groups' single pass through the ring.
    fn build(
        graph: Graph,
        model: &ModelIndex,
        mut backend: B,
        opts: &ExecOptions,
        ring: Option<StagingRing>,
        make_source: &mut dyn FnMut() -> Box<dyn ByteSource>,
    ) -> Result<(Self, ResidentLoad)> {
        let graph = graph.for_backend(model, &backend).unwrap_or(graph);
        let Prepared {
            plan,
            scratch,
            group_buf_len,
            roles,
            group_tensors,
            states,
            slices,
            arena_words,
            views,
            pool_bytes,
            streamed,
            stream_starts,
            resident_group,
            state_slices,
        } = prepare(&graph, model, &backend, opts)?;
        let n_groups = graph.groups.len();
        backend.allocate(arena_words.max(1), pool_bytes)?;
        let mut streamed_group = vec![false; n_groups];
        for &g in &streamed {
            streamed_group[g] = true;
        }
        let group_last = (0..graph.programs.len())
            .map(|p| graph.group_uses(p).iter().map(|u| u.map(|u| u.1)).collect())
            .collect();

        let mut group_buf = vec![0u8; group_buf_len];
        for page in group_buf.chunks_mut(4096) {
            page[0] = 0;
        }
        let mut ex = Executor {
            graph,
            backend,
            plan,
            slices,
            views,
            states,
            roles,
            scratch,
            group_buf,
            stream_starts,
            prefetch: None,
            arena_words,
            pool_bytes,
            state_slices,
            absmax_bytes: Vec::new(),
            nested_scales: Vec::new(),
            profile: None,
            spare_ring: None,
            naive: None,
            streamed_group,
            group_last,
            held: Vec::new(),
            in_place_bytes: 0,
        };
        ex.reset_state()?;
        // Resident groups: one pass through the ring, then the ring streams the rest every step.
        let b = opts.budgets;
        let alloc = ex
            .backend
            .slot_allocator()
            .unwrap_or_else(|| Box::new(HostAllocator));
        let ring = match ring {
            Some(r)
                if r.slots() == b.ring_slots as usize
                    && r.slot_bytes() == b.slot_bytes as usize =>
            {
                r
            }
            Some(r) => {
                return Err(Error::Invalid(format!(
                    "the ring handed over has {} x {} bytes, the budgets ask for {} x {}",
                    r.slots(),
                    r.slot_bytes(),
                    b.ring_slots,
                    b.slot_bytes
                )))
            }
            None => StagingRing::new(b.ring_slots as usize, b.slot_bytes as usize, alloc.as_ref())?,
        };
        let resident: Vec<usize> = (0..n_groups).filter(|&g| resident_group[g]).collect();
        let chunks = chunk_schedule(
            resident.iter().map(|&g| (g, group_tensors[g].as_slice())),
            b.slot_bytes as usize,
        );
        let pf = Prefetcher::new(make_source(), ring, chunks, Some(1))?;
        let stream_chunks = chunk_schedule(
            streamed.iter().map(|&g| (g, group_tensors[g].as_slice())),
            b.slot_bytes as usize,
        );
        Ok((
            ex,
            ResidentLoad {
                pf,
                groups: resident,
                stream_chunks,
                group_tensors,
            },
        ))
    }

    /// After the resident groups: the ring goes to the stream of the other groups.
    fn start_stream(
        &mut self,
        load: ResidentLoad,
        model: &ModelIndex,
        opts: &ExecOptions,
        make_source: &mut dyn FnMut() -> Box<dyn ByteSource>,
    ) -> Result<()> {
        let ResidentLoad {
            pf,
            stream_chunks: chunks,
            group_tensors,
            ..
        } = load;
        let ring = pf.into_ring();
        if opts.naive {
            // The naive offloader keeps no staging ring: drop it after the resident loads.
            drop(ring);
            self.naive = Some(Naive {
                source: model.source(),
                tensors: group_tensors,
            });
        } else if chunks.is_empty() {
            self.spare_ring = Some(ring);
        } else {
            self.prefetch = Some(Prefetcher::new(make_source(), ring, chunks, None)?);
        }
        Ok(())
    }

    /// Limits the weight stream to `passes` more passes (steps or decoded tokens), so that no
    /// read runs ahead into a pass that will not come: with it, the bytes read equal the plan's
    /// `streamed_bytes_per_step` times the passes run.
    pub fn limit_stream_passes(&mut self, passes: u64) {
        if let Some(pf) = self.prefetch.as_mut() {
            pf.limit_passes(passes);
        }
    }

    /// Ends the executor: waits for reads in flight, releases the backend's device memory, and
    /// gives back the backend and the staging ring (for the next phase of a pipeline).
    pub fn into_parts(mut self) -> (B, Option<StagingRing>) {
        self.release_held(None);
        let ring = match self.prefetch.take() {
            Some(pf) => Some(pf.finish()),
            None => self.spare_ring.take(),
        };
        self.backend.release();
        (self.backend, ring)
    }

    /// Sets every state value (KV cache) back to zero, as before the first step.
    pub fn reset_state(&mut self) -> Result<()> {
        for s in self.state_slices.clone() {
            // In pieces, so that a large cache needs no host buffer of its size.
            let zeros = vec![0u32; s.len.clamp(1, 1 << 16)];
            let mut at = 0;
            while at < s.len {
                let n = (s.len - at).min(zeros.len());
                self.backend.write_arena(
                    ArenaSlice {
                        offset: s.offset + at,
                        len: n,
                    },
                    &zeros[..n],
                )?;
                at += n;
            }
        }
        Ok(())
    }

    /// Starts (or stops) timing every op; the backend is synchronized after each op when it has
    /// to be (`read_arena` of nothing), so GPU figures include the kernel.
    pub fn set_profile(&mut self, on: bool) {
        self.profile = on.then(HashMap::new);
    }

    /// The op profile: (op, calls, total time), slowest first.
    pub fn profile(&self) -> Vec<(String, u64, std::time::Duration)> {
        let mut v: Vec<_> = self
            .profile
            .iter()
            .flatten()
            .map(|(k, (n, t))| (k.clone(), *n, *t))
            .collect();
        v.sort_by_key(|x| std::cmp::Reverse(x.2));
        v
    }

    /// The graph being run.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The memory plan in force.
    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    /// Arena words and pool bytes allocated on the backend.
    pub fn device_allocation(&self) -> (usize, u64) {
        (self.arena_words, self.pool_bytes)
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Places one chunk's tensors: uploads (the fences of the uploads are returned), host-side
    /// quant-state parts, dense weights. With `borrowed`, a packed weight that lies whole in
    /// the chunk is lent to the backend in place where it can read it there (its pool offset is
    /// pushed to `borrowed`; the caller then keeps `data` unchanged until `end_borrow`).
    fn handle(
        &mut self,
        spec: &ChunkSpec,
        data: &[u8],
        mut borrowed: Option<&mut Vec<u64>>,
    ) -> Result<Vec<Box<dyn crate::ring::Fence>>> {
        let mut fences = Vec::new();
        for part in &spec.parts {
            let bytes = &data[part.chunk_offset..part.chunk_offset + part.len];
            let at = part.tensor_offset as usize;
            let group_buf = &mut self.group_buf;
            let mut put = |r: &std::ops::Range<usize>| -> Result<()> {
                if r.len() != part.tensor_len as usize || at + bytes.len() > r.len() {
                    return Err(Error::Invalid(format!(
                        "{}: {} bytes in the file, the quant state needs {}",
                        part.tensor,
                        part.tensor_len,
                        r.len()
                    )));
                }
                group_buf[r.start + at..r.start + at + bytes.len()].copy_from_slice(bytes);
                Ok(())
            };
            match self.roles.get(&(spec.group, part.tensor.clone())).cloned() {
                Some(Role::Packed(w)) => {
                    let at = self.views[w].packed.offset;
                    let whole = part.tensor_offset == 0 && part.len as u64 == part.tensor_len;
                    match borrowed.as_deref_mut() {
                        // SAFETY: only `take_chunk` passes `borrowed`, and it keeps the slot
                        // holding `data` out of the ring, unchanged, until `end_borrow(at)`.
                        Some(lent) if whole && unsafe { self.backend.borrow_weight(at, bytes) } => {
                            lent.push(at);
                            self.in_place_bytes += bytes.len() as u64;
                        }
                        _ => fences.push(self.backend.upload(at + part.tensor_offset, bytes)?),
                    }
                }
                Some(Role::QuantMap(w)) => fences.push(
                    self.backend
                        .upload(self.views[w].code.offset + part.tensor_offset, bytes)?,
                ),
                Some(Role::Absmax(w)) => put(&self.scratch[w].absmax)?,
                Some(Role::NestedAbsmax(w)) => put(&self.scratch[w].nested_absmax)?,
                Some(Role::NestedMap(w)) => put(&self.scratch[w].nested_map)?,
                Some(Role::QuantState) | None => {}
                Some(Role::Dense(v, dtype)) => {
                    let es = element_size(dtype);
                    if at % es != 0 || bytes.len() % es != 0 {
                        return Err(Error::Invalid(format!("{}: a ring slot split an element; use a slot size that is a multiple of 8", part.tensor)));
                    }
                    let s =
                        self.slices[v.0].ok_or_else(|| Error::Invalid("unplaced weight".into()))?;
                    if self.graph.values[v.0].elem == ElemType::BF16 {
                        // As stored: the bytes go in as they are, at their element.
                        self.backend.write_bf16(s, at / es, bytes)?;
                        continue;
                    }
                    self.backend.write_dense(
                        ArenaSlice {
                            offset: s.offset + at / es,
                            len: bytes.len() / es,
                        },
                        bytes,
                        dtype,
                    )?;
                }
            }
        }
        Ok(fences)
    }

    fn load_group(&mut self, pf: &mut Prefetcher<Box<dyn ByteSource>>, g: usize) -> Result<()> {
        self.backend.begin_group_load();
        loop {
            if !pf.next_ready() {
                self.backend.idle();
            }
            let chunk = pf.next_chunk()?.ok_or_else(|| stream_ended(g))?;
            if self.take_chunk(pf, chunk, g)? {
                break;
            }
        }
        self.finish_group(g)
    }

    /// [`Executor::load_group`] on an event loop: each chunk is awaited, never waited for.
    async fn load_group_async(
        &mut self,
        pf: &mut Prefetcher<Box<dyn ByteSource>>,
        g: usize,
    ) -> Result<()> {
        self.backend.begin_group_load();
        loop {
            pf.ready().await?;
            let chunk = pf.next_chunk()?.ok_or_else(|| stream_ended(g))?;
            if self.take_chunk(pf, chunk, g)? {
                break;
            }
        }
        self.finish_group(g)
    }

    /// Uploads one chunk of group `g` and releases its slot after the uploads; true when it
    /// was the group's last chunk.
    fn take_chunk(
        &mut self,
        pf: &Prefetcher<Box<dyn ByteSource>>,
        chunk: Chunk,
        g: usize,
    ) -> Result<bool> {
        let per = pf.chunks_per_step();
        if chunk.spec.group != g {
            return Err(Error::Invalid(format!(
                "stream out of order: expected group {g}, got {}",
                chunk.spec.group
            )));
        }
        let idx = (chunk.seq % per as u64) as usize;
        let last_of_group = idx + 1 == per || pf_peek_group(pf, idx + 1) != Some(g);
        // Zero copy: the packed weights of a streamed group may be read from the slot in place;
        // the slot then stays out of the ring until the group's last op. At least one slot is
        // never held, so that the readers can always fill the chunk the executor waits for.
        let borrow =
            self.streamed_group.get(g) == Some(&true) && self.held.len() + 2 <= pf.ring().slots();
        let mut borrowed = Vec::new();
        let fences = self.handle(&chunk.spec, chunk.bytes(), borrow.then_some(&mut borrowed))?;
        let Chunk { slot, .. } = chunk;
        // Uploads from one slot complete in order: the last one frees the slot.
        let fence = fences.into_iter().last();
        if !borrowed.is_empty() {
            self.held.push(Held {
                group: g,
                offsets: borrowed,
                slot,
                fence,
            });
        } else {
            match fence {
                Some(f) => slot.release_after(f),
                None => drop(slot),
            }
        }
        Ok(last_of_group)
    }

    /// The naive offloader's way (for comparison, `ExecOptions::naive`): the group's tensors
    /// read synchronously into a buffer allocated for this load and dropped after it.
    fn load_group_naive(&mut self, g: usize) -> Result<StepStats> {
        let Some(naive) = &self.naive else {
            return Err(Error::Invalid("not in naive mode".into()));
        };
        let tensors = naive.tensors[g].clone();
        let source = naive.source.clone();
        let total: u64 = tensors.iter().map(|t| t.len).sum();
        self.backend.begin_group_load();
        let t0 = web_time::Instant::now();
        let mut buf = vec![0u8; total as usize];
        let mut parts = Vec::with_capacity(tensors.len());
        let mut at = 0usize;
        for t in &tensors {
            source.read_exact_at(
                t.shard,
                t.offset,
                &mut buf[at..at + t.len as usize],
                &t.name,
            )?;
            parts.push(crate::prefetch::ChunkPart {
                tensor: t.name.clone(),
                tensor_offset: 0,
                tensor_len: t.len,
                chunk_offset: at,
                len: t.len as usize,
            });
            at += t.len as usize;
        }
        let read = t0.elapsed();
        let spec = ChunkSpec {
            group: g,
            file: 0,
            offset: 0,
            len: at,
            parts,
        };
        for f in self.handle(&spec, &buf, None)? {
            f.wait();
        }
        drop(buf);
        self.finish_group(g)?;
        Ok(StepStats {
            bytes: total,
            stall: read,
            read_busy: read,
            ..Default::default()
        })
    }

    /// After a group's bytes arrived: undoes double quantization into the pool.
    fn finish_group(&mut self, g: usize) -> Result<()> {
        // Double quantization undone on the host, bit-exactly, into the pool as f32 (the formula
        // of `QuantState::from_parts`; the quant state was validated when the executor opened).
        for wi in 0..self.graph.q4.len() {
            if self.graph.q4[wi].group != g {
                continue;
            }
            let sc = &self.scratch[wi];
            let (absmax, nested_absmax, nested_map) = (
                &self.group_buf[sc.absmax.clone()],
                &self.group_buf[sc.nested_absmax.clone()],
                &self.group_buf[sc.nested_map.clone()],
            );
            let st = &self.states[wi];
            let nblocks = st.num_blocks() as usize;
            let what = &self.graph.q4[wi].tensor;
            let bad = |e: &str| Error::Invalid(format!("{what}: {e}"));
            match &st.nested {
                None if absmax.len() != nblocks * 4 => {
                    return Err(bad(&format!(
                        "streamed absmax has {} bytes, expected {}",
                        absmax.len(),
                        nblocks * 4
                    )))
                }
                Some(n)
                    if absmax.len() != nblocks
                        || nested_absmax.len() != nblocks.div_ceil(n.blocksize as usize) * 4
                        || nested_map.len() != 256 * 4 =>
                {
                    return Err(bad(
                        "streamed double-quant state does not match the quant state",
                    ))
                }
                _ => {}
            }
            let region = self.views[wi].absmax;
            // Host-memory pools are written in place; device pools get one upload.
            let mut buf = std::mem::take(&mut self.absmax_bytes);
            let in_place = self.backend.host_pool_mut(region);
            let host = in_place.is_some();
            let out: &mut [u8] = match in_place {
                Some(s) if s.len() >= nblocks * 4 => s,
                Some(_) => return Err(bad("the pool region is smaller than its absmax")),
                None => {
                    buf.clear();
                    buf.resize(nblocks * 4, 0);
                    &mut buf
                }
            };
            match &st.nested {
                None => out[..nblocks * 4].copy_from_slice(absmax),
                Some(n) => {
                    let mut map = [0f32; 256];
                    let scales = &mut self.nested_scales;
                    scales.resize(nested_absmax.len() / 4, 0.0);
                    // The byte counts were checked above.
                    if !crate::convert::widen_into(nested_map, Dtype::F32, &mut map)
                        || !crate::convert::widen_into(nested_absmax, Dtype::F32, scales)
                    {
                        return Err(bad("streamed double-quant state is not f32"));
                    }
                    let out = &mut out[..nblocks * 4];
                    crate::bnb::undo_double_quant(
                        absmax,
                        &map,
                        scales,
                        n.blocksize as usize,
                        n.offset_f32(),
                        |j, a| out[4 * j..4 * j + 4].copy_from_slice(&a.to_le_bytes()),
                    );
                }
            }
            let r = if host {
                Ok(())
            } else {
                self.backend.upload(region.offset, &buf).map(drop)
            };
            self.absmax_bytes = buf;
            r?;
        }
        Ok(())
    }

    /// Runs one step of program 0 (see [`Executor::step_program`]).
    pub fn step(&mut self, inputs: &[HostTensor]) -> Result<(Vec<HostTensor>, ExecStats)> {
        self.step_program(0, inputs)
    }

    /// Runs one step of program `p`: writes `inputs` (in the program's input order), runs its
    /// ops (streaming the non-resident groups), returns its outputs.
    pub fn step_program(
        &mut self,
        p: usize,
        inputs: &[HostTensor],
    ) -> Result<(Vec<HostTensor>, ExecStats)> {
        let mut c = self.begin_step(p, inputs)?;
        while let Some(g) = self.run_until_load(&mut c)? {
            if self.naive.is_some() {
                let st = self.load_group_naive(g)?;
                c.stats.stream.bytes += st.bytes;
                c.stats.stream.stall += st.stall;
                c.stats.stream.read_busy += st.read_busy;
                c.next_group += 1;
                continue;
            }
            let mut pf = self.take_stream()?;
            let t0 = self.profile.is_some().then(web_time::Instant::now);
            let r = self.load_group(&mut pf, g);
            if let (Some(t0), Some(p)) = (t0, self.profile.as_mut()) {
                let e = p
                    .entry("(load streamed group: wait + upload)".into())
                    .or_default();
                e.0 += 1;
                e.1 += t0.elapsed();
            }
            self.return_stream(pf, &mut c, r)?;
        }
        c.stats.in_place_bytes = std::mem::take(&mut self.in_place_bytes);
        let mut words = Vec::new();
        for s in self.output_slices(p)? {
            words.push(self.backend.read_arena(s)?);
        }
        Ok((self.outputs_from_words(p, words)?, c.stats))
    }

    /// [`Executor::step_program`] on an event loop (the browser): streamed groups and the
    /// outputs' read-back are awaited, never waited for. The naive mode is not offered here.
    pub async fn step_program_async(
        &mut self,
        p: usize,
        inputs: &[HostTensor],
    ) -> Result<(Vec<HostTensor>, ExecStats)> {
        if self.naive.is_some() {
            return Err(Error::Invalid(
                "the naive offloader runs only synchronously".into(),
            ));
        }
        let mut c = self.begin_step(p, inputs)?;
        while let Some(g) = self.run_until_load(&mut c)? {
            let mut pf = self.take_stream()?;
            let r = self.load_group_async(&mut pf, g).await;
            self.return_stream(pf, &mut c, r)?;
        }
        c.stats.in_place_bytes = std::mem::take(&mut self.in_place_bytes);
        let mut words = Vec::new();
        for s in self.output_slices(p)? {
            words.push(self.backend.read_arena_async(s).await?);
        }
        Ok((self.outputs_from_words(p, words)?, c.stats))
    }

    /// Ends the in-place reads of held slots and returns those slots to the ring (after their
    /// uploads' fences), so that the readers may fill them at once: the slots of the groups
    /// whose last op in program `p` is node `n` for `after: Some((p, n))`, all for `None`.
    fn release_held(&mut self, after: Option<(usize, usize)>) {
        let mut i = 0;
        let mut any = false;
        while i < self.held.len() {
            let done = match after {
                None => true,
                Some((p, n)) => self.group_last[p].get(self.held[i].group) == Some(&Some(n)),
            };
            if !done {
                i += 1;
                continue;
            }
            let h = self.held.swap_remove(i);
            for &at in &h.offsets {
                self.backend.end_borrow(at);
            }
            match h.fence {
                Some(f) => h.slot.release_after(f),
                None => drop(h.slot),
            }
            any = true;
        }
        if any {
            if let Some(pf) = self.prefetch.as_mut() {
                // Starts the reads into the freed slots now, not at the next group's load.
                pf.next_ready();
            }
        }
    }

    /// The stream's prefetcher, out of `self` while a group loads (loading borrows both).
    fn take_stream(&mut self) -> Result<Prefetcher<Box<dyn ByteSource>>> {
        self.prefetch
            .take()
            .ok_or_else(|| Error::Invalid("no stream".into()))
    }

    /// Puts the prefetcher back after a group's load `r`, keeping the step's streaming figures,
    /// and moves the cursor past the group.
    fn return_stream(
        &mut self,
        mut pf: Prefetcher<Box<dyn ByteSource>>,
        c: &mut StepCursor,
        r: Result<()>,
    ) -> Result<()> {
        if let Some(st) = pf.take_step_stats() {
            c.stats.stream = st;
        }
        self.prefetch = Some(pf);
        r?;
        c.next_group += 1;
        Ok(())
    }

    /// Checks and writes a step's inputs.
    fn begin_step(&mut self, p: usize, inputs: &[HostTensor]) -> Result<StepCursor> {
        // Normally none are left: a step that failed part-way may have kept some.
        self.release_held(None);
        self.in_place_bytes = 0;
        let prog = self
            .graph
            .programs
            .get(p)
            .ok_or_else(|| Error::Invalid(format!("no program {p}")))?;
        let (start, end) = (prog.start, prog.end);
        if inputs.len() != prog.inputs.len() {
            return Err(Error::Invalid(format!(
                "{} inputs given, program '{}' has {}",
                inputs.len(),
                prog.name,
                prog.inputs.len()
            )));
        }
        for (v, t) in prog.inputs.iter().zip(inputs) {
            if t.info != self.graph.values[v.0] {
                return Err(Error::Invalid(format!(
                    "input {}: {:?} given, {:?} expected",
                    v.0, t.info, self.graph.values[v.0]
                )));
            }
            let s = self.slices[v.0].ok_or_else(|| Error::Invalid("unplaced input".into()))?;
            self.backend.write_arena(s, &host_words(t))?;
        }
        Ok(StepCursor {
            p,
            node: start,
            end,
            next_group: 0,
            stats: ExecStats::default(),
        })
    }

    /// Runs ops from the cursor on until a streamed group has to be loaded first (its index)
    /// or the program has ended (`None`).
    fn run_until_load(&mut self, c: &mut StepCursor) -> Result<Option<usize>> {
        let p = c.p;
        let mut ins: Vec<Operand> = Vec::with_capacity(8);
        while c.node < c.end {
            let ni = c.node;
            if c.next_group < self.stream_starts[p].len()
                && self.stream_starts[p][c.next_group].0 == ni
            {
                return Ok(Some(self.stream_starts[p][c.next_group].1));
            }
            let node = &self.graph.nodes[ni];
            let operand = |v: &ValueId| -> Result<Operand> {
                Ok(Operand {
                    slice: self.slices[v.0]
                        .ok_or_else(|| Error::Invalid("unplaced value".into()))?,
                    info: self.graph.values[v.0].clone(),
                })
            };
            ins.clear();
            for v in &node.inputs {
                ins.push(operand(v)?);
            }
            let out = operand(&node.output)?;
            let view = node.weight.map(|w| &self.views[w.0]);
            if !self.backend.supports(&node.op) {
                return Err(Error::Invalid(format!(
                    "{} does not support {}",
                    self.backend.name(),
                    node.op.name()
                )));
            }
            let t0 = self.profile.is_some().then(web_time::Instant::now);
            self.backend.run(&node.op, &ins, view, &out)?;
            if let Some(t0) = t0 {
                // Wait for the device so that the time is the op's.
                self.backend.read_arena(ArenaSlice {
                    offset: out.slice.offset,
                    len: 1,
                })?;
                let key = match (&node.op, node.weight) {
                    (OpKind::LinearQ4 { .. }, Some(w)) => {
                        format!(
                            "linear_q4 {}x{:?}",
                            ins[0].info.shape[0], self.graph.q4[w.0].info.shape
                        )
                    }
                    (OpKind::Linear { .. }, _) => {
                        format!("linear {}x{:?}", ins[0].info.shape[0], ins[1].info.shape)
                    }
                    (op, _) => op.name().to_string(),
                };
                let e = self.profile.as_mut().map(|p| p.entry(key).or_default());
                if let Some(e) = e {
                    e.0 += 1;
                    e.1 += t0.elapsed();
                }
            }
            if !self.held.is_empty() {
                self.release_held(Some((p, ni)));
            }
            c.node += 1;
        }
        self.release_held(None);
        Ok(None)
    }

    /// Where program `p`'s outputs live.
    fn output_slices(&self, p: usize) -> Result<Vec<ArenaSlice>> {
        self.graph.programs[p]
            .outputs
            .iter()
            .map(|v| self.slices[v.0].ok_or_else(|| Error::Invalid("unplaced output".into())))
            .collect()
    }

    /// Program `p`'s outputs from the words read back.
    fn outputs_from_words(&self, p: usize, words: Vec<Vec<u32>>) -> Result<Vec<HostTensor>> {
        let prog = &self.graph.programs[p];
        let mut outs = Vec::with_capacity(prog.outputs.len());
        for (v, words) in prog.outputs.iter().zip(words) {
            let info = &self.graph.values[v.0];
            outs.push(match info.elem {
                ElemType::F32 => HostTensor::f32(
                    &info.shape,
                    words.iter().map(|w| f32::from_bits(*w)).collect(),
                )?,
                ElemType::U32 => HostTensor::u32(&info.shape, words)?,
                ElemType::BF16 => HostTensor::f32(
                    &info.shape,
                    crate::convert::bf16_words_to_f32(&words, info.numel()),
                )?,
            });
        }
        Ok(outs)
    }
}

/// Where a step is: the program, the next op, the next streamed group.
struct StepCursor {
    p: usize,
    node: usize,
    end: usize,
    next_group: usize,
    stats: ExecStats,
}

/// The stream ran out (its pass limit) before group `g` arrived: running on would compute with
/// whatever the pool region still holds.
fn stream_ended(g: usize) -> Error {
    Error::Invalid(format!(
        "the weight stream ended before group {g} was loaded (more steps than the stream was limited to)"
    ))
}

fn pf_peek_group(pf: &Prefetcher<Box<dyn ByteSource>>, idx: usize) -> Option<usize> {
    pf.chunk_spec(idx).map(|c| c.group)
}
