//! The exec layer: runs a [`Graph`] on a [`Backend`] with weights arriving through the streaming
//! pipeline. Before the first step it takes the plan and its layout from the planner (the
//! [`MemoryPlan`] printed is what gets allocated), allocates once and loads the resident groups;
//! during a step it asks for weight group g just before the first op that uses it and lets the
//! group two later reuse its pool slot once its ops have run.
//!
//! Owns: the step loop ([`Executor`]) and the loading of weight chunks from ring slots into the
//! weight pool (`load`).
//! May import: `plan`, `backend`, `graph`, `stream`, `io`, `format`, `error`.

mod load;

use std::collections::HashMap;

use crate::backend::{host_words, ArenaSlice, Backend, Operand};
use crate::error::{Error, Result};
use crate::format::bnb::QuantStateJson;
use crate::graph::{ElemType, Graph, HostTensor, OpKind, Source, ValueId};
use crate::io::model::ModelIndex;
use crate::io::source::{ByteSource, RangeSource, ThreadedSource};
use crate::plan::layout::{Layout, Q4Scratch};
use crate::plan::{Budgets, MemoryPlan, Planner, Rules};
use crate::stream::host_tier::TierStore;
use crate::stream::prefetch::{chunk_schedule, ChunkSpec, Prefetcher, StepStats};
use crate::stream::ring::{HostAllocator, StagingRing};
use load::{Held, Role};

/// How to run: budgets and streaming knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExecOptions {
    /// Memory budgets.
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

impl ExecOptions {
    /// The options of a budget decision ([`crate::plan::budget::decide`]), reading with
    /// `readers` threads.
    pub fn decided(d: &crate::plan::budget::BudgetDecision, readers: usize) -> Self {
        ExecOptions {
            budgets: d.budgets,
            readers,
            stream_all: d.stream_all,
            naive: false,
        }
    }
}

/// Per-step figures.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ExecStats {
    /// Streaming figures of the step (zero when everything is resident).
    pub stream: StepStats,
    /// Streamed bytes the backend read in place from ring slots instead of copying them into
    /// its pool (the optimized CPU backend; zero on GPUs).
    pub in_place_bytes: u64,
    /// Of the bytes uploaded through the ring this step, those the model's source delivered.
    pub source_bytes: u64,
    /// Of the bytes uploaded through the ring this step, those the host tier delivered (groups
    /// read once and kept in host memory).
    pub host_bytes: u64,
}

/// The resident groups' single pass, between planning and streaming.
struct ResidentLoad {
    pf: Prefetcher<Box<dyn ByteSource>>,
    groups: Vec<usize>,
    stream_chunks: Vec<ChunkSpec>,
}

/// The naive offloader's mode: no ring for the streamed groups.
struct Naive {
    source: std::sync::Arc<dyn RangeSource>,
}

/// The host tier's store (from the backend's slot allocator: pinned on CUDA, so that uploads
/// from it are DMA) and the last upload from it, which is waited for before the store may go:
/// uploads complete in order, so no copy reads the store after it.
struct TierMemory {
    /// Keeps the memory alive (the chunks handed out hold it too).
    _store: crate::stream::host_tier::SharedStore,
    fence: Option<Box<dyn crate::stream::ring::Fence>>,
    /// What memory it is, for the run's report (`None`: the tier holds nothing).
    memory: Option<String>,
}

impl Drop for TierMemory {
    fn drop(&mut self) {
        if let Some(f) = self.fence.take() {
            f.wait();
        }
    }
}

/// A graph bound to a model, a backend and a plan.
pub struct Executor<B: Backend> {
    graph: Graph,
    backend: B,
    plan: MemoryPlan,
    lay: Layout,
    /// Per 4-bit weight: its quant state (sizes, double quantization).
    states: Vec<QuantStateJson>,
    /// What each (group, tensor) read feeds: a tensor used by two groups (tied embeddings) is
    /// read once for each.
    roles: HashMap<(usize, String), Role>,
    /// Per 4-bit weight: where its small parts land in `group_buf`.
    scratch: Vec<Q4Scratch>,
    /// The loading group's absmax / nested components (see [`Q4Scratch`]).
    group_buf: Vec<u8>,
    /// Whether the backend has the host-memory capability (queried once).
    host_memory: bool,
    prefetch: Option<Prefetcher<Box<dyn ByteSource>>>,
    /// Zeros written over the state values before the first step and on `reset_state`.
    state_slices: Vec<ArenaSlice>,
    /// Reused buffer for a streamed weight's f32 absmax.
    absmax_bytes: Vec<u8>,
    /// Reused buffer for a streamed weight's nested absmax, as f32.
    nested_scales: Vec<f32>,
    /// The staging ring when nothing streams (kept to hand on to a later phase).
    spare_ring: Option<StagingRing>,
    naive: Option<Naive>,
    /// Per op kind (name, with the weight's shape for linears): calls and time, when profiling.
    profile: Option<HashMap<String, (u64, std::time::Duration)>>,
    /// Per group: streamed every step (its packed weights may be read in place from the slot).
    streamed_group: Vec<bool>,
    /// Per program and group: the last node that reads the group.
    group_last: Vec<Vec<Option<usize>>>,
    /// Per program: (last node that reads it, pool slot) of each streamed group it uses,
    /// by node (for [`Backend::group_used`]).
    slot_last: Vec<Vec<(usize, usize)>>,
    /// Ring slots whose packed weights the backend reads in place, until their group's last op.
    held: Vec<Held>,
    /// Bytes lent in place during the current step.
    in_place_bytes: u64,
    /// Per group: in the host tier.
    host_group: Vec<bool>,
    /// This step's bytes from the source and from the host tier.
    step_tier_bytes: (u64, u64),
    /// The host tier's memory, which its chunks are uploaded from after their first read.
    tier: Option<TierMemory>,
    /// Per group: its weights were seen finite when it was first loaded (dense values, quant
    /// maps, absmax after double quantization is undone); later loads skip the check.
    finite_seen: Vec<bool>,
}

