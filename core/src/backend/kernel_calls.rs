//! Backend-neutral kernel calls: for every op, the kernel (file and entry-point name), its scalar
//! parameters in the kernel's order (u32 words; f32 values as their bits, which is also how a CUDA
//! kernel receives a `float` argument), the number of work items, and the order of its buffer
//! operands. The wgpu and CUDA kernels share these signatures.

use crate::graph::{OpKind, RopeMode};

/// Attention over at least this many query rows runs the blocked kernel (`attention`: 64 rows a
/// workgroup or block, keys and values staged in shared memory); fewer (decode, short prompts)
/// run `attention_rows`, where a 64-row block would be mostly idle.
pub const ATTENTION_BLOCK_MIN_ROWS: usize = 32;

fn f(v: f32) -> u32 {
    v.to_bits()
}

/// One buffer operand of a kernel, in binding order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// The op's input `i`.
    Input(usize),
    /// An optional input that is absent: a dummy buffer is bound.
    Absent,
    /// The 4-bit weight's packed codes.
    Packed,
    /// The 4-bit weight's f32 absmax.
    Absmax,
    /// The 4-bit weight's code table.
    Code,
}

/// The buffer operands of `op`'s kernel in order (the output follows them).
pub fn operands(op: &OpKind, n_inputs: usize) -> Vec<Slot> {
    let opt = |present: bool, i: usize| {
        if present {
            Slot::Input(i)
        } else {
            Slot::Absent
        }
    };
    match op {
        OpKind::Dequant4 => vec![Slot::Packed, Slot::Absmax, Slot::Code],
        OpKind::LinearQ4 { bias } => vec![
            Slot::Input(0),
            Slot::Packed,
            Slot::Absmax,
            Slot::Code,
            opt(*bias, 1),
        ],
        OpKind::Linear { bias } => vec![Slot::Input(0), Slot::Input(1), opt(*bias, 2)],
        OpKind::LayerNorm { affine, .. } => vec![Slot::Input(0), opt(*affine, 1), opt(*affine, 2)],
        OpKind::Attention { key_mask, .. } => vec![
            Slot::Input(0),
            Slot::Input(1),
            Slot::Input(2),
            opt(*key_mask, 3),
        ],
        OpKind::Conv2d { bias, .. } => vec![Slot::Input(0), Slot::Input(1), opt(*bias, 2)],
        // In place: the cache is the output binding; only the new rows and the position are read.
        OpKind::CacheWrite => vec![Slot::Input(1), Slot::Input(2)],
        _ => (0..n_inputs).map(Slot::Input).collect(),
    }
}

/// `Err` when a dimension or an element count of the operands is past `u32::MAX`, the kernels'
/// parameter width. Every parameter [`call`] gives is a dimension, a count or a stride no larger
/// than an operand's element count, so once this holds its casts are lossless.
pub fn fits_u32(shapes: &[Vec<usize>], out: &[usize]) -> Result<(), String> {
    for s in shapes.iter().map(Vec::as_slice).chain(std::iter::once(out)) {
        let n = s.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if n.is_none_or(|n| n > u32::MAX as usize) || s.iter().any(|&d| d > u32::MAX as usize) {
            return Err(format!(
                "an operand of shape {s:?} has more than {} elements, past the kernels' 32-bit \
                 sizes",
                u32::MAX
            ));
        }
    }
    Ok(())
}

/// Kernel name, scalar parameters and work items of `op` for these operand shapes (`bn`: element
/// count of the second input, for broadcasting ops); `Err` where a size is past the kernels'
/// 32-bit parameters ([`fits_u32`]).
pub fn call(
    op: &OpKind,
    shapes: &[Vec<usize>],
    out: &[usize],
    q4_blocksize: u32,
    bn: usize,
) -> Result<(&'static str, Vec<u32>, usize), String> {
    fits_u32(shapes, out)?;
    Ok(call_checked(op, shapes, out, q4_blocksize, bn))
}

