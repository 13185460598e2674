//! A model's `quantization_config` (in `config.json`), typed: what transformers'
//! `BitsAndBytesConfig` writes, with its defaults, and the check that it describes weights
//! nibble computes (bitsandbytes 4-bit, or none).

use serde::Deserialize;

use crate::error::Result;
use crate::format::json::{field_error, typed};

/// `quantization_config`. transformers' `BitsAndBytesConfig.__init__` defaults:
/// `load_in_8bit=False`, `load_in_4bit=False`, `bnb_4bit_quant_type="fp4"`,
/// `bnb_4bit_use_double_quant=False`, `bnb_4bit_compute_dtype=None` (float32),
/// `bnb_4bit_quant_storage=None` (uint8).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct QuantizationConfig {
    /// `bitsandbytes` for the weights nibble reads.
    pub quant_method: Option<String>,
    /// 4-bit weights.
    #[serde(default)]
    pub load_in_4bit: bool,
    /// 8-bit weights (LLM.int8), which nibble does not compute.
    #[serde(default)]
    pub load_in_8bit: bool,
    /// `nf4` or `fp4`.
    #[serde(default = "fp4")]
    pub bnb_4bit_quant_type: String,
    /// Whether absmax is quantized to 8 bits too.
    #[serde(default)]
    pub bnb_4bit_use_double_quant: bool,
    /// The dtype bitsandbytes computes in (nibble computes in f32).
    pub bnb_4bit_compute_dtype: Option<String>,
    /// The element type the packed bytes are stored under.
    pub bnb_4bit_quant_storage: Option<String>,
}

fn fp4() -> String {
    "fp4".into()
}

impl QuantizationConfig {
    /// The `quantization_config` of `config` (a `config.json` named `file`), checked; `None`
    /// when the model is not quantized.
    pub fn of_config(file: &str, config: &serde_json::Value) -> Result<Option<Self>> {
        let Some(q) = config.get("quantization_config").filter(|q| !q.is_null()) else {
            return Ok(None);
        };
        let field = |f: &str| format!("quantization_config.{f}");
        let c: Self = typed(file, q).map_err(|e| match e {
            crate::Error::Model { file, msg } => crate::Error::Model {
                file,
                msg: format!("quantization_config.{msg}"),
            },
            e => e,
        })?;
        match c.quant_method.as_deref() {
            Some("bitsandbytes") | None => {}
            Some(other) => {
                return Err(field_error(
                    file,
                    &field("quant_method"),
                    format!("'{other}' weights are not supported: nibble reads bitsandbytes 4-bit"),
                ))
            }
        }
        if c.load_in_8bit {
            return Err(field_error(
                file,
                &field("load_in_8bit"),
                "8-bit (LLM.int8) weights are not supported: nibble reads bitsandbytes 4-bit",
            ));
        }
        if !matches!(c.bnb_4bit_quant_type.as_str(), "nf4" | "fp4") {
            return Err(field_error(
                file,
                &field("bnb_4bit_quant_type"),
                format!("'{}' is not nf4 or fp4", c.bnb_4bit_quant_type),
            ));
        }
        Ok(Some(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_nibble_does_not_read_is_refused() {
        let ok = serde_json::json!({"quantization_config": {
            "quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "nf4",
        }});
        let c = QuantizationConfig::of_config("config.json", &ok)
            .expect("ok")
            .expect("some");
        assert!(c.load_in_4bit && !c.bnb_4bit_use_double_quant);
        assert_eq!(
            QuantizationConfig::of_config("c", &serde_json::json!({})).expect("none"),
            None
        );
        for (bad, why) in [
            (serde_json::json!({"quant_method": "gptq"}), "quant_method"),
            (serde_json::json!({"load_in_8bit": true}), "load_in_8bit"),
            (
                serde_json::json!({"bnb_4bit_quant_type": "int4"}),
                "bnb_4bit_quant_type",
            ),
            (
                serde_json::json!({"load_in_4bit": "yes"}),
                "quantization_config.load_in_4bit",
            ),
        ] {
            let e = QuantizationConfig::of_config(
                "m/config.json",
                &serde_json::json!({"quantization_config": bad}),
            )
            .expect_err(why)
            .to_string();
            assert!(e.contains(why) && e.contains("m/config.json"), "{e}");
        }
    }
}
