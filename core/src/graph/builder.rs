//! The [`Graph`] builder: values (program inputs, op outputs, dense model tensors, persistent
//! state such as a KV cache), 4-bit weights, weight groups (the unit the planner keeps resident
//! or streams), and programs (entry points over shared weights and state, e.g. prefill and
//! decode). Every op's output shape is inferred and checked when the op is added.

use crate::error::{Error, Result};
use crate::graph::{bf16_input_allowed, infer, ElemType, OpKind, Q4Info, ValueInfo};

/// A value of the graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ValueId(pub usize);

/// A 4-bit weight of the graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WeightId(pub usize);

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Source {
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
pub(crate) struct Q4Decl {
    pub(crate) tensor: String,
    pub(crate) group: usize,
    pub(crate) info: Q4Info,
}

/// One entry point of a graph: a run of nodes with its own inputs and outputs. Programs share
/// the weights and the state values, so that a language model's prefill (many tokens) and
/// decode (one token) run against one weight pool and one KV cache.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Program {
    pub(crate) name: String,
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) inputs: Vec<ValueId>,
    pub(crate) outputs: Vec<ValueId>,
}

/// A computation over activations and model weights, built op by op with shape checks.
#[derive(Debug, Clone)]
pub struct Graph {
    pub(crate) values: Vec<ValueInfo>,
    pub(crate) sources: Vec<Source>,
    /// Index of the node that defines each value (node outputs only).
    pub(crate) def_node: Vec<Option<usize>>,
    pub(crate) nodes: Vec<Node>,
    pub(crate) q4: Vec<Q4Decl>,
    pub(crate) groups: Vec<String>,
    pub(crate) programs: Vec<Program>,
    /// The first value declared with a shape no run can hold.
    pub(crate) invalid: Option<String>,
    /// Per (group, tensor): its dense weight value (a group loads a tensor into one value).
    pub(crate) dense: std::collections::HashMap<(usize, String), ValueId>,
    /// Per group: whether it is resident whatever the budget ([`Graph::pinned_group`]).
    pub(crate) pinned: Vec<bool>,
    /// Sets of low-rank paths beside linears ([`Graph::low_rank_set`]).
    pub(crate) low_rank: Vec<Vec<LowRankPath>>,
    /// In the current program: per adapter, the rows its paths apply to
    /// ([`Graph::select_adapter_rows`]).
    pub(crate) adapter_rows: Option<Vec<ValueId>>,
}

