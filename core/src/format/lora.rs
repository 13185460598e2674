//! LoRA adapter files: which tensors form which low-rank pair, and the scaling rule of each
//! format, read from the tensor names (and the configs peft and diffusers write beside them).
//!
//! Three namings are recognised, by their keys:
//! * peft (`adapter_model.safetensors`): `[base_model.model.]<module>.lora_A.weight` `[r, in]`
//!   and `.lora_B.weight` `[out, r]`; `r`, `lora_alpha`, `use_rslora`, `rank_pattern` and
//!   `alpha_pattern` from `adapter_config.json`.
//! * diffusers (`pytorch_lora_weights.safetensors`): the same pair with a component prefix
//!   (`transformer.<module>`), the config in the `lora_adapter_metadata` entry of the file's
//!   metadata with every key prefixed by the component; without it, `lora_alpha = r`.
//! * kohya sd-scripts: `lora_unet_<module>.lora_down.weight` / `.lora_up.weight` and a scalar
//!   `.alpha` (absent: `alpha = rank`), module names with `_` for `.` (the model family maps
//!   them).
//!
//! The scaling of a pair is `alpha / r` (`alpha / sqrt(r)` with rsLoRA) as peft's `LoraLayer`
//! computes it, times the adapter's own scale. Bias deltas (peft's `lora_B.bias`, the Wan
//! trainers' `.diff_b`) are added to the linear's output; deltas of norm layers (`.diff`,
//! `.diff_b` of a `norm*` module) are dropped as diffusers drops them; full-weight deltas (`.diff`)
//! of other layers are applied beside the linear as ComfyUI applies them (`W + s · diff`);
//! embedding adapters, DoRA and LyCORIS tensors are refused by name, not skipped.

use std::collections::BTreeMap;

/// How an adapter file names its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    /// `<module>.lora_A.weight` / `.lora_B.weight` (peft, and diffusers with a component prefix).
    Peft,
    /// `<module>.lora_down.weight` / `.lora_up.weight` / `.alpha` (kohya sd-scripts).
    Kohya,
}

/// One adapted module as the file names it: its low-rank pair, its bias delta, or both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    /// The module's name in the file (prefixes kept: the caller knows which it strips).
    pub module: String,
    /// The down projection `[r, in]` (`lora_A` / `lora_down`) and the up projection `[out, r]`
    /// (`lora_B` / `lora_up`); `None` for a module with a bias delta only.
    pub halves: Option<(String, String)>,
    /// kohya's scalar `alpha` tensor, where the file has one.
    pub alpha: Option<String>,
    /// A bias delta `[out]` added to the linear's output: peft's `lora_B.bias` (`lora_bias`) or
    /// the `.diff_b` Wan trainers write.
    pub bias: Option<String>,
    /// A full-weight delta `[out, in]` (`.diff`, as the Wan trainers write for a few layers),
    /// applied as `x · diffᵀ` beside the linear.
    pub full: Option<String>,
}

impl Pair {
    /// The name that stands for the module in messages: its first tensor's.
    pub fn key(&self) -> &str {
        match (&self.halves, &self.bias, &self.full) {
            (Some((d, _)), ..) => d,
            (None, Some(b), _) => b,
            (None, None, Some(f)) => f,
            (None, None, None) => &self.module,
        }
    }
}

/// What an adapter file holds: its naming, its modules in name order, and the deltas on norm
/// layers it carries that are dropped as diffusers drops them (trainers write them as zeros).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pairs {
    /// How it names its tensors.
    pub naming: Naming,
    /// The adapted modules.
    pub modules: Vec<Pair>,
    /// `.diff` / `.diff_b` tensors of norm layers, dropped.
    pub dropped: Vec<String>,
}

