//! The bitsandbytes 4-bit format (NF4 / FP4, optional double quantization) as transformers and
//! diffusers save it: finding a weight's state-dict keys, parsing and validating its quant state,
//! and the reference dequantization, bit-exact with bitsandbytes' `dequantize_4bit`.

use safetensors::Dtype;

use crate::error::{Error, QuantProblem, Result};
use crate::format::dtype::dtype_name;
use crate::format::dtype::{round_bf16, round_f16};
use crate::format::safetensors::TensorEntry;

mod config;
pub mod dequant_fast;
mod keys;
mod state;

pub use config::QuantizationConfig;
pub use keys::{find_4bit_weights, is_quant_component, Bnb4bitKeys};
use state::check_packed_entry;
pub use state::{undo_double_quant, QuantState, QuantStateParts, RawTensor};

/// NF4 code table (`get_4bit_type('nf4')`), as f32 bit patterns.
pub const NF4_CODE_BITS: [u32; 16] = [
    0xbf800000, 0xbf3239b1, 0xbf066b30, 0xbeca32a0, 0xbe91a24d, 0xbe3d353f, 0xbdba7871, 0x00000000,
    0x3da2faff, 0x3e24cae3, 0x3e7c04dd, 0x3ead033a, 0x3ee1a4b8, 0x3f1007ab, 0x3f3913b3, 0x3f800000,
];

/// FP4 code table (`get_4bit_type('fp4')`, entry 8 is +0.0 as bitsandbytes stores it).
pub const FP4_CODE_BITS: [u32; 16] = [
    0x00000000, 0x3baaaaab, 0x3f2aaaab, 0x3f800000, 0x3eaaaaab, 0x3f000000, 0x3e2aaaab, 0x3e800000,
    0x00000000, 0xbbaaaaab, 0xbf2aaaab, 0xbf800000, 0xbeaaaaab, 0xbf000000, 0xbe2aaaab, 0xbe800000,
];

/// The signed 8-bit dynamic map used for double quantization
/// (`create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)`), f32 bit patterns.
pub const DYNAMIC_MAP_BITS: [u32; 256] = [
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
];

/// Blocksizes bitsandbytes accepts for 4-bit quantization.
pub const MIN_BLOCKSIZE: u64 = 32;
/// Largest blocksize bitsandbytes accepts.
pub const MAX_BLOCKSIZE: u64 = 4096;

/// Decodes a table of f32 bit patterns.
pub fn table_from_bits<const N: usize>(bits: &[u32; N]) -> [f32; N] {
    let mut out = [0f32; N];
    for (o, b) in out.iter_mut().zip(bits) {
        *o = f32::from_bits(*b);
    }
    out
}

/// The 4-bit data type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantType {
    /// NormalFloat4.
    Nf4,
    /// bitsandbytes' 4-bit float (1 sign, 2 exponent, 1 mantissa bit).
    Fp4,
}

impl QuantType {
    /// `"nf4"` or `"fp4"`.
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Nf4 => "nf4",
            QuantType::Fp4 => "fp4",
        }
    }

    /// Parses `"nf4"` / `"fp4"`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "nf4" => Some(QuantType::Nf4),
            "fp4" => Some(QuantType::Fp4),
            _ => None,
        }
    }

    /// The code table as bitsandbytes stores it in `quant_map`.
    pub fn code_table(self) -> [f32; 16] {
        match self {
            QuantType::Nf4 => table_from_bits(&NF4_CODE_BITS),
            QuantType::Fp4 => table_from_bits(&FP4_CODE_BITS),
        }
    }

    /// Suffix of the quant-state key: `quant_state.bitsandbytes__nf4`.
    pub fn state_key_suffix(self) -> &'static str {
        match self {
            QuantType::Nf4 => "quant_state.bitsandbytes__nf4",
            QuantType::Fp4 => "quant_state.bitsandbytes__fp4",
        }
    }
}

/// The dtype a weight had when it was quantized (the default output of dequantization).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FloatDtype {
    /// float32.
    F32,
    /// float16.
    F16,
    /// bfloat16.
    BF16,
}

