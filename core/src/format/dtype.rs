//! Little-endian byte <-> float conversions shared by readers and writers.

use half::{bf16, f16};
pub use safetensors::Dtype;

/// The name safetensors uses for a dtype (`F32`, `BF16`, `U8`, ...).
pub fn dtype_name(dtype: Dtype) -> String {
    format!("{dtype:?}")
}

/// Size of one element in bits.
pub fn dtype_bits(dtype: Dtype) -> u64 {
    dtype.bitsize() as u64
}

/// Widens little-endian F32/F16/BF16/F64 bytes to f32 (F64 is rounded). `None` for other dtypes
/// or a length that is not a multiple of the element size.
pub fn bytes_to_f32(bytes: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    let size = match dtype {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::BF16 => 2,
        Dtype::F64 => 8,
        _ => return None,
    };
    if !bytes.len().is_multiple_of(size) {
        return None;
    }
    let chunks = bytes.chunks_exact(size);
    Some(match dtype {
        Dtype::F32 => chunks
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => chunks
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => chunks
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => chunks
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect(),
    })
}

/// Widens little-endian F32/F16/BF16/F64 bytes into `out` (one f32 per element); false for other
/// dtypes or when the lengths do not agree.
pub fn widen_into(bytes: &[u8], dtype: Dtype, out: &mut [f32]) -> bool {
    let size = match dtype {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::BF16 => 2,
        Dtype::F64 => 8,
        _ => return false,
    };
    if bytes.len() != out.len() * size {
        return false;
    }
    let chunks = bytes.chunks_exact(size);
    match dtype {
        Dtype::F32 => {
            for (o, c) in out.iter_mut().zip(chunks) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        // bf16 is the top half of an f32: a shift, exact.
        Dtype::BF16 => {
            for (o, c) in out.iter_mut().zip(chunks) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        Dtype::F16 => {
            for (o, c) in out.iter_mut().zip(chunks) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => {
            for (o, c) in out.iter_mut().zip(chunks) {
                *o = f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32;
            }
        }
    }
    true
}

/// f32 values as little-endian bytes.
pub fn f32_to_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Rounds f32 to float16 (round to nearest even), as torch's `.to(torch.float16)` does.
pub fn round_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// The first `n` bf16 values packed two per word (element `2i` in the low half of word `i`),
/// widened to f32.
pub fn bf16_words_to_f32(words: &[u32], n: usize) -> Vec<f32> {
    words
        .iter()
        .flat_map(|w| [f32::from_bits(w << 16), f32::from_bits(w & 0xffff_0000)])
        .take(n)
        .collect()
}

/// Rounds f32 to bfloat16 (round to nearest even), as torch's `.to(torch.bfloat16)` does.
pub fn round_bf16(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}
