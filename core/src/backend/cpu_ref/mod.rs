//! `cpu_ref`: the reference backend. Scalar, readable, f64 accumulation in reductions; never
//! optimized. Every other backend is judged against it by the conformance suite.

mod linear;

pub use linear::{linear, linear_4bit};

mod backend;

pub use backend::CpuRefBackend;

use crate::error::{Error, Result};
use crate::format::bnb::QuantState;
use crate::graph::{infer, HostTensor, OpKind, Q4Info, RopeMode};

/// A 4-bit weight as the ops see it.
#[derive(Debug, Clone, Copy)]
pub struct Q4Ref<'a> {
    /// Its validated quant state.
    pub state: &'a QuantState,
    /// Its packed codes.
    pub packed: &'a [u8],
}

impl Q4Ref<'_> {
    /// Shape information for shape checks.
    pub fn info(&self) -> Q4Info {
        Q4Info {
            shape: self.state.json.shape.iter().map(|&d| d as usize).collect(),
            blocksize: self.state.json.blocksize as usize,
        }
    }
}

fn erf(x: f64) -> f64 {
    // Abramowitz-Stegun 7.1.26 is too coarse for an oracle; use the series / continued fraction
    // split, accurate to ~1e-15.
    if x.abs() < 2.5 {
        let mut sum = x;
        let mut term = x;
        let x2 = x * x;
        for n in 1..200 {
            let n = n as f64;
            term *= -x2 / n;
            let add = term / (2.0 * n + 1.0);
            sum += add;
            if add.abs() <= 1e-17 * sum.abs() {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc continued fraction (Lentz), for |x| >= 2.5.
        let ax = x.abs();
        let mut f = ax;
        let mut c = ax;
        let mut d = 0.0;
        for k in 1..200 {
            let a = k as f64 / 2.0;
            d = ax + a * d;
            d = 1.0 / d;
            c = ax + a / c;
            let delta = c * d;
            f *= delta;
            if (delta - 1.0).abs() < 1e-16 {
                break;
            }
        }
        let erfc = (-ax * ax).exp() / (f * std::f64::consts::PI.sqrt());
        (1.0 - erfc).copysign(x)
    }
}

/// Runs one op on the host.
pub fn run(op: &OpKind, inputs: &[&HostTensor], q4: Option<Q4Ref<'_>>) -> Result<HostTensor> {
    let infos: Vec<_> = inputs.iter().map(|t| &t.info).collect();
    let q4info = q4.map(|q| q.info());
    let out_info = infer(op, &infos, q4info.as_ref())?;
    let x = |i: usize| inputs[i].as_f32();
    let shape = |i: usize| inputs[i].info.shape.as_slice();
    let last = |i: usize| *shape(i).last().unwrap_or(&1);
    let out: Vec<f32> = match op {
        OpKind::Dequant4 => {
            let q = q4.ok_or_else(|| Error::Invalid("dequant4 needs a weight".into()))?;
            let mut w = vec![0f32; q.state.numel()];
            q.state.dequantize_ref(q.packed, &mut w)?;
            w
        }
        OpKind::LinearQ4 { bias } => {
            let q = q4.ok_or_else(|| Error::Invalid("linear_q4 needs a weight".into()))?;
            let b = bias.then(|| x(1));
            linear_4bit(x(0), shape(0)[0], q.state, q.packed, b)?
        }
        OpKind::Linear { bias } => {
            let (n, k) = (shape(1)[0], shape(1)[1]);
            let b = bias.then(|| x(2));
            linear(x(0), shape(0)[0], x(1), n, k, b)?
        }
        OpKind::MatMul { transpose_b } => {
            let (bsz, m, k) = (shape(0)[0], shape(0)[1], shape(0)[2]);
            let n = out_info.shape[2];
            let (a, b) = (x(0), x(1));
            let mut o = vec![0f32; bsz * m * n];
            for bi in 0..bsz {
                for i in 0..m {
                    for j in 0..n {
                        let mut acc = 0f64;
                        for kk in 0..k {
                            let bv = if *transpose_b {
                                b[(bi * n + j) * k + kk]
                            } else {
                                b[(bi * k + kk) * n + j]
                            };
                            acc += a[(bi * m + i) * k + kk] as f64 * bv as f64;
                        }
                        o[(bi * m + i) * n + j] = acc as f32;
                    }
                }
            }
            o
        }
        OpKind::Add | OpKind::Mul => {
            let (a, b) = (x(0), x(1));
            let d = b.len();
            a.iter()
                .enumerate()
                .map(|(i, &v)| {
                    let w = b[i % d];
                    if matches!(op, OpKind::Add) {
                        v + w
                    } else {
                        v * w
                    }
                })
                .collect()
        }
        OpKind::Scale { factor } => x(0).iter().map(|v| v * factor).collect(),
        OpKind::RmsNorm { eps } => {
            let (v, w, d) = (x(0), x(1), last(0));
            let mut o = vec![0f32; v.len()];
            for (row, orow) in v.chunks(d).zip(o.chunks_mut(d)) {
                let ms: f64 = row.iter().map(|&a| a as f64 * a as f64).sum::<f64>() / d as f64;
                let r = 1.0 / (ms + *eps as f64).sqrt();
                for i in 0..d {
                    orow[i] = (row[i] as f64 * r) as f32 * w[i];
                }
            }
            o
        }
        OpKind::LayerNorm { eps, affine } => {
            let (v, d) = (x(0), last(0));
            let mut o = vec![0f32; v.len()];
            for (row, orow) in v.chunks(d).zip(o.chunks_mut(d)) {
                let mean = row.iter().map(|&a| a as f64).sum::<f64>() / d as f64;
                let var = row.iter().map(|&a| (a as f64 - mean).powi(2)).sum::<f64>() / d as f64;
                let r = 1.0 / (var + *eps as f64).sqrt();
                for i in 0..d {
                    let n = ((row[i] as f64 - mean) * r) as f32;
                    orow[i] = if *affine { n * x(1)[i] + x(2)[i] } else { n };
                }
            }
            o
        }
        OpKind::Silu => x(0)
            .iter()
            .map(|&v| (v as f64 / (1.0 + (-(v as f64)).exp())) as f32)
            .collect(),
        OpKind::Conv2d { kernel, pad, bias } => {
            let (xs, ws) = (shape(0), shape(1));
            let (c, h, w) = (xs[0], xs[1], xs[2]);
            let (o, k, p) = (ws[0], *kernel, *pad as isize);
            let (oh, ow) = (out_info.shape[1], out_info.shape[2]);
            let (xv, wv) = (x(0), x(1));
            let mut out = vec![0f32; o * oh * ow];
            for oc in 0..o {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut acc = if *bias { x(2)[oc] as f64 } else { 0.0 };
                        for ic in 0..c {
                            for ky in 0..k {
                                let iy = oy as isize + ky as isize - p;
                                if iy < 0 || iy >= h as isize {
                                    continue;
                                }
                                for kx in 0..k {
                                    let ix = ox as isize + kx as isize - p;
                                    if ix < 0 || ix >= w as isize {
                                        continue;
                                    }
                                    acc += xv[(ic * h + iy as usize) * w + ix as usize] as f64
                                        * wv[((oc * c + ic) * k + ky) * k + kx] as f64;
                                }
                            }
                        }
                        out[(oc * oh + oy) * ow + ox] = acc as f32;
                    }
                }
            }
            out
        }
        OpKind::GroupNorm { groups, eps } => {
            let v = x(0);
            let c = shape(0)[0];
            let per = v.len() / c;
            let n = c / groups * per;
            let mut out = vec![0f32; v.len()];
            for gi in 0..*groups {
                let part = &v[gi * n..(gi + 1) * n];
                let mean = part.iter().map(|&a| a as f64).sum::<f64>() / n as f64;
                let var = part.iter().map(|&a| (a as f64 - mean).powi(2)).sum::<f64>() / n as f64;
                let r = 1.0 / (var + *eps as f64).sqrt();
                for (i, &a) in part.iter().enumerate() {
                    let ch = gi * (c / groups) + i / per;
                    out[gi * n + i] = ((a as f64 - mean) * r) as f32 * x(1)[ch] + x(2)[ch];
                }
            }
            out
        }
        OpKind::Upsample2x => {
            let (c, h, w) = (shape(0)[0], shape(0)[1], shape(0)[2]);
            let v = x(0);
            let mut out = vec![0f32; c * 4 * h * w];
            for ch in 0..c {
                for y in 0..2 * h {
                    for xx in 0..2 * w {
                        out[(ch * 2 * h + y) * 2 * w + xx] = v[(ch * h + y / 2) * w + xx / 2];
                    }
                }
            }
            out
        }
        OpKind::QuickGelu => x(0)
            .iter()
            .map(|&v| (v as f64 / (1.0 + (-1.702 * v as f64).exp())) as f32)
            .collect(),
        OpKind::Gelu => x(0)
            .iter()
            .map(|&v| (0.5 * v as f64 * (1.0 + erf(v as f64 / std::f64::consts::SQRT_2))) as f32)
            .collect(),
        OpKind::GeluTanh => x(0)
            .iter()
            .map(|&v| {
                let v = v as f64;
                let c = (2.0 / std::f64::consts::PI).sqrt();
                (0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh())) as f32
            })
            .collect(),
        OpKind::Softmax => {
            let (v, d) = (x(0), last(0));
            let mut o = vec![0f32; v.len()];
            for (row, orow) in v.chunks(d).zip(o.chunks_mut(d)) {
                let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
                let sum: f64 = row.iter().map(|&a| (a as f64 - m).exp()).sum();
                for i in 0..d {
                    orow[i] = ((row[i] as f64 - m).exp() / sum) as f32;
                }
            }
            o
        }
        OpKind::Rope { mode } => {
            let (v, cos, sin) = (x(0), x(1), x(2));
            let (t, h, d) = (shape(0)[0], shape(0)[1], shape(0)[2]);
            let half = d / 2;
            let mut o = vec![0f32; v.len()];
            for ti in 0..t {
                for hi in 0..h {
                    let base = (ti * h + hi) * d;
                    for i in 0..half {
                        let (c, s) = (cos[ti * half + i] as f64, sin[ti * half + i] as f64);
                        let (a, b) = match mode {
                            RopeMode::RotateHalf => (base + i, base + i + half),
                            RopeMode::Interleaved => (base + 2 * i, base + 2 * i + 1),
                        };
                        let (x1, x2) = (v[a] as f64, v[b] as f64);
                        o[a] = (x1 * c - x2 * s) as f32;
                        o[b] = (x2 * c + x1 * s) as f32;
                    }
                }
            }
            o
        }
        OpKind::Attention {
            causal,
            scale,
            key_mask,
        } => {
            let (q, k, v) = (x(0), x(1), x(2));
            let (hq, tq, d) = (shape(0)[0], shape(0)[1], shape(0)[2]);
            let (hkv, tk) = (shape(1)[0], shape(1)[1]);
            let group = hq / hkv;
            let mask = key_mask.then(|| x(3));
            let mut o = vec![0f32; q.len()];
            for h in 0..hq {
                let kh = h / group;
                for i in 0..tq {
                    let qrow = &q[(h * tq + i) * d..][..d];
                    let limit = if *causal { i + tk - tq } else { tk - 1 };
                    let mut scores = vec![f64::NEG_INFINITY; tk];
                    for (j, s) in scores.iter_mut().enumerate().take(limit + 1) {
                        if mask.is_some_and(|m| m[j] == 0.0) {
                            continue;
                        }
                        let krow = &k[(kh * tk + j) * d..][..d];
                        let dot: f64 = qrow
                            .iter()
                            .zip(krow)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum();
                        *s = dot * *scale as f64;
                    }
                    let m = scores.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                    let orow = &mut o[(h * tq + i) * d..][..d];
                    // Scores are f64 here; a product that would overflow f32 is garbage as it
                    // is on every backend, and NaN must not read as "every key masked".
                    // (-inf is a masked key.)
                    let garbage = |s: f64| {
                        s.is_nan() || s > f32::MAX as f64 || s < f32::MIN as f64 && s.is_finite()
                    };
                    if scores.iter().any(|&s| garbage(s)) {
                        orow.iter_mut().for_each(|x| *x = f32::NAN);
                        continue;
                    }
                    if m == f64::NEG_INFINITY {
                        continue; // every key masked: output zeros
                    }
                    let w: Vec<f64> = scores.iter().map(|&s| (s - m).exp()).collect();
                    let sum: f64 = w.iter().sum();
                    for (c, oc) in orow.iter_mut().enumerate() {
                        let mut acc = 0f64;
                        for j in 0..tk {
                            if w[j] != 0.0 {
                                acc += w[j] * v[(kh * tk + j) * d + c] as f64;
                            }
                        }
                        *oc = (acc / sum) as f32;
                    }
                }
            }
            o
        }
        OpKind::Embedding => {
            let (ids, table) = (inputs[0].as_u32(), x(1));
            let (vocab, d) = (shape(1)[0], shape(1)[1]);
            let mut o = Vec::with_capacity(ids.len() * d);
            for &id in ids {
                if id as usize >= vocab {
                    return Err(Error::Invalid(format!(
                        "embedding: token id {id} is outside the vocabulary of {vocab}"
                    )));
                }
                o.extend_from_slice(&table[id as usize * d..][..d]);
            }
            o
        }
        OpKind::Concat { axis } => {
            let (a, b) = (x(0), x(1));
            let outer: usize = shape(0)[..*axis].iter().product();
            let ia: usize = shape(0)[*axis..].iter().product();
            let ib: usize = shape(1)[*axis..].iter().product();
            let mut o = Vec::with_capacity(a.len() + b.len());
            for r in 0..outer {
                o.extend_from_slice(&a[r * ia..][..ia]);
                o.extend_from_slice(&b[r * ib..][..ib]);
            }
            o
        }
        OpKind::Slice { axis, start, len } => {
            let v = x(0);
            let outer: usize = shape(0)[..*axis].iter().product();
            let inner: usize = shape(0)[*axis + 1..].iter().product();
            let n = shape(0)[*axis];
            let mut o = Vec::with_capacity(outer * len * inner);
            for r in 0..outer {
                o.extend_from_slice(&v[(r * n + start) * inner..][..len * inner]);
            }
            o
        }
        OpKind::Permute { perm } => {
            let v = x(0);
            let ins = shape(0);
            let rank = ins.len();
            let mut in_strides = vec![1usize; rank];
            for i in (0..rank.saturating_sub(1)).rev() {
                in_strides[i] = in_strides[i + 1] * ins[i + 1];
            }
            let outs = &out_info.shape;
            let mut o = vec![0f32; v.len()];
            for (flat, slot) in o.iter_mut().enumerate() {
                let mut rem = flat;
                let mut src = 0;
                for ax in (0..rank).rev() {
                    let idx = rem % outs[ax];
                    rem /= outs[ax];
                    src += idx * in_strides[perm[ax]];
                }
                *slot = v[src];
            }
            o
        }
        OpKind::Reshape { .. } => x(0).to_vec(),
        OpKind::AdaLnModulate => {
            let (v, shift, sc, d) = (x(0), x(1), x(2), last(0));
            v.iter()
                .enumerate()
                .map(|(i, &a)| a * (1.0 + sc[i % d]) + shift[i % d])
                .collect()
        }
        OpKind::CacheWrite => {
            let (cache, new) = (x(0), x(1));
            let (h, c, d) = (shape(0)[0], shape(0)[1], shape(0)[2]);
            let t = shape(1)[1];
            let pos = inputs[2].as_u32()[0] as usize;
            if pos + t > c {
                return Err(Error::Invalid(format!(
                    "cache_write: rows {pos}..{} do not fit a cache of {c}",
                    pos + t
                )));
            }
            let mut o = cache.to_vec();
            for hi in 0..h {
                for ti in 0..t {
                    o[(hi * c + pos + ti) * d..][..d]
                        .copy_from_slice(&new[(hi * t + ti) * d..][..d]);
                }
            }
            o
        }
        OpKind::TimestepEmbedding {
            dim,
            flip_sin_to_cos,
            downscale_freq_shift,
            scale,
            max_period,
        } => {
            let half = dim / 2;
            let mut o = Vec::with_capacity(x(0).len() * dim);
            for &t in x(0) {
                let args: Vec<f64> = (0..half)
                    .map(|i| {
                        let e = -(*max_period as f64).ln() * i as f64
                            / (half as f64 - *downscale_freq_shift as f64);
                        *scale as f64 * t as f64 * e.exp()
                    })
                    .collect();
                let (sin, cos): (Vec<f32>, Vec<f32>) = args
                    .iter()
                    .map(|a| (a.sin() as f32, a.cos() as f32))
                    .unzip();
                if *flip_sin_to_cos {
                    o.extend(cos.iter().chain(&sin));
                } else {
                    o.extend(sin.iter().chain(&cos));
                }
            }
            o
        }
    };
    HostTensor::f32(&out_info.shape, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.5204998778130465),
            (1.0, 0.8427007929497149),
            (2.0, 0.9953222650189527),
            (3.0, 0.9999779095030014),
            (-1.5, -0.9661051464753108),
        ] {
            assert!(
                (erf(x) - want).abs() < 1e-14,
                "erf({x}) = {} want {want}",
                erf(x)
            );
        }
    }
}
