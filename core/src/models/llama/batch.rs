//! Batched decoding for a server: one pass over the layers (streamed or resident) computes one
//! token for each of several sequences, each with its own KV cache at its own position.
//!
//! The graph holds `slots` KV caches per layer (`[kv_heads, context + 1, head_dim]` each, for K
//! and V; the last position is a scratch row that no mask ever shows). Its programs are built
//! from one row-wise layer: the linears run with one row per token, and each row writes its key
//! and value into its own slot's cache at its own position and attends over that cache through
//! its own key mask. Two kinds of programs:
//! - `batch{n}` (n = 1, 2, 4, ... up to `slots`): row r is the next token of the sequence in slot
//!   r; a pass uses the smallest program that covers the highest busy slot, and the rows of idle
//!   slots in it write to the scratch row and are not read back.
//! - `chunk{s}` (one per slot): up to `chunk` consecutive prompt tokens of the sequence in slot s;
//!   padding rows write to the scratch row. Only the last real row's logits are computed.
//! - `mixed{n}` (n as for `batch`): `mix` rows per slot for slots 0..n, so that one pass takes the
//!   next prompt tokens of every sequence being prefilled and the next token of every sequence
//!   being decoded; each slot's last real row gives its logits.
//!
//! A sequence's arithmetic does not depend on the other rows of its pass: every op is row-wise
//! or reads only the sequence's own cache.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::exec::{ExecOptions, ExecStats, Executor};
use crate::graph::{ElemType, Graph, HostTensor, OpKind, ValueId, ValueInfo};
use crate::io::model::ModelIndex;
use crate::models::llama::graph::{finish_layer, qkv, refuse_unread_tensors, weights, Weights};
use crate::models::llama::LlamaConfig;
use crate::models::nn::Attention;
use crate::models::reshape;

/// What a batched decoder is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchShape {
    /// Sequences decoded together (KV cache slots).
    pub slots: usize,
    /// Positions each slot's cache holds (prompt + generated tokens).
    pub context: usize,
    /// Prompt tokens one prefill pass of one sequence takes.
    pub chunk: usize,
    /// Rows per slot of the mixed programs (prompt tokens a sequence feeds a mixed pass).
    pub mix: usize,
}

/// The batched decoder graph.
#[derive(Debug)]
pub struct BatchGraph {
    /// The graph.
    pub graph: Graph,
    /// The configuration it was built from.
    pub config: LlamaConfig,
    /// The shape it was built for.
    pub shape: BatchShape,
    /// `(rows, program)` of the batch programs, by rows ascending.
    pub batch: Vec<(usize, usize)>,
    /// The chunk program of each slot.
    pub chunk: Vec<usize>,
    /// `(slots, program)` of the mixed programs, by slots ascending.
    pub mixed: Vec<(usize, usize)>,
    /// Per LoRA adapter bound to the model: the width of its row-selection input (its largest
    /// rank).
    pub adapter_ranks: Vec<usize>,
}

