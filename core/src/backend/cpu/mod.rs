//! The optimized CPU backend (`cpu`): the product path on machines without a GPU, separate from
//! the `cpu_ref` oracle and checked against it by the conformance suite. Ops run in place on one
//! arena (no copies per op). A linear of a few rows (decode) decodes 4-bit weights with AVX2
//! table lookups (exactly bitsandbytes' dequantized values) into FMA dot products; a linear or
//! matmul of more rows runs the blocked GEMM ([`gemm`]: packed weight panels, a register-tiled
//! micro-kernel on the widest instruction set present, the same bits on every CPU); attention is
//! blocked with an online softmax on the same micro-kernel ([`attention`]); heavy ops are split
//! across a fixed pool of threads (all cores).

mod attention;
mod dense;
pub mod gemm;
mod image;
pub mod kernels;
mod ops;
pub mod pool;

use crate::backend::{
    Alignment, ArenaSlice, Backend, DeviceInfo, HostMemory, OpShapes, Operand, PoolRegion, Q4View,
    Signalled, Workspace,
};
use crate::error::{Error, Result};
use crate::graph::{ElemType, OpKind, RopeMode};
use crate::stream::ring::Fence;
use kernels::{dot, dot_tile_rows, exp_shifted, gemv_fits, nibble_order, q4_row_dots, Q4Row, Rows};
use pool::ThreadPool;

