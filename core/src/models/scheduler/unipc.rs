//! UniPC (`UniPCMultistepScheduler` of diffusers 0.42, as the Wan 2.1 folders configure it): flow
//! sigmas with a static shift, data prediction (`predict_x0`), the B(h) solvers bh1 / bh2, a
//! predictor of order up to 3 and its corrector. The solver's state (the last model outputs as
//! x0 predictions, the corrected sample, the orders) lives in the sampler and goes into the
//! denoise loop's checkpoints.
//!
//! Every per-step scalar is a float32 value (diffusers keeps them as 0-d float32 tensors), the
//! sigmas and the timesteps are computed in float64 first, and the elementwise updates are done
//! as separate float32 operations in diffusers' order.

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::format::json::typed;

use super::FlowSampler;

/// B(h) of the UniPC solver (`solver_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SolverType {
    /// `B(h) = h` (here `-h`: data prediction).
    Bh1,
    /// `B(h) = e^h - 1`.
    Bh2,
}

/// The last sigma of the schedule (`final_sigmas_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalSigma {
    /// 0: the last step lands on the data prediction.
    Zero,
    /// The last sigma again: the last step leaves the sample as it is.
    SigmaMin,
}

/// The settings of a `UniPCMultistepScheduler` that nibble computes.
#[derive(Debug, Clone, PartialEq)]
pub struct UniPcConfig {
    /// `num_train_timesteps`.
    pub num_train_timesteps: u32,
    /// `solver_order` (1 to 3).
    pub solver_order: usize,
    /// `solver_type`.
    pub solver_type: SolverType,
    /// `lower_order_final`: the last steps use lower orders.
    pub lower_order_final: bool,
    /// `disable_corrector`: steps whose output is not corrected (at the next step).
    pub disable_corrector: Vec<usize>,
    /// `final_sigmas_type`.
    pub final_sigma: FinalSigma,
    /// `flow_shift`.
    pub flow_shift: f64,
}

impl Default for UniPcConfig {
    /// Wan 2.1's: order 2, bh2, lower order at the end, zero final sigma, shift 3 (the 480p
    /// setting; the 720p folders say 5).
    fn default() -> Self {
        UniPcConfig {
            num_train_timesteps: 1000,
            solver_order: 2,
            solver_type: SolverType::Bh2,
            lower_order_final: true,
            disable_corrector: Vec::new(),
            final_sigma: FinalSigma::Zero,
            flow_shift: 3.0,
        }
    }
}

#[derive(Deserialize)]
struct File {
    #[serde(rename = "_class_name")]
    class_name: Option<String>,
    num_train_timesteps: Option<u32>,
    solver_order: Option<usize>,
    solver_type: Option<String>,
    prediction_type: Option<String>,
    predict_x0: Option<bool>,
    thresholding: Option<bool>,
    lower_order_final: Option<bool>,
    disable_corrector: Option<Vec<usize>>,
    solver_p: Option<serde_json::Value>,
    use_karras_sigmas: Option<bool>,
    use_exponential_sigmas: Option<bool>,
    use_beta_sigmas: Option<bool>,
    use_flow_sigmas: Option<bool>,
    flow_shift: Option<f64>,
    use_dynamic_shifting: Option<bool>,
    final_sigmas_type: Option<String>,
    shift_terminal: Option<serde_json::Value>,
    rescale_betas_zero_snr: Option<bool>,
}