/// One adapter's path beside a linear: `y += scale * (x · downᵀ) · upᵀ + bias_scale * bias`
/// (a LoRA adapter's pair and bias delta).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LowRankPath {
    /// `[rank, in]` and `[out, rank]` (`None`: a bias delta only).
    pub pair: Option<(ValueId, ValueId)>,
    /// The pair's scaling.
    pub scale: f32,
    /// A bias delta `[out]` and its scale.
    pub bias: Option<(ValueId, f32)>,
    /// A full-weight delta `[out, in]` and its scale.
    pub full: Option<(ValueId, f32)>,
    /// The adapter it belongs to (an index into the model's adapters).
    pub adapter: usize,
    /// Its rank (0 without a pair).
    pub rank: usize,
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
            invalid: None,
            dense: Default::default(),
            pinned: Vec::new(),
            low_rank: Vec::new(),
            adapter_rows: None,
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
        self.adapter_rows = None;
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
        self.pinned.push(false);
        self.groups.len() - 1
    }

    /// Declares a weight group that stays resident whatever the budget (small weights every
    /// step reads, such as LoRA adapters: streaming them would add their bytes to every step).
    pub fn pinned_group(&mut self, name: &str) -> usize {
        let g = self.group(name);
        self.pinned[g] = true;
        g
    }

    /// Per group: whether it is pinned resident.
    pub fn pinned(&self) -> &[bool] {
        &self.pinned
    }

    /// Records a set of low-rank paths (to apply beside a linear later); its index.
    pub fn low_rank_set(&mut self, paths: Vec<LowRankPath>) -> usize {
        self.low_rank.push(paths);
        self.low_rank.len() - 1
    }

    /// From here to the end of the current program, adapter `a`'s paths apply to the rows where
    /// `rows[a]` (`[rows, r]`, r at least 1 and the adapter's largest rank, every column of a
    /// row the same: 1 or 0) is 1: its values multiply the paths' `x · downᵀ` and their bias
    /// deltas, so that rows of sequences without the adapter get exactly the base linear's
    /// result. `None`: every row.
    pub fn select_adapter_rows(&mut self, rows: Option<Vec<ValueId>>) {
        self.adapter_rows = rows;
    }

    /// The current program's adapter row selection ([`Graph::select_adapter_rows`]).
    pub fn adapter_rows(&self) -> Option<&[ValueId]> {
        self.adapter_rows.as_deref()
    }

    /// The low-rank paths of set `i`.
    pub fn low_rank_paths(&self, i: usize) -> &[LowRankPath] {
        &self.low_rank[i]
    }

    fn value(&mut self, info: ValueInfo, source: Source) -> ValueId {
        if self.invalid.is_none() {
            if let Err(e) = info.check() {
                self.invalid = Some(e.to_string());
            }
        }
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

    /// A dense model tensor (F32/F16/BF16 on disk) as an f32 value of `shape`. Declared again
    /// in the same group, it is the same value (a group loads each tensor once, into one
    /// value); again with another shape, the graph is invalid (reshape the value instead).
    pub fn dense_weight(&mut self, group: usize, tensor: &str, shape: &[usize]) -> ValueId {
        let key = (group, tensor.to_string());
        if let Some(&v) = self.dense.get(&key) {
            if self.values[v.0].shape != shape && self.invalid.is_none() {
                self.invalid = Some(format!(
                    "{tensor}: declared as {:?} and as {shape:?} in one group",
                    self.values[v.0].shape
                ));
            }
            return v;
        }
        let v = self.value(
            ValueInfo::f32(shape),
            Source::Dense {
                tensor: tensor.to_string(),
                group,
            },
        );
        self.dense.insert(key, v);
        v
    }

    /// A value that persists across steps and programs (a KV cache), zero at the start and
    /// changed only by in-place ops such as [`OpKind::CacheWrite`].
    pub fn state(&mut self, info: ValueInfo) -> ValueId {
        self.value(info, Source::State)
    }

    /// A 4-bit model weight (`tensor` is its base name, e.g. `model.layers.0.mlp.up_proj.weight`).
    pub fn q4_weight(&mut self, group: usize, tensor: &str, info: Q4Info) -> WeightId {
        if self.invalid.is_none() {
            if let Err(e) = ValueInfo::f32(&info.shape).check() {
                self.invalid = Some(format!("{tensor}: {e}"));
            }
        }
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
        self.check()?;
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
        // One value twice among an op's inputs (`concat(x, x)`) would be bound twice to one
        // range, and WebGPU refuses two writable bindings of one range: later uses read a copy.
        if op.in_place_input().is_none()
            && (1..inputs.len()).any(|i| inputs[..i].contains(&inputs[i]))
        {
            let mut own = inputs.to_vec();
            for i in 1..own.len() {
                if own[..i].contains(&own[i]) {
                    let shape = self.values[own[i].0].shape.clone();
                    own[i] = self.op(OpKind::Reshape { shape }, &[own[i]], None)?;
                }
            }
            return self.op(op, &own, weight);
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
        info.check()
            .map_err(|e| Error::Invalid(format!("{}: {e}", op.name())))?;
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

    /// Fails when a value was declared with a shape no run can hold (see [`ValueInfo::check`]);
    /// [`Graph::op`] and the planner call it, so a builder's later steps never see such a value.
    pub fn check(&self) -> Result<()> {
        match &self.invalid {
            Some(e) => Err(Error::Invalid(e.clone())),
            None => Ok(()),
        }
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

    /// This graph with its bf16 dense weights kept as bf16 (`None` when nothing changes): every
    /// dense weight for which `stored_bf16(tensor)` holds (the checkpoint stores it as bf16) and
    /// that only ops reading bf16 take (the weight of `Linear`, the table of `Embedding`, see
    /// [`bf16_input_allowed`]) becomes an [`ElemType::BF16`] value: half the bytes on the device
    /// and per use, the same results. The planner uses it for backends that read bf16 weights.
    pub fn with_bf16_weights(&self, stored_bf16: impl Fn(&str) -> bool) -> Option<Graph> {
        let mut ok: Vec<bool> = self
            .sources
            .iter()
            .zip(&self.values)
            .map(|(s, info)| match s {
                Source::Dense { tensor, .. } => info.elem == ElemType::F32 && stored_bf16(tensor),
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

    /// The weight groups' names, in declaration order.
    pub fn groups(&self) -> &[String] {
        &self.groups
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
    pub(crate) fn group_uses(&self, p: usize) -> Vec<Option<(usize, usize)>> {
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
}

#[cfg(test)]
mod dense_tests {
    use super::*;

    #[test]
    fn a_dense_tensor_declared_twice_in_a_group_is_one_value() {
        let mut g = Graph::new();
        let grp = g.group("g");
        let a = g.dense_weight(grp, "w", &[2, 3]);
        g.program("other");
        let b = g.dense_weight(grp, "w", &[2, 3]);
        assert_eq!(a, b, "the same value in both programs");
        let other = g.group("h");
        assert_ne!(
            g.dense_weight(other, "w", &[2, 3]),
            a,
            "another group's own value"
        );
        assert!(g.invalid.is_none());
        g.dense_weight(grp, "w", &[6]);
        assert!(g
            .invalid
            .as_deref()
            .is_some_and(|e| e.contains("declared as")));
    }

    /// WebGPU refuses an op bound twice to one range (Chromium's validation caught the Wan
    /// transformer's `concat(x, x)` for its two guidance sequences): a value given twice is read
    /// from a copy the second time.
    #[test]
    fn an_op_never_takes_one_value_twice() {
        let mut g = Graph::new();
        let x = g.input(ValueInfo::f32(&[2, 3]));
        let y = g
            .op(OpKind::Concat { axis: 0 }, &[x, x], None)
            .expect("concat");
        assert_eq!(g.values[y.0].shape, vec![4, 3]);
        for n in g.nodes() {
            let mut seen = n.inputs.clone();
            seen.dedup();
            assert_eq!(seen.len(), n.inputs.len(), "{:?} takes a value twice", n.op);
        }
        assert_eq!(g.nodes().len(), 2, "one copy, then the concat");
    }
}
