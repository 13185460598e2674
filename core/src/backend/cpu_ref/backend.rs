//! The reference backend behind the [`Backend`] interface: arena and pool in host memory, every
//! op through [`super::run`] on host tensors. Slow and obviously right.

use crate::backend::cpu_ref::{self, Q4Ref};
use crate::backend::{host_words, ArenaSlice, Backend, Operand, PoolRegion, Q4View, Signalled};
use crate::error::{Error, Result};
use crate::graph::{ElemType, HostTensor, OpKind};
use crate::stream::ring::Fence;

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
    fn supports(&self, _op: &crate::backend::OpShapes<'_>) -> std::result::Result<(), String> {
        Ok(())
    }
    fn allocate(&mut self, arena_words: usize, pool_bytes: u64, _workspace: u64) -> Result<()> {
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
                    crate::format::dtype::bf16_words_to_f32(words, o.info.numel()),
                )?,
            };
            tensors.push(t);
        }
        let refs: Vec<&HostTensor> = tensors.iter().collect();
        let result = match q4 {
            Some(v) => {
                let state = crate::format::bnb::QuantState {
                    json: crate::format::bnb::QuantStateJson {
                        quant_type: crate::format::bnb::QuantType::Nf4,
                        blocksize: v.blocksize as u64,
                        dtype: crate::format::bnb::FloatDtype::F32,
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
