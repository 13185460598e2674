//! sentence-transformers' files, typed: `modules.json` (which modules follow the transformer),
//! the `Pooling` module's `config.json` and `sentence_bert_config.json`; and the pooling and
//! normalization they ask for, computed as sentence-transformers computes them.

use serde::Deserialize;

use crate::error::Result;
use crate::format::json::{field_error, typed_bytes};
use crate::io::model::ModelIndex;
use crate::models::bert::BertConfig;

/// How sentence-transformers turns token states into one vector (`modules.json`, then
/// `1_Pooling/config.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolingMode {
    /// Mean over the unmasked tokens.
    Mean,
    /// The first token's state.
    Cls,
    /// Element-wise maximum over the unmasked tokens.
    Max,
    /// Sum over the unmasked tokens divided by the square root of their count.
    MeanSqrtLen,
}

/// Pooling and optional L2 normalization, as sentence-transformers' `Pooling` and `Normalize`
/// modules compute them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pooling {
    /// The pooling.
    pub mode: PoolingMode,
    /// Whether the pooled vector is divided by its L2 norm (`max(norm, 1e-12)`).
    pub normalize: bool,
}

impl Default for Pooling {
    /// Mean pooling without normalization: what sentence-transformers uses for a plain
    /// transformers model.
    fn default() -> Self {
        Pooling {
            mode: PoolingMode::Mean,
            normalize: false,
        }
    }
}

/// One entry of `modules.json`.
#[derive(Debug, Deserialize)]
struct Module {
    /// The module's folder, relative to the model folder.
    #[serde(default)]
    path: Option<String>,
    /// Its class, e.g. `sentence_transformers.models.Pooling`.
    #[serde(rename = "type")]
    kind: String,
}

/// The `Pooling` module's `config.json`. sentence-transformers' `Pooling.__init__` defaults:
/// `pooling_mode=None`, `pooling_mode_cls_token=False`, `pooling_mode_max_tokens=False`,
/// `pooling_mode_mean_tokens=True`, `pooling_mode_mean_sqrt_len_tokens=False`,
/// `pooling_mode_weightedmean_tokens=False`, `pooling_mode_lasttoken=False`.
#[derive(Debug, Deserialize)]
struct PoolingFile {
    pooling_mode: Option<String>,
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default = "yes")]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
    #[serde(default)]
    pooling_mode_weightedmean_tokens: bool,
    #[serde(default)]
    pooling_mode_lasttoken: bool,
}

fn yes() -> bool {
    true
}

/// `sentence_bert_config.json`.
#[derive(Debug, Deserialize)]
struct SentenceBertFile {
    max_seq_length: Option<u64>,
}