impl FloatDtype {
    /// The name bitsandbytes writes (`"float32"`, `"float16"`, `"bfloat16"`).
    pub fn name(self) -> &'static str {
        match self {
            FloatDtype::F32 => "float32",
            FloatDtype::F16 => "float16",
            FloatDtype::BF16 => "bfloat16",
        }
    }

    /// Parses a bitsandbytes dtype name (also accepts a `torch.` prefix).
    pub fn parse(s: &str) -> Option<Self> {
        match s.strip_prefix("torch.").unwrap_or(s) {
            "float32" | "float" => Some(FloatDtype::F32),
            "float16" | "half" => Some(FloatDtype::F16),
            "bfloat16" => Some(FloatDtype::BF16),
            _ => None,
        }
    }

    /// The matching safetensors dtype.
    pub fn safetensors_dtype(self) -> Dtype {
        match self {
            FloatDtype::F32 => Dtype::F32,
            FloatDtype::F16 => Dtype::F16,
            FloatDtype::BF16 => Dtype::BF16,
        }
    }

    /// From a safetensors dtype, when it is one of the three.
    pub fn from_safetensors(d: Dtype) -> Option<Self> {
        match d {
            Dtype::F32 => Some(FloatDtype::F32),
            Dtype::F16 => Some(FloatDtype::F16),
            Dtype::BF16 => Some(FloatDtype::BF16),
            _ => None,
        }
    }

    /// Rounds an f32 to this dtype (round to nearest even) and back.
    pub fn round(self, v: f32) -> f32 {
        match self {
            FloatDtype::F32 => v,
            FloatDtype::F16 => round_f16(v),
            FloatDtype::BF16 => round_bf16(v),
        }
    }
}

/// Double-quantization fields of the quant state.
#[derive(Debug, Clone, PartialEq)]
pub struct NestedState {
    /// Blocksize of the absmax quantization (bitsandbytes: always 256).
    pub blocksize: u64,
    /// dtype of `nested_absmax` (`"float32"`).
    pub dtype: String,
    /// The mean that was subtracted from absmax before quantizing it, as written (a Python float
    /// holding an f32 value).
    pub offset: f64,
}

impl NestedState {
    /// The offset as the f32 bitsandbytes adds.
    pub fn offset_f32(&self) -> f32 {
        self.offset as f32
    }
}

/// The JSON blob stored under `<w>.quant_state.bitsandbytes__nf4|__fp4`.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantStateJson {
    /// NF4 or FP4.
    pub quant_type: QuantType,
    /// Elements per absmax block.
    pub blocksize: u64,
    /// dtype of the weight before quantization.
    pub dtype: FloatDtype,
    /// Logical shape of the weight.
    pub shape: Vec<u64>,
    /// Present when double-quantized.
    pub nested: Option<NestedState>,
}

fn check_blocksize(field: &'static str, value: u64) -> std::result::Result<(), QuantProblem> {
    if value.is_power_of_two() && (MIN_BLOCKSIZE..=MAX_BLOCKSIZE).contains(&value) {
        Ok(())
    } else {
        Err(QuantProblem::BadBlocksize { field, value })
    }
}

type QResult<T> = std::result::Result<T, QuantProblem>;

impl QuantStateJson {
    /// Parses a weight's quant-state JSON and checks it against what the header says of its
    /// components (dtype and element count of each, the packed bytes), before any of them is
    /// read: the same problems [`QuantState::from_parts`] reports, found from the header alone.
    #[allow(clippy::too_many_arguments)]
    pub fn check_entries(
        file: &str,
        tensor: &str,
        key_quant_type: QuantType,
        json: &[u8],
        packed: &TensorEntry,
        absmax: &TensorEntry,
        quant_map: &TensorEntry,
        nested_absmax: Option<&TensorEntry>,
        nested_quant_map: Option<&TensorEntry>,
    ) -> Result<Self> {
        let err = |problem| Error::Quant {
            file: file.into(),
            tensor: tensor.into(),
            problem,
        };
        let parsed = Self::parse(json).map_err(err)?;
        if parsed.quant_type != key_quant_type {
            return Err(err(QuantProblem::UnknownQuantType(format!(
                "{} in the JSON, but the key says {}",
                parsed.quant_type.name(),
                key_quant_type.name()
            ))));
        }
        let want = |component: &'static str,
                    e: &TensorEntry,
                    dtype: Dtype,
                    dname: &'static str,
                    n: u64| {
            if e.dtype != dtype {
                return Err(err(QuantProblem::WrongDtype {
                    component,
                    expected: dname,
                    actual: dtype_name(e.dtype),
                }));
            }
            if e.numel() != n {
                return Err(err(QuantProblem::WrongCount {
                    component,
                    expected: n,
                    actual: e.numel(),
                }));
            }
            Ok(())
        };
        want("quant_map", quant_map, Dtype::F32, "F32", 16)?;
        let nblocks = parsed.num_blocks();
        match (&parsed.nested, nested_absmax, nested_quant_map) {
            (None, None, None) => want("absmax", absmax, Dtype::F32, "F32", nblocks)?,
            (Some(n), Some(na), Some(nq)) => {
                want(
                    "absmax",
                    absmax,
                    Dtype::U8,
                    "U8 (double quantization)",
                    nblocks,
                )?;
                want(
                    "nested_absmax",
                    na,
                    Dtype::F32,
                    "F32",
                    nblocks.div_ceil(n.blocksize),
                )?;
                want("nested_quant_map", nq, Dtype::F32, "F32", 256)?;
            }
            (Some(_), _, _) => {
                return Err(err(QuantProblem::InconsistentNesting(
                    "the JSON has nested_* fields but nested_absmax / nested_quant_map are missing"
                        .into(),
                )))
            }
            (None, _, _) => {
                return Err(err(QuantProblem::InconsistentNesting(
                    "nested_absmax / nested_quant_map present but the JSON has no nested_* fields"
                        .into(),
                )))
            }
        }
        check_packed_entry(&parsed, file, tensor, packed)?;
        Ok(parsed)
    }

