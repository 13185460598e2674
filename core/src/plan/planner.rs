//! The planner: a graph bound to a model's stored tensors and a backend's rules, which lays out
//! arena and pool for a residency and chooses the residency that fits the budgets.

use std::collections::HashMap;

use super::*;

/// A graph bound to a model's stored tensors and a backend's rules: everything the planner needs,
/// gathered (and checked against the model) once; [`Planner::plan`] then costs nothing but
/// arithmetic on it.
#[derive(Debug, Clone)]
pub struct Planner {
    graph: Graph,
    rules: Rules,
    keys: Vec<Bnb4bitKeys>,
    states: Vec<QuantStateJson>,
    dense_dtypes: Vec<Option<Dtype>>,
    group_tensors: Vec<Vec<TensorEntry>>,
    lifetimes: Vec<Vec<(usize, usize)>>,
    scratch: Vec<Q4Scratch>,
    loader_bytes: u64,
}

impl Planner {
    /// Binds `graph` to `model` for a backend with `rules`: on a backend that reads bf16 dense
    /// weights as stored, the model's bf16 weights stay bf16 ([`Graph::with_bf16_weights`]).
    /// Every tensor the graph reads is checked against the model's index here (names, shapes,
    /// dtypes, quant states), before any weight byte is read.
    pub fn new(graph: Graph, model: &ModelIndex, rules: Rules) -> Result<Self> {
        graph.check()?;
        if let Some(e) = &rules.unsupported {
            return Err(Error::Invalid(e.clone()));
        }
        if let Some(c) = &model.config {
            QuantizationConfig::of_config(&model.locate("config.json"), c)?;
        }
        let graph = if rules.host_memory {
            graph
                .with_bf16_weights(|t| model.get(t).is_some_and(|e| e.dtype == Dtype::BF16))
                .unwrap_or(graph)
        } else {
            graph
        };
        let mut keys = Vec::with_capacity(graph.q4.len());
        let mut states = Vec::with_capacity(graph.q4.len());
        let mut group_tensors: Vec<Vec<TensorEntry>> = vec![Vec::new(); graph.groups.len()];
        for d in &graph.q4 {
            let k = model.q4_keys(&d.tensor)?;
            let state = model.quant_state_json(k)?;
            let shape: Vec<usize> = state.shape.iter().map(|&x| x as usize).collect();
            if shape != d.info.shape || state.blocksize as usize != d.info.blocksize {
                return Err(Error::Invalid(format!(
                    "{}: the graph expects {:?} blocksize {}, the model has {:?} blocksize {}",
                    d.tensor, d.info.shape, d.info.blocksize, shape, state.blocksize
                )));
            }
            for name in k.all_keys() {
                group_tensors[d.group].push(model.require(name)?.clone());
            }
            keys.push(k.clone());
            states.push(state);
        }
        check_adapters_applied(&graph, model)?;
        let mut dense_dtypes = vec![None; graph.values.len()];
        for (vi, s) in graph.sources.iter().enumerate() {
            let Source::Dense { tensor, group } = s else {
                continue;
            };
            let e = model.require(tensor)?;
            let info = &graph.values[vi];
            if e.numel() != info.numel() as u64 {
                return Err(Error::Invalid(format!(
                    "{tensor}: {:?} in the model, {:?} in the graph",
                    e.shape, info.shape
                )));
            }
            if !matches!(e.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F64) {
                return Err(Error::WrongDtype {
                    file: model.shard_name(e.shard).into(),
                    tensor: tensor.clone(),
                    expected: "F32, F16 or BF16".into(),
                    actual: dtype_name(e.dtype),
                });
            }
            if info.elem == ElemType::BF16 && (e.dtype != Dtype::BF16 || !rules.host_memory) {
                return Err(Error::Invalid(format!(
                    "{tensor}: a bf16 value of the graph, but the model stores {} and the \
                     backend reads bf16 weights: {}",
                    dtype_name(e.dtype),
                    rules.host_memory
                )));
            }
            dense_dtypes[vi] = Some(e.dtype);
            group_tensors[*group].push(e.clone());
        }
        for ts in &mut group_tensors {
            ts.sort_by_key(|t| (t.shard, t.offset));
            ts.dedup_by(|a, b| a.name == b.name);
        }
        let lifetimes = layout::lifetimes(&graph);
        let (scratch, group_buf, absmax_buf) = layout::scratch(&graph, &states);
        // A device backend gets dense weights through host copies made a piece at a time.
        let dense_piece_bytes = if !rules.host_memory && dense_dtypes.iter().any(Option::is_some) {
            DENSE_PIECE_HOST_BYTES
        } else {
            0
        };
        Ok(Planner {
            graph,
            rules,
            keys,
            states,
            dense_dtypes,
            group_tensors,
            lifetimes,
            scratch,
            loader_bytes: (group_buf + absmax_buf) as u64 + dense_piece_bytes,
        })
    }