impl<B: Backend> std::fmt::Debug for Executor<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("backend", &self.backend.name())
            .field("arena_words", &self.lay.arena_words)
            .finish()
    }
}

impl<B: Backend> Executor<B> {
    /// Plans memory, allocates the backend's arena and pool once, and loads resident weights.
    pub fn new(graph: Graph, model: &ModelIndex, backend: B, opts: ExecOptions) -> Result<Self> {
        Self::with_ring(graph, model, backend, opts, None)
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
        let rules = Rules::of(&mut backend, &graph);
        let host_memory = rules.host_memory;
        let planner = Planner::new(graph, model, rules)?;
        let (plan, lay) = planner.plan(opts.budgets, opts.stream_all)?;
        let roles = load::roles(&planner);
        let scratch = planner.scratch().to_vec();
        let group_buf_len = planner.group_buffer_bytes();
        let states = planner.states().to_vec();
        let graph = planner.graph().clone();
        drop(planner);
        backend.allocate(
            lay.arena_words.max(1),
            lay.pool_bytes,
            lay.device_workspace_bytes,
        )?;
        let n_groups = graph.groups.len();
        let mut streamed_group = vec![false; n_groups];
        for &g in &lay.streamed {
            streamed_group[g] = true;
        }
        let group_last: Vec<Vec<Option<usize>>> = (0..graph.programs.len())
            .map(|p| graph.group_uses(p).iter().map(|u| u.map(|u| u.1)).collect())
            .collect();
        let slot_last = group_last
            .iter()
            .map(|last| {
                let mut v: Vec<(usize, usize)> = lay
                    .streamed
                    .iter()
                    .filter_map(|&g| Some((last[g]?, lay.slot_of(g)?)))
                    .collect();
                v.sort_unstable();
                v
            })
            .collect();
        let state_slices: Vec<ArenaSlice> = (0..graph.values.len())
            .filter(|&v| graph.sources[v] == Source::State)
            .filter_map(|v| lay.slices[v])
            .collect();
        let mut group_buf = vec![0u8; group_buf_len];
        for page in group_buf.chunks_mut(4096) {
            page[0] = 0;
        }
        let b = opts.budgets;
        let resident: Vec<usize> = (0..n_groups).filter(|&g| lay.resident[g]).collect();
        let resident_chunks = chunk_schedule(
            resident.iter().map(|&g| (g, lay.reads[g].as_slice())),
            b.slot_bytes as usize,
        );
        let stream_chunks = chunk_schedule(
            lay.streamed.iter().map(|&g| (g, lay.reads[g].as_slice())),
            b.slot_bytes as usize,
        );
        let mut ex = Executor {
            graph,
            backend,
            plan,
            lay,
            states,
            roles,
            scratch,
            group_buf,
            host_memory,
            prefetch: None,
            state_slices,
            absmax_bytes: Vec::new(),
            nested_scales: Vec::new(),
            spare_ring: None,
            naive: None,
            profile: None,
            streamed_group,
            slot_last,
            group_last,
            held: Vec::new(),
            finite_seen: vec![false; n_groups],
            in_place_bytes: 0,
            host_group: vec![false; n_groups],
            step_tier_bytes: (0, 0),
            tier: None,
        };
        ex.reset_state()?;
        // Resident groups: one pass through the ring, then the ring streams the rest every step.
        let alloc = ex
            .backend
            .slot_allocator()
            .unwrap_or_else(|| Box::new(HostAllocator));
        let ring = match ring {
            Some(r)
                if r.slots() as u64 == b.ring_slots && r.slot_bytes() as u64 == b.slot_bytes =>
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
            None => {
                let slots = usize::try_from(b.ring_slots).map_err(|_| too_large("--slots"))?;
                let bytes = usize::try_from(b.slot_bytes).map_err(|_| too_large("--slot-size"))?;
                StagingRing::new(slots, bytes, alloc.as_ref())?
            }
        };
        let pf = Prefetcher::new(make_source(), ring, resident_chunks, Some(1))?;
        Ok((
            ex,
            ResidentLoad {
                pf,
                groups: resident,
                stream_chunks,
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
            ..
        } = load;
        let ring = pf.into_ring();
        if opts.naive {
            // The naive offloader keeps no staging ring: drop it after the resident loads.
            drop(ring);
            self.naive = Some(Naive {
                source: model.source(),
            });
        } else if chunks.is_empty() {
            self.spare_ring = Some(ring);
        } else {
            // The host tier sits in front of the source: its groups' chunks are kept after
            // their first read and later served from host memory.
            for (g, gp) in self.plan.groups.iter().enumerate() {
                self.host_group[g] = gp.placement == crate::plan::Placement::Host;
            }
            let keep: Vec<_> = chunks
                .iter()
                .filter(|c| self.host_group.get(c.group) == Some(&true))
                .map(|c| (c.file, c.offset, c.len))
                .collect();
            // Allocated once, now, from the memory the backend uploads fastest from (pinned on
            // CUDA); where the driver refuses that much, plain host memory, which only uploads
            // slower, and the executor says so.
            let any = !keep.is_empty();
            let backends = self
                .backend
                .slot_allocator()
                .filter(|_| any)
                .map(|a| TierStore::new(keep.iter().copied(), a.as_ref()));
            let (store, memory) = match backends {
                Some(Ok(s)) => (s, "pinned host memory".to_string()),
                other => (
                    TierStore::new(keep, &HostAllocator)?,
                    match other {
                        Some(Err(e)) => {
                            format!("plain host memory (the backend's allocation failed: {e})")
                        }
                        _ => "host memory".to_string(),
                    },
                ),
            };
            let store = std::sync::Arc::new(store);
            let source =
                crate::stream::host_tier::HostTierSource::new(make_source(), store.clone());
            self.tier = Some(TierMemory {
                _store: store,
                fence: None,
                memory: any.then_some(memory),
            });
            let source: Box<dyn ByteSource> = Box::new(source);
            self.prefetch = Some(Prefetcher::new(source, ring, chunks, None)?);
        }
        Ok(())
    }

    /// Bytes the stream's reads delivered from the model's source and from the host tier so
    /// far (counted as the reads complete; they run ahead of the steps by up to the ring).
    pub fn tier_totals(&self) -> (u64, u64) {
        self.prefetch
            .as_ref()
            .map(|p| p.delivered())
            .unwrap_or_default()
    }

    /// What memory holds the host tier (`pinned host memory` on CUDA, `host memory` on the
    /// other device backends, or the reason a pinned allocation fell back to plain memory);
    /// `None` without a host tier.
    pub fn host_tier_memory(&self) -> Option<&str> {
        self.tier.as_ref().and_then(|t| t.memory.as_deref())
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
        self.tier = None;
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
        (self.lay.arena_words, self.lay.pool_bytes)
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, mutable (tests inspect its capability's state).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
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
        let r = self.run_step(p, inputs);
        if r.is_err() {
            // Slots lent to the backend go back to the ring on every path.
            self.release_held(None);
        }
        r
    }

    fn run_step(
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
        (c.stats.source_bytes, c.stats.host_bytes) = std::mem::take(&mut self.step_tier_bytes);
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
        let r = self.run_step_async(p, inputs).await;
        if r.is_err() {
            self.release_held(None);
        }
        r
    }

    async fn run_step_async(
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
        (c.stats.source_bytes, c.stats.host_bytes) = std::mem::take(&mut self.step_tier_bytes);
        let mut words = Vec::new();
        for s in self.output_slices(p)? {
            words.push(self.backend.read_arena_async(s).await?);
        }
        Ok((self.outputs_from_words(p, words)?, c.stats))
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
            let s = self.lay.slices[v.0].ok_or_else(|| Error::Invalid("unplaced input".into()))?;
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
            if c.next_group < self.lay.stream_starts[p].len()
                && self.lay.stream_starts[p][c.next_group].0 == ni
            {
                return Ok(Some(self.lay.stream_starts[p][c.next_group].1));
            }
            let node = &self.graph.nodes[ni];
            let operand = |v: &ValueId| -> Result<Operand> {
                Ok(Operand {
                    slice: self.lay.slices[v.0]
                        .ok_or_else(|| Error::Invalid("unplaced value".into()))?,
                    info: self.graph.values[v.0].clone(),
                })
            };
            ins.clear();
            for v in &node.inputs {
                ins.push(operand(v)?);
            }
            let out = operand(&node.output)?;
            let view = node.weight.map(|w| &self.lay.views[w.0]);
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
            let sl = &self.slot_last[p];
            let from = sl.partition_point(|&(n, _)| n < ni);
            for &(_, slot) in sl[from..].iter().take_while(|&&(n, _)| n == ni) {
                self.backend.group_used(slot);
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
            .map(|v| self.lay.slices[v.0].ok_or_else(|| Error::Invalid("unplaced output".into())))
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
                    crate::format::dtype::bf16_words_to_f32(&words, info.numel()),
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

/// A size from the command line that does not fit this machine's address space.
fn too_large(what: &str) -> Error {
    Error::Invalid(format!("{what} is larger than this machine can address"))
}
