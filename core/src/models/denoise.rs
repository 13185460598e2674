//! The denoise loop every diffusion family shares: a model bound to its executor
//! ([`DenoiseModel`]: Flux's transformer is one) and a sampler of the flow-matching family
//! ([`FlowSampler`]) walk a latent step by step, one streaming pass over the weights a step,
//! each step's prediction and latent checked finite; the loop's state (steps done, the latent,
//! the sampler's history) is what a checkpoint saves.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::exec::{ExecStats, Executor};
use crate::graph::HostTensor;
use crate::models::scheduler::FlowSampler;

/// A diffusion model bound to its executor: what the executor takes for a step and what the
/// sampler takes from its outputs.
pub trait DenoiseModel {
    /// The backend its executor runs on.
    type Backend: Backend;

    /// The executor (plan, backend).
    fn executor(&self) -> &Executor<Self::Backend>;

    /// The executor, mutable.
    fn executor_mut(&mut self) -> &mut Executor<Self::Backend>;

    /// Ends the model: its executor.
    fn into_executor(self) -> Executor<Self::Backend>;

    /// The executor's inputs for a step at latent `x` and the sampler's `timestep`.
    fn step_inputs(&self, x: &[f32], timestep: f32) -> Result<Vec<HostTensor>>;

    /// The prediction the sampler takes, from the executor's outputs (by default the first).
    fn prediction(&self, out: Vec<HostTensor>) -> Result<Vec<f32>> {
        out.into_iter()
            .next()
            .map(HostTensor::into_f32)
            .ok_or_else(|| Error::Invalid("the model's graph has no output".into()))
    }
}

/// What one denoising step cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DenoiseStep {
    /// Step number, from 1.
    pub step: usize,
    /// Wall time of the step.
    pub wall: std::time::Duration,
    /// Streaming figures of the step.
    pub stats: ExecStats,
    /// Process RSS after the step (0 where unknown).
    pub rss_bytes: u64,
}

/// The loop: a model, a sampler, the latent and the steps done.
#[derive(Debug)]
pub struct DenoiseLoop<M, S> {
    model: M,
    sampler: S,
    x: Vec<f32>,
    next: usize,
}

impl<M: DenoiseModel, S: FlowSampler> DenoiseLoop<M, S> {
    /// Starts at latent `x0`.
    pub fn new(model: M, sampler: S, x0: Vec<f32>) -> Self {
        DenoiseLoop {
            model,
            sampler,
            x: x0,
            next: 0,
        }
    }

    /// The model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The model, mutable.
    pub fn model_mut(&mut self) -> &mut M {
        &mut self.model
    }

    /// The sampler.
    pub fn sampler(&self) -> &S {
        &self.sampler
    }

    /// Ends the loop: the model and the latent.
    pub fn into_parts(self) -> (M, Vec<f32>) {
        (self.model, self.x)
    }

    /// Steps in the schedule.
    pub fn steps(&self) -> usize {
        self.sampler.steps()
    }

    /// Steps done.
    pub fn done(&self) -> usize {
        self.next
    }

    /// The latent now.
    pub fn latent(&self) -> &[f32] {
        &self.x
    }

    /// Continues after `done` steps from latent `x` and the sampler's `state` (a checkpoint's);
    /// the caller has checked that they belong to this run.
    pub fn resume(&mut self, done: usize, x: Vec<f32>, state: &[(String, Vec<f32>)]) -> Result<()> {
        if x.len() != self.x.len() || done > self.steps() {
            return Err(Error::Invalid(
                "the checkpoint's latent does not fit this run".into(),
            ));
        }
        self.sampler.restore(state)?;
        self.x = x;
        self.next = done;
        Ok(())
    }

    /// The model's inputs for the next step; `None` once every step is done.
    fn step_inputs(&self) -> Result<Option<Vec<HostTensor>>> {
        if self.next >= self.steps() {
            return Ok(None);
        }
        let t = self.sampler.timestep(self.next);
        self.model.step_inputs(&self.x, t).map(Some)
    }

    /// One step: one streaming pass over the model's weights, then the sampler's update.
    /// `None` once every step is done.
    pub fn step(&mut self) -> Result<Option<DenoiseStep>> {
        let t0 = web_time::Instant::now();
        let Some(inputs) = self.step_inputs()? else {
            return Ok(None);
        };
        let (out, stats) = self.model.executor_mut().step(&inputs)?;
        self.stepped(t0, out, stats).map(Some)
    }

    /// [`DenoiseLoop::step`] on an event loop (the browser).
    pub async fn step_async(&mut self) -> Result<Option<DenoiseStep>> {
        let t0 = web_time::Instant::now();
        let Some(inputs) = self.step_inputs()? else {
            return Ok(None);
        };
        let (out, stats) = self
            .model
            .executor_mut()
            .step_program_async(0, &inputs)
            .await?;
        self.stepped(t0, out, stats).map(Some)
    }

    /// The sampler's update from the model's outputs.
    fn stepped(
        &mut self,
        t0: web_time::Instant,
        out: Vec<HostTensor>,
        stats: ExecStats,
    ) -> Result<DenoiseStep> {
        let i = self.next;
        let n = self.steps();
        let v = self.model.prediction(out)?;
        crate::error::check_finite(&v, || {
            format!("step {} of {n}: the model's output (velocity)", i + 1)
        })?;
        self.sampler.step(i, &mut self.x, &v)?;
        crate::error::check_finite(&self.x, || format!("step {} of {n}: the latent", i + 1))?;
        self.next += 1;
        Ok(DenoiseStep {
            step: self.next,
            wall: t0.elapsed(),
            stats,
            rss_bytes: crate::io::machine::rss_bytes().unwrap_or(0),
        })
    }
}