    /// The graph as the backend runs it.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The backend's rules the plans follow.
    pub fn rules(&self) -> Rules {
        self.rules.clone()
    }

    /// Per 4-bit weight of the graph: its state-dict keys.
    pub fn keys(&self) -> &[Bnb4bitKeys] {
        &self.keys
    }

    /// Per 4-bit weight of the graph: its quant state.
    pub fn states(&self) -> &[QuantStateJson] {
        &self.states
    }

    /// Per graph value: the stored dtype of a dense weight (`None` for other values).
    pub fn dense_dtypes(&self) -> &[Option<Dtype>] {
        &self.dense_dtypes
    }

    /// Per 4-bit weight: where its small components land in the loader's group buffer.
    pub fn scratch(&self) -> &[Q4Scratch] {
        &self.scratch
    }

    /// The loader's group buffer: large enough for any group's small quant-state tensors.
    pub fn group_buffer_bytes(&self) -> usize {
        self.scratch
            .iter()
            .flat_map(|s| [s.absmax.end, s.nested_absmax.end, s.nested_map.end])
            .max()
            .unwrap_or(0)
    }

    /// The layout for one residency (`resident[g]` per group).
    pub fn layout(&self, resident: &[bool]) -> Result<Layout> {
        Layout::new(
            &LayoutInput {
                graph: &self.graph,
                states: &self.states,
                group_tensors: &self.group_tensors,
                lifetimes: &self.lifetimes,
                arena_align_words: self.rules.arena_align_words,
                pool_align_bytes: self.rules.pool_align_bytes,
                device_workspace_bytes: self.rules.device_workspace_bytes,
            },
            resident,
        )
    }

    /// The smallest device budget that runs the graph: every group streamed.
    pub fn min_device_bytes(&self) -> Result<u64> {
        Ok(self.layout(self.graph.pinned())?.device_bytes())
    }

    /// The device budget that keeps every group resident.
    pub fn resident_device_bytes(&self) -> Result<u64> {
        Ok(self
            .layout(&vec![true; self.graph.groups.len()])?
            .device_bytes())
    }

    /// Decides residency for `budgets` and returns the plan with its layout. Groups are kept
    /// resident, offered in [`spread_order`], while the layout with them still fits the device budget
    /// (every group streams with `stream_all`); the layout returned is the one whose figures
    /// the plan reports.
    pub fn plan(&self, budgets: Budgets, stream_all: bool) -> Result<(MemoryPlan, Layout)> {
        let available = crate::io::machine::available_memory_bytes();
        self.plan_within(budgets, stream_all, available)
    }

    /// [`Planner::plan`] on a machine whose available memory (`None`: unknown) was read
    /// already (the budget decision plans many times and reads the machine once).
    pub fn plan_within(
        &self,
        budgets: Budgets,
        stream_all: bool,
        available: Option<u64>,
    ) -> Result<(MemoryPlan, Layout)> {
        if budgets.ring_slots == 0 || budgets.slot_bytes < MIN_SLOT_BYTES {
            return Err(Error::Invalid(format!(
                "the staging ring needs at least 1 slot of at least {} ({} slots x {} given): \
                 use --slots 1 or more and --slot-size {} or more",
                fmt_bytes(MIN_SLOT_BYTES),
                budgets.ring_slots,
                fmt_bytes(budgets.slot_bytes),
                MIN_SLOT_BYTES
            )));
        }
        crate::io::machine::check_alloc_within(
            available,
            budgets.ring_slots.saturating_mul(budgets.slot_bytes),
            &format!(
                "a staging ring of {} slots x {}",
                budgets.ring_slots,
                fmt_bytes(budgets.slot_bytes)
            ),
        )?;
        let n = self.graph.groups.len();
        // Pinned groups (adapters) are resident in every plan, the smallest included.
        let mut resident = self.graph.pinned().to_vec();
        let mut lay = self.layout(&resident)?;
        let all = (!stream_all)
            .then(|| self.layout(&vec![true; n]))
            .transpose()?;
        let min = lay.device_bytes();
        // Every group resident may be less than every group streamed (streaming adds staging
        // and per-group device buffers; a small model with large activations): it is tried
        // first.
        let all_fits = all
            .as_ref()
            .is_some_and(|a| a.device_bytes() <= budgets.device_bytes);
        if min > budgets.device_bytes && !all_fits {
            let largest = (0..n)
                .filter(|&g| !lay.reads[g].is_empty())
                .max_by_key(|&g| lay.reads[g].iter().map(|t| t.len).sum::<u64>());
            return Err(Error::Invalid(format!(
                "device budget {} cannot hold the run: with every weight group streamed it needs \
                 a weight pool of {} (two groups at a time{}) and an arena of {} (activations, \
                 KV cache, streamed dense weights): use --device-budget {} or more",
                fmt_bytes(budgets.device_bytes),
                fmt_bytes(lay.pool_bytes),
                largest
                    .map(|g| format!(", the largest '{}'", self.graph.groups[g]))
                    .unwrap_or_default(),
                fmt_bytes(lay.arena_words.max(1) as u64 * 4),
                fmt_bytes(min)
            )));
        }
        if let Some(all) = all.filter(|a| a.device_bytes() <= budgets.device_bytes) {
            // Everything resident fits: the greedy pass below could leave a group streamed
            // whose residency only fits once a later group (a tied head) is resident too.
            lay = all;
        } else if !stream_all {
            for g in spread_order(n) {
                if resident[g] {
                    continue;
                }
                resident[g] = true;
                let candidate = self.layout(&resident)?;
                if candidate.device_bytes() <= budgets.device_bytes {
                    lay = candidate;
                } else {
                    resident[g] = false;
                }
            }
        }
        Ok((self.describe(&lay, budgets), lay))
    }

