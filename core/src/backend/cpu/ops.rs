//! The optimized CPU backend's ops: one dispatch over [`OpKind`], and the heavier kernels it
//! calls (GELU's erf, permutes, attention, the 4-bit linear); the dense linear is
//! [`super::dense`]'s, shared with the image ops.

use super::dense::dense_linear;
use super::*;

/// Runs `f(row index, output row)` for every row of `d` values of `out` (the last one shorter
/// where `d` does not divide its length), the rows split across `pool`'s threads when there are
/// enough values to pay for it (each row's arithmetic is the same either way).
fn by_rows(pool: &ThreadPool, out: &mut [f32], d: usize, f: &(dyn Fn(usize, &mut [f32]) + Sync)) {
    let (len, d) = (out.len(), d.max(1));
    let rows = len.div_ceil(d);
    let tasks = if len < 1 << 15 { 1 } else { pool.threads() };
    let o = Out(out.as_mut_ptr());
    pool.run(tasks, &|t| {
        let (r0, r1) = split(rows, tasks, t, 1);
        for r in r0..r1 {
            // SAFETY: row r lies inside `out` and belongs to this task only.
            f(r, unsafe { o.range(r * d, d.min(len - r * d)) });
        }
    });
}

/// `out[i] = f(x[i])`, in pieces across `pool`'s threads when there are enough values (each
/// value's arithmetic is the same either way).
fn elementwise(pool: &ThreadPool, x: &[f32], out: &mut [f32], f: &(dyn Fn(f32) -> f32 + Sync)) {
    in_pieces(pool, x, out, &|x, o| {
        for (v, &x) in o.iter_mut().zip(x) {
            *v = f(x);
        }
    });
}

/// `f(x piece, out piece)` over pieces of 4096 values across `pool`'s threads (see
/// [`elementwise`]), for kernels that take a slice at a time.
fn in_pieces(
    pool: &ThreadPool,
    x: &[f32],
    out: &mut [f32],
    f: &(dyn Fn(&[f32], &mut [f32]) + Sync),
) {
    const PIECE: usize = 4096;
    let n = out.len().min(x.len());
    by_rows(pool, &mut out[..n], PIECE, &|i, o| {
        f(&x[i * PIECE..i * PIECE + o.len()], o)
    });
}

/// `sum(g(v))` over `row` in f64, in 8 lanes (value i into lane i % 8) added in a fixed tree at
/// the end: one order on every CPU, whether or not the compiler vectorizes it, and 8 chains
/// instead of one long dependent one.
fn lane_sum(row: &[f32], g: impl Fn(f64) -> f64) -> f64 {
    let mut lanes = [0f64; 8];
    let chunks = row.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += g(v as f64);
        }
    }
    for (l, &v) in lanes.iter_mut().zip(rest) {
        *l += g(v as f64);
    }
    ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
}

