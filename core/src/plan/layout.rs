//! Where everything lives for one choice of resident groups: every graph value in the activation
//! arena (packed by lifetime), every 4-bit weight in the weight pool (resident regions, then two
//! alternating slots for the streamed groups), the order the streamed groups load in, and the
//! tensors each group reads. The plan picks the residency by calling [`Layout::new`]: what it
//! predicts is what the executor allocates.

use std::collections::HashMap;

use crate::backend::{ArenaSlice, PoolRegion, Q4View};
use crate::error::{Error, Result};
use crate::format::bnb::QuantStateJson;
use crate::format::safetensors::TensorEntry;
use crate::graph::{Graph, Source};

/// (first node, group) of each streamed group a program uses, in load order.
pub type StreamStarts = Vec<(usize, usize)>;

/// Where a 4-bit weight's small components land while its group loads: ranges of the shared
/// group buffer (one group loads at a time, so the buffer is as large as the largest group's).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Q4Scratch {
    /// f32 absmax bytes, or the u8 codes of a double-quantized absmax.
    pub absmax: std::ops::Range<usize>,
    /// f32 nested absmax (double quantization).
    pub nested_absmax: std::ops::Range<usize>,
    /// The 256-entry f32 nested code table (double quantization).
    pub nested_map: std::ops::Range<usize>,
}

/// What the layout depends on besides the residency: the graph as the backend runs it, the
/// quant state and the stored tensors of every weight, and the backend's alignment rules.
#[derive(Debug)]
pub(crate) struct LayoutInput<'a> {
    pub graph: &'a Graph,
    /// Per 4-bit weight of the graph.
    pub states: &'a [QuantStateJson],
    /// Per group: every stored tensor it reads (sorted by file and offset).
    pub group_tensors: &'a [Vec<TensorEntry>],
    /// Per value: its lifetime when its group streams (precomputed, see [`lifetimes`]).
    pub lifetimes: &'a [Vec<(usize, usize)>],
    pub arena_align_words: usize,
    pub pool_align_bytes: u64,
    /// The kernels' device workspace, allocated with the arena and the pool.
    pub device_workspace_bytes: u64,
}

/// The arena, the pool and the stream order for one residency.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    /// Per graph value: its arena words (`None`: never live).
    pub slices: Vec<Option<ArenaSlice>>,
    /// Words of the activation arena.
    pub arena_words: usize,
    /// Per 4-bit weight: its pool regions.
    pub views: Vec<Q4View>,
    /// Bytes of the weight pool.
    pub pool_bytes: u64,
    /// Per group: kept on the device after one read.
    pub resident: Vec<bool>,
    /// The groups read every step, in the order the ring streams them.
    pub streamed: Vec<usize>,
    /// Per program: (first node, group) of each streamed group it uses, in load order.
    pub stream_starts: Vec<StreamStarts>,
    /// Per group: the tensors read when it loads (a tensor that a resident group already
    /// holds, such as a tied embedding table, is read once, by that group).
    pub reads: Vec<Vec<TensorEntry>>,
    /// The kernels' device workspace (a GEMM's operands, the BLAS library's workspace).
    pub device_workspace_bytes: u64,
}

/// The pool slot streamed group `group` loads into (`streamed` in stream order): the groups take
/// the two slots in turn. `None` for a group that is not streamed.
pub fn stream_slot(streamed: &[usize], group: usize) -> Option<usize> {
    streamed.iter().position(|&g| g == group).map(|i| i % 2)
}

impl Layout {
    /// The pool slot a streamed group loads into (see [`stream_slot`]).
    pub fn slot_of(&self, group: usize) -> Option<usize> {
        stream_slot(&self.streamed, group)
    }

    /// Device bytes the layout allocates: the weight pool, the arena and the kernels'
    /// workspace.
    pub fn device_bytes(&self) -> u64 {
        self.pool_bytes + self.arena_words.max(1) as u64 * 4 + self.device_workspace_bytes
    }