    /// The plan's figures for a layout.
    fn describe(&self, lay: &Layout, budgets: Budgets) -> MemoryPlan {
        let mut groups: Vec<GroupPlan> = (0..self.graph.groups.len())
            .map(|g| GroupPlan {
                name: self.graph.groups[g].clone(),
                bytes: lay.reads[g].iter().map(|t| t.len).sum(),
                placement: if lay.resident[g] {
                    Placement::Resident
                } else {
                    Placement::Streamed
                },
                pinned: self.graph.pinned()[g],
            })
            .collect();
        // The host tier: streamed groups, offered in spread order, while they fit its budget; none
        // where host and device are the same memory.
        // A group that shares a tensor with another streamed group (tied embeddings) stays with
        // the source: the host tier keeps chunks by their place in the file, and both groups
        // would read the one copy.
        let mut host_tier_bytes = 0u64;
        if !self.rules.host_memory {
            let mut readers: HashMap<&str, usize> = HashMap::new();
            for &g in &lay.streamed {
                for t in &lay.reads[g] {
                    *readers.entry(t.name.as_str()).or_default() += 1;
                }
            }
            for i in spread_order(lay.streamed.len()) {
                let g = lay.streamed[i];
                let shared = lay.reads[g].iter().any(|t| readers[t.name.as_str()] > 1);
                let b = groups[g].bytes;
                if shared || host_tier_bytes + b > budgets.host_tier_bytes {
                    continue;
                }
                host_tier_bytes += b;
                groups[g].placement = Placement::Host;
            }
        }
        let streamed_bytes_per_step: u64 = lay.streamed.iter().map(|&g| groups[g].bytes).sum();
        let in_place_bytes_per_step = if self.rules.host_memory && budgets.ring_slots >= 2 {
            // What the loader may lend: a streamed packed weight that arrives whole in one slot.
            lay.streamed
                .iter()
                .flat_map(|&g| lay.reads[g].iter())
                .filter(|t| {
                    t.len <= budgets.slot_bytes && self.keys.iter().any(|k| k.base == t.name)
                })
                .map(|t| t.len)
                .sum()
        } else {
            0
        };
        let (state_bytes, resident_dense_bytes) = lay.arena_parts(&self.graph);
        let ring_bytes = budgets.ring_slots.saturating_mul(budgets.slot_bytes);
        MemoryPlan {
            groups,
            budgets,
            pool_bytes: lay.pool_bytes,
            arena_bytes: lay.arena_words.max(1) as u64 * 4,
            state_bytes,
            resident_dense_bytes,
            ring_bytes,
            loader_bytes: self.loader_bytes,
            prefetch_depth: budgets.ring_slots,
            streamed_bytes_per_step,
            source_bytes_per_step: streamed_bytes_per_step - host_tier_bytes,
            host_tier_bytes,
            in_place_bytes_per_step,
            peak_device_bytes: lay.device_bytes(),
            workspace_bytes: self.rules.workspace_bytes,
            device_workspace_bytes: self.rules.device_workspace_bytes,
            peak_host_bytes: ring_bytes
                .saturating_add(self.loader_bytes)
                .saturating_add(self.rules.workspace_bytes)
                .saturating_add(host_tier_bytes),
            shared_memory: self.rules.host_memory,
            device_in_host_memory: self.rules.host_memory || self.rules.device_in_ram,
        }
    }
}