impl Pooling {
    /// From the sentence-transformers files of a model (`modules.json` and its `Pooling`
    /// module's `config.json`), read through its folder; [`Pooling::default`] where there are
    /// none. A module path must stay inside the model folder.
    pub async fn load(model: &ModelIndex) -> Result<Self> {
        let Some(bytes) = model.read_side("modules.json").await? else {
            return Ok(Pooling::default());
        };
        let modules: Vec<Module> = typed_bytes(&model.locate("modules.json"), &bytes)?;
        let of_type = |suffix: &str| modules.iter().find(|m| m.kind.ends_with(suffix));
        let mut p = Pooling {
            mode: PoolingMode::Mean,
            normalize: of_type(".Normalize").is_some(),
        };
        let Some(m) = of_type(".Pooling") else {
            return Ok(p);
        };
        let dir = m
            .path
            .as_deref()
            .unwrap_or("1_Pooling")
            .trim_end_matches('/');
        let name = format!("{dir}/config.json");
        let Some(b) = model.read_side(&name).await? else {
            return Ok(p);
        };
        let file = model.locate(&name);
        let c: PoolingFile = typed_bytes(&file, &b)?;
        let (mut cls, mut max, mut mean, mut sqrt) = (
            c.pooling_mode_cls_token,
            c.pooling_mode_max_tokens,
            c.pooling_mode_mean_tokens,
            c.pooling_mode_mean_sqrt_len_tokens,
        );
        // `pooling_mode`, when given, replaces the flags (as in sentence-transformers).
        if let Some(mode) = c.pooling_mode.as_deref() {
            (cls, max, mean, sqrt) = (false, false, false, false);
            match mode {
                "cls" => cls = true,
                "max" => max = true,
                "mean" => mean = true,
                "mean_sqrt_len_tokens" => sqrt = true,
                other => {
                    return Err(field_error(
                        &file,
                        "pooling_mode",
                        format!(
                            "'{other}' is not supported (cls, max, mean, mean_sqrt_len_tokens)"
                        ),
                    ))
                }
            }
        }
        if c.pooling_mode_weightedmean_tokens || c.pooling_mode_lasttoken {
            return Err(field_error(
                &file,
                "pooling_mode",
                "weighted-mean and last-token pooling are not supported",
            ));
        }
        let chosen: Vec<PoolingMode> = [
            (cls, PoolingMode::Cls),
            (mean, PoolingMode::Mean),
            (max, PoolingMode::Max),
            (sqrt, PoolingMode::MeanSqrtLen),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, m)| *m)
        .collect();
        p.mode = match chosen.as_slice() {
            [one] => *one,
            [] => {
                return Err(field_error(
                    &file,
                    "pooling_mode",
                    "no pooling mode is switched on",
                ))
            }
            _ => {
                return Err(field_error(
                    &file,
                    "pooling_mode",
                    format!("several pooling modes at once ({chosen:?}) are not supported"),
                ))
            }
        };
        Ok(p)
    }

    /// [`Pooling::load`], natively.
    #[cfg(feature = "native")]
    pub fn for_model(model: &ModelIndex) -> Result<Self> {
        crate::io::folder::block_on(Self::load(model))
    }

    /// The sentence vector of token states `tokens [T, hidden]` with `mask [T]` (1 token, 0
    /// padding). Sums run in f64.
    pub fn pool(&self, tokens: &[f32], mask: &[f32], hidden: usize) -> Vec<f32> {
        let rows = || {
            tokens
                .chunks_exact(hidden)
                .zip(mask)
                .filter(|(_, &m)| m != 0.0)
                .map(|(r, _)| r)
        };
        let count = mask.iter().map(|&m| m as f64).sum::<f64>();
        let mut v: Vec<f32> = match self.mode {
            PoolingMode::Cls => tokens[..hidden].to_vec(),
            PoolingMode::Max => (0..hidden)
                .map(|j| rows().map(|r| r[j]).fold(f32::NEG_INFINITY, f32::max))
                .collect(),
            PoolingMode::Mean | PoolingMode::MeanSqrtLen => {
                let div = match self.mode {
                    PoolingMode::Mean => count.max(1e-9),
                    _ => count.max(1e-9).sqrt(),
                };
                (0..hidden)
                    .map(|j| (rows().map(|r| r[j] as f64).sum::<f64>() / div) as f32)
                    .collect()
            }
        };
        if self.normalize {
            let norm = v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
            let d = norm.max(1e-12);
            v.iter_mut().for_each(|x| *x = (*x as f64 / d) as f32);
        }
        v
    }
}

/// The longest input: sentence-transformers' `max_seq_length` (`sentence_bert_config.json`)
/// where the model has one (at most the position table), else the position table's length.
pub async fn max_seq_len(model: &ModelIndex, cfg: &BertConfig) -> Result<usize> {
    let Some(b) = model.read_side("sentence_bert_config.json").await? else {
        return Ok(cfg.max_positions);
    };
    let file = model.locate("sentence_bert_config.json");
    let s: SentenceBertFile = typed_bytes(&file, &b)?;
    Ok(match s.max_seq_length {
        Some(0) => return Err(field_error(&file, "max_seq_length", "must be at least 1")),
        Some(m) => usize::try_from(m)
            .unwrap_or(usize::MAX)
            .min(cfg.max_positions),
        None => cfg.max_positions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_modes_and_normalization() {
        // Two tokens and one padded row of width 2.
        let tokens = [1.0, 2.0, 3.0, -4.0, 100.0, 100.0];
        let mask = [1.0, 1.0, 0.0];
        let p = |mode, normalize| Pooling { mode, normalize }.pool(&tokens, &mask, 2);
        assert_eq!(p(PoolingMode::Mean, false), vec![2.0, -1.0]);
        assert_eq!(p(PoolingMode::Cls, false), vec![1.0, 2.0]);
        assert_eq!(p(PoolingMode::Max, false), vec![3.0, 2.0]);
        let s = 2f32.sqrt();
        assert_eq!(p(PoolingMode::MeanSqrtLen, false), vec![4.0 / s, -2.0 / s]);
        let n = p(PoolingMode::Mean, true);
        let r = 5f32.sqrt();
        assert!(
            (n[0] - 2.0 / r).abs() < 1e-7 && (n[1] + 1.0 / r).abs() < 1e-7,
            "{n:?}"
        );
    }
}
