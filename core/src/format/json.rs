//! Typed JSON files (`config.json`, `generation_config.json`, sentence-transformers' files):
//! serde structs whose errors name the file and the field, e.g. `config.json: rms_norm_eps:
//! invalid type: string "1e-6", expected f64`; and the checks every config shares (a size must be
//! positive, a constant finite and positive, a token id a u32).

use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::error::{Error, Result};

/// `v` as a `T`; an error names `file` and the path of the field that does not fit.
pub fn typed<T: DeserializeOwned>(file: &str, v: &serde_json::Value) -> Result<T> {
    serde_path_to_error::deserialize(v).map_err(|e| Error::Model {
        file: file.to_string(),
        msg: if e.path().iter().next().is_none() {
            e.inner().to_string()
        } else {
            format!("{}: {}", e.path(), e.inner())
        },
    })
}

/// The JSON in `bytes` as a `T` (see [`typed`]).
pub fn typed_bytes<T: DeserializeOwned>(file: &str, bytes: &[u8]) -> Result<T> {
    let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| Error::Model {
        file: file.to_string(),
        msg: format!("invalid JSON: {e}"),
    })?;
    typed(file, &v)
}

/// An error about field `field` of `file`.
pub fn field_error(file: &str, field: &str, msg: impl std::fmt::Display) -> Error {
    Error::Model {
        file: file.to_string(),
        msg: format!("{field}: {msg}"),
    }
}

/// The largest size a config field may give (2^31): beyond any real model, and small enough that
/// the products of two sizes cannot overflow.
pub const MAX_SIZE: u64 = 1 << 31;

/// A size that must be at least 1 and at most [`MAX_SIZE`], as a `usize`.
pub fn positive(file: &str, field: &str, v: u64) -> Result<usize> {
    if v == 0 {
        return Err(field_error(file, field, "must be at least 1"));
    }
    if v > MAX_SIZE {
        return Err(field_error(
            file,
            field,
            format!("{v} is larger than any model nibble runs (at most {MAX_SIZE})"),
        ));
    }
    usize::try_from(v).map_err(|_| field_error(file, field, format!("{v} is too large")))
}

/// A constant that must be finite and positive also as an f32 (an epsilon, a RoPE base, a
/// scaling factor).
pub fn positive_f32(file: &str, field: &str, v: f64) -> Result<f32> {
    let f = v as f32;
    if !(v.is_finite() && f.is_finite() && f > 0.0) {
        return Err(field_error(
            file,
            field,
            format!("{v} is not a finite positive number"),
        ));
    }
    Ok(f)
}

/// A token id field: one id or a list of them (`eos_token_id` may be either).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// One id.
    One(u64),
    /// Several.
    Many(Vec<u64>),
}

impl TokenIds {
    /// The ids as u32; an id that does not fit is an error naming the field.
    pub fn ids(&self, file: &str, field: &str) -> Result<Vec<u32>> {
        let all: &[u64] = match self {
            TokenIds::One(v) => std::slice::from_ref(v),
            TokenIds::Many(v) => v,
        };
        all.iter()
            .map(|&id| {
                u32::try_from(id)
                    .map_err(|_| field_error(file, field, format!("token id {id} is not a u32")))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    struct T {
        #[allow(dead_code)]
        rms_norm_eps: f64,
    }

    #[test]
    fn errors_name_the_file_and_the_field() {
        let v = serde_json::json!({"rms_norm_eps": "1e-6"});
        let e = typed::<T>("m/config.json", &v).expect_err("a string");
        let msg = e.to_string();
        assert!(
            msg.contains("m/config.json") && msg.contains("rms_norm_eps"),
            "{msg}"
        );
        assert!(positive("c", "hidden_size", 0).is_err());
        assert!(positive_f32("c", "rope_theta", 0.0).is_err());
        assert!(positive_f32("c", "rope_theta", f64::NAN).is_err());
        assert!(
            positive_f32("c", "rms_norm_eps", 1e-60).is_err(),
            "0 as an f32"
        );
        let ids = TokenIds::Many(vec![2, (1 << 32) + 102]);
        assert!(ids.ids("c", "eos_token_id").is_err());
    }
}
