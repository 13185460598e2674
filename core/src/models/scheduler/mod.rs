//! The flow-matching scheduler family that every diffusion family samples with: one schedule
//! ([`flow_match`]: diffusers' `FlowMatchEulerDiscreteScheduler` settings and the sigmas a run
//! gets from them) and the samplers behind one trait, [`FlowSampler`]: [`Euler`] and the
//! multistep [`UniPc`] ([`unipc`], diffusers' `UniPCMultistepScheduler` with flow sigmas), and
//! classifier-free guidance ([`guide`]). A sampler owns its state
//! (a multistep solver such as UniPC keeps earlier model outputs); the denoise loop keeps the
//! sampler and saves that state in its checkpoints, so a resumed run continues bit for bit.

pub mod flow_match;
pub mod unipc;

pub use flow_match::{SchedulerConfig, TimeShift};
pub use unipc::{UniPc, UniPcConfig};

use crate::error::{Error, Result};

/// The most denoising steps a run takes.
pub const MAX_STEPS: usize = 100_000;

/// What a scheduler's config names as its class must be `class` (or absent).
pub(crate) fn check_class(file: &str, found: Option<&str>, class: &str) -> Result<()> {
    match found {
        Some(c) if c != class => Err(Error::Model {
            file: file.to_string(),
            msg: format!("_class_name: {c} is not supported ({class})"),
        }),
        _ => Ok(()),
    }
}

/// Refuses each of `fields` that is set to true: a setting the sampler does not compute.
pub(crate) fn refuse_true(file: &str, fields: &[(&str, Option<bool>)]) -> Result<()> {
    match fields.iter().find(|(_, on)| *on == Some(true)) {
        Some((field, _)) => Err(Error::Model {
            file: file.to_string(),
            msg: format!("{field}: true is not supported"),
        }),
        None => Ok(()),
    }
}

/// A sampler of the flow-matching family: it walks a latent from `sigmas[0]` to the last sigma
/// (0), given the model's output at each step.
pub trait FlowSampler: std::fmt::Debug {
    /// The sampler's name (as diffusers' class, for messages and checkpoints).
    fn name(&self) -> &'static str;

    /// The `steps + 1` sigmas (the last is 0).
    fn sigmas(&self) -> &[f32];

    /// Steps in the schedule.
    fn steps(&self) -> usize {
        self.sigmas().len().saturating_sub(1)
    }

    /// The model's timestep input at step `i` (`sigmas[i] * num_train_timesteps`).
    fn timestep(&self, i: usize) -> f32;

    /// Updates `x` in place from the model's output at step `i` (a velocity for flow
    /// matching); steps are taken in order from 0.
    fn step(&mut self, i: usize, x: &mut [f32], model_out: &[f32]) -> Result<()>;

    /// The sampler's state after the steps taken (named values), for a checkpoint; none for a
    /// one-step solver.
    fn state(&self) -> Vec<(String, Vec<f32>)> {
        Vec::new()
    }

    /// Takes back a state [`FlowSampler::state`] gave.
    fn restore(&mut self, state: &[(String, Vec<f32>)]) -> Result<()> {
        match state.first() {
            None => Ok(()),
            Some((name, _)) => Err(Error::Invalid(format!(
                "{} keeps no state, but the checkpoint holds '{name}'",
                self.name()
            ))),
        }
    }
}

/// A boxed sampler is one (a pipeline whose folder chooses its sampler at run time).
impl<S: FlowSampler + ?Sized> FlowSampler for Box<S> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn sigmas(&self) -> &[f32] {
        (**self).sigmas()
    }
    fn steps(&self) -> usize {
        (**self).steps()
    }
    fn timestep(&self, i: usize) -> f32 {
        (**self).timestep(i)
    }
    fn step(&mut self, i: usize, x: &mut [f32], model_out: &[f32]) -> Result<()> {
        (**self).step(i, x, model_out)
    }
    fn state(&self) -> Vec<(String, Vec<f32>)> {
        (**self).state()
    }
    fn restore(&mut self, state: &[(String, Vec<f32>)]) -> Result<()> {
        (**self).restore(state)
    }
}

/// Classifier-free guidance as diffusers computes it: `uncond + scale · (cond − uncond)`, each
/// operation in float32.
pub fn guide(cond: &[f32], uncond: &[f32], scale: f32) -> Vec<f32> {
    cond.iter()
        .zip(uncond)
        .map(|(&c, &u)| u + scale * (c - u))
        .collect()
}

/// Flow-matching Euler (`FlowMatchEulerDiscreteScheduler.step`): `x += (sigma_{i+1} - sigma_i)
/// * v` in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct Euler {
    sigmas: Vec<f32>,
    num_train_timesteps: f32,
}

impl Euler {
    /// Over `sigmas` (at least two, the last 0) of a scheduler with `num_train_timesteps`.
    pub fn new(sigmas: Vec<f32>, num_train_timesteps: u32) -> Result<Self> {
        if sigmas.len() < 2 {
            return Err(Error::Invalid("a schedule needs at least one step".into()));
        }
        Ok(Euler {
            sigmas,
            num_train_timesteps: num_train_timesteps as f32,
        })
    }

    /// One Euler step in place: `x += (sigma_next - sigma) * v`, in f32.
    pub fn update(x: &mut [f32], v: &[f32], sigma: f32, sigma_next: f32) {
        let dt = sigma_next - sigma;
        for (a, b) in x.iter_mut().zip(v) {
            *a += dt * b;
        }
    }
}

impl FlowSampler for Euler {
    fn name(&self) -> &'static str {
        "FlowMatchEulerDiscreteScheduler"
    }

    fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }

    fn timestep(&self, i: usize) -> f32 {
        self.sigmas[i] * self.num_train_timesteps
    }

    fn step(&mut self, i: usize, x: &mut [f32], model_out: &[f32]) -> Result<()> {
        if i + 1 >= self.sigmas.len() || model_out.len() != x.len() {
            return Err(Error::Invalid(format!(
                "Euler step {i} of {} with {} model values for {} latent values",
                self.steps(),
                model_out.len(),
                x.len()
            )));
        }
        Euler::update(x, model_out, self.sigmas[i], self.sigmas[i + 1]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn euler_moves_along_the_velocity_by_the_sigma_step() {
        let mut e = Euler::new(vec![1.0, 0.5, 0.0], 1000).expect("euler");
        let mut x = vec![1.0f32, 2.0];
        e.step(0, &mut x, &[2.0, -2.0]).expect("step");
        assert_eq!(x, vec![0.0, 3.0]);
        assert_eq!((e.timestep(0), e.timestep(1)), (1000.0, 500.0));
        assert!(e.step(2, &mut x, &[0.0, 0.0]).is_err());
        assert!(e.restore(&[("x".into(), vec![])]).is_err());
        assert!(Euler::new(vec![0.0], 1000).is_err());
    }
}
