//! The optimized CPU dequantization path: a byte -> (code, code) pair table, AVX2 table lookups
//! where the CPU has them, and all cores for large weights. It must stay bit-identical to
//! `QuantState::dequantize_ref` (the conformance and fixture tests compare them); the only
//! arithmetic is the same single f32 multiply per element.

/// Below this many elements a weight is dequantized on the calling thread.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 16;

/// Dequantizes `out.len()` elements. `packed` holds at least `ceil(out.len() / 2)` bytes,
/// `absmax` one scale per `blocksize` elements, `blocksize` even.
pub fn dequantize(
    code: &[f32; 16],
    absmax: &[f32],
    blocksize: usize,
    packed: &[u8],
    out: &mut [f32],
) {
    let n = out.len();
    let threads = worker_threads(n);
    if threads <= 1 {
        dequantize_range(code, absmax, blocksize, packed, out, 0);
        return;
    }
    let blocks = n.div_ceil(blocksize);
    let chunk = blocks.div_ceil(threads) * blocksize;
    std::thread::scope(|s| {
        for (ci, o) in out.chunks_mut(chunk).enumerate() {
            s.spawn(move || dequantize_range(code, absmax, blocksize, packed, o, ci * chunk));
        }
    });
}

#[cfg(not(target_arch = "wasm32"))]
fn worker_threads(n: usize) -> usize {
    if n < PARALLEL_MIN_ELEMENTS {
        return 1;
    }
    std::thread::available_parallelism()
        .map(|p| p.get())
        .unwrap_or(1)
}

#[cfg(target_arch = "wasm32")]
fn worker_threads(_n: usize) -> usize {
    let _ = PARALLEL_MIN_ELEMENTS;
    1
}

/// Dequantizes the elements `start .. start + out.len()`; `start` is a multiple of `blocksize`.
fn dequantize_range(
    code: &[f32; 16],
    absmax: &[f32],
    blocksize: usize,
    packed: &[u8],
    out: &mut [f32],
    start: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 support was just checked.
            unsafe { avx2::dequantize_range(code, absmax, blocksize, packed, out, start) };
            return;
        }
    }
    dequantize_range_lut(code, absmax, blocksize, packed, out, start);
}

/// Portable path: one table lookup per byte yields both elements.
pub fn dequantize_range_lut(
    code: &[f32; 16],
    absmax: &[f32],
    blocksize: usize,
    packed: &[u8],
    out: &mut [f32],
    start: usize,
) {
    let mut pairs = [[0f32; 2]; 256];
    for (b, p) in pairs.iter_mut().enumerate() {
        *p = [code[b >> 4], code[b & 15]];
    }
    for (bi, block) in out.chunks_mut(blocksize).enumerate() {
        let g = start + bi * blocksize;
        let scale = absmax[g / blocksize];
        let bytes = &packed[g / 2..];
        let half = block.len() / 2;
        let mut it = block.chunks_exact_mut(2);
        for (o, &b) in (&mut it).zip(bytes) {
            let p = pairs[b as usize];
            o[0] = p[0] * scale;
            o[1] = p[1] * scale;
        }
        if let [last] = it.into_remainder() {
            *last = pairs[bytes[half] as usize][0] * scale;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2")]
    pub unsafe fn dequantize_range(
        code: &[f32; 16],
        absmax: &[f32],
        blocksize: usize,
        packed: &[u8],
        out: &mut [f32],
        start: usize,
    ) {
        // SAFETY (whole body): loads and stores stay inside `code`, `bytes` (4 per 8 outputs,
        // bounds-checked by slicing) and `block` (8 per iteration, k8 + 8 <= len).
        unsafe {
            let tbl_lo = _mm256_loadu_ps(code.as_ptr());
            let tbl_hi = _mm256_loadu_ps(code.as_ptr().add(8));
            let shifts = _mm256_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0);
            let mask15 = _mm256_set1_epi32(15);
            let dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1);
            for (bi, block) in out.chunks_mut(blocksize).enumerate() {
                let g = start + bi * blocksize;
                let scale = absmax[g / blocksize];
                let sc = _mm256_set1_ps(scale);
                let bytes = &packed[g / 2..g / 2 + block.len().div_ceil(2)];
                let full = block.len() / 8;
                for k in 0..full {
                    let w = bytes[4 * k..4 * k + 4]
                        .try_into()
                        .map(u32::from_le_bytes)
                        .unwrap_or(0);
                    let v = _mm_shuffle_epi8(_mm_cvtsi32_si128(w as i32), dup);
                    let idx = _mm256_and_si256(
                        _mm256_srlv_epi32(_mm256_cvtepu8_epi32(v), shifts),
                        mask15,
                    );
                    let lo = _mm256_permutevar8x32_ps(tbl_lo, idx);
                    let hi = _mm256_permutevar8x32_ps(tbl_hi, idx);
                    let sel = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
                    let val = _mm256_blendv_ps(lo, hi, sel);
                    _mm256_storeu_ps(block.as_mut_ptr().add(8 * k), _mm256_mul_ps(val, sc));
                }
                for i in full * 8..block.len() {
                    let b = bytes[i / 2];
                    let q = if i % 2 == 0 { b >> 4 } else { b & 15 };
                    block[i] = code[q as usize] * scale;
                }
            }
        }
    }
}