/// Rows up to which the 4-bit linear decodes each weight row once per call into dot products
/// (decode); above, it dequantizes tiles of rows and runs the GEMM tiles.
pub const GEMV_MAX_ROWS: usize = 4;

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

    /// "cpu (N threads, GEMM avx512f, GEMV avx512f, AVX2+FMA)": the GEMM's instruction set,
    /// the 4-bit GEMV's (the same: one sum on each, bit for bit), then the other kernels'.
    pub fn describe(&self) -> String {
        let gemv = gemm::isa().name();
        format!(
            "{} threads, GEMM {}, GEMV {gemv}, {}",
            self.threads.threads(),
            gemm::isa().name(),
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
        if !(b.as_ptr() as usize).is_multiple_of(4) {
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
    fn supports(&self, _op: &OpShapes<'_>) -> std::result::Result<(), String> {
        Ok(())
    }
    fn allocate(&mut self, arena_words: usize, pool_bytes: u64, _workspace: u64) -> Result<()> {
        self.arena = crate::error::zeroed_huge(arena_words, "the CPU backend's arena")?;
        touch(&mut self.arena);
        self.pool_len = usize::try_from(pool_bytes).map_err(|_| {
            crate::error::Error::Invalid(format!("a weight pool of {pool_bytes} bytes"))
        })?;
        self.pool =
            crate::error::zeroed_huge(self.pool_len.div_ceil(8), "the CPU backend's weight pool")?;
        for page in self.pool.chunks_mut(512) {
            // SAFETY: as in `touch`.
            unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) };
        }
        Ok(())
    }
    fn release(&mut self) {
        self.borrowed.clear();
        self.arena = Vec::new();
        self.pool = Vec::new();
        self.pool_len = 0;
        // The kernels' shared workspace belongs to the phase that sized it: the next phase's
        // plan counts its own.
        self.scratch = Vec::new();
    }
    fn workspace(&self, ops: &[OpShapes<'_>]) -> Workspace {
        // `self.scratch` grows to the largest of: activations reordered for a 4-bit GEMV
        // (m x k), a matmul's transposed operand (n x k), a convolution band's columns. Each
        // worker (and the caller) keeps the GEMM's packed weight block ([`gemm::panel_bytes`])
        // for every linear, matmul and convolution, or attention's packed key head and tiles;
        // a convolution also allocates its band's products while it runs.
        // A worker keeps the GEMM's panel (thread-local, kept between ops) while it runs an
        // attention task's buffers too: each worker's share is the sum of the two largest.
        let (mut shared, mut tile, mut attend, mut transient) = (0u64, 0u64, 0u64, 0u64);
        for o in ops {
            let shape = |i: usize| o.inputs.get(i).map(|v| v.shape.clone()).unwrap_or_default();
            match o.op {
                OpKind::LinearQ4 { .. } => {
                    let x = shape(0);
                    let (m, k) = (
                        x.first().copied().unwrap_or(0),
                        x.last().copied().unwrap_or(0),
                    );
                    // Only the GEMV's rows are reordered into the workspace; the GEMM reads
                    // its activations in place.
                    if m <= GEMV_MAX_ROWS {
                        shared = shared.max((m * k * 4) as u64);
                    }
                    tile = tile.max(gemm::panel_bytes(k) as u64);
                }
                OpKind::Linear { .. } | OpKind::MatMul { transpose_b: true } => {
                    let k = shape(0).last().copied().unwrap_or(0);
                    tile = tile.max(gemm::panel_bytes(k) as u64);
                }
                OpKind::MatMul { transpose_b: false } => {
                    let (a, b) = (shape(0), shape(1));
                    if let (Some(&k), Some(&n)) = (a.last(), b.last()) {
                        shared = shared.max((n * k * 4) as u64);
                        tile = tile.max(gemm::panel_bytes(k) as u64);
                    }
                }
                OpKind::Attention { .. } => {
                    let k = shape(1);
                    if let (Some(&tk), Some(&d)) = (k.get(1), k.get(2)) {
                        attend = attend.max(attention::workspace_bytes(tk, d));
                    }
                }
                OpKind::Conv2d { kernel, pad, .. } => {
                    tile = tile.max(gemm::panel_bytes(usize::MAX) as u64);
                    let (x, w) = (shape(0), shape(1));
                    if x.len() == 3 && !w.is_empty() {
                        let (cols, tmp) =
                            image::conv2d_workspace((x[0], x[1], x[2]), w[0], (*kernel, *pad));
                        shared = shared.max(cols);
                        transient = transient.max(tmp);
                    }
                }
                _ => {}
            }
        }
        Workspace {
            host_bytes: shared + (tile + attend) * (self.threads.threads() as u64 + 1) + transient,
            device_bytes: 0,
        }
    }
    fn device_info(&self) -> DeviceInfo {
        // 64 bytes: every operand and pool region starts on a cache line.
        DeviceInfo {
            alignment: Alignment {
                arena_words: 16,
                pool_bytes: 64,
            },
            ..DeviceInfo::default()
        }
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
        self.run_op(op, inputs, q4, out)
    }
    fn host_memory(&mut self) -> Option<&mut dyn HostMemory> {
        Some(self)
    }
}

impl HostMemory for CpuBackend {
    fn arena_f32_mut(&mut self, dst: ArenaSlice) -> Result<&mut [f32]> {
        self.arena
            .get_mut(dst.offset..dst.offset + dst.len)
            .ok_or_else(|| Error::Invalid(format!("cpu: arena write {dst:?} out of range")))
    }
    fn write_bf16(&mut self, dst: ArenaSlice, first: usize, bytes: &[u8]) -> Result<()> {
        self.check(dst)?;
        let n = bytes.len() / 2;
        if !bytes.len().is_multiple_of(2) || first + n > dst.len * 2 {
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
    fn pool_mut(&mut self, r: PoolRegion) -> Result<&mut [u8]> {
        let len = self.pool_len;
        // SAFETY: the u64 storage viewed as bytes; the length is the allocated byte count.
        let pool =
            unsafe { std::slice::from_raw_parts_mut(self.pool.as_mut_ptr() as *mut u8, len) };
        pool.get_mut(r.offset as usize..(r.offset + r.len) as usize)
            .ok_or_else(|| Error::Invalid(format!("cpu: pool region {r:?} out of range")))
    }
    unsafe fn lend(&mut self, offset: u64, bytes: &[u8]) {
        self.end_lend(offset);
        self.borrowed.push(Borrowed {
            offset,
            ptr: bytes.as_ptr(),
            len: bytes.len(),
        });
    }
    fn end_lend(&mut self, offset: u64) {
        self.borrowed.retain(|b| b.offset != offset);
    }
    fn lent(&self) -> usize {
        self.borrowed.len()
    }
    fn idle(&mut self) {
        self.threads.park();
    }
}