    /// Lays out the arena and the pool for `resident` and orders the streamed groups.
    pub(crate) fn new(inp: &LayoutInput<'_>, resident: &[bool]) -> Result<Layout> {
        let g = inp.graph;
        let (slices, arena_words, served) = arena(inp, resident);
        let mut reads: Vec<Vec<TensorEntry>> = inp.group_tensors.to_vec();
        for (group, tensor) in served {
            reads[group].retain(|t| t.name != tensor);
        }
        let (streamed, stream_starts) = stream_order(g, resident, &reads)?;
        let (views, pool_bytes) = pool(inp, resident, &streamed);
        Ok(Layout {
            slices,
            arena_words,
            views,
            pool_bytes,
            resident: resident.to_vec(),
            streamed,
            stream_starts,
            reads,
            device_workspace_bytes: inp.device_workspace_bytes,
        })
    }

    /// Bytes of the arena that hold persistent state (the KV cache) and resident dense weights.
    pub(crate) fn arena_parts(&self, g: &Graph) -> (u64, u64) {
        let mut state = 0u64;
        let mut dense: HashMap<usize, u64> = HashMap::new();
        for (v, s) in g.sources.iter().enumerate() {
            let Some(sl) = self.slices[v] else { continue };
            match s {
                Source::State => state += sl.len as u64 * 4,
                Source::Dense { group, .. } if self.resident[*group] => {
                    dense.insert(sl.offset, sl.len as u64 * 4);
                }
                _ => {}
            }
        }
        (state, dense.values().sum())
    }
}

/// Per value, its lifetime as inclusive node intervals over all programs when its group streams:
/// from first to last use in each program (a program's inputs from its start, its outputs to its
/// end); a dense weight from its group's first to last use in each program that uses the group
/// (it is written when the group loads). Persistent state lives for the whole run. Independent of
/// the residency, so computed once.
pub(crate) fn lifetimes(g: &Graph) -> Vec<Vec<(usize, usize)>> {
    let n = g.nodes.len();
    let mut iv: Vec<Vec<(usize, usize)>> = vec![Vec::new(); g.values.len()];
    for (p, pr) in g.programs.iter().enumerate() {
        let uses = g.group_uses(p);
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
            let node = &g.nodes[ni];
            touch(node.output.0, ni);
            for v in &node.inputs {
                touch(v.0, ni);
            }
        }
        for &v in &pr.outputs {
            touch(v.0, pr.end);
        }
        for (vi, s) in g.sources.iter().enumerate() {
            if let Source::Dense { group, .. } = s {
                if let Some((first, last)) = uses[*group] {
                    touch(vi, first);
                    touch(vi, last);
                }
            }
        }
        let mut spans: Vec<(usize, (usize, usize))> = span.into_iter().collect();
        spans.sort_unstable();
        for (v, (a, b)) in spans {
            if g.sources[v] != Source::State {
                iv[v].push((a, b));
            }
        }
    }
    for (v, s) in g.sources.iter().enumerate() {
        if *s == Source::State {
            iv[v] = vec![(0, n)];
        }
    }
    iv
}