    /// Parses and validates the blob's bytes.
    pub fn parse(bytes: &[u8]) -> QResult<Self> {
        let bad = |m: String| QuantProblem::BadJson(m);
        let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        let obj = v
            .as_object()
            .ok_or_else(|| bad("not a JSON object".into()))?;
        let field = |k: &str| {
            obj.get(k)
                .ok_or_else(|| bad(format!("missing field '{k}'")))
        };
        let get_str = |k: &str| -> QResult<&str> {
            field(k)?
                .as_str()
                .ok_or_else(|| bad(format!("field '{k}' is not a string")))
        };
        let get_u64 = |k: &str| -> QResult<u64> {
            field(k)?
                .as_u64()
                .ok_or_else(|| bad(format!("field '{k}' is not a non-negative integer")))
        };
        let qt = get_str("quant_type")?;
        let quant_type =
            QuantType::parse(qt).ok_or_else(|| QuantProblem::UnknownQuantType(qt.to_string()))?;
        let blocksize = get_u64("blocksize")?;
        check_blocksize("blocksize", blocksize)?;
        let dt = get_str("dtype")?;
        let dtype =
            FloatDtype::parse(dt).ok_or_else(|| QuantProblem::UnknownDtype(dt.to_string()))?;
        let shape = field("shape")?
            .as_array()
            .ok_or_else(|| bad("field 'shape' is not a list".into()))?
            .iter()
            .map(|d| {
                d.as_u64()
                    .ok_or_else(|| bad("field 'shape' holds a non-integer".into()))
            })
            .collect::<QResult<Vec<u64>>>()?;
        shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or(QuantProblem::ShapeOverflow)?;
        let present = ["nested_blocksize", "nested_dtype", "nested_offset"]
            .iter()
            .filter(|k| obj.contains_key(**k))
            .count();
        let nested = match present {
            0 => None,
            3 => {
                let nb = get_u64("nested_blocksize")?;
                if !nb.is_power_of_two() || nb > MAX_BLOCKSIZE {
                    return Err(QuantProblem::BadBlocksize {
                        field: "nested_blocksize",
                        value: nb,
                    });
                }
                let nd = get_str("nested_dtype")?;
                if FloatDtype::parse(nd) != Some(FloatDtype::F32) {
                    return Err(QuantProblem::UnknownDtype(nd.to_string()));
                }
                let off = field("nested_offset")?
                    .as_f64()
                    .filter(|o| o.is_finite())
                    .ok_or_else(|| bad("field 'nested_offset' is not a finite number".into()))?;
                Some(NestedState {
                    blocksize: nb,
                    dtype: nd.to_string(),
                    offset: off,
                })
            }
            _ => {
                return Err(QuantProblem::InconsistentNesting(
                    "nested_blocksize, nested_dtype and nested_offset must appear together".into(),
                ))
            }
        };
        Ok(QuantStateJson {
            quant_type,
            blocksize,
            dtype,
            shape,
            nested,
        })
    }

    /// The exact bytes bitsandbytes writes (`json.dumps` with default separators, fields in
    /// bitsandbytes' order).
    pub fn to_json_bytes(&self) -> Vec<u8> {
        let shape: Vec<String> = self.shape.iter().map(|d| d.to_string()).collect();
        let mut s = format!(
            "{{\"quant_type\": \"{}\", \"blocksize\": {}, \"dtype\": \"{}\", \"shape\": [{}]",
            self.quant_type.name(),
            self.blocksize,
            self.dtype.name(),
            shape.join(", ")
        );
        if let Some(n) = &self.nested {
            s.push_str(&format!(
                ", \"nested_blocksize\": {}, \"nested_dtype\": \"{}\", \"nested_offset\": {}",
                n.blocksize,
                n.dtype,
                python_float_repr(n.offset)
            ));
        }
        s.push('}');
        s.into_bytes()
    }

    /// Number of logical elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Number of absmax blocks (`ceil(n / blocksize)`).
    pub fn num_blocks(&self) -> u64 {
        self.numel().div_ceil(self.blocksize)
    }