impl UniPcConfig {
    /// Reads `scheduler_config.json` (`file` names it in errors). What this solver does not
    /// compute (another prediction type, thresholding, Karras or other sigma families, dynamic
    /// shifting, a terminal shift, a second solver) is refused naming the field.
    pub fn from_json(file: &str, json: &serde_json::Value) -> Result<Self> {
        let f: File = typed(file, json)?;
        let bad = |field: &str, msg: &str| Error::Model {
            file: file.to_string(),
            msg: format!("{field}: {msg}"),
        };
        super::check_class(file, f.class_name.as_deref(), "UniPCMultistepScheduler")?;
        match f.prediction_type.as_deref() {
            Some("flow_prediction") => {}
            other => {
                return Err(bad(
                    "prediction_type",
                    &format!(
                        "{} is not supported (flow_prediction)",
                        other.unwrap_or("epsilon (the default)")
                    ),
                ))
            }
        }
        if f.use_flow_sigmas != Some(true) {
            return Err(bad("use_flow_sigmas", "must be true (flow matching)"));
        }
        if f.predict_x0 == Some(false) {
            return Err(bad("predict_x0", "false is not supported"));
        }
        super::refuse_true(
            file,
            &[
                ("thresholding", f.thresholding),
                ("use_karras_sigmas", f.use_karras_sigmas),
                ("use_exponential_sigmas", f.use_exponential_sigmas),
                ("use_beta_sigmas", f.use_beta_sigmas),
                ("use_dynamic_shifting", f.use_dynamic_shifting),
                ("rescale_betas_zero_snr", f.rescale_betas_zero_snr),
            ],
        )?;
        for (field, v) in [
            ("solver_p", &f.solver_p),
            ("shift_terminal", &f.shift_terminal),
        ] {
            if v.as_ref().is_some_and(|v| !v.is_null()) {
                return Err(bad(field, "is not supported"));
            }
        }
        let solver_type = match f.solver_type.as_deref() {
            Some("bh2") | None => SolverType::Bh2,
            Some("bh1") => SolverType::Bh1,
            Some(other) => return Err(bad("solver_type", &format!("'{other}' (bh1 or bh2)"))),
        };
        let final_sigma = match f.final_sigmas_type.as_deref() {
            Some("zero") | None => FinalSigma::Zero,
            Some("sigma_min") => FinalSigma::SigmaMin,
            Some(other) => {
                return Err(bad(
                    "final_sigmas_type",
                    &format!("'{other}' (zero or sigma_min)"),
                ))
            }
        };
        let d = UniPcConfig::default();
        let c = UniPcConfig {
            num_train_timesteps: f.num_train_timesteps.unwrap_or(d.num_train_timesteps),
            solver_order: f.solver_order.unwrap_or(d.solver_order),
            solver_type,
            lower_order_final: f.lower_order_final.unwrap_or(d.lower_order_final),
            disable_corrector: f.disable_corrector.unwrap_or_default(),
            final_sigma,
            flow_shift: f.flow_shift.unwrap_or(1.0),
        };
        if !(1..=3).contains(&c.solver_order) {
            return Err(bad("solver_order", "must be 1, 2 or 3"));
        }
        if !(1..=1_000_000).contains(&c.num_train_timesteps) {
            return Err(bad("num_train_timesteps", "must be 1 to 1000000"));
        }
        if !(c.flow_shift.is_finite() && c.flow_shift > 0.0) {
            return Err(bad(
                "flow_shift",
                &format!("{} is not a finite positive number", c.flow_shift),
            ));
        }
        if c.solver_type == SolverType::Bh1 && c.final_sigma == FinalSigma::Zero {
            // B(h) = -inf at a zero sigma: diffusers' own last step is NaN.
            return Err(bad(
                "solver_type",
                "bh1 with final_sigmas_type zero ends in NaN (in diffusers too): use bh2 or \
                 final_sigmas_type sigma_min",
            ));
        }
        Ok(c)
    }

    /// The `steps + 1` sigmas (float32) and the `steps` timesteps (truncated to integers) of
    /// `set_timesteps(steps)`: `linspace(1, 1/N, steps + 1)` without its end, shifted
    /// (`shift·s/(1 + (shift − 1)·s)`), the first lowered by 1e-6 where it is 1, all in float64;
    /// then the final sigma.
    pub fn schedule(&self, steps: usize) -> Result<(Vec<f32>, Vec<i64>)> {
        if steps == 0 || steps > super::MAX_STEPS {
            return Err(Error::Invalid(format!(
                "{steps} denoising steps: between 1 and {}",
                super::MAX_STEPS
            )));
        }
        let n = self.num_train_timesteps as f64;
        // numpy's linspace(1, 1/n, steps + 1): start + i * step, the end exact (dropped here).
        let (start, stop) = (1.0f64, 1.0 / n);
        let step = (stop - start) / steps as f64;
        let shift = self.flow_shift;
        let mut s: Vec<f64> = (0..steps)
            .map(|i| i as f64 * step + start)
            .map(|v| shift * v / (1.0 + (shift - 1.0) * v))
            .collect();
        if (s[0] - 1.0).abs() < 1e-6 {
            s[0] -= 1e-6;
        }
        let timesteps: Vec<i64> = s.iter().map(|&v| (v * n) as i64).collect();
        let last = match self.final_sigma {
            FinalSigma::Zero => 0.0,
            FinalSigma::SigmaMin => s[steps - 1],
        };
        let mut sigmas: Vec<f32> = s.iter().map(|&v| v as f32).collect();
        sigmas.push(last as f32);
        Ok((sigmas, timesteps))
    }
}