/// Every tensor of the adapters bound to `model` is read by `graph`: an adapter whose module
/// the graph does not run as a linear (an embedding, a tied head) is an error, not a no-op.
fn check_adapters_applied(graph: &Graph, model: &ModelIndex) -> Result<()> {
    let a = model.adapters();
    if a.paths.is_empty() {
        return Ok(());
    }
    let read: std::collections::HashSet<&str> = graph.weight_names().0.into_iter().collect();
    for (module, paths) in &a.paths {
        for p in paths {
            // Every tensor: the parts of a fused module share their down projection.
            let names = p
                .halves
                .iter()
                .flat_map(|(d, u)| [d, u])
                .chain(p.bias.iter().map(|b| &b.0))
                .chain(p.full.iter().map(|f| &f.0));
            if let Some(missing) = names.into_iter().find(|n| !read.contains(n.as_str())) {
                return Err(Error::Invalid(format!(
                    "LoRA adapter '{}' adapts {module} ({missing}), which this model does not \
                     compute as a linear layer (nibble applies adapters to linears only)",
                    a.names[p.adapter]
                )));
            }
        }
    }
    Ok(())
}

/// `0..n` in bit-reversed order (0, n/2, n/4, 3n/4, ...): every prefix is spread evenly over the
/// range. The planner offers groups to a tier in this order, so that the groups a tier cannot
/// hold are spread between those it does: the reads of each streamed group then overlap the
/// compute of the resident groups before it, where a run of resident groups followed by a run
/// of streamed ones would compute the first run with the disk idle (the ring holds only a few
/// slots ahead).
pub fn spread_order(n: usize) -> Vec<usize> {
    let bits = n.next_power_of_two().trailing_zeros();
    (0..n.next_power_of_two())
        .map(|i| {
            if bits == 0 {
                0
            } else {
                i.reverse_bits() >> (usize::BITS - bits)
            }
        })
        .filter(|&i| i < n)
        .collect()
}

impl Planner {
    /// The largest weight group that `budgets` leave streamed or in the host tier (both pass
    /// through the ring every step): the ring slots of the budgets' slot size it takes to be
    /// read in whole, its bytes and its name; `None` when every group is resident. A group's
    /// tensors are cut into slot-sized chunks and neighbours share a chunk only while they fit,
    /// so a group can take more slots than its bytes over the slot size.
    pub fn largest_streamed_group(
        &self,
        budgets: Budgets,
        stream_all: bool,
        available: Option<u64>,
    ) -> Result<Option<(u64, u64, String)>> {
        let (plan, lay) = self.plan_within(budgets, stream_all, available)?;
        let slot = budgets.slot_bytes as usize;
        Ok(lay
            .streamed
            .iter()
            .map(|&g| {
                let chunks =
                    crate::stream::prefetch::chunk_schedule([(g, lay.reads[g].as_slice())], slot)
                        .len() as u64;
                (chunks, plan.groups[g].bytes, plan.groups[g].name.clone())
            })
            .max_by_key(|l| (l.0, l.1)))
    }
}

/// The plan `backend` makes for `graph` on `model` with these budgets, without allocating or
/// reading any weight (lets a pipeline print the plans of all its phases first).
pub fn plan_graph<B: Backend + ?Sized>(
    graph: &Graph,
    model: &ModelIndex,
    backend: &mut B,
    budgets: Budgets,
    stream_all: bool,
) -> Result<MemoryPlan> {
    let planner = Planner::new(graph.clone(), model, Rules::of(backend, graph))?;
    Ok(planner.plan(budgets, stream_all)?.0)
}

/// The smallest device budget with which `backend` runs `graph` on `model` (every group
/// streamed): what a planner made for them reports.
pub fn min_device_bytes<B: Backend + ?Sized>(
    graph: &Graph,
    model: &ModelIndex,
    backend: &mut B,
) -> Result<u64> {
    Planner::new(graph.clone(), model, Rules::of(backend, graph))?.min_device_bytes()
}

/// The device budget with which `backend` keeps every group of `graph` resident.
pub fn resident_device_bytes<B: Backend + ?Sized>(
    graph: &Graph,
    model: &ModelIndex,
    backend: &mut B,
) -> Result<u64> {
    Planner::new(graph.clone(), model, Rules::of(backend, graph))?.resident_device_bytes()
}
