//! The [`Encoder`]: a BERT graph bound to a backend, one (padded, masked) sequence per step.

use crate::error::{Error, Result};
use crate::exec::{ExecStats, Executor};
use crate::graph::HostTensor;
use crate::io::model::ModelIndex;
use crate::models::bert::{build, BertConfig, BertGraph, Pooling};

/// An encoder bound to a backend: one sequence per step, weights streamed as the plan says.
pub struct Encoder<B: crate::backend::Backend> {
    ex: Executor<B>,
    /// The configuration.
    pub config: BertConfig,
    /// The sequence length the graph was built for (shorter inputs are padded).
    pub seq_len: usize,
}

impl<B: crate::backend::Backend> std::fmt::Debug for Encoder<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder")
            .field("seq_len", &self.seq_len)
            .finish()
    }
}

impl<B: crate::backend::Backend> Encoder<B> {
    /// Builds the graph for `seq_len` tokens, plans memory and loads the resident weights.
    pub fn new(
        model: &ModelIndex,
        backend: B,
        seq_len: usize,
        opts: crate::exec::ExecOptions,
    ) -> Result<Self> {
        Self::from_graph(build(model, seq_len)?, model, backend, opts)
    }

    /// An encoder over an already built graph.
    pub fn from_graph(
        bg: BertGraph,
        model: &ModelIndex,
        backend: B,
        opts: crate::exec::ExecOptions,
    ) -> Result<Self> {
        let ex = Executor::new(bg.graph, model, backend, opts)?;
        Ok(Encoder {
            ex,
            config: bg.config,
            seq_len: bg.seq_len,
        })
    }

    /// The executor (its plan, its backend).
    pub fn executor(&self) -> &Executor<B> {
        &self.ex
    }

    /// The last hidden state `[seq_len, hidden]` of `ids` (at most `seq_len` of them; the rest
    /// is padding), with `type_ids` (zeros when `None`).
    pub fn forward(
        &mut self,
        ids: &[u32],
        type_ids: Option<&[u32]>,
    ) -> Result<(Vec<f32>, Vec<f32>, ExecStats)> {
        let (t, n) = (self.seq_len, ids.len());
        if n == 0 || n > t {
            return Err(Error::Invalid(format!(
                "{n} tokens for an encoder built for 1 to {t}"
            )));
        }
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.config.vocab) {
            return Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.config.vocab
            )));
        }
        let types = type_ids.map(<[u32]>::to_vec).unwrap_or_else(|| vec![0; n]);
        if types.len() != n || types.iter().any(|&x| x as usize >= self.config.type_vocab) {
            return Err(Error::Invalid(format!(
                "token_type_ids must be {n} values below {}",
                self.config.type_vocab
            )));
        }
        let pad = |mut v: Vec<u32>| {
            v.resize(t, 0);
            v
        };
        let mask: Vec<f32> = (0..t).map(|i| if i < n { 1.0 } else { 0.0 }).collect();
        let inputs = [
            HostTensor::u32(&[t], pad(ids.to_vec()))?,
            HostTensor::u32(&[t], pad(types))?,
            HostTensor::u32(&[t], (0..t as u32).collect())?,
            HostTensor::f32(&[t], mask.clone())?,
        ];
        let (out, stats) = self.ex.step(&inputs)?;
        let states = out
            .into_iter()
            .next()
            .ok_or_else(|| Error::Invalid("the encoder graph has no output".into()))?
            .into_f32();
        crate::error::check_finite(&states, || "the encoder's hidden states".to_string())?;
        Ok((states, mask, stats))
    }

    /// The sentence embedding of `ids` with `pooling`.
    pub fn embed(&mut self, ids: &[u32], pooling: &Pooling) -> Result<(Vec<f32>, ExecStats)> {
        let (states, mask, stats) = self.forward(ids, None)?;
        let v = pooling.pool(&states, &mask, self.config.hidden);
        crate::error::check_finite(&v, || "the sentence embedding".to_string())?;
        Ok((v, stats))
    }
}
