//! Finding a model's 4-bit weights by their state-dict keys: the packed tensor and its
//! `absmax`, `quant_map`, optional `nested_*` and `quant_state.bitsandbytes__*` components.

use crate::error::{Error, QuantProblem, Result};
use crate::format::bnb::QuantType;
use crate::format::safetensors::TensorEntry;

/// The state-dict keys of one 4-bit weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Bnb4bitKeys {
    /// The weight's name, e.g. `model.layers.0.mlp.up_proj.weight` (also the packed tensor).
    pub base: String,
    /// NF4 or FP4, from the quant-state key's suffix.
    pub quant_type: QuantType,
    /// `<base>.absmax`.
    pub absmax: String,
    /// `<base>.quant_map`.
    pub quant_map: String,
    /// `<base>.nested_absmax`, when double-quantized.
    pub nested_absmax: Option<String>,
    /// `<base>.nested_quant_map`, when double-quantized.
    pub nested_quant_map: Option<String>,
    /// `<base>.quant_state.bitsandbytes__<type>`.
    pub quant_state: String,
}

impl Bnb4bitKeys {
    /// Every key of this weight, the packed tensor first.
    pub fn all_keys(&self) -> Vec<&str> {
        let mut v = vec![
            self.base.as_str(),
            &self.absmax,
            &self.quant_map,
            &self.quant_state,
        ];
        v.extend(self.nested_absmax.as_deref());
        v.extend(self.nested_quant_map.as_deref());
        v
    }
}

const COMPONENT_SUFFIXES: [&str; 6] = [
    ".absmax",
    ".quant_map",
    ".nested_absmax",
    ".nested_quant_map",
    ".quant_state.bitsandbytes__nf4",
    ".quant_state.bitsandbytes__fp4",
];

/// True when `name` is one of the auxiliary tensors of a 4-bit weight (not the packed data).
pub fn is_quant_component(name: &str) -> bool {
    COMPONENT_SUFFIXES.iter().any(|s| name.ends_with(s))
}

/// Finds every bitsandbytes 4-bit weight among a model's tensors by their state-dict keys, in
/// file order (`tensors` in file order, `file_of(shard)` names a shard for messages). A
/// component without its quant state, or a quant state without its components, is an error.
pub fn find_4bit_weights(
    tensors: &[&TensorEntry],
    file_of: impl Fn(usize) -> String,
) -> Result<Vec<Bnb4bitKeys>> {
    let names: std::collections::HashSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    let has = |n: &str| names.contains(n);
    let mut out: Vec<Bnb4bitKeys> = Vec::new();
    for t in tensors {
        let (base, qt) = if let Some(b) = t.name.strip_suffix(".quant_state.bitsandbytes__nf4") {
            (b, QuantType::Nf4)
        } else if let Some(b) = t.name.strip_suffix(".quant_state.bitsandbytes__fp4") {
            (b, QuantType::Fp4)
        } else {
            continue;
        };
        let file = file_of(t.shard);
        let quant_err = |problem| Error::Quant {
            file: file.clone(),
            tensor: base.to_string(),
            problem,
        };
        if !has(base) {
            return Err(quant_err(QuantProblem::MissingComponent("packed weight")));
        }
        let absmax = format!("{base}.absmax");
        if !has(&absmax) {
            return Err(quant_err(QuantProblem::MissingComponent("absmax")));
        }
        let quant_map = format!("{base}.quant_map");
        if !has(&quant_map) {
            return Err(quant_err(QuantProblem::MissingComponent("quant_map")));
        }
        let na = format!("{base}.nested_absmax");
        let nq = format!("{base}.nested_quant_map");
        let (na, nq) = match (has(&na), has(&nq)) {
            (true, true) => (Some(na), Some(nq)),
            (false, false) => (None, None),
            (has_a, _) => {
                let (have, lack) = if has_a {
                    ("nested_absmax", "nested_quant_map")
                } else {
                    ("nested_quant_map", "nested_absmax")
                };
                return Err(quant_err(QuantProblem::InconsistentNesting(format!(
                    "{have} present without {lack}"
                ))));
            }
        };
        out.push(Bnb4bitKeys {
            base: base.to_string(),
            quant_type: qt,
            absmax,
            quant_map,
            nested_absmax: na,
            nested_quant_map: nq,
            quant_state: t.name.clone(),
        });
    }
    // An absmax next to a weight but without any quant state is a half-written checkpoint.
    let bases: std::collections::HashSet<&str> = out.iter().map(|k| k.base.as_str()).collect();
    for t in tensors {
        if let Some(base) = t.name.strip_suffix(".absmax") {
            if has(base) && !bases.contains(base) {
                return Err(Error::Quant {
                    file: file_of(t.shard),
                    tensor: base.to_string(),
                    problem: QuantProblem::MissingComponent("quant_state.bitsandbytes__nf4|__fp4"),
                });
            }
        }
    }
    Ok(out)
}
