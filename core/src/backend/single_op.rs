//! One op on any [`Backend`], the way the executor runs it: operands in a freshly allocated
//! arena, the 4-bit weight in the pool, the result read back. The conformance suite and the
//! kernel benchmarks use it; the executor does not.

use crate::backend::cpu_ref::Q4Ref;
use crate::backend::{ArenaSlice, Backend, Operand, PoolRegion, Q4View};
use crate::error::Result;
use crate::graph::{infer, HostData, HostTensor, OpKind, ValueInfo};

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
    let align = b.device_info().alignment.arena_words.max(1);
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
    let pa = b.device_info().alignment.pool_bytes.max(4);
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
    let shapes = crate::backend::OpShapes {
        op,
        inputs: &infos,
        out: &out_info,
    };
    b.supports(&shapes)
        .map_err(|why| crate::Error::Invalid(format!("{} on {}: {why}", op.name(), b.name())))?;
    let ws = b.workspace(&[shapes]);
    b.allocate(lay.arena_words, lay.pool_bytes, ws.device_bytes)?;
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
