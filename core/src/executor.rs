//! The executor: runs a [`Graph`] on a [`Backend`] with weights arriving through the streaming
//! pipeline. Before the first step it plans everything: which weight groups stay resident and
//! which stream (the [`MemoryPlan`]), where every activation lives in the arena (sized once from
//! the graph's lifetimes), where every weight lives in the pool (resident regions plus two
//! alternating stream slots). During a step it asks for weight group g just before the first op
//! that uses it and lets the next group two later reuse its pool slot once its ops have run.

use std::collections::HashMap;

use crate::backend::{host_words, ArenaSlice, Backend, Operand, PoolRegion, Q4View};
use crate::bnb::{find_4bit_weights, QuantState, QuantStateJson, QuantStateParts, RawTensor};
use crate::convert::bytes_to_f32;
use crate::error::{Error, Result};
use crate::graph::{infer, ElemType, HostTensor, OpKind, Q4Info, ValueInfo};
use crate::index::{Dtype, ModelIndex, TensorEntry};
use crate::plan::{Budgets, MemoryPlan, Placement, WeightGroup};
use crate::prefetch::{chunk_schedule, Chunk, Prefetcher, StepStats};
use crate::ring::{HostAllocator, StagingRing};
use crate::source::ThreadedSource;

/// A value of the graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ValueId(pub usize);

/// A 4-bit weight of the graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WeightId(pub usize);

#[derive(Debug, Clone, PartialEq)]
enum Source {
    Input,
    Node,
    Dense { tensor: String, group: usize },
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
    /// Its result.
    pub output: ValueId,
}

#[derive(Debug, Clone, PartialEq)]
struct Q4Decl {
    tensor: String,
    group: usize,
    info: Q4Info,
}

