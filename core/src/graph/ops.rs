//! The graph IR: ops are data. Every op that the Llama, Flux-style DiT and BERT graphs need is one
//! [`OpKind`] variant; shapes are checked when an op is added, with errors that say which input
//! is wrong and how. Activations are f32 (token ids u32); 4-bit weights stay packed.

use crate::error::{Error, Result};
use crate::graph::tensor::{ElemType, Q4Info, ValueInfo};

/// Rotary embedding layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeMode {
    /// Llama's rotate-half: element i pairs with i + D/2.
    RotateHalf,
    /// Flux's interleaved pairs: element 2i pairs with 2i + 1.
    Interleaved,
}

/// Every operation nibble's graphs use.
#[derive(Debug, Clone, PartialEq)]
pub enum OpKind {
    /// 4-bit weight `[n]` (any logical shape) to f32, bit-exact.
    Dequant4,
    /// `x[M,K] · W4[N,K]^T (+ b[N])` with W in bitsandbytes 4-bit.
    LinearQ4 {
        /// Whether a bias input follows.
        bias: bool,
    },
    /// `x[M,K] · W[N,K]^T (+ b[N])` with a dense weight (f32/f16/bf16 on disk, f32 here).
    Linear {
        /// Whether a bias input follows.
        bias: bool,
    },
    /// Batched `a[B,M,K] · b[B,K,N]` (or `b[B,N,K]` transposed).
    MatMul {
        /// Whether `b` is stored `[B,N,K]`.
        transpose_b: bool,
    },
    /// `a + b`; b has a's shape or is a vector over a's last dim.
    Add,
    /// `a * b`; b has a's shape or is a vector over a's last dim.
    Mul,
    /// `x * factor`.
    Scale {
        /// The factor.
        factor: f32,
    },
    /// `x / sqrt(mean(x^2) + eps) * w` over the last dim.
    RmsNorm {
        /// Epsilon.
        eps: f32,
    },
    /// `(x - mean) / sqrt(var + eps) (* w + b)` over the last dim.
    LayerNorm {
        /// Epsilon.
        eps: f32,
        /// Whether weight and bias inputs follow.
        affine: bool,
    },
    /// `x * sigmoid(x)`.
    Silu,
    /// GELU with erf.
    Gelu,
    /// GELU, tanh approximation.
    GeluTanh,
    /// CLIP's `quick_gelu`: `x * sigmoid(1.702 x)`.
    QuickGelu,
    /// Softmax over the last dim.
    Softmax,
    /// Rotary embedding of `x[T,H,D]` with `cos[T,D/2]`, `sin[T,D/2]`.
    Rope {
        /// Pairing of elements.
        mode: RopeMode,
    },
    /// Scaled dot-product attention of `q[Hq,Tq,D]` over `k,v[Hkv,Tk,D]`, grouped-query when
    /// `Hkv < Hq`; an optional `key_mask[Tk]` (1 keep, 0 pad) masks padding.
    Attention {
        /// Query i sees keys up to i + (Tk - Tq).
        causal: bool,
        /// Multiplies the scores (usually 1/sqrt(D)).
        scale: f32,
        /// Whether a key-mask input follows.
        key_mask: bool,
    },
    /// Rows of `table[V,D]` picked by `ids[T]` (u32).
    Embedding,
    /// Two tensors joined along an axis.
    Concat {
        /// The axis.
        axis: usize,
    },
    /// `len` entries from `start` along an axis.
    Slice {
        /// The axis.
        axis: usize,
        /// First index.
        start: usize,
        /// Number of entries.
        len: usize,
    },
    /// Axes reordered (rank at most 4): output axis i is input axis `perm[i]`.
    Permute {
        /// The permutation.
        perm: Vec<usize>,
    },
    /// Same data, another shape.
    Reshape {
        /// The new shape.
        shape: Vec<usize>,
    },
    /// adaLN modulation: `x * (1 + scale) + shift`, scale and shift over the last dim.
    AdaLnModulate,
    /// KV-cache append, in place: `cache[H, C, D]` with rows `pos .. pos + T` of every head
    /// replaced by `x[H, T, D]`; `pos` is a runtime `u32[1]`. The output is the cache itself
    /// (input 0): kernels write only the new rows.
    CacheWrite,
    /// 2-D convolution of one image `x[C, H, W]` with `w[O, C, k, k]` (+ `b[O]`), stride 1,
    /// zero padding `pad` on each side: `[O, H + 2 pad - k + 1, W + 2 pad - k + 1]`.
    Conv2d {
        /// Kernel size k (square).
        kernel: usize,
        /// Zero padding per side.
        pad: usize,
        /// Whether a bias input follows.
        bias: bool,
    },
    /// Group normalization of `x[C, ...]` over `groups` groups of channels (each group's
    /// channels and positions together), then `* w[C] + b[C]`.
    GroupNorm {
        /// Number of groups (divides C).
        groups: usize,
        /// Epsilon.
        eps: f32,
    },
    /// Nearest-neighbour 2x upsampling of `x[C, H, W]` to `[C, 2H, 2W]`.
    Upsample2x,
    /// Sinusoidal timestep embedding of `t[B]` to `[B, dim]` (diffusers' `get_timestep_embedding`).
    TimestepEmbedding {
        /// Output width (even).
        dim: usize,
        /// `cos` half first.
        flip_sin_to_cos: bool,
        /// Shift of the frequency denominator.
        downscale_freq_shift: f32,
        /// Multiplies the arguments.
        scale: f32,
        /// Longest period.
        max_period: f32,
    },
}