/// [`call`] once the sizes fit 32 bits.
fn call_checked(
    op: &OpKind,
    shapes: &[Vec<usize>],
    out: &[usize],
    q4_blocksize: u32,
    bn: usize,
) -> (&'static str, Vec<u32>, usize) {
    let n: usize = out.iter().product();
    let last = |i: usize| *shapes[i].last().unwrap_or(&1) as u32;
    let rows = |i: usize| (n as u32) / last(i).max(1);
    match op {
        OpKind::Dequant4 => ("dequant4", vec![n as u32, q4_blocksize], n),
        OpKind::LinearQ4 { bias } => {
            let (r, k) = (shapes[0][0] as u32, shapes[0][1] as u32);
            let n = out[1] as u32;
            (
                "linear_q4",
                vec![r, n, k, q4_blocksize, *bias as u32, n, 0],
                n as usize * r as usize,
            )
        }
        OpKind::Linear { bias } => {
            let (r, k) = (shapes[0][0] as u32, shapes[0][1] as u32);
            let nn = shapes[1][0] as u32;
            ("linear", vec![r, nn, k, *bias as u32, nn, 0], n)
        }
        OpKind::MatMul { transpose_b } => {
            let a = &shapes[0];
            (
                "matmul",
                vec![
                    a[0] as u32,
                    a[1] as u32,
                    out[2] as u32,
                    a[2] as u32,
                    *transpose_b as u32,
                ],
                n,
            )
        }
        OpKind::Add => ("add", vec![n as u32, bn as u32], n),
        OpKind::Mul => ("mul", vec![n as u32, bn as u32], n),
        OpKind::Scale { factor } => ("scale", vec![n as u32, f(*factor)], n),
        OpKind::Silu => ("silu", vec![n as u32], n),
        OpKind::Gelu => ("gelu", vec![n as u32], n),
        OpKind::GeluTanh => ("gelu_tanh", vec![n as u32], n),
        OpKind::QuickGelu => ("quick_gelu", vec![n as u32], n),
        OpKind::Reshape { .. } => ("reshape", vec![n as u32], n),
        OpKind::RmsNorm { eps } => (
            "rms_norm",
            vec![rows(0), last(0), f(*eps)],
            rows(0) as usize,
        ),
        OpKind::LayerNorm { eps, affine } => (
            "layer_norm",
            vec![rows(0), last(0), f(*eps), *affine as u32],
            rows(0) as usize,
        ),
        OpKind::Softmax => ("softmax", vec![rows(0), last(0)], rows(0) as usize),
        OpKind::Rope { mode } => {
            let s = &shapes[0];
            let m = match mode {
                RopeMode::RotateHalf => 0,
                RopeMode::Interleaved => 1,
            };
            (
                "rope",
                vec![s[0] as u32, s[1] as u32, s[2] as u32, m],
                n / 2,
            )
        }
        OpKind::Attention {
            causal,
            scale,
            key_mask,
        } => {
            let (q, k) = (&shapes[0], &shapes[1]);
            let p = vec![
                q[0] as u32,
                k[0] as u32,
                q[1] as u32,
                k[1] as u32,
                q[2] as u32,
                *causal as u32,
                *key_mask as u32,
                f(*scale),
            ];
            if q[1] < ATTENTION_BLOCK_MIN_ROWS {
                // Decode and short prompts: a thread (wgpu) or a warp (CUDA) per query row.
                ("attention_rows", p, q[0] * q[1])
            } else {
                // The blocked kernels: on wgpu a workgroup of 64 invocations per 64 query rows
                // of a head (CUDA launches its own grid).
                ("attention", p, q[0] * q[1].div_ceil(64) * 64)
            }
        }
        OpKind::Embedding => (
            "embedding",
            vec![
                shapes[0][0] as u32,
                shapes[1][1] as u32,
                0,
                shapes[1][0] as u32,
            ],
            n,
        ),
        OpKind::Concat { axis } => {
            let outer: usize = shapes[0][..*axis].iter().product();
            let ia: usize = shapes[0][*axis..].iter().product();
            let ib: usize = shapes[1][*axis..].iter().product();
            ("concat", vec![outer as u32, ia as u32, ib as u32], n)
        }
        OpKind::Slice { axis, start, len } => {
            let s = &shapes[0];
            let outer: usize = s[..*axis].iter().product();
            let inner: usize = s[*axis + 1..].iter().product();
            (
                "slice",
                vec![
                    outer as u32,
                    s[*axis] as u32,
                    *start as u32,
                    *len as u32,
                    inner as u32,
                ],
                n,
            )
        }
        OpKind::Permute { perm } => {
            let s = &shapes[0];
            let rank = s.len();
            let mut strides = vec![1usize; rank];
            for i in (0..rank.saturating_sub(1)).rev() {
                strides[i] = strides[i + 1] * s[i + 1];
            }
            let pad = 4 - rank;
            let (mut dims, mut src) = ([1u32; 4], [0u32; 4]);
            for (i, &p) in perm.iter().enumerate() {
                dims[pad + i] = s[p] as u32;
                src[pad + i] = strides[p] as u32;
            }
            (
                "permute",
                vec![
                    n as u32, dims[0], dims[1], dims[2], dims[3], src[0], src[1], src[2], src[3],
                ],
                n,
            )
        }
        OpKind::AdaLnModulate => ("adaln_modulate", vec![n as u32, last(0)], n),
        OpKind::Conv2d { kernel, pad, bias } => {
            let x = &shapes[0];
            (
                "conv2d",
                vec![
                    x[0] as u32,
                    x[1] as u32,
                    x[2] as u32,
                    out[0] as u32,
                    out[1] as u32,
                    out[2] as u32,
                    *kernel as u32,
                    *pad as u32,
                    *bias as u32,
                ],
                n,
            )
        }
        OpKind::GroupNorm { groups, eps } => {
            let c = shapes[0][0];
            let spatial = n / c.max(1);
            (
                "group_norm",
                vec![c as u32, spatial as u32, *groups as u32, f(*eps)],
                // 64 lanes per group (one wgpu workgroup; CUDA launches one block per group).
                *groups * 64,
            )
        }
        OpKind::Upsample2x => {
            let x = &shapes[0];
            ("upsample2x", vec![x[0] as u32, x[1] as u32, x[2] as u32], n)
        }
        OpKind::CacheWrite => {
            let (c, x) = (&shapes[0], &shapes[1]);
            let items = x[0] * x[1] * x[2];
            (
                "cache_write",
                vec![x[0] as u32, c[1] as u32, x[1] as u32, x[2] as u32],
                items,
            )
        }
        OpKind::TimestepEmbedding {
            dim,
            flip_sin_to_cos,
            downscale_freq_shift,
            scale,
            max_period,
        } => (
            "timestep_embedding",
            vec![
                shapes[0][0] as u32,
                *dim as u32,
                *flip_sin_to_cos as u32,
                f(*downscale_freq_shift),
                f(*scale),
                f(*max_period),
            ],
            n,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_past_32_bits_are_refused_not_truncated() {
        let op = OpKind::Add;
        let ok = vec![vec![1usize << 16, 1 << 15]];
        assert!(call(&op, &ok, &ok[0], 0, 1).is_ok());
        // 2^32 elements: a u32 count would wrap to 0.
        let big = vec![vec![1usize << 16, 1 << 16]];
        let e = call(&op, &big, &big[0], 0, 1).expect_err("past u32");
        assert!(e.contains("32-bit"), "{e}");
        // One dimension past u32 in an operand of few elements overall cannot happen, but a
        // dimension alone past u32 is refused too.
        assert!(fits_u32(&[vec![u32::MAX as usize + 1]], &[1]).is_err());
        assert!(fits_u32(&[vec![u32::MAX as usize]], &[1]).is_ok());
    }
}
