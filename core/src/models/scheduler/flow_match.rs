//! The flow-matching schedule, written once: the settings of diffusers'
//! `FlowMatchEulerDiscreteScheduler` (`scheduler/scheduler_config.json` of a pipeline folder) and
//! the two ways a run gets its sigmas from them:
//!
//! - [`SchedulerConfig::pipeline_sigmas`]: the sigmas `FluxPipeline` passes in,
//!   `np.linspace(1, 1/steps, steps)` as float32, shifted by the resolution-dependent `mu`
//!   (exponential or linear time shift) or statically, then a final 0; numpy's float32
//!   arithmetic, so the values are diffusers' to the bit.
//! - [`SchedulerConfig::default_sigmas`]: the scheduler's own `set_timesteps(steps)`,
//!   `linspace(t(sigma_max), t(sigma_min), steps) / N` in f64 (the training schedule's ends after
//!   the static shift, in float32 as torch computes them), shifted, then f32 and a final 0 (the
//!   lone DiT's schedule, and a Wan folder's that names this scheduler).
//!
//! The model's timestep at step i is `sigmas[i] * num_train_timesteps` in f32.

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::format::json::typed;

/// How `mu` shifts the sigmas (`time_shift_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeShift {
    /// `e^mu / (e^mu + (1/t - 1))`.
    Exponential,
    /// `mu / (mu + (1/t - 1))`.
    Linear,
}

/// The scheduler's settings that Flux sampling uses.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// `num_train_timesteps` (1000).
    pub num_train_timesteps: u32,
    /// `shift`, used when `use_dynamic_shifting` is false.
    pub shift: f64,
    /// `use_dynamic_shifting`: shift by `mu` from the image's token count.
    pub use_dynamic_shifting: bool,
    /// `base_shift`: `mu` at `base_image_seq_len` tokens.
    pub base_shift: f64,
    /// `max_shift`: `mu` at `max_image_seq_len` tokens.
    pub max_shift: f64,
    /// `base_image_seq_len`.
    pub base_image_seq_len: u64,
    /// `max_image_seq_len`.
    pub max_image_seq_len: u64,
    /// `time_shift_type`.
    pub time_shift: TimeShift,
}

#[derive(Deserialize)]
struct File {
    #[serde(rename = "_class_name")]
    class_name: Option<String>,
    num_train_timesteps: Option<u32>,
    shift: Option<f64>,
    use_dynamic_shifting: Option<bool>,
    base_shift: Option<f64>,
    max_shift: Option<f64>,
    base_image_seq_len: Option<u64>,
    max_image_seq_len: Option<u64>,
    time_shift_type: Option<String>,
    invert_sigmas: Option<bool>,
    stochastic_sampling: Option<bool>,
    shift_terminal: Option<f64>,
    use_karras_sigmas: Option<bool>,
    use_exponential_sigmas: Option<bool>,
    use_beta_sigmas: Option<bool>,
}

impl Default for SchedulerConfig {
    /// diffusers' defaults: 1000 training steps, no shift, Flux's `mu` line.
    fn default() -> Self {
        SchedulerConfig {
            num_train_timesteps: 1000,
            shift: 1.0,
            use_dynamic_shifting: false,
            base_shift: 0.5,
            max_shift: 1.15,
            base_image_seq_len: 256,
            max_image_seq_len: 4096,
            time_shift: TimeShift::Exponential,
        }
    }
}

fn static_shift(shift: f64, s: f64) -> f64 {
    shift * s / (1.0 + (shift - 1.0) * s)
}

