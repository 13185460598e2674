//! A weight's quant state resolved to what dequantization needs (code table, f32 absmax with
//! double quantization undone bit-exactly), and the reference dequantization.

use crate::error::{Error, QuantProblem, Result};
use crate::format::bnb::{FloatDtype, QuantStateJson, QuantType};
use crate::format::dtype::{bytes_to_f32, dtype_name, Dtype};
use crate::format::safetensors::TensorEntry;

/// Raw bytes and dtype of one component, as read from a file or a ring slot.
#[derive(Debug, Clone, Copy)]
pub struct RawTensor<'a> {
    /// Element type.
    pub dtype: Dtype,
    /// Number of elements the header declares.
    pub numel: u64,
    /// The bytes.
    pub bytes: &'a [u8],
}

/// The non-packed parts of a 4-bit weight, as raw tensors.
#[derive(Debug, Clone, Copy)]
pub struct QuantStateParts<'a> {
    /// NF4/FP4 from the key suffix.
    pub key_quant_type: QuantType,
    /// The JSON blob.
    pub json: &'a [u8],
    /// `absmax`.
    pub absmax: RawTensor<'a>,
    /// `quant_map`.
    pub quant_map: RawTensor<'a>,
    /// `nested_absmax`.
    pub nested_absmax: Option<RawTensor<'a>>,
    /// `nested_quant_map`.
    pub nested_quant_map: Option<RawTensor<'a>>,
}

/// A validated quantization state with absmax resolved to f32: everything needed to
/// dequantize the packed bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantState {
    /// The parsed JSON.
    pub json: QuantStateJson,
    /// The 16-entry code table from `quant_map`.
    pub code: [f32; 16],
    /// One f32 scale per block (double quantization already undone, bit-exactly).
    pub absmax: Vec<f32>,
}

fn f32_component(
    file: &str,
    tensor: &str,
    component: &'static str,
    raw: &RawTensor<'_>,
    expected: u64,
) -> Result<Vec<f32>> {
    let err = |problem| Error::Quant {
        file: file.into(),
        tensor: tensor.into(),
        problem,
    };
    if raw.dtype != Dtype::F32 {
        return Err(err(QuantProblem::WrongDtype {
            component,
            expected: "F32",
            actual: dtype_name(raw.dtype),
        }));
    }
    let actual = raw.bytes.len() as u64 / 4;
    if raw.numel != expected || actual != expected {
        return Err(err(QuantProblem::WrongCount {
            component,
            expected,
            actual: raw.numel,
        }));
    }
    bytes_to_f32(raw.bytes, Dtype::F32).ok_or_else(|| {
        err(QuantProblem::WrongCount {
            component,
            expected,
            actual,
        })
    })
}

/// Double quantization undone as bitsandbytes does it: `dequantize_blockwise(absmax_u8,
/// nested_absmax)` in f32, then `+ offset`, i.e. `map[codes[j]] * nested_absmax[j / nbs] +
/// offset`; `put(j, value)` receives every block's absmax in order.
pub fn undo_double_quant(
    codes: &[u8],
    map: &[f32],
    nested_absmax: &[f32],
    nbs: usize,
    offset: f32,
    mut put: impl FnMut(usize, f32),
) {
    for (b, (codes, &scale)) in codes.chunks(nbs).zip(nested_absmax).enumerate() {
        for (i, &q) in codes.iter().enumerate() {
            put(b * nbs + i, map[q as usize] * scale + offset);
        }
    }
}

impl QuantState {
    /// Validates the parts against each other and resolves absmax.
    pub fn from_parts(file: &str, tensor: &str, parts: &QuantStateParts<'_>) -> Result<Self> {
        let err = |problem| Error::Quant {
            file: file.into(),
            tensor: tensor.into(),
            problem,
        };
        let json = QuantStateJson::parse(parts.json).map_err(err)?;
        if json.quant_type != parts.key_quant_type {
            return Err(err(QuantProblem::UnknownQuantType(format!(
                "{} in the JSON, but the key says {}",
                json.quant_type.name(),
                parts.key_quant_type.name()
            ))));
        }
        let code_v = f32_component(file, tensor, "quant_map", &parts.quant_map, 16)?;
        let mut code = [0f32; 16];
        code.copy_from_slice(&code_v);
        let nblocks = json.num_blocks();
        let absmax =
            match (&json.nested, parts.nested_absmax, parts.nested_quant_map) {
                (None, None, None) => {
                    f32_component(file, tensor, "absmax", &parts.absmax, nblocks)?
                }
                (Some(nested), Some(na), Some(nq)) => {
                    if parts.absmax.dtype != Dtype::U8 {
                        return Err(err(QuantProblem::WrongDtype {
                            component: "absmax",
                            expected: "U8 (double quantization)",
                            actual: dtype_name(parts.absmax.dtype),
                        }));
                    }
                    if parts.absmax.numel != nblocks || parts.absmax.bytes.len() as u64 != nblocks {
                        return Err(err(QuantProblem::WrongCount {
                            component: "absmax",
                            expected: nblocks,
                            actual: parts.absmax.numel,
                        }));
                    }
                    let nn = nblocks.div_ceil(nested.blocksize);
                    let nested_absmax = f32_component(file, tensor, "nested_absmax", &na, nn)?;
                    let map = f32_component(file, tensor, "nested_quant_map", &nq, 256)?;
                    let mut absmax = vec![0f32; nblocks as usize];
                    undo_double_quant(
                        parts.absmax.bytes,
                        &map,
                        &nested_absmax,
                        nested.blocksize as usize,
                        nested.offset_f32(),
                        |j, a| absmax[j] = a,
                    );
                    absmax
                }
                (Some(_), _, _) => return Err(err(QuantProblem::InconsistentNesting(
                    "the JSON has nested_* fields but nested_absmax / nested_quant_map are missing"
                        .into(),
                ))),
                (None, _, _) => return Err(err(QuantProblem::InconsistentNesting(
                    "nested_absmax / nested_quant_map present but the JSON has no nested_* fields"
                        .into(),
                ))),
            };
        Ok(QuantState { json, code, absmax })
    }

