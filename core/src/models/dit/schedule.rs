//! Flow-matching Euler sampling, as diffusers' `FlowMatchEulerDiscreteScheduler` computes it:
//! sigmas from `linspace(t(sigma_max), t(sigma_min), steps) / N` (f64, then f32), optionally
//! shifted (`shift * s / (1 + (shift - 1) s)`) or dynamically shifted by `mu`
//! (`e^mu / (e^mu + (1/s - 1))`), a final 0; each step `x += (sigma_{i+1} - sigma_i) * v`.

/// How the schedule is shifted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Shift {
    /// `shift * s / (1 + (shift - 1) s)` (1.0: none).
    Static(f64),
    /// Resolution-dependent shift with this `mu` (Flux: see [`flux_mu`]).
    Dynamic(f64),
}

/// The scheduler.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlowMatchEuler {
    /// Training timesteps (diffusers' default 1000).
    pub num_train_timesteps: u32,
    /// The shift.
    pub shift: Shift,
}

impl Default for FlowMatchEuler {
    fn default() -> Self {
        FlowMatchEuler {
            num_train_timesteps: 1000,
            shift: Shift::Static(1.0),
        }
    }
}

fn static_shift(shift: f64, s: f64) -> f64 {
    shift * s / (1.0 + (shift - 1.0) * s)
}

/// Flux's `mu` for `image_seq_len` latent tokens (linear between 256 -> 0.5 and 4096 -> 1.15).
pub fn flux_mu(image_seq_len: usize) -> f64 {
    let (base_len, max_len, base_shift, max_shift) = (256.0, 4096.0, 0.5, 1.15);
    let m = (max_shift - base_shift) / (max_len - base_len);
    image_seq_len as f64 * m + (base_shift - m * base_len)
}

impl FlowMatchEuler {
    /// The `steps + 1` sigmas (the last is 0); the model's timestep at step i is `sigmas[i]`
    /// (times `num_train_timesteps` inside models that scale it).
    pub fn sigmas(&self, steps: usize) -> Vec<f32> {
        let n = self.num_train_timesteps as f64;
        // The training schedule's ends, after the static shift (diffusers applies it at init).
        let init_shift = match self.shift {
            Shift::Static(s) => s,
            Shift::Dynamic(_) => 1.0,
        };
        let train = |t: f64| static_shift(init_shift, t / n);
        let (sigma_max, sigma_min) = (train(n), train(1.0));
        let (t0, t1) = (sigma_max * n, sigma_min * n);
        let mut out: Vec<f32> = (0..steps)
            .map(|i| {
                let t = if steps == 1 {
                    t0
                } else {
                    t0 + (t1 - t0) * i as f64 / (steps - 1) as f64
                };
                let s = t / n;
                let s = match self.shift {
                    Shift::Static(sh) => static_shift(sh, s),
                    Shift::Dynamic(mu) => mu.exp() / (mu.exp() + (1.0 / s - 1.0)),
                };
                s as f32
            })
            .collect();
        out.push(0.0);
        out
    }

    /// One Euler step in place: `x += (sigma_next - sigma) * v`, in f32.
    pub fn step(x: &mut [f32], v: &[f32], sigma: f32, sigma_next: f32) {
        let dt = sigma_next - sigma;
        for (a, b) in x.iter_mut().zip(v) {
            *a += dt * b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_steps_without_shift_match_diffusers() {
        let s = FlowMatchEuler::default().sigmas(4);
        assert_eq!(s, vec![1.0, 0.667, 0.334, 0.001, 0.0]);
    }

    #[test]
    fn shifts_move_sigmas_up_and_keep_the_ends() {
        let plain = FlowMatchEuler::default().sigmas(10);
        let shifted = FlowMatchEuler {
            shift: Shift::Static(3.0),
            ..Default::default()
        }
        .sigmas(10);
        let dynamic = FlowMatchEuler {
            shift: Shift::Dynamic(flux_mu(4096)),
            ..Default::default()
        }
        .sigmas(10);
        assert_eq!(shifted[0], 1.0);
        assert_eq!(*shifted.last().expect("0"), 0.0);
        for i in 1..10 {
            assert!(shifted[i] > plain[i] && dynamic[i] > plain[i], "step {i}");
            assert!(shifted[i] < shifted[i - 1]);
        }
        assert!((flux_mu(256) - 0.5).abs() < 1e-12 && (flux_mu(4096) - 1.15).abs() < 1e-12);
    }
}