impl SchedulerConfig {
    /// Reads the config (`file` names it in errors). Another scheduler class, or a setting this
    /// sampler does not compute (inverted, stochastic, terminal-shifted, Karras / exponential /
    /// beta sigmas), is refused naming the field.
    pub fn from_json(file: &str, json: &serde_json::Value) -> Result<Self> {
        let f: File = typed(file, json)?;
        let bad = |field: &str, msg: &str| Error::Model {
            file: file.to_string(),
            msg: format!("{field}: {msg}"),
        };
        super::check_class(
            file,
            f.class_name.as_deref(),
            "FlowMatchEulerDiscreteScheduler",
        )?;
        super::refuse_true(
            file,
            &[
                ("invert_sigmas", f.invert_sigmas),
                ("stochastic_sampling", f.stochastic_sampling),
                ("use_karras_sigmas", f.use_karras_sigmas),
                ("use_exponential_sigmas", f.use_exponential_sigmas),
                ("use_beta_sigmas", f.use_beta_sigmas),
            ],
        )?;
        if f.shift_terminal.is_some() {
            return Err(bad("shift_terminal", "is not supported"));
        }
        let time_shift = match f.time_shift_type.as_deref() {
            Some("exponential") | None => TimeShift::Exponential,
            Some("linear") => TimeShift::Linear,
            Some(other) => return Err(bad("time_shift_type", &format!("'{other}'"))),
        };
        // diffusers' defaults.
        let d = SchedulerConfig::default();
        let c = SchedulerConfig {
            num_train_timesteps: f.num_train_timesteps.unwrap_or(d.num_train_timesteps),
            shift: f.shift.unwrap_or(d.shift),
            use_dynamic_shifting: f.use_dynamic_shifting.unwrap_or(d.use_dynamic_shifting),
            base_shift: f.base_shift.unwrap_or(d.base_shift),
            max_shift: f.max_shift.unwrap_or(d.max_shift),
            base_image_seq_len: f.base_image_seq_len.unwrap_or(d.base_image_seq_len),
            max_image_seq_len: f.max_image_seq_len.unwrap_or(d.max_image_seq_len),
            time_shift,
        };
        if !(1..=1_000_000).contains(&c.num_train_timesteps) {
            return Err(bad("num_train_timesteps", "must be 1 to 1000000"));
        }
        for (field, v) in [
            ("shift", c.shift),
            ("base_shift", c.base_shift),
            ("max_shift", c.max_shift),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(field, &format!("{v} is not a finite positive number")));
            }
        }
        if c.max_image_seq_len <= c.base_image_seq_len {
            return Err(bad("max_image_seq_len", "must be above base_image_seq_len"));
        }
        Ok(c)
    }

    /// `mu` for `image_seq_len` latent tokens (diffusers' `calculate_shift`, f64).
    pub fn mu(&self, image_seq_len: usize) -> f64 {
        let m = (self.max_shift - self.base_shift)
            / (self.max_image_seq_len as f64 - self.base_image_seq_len as f64);
        let b = self.base_shift - m * self.base_image_seq_len as f64;
        image_seq_len as f64 * m + b
    }

    /// The `steps + 1` sigmas of the scheduler's own `set_timesteps(steps)` (the last is 0):
    /// shifted by `mu` (exponential time shift, f64) when the config shifts dynamically, else
    /// statically.
    pub fn default_sigmas(&self, steps: usize, mu: f64) -> Vec<f32> {
        let n = self.num_train_timesteps as f64;
        // The training schedule's ends, after the static shift (diffusers applies it at init).
        let init_shift = if self.use_dynamic_shifting {
            1.0
        } else {
            self.shift
        };
        // The training sigmas as the scheduler's __init__ computes them: torch float32
        // (`linspace(1, N, N) / N`, shifted), read back with `.item()`.
        let train = |t: f32| {
            let s = t / n as f32;
            let (a, b) = (init_shift as f32, (init_shift - 1.0) as f32);
            (a * s / (1.0 + b * s)) as f64
        };
        let (sigma_max, sigma_min) = (train(n as f32), train(1.0));
        let (t0, t1) = (sigma_max * n, sigma_min * n);
        let mut out: Vec<f32> = (0..steps)
            .map(|i| {
                // np.linspace: i * ((t1 - t0) / (steps - 1)) + t0, the last exactly t1.
                let t = if steps == 1 {
                    t0
                } else if i == steps - 1 {
                    t1
                } else {
                    i as f64 * ((t1 - t0) / (steps - 1) as f64) + t0
                };
                let s = t / n;
                let s = if self.use_dynamic_shifting {
                    match self.time_shift {
                        TimeShift::Exponential => mu.exp() / (mu.exp() + (1.0 / s - 1.0)),
                        TimeShift::Linear => mu / (mu + (1.0 / s - 1.0)),
                    }
                } else {
                    static_shift(self.shift, s)
                };
                s as f32
            })
            .collect();
        out.push(0.0);
        out
    }

    /// The `steps + 1` sigmas `FluxPipeline` samples with (the last is 0), for `steps` from 1,
    /// shifted by `mu` when the config shifts dynamically.
    pub fn pipeline_sigmas(&self, steps: usize, mu: f64) -> Result<Vec<f32>> {
        if steps == 0 || steps > super::MAX_STEPS {
            return Err(Error::Invalid(format!(
                "{steps} denoising steps: between 1 and {}",
                super::MAX_STEPS
            )));
        }
        if self.use_dynamic_shifting && self.time_shift == TimeShift::Linear && mu <= 0.0 {
            return Err(Error::Invalid(format!("mu {mu} must be positive")));
        }
        // np.linspace(1.0, 1 / steps, steps) in f64, then astype(float32).
        let (start, stop) = (1.0f64, 1.0 / steps as f64);
        let lin: Vec<f32> = (0..steps)
            .map(|i| {
                if steps > 1 && i == steps - 1 {
                    stop
                } else if steps > 1 {
                    i as f64 * ((stop - start) / (steps - 1) as f64) + start
                } else {
                    start
                }
            })
            .map(|v| v as f32)
            .collect();
        // numpy float32 arithmetic: Python floats take part as float32.
        let mut s: Vec<f32> = if self.use_dynamic_shifting {
            let k = match self.time_shift {
                TimeShift::Exponential => mu.exp() as f32,
                TimeShift::Linear => mu as f32,
            };
            lin.iter().map(|&t| k / (k + (1.0 / t - 1.0))).collect()
        } else {
            let sh = self.shift as f32;
            lin.iter()
                .map(|&t| sh * t / (1.0 + (sh - 1.0) * t))
                .collect()
        };
        s.push(0.0);
        Ok(s)
    }

    /// The model's timestep for each sigma but the last (`sigma * num_train_timesteps`, f32).
    pub fn timesteps(&self, sigmas: &[f32]) -> Vec<f32> {
        let n = self.num_train_timesteps as f32;
        sigmas[..sigmas.len().saturating_sub(1)]
            .iter()
            .map(|s| s * n)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(json: serde_json::Value) -> Result<SchedulerConfig> {
        SchedulerConfig::from_json("scheduler_config.json", &json)
    }

    #[test]
    fn flux_dev_settings_give_diffusers_sigmas() {
        let c = cfg(serde_json::json!({
            "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256,
            "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
            "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": true
        }))
        .expect("config");
        let mu = c.mu(64);
        assert!((mu - 0.4675).abs() < 1e-12, "{mu}");
        let s = c.pipeline_sigmas(4, mu).expect("sigmas");
        assert_eq!(s.len(), 5);
        assert_eq!((s[0], s[4]), (1.0, 0.0));
        assert!((s[1] - 0.827_228_67).abs() < 1e-7, "{s:?}");
        assert!((s[3] - 0.347_258_4).abs() < 1e-7, "{s:?}");
    }

    /// diffusers' `FlowMatchEulerDiscreteScheduler(shift=3.0).set_timesteps(4)` as its source
    /// computes it (float32 training sigmas, numpy f64 linspace and shift, float32), worked
    /// through with Python floats rounded to float32 at each torch operation.
    #[test]
    fn four_default_steps_with_static_shift_3_follow_diffusers_arithmetic() {
        let s = SchedulerConfig {
            shift: 3.0,
            ..Default::default()
        }
        .default_sigmas(4, 0.0);
        assert_eq!(s, vec![1.0, 0.857_692_3, 0.602_150_56, 0.008_928_572, 0.0]);
    }

    #[test]
    fn four_default_steps_without_shift_match_diffusers() {
        let s = SchedulerConfig::default().default_sigmas(4, 0.0);
        assert_eq!(s, vec![1.0, 0.667, 0.334, 0.001, 0.0]);
    }

    #[test]
    fn shifts_move_default_sigmas_up_and_keep_the_ends() {
        let plain = SchedulerConfig::default().default_sigmas(10, 0.0);
        let shifted = SchedulerConfig {
            shift: 3.0,
            ..Default::default()
        }
        .default_sigmas(10, 0.0);
        let d = SchedulerConfig {
            use_dynamic_shifting: true,
            ..Default::default()
        };
        let dynamic = d.default_sigmas(10, d.mu(4096));
        assert_eq!(shifted[0], 1.0);
        assert_eq!(*shifted.last().expect("0"), 0.0);
        for i in 1..10 {
            assert!(shifted[i] > plain[i] && dynamic[i] > plain[i], "step {i}");
            assert!(shifted[i] < shifted[i - 1]);
        }
        assert!((d.mu(256) - 0.5).abs() < 1e-12 && (d.mu(4096) - 1.15).abs() < 1e-12);
    }

    #[test]
    fn schedulers_nibble_does_not_compute_are_refused() {
        for (j, field) in [
            (
                serde_json::json!({"_class_name": "EulerDiscreteScheduler"}),
                "_class_name",
            ),
            (
                serde_json::json!({"use_karras_sigmas": true}),
                "use_karras_sigmas",
            ),
            (serde_json::json!({"shift_terminal": 0.1}), "shift_terminal"),
            (serde_json::json!({"shift": -1.0}), "shift"),
            (
                serde_json::json!({"time_shift_type": "cubic"}),
                "time_shift_type",
            ),
            (
                serde_json::json!({"num_train_timesteps": "1000"}),
                "num_train_timesteps",
            ),
        ] {
            let e = cfg(j).expect_err(field).to_string();
            assert!(e.contains(field), "{field}: {e}");
        }
    }
}
