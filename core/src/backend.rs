//! The backend interface: small on purpose (ggml's `graph_compute` + `supports_op`, not a
//! 40-method storage trait). A backend owns one activation arena and one weight pool, both
//! allocated once; the executor places every value and weight in them before the first step.

use crate::cpu_ref::{self, Q4Ref};
use crate::error::{Error, Result};
use crate::graph::{infer, ElemType, HostData, HostTensor, OpKind, ValueInfo};
use crate::ring::Fence;

/// A region of the activation arena, in 4-byte words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaSlice {
    /// First word.
    pub offset: usize,
    /// Words.
    pub len: usize,
}

/// A region of the weight pool, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolRegion {
    /// First byte.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// A 4-bit weight in the pool: packed codes, f32 absmax (double quantization already undone
/// bit-exactly by the executor) and the 16-entry code table.
#[derive(Debug, Clone, PartialEq)]
pub struct Q4View {
    /// Packed codes.
    pub packed: PoolRegion,
    /// One f32 per block.
    pub absmax: PoolRegion,
    /// 16 f32.
    pub code: PoolRegion,
    /// Logical shape.
    pub shape: Vec<usize>,
    /// Elements per block.
    pub blocksize: usize,
}

/// An operand of an op: where it lives and what it is.
#[derive(Debug, Clone, PartialEq)]
pub struct Operand {
    /// Its arena words.
    pub slice: ArenaSlice,
    /// Shape and type.
    pub info: ValueInfo,
}

/// A fence that has already signalled (the host has finished with the slot).
#[derive(Debug, Clone, Copy, Default)]
pub struct Signalled;

impl Fence for Signalled {
    fn is_signalled(&self) -> bool {
        true
    }
    fn wait(&self) {}
}