/// `λ(σ) = log(1 − σ) − log(σ)` in float32, and `α = 1 − σ`.
fn alpha_lambda(sigma: f32) -> (f32, f32) {
    let alpha = 1.0 - sigma;
    (alpha, alpha.ln() - sigma.ln())
}

/// Solves the `n x n` system `a · x = b` in float32 by Gaussian elimination with partial
/// pivoting (LAPACK's sgesv: rows scaled by the pivot's reciprocal).
fn solve(mut a: Vec<Vec<f32>>, mut b: Vec<f32>) -> Result<Vec<f32>> {
    let n = b.len();
    for k in 0..n {
        let p = (k..n)
            .max_by(|&i, &j| a[i][k].abs().total_cmp(&a[j][k].abs()))
            .unwrap_or(k);
        if a[p][k] == 0.0 || !a[p][k].is_finite() {
            return Err(Error::Invalid(
                "UniPC: the solver's linear system is singular at this step".into(),
            ));
        }
        a.swap(k, p);
        b.swap(k, p);
        let inv = 1.0 / a[k][k];
        let (top, rest) = a.split_at_mut(k + 1);
        let pivot = &top[k];
        for (i, row) in rest.iter_mut().enumerate() {
            let l = row[k] * inv;
            for (x, p) in row.iter_mut().zip(pivot).skip(k + 1) {
                *x -= l * p;
            }
            b[k + 1 + i] -= l * b[k];
        }
    }
    let mut x = vec![0f32; n];
    for i in (0..n).rev() {
        let mut s = b[i];
        for j in i + 1..n {
            s -= a[i][j] * x[j];
        }
        x[i] = s / a[i][i];
    }
    Ok(x)
}

/// The UniPC sampler over one schedule, with its state.
#[derive(Debug, Clone, PartialEq)]
pub struct UniPc {
    cfg: UniPcConfig,
    sigmas: Vec<f32>,
    timesteps: Vec<i64>,
    /// The last `solver_order` data predictions (x0), oldest first (`None`: none yet).
    model_outputs: Vec<Option<Vec<f32>>>,
    /// The sample the last step predicted from (corrected), for the next step's corrector.
    last_sample: Option<Vec<f32>>,
    /// Steps taken with each order so far, capped at the solver order.
    lower_order_nums: usize,
    /// The predictor's order at the last step (the corrector's at the next).
    this_order: usize,
    /// Steps taken.
    step_index: usize,
}

impl UniPc {
    /// The sampler for `steps` steps of `cfg`.
    pub fn new(cfg: UniPcConfig, steps: usize) -> Result<Self> {
        let (sigmas, timesteps) = cfg.schedule(steps)?;
        Ok(UniPc {
            model_outputs: vec![None; cfg.solver_order],
            cfg,
            sigmas,
            timesteps,
            last_sample: None,
            lower_order_nums: 0,
            this_order: 1,
            step_index: 0,
        })
    }

    /// The timesteps (integers, as the model gets them).
    pub fn timesteps(&self) -> &[i64] {
        &self.timesteps
    }

    /// The last step's data prediction (diffusers' `model_outputs[-1]`).
    pub fn last_x0(&self) -> Option<&[f32]> {
        self.model_outputs.last().and_then(|m| m.as_deref())
    }

    /// The sample the last step predicted from, after its corrector (`last_sample`).
    pub fn last_corrected(&self) -> Option<&[f32]> {
        self.last_sample.as_deref()
    }

    /// The `i`-th newest data prediction (0: the newest).
    fn m(&self, i: usize) -> Result<&[f32]> {
        let k = self.model_outputs.len();
        self.model_outputs
            .get(k.wrapping_sub(1 + i))
            .and_then(|m| m.as_deref())
            .ok_or_else(|| Error::Invalid(format!("UniPC: no model output {i} steps back")))
    }