impl OpKind {
    /// Short name (the shader / kernel file name).
    pub fn name(&self) -> &'static str {
        match self {
            OpKind::Dequant4 => "dequant4",
            OpKind::LinearQ4 { .. } => "linear_q4",
            OpKind::Linear { .. } => "linear",
            OpKind::MatMul { .. } => "matmul",
            OpKind::Add => "add",
            OpKind::Mul => "mul",
            OpKind::Scale { .. } => "scale",
            OpKind::RmsNorm { .. } => "rms_norm",
            OpKind::LayerNorm { .. } => "layer_norm",
            OpKind::Silu => "silu",
            OpKind::Gelu => "gelu",
            OpKind::GeluTanh => "gelu_tanh",
            OpKind::QuickGelu => "quick_gelu",
            OpKind::Softmax => "softmax",
            OpKind::Rope { .. } => "rope",
            OpKind::Attention { .. } => "attention",
            OpKind::Embedding => "embedding",
            OpKind::Concat { .. } => "concat",
            OpKind::Slice { .. } => "slice",
            OpKind::Permute { .. } => "permute",
            OpKind::Reshape { .. } => "reshape",
            OpKind::AdaLnModulate => "adaln_modulate",
            OpKind::CacheWrite => "cache_write",
            OpKind::TimestepEmbedding { .. } => "timestep_embedding",
            OpKind::Conv2d { .. } => "conv2d",
            OpKind::GroupNorm { .. } => "group_norm",
            OpKind::Upsample2x => "upsample2x",
        }
    }

    /// The input whose storage the output shares (in-place ops), if any.
    pub fn in_place_input(&self) -> Option<usize> {
        match self {
            OpKind::CacheWrite => Some(0),
            _ => None,
        }
    }
}

fn err<T>(op: &OpKind, msg: String) -> Result<T> {
    Err(Error::Invalid(format!("{}: {msg}", op.name())))
}

fn want_f32(op: &OpKind, what: &str, v: &ValueInfo) -> Result<()> {
    if v.elem != ElemType::F32 {
        return err(op, format!("{what} must be f32, is {:?}", v.elem));
    }
    Ok(())
}

/// Whether input `i` of `op` may be a [`ElemType::BF16`] dense weight: the weight of `Linear`,
/// the table of `Embedding`.
pub fn bf16_input_allowed(op: &OpKind, i: usize) -> bool {
    matches!(op, OpKind::Linear { .. } | OpKind::Embedding) && i == 1
}