/// What the executor needs from a device.
pub trait Backend {
    /// Name for tables and messages.
    fn name(&self) -> String;
    /// Whether `op` runs here.
    fn supports(&self, op: &OpKind) -> bool;
    /// Allocates the activation arena (`arena_words` 4-byte words) and the weight pool, once.
    fn allocate(&mut self, arena_words: usize, pool_bytes: u64) -> Result<()>;
    /// Alignment, in words, that every arena slice must start at (binding offset rules).
    fn arena_align_words(&self) -> usize {
        1
    }
    /// Alignment, in bytes, that every pool region must start at.
    fn pool_align_bytes(&self) -> u64 {
        4
    }
    /// Writes host words into the arena.
    fn write_arena(&mut self, dst: ArenaSlice, words: &[u32]) -> Result<()>;
    /// Writes a dense tensor's stored bytes (F32/F16/BF16/F64, little-endian) into the arena as
    /// f32 values starting at `dst.offset` (`dst.len` elements).
    fn write_dense(
        &mut self,
        dst: ArenaSlice,
        bytes: &[u8],
        dtype: crate::index::Dtype,
    ) -> Result<()> {
        let mut vals = vec![0f32; dst.len];
        if !crate::convert::widen_into(bytes, dtype, &mut vals) {
            return Err(Error::Invalid(format!(
                "{} bytes of {dtype:?} do not make {} floats",
                bytes.len(),
                dst.len
            )));
        }
        let words: Vec<u32> = vals.iter().map(|v| v.to_bits()).collect();
        self.write_arena(dst, &words)
    }
    /// Whether ops here read [`ElemType::BF16`] dense weights (the weight of `Linear`, the table
    /// of `Embedding`) as stored. The executor then keeps the model's bf16 tensors that only
    /// such ops read at half the bytes of an f32 copy. False (the default): dense weights are
    /// widened to f32 on the way in.
    fn dense_bf16(&self) -> bool {
        false
    }
    /// Writes bf16 bytes (as the model stores them) into a [`ElemType::BF16`] value at `dst`,
    /// starting at its element `first` (two elements per arena word, so `first` may fall in the
    /// middle of a word). Only called where [`Backend::dense_bf16`] is true.
    fn write_bf16(&mut self, dst: ArenaSlice, first: usize, bytes: &[u8]) -> Result<()> {
        let _ = (dst, first, bytes);
        Err(Error::Invalid(format!(
            "{}: bf16 dense weights are not supported",
            self.name()
        )))
    }
    /// Reads arena words back.
    fn read_arena(&mut self, src: ArenaSlice) -> Result<Vec<u32>>;
    /// [`Backend::read_arena`] for an event loop (the browser), where waiting for the device
    /// would block the loop that delivers its answer. The default reads synchronously.
    fn read_arena_async(
        &mut self,
        src: ArenaSlice,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Vec<u32>>> + '_>> {
        let r = self.read_arena(src);
        Box::pin(std::future::ready(r))
    }
    /// Copies bytes (usually from a ring slot) into the weight pool at `offset`. The returned
    /// fence signals when the source bytes may be overwritten.
    fn upload(&mut self, offset: u64, bytes: &[u8]) -> Result<Box<dyn Fence>>;
    /// Where the weight pool is host memory (the optimized CPU backend): the bytes of `r`,
    /// writable in place, so that the executor decodes a streamed weight's absmax straight
    /// into the pool instead of into a buffer that [`Backend::upload`] then copies. `None`
    /// (the default): use `upload`.
    fn host_pool_mut(&mut self, _r: PoolRegion) -> Option<&mut [u8]> {
        None
    }
    /// Zero copy, where kernels read weights from host memory (the optimized CPU backend):
    /// ops read the pool bytes at `offset` (a packed weight's region, `bytes.len()` long) from
    /// `bytes` itself, a filled ring slot, instead of from a copy, until
    /// [`Backend::end_borrow`]. False (the default): not done, [`Backend::upload`] instead.
    ///
    /// # Safety
    /// `bytes` must stay valid and unchanged until `end_borrow(offset)` or `release`.
    unsafe fn borrow_weight(&mut self, _offset: u64, _bytes: &[u8]) -> bool {
        false
    }
    /// Whether [`Backend::borrow_weight`] reads weights in place (for the memory plan's line).
    fn reads_weights_in_place(&self) -> bool {
        false
    }
    /// Ends a [`Backend::borrow_weight`].
    fn end_borrow(&mut self, _offset: u64) {}
    /// A weight group is about to be uploaded (the executor calls this before each group's
    /// first chunk). Asynchronous backends mark here how far the queued compute had got, so
    /// that a later upload waits only for the kernels that read the region it overwrites.
    fn begin_group_load(&mut self) {}
    /// Frees the arena and the pool (the end of a pipeline phase); `allocate` may follow.
    fn release(&mut self) {}
    /// The executor is about to block on the weight stream: a backend that spins worker threads
    /// can let them sleep so that the readers get the cores.
    fn idle(&mut self) {}
    /// Memory for the staging ring's slots (pinned host memory for CUDA); `None`: plain host
    /// memory.
    fn slot_allocator(&self) -> Option<Box<dyn crate::ring::SlotAllocator>> {
        None
    }
    /// Runs `op` on arena operands (and a pool weight) into `out`.
    fn run(
        &mut self,
        op: &OpKind,
        inputs: &[Operand],
        q4: Option<&Q4View>,
        out: &Operand,
    ) -> Result<()>;
}

/// Words of host data (u32 ids as they are, f32 as bits).
pub fn host_words(t: &HostTensor) -> Vec<u32> {
    match &t.data {
        HostData::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
        HostData::U32(v) => v.clone(),
    }
}

/// Where one op's operands go in a fresh arena and pool (aligned as the backend asks).
#[derive(Debug, Clone, PartialEq)]
pub struct OpLayout {
    /// The inputs, in order.
    pub inputs: Vec<Operand>,
    /// The output.
    pub out: Operand,
    /// The 4-bit weight, if any.
    pub q4: Option<Q4View>,
    /// Arena words to allocate.
    pub arena_words: usize,
    /// Pool bytes to allocate.
    pub pool_bytes: u64,
}

