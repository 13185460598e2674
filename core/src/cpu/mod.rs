//! The optimized CPU backend (`cpu`): the product path on machines without a GPU, separate from
//! the `cpu_ref` oracle and checked against it by the conformance suite. Ops run in place on one
//! arena (no copies per op); the 4-bit linear decodes weights with AVX2 table lookups (exactly
//! bitsandbytes' dequantized values) into FMA dot products for few rows and into cache-sized f32
//! tiles for a register-blocked GEMM for many; the dense linear, matmul and attention use the
//! same FMA tiles; heavy ops are split across a fixed pool of threads (all cores).

pub mod kernels;
pub mod pool;

use crate::backend::{ArenaSlice, Backend, Operand, PoolRegion, Q4View, Signalled};
use crate::error::{Error, Result};
use crate::graph::{ElemType, OpKind, RopeMode};
use crate::ring::Fence;
use kernels::{
    dequant_row_paired, dot, dot_tile, dot_tile_rows, lane_order, pair_order, q4_row_dots, Rows,
};
use pool::ThreadPool;

/// Rows up to which the 4-bit linear decodes each weight row once per call into dot products
/// (decode); above, it dequantizes tiles of rows and runs the GEMM tiles.
pub const GEMV_MAX_ROWS: usize = 4;

/// Weight rows dequantized per GEMM tile (per thread, `TILE_ROWS * K * 4` bytes of scratch).
const TILE_ROWS: usize = 24;

/// The optimized CPU backend.
#[derive(Debug)]
pub struct CpuBackend {
    arena: Vec<f32>,
    pool: Vec<u64>,
    pool_len: usize,
    threads: &'static ThreadPool,
    /// Activations in kernel order and transposed matmul operands: kept between ops so that
    /// they grow once to the largest shape instead of being allocated per call.
    scratch: Vec<f32>,
    /// Streamed packed weights read in place from ring slots ([`Backend::borrow_weight`]).
    borrowed: Vec<Borrowed>,
}

/// A pool region whose bytes are read from a ring slot instead.
#[derive(Debug)]
struct Borrowed {
    offset: u64,
    ptr: *const u8,
    len: usize,
}
// SAFETY: the slot memory is plain host memory that the executor keeps alive and unchanged
// while lent (`borrow_weight`'s contract); the backend only reads it.
unsafe impl Send for Borrowed {}
unsafe impl Sync for Borrowed {}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

/// A raw pointer that tasks of one parallel op share; each task writes a disjoint range.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: tasks write disjoint elements and the parallel call returns before the borrow ends.
unsafe impl Sync for Out {}
unsafe impl Send for Out {}

/// A byte pointer shared by the tasks of one parallel copy (each writes a disjoint range).
#[derive(Clone, Copy)]
struct SyncBytes(*mut u8);
// SAFETY: as for `Out`.
unsafe impl Sync for SyncBytes {}
unsafe impl Send for SyncBytes {}

impl SyncBytes {
    fn at(&self, i: usize) -> *mut u8 {
        self.0.wrapping_add(i)
    }
}

impl Out {
    /// # Safety
    /// `at .. at + len` lies inside the output and no other task touches it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn range(&self, at: usize, len: usize) -> &mut [f32] {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(at), len) }
    }
}

fn split(n: usize, parts: usize, i: usize, step: usize) -> (usize, usize) {
    let units = n.div_ceil(step);
    let per = units.div_ceil(parts);
    let a = (i * per * step).min(n);
    let b = ((i + 1) * per * step).min(n);
    (a, b)
}

fn touch(v: &mut [f32]) {
    // vec![0; n] is not resident until written: touch every page now so that the arena counts
    // in RSS from the start, not in the middle of a run.
    for page in v.chunks_mut(1024) {
        // SAFETY: a valid, exclusive pointer into the slice.
        unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0.0) };
    }
}

impl CpuBackend {
    /// A backend with nothing allocated yet, on the shared thread pool.
    pub fn new() -> Self {
        CpuBackend {
            arena: Vec::new(),
            pool: Vec::new(),
            pool_len: 0,
            threads: ThreadPool::global(),
            scratch: Vec::new(),
            borrowed: Vec::new(),
        }
    }

    /// "cpu (N threads, AVX2)".
    pub fn describe(&self) -> String {
        format!(
            "{} threads, {}",
            self.threads.threads(),
            if kernels::have_avx2() {
                "AVX2+FMA"
            } else {
                "portable"
            }
        )
    }