/// The arena: persistent state and resident dense weights at the bottom (live for the whole
/// run), then every other value packed first-fit by lifetime. A dense tensor of two groups
/// (tied embeddings) is stored once when one of them is resident: the other reads that copy.
/// Returns the slices, the arena's words and the (group, tensor) reads a resident copy serves.
fn arena(
    inp: &LayoutInput<'_>,
    resident: &[bool],
) -> (Vec<Option<ArenaSlice>>, usize, Vec<(usize, String)>) {
    let g = inp.graph;
    let align = inp.arena_align_words.max(1);
    let up = |x: usize| x.div_ceil(align) * align;
    let nv = g.values.len();
    let whole = |v: usize| match &g.sources[v] {
        Source::State => true,
        Source::Dense { group, .. } => resident[*group],
        _ => false,
    };
    // The first value of a resident group that holds each dense tensor.
    let mut owner: HashMap<&str, usize> = HashMap::new();
    for (v, s) in g.sources.iter().enumerate() {
        if let Source::Dense { tensor, group } = s {
            if resident[*group] {
                owner.entry(tensor.as_str()).or_insert(v);
            }
        }
    }
    let mut alias: Vec<Option<usize>> = vec![None; nv];
    let mut served = Vec::new();
    for (v, s) in g.sources.iter().enumerate() {
        if let Source::Dense { tensor, group } = s {
            if let Some(&f) = owner.get(tensor.as_str()) {
                if f != v && g.values[f] == g.values[v] {
                    alias[v] = Some(f);
                    let owner_group = match &g.sources[f] {
                        Source::Dense { group, .. } => *group,
                        _ => *group,
                    };
                    if owner_group != *group {
                        served.push((*group, tensor.clone()));
                    }
                }
            }
        }
    }
    let mut slices: Vec<Option<ArenaSlice>> = vec![None; nv];
    let mut bottom = 0usize;
    for v in (0..nv).filter(|&v| whole(v) && alias[v].is_none()) {
        slices[v] = Some(ArenaSlice {
            offset: bottom,
            len: g.values[v].words(),
        });
        bottom = up(bottom + g.values[v].words().max(1));
    }
    // Transient values by first use; a placed value whose last use is before the next value's
    // first use can never conflict again (linear scan).
    let lt = inp.lifetimes;
    let mut order: Vec<usize> = (0..nv)
        .filter(|&v| !whole(v) && alias[v].is_none() && !lt[v].is_empty())
        .collect();
    let first = |v: usize| lt[v].iter().map(|i| i.0).min().unwrap_or(0);
    let last = |v: usize| lt[v].iter().map(|i| i.1).max().unwrap_or(0);
    order.sort_by_key(|&v| (first(v), v));
    let overlap = |a: &[(usize, usize)], b: &[(usize, usize)]| {
        a.iter()
            .any(|&(s1, e1)| b.iter().any(|&(s2, e2)| s1 <= e2 && s2 <= e1))
    };
    let mut active: Vec<(usize, usize, usize)> = Vec::new(); // (offset, len, value)
    let mut conflicts: Vec<(usize, usize)> = Vec::new();
    let mut words = bottom;
    for v in order {
        let f = first(v);
        active.retain(|p| last(p.2) >= f);
        let len = g.values[v].words().max(1);
        conflicts.clear();
        conflicts.extend(
            active
                .iter()
                .filter(|p| overlap(&lt[p.2], &lt[v]))
                .map(|p| (p.0, p.1)),
        );
        conflicts.sort_unstable();
        let mut off = bottom;
        for &(o, l) in &conflicts {
            if off + len <= o {
                break;
            }
            off = off.max(up(o + l));
        }
        active.push((off, len, v));
        slices[v] = Some(ArenaSlice {
            offset: off,
            len: g.values[v].words(),
        });
        words = words.max(off + len);
    }
    for (v, a) in alias.iter().enumerate() {
        if let Some(f) = a {
            slices[v] = slices[*f];
        }
    }
    (slices, words.max(bottom), served)
}

/// The streamed groups (not resident, with something to read, used by some program) in the
/// order of their first use in the first program that uses them, and per program where each
/// one's load starts. Every program must use them in that order, and a group must be done before
/// the program's next group in its pool slot ([`stream_slot`]) starts.
fn stream_order(
    g: &Graph,
    resident: &[bool],
    reads: &[Vec<TensorEntry>],
) -> Result<(Vec<usize>, Vec<StreamStarts>)> {
    let uses: Vec<Vec<Option<(usize, usize)>>> =
        (0..g.programs.len()).map(|p| g.group_uses(p)).collect();
    let first_use = |grp: usize| uses.iter().find_map(|u| u[grp]).map(|u| u.0);
    let mut streamed: Vec<usize> = (0..g.groups.len())
        .filter(|&grp| !resident[grp] && !reads[grp].is_empty() && first_use(grp).is_some())
        .collect();
    streamed.sort_by_key(|&grp| first_use(grp));
    let mut starts = Vec::with_capacity(g.programs.len());
    for (p, u) in uses.iter().enumerate() {
        let mut order: Vec<usize> = streamed
            .iter()
            .copied()
            .filter(|&grp| u[grp].is_some())
            .collect();
        order.sort_by_key(|&grp| u[grp].map(|x| x.0));
        let in_stream: Vec<usize> = streamed
            .iter()
            .copied()
            .filter(|grp| order.contains(grp))
            .collect();
        if order != in_stream {
            return Err(Error::Invalid(format!(
                "program '{}' does not use the streamed weight groups in the order the ring \
                 streams them",
                g.programs[p].name
            )));
        }
        // A group's pool slot is overwritten by the next group of this program that loads
        // into it (two later, when the program uses every streamed group): its last use must
        // come before that group's first.
        for (i, &a) in order.iter().enumerate() {
            let slot = stream_slot(&streamed, a);
            let next = order[i + 1..]
                .iter()
                .find(|&&c| stream_slot(&streamed, c) == slot);
            if let (Some(&c), Some(ua)) = (next, u[a]) {
                if u[c].is_some_and(|uc| ua.1 >= uc.0) {
                    return Err(Error::Invalid(format!(
                        "weight group '{}' is still used after group '{}' starts: streamed \
                         groups must be used in order",
                        g.groups[a], g.groups[c]
                    )));
                }
            }
        }
        starts.push(
            order
                .iter()
                .filter_map(|&grp| u[grp].map(|x| (x.0, grp)))
                .collect(),
        );
    }
    Ok((streamed, starts))
}