    /// Bytes of packed codes (`ceil(n / 2)`).
    pub fn packed_bytes(&self) -> u64 {
        self.numel().div_ceil(2)
    }

    /// Number of nested absmax values, when double-quantized.
    pub fn num_nested_blocks(&self) -> Option<u64> {
        self.nested
            .as_ref()
            .map(|n| self.num_blocks().div_ceil(n.blocksize))
    }
}

/// Formats an f64 the way Python's `repr(float)` (and so `json.dumps`) does.
pub fn python_float_repr(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    if v == 0.0 {
        return if v.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    // Rust's `{:e}` gives the shortest round-trip digits, as Python's repr does.
    let e_fmt = format!("{:e}", v.abs());
    let (mant, exp) = e_fmt.split_once('e').unwrap_or((&e_fmt, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if v < 0.0 { "-" } else { "" };
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            let (int_part, frac) = if digits.len() > int_len {
                (digits[..int_len].to_string(), digits[int_len..].to_string())
            } else {
                (
                    format!("{digits}{}", "0".repeat(int_len - digits.len())),
                    "0".to_string(),
                )
            };
            format!("{sign}{int_part}.{frac}")
        } else {
            format!("{sign}0.{}{digits}", "0".repeat((-exp - 1) as usize))
        }
    } else {
        let m = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        let es = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{es}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_repr_matches_json_dumps() {
        for (v, want) in [
            (0.3630799949169159f64, "0.3630799949169159"),
            (0.5, "0.5"),
            (1.0, "1.0"),
            (-2.5, "-2.5"),
            (1e-05, "1e-05"),
            (0.0001, "0.0001"),
            (1.5e16, "1.5e+16"),
            (123456789012345.0, "123456789012345.0"),
            (-3.0517578125e-05, "-3.0517578125e-05"),
            (0.0, "0.0"),
        ] {
            assert_eq!(python_float_repr(v), want, "{v:e}");
        }
    }

    #[test]
    fn quant_state_json_round_trips_to_the_same_bytes() {
        let blob = br#"{"quant_type": "fp4", "blocksize": 128, "dtype": "bfloat16", "shape": [7, 3], "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.13923098146915436}"#;
        let parsed = QuantStateJson::parse(blob).expect("parse");
        assert_eq!(parsed.quant_type, QuantType::Fp4);
        assert_eq!(parsed.num_blocks(), 1);
        assert_eq!(parsed.packed_bytes(), 11);
        assert_eq!(parsed.to_json_bytes(), blob.to_vec());
    }

    #[test]
    fn fast_dequant_is_bit_identical_to_the_reference() {
        // Sizes: odd, partial last block, and large enough for the threaded path.
        for (n, bs) in [
            (1usize, 64u64),
            (7, 32),
            (1961, 64),
            (33300, 32),
            (300_001, 256),
        ] {
            let packed: Vec<u8> = (0..n.div_ceil(2))
                .map(|i| ((i * 2654435761usize) >> 7) as u8)
                .collect();
            let nb = n.div_ceil(bs as usize);
            let absmax: Vec<f32> = (0..nb).map(|j| 0.01 + j as f32 * 0.37 % 3.0).collect();
            let state = QuantState {
                json: QuantStateJson {
                    quant_type: QuantType::Fp4,
                    blocksize: bs,
                    dtype: FloatDtype::F32,
                    shape: vec![n as u64],
                    nested: None,
                },
                code: QuantType::Fp4.code_table(),
                absmax,
            };
            let mut a = vec![0f32; n];
            let mut b = vec![1f32; n];
            state.dequantize_ref(&packed, &mut a).expect("ref");
            state.dequantize(&packed, &mut b).expect("fast");
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "n={n} bs={bs}"
            );
            let mut lut = vec![2f32; n];
            crate::format::bnb::dequant_fast::dequantize_range_lut(
                &state.code,
                &state.absmax,
                bs as usize,
                &packed,
                &mut lut,
                0,
            );
            assert!(
                a.iter().zip(&lut).all(|(x, y)| x.to_bits() == y.to_bits()),
                "lut n={n}"
            );
        }
    }

    #[test]
    fn wrong_output_length_is_an_error_not_a_panic() {
        let state = QuantState {
            json: QuantStateJson {
                quant_type: QuantType::Nf4,
                blocksize: 64,
                dtype: FloatDtype::F32,
                shape: vec![10, 10],
                nested: None,
            },
            code: QuantType::Nf4.code_table(),
            absmax: vec![1.0, 1.0],
        };
        assert!(state.dequantize(&[0u8; 50], &mut [0f32; 99]).is_err());
        assert!(state.dequantize_ref(&[0u8; 49], &mut [0f32; 100]).is_err());
    }
}