    fn pool_bytes(&self) -> &[u8] {
        // SAFETY: u64 storage viewed as bytes; the length is the allocated byte count.
        unsafe { std::slice::from_raw_parts(self.pool.as_ptr() as *const u8, self.pool_len) }
    }

    fn region(&self, r: PoolRegion) -> Result<&[u8]> {
        if let Some(b) = self
            .borrowed
            .iter()
            .find(|b| b.offset == r.offset && r.len as usize <= b.len)
        {
            // SAFETY: lent by the executor, alive and unchanged until `end_borrow`.
            return Ok(unsafe { std::slice::from_raw_parts(b.ptr, r.len as usize) });
        }
        self.pool_bytes()
            .get(r.offset as usize..(r.offset + r.len) as usize)
            .ok_or_else(|| Error::Invalid(format!("cpu: pool region {r:?} out of range")))
    }

    fn region_f32(&self, r: PoolRegion) -> Result<&[f32]> {
        let b = self.region(r)?;
        if (b.as_ptr() as usize) % 4 != 0 {
            return Err(Error::Invalid("cpu: misaligned f32 pool region".into()));
        }
        // SAFETY: aligned, in bounds, and every bit pattern is a valid f32.
        Ok(unsafe { std::slice::from_raw_parts(b.as_ptr() as *const f32, b.len() / 4) })
    }

    fn check(&self, s: ArenaSlice) -> Result<()> {
        if s.offset + s.len > self.arena.len() {
            return Err(Error::Invalid(format!(
                "cpu: arena slice {s:?} out of range ({} words)",
                self.arena.len()
            )));
        }
        Ok(())
    }
}

/// A dense weight operand's elements (`words` are its arena words): f32, or the bf16 of an
/// [`ElemType::BF16`] value.
fn rows<'a>(o: &Operand, words: &'a [f32]) -> Rows<'a> {
    match o.info.elem {
        ElemType::BF16 => {
            let n = o.info.numel();
            assert!(
                n <= words.len() * 2,
                "bf16 value of {n} in {} words",
                words.len()
            );
            // SAFETY: u16 view of f32 storage (alignment 4 >= 2), in bounds (asserted).
            Rows::Bf16(unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u16, n) })
        }
        _ => Rows::F32(words),
    }
}