/// Checks an op's inputs and returns its output. `q4` is the 4-bit weight for `Dequant4` /
/// `LinearQ4`.
pub fn infer(op: &OpKind, inputs: &[&ValueInfo], q4: Option<&Q4Info>) -> Result<ValueInfo> {
    let n_expected = match op {
        OpKind::Dequant4 => 0,
        OpKind::LinearQ4 { bias } => 1 + *bias as usize,
        OpKind::Linear { bias } => 2 + *bias as usize,
        OpKind::MatMul { .. }
        | OpKind::Add
        | OpKind::Mul
        | OpKind::Concat { .. }
        | OpKind::Embedding => 2,
        OpKind::RmsNorm { .. } => 2,
        OpKind::LayerNorm { affine, .. } => 1 + 2 * *affine as usize,
        OpKind::Rope { .. } | OpKind::AdaLnModulate | OpKind::CacheWrite => 3,
        OpKind::Attention { key_mask, .. } => 3 + *key_mask as usize,
        OpKind::Conv2d { bias, .. } => 2 + *bias as usize,
        OpKind::GroupNorm { .. } => 3,
        _ => 1,
    };
    if inputs.len() != n_expected {
        return err(
            op,
            format!("takes {n_expected} inputs, got {}", inputs.len()),
        );
    }
    let needs_q4 = matches!(op, OpKind::Dequant4 | OpKind::LinearQ4 { .. });
    if needs_q4 != q4.is_some() {
        return err(
            op,
            if needs_q4 {
                "needs a 4-bit weight".into()
            } else {
                "takes no 4-bit weight".into()
            },
        );
    }
    for (i, v) in inputs.iter().enumerate() {
        let ids = (matches!(op, OpKind::Embedding) && i == 0)
            || (matches!(op, OpKind::CacheWrite) && i == 2);
        if bf16_input_allowed(op, i) && v.elem == ElemType::BF16 {
            continue;
        }
        if !ids {
            want_f32(op, &format!("input {i}"), v)?;
        }
    }
    let s = |i: usize| inputs[i].shape.as_slice();
    let out = match op {
        OpKind::Dequant4 => q4.map(|q| q.shape.clone()).unwrap_or_default(),
        OpKind::LinearQ4 { bias } | OpKind::Linear { bias } => {
            let x = s(0);
            let (n, k) = match (op, q4) {
                (OpKind::LinearQ4 { .. }, Some(q)) if q.shape.len() == 2 => {
                    (q.shape[0], q.shape[1])
                }
                (OpKind::Linear { .. }, _) if s(1).len() == 2 => (s(1)[0], s(1)[1]),
                _ => return err(op, "the weight must be 2-D [out, in]".into()),
            };
            if x.len() != 2 || x[1] != k {
                return err(
                    op,
                    format!("x is {x:?}, expected [rows, {k}] for a weight [{n}, {k}]"),
                );
            }
            if *bias {
                let b = s(inputs.len() - 1);
                if b != [n] {
                    return err(op, format!("bias is {b:?}, expected [{n}]"));
                }
            }
            vec![x[0], n]
        }
        OpKind::MatMul { transpose_b } => {
            let (a, b) = (s(0), s(1));
            if a.len() != 3 || b.len() != 3 || a[0] != b[0] {
                return err(
                    op,
                    format!("expects a[B,M,K] and b[B,.,.], got {a:?} and {b:?}"),
                );
            }
            let (bk, bn) = if *transpose_b {
                (b[2], b[1])
            } else {
                (b[1], b[2])
            };
            if bk != a[2] {
                return err(
                    op,
                    format!("inner dims differ: a {a:?}, b {b:?} (transpose_b {transpose_b})"),
                );
            }
            vec![a[0], a[1], bn]
        }
        OpKind::Add | OpKind::Mul => {
            let (a, b) = (s(0), s(1));
            if a != b && !(b.len() == 1 && a.last() == b.first()) {
                return err(
                    op,
                    format!(
                        "b {b:?} must equal a {a:?} or be [{}]",
                        a.last().copied().unwrap_or(0)
                    ),
                );
            }
            a.to_vec()
        }
        OpKind::RmsNorm { .. } | OpKind::LayerNorm { .. } => {
            let x = s(0);
            let d = *x.last().unwrap_or(&0);
            for i in 1..inputs.len() {
                if s(i) != [d] {
                    return err(op, format!("input {i} is {:?}, expected [{d}]", s(i)));
                }
            }
            x.to_vec()
        }
        OpKind::Conv2d { kernel, pad, bias } => {
            let (x, w) = (s(0), s(1));
            let k = *kernel;
            if x.len() != 3 || w.len() != 4 || w[1] != x[0] || w[2] != k || w[3] != k || k == 0 {
                return err(
                    op,
                    format!("expects x[C,H,W] and w[O,C,{k},{k}], got {x:?} and {w:?}"),
                );
            }
            let (oh, ow) = (x[1] + 2 * pad, x[2] + 2 * pad);
            if oh < k || ow < k {
                return err(
                    op,
                    format!("a {k}x{k} kernel does not fit {x:?} padded by {pad}"),
                );
            }
            if *bias && s(2) != [w[0]] {
                return err(op, format!("bias is {:?}, expected [{}]", s(2), w[0]));
            }
            vec![w[0], oh - k + 1, ow - k + 1]
        }
        OpKind::GroupNorm { groups, .. } => {
            let x = s(0);
            let c = x.first().copied().unwrap_or(0);
            if x.len() < 2 || *groups == 0 || c % groups != 0 {
                return err(
                    op,
                    format!("x is {x:?}: expected [C, ...] with C a multiple of {groups} groups"),
                );
            }
            for i in 1..3 {
                if s(i) != [c] {
                    return err(op, format!("input {i} is {:?}, expected [{c}]", s(i)));
                }
            }
            x.to_vec()
        }
        OpKind::Upsample2x => {
            let x = s(0);
            if x.len() != 3 {
                return err(op, format!("x is {x:?}, expected [C, H, W]"));
            }
            vec![x[0], 2 * x[1], 2 * x[2]]
        }
        OpKind::AdaLnModulate => {
            let x = s(0);
            let d = *x.last().unwrap_or(&0);
            for (i, name) in [(1, "shift"), (2, "scale")] {
                if s(i) != [d] {
                    return err(op, format!("{name} is {:?}, expected [{d}]", s(i)));
                }
            }
            x.to_vec()
        }
        OpKind::Scale { .. }
        | OpKind::Silu
        | OpKind::Gelu
        | OpKind::GeluTanh
        | OpKind::QuickGelu
        | OpKind::Softmax => s(0).to_vec(),
        OpKind::Rope { .. } => {
            let x = s(0);
            if x.len() != 3 || x[2] % 2 != 0 {
                return err(op, format!("x is {x:?}, expected [T, H, D] with D even"));
            }
            let want = [x[0], x[2] / 2];
            if s(1) != want || s(2) != want {
                return err(
                    op,
                    format!("cos {:?} / sin {:?} must be {want:?}", s(1), s(2)),
                );
            }
            x.to_vec()
        }
        OpKind::Attention { key_mask, .. } => {
            let (q, k, v) = (s(0), s(1), s(2));
            if q.len() != 3 || k.len() != 3 || k != v || q[2] != k[2] {
                return err(
                    op,
                    format!("expects q[Hq,Tq,D], k = v [Hkv,Tk,D]; got {q:?}, {k:?}, {v:?}"),
                );
            }
            if k[0] == 0 || q[0] % k[0] != 0 {
                return err(
                    op,
                    format!(
                        "{} query heads do not group over {} key/value heads",
                        q[0], k[0]
                    ),
                );
            }
            if *key_mask && s(3) != [k[1]] {
                return err(op, format!("key mask is {:?}, expected [{}]", s(3), k[1]));
            }
            q.to_vec()
        }
        OpKind::Embedding => {
            let (ids, t) = (inputs[0], s(1));
            if ids.elem != ElemType::U32 || ids.shape.len() != 1 || t.len() != 2 {
                return err(
                    op,
                    format!(
                        "expects ids u32[T] and table[V,D], got {:?} {:?} and {t:?}",
                        ids.elem, ids.shape
                    ),
                );
            }
            vec![ids.shape[0], t[1]]
        }
        OpKind::Concat { axis } => {
            let (a, b) = (s(0), s(1));
            if a.len() != b.len()
                || *axis >= a.len()
                || a.iter()
                    .zip(b)
                    .enumerate()
                    .any(|(i, (x, y))| i != *axis && x != y)
            {
                return err(op, format!("cannot join {a:?} and {b:?} along axis {axis}"));
            }
            let mut o = a.to_vec();
            o[*axis] += b[*axis];
            o
        }
        OpKind::Slice { axis, start, len } => {
            let x = s(0);
            if *axis >= x.len() || start + len > x[*axis] {
                return err(
                    op,
                    format!(
                        "[{start}, {}) along axis {axis} is outside {x:?}",
                        start + len
                    ),
                );
            }
            let mut o = x.to_vec();
            o[*axis] = *len;
            o
        }
        OpKind::Permute { perm } => {
            let x = s(0);
            let mut seen = perm.clone();
            seen.sort_unstable();
            if perm.len() != x.len() || x.len() > 4 || seen != (0..x.len()).collect::<Vec<_>>() {
                return err(
                    op,
                    format!(
                        "{perm:?} is not a permutation of the {} axes of {x:?} (rank <= 4)",
                        x.len()
                    ),
                );
            }
            perm.iter().map(|&p| x[p]).collect()
        }
        OpKind::Reshape { shape } => {
            if shape.iter().product::<usize>() != inputs[0].numel() {
                return err(
                    op,
                    format!(
                        "{:?} has {} elements, {shape:?} has {}",
                        s(0),
                        inputs[0].numel(),
                        shape.iter().product::<usize>()
                    ),
                );
            }
            shape.clone()
        }
        OpKind::CacheWrite => {
            let (c, x, pos) = (s(0), s(1), inputs[2]);
            if c.len() != 3 || x.len() != 3 || c[0] != x[0] || c[2] != x[2] || x[1] > c[1] {
                return err(
                    op,
                    format!("expects cache[H,C,D] and x[H,T,D] with T <= C, got {c:?} and {x:?}"),
                );
            }
            if pos.elem != ElemType::U32 || pos.shape != [1] {
                return err(
                    op,
                    format!(
                        "the position must be u32[1], is {:?} {:?}",
                        pos.elem, pos.shape
                    ),
                );
            }
            c.to_vec()
        }
        OpKind::TimestepEmbedding { dim, .. } => {
            if s(0).len() != 1 || *dim == 0 || dim % 2 != 0 {
                return err(
                    op,
                    format!("expects t[B] and an even dim, got {:?} and {dim}", s(0)),
                );
            }
            vec![s(0)[0], *dim]
        }
    };
    Ok(ValueInfo::f32(&out))
}