/// A computation over activations and model weights, built op by op with shape checks.
#[derive(Debug, Clone, Default)]
pub struct Graph {
    values: Vec<ValueInfo>,
    sources: Vec<Source>,
    nodes: Vec<Node>,
    q4: Vec<Q4Decl>,
    groups: Vec<String>,
    inputs: Vec<ValueId>,
    outputs: Vec<ValueId>,
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
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
        ValueId(self.values.len() - 1)
    }

    /// A graph input, written by the caller before each step.
    pub fn input(&mut self, info: ValueInfo) -> ValueId {
        let v = self.value(info, Source::Input);
        self.inputs.push(v);
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

    /// A 4-bit model weight (`tensor` is its base name, e.g. `model.layers.0.mlp.up_proj.weight`).
    pub fn q4_weight(&mut self, group: usize, tensor: &str, info: Q4Info) -> WeightId {
        self.q4.push(Q4Decl {
            tensor: tensor.to_string(),
            group,
            info,
        });
        WeightId(self.q4.len() - 1)
    }

    /// Appends an op; its output's shape is checked and inferred now.
    pub fn op(
        &mut self,
        op: OpKind,
        inputs: &[ValueId],
        weight: Option<WeightId>,
    ) -> Result<ValueId> {
        let infos: Vec<&ValueInfo> = inputs
            .iter()
            .map(|v| {
                self.values
                    .get(v.0)
                    .ok_or_else(|| Error::Invalid(format!("{}: unknown value {}", op.name(), v.0)))
            })
            .collect::<Result<_>>()?;
        let q4 = weight
            .map(|w| {
                self.q4
                    .get(w.0)
                    .map(|d| &d.info)
                    .ok_or_else(|| Error::Invalid(format!("unknown weight {}", w.0)))
            })
            .transpose()?;
        let info = infer(&op, &infos, q4)?;
        let out = self.value(info, Source::Node);
        self.nodes.push(Node {
            op,
            inputs: inputs.to_vec(),
            weight,
            output: out,
        });
        Ok(out)
    }

    /// Marks a value as an output, read back after each step.
    pub fn output(&mut self, v: ValueId) {
        self.outputs.push(v);
    }

    /// Shape and type of a value.
    pub fn info(&self, v: ValueId) -> &ValueInfo {
        &self.values[v.0]
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

    /// Device bytes the plan reserves for activations: every value at once (an upper bound of
    /// the arena, which reuses memory between values whose lifetimes do not overlap).
    pub fn activation_bytes(&self) -> u64 {
        self.values.iter().map(|v| v.numel() as u64 * 4).sum()
    }

    /// The smallest device budget with which this graph runs on `model`: activations plus a
    /// stream pool for the two largest groups, everything streamed.
    pub fn min_device_bytes(&self, model: &ModelIndex) -> Result<u64> {
        let mut g = self.group_bytes(model)?;
        g.sort_unstable_by(|a, b| b.cmp(a));
        Ok(self.activation_bytes() + g.iter().take(2).sum::<u64>())
    }

    /// The ops.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Index of the first node using each group (`None` for unused groups).
    fn first_use(&self) -> Vec<Option<usize>> {
        let mut first = vec![None; self.groups.len()];
        for (ni, n) in self.nodes.iter().enumerate() {
            let mut mark = |g: usize| {
                if first[g].is_none() {
                    first[g] = Some(ni);
                }
            };
            if let Some(w) = n.weight {
                mark(self.q4[w.0].group);
            }
            for v in &n.inputs {
                if let Source::Dense { group, .. } = &self.sources[v.0] {
                    mark(*group);
                }
            }
        }
        first
    }

    fn last_use(&self) -> Vec<usize> {
        let mut last = vec![0usize; self.groups.len()];
        for (ni, n) in self.nodes.iter().enumerate() {
            if let Some(w) = n.weight {
                last[self.q4[w.0].group] = ni;
            }
            for v in &n.inputs {
                if let Source::Dense { group, .. } = &self.sources[v.0] {
                    last[*group] = ni;
                }
            }
        }
        last
    }
}

/// How to run: budgets and streaming knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExecOptions {
    /// Memory budgets (`device_other_bytes` is added to by the arena).
    pub budgets: Budgets,
    /// Reader threads.
    pub readers: usize,
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

#[derive(Debug, Clone, Default)]
struct Q4Scratch {
    absmax: Vec<u8>,
    nested_absmax: Vec<u8>,
    nested_map: Vec<u8>,
}

/// Per-step figures.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ExecStats {
    /// Streaming figures of the step (zero when everything is resident).
    pub stream: StepStats,
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
    /// Per weight: its quant-state JSON and code table as the safetensors bytes the stream
    /// rebuilds the state from (fixed for the executor's life, so encoded once).
    state_bytes: Vec<(Vec<u8>, Vec<u8>)>,
    /// The non-resident groups as (first node, group), in the order the step loads them.
    stream_starts: Vec<(usize, usize)>,
    prefetch: Option<Prefetcher<ThreadedSource>>,
    arena_words: usize,
    pool_bytes: u64,
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

impl<B: Backend> Executor<B> {
    /// Plans memory, allocates the backend's arena and pool once, and loads resident weights.
    pub fn new(
        graph: Graph,
        model: &ModelIndex,
        mut backend: B,
        opts: ExecOptions,
    ) -> Result<Self> {
        let first_use = graph.first_use();
        let last_use = graph.last_use();
        // Which file tensors feed which weight.
        let keys = find_4bit_weights(model)?;
        let mut roles: HashMap<(usize, String), Role> = HashMap::new();
        let mut group_tensors: Vec<Vec<TensorEntry>> = vec![Vec::new(); graph.groups.len()];
        let mut states = Vec::with_capacity(graph.q4.len());
        for (wi, d) in graph.q4.iter().enumerate() {
            let k =
                keys.iter()
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
                if crate::bnb::FloatDtype::from_safetensors(e.dtype).is_none()
                    && e.dtype != Dtype::F64
                {
                    return Err(Error::WrongDtype {
                        file: model.shard_name(e.shard).into(),
                        tensor: tensor.clone(),
                        expected: "F32, F16 or BF16".into(),
                        actual: crate::index::dtype_name(e.dtype),
                    });
                }
                roles.insert((*group, tensor.clone()), Role::Dense(ValueId(vi), e.dtype));
                group_tensors[*group].push(e.clone());
            }
        }
        for ts in &mut group_tensors {
            ts.sort_by_key(|t| (t.shard, t.offset));
            ts.dedup_by(|a, b| a.name == b.name);
        }

        // Arena: each value lives from its definition (or its group's load) to its last use.
        let n_nodes = graph.nodes.len();
        let mut start = vec![0usize; graph.values.len()];
        let mut end = vec![0usize; graph.values.len()];
        for (ni, n) in graph.nodes.iter().enumerate() {
            start[n.output.0] = ni;
            end[n.output.0] = end[n.output.0].max(ni);
            for v in &n.inputs {
                end[v.0] = end[v.0].max(ni);
            }
        }
        let mut streamed_dense = vec![false; graph.values.len()];
        let group_bytes: Vec<u64> = group_tensors
            .iter()
            .map(|ts| ts.iter().map(|t| t.len).sum())
            .collect();
        for (vi, s) in graph.sources.iter().enumerate() {
            match s {
                Source::Input => start[vi] = 0,
                Source::Dense { group, .. } => {
                    start[vi] = first_use[*group].unwrap_or(0);
                    streamed_dense[vi] = true;
                }
                Source::Node => {}
            }
        }
        for o in &graph.outputs {
            end[o.0] = n_nodes;
        }
        let align_w = backend.arena_align_words().max(1);
        // The plan decides residency; resident dense weights then live for the whole run.
        let arena_guess = graph.activation_bytes();
        let mut budgets = opts.budgets;
        budgets.device_other_bytes += arena_guess;
        // The executor does not keep a host cache yet: plan without one, so the plan is true.
        budgets.host_cache_bytes = 0;
        let plan = MemoryPlan::new(
            graph
                .groups
                .iter()
                .zip(&group_bytes)
                .map(|(n, &b)| WeightGroup {
                    name: n.clone(),
                    bytes: b,
                })
                .collect(),
            budgets,
        )?;
        for (vi, s) in graph.sources.iter().enumerate() {
            if let Source::Dense { group, .. } = s {
                if plan.placement[*group] == Placement::Resident {
                    start[vi] = 0;
                    end[vi] = n_nodes;
                    streamed_dense[vi] = false;
                }
            }
        }
        let mut order: Vec<usize> = (0..graph.values.len())
            .filter(|&v| start[v] <= end[v])
            .collect();
        order.sort_by_key(|&v| (start[v], v));
        let mut live: Vec<(usize, usize, usize)> = Vec::new(); // (offset, len, end)
        let mut slices = vec![None; graph.values.len()];
        let mut arena_words = 0usize;
        for v in order {
            live.retain(|&(_, _, e)| e >= start[v]);
            let len = graph.values[v].numel().max(1);
            live.sort_unstable();
            let mut off = 0usize;
            for &(o, l, _) in &live {
                if off + len <= o {
                    break;
                }
                off = off.max((o + l).div_ceil(align_w) * align_w);
            }
            live.push((off, len, end[v]));
            slices[v] = Some(ArenaSlice {
                offset: off,
                len: graph.values[v].numel(),
            });
            arena_words = arena_words.max(off + len);
        }

        // Pool: resident weights in their own regions; streamed ones in two alternating slots.
        let pa = backend.pool_align_bytes().max(4);
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
            if plan.placement[d.group] != Placement::Streamed
                && plan.placement[d.group] != Placement::HostCached
            {
                views[wi] = place(&mut cursor, &states[wi], d);
            }
        }
        let streamed: Vec<usize> = {
            let mut g: Vec<usize> = (0..graph.groups.len())
                .filter(|&g| plan.placement[g] != Placement::Resident && first_use[g].is_some())
                .collect();
            g.sort_by_key(|&g| first_use[g]);
            g
        };
        for w in streamed.windows(3) {
            if last_use[w[0]] >= first_use[w[2]].unwrap_or(usize::MAX) {
                return Err(Error::Invalid(format!(
                    "weight group '{}' is still used after group '{}' starts: streamed groups must be used in order",
                    graph.groups[w[0]], graph.groups[w[2]]
                )));
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
        backend.allocate(arena_words.max(1), pool_bytes)?;

        let scratch = vec![Q4Scratch::default(); graph.q4.len()];
        let state_bytes = states
            .iter()
            .map(|st| {
                let code = st
                    .quant_type
                    .code_table()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                (st.to_json_bytes(), code)
            })
            .collect();
        let stream_starts = streamed
            .iter()
            .filter_map(|&g| first_use[g].map(|n| (n, g)))
            .collect();
        let mut ex = Executor {
            graph,
            backend,
            plan,
            slices,
            views,
            states,
            roles,
            scratch,
            state_bytes,
            stream_starts,
            prefetch: None,
            arena_words,
            pool_bytes,
        };
        // Resident groups: one pass through the ring, then the ring streams the rest every step.
        let b = opts.budgets;
        let ring = StagingRing::new(b.ring_slots as usize, b.slot_bytes as usize, &HostAllocator)?;
        let resident: Vec<usize> = (0..ex.graph.groups.len())
            .filter(|&g| ex.plan.placement[g] == Placement::Resident)
            .collect();
        let chunks = chunk_schedule(
            resident.iter().map(|&g| (g, group_tensors[g].as_slice())),
            b.slot_bytes as usize,
        );
        let src = ThreadedSource::new(model.source(), opts.readers);
        let mut pf = Prefetcher::new(src, ring, chunks, Some(1))?;
        for &g in &resident {
            ex.load_group(&mut pf, g)?;
        }
        let ring = pf.into_ring();
        let chunks = chunk_schedule(
            streamed.iter().map(|&g| (g, group_tensors[g].as_slice())),
            b.slot_bytes as usize,
        );
        if !chunks.is_empty() {
            let src = ThreadedSource::new(model.source(), opts.readers);
            ex.prefetch = Some(Prefetcher::new(src, ring, chunks, None)?);
        }
        Ok(ex)
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

    fn handle(&mut self, chunk: &Chunk) -> Result<Vec<Box<dyn crate::ring::Fence>>> {
        let mut fences = Vec::new();
        for part in &chunk.spec.parts {
            let bytes = &chunk.bytes()[part.chunk_offset..part.chunk_offset + part.len];
            let at = part.tensor_offset as usize;
            let put = |buf: &mut Vec<u8>| {
                if buf.len() != part.tensor_len as usize {
                    *buf = vec![0; part.tensor_len as usize];
                }
                buf[at..at + bytes.len()].copy_from_slice(bytes);
            };
            match self
                .roles
                .get(&(chunk.spec.group, part.tensor.clone()))
                .cloned()
            {
                Some(Role::Packed(w)) => fences.push(
                    self.backend
                        .upload(self.views[w].packed.offset + part.tensor_offset, bytes)?,
                ),
                Some(Role::QuantMap(w)) => fences.push(
                    self.backend
                        .upload(self.views[w].code.offset + part.tensor_offset, bytes)?,
                ),
                Some(Role::Absmax(w)) => put(&mut self.scratch[w].absmax),
                Some(Role::NestedAbsmax(w)) => put(&mut self.scratch[w].nested_absmax),
                Some(Role::NestedMap(w)) => put(&mut self.scratch[w].nested_map),
                Some(Role::QuantState) | None => {}
                Some(Role::Dense(v, dtype)) => {
                    let es = element_size(dtype);
                    if at % es != 0 || bytes.len() % es != 0 {
                        return Err(Error::Invalid(format!("{}: a ring slot split an element; use a slot size that is a multiple of 8", part.tensor)));
                    }
                    let vals = bytes_to_f32(bytes, dtype).ok_or_else(|| {
                        Error::Invalid(format!("{}: not a float tensor", part.tensor))
                    })?;
                    let s =
                        self.slices[v.0].ok_or_else(|| Error::Invalid("unplaced weight".into()))?;
                    let words: Vec<u32> = vals.iter().map(|x| x.to_bits()).collect();
                    self.backend.write_arena(
                        ArenaSlice {
                            offset: s.offset + at / es,
                            len: words.len(),
                        },
                        &words,
                    )?;
                }
            }
        }
        Ok(fences)
    }

    fn load_group(&mut self, pf: &mut Prefetcher<ThreadedSource>, g: usize) -> Result<()> {
        let per = pf.chunks_per_step();
        loop {
            let Some(chunk) = pf.next_chunk()? else { break };
            if chunk.spec.group != g {
                return Err(Error::Invalid(format!(
                    "stream out of order: expected group {g}, got {}",
                    chunk.spec.group
                )));
            }
            let fences = self.handle(&chunk)?;
            let last_of_group = {
                let idx = (chunk.seq % per as u64) as usize;
                idx + 1 == per || pf_peek_group(pf, idx + 1) != Some(g)
            };
            let Chunk { slot, .. } = chunk;
            match fences.into_iter().next() {
                Some(f) => slot.release_after(f),
                None => drop(slot),
            }
            if last_of_group {
                break;
            }
        }
        // Double quantization undone on the host, bit-exactly, into the pool as f32.
        for wi in 0..self.graph.q4.len() {
            if self.graph.q4[wi].group != g {
                continue;
            }
            let s = &self.scratch[wi];
            let (json, code) = &self.state_bytes[wi];
            let nested = self.states[wi].nested.is_some();
            let absmax_dtype = if nested { Dtype::U8 } else { Dtype::F32 };
            let parts = QuantStateParts {
                key_quant_type: self.states[wi].quant_type,
                json,
                absmax: raw(absmax_dtype, &s.absmax),
                quant_map: raw(Dtype::F32, code),
                nested_absmax: nested.then(|| raw(Dtype::F32, &s.nested_absmax)),
                nested_quant_map: nested.then(|| raw(Dtype::F32, &s.nested_map)),
            };
            let state = QuantState::from_parts("stream", &self.graph.q4[wi].tensor, &parts)?;
            let bytes: Vec<u8> = state.absmax.iter().flat_map(|v| v.to_le_bytes()).collect();
            self.backend.upload(self.views[wi].absmax.offset, &bytes)?;
        }
        Ok(())
    }

    /// Runs one step: writes `inputs` (in graph-input order), runs every op (streaming the
    /// non-resident groups), returns the outputs.
    pub fn step(&mut self, inputs: &[HostTensor]) -> Result<(Vec<HostTensor>, ExecStats)> {
        if inputs.len() != self.graph.inputs.len() {
            return Err(Error::Invalid(format!(
                "{} inputs given, the graph has {}",
                inputs.len(),
                self.graph.inputs.len()
            )));
        }
        for (v, t) in self.graph.inputs.iter().zip(inputs) {
            if t.info != self.graph.values[v.0] {
                return Err(Error::Invalid(format!(
                    "input {}: {:?} given, {:?} expected",
                    v.0, t.info, self.graph.values[v.0]
                )));
            }
            let s = self.slices[v.0].ok_or_else(|| Error::Invalid("unplaced input".into()))?;
            self.backend.write_arena(s, &host_words(t))?;
        }
        let mut next_group = 0;
        let mut stats = ExecStats::default();
        for ni in 0..self.graph.nodes.len() {
            while next_group < self.stream_starts.len() && self.stream_starts[next_group].0 == ni {
                let g = self.stream_starts[next_group].1;
                let mut pf = self
                    .prefetch
                    .take()
                    .ok_or_else(|| Error::Invalid("no stream".into()))?;
                let r = self.load_group(&mut pf, g);
                if let Some(st) = pf.take_step_stats() {
                    stats.stream = st;
                }
                self.prefetch = Some(pf);
                r?;
                next_group += 1;
            }
            let node = &self.graph.nodes[ni];
            let operand = |v: &ValueId| -> Result<Operand> {
                Ok(Operand {
                    slice: self.slices[v.0]
                        .ok_or_else(|| Error::Invalid("unplaced value".into()))?,
                    info: self.graph.values[v.0].clone(),
                })
            };
            let ins: Vec<Operand> = node.inputs.iter().map(operand).collect::<Result<_>>()?;
            let out = operand(&node.output)?;
            let view = node.weight.map(|w| self.views[w.0].clone());
            if !self.backend.supports(&node.op) {
                return Err(Error::Invalid(format!(
                    "{} does not support {}",
                    self.backend.name(),
                    node.op.name()
                )));
            }
            self.backend.run(&node.op, &ins, view.as_ref(), &out)?;
        }
        let mut outs = Vec::with_capacity(self.graph.outputs.len());
        for v in &self.graph.outputs {
            let s = self.slices[v.0].ok_or_else(|| Error::Invalid("unplaced output".into()))?;
            let words = self.backend.read_arena(s)?;
            let info = &self.graph.values[v.0];
            outs.push(match info.elem {
                ElemType::F32 => HostTensor::f32(
                    &info.shape,
                    words.iter().map(|w| f32::from_bits(*w)).collect(),
                )?,
                ElemType::U32 => HostTensor::u32(&info.shape, words)?,
            });
        }
        Ok((outs, stats))
    }
}

fn raw(dtype: Dtype, bytes: &[u8]) -> RawTensor<'_> {
    RawTensor {
        dtype,
        numel: (bytes.len() / element_size(dtype)) as u64,
        bytes,
    }
}

fn pf_peek_group(pf: &Prefetcher<ThreadedSource>, idx: usize) -> Option<usize> {
    pf.chunk_spec(idx).map(|c| c.group)
}
