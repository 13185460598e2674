//! The reference linear layers.

use crate::error::{Error, Result};
use crate::format::bnb::QuantState;

/// `y = x W^T + b` for a 4-bit weight `W` of logical shape `[out, in]` and `x` of shape
/// `[rows, in]` (row-major). The weight is dequantized with the reference dequantizer and each
/// dot product accumulates in f64.
pub fn linear_4bit(
    x: &[f32],
    rows: usize,
    state: &QuantState,
    packed: &[u8],
    bias: Option<&[f32]>,
) -> Result<Vec<f32>> {
    let [out_f, in_f] = state.json.shape[..] else {
        return Err(Error::Invalid(format!(
            "linear_4bit: weight shape {:?} is not 2-D",
            state.json.shape
        )));
    };
    let (out_f, in_f) = (out_f as usize, in_f as usize);
    let mut w = vec![0f32; state.numel()];
    state.dequantize_ref(packed, &mut w)?;
    linear(x, rows, &w, out_f, in_f, bias)
}

/// `y = x W^T + b` for a dense f32 weight `[out_f, in_f]`, f64 accumulation.
pub fn linear(
    x: &[f32],
    rows: usize,
    w: &[f32],
    out_f: usize,
    in_f: usize,
    bias: Option<&[f32]>,
) -> Result<Vec<f32>> {
    if x.len() != rows * in_f || w.len() != out_f * in_f {
        return Err(Error::Invalid(format!(
            "linear: x has {} values for {rows} x {in_f}, weight {} for {out_f} x {in_f}",
            x.len(),
            w.len()
        )));
    }
    if let Some(b) = bias {
        if b.len() != out_f {
            return Err(Error::Invalid(format!(
                "linear: bias has {} values, expected {out_f}",
                b.len()
            )));
        }
    }
    let mut y = vec![0f32; rows * out_f];
    for r in 0..rows {
        let xr = &x[r * in_f..(r + 1) * in_f];
        for o in 0..out_f {
            let wr = &w[o * in_f..(o + 1) * in_f];
            let mut acc = 0f64;
            for (a, b) in xr.iter().zip(wr) {
                acc += *a as f64 * *b as f64;
            }
            if let Some(b) = bias {
                acc += b[o] as f64;
            }
            y[r * out_f + o] = acc as f32;
        }
    }
    Ok(y)
}