impl CpuBackend {
    /// Runs one op (see [`Backend::run`]).
    pub(super) fn run_op(
        &mut self,
        op: &OpKind,
        inputs: &[Operand],
        q4: Option<&Q4View>,
        out: &Operand,
    ) -> Result<()> {
        for o in inputs.iter().chain(std::iter::once(out)) {
            self.check(o.slice)?;
        }
        let in_place = op.in_place_input();
        for (i, o) in inputs.iter().enumerate() {
            let (a, b) = (o.slice, out.slice);
            let disjoint = a.offset + a.len <= b.offset || b.offset + b.len <= a.offset;
            if !disjoint && in_place != Some(i) && a.len > 0 && b.len > 0 {
                return Err(Error::Invalid(format!(
                    "cpu {}: input {i} overlaps the output",
                    op.name()
                )));
            }
        }
        let base = self.arena.as_mut_ptr();
        // SAFETY: every slice is in bounds (checked above); the output overlaps no input it
        // reads (an in-place op's shared input is never read through `ins`).
        let io = unsafe {
            Io {
                ins: inputs
                    .iter()
                    .map(|o| {
                        if in_place.is_some() {
                            &[][..]
                        } else {
                            std::slice::from_raw_parts(
                                base.add(o.slice.offset) as *const f32,
                                o.slice.len,
                            )
                        }
                    })
                    .collect(),
                out: std::slice::from_raw_parts_mut(base.add(out.slice.offset), out.slice.len),
            }
        };
        let mut io = io;
        if in_place.is_some() {
            // Only the inputs after the shared one are read.
            for (i, o) in inputs.iter().enumerate().skip(1) {
                // SAFETY: in bounds and disjoint from the output (checked above).
                io.ins[i] = unsafe {
                    std::slice::from_raw_parts(base.add(o.slice.offset) as *const f32, o.slice.len)
                };
            }
        }
        let shape = |i: usize| inputs[i].info.shape.as_slice();
        let last = |i: usize| *shape(i).last().unwrap_or(&1);
        let pool = self.threads;
        match op {
            OpKind::Dequant4 => {
                let v = q4.ok_or_else(|| Error::Invalid("dequant4 needs a weight".into()))?;
                let st = self.q4_state(v)?;
                let packed = self.region(v.packed)?;
                st.dequantize(packed, io.out)?;
            }
            OpKind::LinearQ4 { bias } => {
                let v = q4.ok_or_else(|| Error::Invalid("linear_q4 needs a weight".into()))?;
                let b = bias.then(|| io.ins[1]);
                let mut xp = std::mem::take(&mut self.scratch);
                let r = self.linear_q4(io.ins[0], shape(0)[0], v, b, io.out, &mut xp);
                self.scratch = xp;
                r?;
            }
            OpKind::Linear { bias } => {
                let (m, k) = (shape(0)[0], shape(0)[1]);
                let n = shape(1)[0];
                let b = bias.then(|| io.ins[2]);
                dense_linear(
                    pool,
                    io.ins[0],
                    m,
                    rows(&inputs[1], io.ins[1]),
                    n,
                    k,
                    b,
                    io.out,
                );
            }
            OpKind::MatMul { transpose_b } => {
                let (bsz, m, k) = (shape(0)[0], shape(0)[1], shape(0)[2]);
                let n = out.info.shape[2];
                let (a, bm) = (io.ins[0], io.ins[1]);
                let mut bt = std::mem::take(&mut self.scratch);
                for bi in 0..bsz {
                    let a = &a[bi * m * k..(bi + 1) * m * k];
                    let w: &[f32] = if *transpose_b {
                        &bm[bi * n * k..(bi + 1) * n * k]
                    } else {
                        bt.resize(n * k, 0.0);
                        let src = &bm[bi * k * n..(bi + 1) * k * n];
                        for kk in 0..k {
                            for j in 0..n {
                                bt[j * k + kk] = src[kk * n + j];
                            }
                        }
                        &bt
                    };
                    dense_linear(
                        pool,
                        a,
                        m,
                        Rows::F32(w),
                        n,
                        k,
                        None,
                        &mut io.out[bi * m * n..(bi + 1) * m * n],
                    );
                }
            }
            OpKind::Add | OpKind::Mul => {
                // `b` repeats along `a` (a bias row, or `a`'s whole shape): pieces of one row of
                // it, or of 4096 values where a row is longer (a residual add is one row).
                let (a, b) = (io.ins[0], io.ins[1]);
                let d = b.len().max(1);
                let piece = d.min(4096);
                let add = matches!(op, OpKind::Add);
                by_rows(pool, io.out, piece, &|i, oc| {
                    let at = i * piece;
                    let mut j = at % d;
                    for (o, &x) in oc.iter_mut().zip(&a[at..]) {
                        let y = b[j];
                        *o = if add { x + y } else { x * y };
                        j = if j + 1 == d { 0 } else { j + 1 };
                    }
                });
            }
            OpKind::Scale { factor } => {
                for (o, &x) in io.out.iter_mut().zip(io.ins[0]) {
                    *o = x * factor;
                }
            }
            OpKind::RmsNorm { eps } => {
                let (x, w, d) = (io.ins[0], io.ins[1], last(0));
                by_rows(pool, io.out, d, &|i, orow| {
                    let row = &x[i * d..(i + 1) * d];
                    let ms = (dot(row, row) as f64 / d as f64) as f32;
                    let r = 1.0 / (ms + eps).sqrt();
                    for i in 0..d {
                        orow[i] = row[i] * r * w[i];
                    }
                });
            }
            OpKind::LayerNorm { eps, affine } => {
                let (x, d) = (io.ins[0], last(0));
                let (w, b) = if *affine {
                    (io.ins[1], io.ins[2])
                } else {
                    (&[][..], &[][..])
                };
                by_rows(pool, io.out, d, &|i, orow| {
                    let row = &x[i * d..(i + 1) * d];
                    let mean = lane_sum(row, |v| v) / d as f64;
                    let var = lane_sum(row, |v| (v - mean) * (v - mean)) / d as f64;
                    let r = (1.0 / (var + *eps as f64).sqrt()) as f32;
                    let mean = mean as f32;
                    for i in 0..d {
                        let n = (row[i] - mean) * r;
                        orow[i] = if *affine { n * w[i] + b[i] } else { n };
                    }
                });
            }
            OpKind::Silu => in_pieces(pool, io.ins[0], io.out, &|x, o| {
                kernels::sigmoid_gate(x, 1.0, o)
            }),
            OpKind::QuickGelu => in_pieces(pool, io.ins[0], io.out, &|x, o| {
                kernels::sigmoid_gate(x, 1.702, o)
            }),
            OpKind::Gelu => elementwise(pool, io.ins[0], io.out, &|x| {
                let v = x as f64;
                (0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2))) as f32
            }),
            OpKind::GeluTanh => {
                let c = (2.0f32 / std::f32::consts::PI).sqrt();
                elementwise(pool, io.ins[0], io.out, &|x| {
                    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
                })
            }
            OpKind::Softmax => {
                let d = last(0);
                for (row, orow) in io.ins[0].chunks(d).zip(io.out.chunks_mut(d)) {
                    let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                    let mut sum = 0f64;
                    for (o, &x) in orow.iter_mut().zip(row) {
                        *o = (x - m).exp();
                        sum += *o as f64;
                    }
                    let inv = (1.0 / sum) as f32;
                    orow.iter_mut().for_each(|o| *o *= inv);
                }
            }
            OpKind::Rope { mode } => {
                let (x, cos, sin) = (io.ins[0], io.ins[1], io.ins[2]);
                let (t, h, d) = (shape(0)[0], shape(0)[1], shape(0)[2]);
                let half = d / 2;
                for ti in 0..t {
                    let (c, s) = (&cos[ti * half..][..half], &sin[ti * half..][..half]);
                    for hi in 0..h {
                        let base = (ti * h + hi) * d;
                        for i in 0..half {
                            let (a, b) = match mode {
                                RopeMode::RotateHalf => (base + i, base + i + half),
                                RopeMode::Interleaved => (base + 2 * i, base + 2 * i + 1),
                            };
                            let (x1, x2) = (x[a], x[b]);
                            io.out[a] = x1 * c[i] - x2 * s[i];
                            io.out[b] = x2 * c[i] + x1 * s[i];
                        }
                    }
                }
            }
            OpKind::Attention {
                causal,
                scale,
                key_mask,
            } => {
                let mask = key_mask.then(|| io.ins[3]);
                super::attention::attention(
                    super::gemm::isa(),
                    pool,
                    io.ins[0],
                    io.ins[1],
                    io.ins[2],
                    mask,
                    shape(0),
                    shape(1),
                    *causal,
                    *scale,
                    io.out,
                );
            }
            OpKind::Embedding => {
                let (vocab, d) = (shape(1)[0], shape(1)[1]);
                let table = rows(&inputs[1], io.ins[1]);
                for (i, &idw) in io.ins[0].iter().enumerate() {
                    let id = idw.to_bits() as usize;
                    if id >= vocab {
                        return Err(Error::Invalid(format!(
                            "embedding: token id {id} is outside the vocabulary of {vocab}"
                        )));
                    }
                    table.widen_into(id * d, &mut io.out[i * d..(i + 1) * d]);
                }
            }
            OpKind::Concat { axis } => {
                let outer: usize = shape(0)[..*axis].iter().product();
                let ia: usize = shape(0)[*axis..].iter().product();
                let ib: usize = shape(1)[*axis..].iter().product();
                for r in 0..outer {
                    let o = &mut io.out[r * (ia + ib)..(r + 1) * (ia + ib)];
                    o[..ia].copy_from_slice(&io.ins[0][r * ia..(r + 1) * ia]);
                    o[ia..].copy_from_slice(&io.ins[1][r * ib..(r + 1) * ib]);
                }
            }
            OpKind::Slice { axis, start, len } => {
                let outer: usize = shape(0)[..*axis].iter().product();
                let inner: usize = shape(0)[*axis + 1..].iter().product();
                let n = shape(0)[*axis];
                for r in 0..outer {
                    io.out[r * len * inner..(r + 1) * len * inner]
                        .copy_from_slice(&io.ins[0][(r * n + start) * inner..][..len * inner]);
                }
            }
            OpKind::Permute { perm } => permute(io.ins[0], shape(0), perm, io.out),
            OpKind::Reshape { .. } => io.out.copy_from_slice(io.ins[0]),
            OpKind::AdaLnModulate => {
                let (shift, sc, d) = (io.ins[1], io.ins[2], last(0));
                for (oc, xc) in io.out.chunks_mut(d).zip(io.ins[0].chunks(d)) {
                    for i in 0..d {
                        oc[i] = xc[i] * (1.0 + sc[i]) + shift[i];
                    }
                }
            }
            OpKind::CacheWrite => {
                let (c, d) = (shape(0)[1], shape(0)[2]);
                let (h, t) = (shape(1)[0], shape(1)[1]);
                if inputs[2].info.elem != ElemType::U32 {
                    return Err(Error::Invalid("cache_write: position is not u32".into()));
                }
                let pos = io.ins[2][0].to_bits() as usize;
                if pos + t > c {
                    return Err(Error::Invalid(format!(
                        "cache_write: rows {pos}..{} do not fit a cache of {c}",
                        pos + t
                    )));
                }
                for hi in 0..h {
                    io.out[(hi * c + pos) * d..(hi * c + pos + t) * d]
                        .copy_from_slice(&io.ins[1][hi * t * d..(hi + 1) * t * d]);
                }
            }
            OpKind::Conv2d { kernel, pad, bias } => {
                let x = shape(0);
                let mut cols = std::mem::take(&mut self.scratch);
                super::image::conv2d(
                    pool,
                    io.ins[0],
                    (x[0], x[1], x[2]),
                    io.ins[1],
                    shape(1)[0],
                    (*kernel, *pad),
                    bias.then(|| io.ins[2]),
                    io.out,
                    &mut cols,
                );
                self.scratch = cols;
            }
            OpKind::GroupNorm { groups, eps } => super::image::group_norm(
                pool,
                io.ins[0],
                shape(0)[0],
                *groups,
                *eps,
                io.ins[1],
                io.ins[2],
                io.out,
            ),
            OpKind::Upsample2x => {
                let x = shape(0);
                super::image::upsample2x(io.ins[0], (x[0], x[1], x[2]), io.out);
            }
            OpKind::TimestepEmbedding {
                dim,
                flip_sin_to_cos,
                downscale_freq_shift,
                scale,
                max_period,
            } => {
                let half = dim / 2;
                for (bi, &t) in io.ins[0].iter().enumerate() {
                    let o = &mut io.out[bi * dim..(bi + 1) * dim];
                    for i in 0..half {
                        let e = -(*max_period as f64).ln() * i as f64
                            / (half as f64 - *downscale_freq_shift as f64);
                        let a = *scale as f64 * t as f64 * e.exp();
                        let (s, c) = (a.sin() as f32, a.cos() as f32);
                        if *flip_sin_to_cos {
                            o[i] = c;
                            o[half + i] = s;
                        } else {
                            o[i] = s;
                            o[half + i] = c;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// erf for GELU: the Taylor series below 0.5 (error < 1e-16), Abramowitz-Stegun 7.1.26 above
/// (absolute error < 1.5e-7, far below what an f32 GELU output resolves at those arguments).
fn erf(x: f64) -> f64 {
    if x.abs() < 0.5 {
        let x2 = x * x;
        let mut term = x;
        let mut sum = x;
        for n in 1..14 {
            term *= -x2 / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        return sum * 2.0 / std::f64::consts::PI.sqrt();
    }
    let t = 1.0 / (1.0 + 0.3275911 * x.abs());
    let poly = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t
        + 0.254829592)
        * t;
    (1.0 - poly * (-x * x).exp()).copysign(x)
}

fn permute(x: &[f32], ins: &[usize], perm: &[usize], out: &mut [f32]) {
    let rank = ins.len();
    let mut strides = vec![1usize; rank];
    for i in (0..rank.saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * ins[i + 1];
    }
    let outs: Vec<usize> = perm.iter().map(|&p| ins[p]).collect();
    let src_stride: Vec<usize> = perm.iter().map(|&p| strides[p]).collect();
    // The innermost output axis as a run of strided reads.
    let inner = *outs.last().unwrap_or(&1);
    let inner_stride = *src_stride.last().unwrap_or(&1);
    let mut idx = vec![0usize; rank];
    for (row, o) in out.chunks_mut(inner.max(1)).enumerate() {
        let mut rem = row;
        let mut src = 0;
        for ax in (0..rank.saturating_sub(1)).rev() {
            idx[ax] = rem % outs[ax];
            rem /= outs[ax];
            src += idx[ax] * src_stride[ax];
        }
        if inner_stride == 1 {
            o.copy_from_slice(&x[src..src + inner]);
        } else {
            for (i, v) in o.iter_mut().enumerate() {
                *v = x[src + i * inner_stride];
            }
        }
    }
}

impl CpuBackend {
    fn q4_state(&self, v: &Q4View) -> Result<crate::format::bnb::QuantState> {
        Ok(crate::format::bnb::QuantState {
            json: crate::format::bnb::QuantStateJson {
                quant_type: crate::format::bnb::QuantType::Nf4,
                blocksize: v.blocksize as u64,
                dtype: crate::format::bnb::FloatDtype::F32,
                shape: v.shape.iter().map(|&d| d as u64).collect(),
                nested: None,
            },
            code: self.code(v)?,
            absmax: self.region_f32(v.absmax)?.to_vec(),
        })
    }

    fn code(&self, v: &Q4View) -> Result<[f32; 16]> {
        self.region_f32(v.code)?
            .get(..16)
            .and_then(|c| c.try_into().ok())
            .ok_or_else(|| Error::Invalid("cpu: the code table is not 16 f32".into()))
    }

    fn linear_q4(
        &self,
        x: &[f32],
        m: usize,
        v: &Q4View,
        bias: Option<&[f32]>,
        out: &mut [f32],
        xp: &mut Vec<f32>,
    ) -> Result<()> {
        let (n, k, bs) = (v.shape[0], v.shape[1], v.blocksize);
        let packed = self.region(v.packed)?;
        let absmax = self.region_f32(v.absmax)?;
        let code = self.code(v)?;
        let pool = self.threads;
        let o = Out(out.as_mut_ptr());
        if k % bs != 0 || bs % 16 != 0 {
            // Blocks cross rows (or a row starts mid-byte): dequantize rows one at a time by
            // the element formula.
            let tasks = pool.threads();
            pool.run(tasks, &|t| {
                let (n0, n1) = split(n, tasks, t, 1);
                let mut row = vec![0f32; k];
                for j in n0..n1 {
                    for (kk, r) in row.iter_mut().enumerate() {
                        let e = j * k + kk;
                        let byte = packed[e / 2];
                        let q = if e % 2 == 0 { byte >> 4 } else { byte & 15 };
                        *r = code[q as usize] * absmax[e / bs];
                    }
                    for i in 0..m {
                        let mut s = dot(&x[i * k..(i + 1) * k], &row);
                        if let Some(b) = bias {
                            s += b[j];
                        }
                        // SAFETY: column j belongs to this task only.
                        unsafe { o.range(i * n + j, 1)[0] = s };
                    }
                }
            });
            return Ok(());
        }
        // The GEMV reads activations in the order it decodes weights in (chunks of 64, see
        // `nibble_order`), permuted here once per call; the GEMM reads them paired as it packs.
        let gemv = m <= GEMV_MAX_ROWS && gemv_fits(k, bs);
        if !gemv {
            let w = gemm::Nf4Rows {
                packed,
                absmax,
                bs,
                k,
                code: &code,
            };
            gemm::gemm(pool, gemm::isa(), x, m, k, &w, n, bias, out);
            return Ok(());
        }
        if xp.len() < m * k {
            xp.resize(m * k, 0.0);
        }
        let paired = kernels::gemv_paired();
        for i in 0..m {
            nibble_order(&x[i * k..(i + 1) * k], &mut xp[i * k..(i + 1) * k], paired);
        }
        let xp: &[f32] = &xp[..m * k];
        let blocks_per_row = k / bs;
        let tasks = if n * k < 1 << 15 {
            1
        } else {
            pool.threads() * 2
        };
        pool.run(tasks, &|t| {
            let (n0, n1) = split(n, tasks, t, 1);
            let rows: Vec<&[f32]> = (0..m).map(|i| &xp[i * k..(i + 1) * k]).collect();
            let mut dots = [0f32; GEMV_MAX_ROWS];
            for j in n0..n1 {
                let row = Q4Row {
                    packed: &packed[j * k / 2..(j + 1) * k / 2],
                    absmax: &absmax[j * blocks_per_row..(j + 1) * blocks_per_row],
                    bs,
                    code: &code,
                };
                q4_row_dots(&row, &rows, &mut dots[..m]);
                for (i, &d) in dots[..m].iter().enumerate() {
                    let s = d + bias.map_or(0.0, |b| b[j]);
                    // SAFETY: column j belongs to this task only.
                    unsafe { o.range(i * n + j, 1)[0] = s };
                }
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_elementwise_ops_cover_every_value_once_with_the_serial_bits() {
        let pool = ThreadPool::new(3);
        // Below the split threshold, at it, and above with a ragged last piece.
        for n in [5usize, 1 << 15, 3 * 4096 + 17, 200_001] {
            let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 6.0).collect();
            let silu = |v: f32| v / (1.0 + (-v).exp());
            let mut out = vec![f32::NAN; n];
            elementwise(&pool, &x, &mut out, &silu);
            assert!(
                out.iter()
                    .zip(&x)
                    .all(|(o, &v)| o.to_bits() == silu(v).to_bits()),
                "{n} values"
            );
            // Rows of 96 (and a short last one) each handed over once, by index.
            let mut seen = vec![0f32; n];
            by_rows(&pool, &mut seen, 96, &|r, row| {
                for (i, v) in row.iter_mut().enumerate() {
                    *v += (r * 96 + i) as f32 + 1.0;
                }
            });
            assert!(seen.iter().enumerate().all(|(i, &v)| v == i as f32 + 1.0));
        }
    }
}