/// The modules of an adapter file's tensor names and the naming they use; an error names the
/// first tensor that is not part of something nibble applies.
pub fn pairs<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Pairs, String> {
    #[derive(Default)]
    struct Parts {
        down: Option<String>,
        up: Option<String>,
        alpha: Option<String>,
        bias: Option<String>,
        full: Option<String>,
    }
    let mut modules: BTreeMap<String, Parts> = BTreeMap::new();
    let mut naming: Option<(Naming, String)> = None;
    let mut dropped = Vec::new();
    for name in names {
        let (module, part, kind) = if let Some(m) = name.strip_suffix(".lora_A.weight") {
            (m, 0, Some(Naming::Peft))
        } else if let Some(m) = name.strip_suffix(".lora_B.weight") {
            (m, 1, Some(Naming::Peft))
        } else if let Some(m) = name.strip_suffix(".lora_B.bias") {
            (m, 3, Some(Naming::Peft))
        } else if let Some(m) = name.strip_suffix(".lora_down.weight") {
            (m, 0, Some(Naming::Kohya))
        } else if let Some(m) = name.strip_suffix(".lora_up.weight") {
            (m, 1, Some(Naming::Kohya))
        } else if let Some(m) = name.strip_suffix(".alpha") {
            (m, 2, None)
        } else if let Some(m) = name.strip_suffix(".diff_b") {
            if m.rsplit('.').next().is_some_and(|l| l.contains("norm")) {
                dropped.push(name.to_string());
                continue;
            }
            (m, 3, None)
        } else if let Some(m) = name.strip_suffix(".diff") {
            if m.rsplit('.').next().is_some_and(|l| l.contains("norm")) {
                dropped.push(name.to_string());
                continue;
            }
            (m, 4, None)
        } else {
            return Err(unsupported(name));
        };
        if module.is_empty() {
            return Err(format!("'{name}': a LoRA tensor without a module name"));
        }
        if let Some(kind) = kind {
            match &naming {
                None => naming = Some((kind, name.to_string())),
                Some((k, first)) if *k != kind => {
                    return Err(format!(
                        "'{name}' and '{first}': one file mixes peft (lora_A/lora_B) and kohya \
                         (lora_down/lora_up) names"
                    ))
                }
                Some(_) => {}
            }
        }
        let e = modules.entry(module.to_string()).or_default();
        let slot = match part {
            0 => &mut e.down,
            1 => &mut e.up,
            2 => &mut e.alpha,
            3 => &mut e.bias,
            _ => &mut e.full,
        };
        if let Some(prev) = slot.replace(name.to_string()) {
            return Err(format!(
                "'{name}' and '{prev}': two deltas of one kind for one module"
            ));
        }
    }
    let naming = match naming {
        Some((n, _)) => n,
        None if modules
            .values()
            .any(|p| p.bias.is_some() || p.full.is_some()) =>
        {
            Naming::Peft
        }
        None => {
            return Err("no LoRA tensors (lora_A/lora_B or lora_down/lora_up) in the file".into())
        }
    };
    let mut out = Vec::with_capacity(modules.len());
    for (module, p) in modules {
        let halves = match (p.down, p.up) {
            (Some(d), Some(u)) => Some((d, u)),
            (Some(only), None) | (None, Some(only)) => {
                return Err(format!(
                    "'{only}' has no partner (each module needs both halves)"
                ))
            }
            (None, None) => None,
        };
        if halves.is_none() && p.bias.is_none() && p.full.is_none() {
            return Err(format!(
                "'{}' belongs to no lora_down/lora_up pair",
                p.alpha.unwrap_or(module)
            ));
        }
        out.push(Pair {
            module,
            halves,
            alpha: p.alpha,
            bias: p.bias,
            full: p.full,
        });
    }
    Ok(Pairs {
        naming,
        modules: out,
        dropped,
    })
}

fn unsupported(name: &str) -> String {
    let what = if name.contains("lora_embedding_") {
        "an embedding adapter, which nibble does not apply"
    } else if name.contains(".dora_scale") || name.contains("magnitude_vector") {
        "a DoRA magnitude, which nibble does not apply"
    } else if name.contains(".hada_") || name.contains(".lokr_") {
        "a LyCORIS (LoHa / LoKr) tensor, which nibble does not apply"
    } else {
        "not a LoRA tensor (expected <module>.lora_A.weight / .lora_B.weight, or \
         <module>.lora_down.weight / .lora_up.weight / .alpha, or .diff_b / .diff deltas)"
    };
    format!("'{name}': {what}")
}

