//! The [`Decoder`]: a decoder graph bound to a backend through the executor; the prompt in one
//! prefill pass, then one token per decode pass through the KV cache (each pass streamed like a
//! denoising step). Sync natively, awaited in the browser.

use crate::error::{Error, Result};
use crate::io::model::ModelIndex;
use crate::models::llama::{build, LlamaConfig, LlamaGraph, LlamaShape};

/// A decoder bound to a backend: prefill once, then one token per step through the KV cache.
pub struct Decoder<B: crate::backend::Backend> {
    ex: crate::exec::Executor<B>,
    /// The configuration.
    pub config: LlamaConfig,
    /// The shape the graph was built for.
    pub shape: LlamaShape,
    prefill: usize,
    decode: Option<usize>,
    pos: usize,
    mask: Vec<f32>,
}

impl<B: crate::backend::Backend> std::fmt::Debug for Decoder<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder")
            .field("shape", &self.shape)
            .field("pos", &self.pos)
            .finish()
    }
}

impl<B: crate::backend::Backend> Decoder<B> {
    /// Builds the graph, plans memory and loads the resident weights.
    pub fn new(
        model: &ModelIndex,
        backend: B,
        shape: LlamaShape,
        opts: crate::exec::ExecOptions,
    ) -> Result<Self> {
        Self::from_graph(build(model, shape)?, model, backend, opts)
    }

    /// A decoder over an already built graph.
    pub fn from_graph(
        lg: LlamaGraph,
        model: &ModelIndex,
        backend: B,
        opts: crate::exec::ExecOptions,
    ) -> Result<Self> {
        Self::with_ring(lg, model, backend, opts, None)
    }

    /// [`Decoder::from_graph`] streaming through a ring handed over from an earlier phase.
    pub fn with_ring(
        lg: LlamaGraph,
        model: &ModelIndex,
        backend: B,
        opts: crate::exec::ExecOptions,
        ring: Option<crate::stream::ring::StagingRing>,
    ) -> Result<Self> {
        let ex = crate::exec::Executor::with_ring(lg.graph, model, backend, opts, ring)?;
        Ok(Self::over(lg.config, lg.shape, lg.prefill, lg.decode, ex))
    }

    /// [`Decoder::from_graph`] for an event loop (the browser): weights come from the sources
    /// `make_source` makes, and resident groups are awaited.
    pub async fn from_graph_async(
        lg: LlamaGraph,
        model: &ModelIndex,
        backend: B,
        opts: crate::exec::ExecOptions,
        make_source: &mut dyn FnMut() -> Box<dyn crate::io::source::ByteSource>,
    ) -> Result<Self> {
        let ex =
            crate::exec::Executor::with_source_async(lg.graph, model, backend, opts, make_source)
                .await?;
        Ok(Self::over(lg.config, lg.shape, lg.prefill, lg.decode, ex))
    }

    fn over(
        config: LlamaConfig,
        shape: LlamaShape,
        prefill: usize,
        decode: Option<usize>,
        ex: crate::exec::Executor<B>,
    ) -> Self {
        Decoder {
            ex,
            config,
            shape,
            prefill,
            decode,
            pos: 0,
            mask: vec![0.0; shape.capacity],
        }
    }

    /// The executor, mutable (profiling, stream limits).
    pub fn executor_mut(&mut self) -> &mut crate::exec::Executor<B> {
        &mut self.ex
    }

    /// Ends the decoder: releases its device memory, gives back the backend and the ring.
    pub fn into_parts(self) -> (B, Option<crate::stream::ring::StagingRing>) {
        self.ex.into_parts()
    }

    /// The executor (plan, backend).
    pub fn executor(&self) -> &crate::exec::Executor<B> {
        &self.ex
    }