/// Lays out one op: `inputs` and `out` in the arena, and a 4-bit weight of logical `shape` and
/// `blocksize` in the pool. The output of an in-place op (`in_place`: the input it overwrites)
/// shares that input's slice.
pub fn layout_op<B: Backend + ?Sized>(
    b: &B,
    inputs: &[ValueInfo],
    out: &ValueInfo,
    q4: Option<(&[usize], usize)>,
    in_place: Option<usize>,
) -> OpLayout {
    let align = b.arena_align_words().max(1);
    let mut cursor = 0usize;
    let mut place = |info: &ValueInfo| {
        let slice = ArenaSlice {
            offset: cursor,
            len: info.numel(),
        };
        cursor = (cursor + info.numel().max(1)).div_ceil(align) * align;
        Operand {
            slice,
            info: info.clone(),
        }
    };
    let ins: Vec<Operand> = inputs.iter().map(&mut place).collect();
    let out = match in_place.and_then(|i| ins.get(i)) {
        Some(shared) => shared.clone(),
        None => place(out),
    };
    let pa = b.pool_align_bytes().max(4);
    let q4 = q4.map(|(shape, blocksize)| {
        let n = shape.iter().product::<usize>() as u64;
        let packed = PoolRegion {
            offset: 0,
            len: n.div_ceil(2),
        };
        let absmax = PoolRegion {
            offset: packed.len.div_ceil(pa) * pa,
            len: n.div_ceil(blocksize as u64) * 4,
        };
        let code = PoolRegion {
            offset: (absmax.offset + absmax.len).div_ceil(pa) * pa,
            len: 64,
        };
        Q4View {
            packed,
            absmax,
            code,
            shape: shape.to_vec(),
            blocksize,
        }
    });
    let pool_bytes = q4.as_ref().map(|v| v.code.offset + 64).unwrap_or(pa);
    OpLayout {
        inputs: ins,
        out,
        q4,
        arena_words: cursor.max(1),
        pool_bytes,
    }
}

/// Runs one op on any [`Backend`] the way the executor does (operands in a freshly allocated
/// arena, the 4-bit weight in the pool) and reads the result back.
pub fn run_op<B: Backend + ?Sized>(
    b: &mut B,
    op: &OpKind,
    inputs: &[&HostTensor],
    q4: Option<Q4Ref<'_>>,
) -> Result<HostTensor> {
    let infos: Vec<ValueInfo> = inputs.iter().map(|t| t.info.clone()).collect();
    let refs: Vec<&ValueInfo> = infos.iter().collect();
    let q4info = q4.map(|q| q.info());
    let out_info = infer(op, &refs, q4info.as_ref())?;
    let lay = layout_op(
        b,
        &infos,
        &out_info,
        q4info.as_ref().map(|i| (i.shape.as_slice(), i.blocksize)),
        op.in_place_input(),
    );
    b.allocate(lay.arena_words, lay.pool_bytes)?;
    for (o, t) in lay.inputs.iter().zip(inputs) {
        b.write_arena(o.slice, &host_words(t))?;
    }
    if let (Some(v), Some(q)) = (&lay.q4, q4) {
        b.upload(v.packed.offset, q.packed)?.wait();
        let absmax: Vec<u8> = q
            .state
            .absmax
            .iter()
            .flat_map(|a| a.to_le_bytes())
            .collect();
        b.upload(v.absmax.offset, &absmax)?.wait();
        let code: Vec<u8> = q.state.code.iter().flat_map(|a| a.to_le_bytes()).collect();
        b.upload(v.code.offset, &code)?.wait();
    }
    b.run(op, &lay.inputs, lay.q4.as_ref(), &lay.out)?;
    let words = b.read_arena(lay.out.slice)?;
    HostTensor::f32(
        &out_info.shape,
        words.into_iter().map(f32::from_bits).collect(),
    )
}

/// The reference backend behind the [`Backend`] interface: arena and pool in host memory,
/// every op through `cpu_ref::run`.
#[derive(Debug, Default)]
pub struct CpuRefBackend {
    arena: Vec<u32>,
    pool: Vec<u8>,
}