/// Builds the batched decoder against `model`'s weights.
pub fn build_batched(model: &ModelIndex, shape: BatchShape) -> Result<BatchGraph> {
    let cfg = LlamaConfig::of(model)?;
    if shape.slots == 0 || shape.chunk == 0 || shape.mix == 0 || shape.context < 2 {
        return Err(Error::Invalid(format!(
            "batched decoder: {} slots, chunk {}, mix {}, context {} (need >= 1 slot, a chunk \
             and a mix >= 1, a context >= 2)",
            shape.slots, shape.chunk, shape.mix, shape.context
        )));
    }
    if shape.context > cfg.max_positions {
        return Err(Error::Invalid(format!(
            "a context of {} tokens exceeds the model's {} positions",
            shape.context, cfg.max_positions
        )));
    }
    if let Some(w) = cfg.sliding_window.filter(|&w| shape.context > w) {
        return Err(Error::Invalid(format!(
            "the model attends through a sliding window of {w} positions, which nibble does not \
             compute: the context ({}) must fit in it",
            shape.context
        )));
    }
    if let Some(l) = cfg.dynamic_rope_limit.filter(|&l| shape.context > l) {
        return Err(Error::Invalid(format!(
            "dynamic RoPE scaling changes the frequencies past {l} positions, which nibble does \
             not compute: the context ({}) must fit in {l}",
            shape.context
        )));
    }
    let mut g = Graph::new();
    let w = weights(&mut g, model, &cfg)?;
    let a = model.adapters();
    // A column at least: an adapter of bias deltas only selects its rows too.
    let ranks: Vec<usize> = (0..a.names.len()).map(|i| a.max_rank(i).max(1)).collect();
    let rows = shape.context + 1;
    let info = ValueInfo::f32(&[cfg.kv_heads, rows, cfg.head_dim]);
    // caches[layer][slot] = (K, V)
    let caches: Vec<Vec<(ValueId, ValueId)>> = (0..cfg.layers)
        .map(|_| {
            (0..shape.slots)
                .map(|_| (g.state(info.clone()), g.state(info.clone())))
                .collect()
        })
        .collect();
    let mut batch = Vec::new();
    let mut mixed = Vec::new();
    for n in slot_counts(shape.slots) {
        let slots: Vec<usize> = (0..n).collect();
        let name = format!("batch{n}");
        batch.push((
            n,
            rows_program(&mut g, &name, &cfg, &w, &caches, &slots, rows, 0, &ranks)?,
        ));
    }
    let chunk = (0..shape.slots)
        .map(|s| {
            let slots = vec![s; shape.chunk];
            rows_program(
                &mut g,
                &format!("chunk{s}"),
                &cfg,
                &w,
                &caches,
                &slots,
                rows,
                1,
                &ranks,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    if shape.mix > 1 {
        for n in slot_counts(shape.slots) {
            let slots: Vec<usize> = (0..n)
                .flat_map(|s| std::iter::repeat_n(s, shape.mix))
                .collect();
            let name = format!("mixed{n}");
            mixed.push((
                n,
                rows_program(&mut g, &name, &cfg, &w, &caches, &slots, rows, n, &ranks)?,
            ));
        }
    }
    refuse_unread_tensors(model, &g, w.tied)?;
    Ok(BatchGraph {
        graph: g,
        config: cfg,
        shape,
        batch,
        chunk,
        mixed,
        adapter_ranks: ranks,
    })
}

/// 1, 2, 4, ... up to `slots` (and `slots` itself).
fn slot_counts(slots: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut n = 1;
    while n < slots {
        v.push(n);
        n *= 2;
    }
    v.push(slots);
    v
}

/// One program whose row r is a token of the sequence in slot `slots[r]`.
///
/// Inputs: ids `u32[t]`, cos and sin `[t, head_dim/2]` (each row at its own position), then
/// per row its cache position `u32[1]`, then per row its key mask `[context + 1]`, then with
/// `gather` > 0 the rows whose logits are returned `u32[gather]`, then per LoRA adapter the rows
/// its paths apply to `[t, ranks[a]]` (all ones or all zeros per row). Output: logits
/// `[t, vocab]` (`[gather, vocab]`).
#[allow(clippy::too_many_arguments)]
fn rows_program(
    g: &mut Graph,
    name: &str,
    cfg: &LlamaConfig,
    w: &Weights,
    caches: &[Vec<(ValueId, ValueId)>],
    slots: &[usize],
    cache_rows: usize,
    gather: usize,
    ranks: &[usize],
) -> Result<usize> {
    let t = slots.len();
    let (hd, nh, nkv) = (cfg.head_dim, cfg.heads, cfg.kv_heads);
    let prog = g.program(name);
    let u32v = |shape: &[usize]| ValueInfo {
        shape: shape.to_vec(),
        elem: ElemType::U32,
    };
    let ids = g.input(u32v(&[t]));
    let cos = g.input(ValueInfo::f32(&[t, hd / 2]));
    let sin = g.input(ValueInfo::f32(&[t, hd / 2]));
    let pos: Vec<ValueId> = (0..t).map(|_| g.input(u32v(&[1]))).collect();
    let masks: Vec<ValueId> = (0..t)
        .map(|_| g.input(ValueInfo::f32(&[cache_rows])))
        .collect();
    let last = (gather > 0).then(|| g.input(u32v(&[gather])));
    let select: Vec<ValueId> = ranks
        .iter()
        .map(|&r| g.input(ValueInfo::f32(&[t, r])))
        .collect();
    if !select.is_empty() {
        g.select_adapter_rows(Some(select.clone()));
    }
    let scale = 1.0 / (hd as f32).sqrt();
    let mut x = g.op(OpKind::Embedding, &[ids, w.table], None)?;
    for (l, lw) in w.layers.iter().enumerate() {
        let (q, k, v) = qkv(g, cfg, lw, x, t, cos, sin)?;
        let mut a: Option<ValueId> = None;
        for (r, &s) in slots.iter().enumerate() {
            let row = |g: &mut Graph, v: ValueId, heads: usize| -> Result<ValueId> {
                let one = if t == 1 {
                    v
                } else {
                    g.op(
                        OpKind::Slice {
                            axis: 0,
                            start: r,
                            len: 1,
                        },
                        &[v],
                        None,
                    )?
                };
                // [1, heads, hd] and [heads, 1, hd] are the same bytes.
                reshape(g, one, &[heads, 1, hd])
            };
            let qr = row(g, q, nh)?;
            let kr = row(g, k, nkv)?;
            let vr = row(g, v, nkv)?;
            let (kc, vc) = caches[l][s];
            let kc = g.op(OpKind::CacheWrite, &[kc, kr, pos[r]], None)?;
            let vc = g.op(OpKind::CacheWrite, &[vc, vr, pos[r]], None)?;
            let ar = Attention::with_scale(scale)
                .masked(masks[r])
                .apply(g, qr, kc, vc)?;
            let ar = reshape(g, ar, &[1, nh * hd])?;
            a = Some(match a {
                None => ar,
                Some(prev) => g.op(OpKind::Concat { axis: 0 }, &[prev, ar], None)?,
            });
        }
        let a = a.ok_or_else(|| Error::Invalid("a program with no rows".into()))?;
        x = finish_layer(g, cfg, lw, x, a)?;
    }
    if let Some(last) = last {
        x = g.op(OpKind::Embedding, &[last, x], None)?;
        if !select.is_empty() {
            let gathered = select
                .iter()
                .map(|&m| g.op(OpKind::Embedding, &[last, m], None))
                .collect::<Result<Vec<_>>>()?;
            g.select_adapter_rows(Some(gathered));
        }
    }
    let xn = g.op(OpKind::RmsNorm { eps: cfg.rms_eps }, &[x, w.norm_f], None)?;
    let logits = w.head.apply(g, xn)?;
    g.output(logits);
    Ok(prog)
}

/// A batched decoder bound to a backend: sequences in slots, each prefilled a chunk per pass,
/// then decoded together one token per pass.
pub struct BatchDecoder<B: Backend> {
    ex: Executor<B>,
    /// The configuration.
    pub config: LlamaConfig,
    /// The shape it was built for.
    pub shape: BatchShape,
    batch: Vec<(usize, usize)>,
    chunk: Vec<usize>,
    mixed: Vec<(usize, usize)>,
    /// Per slot: positions filled so far.
    pos: Vec<usize>,
    /// Per slot: the key mask (1 for filled positions; never the scratch row).
    masks: Vec<Vec<f32>>,
    /// Per LoRA adapter: its row-selection width.
    adapter_ranks: Vec<usize>,
    /// Per slot: the adapter its sequence runs with (`None`: the base model alone).
    adapter: Vec<Option<usize>>,
}

impl<B: Backend> std::fmt::Debug for BatchDecoder<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchDecoder")
            .field("shape", &self.shape)
            .field("pos", &self.pos)
            .finish()
    }
}

impl<B: Backend> BatchDecoder<B> {
    /// Binds `bg` to `backend`: plans memory (the caches of every slot are part of the plan)
    /// and loads the resident weights.
    pub fn new(bg: BatchGraph, model: &ModelIndex, backend: B, opts: ExecOptions) -> Result<Self> {
        let ex = Executor::new(bg.graph, model, backend, opts)?;
        let rows = bg.shape.context + 1;
        Ok(BatchDecoder {
            ex,
            config: bg.config,
            shape: bg.shape,
            batch: bg.batch,
            chunk: bg.chunk,
            mixed: bg.mixed,
            pos: vec![0; bg.shape.slots],
            masks: vec![vec![0.0; rows]; bg.shape.slots],
            adapter_ranks: bg.adapter_ranks,
            adapter: vec![None; bg.shape.slots],
        })
    }

    /// The executor (plan, statistics).
    pub fn executor(&self) -> &Executor<B> {
        &self.ex
    }

    /// The executor, mutable (profiling).
    pub fn executor_mut(&mut self) -> &mut Executor<B> {
        &mut self.ex
    }

    /// Positions slot `slot` holds.
    pub fn position(&self, slot: usize) -> usize {
        self.pos[slot]
    }

    /// Empties slot `slot` for a new sequence (which runs without adapters until
    /// [`BatchDecoder::set_adapter`]).
    pub fn reset(&mut self, slot: usize) {
        self.pos[slot] = 0;
        self.masks[slot].iter_mut().for_each(|m| *m = 0.0);
        self.adapter[slot] = None;
    }

    /// The LoRA adapter (an index into the model's adapters) the sequence in `slot` runs with,
    /// `None` for the base model alone; other slots of the same passes keep theirs.
    pub fn set_adapter(&mut self, slot: usize, adapter: Option<usize>) -> Result<()> {
        if slot >= self.shape.slots {
            return Err(Error::Invalid(format!(
                "slot {slot} of {}",
                self.shape.slots
            )));
        }
        if let Some(a) = adapter.filter(|&a| a >= self.adapter_ranks.len()) {
            return Err(Error::Invalid(format!(
                "adapter #{a}: the model has {} adapters",
                self.adapter_ranks.len()
            )));
        }
        self.adapter[slot] = adapter;
        Ok(())
    }

    fn check(&self, slot: usize, ids: &[u32]) -> Result<()> {
        if slot >= self.shape.slots {
            return Err(Error::Invalid(format!(
                "slot {slot} of {}",
                self.shape.slots
            )));
        }
        if self.pos[slot] + ids.len() > self.shape.context {
            return Err(Error::Invalid(format!(
                "slot {slot} holds {} of {} positions: {} more do not fit",
                self.pos[slot],
                self.shape.context,
                ids.len()
            )));
        }
        match ids.iter().find(|&&t| t as usize >= self.config.vocab) {
            Some(bad) => Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.config.vocab
            ))),
            None => Ok(()),
        }
    }

    /// Inputs of a program whose rows are `(slot, id)` (`None`: a padding row that writes to
    /// its slot's scratch row), marking each real row's position filled.
    fn inputs(&mut self, rows: &[(usize, Option<u32>)], last: &[u32]) -> Result<Vec<HostTensor>> {
        let t = rows.len();
        let half = self.config.head_dim / 2;
        let scratch = self.shape.context;
        let (mut ids, mut cos, mut sin) = (Vec::with_capacity(t), Vec::new(), Vec::new());
        let (mut pos, mut masks) = (Vec::with_capacity(t), Vec::with_capacity(t));
        for &(slot, id) in rows {
            let p = match id {
                Some(_) => {
                    let p = self.pos[slot];
                    self.masks[slot][p] = 1.0;
                    self.pos[slot] += 1;
                    p
                }
                None => scratch,
            };
            ids.push(id.unwrap_or(0));
            let (c, s) = self.config.rope_at(p.min(scratch - 1), 1);
            cos.extend(c);
            sin.extend(s);
            pos.push(HostTensor::u32(&[1], vec![p as u32])?);
            masks.push(match id {
                Some(_) => HostTensor::f32(&[scratch + 1], self.masks[slot].clone())?,
                None => {
                    let mut m = vec![0.0; scratch + 1];
                    m[scratch] = 1.0;
                    HostTensor::f32(&[scratch + 1], m)?
                }
            });
        }
        let mut inputs = vec![
            HostTensor::u32(&[t], ids)?,
            HostTensor::f32(&[t, half], cos)?,
            HostTensor::f32(&[t, half], sin)?,
        ];
        inputs.extend(pos);
        inputs.extend(masks);
        if !last.is_empty() {
            inputs.push(HostTensor::u32(&[last.len()], last.to_vec())?);
        }
        for (a, &r) in self.adapter_ranks.iter().enumerate() {
            let mut sel = Vec::with_capacity(t * r);
            for &(slot, _) in rows {
                let on = if self.adapter[slot] == Some(a) {
                    1.0
                } else {
                    0.0
                };
                sel.extend(std::iter::repeat_n(on, r));
            }
            inputs.push(HostTensor::f32(&[t, r], sel)?);
        }
        Ok(inputs)
    }

    /// Feeds up to `shape.chunk` prompt tokens of the sequence in `slot` at its next positions in
    /// one pass; returns the logits `[vocab]` after the last of them.
    pub fn prefill(&mut self, slot: usize, ids: &[u32]) -> Result<(Vec<f32>, ExecStats)> {
        self.check(slot, ids)?;
        if ids.is_empty() || ids.len() > self.shape.chunk {
            return Err(Error::Invalid(format!(
                "a prefill pass takes 1 to {} tokens, {} given",
                self.shape.chunk,
                ids.len()
            )));
        }
        let rows: Vec<(usize, Option<u32>)> = (0..self.shape.chunk)
            .map(|i| (slot, ids.get(i).copied()))
            .collect();
        let inputs = self.inputs(&rows, &[ids.len() as u32 - 1])?;
        let (out, stats) = self.ex.step_program(self.chunk[slot], &inputs)?;
        let logits = out
            .into_iter()
            .next()
            .map(|t| t.into_f32())
            .unwrap_or_default();
        let p = self.pos[slot];
        crate::error::check_finite(&logits, || {
            format!("the model's output (logits) for the prompt up to position {p} in slot {slot}")
        })?;
        Ok((logits, stats))
    }

    /// One pass: the next token of each `(slot, id)` (distinct slots); returns their logits
    /// `[vocab]` in the same order.
    pub fn decode(&mut self, tokens: &[(usize, u32)]) -> Result<(Vec<Vec<f32>>, ExecStats)> {
        let mut busy = vec![None; self.shape.slots];
        for &(slot, id) in tokens {
            self.check(slot, &[id])?;
            if busy[slot].replace(id).is_some() {
                return Err(Error::Invalid(format!("slot {slot} twice in one pass")));
            }
        }
        let top =
            tokens.iter().map(|t| t.0 + 1).max().ok_or_else(|| {
                Error::Invalid("a decode pass needs at least one sequence".into())
            })?;
        let &(n, p) =
            self.batch.iter().find(|(n, _)| *n >= top).ok_or_else(|| {
                Error::Invalid(format!("no batch program covers slot {}", top - 1))
            })?;
        let rows: Vec<(usize, Option<u32>)> = (0..n).map(|s| (s, busy[s])).collect();
        let inputs = self.inputs(&rows, &[])?;
        let (out, stats) = self.ex.step_program(p, &inputs)?;
        let slots: Vec<usize> = tokens.iter().map(|t| t.0).collect();
        Ok((self.slot_logits(out, n, &slots)?, stats))
    }

    /// Whether mixed passes exist (`shape.mix` > 1).
    pub fn has_mixed(&self) -> bool {
        !self.mixed.is_empty()
    }

    /// One mixed pass: for each `(slot, ids)` (distinct slots, 1 to `shape.mix` tokens each:
    /// prompt tokens being prefilled, or a decoded token) the tokens at the slot's next
    /// positions; returns the logits `[vocab]` after each slot's last token, in the same order.
    pub fn step_mixed(
        &mut self,
        feeds: &[(usize, Vec<u32>)],
    ) -> Result<(Vec<Vec<f32>>, ExecStats)> {
        let mix = self.shape.mix;
        let mut busy: Vec<Option<&[u32]>> = vec![None; self.shape.slots];
        for (slot, ids) in feeds {
            self.check(*slot, ids)?;
            if ids.is_empty() || ids.len() > mix {
                return Err(Error::Invalid(format!(
                    "a mixed pass takes 1 to {mix} tokens per sequence, {} given",
                    ids.len()
                )));
            }
            if busy[*slot].replace(ids).is_some() {
                return Err(Error::Invalid(format!("slot {slot} twice in one pass")));
            }
        }
        let top = feeds
            .iter()
            .map(|f| f.0 + 1)
            .max()
            .ok_or_else(|| Error::Invalid("a mixed pass needs at least one sequence".into()))?;
        let &(n, p) =
            self.mixed.iter().find(|(n, _)| *n >= top).ok_or_else(|| {
                Error::Invalid(format!("no mixed program covers slot {}", top - 1))
            })?;
        let mut rows = Vec::with_capacity(n * mix);
        let mut last = Vec::with_capacity(n);
        for (s, ids) in busy.iter().enumerate().take(n) {
            let ids = ids.unwrap_or(&[]);
            last.push((s * mix + ids.len().max(1) - 1) as u32);
            rows.extend((0..mix).map(|i| (s, ids.get(i).copied())));
        }
        let inputs = self.inputs(&rows, &last)?;
        let (out, stats) = self.ex.step_program(p, &inputs)?;
        let slots: Vec<usize> = feeds.iter().map(|f| f.0).collect();
        Ok((self.slot_logits(out, n, &slots)?, stats))
    }

    /// The logits `[vocab]` of `slots` from a program's output `[n, vocab]` (row s: slot s),
    /// each checked finite.
    fn slot_logits(
        &self,
        out: Vec<HostTensor>,
        n: usize,
        slots: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        let all = out
            .into_iter()
            .next()
            .map(|t| t.into_f32())
            .unwrap_or_default();
        let vocab = self.config.vocab;
        if all.len() != n * vocab {
            return Err(Error::Invalid(format!(
                "the program returned {} logits for {n} slots of {vocab}",
                all.len()
            )));
        }
        slots
            .iter()
            .map(|&slot| {
                let l = all[slot * vocab..(slot + 1) * vocab].to_vec();
                let p = self.pos[slot] - 1;
                crate::error::check_finite(&l, || {
                    format!(
                        "the model's output (logits) for the token at position {p} in slot {slot}"
                    )
                })?;
                Ok(l)
            })
            .collect()
    }
}