    /// Tokens in the cache so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&t| t as usize >= self.config.vocab) {
            Some(bad) => Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.config.vocab
            ))),
            None => Ok(()),
        }
    }

    /// Runs the prompt (exactly `shape.prompt` tokens) from position 0; returns the logits
    /// (`[prompt, vocab]` with `all_logits`, else the last position's) or the hidden states.
    pub fn prefill(&mut self, ids: &[u32]) -> Result<(Vec<f32>, crate::exec::ExecStats)> {
        let inputs = self.prefill_inputs(ids)?;
        let (out, stats) = self.ex.step_program(self.prefill, &inputs)?;
        self.prefilled();
        Ok((self.checked(first_f32(out), None)?, stats))
    }

    /// [`Decoder::prefill`] on an event loop (the browser).
    pub async fn prefill_async(
        &mut self,
        ids: &[u32],
    ) -> Result<(Vec<f32>, crate::exec::ExecStats)> {
        let inputs = self.prefill_inputs(ids)?;
        let (out, stats) = self.ex.step_program_async(self.prefill, &inputs).await?;
        self.prefilled();
        Ok((self.checked(first_f32(out), None)?, stats))
    }

    fn prefill_inputs(&self, ids: &[u32]) -> Result<[crate::graph::HostTensor; 4]> {
        let t = self.shape.prompt;
        if ids.len() != t {
            return Err(Error::Invalid(format!(
                "the graph was built for a prompt of {t} tokens, {} given",
                ids.len()
            )));
        }
        self.check_ids(ids)?;
        let half = self.config.head_dim / 2;
        let (cos, sin) = self.config.rope_at(0, t);
        let inputs = [
            crate::graph::HostTensor::u32(&[t], ids.to_vec())?,
            crate::graph::HostTensor::f32(&[t, half], cos)?,
            crate::graph::HostTensor::f32(&[t, half], sin)?,
            crate::graph::HostTensor::u32(&[1], vec![0])?,
        ];
        Ok(inputs)
    }

    fn prefilled(&mut self) {
        let t = self.shape.prompt;
        self.pos = t;
        self.mask.iter_mut().for_each(|m| *m = 0.0);
        let valid = t.min(self.mask.len());
        self.mask[..valid].iter_mut().for_each(|m| *m = 1.0);
    }

    /// Appends one token at the next position; returns its logits `[vocab]`.
    pub fn decode(&mut self, id: u32) -> Result<(Vec<f32>, crate::exec::ExecStats)> {
        let (p, inputs) = self.decode_inputs(id)?;
        let (out, stats) = self.ex.step_program(p, &inputs)?;
        self.pos += 1;
        Ok((self.checked(first_f32(out), Some(self.pos - 1))?, stats))
    }

    /// [`Decoder::decode`] on an event loop (the browser).
    pub async fn decode_async(&mut self, id: u32) -> Result<(Vec<f32>, crate::exec::ExecStats)> {
        let (p, inputs) = self.decode_inputs(id)?;
        let (out, stats) = self.ex.step_program_async(p, &inputs).await?;
        self.pos += 1;
        Ok((self.checked(first_f32(out), Some(self.pos - 1))?, stats))
    }

    /// `out` if every value is finite, else an error naming the position (`None`: the prompt).
    fn checked(&self, out: Vec<f32>, pos: Option<usize>) -> Result<Vec<f32>> {
        crate::error::check_finite(&out, || match pos {
            Some(p) => format!("the model's output (logits) for the token at position {p}"),
            None => format!(
                "the model's output (logits) for the {}-token prompt",
                self.shape.prompt
            ),
        })?;
        Ok(out)
    }

    /// The decode program and its inputs for `id` at the next position (marks the position
    /// valid in the attention mask).
    fn decode_inputs(&mut self, id: u32) -> Result<(usize, [crate::graph::HostTensor; 5])> {
        let p = self.decode.ok_or_else(|| {
            Error::Invalid("this graph has no decode program (capacity == prompt)".into())
        })?;
        if self.pos >= self.shape.capacity {
            return Err(Error::Invalid(format!(
                "the KV cache holds {} positions and is full",
                self.shape.capacity
            )));
        }
        self.check_ids(&[id])?;
        let half = self.config.head_dim / 2;
        let (cos, sin) = self.config.rope_at(self.pos, 1);
        self.mask[self.pos] = 1.0;
        let inputs = [
            crate::graph::HostTensor::u32(&[1], vec![id])?,
            crate::graph::HostTensor::f32(&[1, half], cos)?,
            crate::graph::HostTensor::f32(&[1, half], sin)?,
            crate::graph::HostTensor::u32(&[1], vec![self.pos as u32])?,
            crate::graph::HostTensor::f32(&[self.shape.capacity], self.mask.clone())?,
        ];
        Ok((p, inputs))
    }
}

fn first_f32(out: Vec<crate::graph::HostTensor>) -> Vec<f32> {
    out.into_iter()
        .next()
        .map(|t| t.into_f32())
        .unwrap_or_default()
}