    /// `(rks, D1s)` of an update of `order` from `s0` with `h`, over the data predictions `i`
    /// steps back at sigma indices `si(i)`, `i` in 1..order.
    #[allow(clippy::type_complexity)]
    fn differences(
        &self,
        order: usize,
        m0: &[f32],
        lambda_s0: f32,
        h: f32,
        si: impl Fn(usize) -> usize,
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
        let mut rks = Vec::with_capacity(order);
        let mut d1s = Vec::with_capacity(order);
        for i in 1..order {
            let mi = self.m(i)?;
            let (_, lambda_si) = alpha_lambda(self.sigmas[si(i)]);
            let rk = (lambda_si - lambda_s0) / h;
            rks.push(rk);
            d1s.push(mi.iter().zip(m0).map(|(a, b)| (a - b) / rk).collect());
        }
        rks.push(1.0);
        Ok((rks, d1s))
    }

    /// `hφ1`, `B(h)` and the `b` vector of an update of `order` with `hh = −h`.
    fn coefficients(&self, order: usize, hh: f32) -> (f32, f32, Vec<f32>) {
        let h_phi_1 = hh.exp_m1();
        let mut h_phi_k = h_phi_1 / hh - 1.0;
        let b_h = match self.cfg.solver_type {
            SolverType::Bh1 => hh,
            SolverType::Bh2 => hh.exp_m1(),
        };
        let mut factorial_i = 1u64;
        let mut b = Vec::with_capacity(order);
        for i in 1..=order {
            b.push(h_phi_k * factorial_i as f32 / b_h);
            factorial_i *= i as u64 + 1;
            h_phi_k = h_phi_k / hh - (1.0 / factorial_i as f64) as f32;
        }
        (h_phi_1, b_h, b)
    }

    /// The predictor: from `x` (the corrected sample at step `k`) to step `k + 1`.
    fn predict(&self, x: &[f32], order: usize) -> Result<Vec<f32>> {
        let k = self.step_index;
        let m0 = self.m(0)?;
        let (sigma_t, sigma_s0) = (self.sigmas[k + 1], self.sigmas[k]);
        let (alpha_t, lambda_t) = alpha_lambda(sigma_t);
        let (_, lambda_s0) = alpha_lambda(sigma_s0);
        let h = lambda_t - lambda_s0;
        let (rks, d1s) = self.differences(order, m0, lambda_s0, h, |i| k - i)?;
        let hh = -h;
        let (h_phi_1, b_h, b) = self.coefficients(order, hh);
        let rhos: Vec<f32> = match order {
            1 => Vec::new(),
            2 => vec![0.5],
            _ => {
                let r: Vec<Vec<f32>> = (0..order - 1)
                    .map(|p| rks[..order - 1].iter().map(|r| r.powi(p as i32)).collect())
                    .collect();
                solve(r, b[..order - 1].to_vec())?
            }
        };
        let c1 = sigma_t / sigma_s0;
        let c2 = alpha_t * h_phi_1;
        let c3 = alpha_t * b_h;
        Ok((0..x.len())
            .map(|i| {
                let base = c1 * x[i] - c2 * m0[i];
                if d1s.is_empty() {
                    return base;
                }
                let mut res = rhos[0] * d1s[0][i];
                for (rho, d) in rhos.iter().zip(&d1s).skip(1) {
                    res += rho * d[i];
                }
                base - c3 * res
            })
            .collect())
    }