/// The scaling settings of an adapter as peft's `LoraConfig` holds them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoraConfig {
    /// `r` (used where a module's rank is not its tensors').
    pub r: Option<f64>,
    /// `lora_alpha` (`None`: alpha = the module's rank, as diffusers reads a file without one).
    pub alpha: Option<f64>,
    /// `use_rslora`: `alpha / sqrt(r)`.
    pub rslora: bool,
    /// `rank_pattern`: per-module ranks, by name suffix.
    pub rank_pattern: Vec<(String, f64)>,
    /// `alpha_pattern`: per-module alphas, by name suffix.
    pub alpha_pattern: Vec<(String, f64)>,
}

impl LoraConfig {
    /// Reads peft's `adapter_config.json` (`prefix` empty), or diffusers' `lora_adapter_metadata`
    /// where every key carries the component's prefix (`"transformer."`).
    pub fn of_json(json: &serde_json::Value, prefix: &str) -> Result<Self, String> {
        let get = |k: &str| json.get(format!("{prefix}{k}"));
        let num = |k: &str| -> Result<Option<f64>, String> {
            match get(k) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .map(Some)
                    .ok_or_else(|| format!("{prefix}{k} is {v}, not a positive number")),
            }
        };
        let pattern = |k: &str| -> Result<Vec<(String, f64)>, String> {
            match get(k) {
                None | Some(serde_json::Value::Null) => Ok(Vec::new()),
                Some(serde_json::Value::Object(m)) => m
                    .iter()
                    .map(|(name, v)| {
                        // peft matches these keys as regular expressions; nibble as module
                        // names (or dotted suffixes), so a key that needs a regex is refused
                        // rather than silently not matching.
                        if name.contains(['\\', '*', '[', '(', '^', '$', '+', '?', '|', '{']) {
                            return Err(format!(
                                "{prefix}{k}[{name}] is a regular expression; nibble matches \
                                 module names and dotted suffixes only"
                            ));
                        }
                        v.as_f64()
                            .filter(|x| x.is_finite() && *x > 0.0)
                            .map(|x| (name.clone(), x))
                            .ok_or_else(|| format!("{prefix}{k}[{name}] is {v}, not a number"))
                    })
                    .collect(),
                Some(v) => Err(format!("{prefix}{k} is {v}, not an object")),
            }
        };
        if let Some(t) = get("peft_type").and_then(|v| v.as_str()) {
            if t != "LORA" {
                return Err(format!("peft_type {t}: nibble applies LORA adapters only"));
            }
        }
        for flag in ["use_dora", "fan_in_fan_out"] {
            if get(flag).and_then(|v| v.as_bool()) == Some(true) {
                return Err(format!(
                    "{prefix}{flag} is true, which nibble does not apply"
                ));
            }
        }
        Ok(LoraConfig {
            r: num("r")?,
            alpha: num("lora_alpha")?,
            rslora: get("use_rslora").and_then(|v| v.as_bool()) == Some(true),
            rank_pattern: pattern("rank_pattern")?,
            alpha_pattern: pattern("alpha_pattern")?,
        })
    }

    /// The scaling of `module` (its name without prefixes) whose tensors have rank `rank`: peft's
    /// `lora_alpha / r` (or `/ sqrt(r)`), with the patterns' entries for the module where they
    /// match its name or a dotted suffix of it.
    pub fn scaling(&self, module: &str, rank: usize) -> f64 {
        let find = |p: &[(String, f64)]| {
            p.iter()
                .find(|(k, _)| module == k || module.ends_with(&format!(".{k}")))
                .map(|&(_, v)| v)
        };
        let r = find(&self.rank_pattern).unwrap_or(rank as f64);
        let alpha = find(&self.alpha_pattern).or(self.alpha).unwrap_or(r);
        if self.rslora {
            alpha / r.sqrt()
        } else {
            alpha / r
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_group_both_halves_and_refuse_what_is_not_applied() {
        let p = pairs([
            "m.a.lora_B.weight",
            "m.a.lora_A.weight",
            "m.b.lora_A.weight",
            "m.b.lora_B.weight",
            "m.b.lora_B.bias",
        ])
        .expect("pairs");
        assert_eq!(p.naming, Naming::Peft);
        assert_eq!(p.modules.len(), 2);
        assert_eq!(
            p.modules[0].halves,
            Some(("m.a.lora_A.weight".into(), "m.a.lora_B.weight".into()))
        );
        assert_eq!(p.modules[1].bias.as_deref(), Some("m.b.lora_B.bias"));
        let p = pairs(["x.alpha", "x.lora_up.weight", "x.lora_down.weight"]).expect("kohya");
        assert_eq!(p.naming, Naming::Kohya);
        assert_eq!(p.modules[0].alpha.as_deref(), Some("x.alpha"));
        let p = pairs([
            "d.blocks.0.ffn.0.lora_down.weight",
            "d.blocks.0.ffn.0.lora_up.weight",
            "d.blocks.0.ffn.0.diff_b",
            "d.blocks.0.ffn.2.diff_b",
            "d.blocks.0.norm3.diff",
            "d.head.head.diff",
            "d.blocks.0.norm3.diff_b",
        ])
        .expect("bias deltas");
        assert_eq!(p.modules.len(), 3);
        assert_eq!(p.modules[2].full.as_deref(), Some("d.head.head.diff"));
        assert_eq!(p.modules[1].halves, None);
        assert_eq!(
            p.modules[1].bias.as_deref(),
            Some("d.blocks.0.ffn.2.diff_b")
        );
        assert_eq!(
            p.dropped.len(),
            2,
            "norm deltas are dropped: {:?}",
            p.dropped
        );
        for (bad, says) in [
            (vec!["m.lora_A.weight"], "no partner"),
            (
                vec!["m.lora_A.weight", "m.lora_B.weight", "m.weight"],
                "not a LoRA",
            ),
            (
                vec!["a.lora_A.weight", "a.lora_B.weight", "b.lora_up.weight"],
                "mixes",
            ),
            (vec!["x.alpha"], "no LoRA tensors"),
            (vec!["x.alpha", "y.lora_B.bias"], "no lora_down"),
            (vec![], "no LoRA tensors"),
        ] {
            let e = pairs(bad.iter().copied()).expect_err("refused");
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    #[test]
    fn scaling_follows_peft() {
        let c = LoraConfig {
            r: Some(8.0),
            alpha: Some(6.0),
            rslora: true,
            ..Default::default()
        };
        assert!((c.scaling("q_proj", 8) - 6.0 / 8f64.sqrt()).abs() < 1e-15);
        let c = LoraConfig {
            alpha: Some(8.0),
            alpha_pattern: vec![("v_proj".into(), 2.0)],
            rank_pattern: vec![("layers.1.self_attn.q_proj".into(), 2.0)],
            ..Default::default()
        };
        assert_eq!(c.scaling("model.layers.0.self_attn.q_proj", 4), 2.0);
        assert_eq!(c.scaling("model.layers.0.self_attn.v_proj", 4), 0.5);
        assert_eq!(c.scaling("model.layers.1.self_attn.q_proj", 2), 4.0);
        assert_eq!(LoraConfig::default().scaling("m", 16), 1.0);
        let j = serde_json::json!({"transformer.r": 4, "transformer.lora_alpha": 8.0,
            "transformer.use_rslora": false});
        let c = LoraConfig::of_json(&j, "transformer.").expect("config");
        assert_eq!(c.scaling("x", 4), 2.0);
        let j = serde_json::json!({"alpha_pattern": {"layers\\.[0-3]\\..*q_proj": 32}});
        let e = LoraConfig::of_json(&j, "").expect_err("a regex pattern");
        assert!(e.contains("regular expression"), "{e}");
        let j = serde_json::json!({"use_dora": true});
        assert!(LoraConfig::of_json(&j, "").is_err());
    }
}