/// The weight pool: every resident 4-bit weight in its own regions (packed codes, f32 absmax,
/// code table, each aligned), then two alternating slots for the streamed groups, each as large
/// as the largest group that lands in it.
fn pool(inp: &LayoutInput<'_>, resident: &[bool], streamed: &[usize]) -> (Vec<Q4View>, u64) {
    let g = inp.graph;
    let pa = inp.pool_align_bytes.max(4);
    let align = |x: u64| x.div_ceil(pa) * pa;
    let place = |cursor: &mut u64, s: &QuantStateJson, wi: usize| -> Q4View {
        let mut region = |len: u64| {
            let r = PoolRegion {
                offset: align(*cursor),
                len,
            };
            *cursor = r.offset + len;
            r
        };
        let d = &g.q4[wi];
        Q4View {
            packed: region(s.packed_bytes()),
            absmax: region(s.num_blocks() * 4),
            code: region(64),
            shape: d.info.shape.clone(),
            blocksize: d.info.blocksize,
        }
    };
    let mut views: Vec<Q4View> = Vec::with_capacity(g.q4.len());
    let mut cursor = 0u64;
    let mut slot_of: Vec<Option<usize>> = vec![None; g.groups.len()];
    for &grp in streamed {
        slot_of[grp] = stream_slot(streamed, grp);
    }
    let mut slot_len = [0u64; 2];
    let mut in_slot = vec![0u64; g.groups.len()];
    for (wi, d) in g.q4.iter().enumerate() {
        match slot_of[d.group] {
            Some(slot) => {
                let mut c = in_slot[d.group];
                views.push(place(&mut c, &inp.states[wi], wi));
                in_slot[d.group] = c;
                slot_len[slot] = slot_len[slot].max(c);
            }
            None if resident[d.group] => views.push(place(&mut cursor, &inp.states[wi], wi)),
            // Neither resident nor streamed: never read (a group no program uses).
            None => views.push(Q4View {
                packed: Default::default(),
                absmax: Default::default(),
                code: Default::default(),
                shape: d.info.shape.clone(),
                blocksize: d.info.blocksize,
            }),
        }
    }
    let base = [align(cursor), align(align(cursor) + slot_len[0])];
    for (wi, d) in g.q4.iter().enumerate() {
        if let Some(slot) = slot_of[d.group] {
            let v = &mut views[wi];
            for r in [&mut v.packed, &mut v.absmax, &mut v.code] {
                r.offset += base[slot];
            }
        }
    }
    (views, align(base[1] + slot_len[1]).max(pa))
}

/// Per 4-bit weight, where its small components land in the group buffer, and the buffer's
/// size: the largest group's components, and the largest absmax (decoded to f32 on its way into
/// the pool).
pub(crate) fn scratch(g: &Graph, states: &[QuantStateJson]) -> (Vec<Q4Scratch>, usize, usize) {
    let mut scratch = vec![Q4Scratch::default(); g.q4.len()];
    let mut cursor = vec![0usize; g.groups.len()];
    let mut largest_absmax = 0usize;
    for (wi, d) in g.q4.iter().enumerate() {
        let st = &states[wi];
        let nblocks = st.num_blocks() as usize;
        let c = &mut cursor[d.group];
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
    let buf = cursor.iter().copied().max().unwrap_or(0);
    (scratch, buf, largest_absmax)
}