    /// The corrector at step `k`: the sample the last step predicted, corrected with this
    /// step's data prediction `model_t`, from `last` (the sample the last step predicted from),
    /// with the last step's order.
    fn correct(&self, model_t: &[f32], last: &[f32], order: usize) -> Result<Vec<f32>> {
        let k = self.step_index;
        let m0 = self.m(0)?;
        let (sigma_t, sigma_s0) = (self.sigmas[k], self.sigmas[k - 1]);
        let (alpha_t, lambda_t) = alpha_lambda(sigma_t);
        let (_, lambda_s0) = alpha_lambda(sigma_s0);
        let h = lambda_t - lambda_s0;
        let (rks, d1s) = self.differences(order, m0, lambda_s0, h, |i| k - (i + 1))?;
        let hh = -h;
        let (h_phi_1, b_h, b) = self.coefficients(order, hh);
        let rhos: Vec<f32> = if order == 1 {
            vec![0.5]
        } else {
            let r: Vec<Vec<f32>> = (0..order)
                .map(|p| rks.iter().map(|r| r.powi(p as i32)).collect())
                .collect();
            solve(r, b)?
        };
        let c1 = sigma_t / sigma_s0;
        let c2 = alpha_t * h_phi_1;
        let c3 = alpha_t * b_h;
        let rho_t = rhos[rhos.len() - 1];
        Ok((0..last.len())
            .map(|i| {
                let base = c1 * last[i] - c2 * m0[i];
                let d1_t = model_t[i] - m0[i];
                let res = if d1s.is_empty() {
                    rho_t * d1_t
                } else {
                    let mut corr = rhos[0] * d1s[0][i];
                    for (rho, d) in rhos.iter().zip(&d1s).skip(1).take(d1s.len() - 1) {
                        corr += rho * d[i];
                    }
                    corr + rho_t * d1_t
                };
                base - c3 * res
            })
            .collect())
    }
}

/// Names of the state values in a checkpoint.
const STATE_LAST: &str = "unipc.last_sample";
const STATE_ORDERS: &str = "unipc.orders";