    /// Checks the packed tensor's dtype and byte count against the logical shape.
    pub fn check_packed(&self, file: &str, tensor: &str, packed: &TensorEntry) -> Result<()> {
        check_packed_entry(&self.json, file, tensor, packed)
    }

    /// Number of logical elements.
    pub fn numel(&self) -> usize {
        self.json.numel() as usize
    }

    /// Reference dequantization to f32: `code[nibble] * absmax[i / blocksize]`, element `2i` in
    /// the high nibble. Scalar and obviously right.
    pub fn dequantize_ref(&self, packed: &[u8], out: &mut [f32]) -> Result<()> {
        self.check_lengths(packed, out)?;
        let bs = self.json.blocksize as usize;
        for (i, o) in out.iter_mut().enumerate() {
            let byte = packed[i / 2];
            let q = if i % 2 == 0 { byte >> 4 } else { byte & 0x0f };
            *o = self.code[q as usize] * self.absmax[i / bs];
        }
        Ok(())
    }

    /// Dequantizes with the fast CPU path (table lookup, SIMD where available, all cores);
    /// bit-identical to [`QuantState::dequantize_ref`].
    pub fn dequantize(&self, packed: &[u8], out: &mut [f32]) -> Result<()> {
        self.check_lengths(packed, out)?;
        crate::format::bnb::dequant_fast::dequantize(
            &self.code,
            &self.absmax,
            self.json.blocksize as usize,
            packed,
            out,
        );
        Ok(())
    }

    /// Dequantizes and rounds to the recorded dtype, as bitsandbytes' default output is
    /// (returned widened to f32).
    pub fn dequantize_native(&self, packed: &[u8], out: &mut [f32]) -> Result<()> {
        self.dequantize(packed, out)?;
        let d = self.json.dtype;
        if d != FloatDtype::F32 {
            out.iter_mut().for_each(|v| *v = d.round(*v));
        }
        Ok(())
    }

    fn check_lengths(&self, packed: &[u8], out: &[f32]) -> Result<()> {
        let n = self.numel();
        if out.len() != n || (packed.len() as u64) < self.json.packed_bytes() {
            return Err(Error::Invalid(format!(
                "dequantize: {n} elements need {} packed bytes and an output of {n}, got {} and {}",
                self.json.packed_bytes(),
                packed.len(),
                out.len()
            )));
        }
        Ok(())
    }
}

/// Checks the packed tensor's dtype and byte count against the logical shape. The bytes are
/// what count: bitsandbytes' `bnb_4bit_quant_storage` may store them as U8 (the default),
/// I8, F16, BF16 or F32 (FSDP's QLoRA), the same bytes under another element type.
pub(super) fn check_packed_entry(
    json: &QuantStateJson,
    file: &str,
    tensor: &str,
    packed: &TensorEntry,
) -> Result<()> {
    let err = |problem| Error::Quant {
        file: file.into(),
        tensor: tensor.into(),
        problem,
    };
    if ![Dtype::U8, Dtype::I8, Dtype::F16, Dtype::BF16, Dtype::F32].contains(&packed.dtype) {
        return Err(err(QuantProblem::WrongDtype {
            component: "packed weight",
            expected: "U8 (or I8, F16, BF16, F32 as quant storage)",
            actual: dtype_name(packed.dtype),
        }));
    }
    let expected = json.packed_bytes();
    if packed.len != expected {
        return Err(err(QuantProblem::WrongCount {
            component: "packed weight (bytes)",
            expected,
            actual: packed.len,
        }));
    }
    Ok(())
}