/// The inputs and output of one op as slices of the arena.
struct Io<'a> {
    ins: Vec<&'a [f32]>,
    out: &'a mut [f32],
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!("cpu ({})", self.describe())
    }
    fn supports(&self, _op: &OpKind) -> bool {
        true
    }
    fn allocate(&mut self, arena_words: usize, pool_bytes: u64) -> Result<()> {
        self.arena = vec![0f32; arena_words];
        touch(&mut self.arena);
        self.pool_len = pool_bytes as usize;
        self.pool = vec![0u64; self.pool_len.div_ceil(8)];
        for page in self.pool.chunks_mut(512) {
            // SAFETY: as in `touch`.
            unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) };
        }
        Ok(())
    }
    fn idle(&mut self) {
        self.threads.park();
    }
    fn host_pool_mut(&mut self, r: PoolRegion) -> Option<&mut [u8]> {
        let len = self.pool_len;
        // SAFETY: the u64 storage viewed as bytes; the length is the allocated byte count.
        let pool =
            unsafe { std::slice::from_raw_parts_mut(self.pool.as_mut_ptr() as *mut u8, len) };
        pool.get_mut(r.offset as usize..(r.offset + r.len) as usize)
    }
    unsafe fn borrow_weight(&mut self, offset: u64, bytes: &[u8]) -> bool {
        self.end_borrow(offset);
        self.borrowed.push(Borrowed {
            offset,
            ptr: bytes.as_ptr(),
            len: bytes.len(),
        });
        true
    }
    fn reads_weights_in_place(&self) -> bool {
        true
    }
    fn end_borrow(&mut self, offset: u64) {
        self.borrowed.retain(|b| b.offset != offset);
    }
    fn release(&mut self) {
        self.borrowed.clear();
        self.arena = Vec::new();
        self.pool = Vec::new();
        self.pool_len = 0;
    }
    fn arena_align_words(&self) -> usize {
        16 // 64 bytes: every operand starts on a cache line
    }
    fn pool_align_bytes(&self) -> u64 {
        64
    }
    fn write_arena(&mut self, dst: ArenaSlice, words: &[u32]) -> Result<()> {
        let d = self
            .arena
            .get_mut(dst.offset..dst.offset + words.len())
            .ok_or_else(|| Error::Invalid(format!("cpu: arena write {dst:?} out of range")))?;
        for (a, w) in d.iter_mut().zip(words) {
            *a = f32::from_bits(*w);
        }
        Ok(())
    }
    fn write_dense(
        &mut self,
        dst: ArenaSlice,
        bytes: &[u8],
        dtype: crate::index::Dtype,
    ) -> Result<()> {
        let d = self
            .arena
            .get_mut(dst.offset..dst.offset + dst.len)
            .ok_or_else(|| Error::Invalid(format!("cpu: arena write {dst:?} out of range")))?;
        if !crate::convert::widen_into(bytes, dtype, d) {
            return Err(Error::Invalid(format!(
                "cpu: {} bytes of {dtype:?} do not make {} floats",
                bytes.len(),
                dst.len
            )));
        }
        Ok(())
    }
    fn dense_bf16(&self) -> bool {
        true
    }
    fn write_bf16(&mut self, dst: ArenaSlice, first: usize, bytes: &[u8]) -> Result<()> {
        self.check(dst)?;
        let n = bytes.len() / 2;
        if bytes.len() % 2 != 0 || first + n > dst.len * 2 {
            return Err(Error::Invalid(format!(
                "cpu: {} bf16 bytes at element {first} do not fit {dst:?}",
                bytes.len()
            )));
        }
        let words = &mut self.arena[dst.offset..dst.offset + dst.len];
        // SAFETY: u16 view of the f32 words (alignment 4 >= 2), in bounds (checked above).
        let h =
            unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u16, dst.len * 2) };
        for (d, c) in h[first..first + n].iter_mut().zip(bytes.chunks_exact(2)) {
            *d = u16::from_le_bytes([c[0], c[1]]);
        }
        Ok(())
    }
    fn read_arena(&mut self, src: ArenaSlice) -> Result<Vec<u32>> {
        self.check(src)?;
        Ok(self.arena[src.offset..src.offset + src.len]
            .iter()
            .map(|v| v.to_bits())
            .collect())
    }
    fn upload(&mut self, offset: u64, bytes: &[u8]) -> Result<Box<dyn Fence>> {
        let len = self.pool_len;
        let end = offset as usize + bytes.len();
        if end > len {
            return Err(Error::Invalid(format!(
                "cpu: pool upload at {offset} of {} bytes out of range ({len})",
                bytes.len()
            )));
        }
        // SAFETY: in bounds (checked above) of the u64 storage viewed as bytes.
        let pool =
            unsafe { std::slice::from_raw_parts_mut(self.pool.as_mut_ptr() as *mut u8, len) };
        let dst = &mut pool[offset as usize..end];
        if bytes.len() < 4 << 20 {
            dst.copy_from_slice(bytes);
        } else {
            // Large uploads (streamed blocks) copy on every core.
            let parts = self.threads.threads();
            let per = bytes.len().div_ceil(parts);
            let d = SyncBytes(dst.as_mut_ptr());
            self.threads.run(parts, &|t| {
                let a = (t * per).min(bytes.len());
                let b = ((t + 1) * per).min(bytes.len());
                // SAFETY: task t writes bytes a..b of dst only.
                unsafe { std::slice::from_raw_parts_mut(d.at(a), b - a) }
                    .copy_from_slice(&bytes[a..b]);
            });
        }
        Ok(Box::new(Signalled))
    }
    fn run(
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
                let (a, b) = (io.ins[0], io.ins[1]);
                let d = b.len().max(1);
                let add = matches!(op, OpKind::Add);
                for (oc, ac) in io.out.chunks_mut(d).zip(a.chunks(d)) {
                    for ((o, &x), &y) in oc.iter_mut().zip(ac).zip(b) {
                        *o = if add { x + y } else { x * y };
                    }
                }
            }
            OpKind::Scale { factor } => {
                for (o, &x) in io.out.iter_mut().zip(io.ins[0]) {
                    *o = x * factor;
                }
            }
            OpKind::RmsNorm { eps } => {
                let (w, d) = (io.ins[1], last(0));
                for (row, orow) in io.ins[0].chunks(d).zip(io.out.chunks_mut(d)) {
                    let ms = (dot(row, row) as f64 / d as f64) as f32;
                    let r = 1.0 / (ms + eps).sqrt();
                    for i in 0..d {
                        orow[i] = row[i] * r * w[i];
                    }
                }
            }
            OpKind::LayerNorm { eps, affine } => {
                let d = last(0);
                for (row, orow) in io.ins[0].chunks(d).zip(io.out.chunks_mut(d)) {
                    let mean = row.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
                    let var =
                        row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
                    let r = (1.0 / (var + *eps as f64).sqrt()) as f32;
                    let mean = mean as f32;
                    for i in 0..d {
                        let n = (row[i] - mean) * r;
                        orow[i] = if *affine {
                            n * io.ins[1][i] + io.ins[2][i]
                        } else {
                            n
                        };
                    }
                }
            }
            OpKind::Silu => {
                for (o, &x) in io.out.iter_mut().zip(io.ins[0]) {
                    *o = x / (1.0 + (-x).exp());
                }
            }
            OpKind::Gelu => {
                for (o, &x) in io.out.iter_mut().zip(io.ins[0]) {
                    let v = x as f64;
                    *o = (0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2))) as f32;
                }
            }
            OpKind::GeluTanh => {
                let c = (2.0f32 / std::f32::consts::PI).sqrt();
                for (o, &x) in io.out.iter_mut().zip(io.ins[0]) {
                    *o = 0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh());
                }
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
                attention(
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

/// `out[M,N] = x[M,K] · w[N,K]^T (+ b)`, f32 tiles, columns split across threads.
#[allow(clippy::too_many_arguments)]
fn dense_linear(
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    w: Rows<'_>,
    n: usize,
    k: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let o = Out(out.as_mut_ptr());
    let tasks = if (m * n * k) < 1 << 16 {
        1
    } else {
        pool.threads() * 2
    };
    pool.run(tasks, &|t| {
        let (n0, n1) = split(n, tasks, t, 3);
        let mut tile = [0f32; 12];
        let mut j = n0;
        while j < n1 {
            let nr = (n1 - j).min(3);
            let mut i = 0;
            while i < m {
                let mr = (m - i).min(4);
                dot_tile_rows(&x[i * k..], k, mr, w.from(j * k), k, nr, k, &mut tile, 3);
                for a in 0..mr {
                    for bcol in 0..nr {
                        let mut v = tile[a * 3 + bcol];
                        if let Some(b) = bias {
                            v += b[j + bcol];
                        }
                        // SAFETY: column j + bcol belongs to this task only.
                        unsafe { o.range((i + a) * n + j + bcol, 1)[0] = v };
                    }
                }
                i += mr;
            }
            j += nr;
        }
    });
}

#[allow(clippy::too_many_arguments)]
fn attention(
    pool: &ThreadPool,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&[f32]>,
    qs: &[usize],
    ks: &[usize],
    causal: bool,
    scale: f32,
    out: &mut [f32],
) {
    let (hq, tq, d) = (qs[0], qs[1], qs[2]);
    let (hkv, tk) = (ks[0], ks[1]);
    let group = hq / hkv.max(1);
    let rows = hq * tq;
    let o = Out(out.as_mut_ptr());
    let tasks = rows.min(pool.threads() * 4).max(1);
    pool.run(tasks, &|t| {
        let (r0, r1) = split(rows, tasks, t, 1);
        let mut scores = vec![0f32; tk];
        let mut acc = vec![0f32; d];
        for row in r0..r1 {
            let (h, i) = (row / tq, row % tq);
            let kh = h / group;
            let qrow = &q[row * d..(row + 1) * d];
            let limit = if causal {
                (i + tk - tq + 1).min(tk)
            } else {
                tk
            };
            let mut m = f32::NEG_INFINITY;
            for j in 0..limit {
                if mask.is_some_and(|mk| mk[j] == 0.0) {
                    scores[j] = f32::NEG_INFINITY;
                    continue;
                }
                let s = dot(qrow, &k[(kh * tk + j) * d..(kh * tk + j + 1) * d]) * scale;
                scores[j] = s;
                m = m.max(s);
            }
            acc.iter_mut().for_each(|a| *a = 0.0);
            // SAFETY: row `row` of the output belongs to this task only.
            let orow = unsafe { o.range(row * d, d) };
            if m == f32::NEG_INFINITY {
                orow.iter_mut().for_each(|x| *x = 0.0);
                continue;
            }
            let mut sum = 0f32;
            for j in 0..limit {
                if scores[j] == f32::NEG_INFINITY {
                    continue;
                }
                let w = (scores[j] - m).exp();
                sum += w;
                let vrow = &v[(kh * tk + j) * d..(kh * tk + j + 1) * d];
                for (a, &x) in acc.iter_mut().zip(vrow) {
                    *a += w * x;
                }
            }
            let inv = 1.0 / sum;
            for (ov, a) in orow.iter_mut().zip(&acc) {
                *ov = a * inv;
            }
        }
    });
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl CpuBackend {
    fn q4_state(&self, v: &Q4View) -> Result<crate::bnb::QuantState> {
        Ok(crate::bnb::QuantState {
            json: crate::bnb::QuantStateJson {
                quant_type: crate::bnb::QuantType::Nf4,
                blocksize: v.blocksize as u64,
                dtype: crate::bnb::FloatDtype::F32,
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
        // Activations in the order the kernel decodes weights into, once per call: lane order
        // for the GEMV (blocks of at least 32), paired order for the tiles.
        let gemv = m <= GEMV_MAX_ROWS && bs % 32 == 0;
        if xp.len() < m * k {
            xp.resize(m * k, 0.0);
        }
        for i in 0..m {
            let (src, dst) = (&x[i * k..(i + 1) * k], &mut xp[i * k..(i + 1) * k]);
            if gemv {
                lane_order(src, dst);
            } else {
                pair_order(src, dst);
            }
        }
        let xp: &[f32] = &xp[..m * k];
        let blocks_per_row = k / bs;
        let tasks = if n * k < 1 << 15 {
            1
        } else {
            pool.threads() * 2
        };
        if gemv {
            pool.run(tasks, &|t| {
                let (n0, n1) = split(n, tasks, t, 1);
                let rows: Vec<&[f32]> = (0..m).map(|i| &xp[i * k..(i + 1) * k]).collect();
                let mut dots = [0f32; GEMV_MAX_ROWS];
                for j in n0..n1 {
                    q4_row_dots(
                        &packed[j * k / 2..(j + 1) * k / 2],
                        &absmax[j * blocks_per_row..(j + 1) * blocks_per_row],
                        bs,
                        &code,
                        &rows,
                        &mut dots[..m],
                    );
                    for (i, &d) in dots[..m].iter().enumerate() {
                        let s = d + bias.map_or(0.0, |b| b[j]);
                        // SAFETY: column j belongs to this task only.
                        unsafe { o.range(i * n + j, 1)[0] = s };
                    }
                }
            });
            return Ok(());
        }
        pool.run(tasks, &|t| {
            let (n0, n1) = split(n, tasks, t, TILE_ROWS);
            SCRATCH.with(|s| {
                let mut w = s.borrow_mut();
                if w.len() < TILE_ROWS * k {
                    w.resize(TILE_ROWS * k, 0.0);
                }
                let mut tile = [0f32; 12];
                let mut j0 = n0;
                while j0 < n1 {
                    let rows = (n1 - j0).min(TILE_ROWS);
                    for r in 0..rows {
                        let j = j0 + r;
                        dequant_row_paired(
                            &packed[j * k / 2..(j + 1) * k / 2],
                            &absmax[j * blocks_per_row..(j + 1) * blocks_per_row],
                            bs,
                            &code,
                            &mut w[r * k..(r + 1) * k],
                        );
                    }
                    let mut i = 0;
                    while i < m {
                        let mr = (m - i).min(4);
                        let mut r = 0;
                        while r < rows {
                            let nr = (rows - r).min(3);
                            dot_tile(&xp[i * k..], k, mr, &w[r * k..], k, nr, k, &mut tile, 3);
                            for a in 0..mr {
                                for c in 0..nr {
                                    let j = j0 + r + c;
                                    let s = tile[a * 3 + c] + bias.map_or(0.0, |b| b[j]);
                                    // SAFETY: column j belongs to this task only.
                                    unsafe { o.range((i + a) * n + j, 1)[0] = s };
                                }
                            }
                            r += nr;
                        }
                        i += mr;
                    }
                    j0 += rows;
                }
            });
        });
        Ok(())
    }
}