impl FlowSampler for UniPc {
    fn name(&self) -> &'static str {
        "UniPCMultistepScheduler"
    }

    fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }

    fn timestep(&self, i: usize) -> f32 {
        self.timesteps[i] as f32
    }

    fn step(&mut self, i: usize, x: &mut [f32], model_out: &[f32]) -> Result<()> {
        if i != self.step_index || i >= self.timesteps.len() || model_out.len() != x.len() {
            return Err(Error::Invalid(format!(
                "UniPC step {i} (expected {}) of {} with {} model values for {} latent values",
                self.step_index,
                self.timesteps.len(),
                model_out.len(),
                x.len()
            )));
        }
        let sigma = self.sigmas[i];
        // The data prediction, from the uncorrected sample.
        let m: Vec<f32> = x
            .iter()
            .zip(model_out)
            .map(|(s, v)| s - sigma * v)
            .collect();
        let use_corrector =
            i > 0 && !self.cfg.disable_corrector.contains(&(i - 1)) && self.last_sample.is_some();
        let sample = match (&self.last_sample, use_corrector) {
            (Some(last), true) => self.correct(&m, last, self.this_order)?,
            _ => x.to_vec(),
        };
        self.model_outputs.remove(0);
        self.model_outputs.push(Some(m));
        let order = if self.cfg.lower_order_final {
            self.cfg.solver_order.min(self.timesteps.len() - i)
        } else {
            self.cfg.solver_order
        };
        self.this_order = order.min(self.lower_order_nums + 1).max(1);
        let next = self.predict(&sample, self.this_order)?;
        self.last_sample = Some(sample);
        if self.lower_order_nums < self.cfg.solver_order {
            self.lower_order_nums += 1;
        }
        self.step_index += 1;
        x.copy_from_slice(&next);
        Ok(())
    }

    fn state(&self) -> Vec<(String, Vec<f32>)> {
        let mut v: Vec<(String, Vec<f32>)> = self
            .model_outputs
            .iter()
            .enumerate()
            .filter_map(|(k, m)| {
                m.as_ref()
                    .map(|m| (format!("unipc.model_output{k}"), m.clone()))
            })
            .collect();
        if let Some(l) = &self.last_sample {
            v.push((STATE_LAST.into(), l.clone()));
        }
        v.push((
            STATE_ORDERS.into(),
            vec![
                self.lower_order_nums as f32,
                self.this_order as f32,
                self.step_index as f32,
            ],
        ));
        v
    }

    fn restore(&mut self, state: &[(String, Vec<f32>)]) -> Result<()> {
        let get = |name: &str| state.iter().find(|(n, _)| n == name).map(|(_, v)| v);
        let orders = get(STATE_ORDERS).filter(|o| o.len() == 3).ok_or_else(|| {
            Error::Invalid("the checkpoint holds no UniPC state (unipc.orders)".into())
        })?;
        let (lower, this, step) = (orders[0] as usize, orders[1] as usize, orders[2] as usize);
        if lower > self.cfg.solver_order || this > self.cfg.solver_order || step > self.steps() {
            return Err(Error::Invalid(format!(
                "the checkpoint's UniPC state (orders {lower}, {this}, step {step}) does not fit \
                 this scheduler (order {}, {} steps)",
                self.cfg.solver_order,
                self.steps()
            )));
        }
        let n = self.model_outputs.len();
        self.model_outputs = (0..n)
            .map(|k| get(&format!("unipc.model_output{k}")).cloned())
            .collect();
        self.last_sample = get(STATE_LAST).cloned();
        self.lower_order_nums = lower;
        self.this_order = this.max(1);
        self.step_index = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wan() -> serde_json::Value {
        serde_json::json!({
            "_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction",
            "use_flow_sigmas": true, "flow_shift": 3.0, "solver_order": 2, "solver_type": "bh2",
            "predict_x0": true, "lower_order_final": true, "disable_corrector": [],
            "final_sigmas_type": "zero", "timestep_spacing": "linspace", "num_train_timesteps": 1000,
            "shift_terminal": null, "solver_p": null, "use_dynamic_shifting": false
        })
    }

    #[test]
    fn wan_settings_give_diffusers_schedule() {
        let c = UniPcConfig::from_json("scheduler_config.json", &wan()).expect("config");
        let (s, t) = c.schedule(4).expect("schedule");
        assert_eq!(t, vec![999, 900, 750, 500]);
        // diffusers' float32 sigmas, as bit patterns.
        let want = [0x3f7f_ffef_u32, 0x3f66_6e43, 0x3f40_1890, 0x3f00_4178, 0].map(f32::from_bits);
        assert_eq!(s, want, "bit for bit");
    }

    #[test]
    fn what_unipc_does_not_compute_is_refused_naming_the_field() {
        for (k, v) in [
            ("prediction_type", serde_json::json!("epsilon")),
            ("use_flow_sigmas", serde_json::json!(false)),
            ("thresholding", serde_json::json!(true)),
            ("solver_order", serde_json::json!(4)),
            ("solver_type", serde_json::json!("bh3")),
            ("final_sigmas_type", serde_json::json!("last")),
            ("shift_terminal", serde_json::json!(0.1)),
            ("use_dynamic_shifting", serde_json::json!(true)),
            ("flow_shift", serde_json::json!(-1.0)),
        ] {
            let mut j = wan();
            j[k] = v;
            let e = UniPcConfig::from_json("s.json", &j)
                .expect_err(k)
                .to_string();
            assert!(e.contains(k), "{k}: {e}");
        }
        let mut j = wan();
        j["solver_type"] = serde_json::json!("bh1");
        let e = UniPcConfig::from_json("s.json", &j)
            .expect_err("bh1 + zero")
            .to_string();
        assert!(e.contains("NaN"), "{e}");
    }

    #[test]
    fn a_constant_velocity_lands_on_its_data_prediction_and_the_state_resumes() {
        // x = x0 + sigma * v with a constant v: every data prediction is x0, whatever the order.
        let c = UniPcConfig::default();
        let mut u = UniPc::new(c.clone(), 5).expect("unipc");
        let (x0, v) = (vec![0.25f32, -1.5, 3.0], vec![1.0f32, 2.0, -0.5]);
        let mut x: Vec<f32> = x0
            .iter()
            .zip(&v)
            .map(|(a, b)| a + u.sigmas()[0] * b)
            .collect();
        let mut resumed = None;
        for i in 0..5 {
            if i == 2 {
                let mut r = UniPc::new(c.clone(), 5).expect("unipc");
                r.restore(&u.state()).expect("restore");
                resumed = Some((r, x.clone()));
            }
            u.step(i, &mut x, &v).expect("step");
        }
        for (a, b) in x.iter().zip(&x0) {
            assert!((a - b).abs() < 1e-5, "{x:?}");
        }
        let (mut r, mut y) = resumed.expect("resumed");
        for i in 2..5 {
            r.step(i, &mut y, &v).expect("step");
        }
        assert_eq!(y, x, "a resumed run ends where the uninterrupted one does");
        assert!(u.step(5, &mut x, &v).is_err(), "no step past the schedule");
    }
}