impl CpuRefBackend {
    /// A backend with nothing allocated yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn arena(&self, s: ArenaSlice) -> Result<&[u32]> {
        self.arena
            .get(s.offset..s.offset + s.len)
            .ok_or_else(|| Error::Invalid(format!("arena slice {s:?} out of range")))
    }

    fn pool(&self, r: PoolRegion) -> Result<&[u8]> {
        self.pool
            .get(r.offset as usize..(r.offset + r.len) as usize)
            .ok_or_else(|| Error::Invalid(format!("pool region {r:?} out of range")))
    }
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

impl Backend for CpuRefBackend {
    fn name(&self) -> String {
        "cpu_ref".into()
    }
    fn supports(&self, _op: &OpKind) -> bool {
        true
    }
    fn allocate(&mut self, arena_words: usize, pool_bytes: u64) -> Result<()> {
        self.arena = vec![0; arena_words];
        self.pool = vec![0; pool_bytes as usize];
        Ok(())
    }
    fn release(&mut self) {
        self.arena = Vec::new();
        self.pool = Vec::new();
    }
    fn write_arena(&mut self, dst: ArenaSlice, words: &[u32]) -> Result<()> {
        let d = self
            .arena
            .get_mut(dst.offset..dst.offset + words.len())
            .ok_or_else(|| Error::Invalid(format!("arena write {dst:?} out of range")))?;
        d.copy_from_slice(words);
        Ok(())
    }
    fn read_arena(&mut self, src: ArenaSlice) -> Result<Vec<u32>> {
        Ok(self.arena(src)?.to_vec())
    }
    fn upload(&mut self, offset: u64, bytes: &[u8]) -> Result<Box<dyn Fence>> {
        let d = self
            .pool
            .get_mut(offset as usize..offset as usize + bytes.len())
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "pool upload at {offset} of {} bytes out of range",
                    bytes.len()
                ))
            })?;
        d.copy_from_slice(bytes);
        Ok(Box::new(Signalled))
    }
    fn run(
        &mut self,
        op: &OpKind,
        inputs: &[Operand],
        q4: Option<&Q4View>,
        out: &Operand,
    ) -> Result<()> {
        let mut tensors = Vec::with_capacity(inputs.len());
        for o in inputs {
            let words = self.arena(o.slice)?;
            let t = match o.info.elem {
                ElemType::F32 => HostTensor::f32(
                    &o.info.shape,
                    words.iter().map(|w| f32::from_bits(*w)).collect(),
                )?,
                ElemType::U32 => HostTensor::u32(&o.info.shape, words.to_vec())?,
                ElemType::BF16 => HostTensor::f32(
                    &o.info.shape,
                    crate::convert::bf16_words_to_f32(words, o.info.numel()),
                )?,
            };
            tensors.push(t);
        }
        let refs: Vec<&HostTensor> = tensors.iter().collect();
        let result = match q4 {
            Some(v) => {
                let state = crate::bnb::QuantState {
                    json: crate::bnb::QuantStateJson {
                        quant_type: crate::bnb::QuantType::Nf4,
                        blocksize: v.blocksize as u64,
                        dtype: crate::bnb::FloatDtype::F32,
                        shape: v.shape.iter().map(|&d| d as u64).collect(),
                        nested: None,
                    },
                    code: f32s(self.pool(v.code)?)
                        .try_into()
                        .map_err(|_| Error::Invalid("code table is not 16 f32".into()))?,
                    absmax: f32s(self.pool(v.absmax)?),
                };
                let packed = self.pool(v.packed)?.to_vec();
                cpu_ref::run(
                    op,
                    &refs,
                    Some(Q4Ref {
                        state: &state,
                        packed: &packed,
                    }),
                )?
            }
            None => cpu_ref::run(op, &refs, None)?,
        };
        if result.info != out.info {
            return Err(Error::Invalid(format!(
                "{}: output {:?} does not match the planned {:?}",
                op.name(),
                result.info,
                out.info
            )));
        }
        self.write_arena(out.slice, &host_words(&result))
    }
}
