//! What flows through a graph: element types, shapes ([`ValueInfo`]), the logical shape of a
//! 4-bit weight ([`Q4Info`]) and host tensors ([`HostTensor`]) for inputs and outputs.

use crate::error::{Error, Result};

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElemType {
    /// f32 activations and dense weights.
    F32,
    /// u32 token ids.
    U32,
    /// A dense weight kept as the bf16 values the model stores, two per arena word (element
    /// `2i` in the low half of word `i`): only where a backend reads it directly
    /// (a backend with the host-memory capability), only as the weight of `Linear` or the table of
    /// `Embedding`, which widen each element to f32 exactly (the same results as an f32 copy,
    /// from half the bytes).
    BF16,
}

/// The most elements one value may have (2^40: 4 TiB of f32, more than any device holds); larger
/// shapes come from sizes no real model has, and are refused before anything is allocated.
pub const MAX_ELEMENTS: usize = if usize::BITS >= 64 {
    (1u64 << 40) as usize
} else {
    1 << 30
};

/// Shape and type of a value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValueInfo {
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Element type.
    pub elem: ElemType,
}

impl ValueInfo {
    /// An f32 value.
    pub fn f32(shape: &[usize]) -> Self {
        ValueInfo {
            shape: shape.to_vec(),
            elem: ElemType::F32,
        }
    }
    /// Number of elements.
    /// Number of elements (saturating: an overflowing shape counts as `usize::MAX`, which no
    /// graph accepts, see [`ValueInfo::check`]).
    pub fn numel(&self) -> usize {
        self.shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .unwrap_or(usize::MAX)
    }

    /// Refuses a shape no run can hold: an empty dimension, or more than [`MAX_ELEMENTS`]
    /// elements (a product that overflows included).
    pub fn check(&self) -> Result<()> {
        if self.shape.contains(&0) {
            return Err(Error::Invalid(format!(
                "a value of shape {:?} has an empty dimension",
                self.shape
            )));
        }
        if self.numel() > MAX_ELEMENTS {
            return Err(Error::Invalid(format!(
                "a value of shape {:?} has more than {MAX_ELEMENTS} elements",
                self.shape
            )));
        }
        Ok(())
    }
    /// Arena words it takes.
    pub fn words(&self) -> usize {
        match self.elem {
            ElemType::BF16 => self.numel().div_ceil(2),
            ElemType::F32 | ElemType::U32 => self.numel(),
        }
    }
}

/// The logical shape of a 4-bit weight input (`[N, K]` for a linear).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Q4Info {
    /// Logical shape.
    pub shape: Vec<usize>,
    /// Elements per absmax block.
    pub blocksize: usize,
}

/// Tensor data on the host.
#[derive(Debug, Clone, PartialEq)]
pub enum HostData {
    /// f32 values.
    F32(Vec<f32>),
    /// u32 values (token ids).
    U32(Vec<u32>),
}

/// A tensor on the host: shape, type and data.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Shape and type.
    pub info: ValueInfo,
    /// The values, row-major.
    pub data: HostData,
}

impl HostTensor {
    /// An f32 tensor; fails when the data does not fill the shape.
    pub fn f32(shape: &[usize], data: Vec<f32>) -> Result<Self> {
        if shape.iter().product::<usize>() != data.len() {
            return Err(Error::Invalid(format!(
                "{} values for shape {shape:?}",
                data.len()
            )));
        }
        Ok(HostTensor {
            info: ValueInfo::f32(shape),
            data: HostData::F32(data),
        })
    }

    /// A u32 tensor.
    pub fn u32(shape: &[usize], data: Vec<u32>) -> Result<Self> {
        if shape.iter().product::<usize>() != data.len() {
            return Err(Error::Invalid(format!(
                "{} values for shape {shape:?}",
                data.len()
            )));
        }
        Ok(HostTensor {
            info: ValueInfo {
                shape: shape.to_vec(),
                elem: ElemType::U32,
            },
            data: HostData::U32(data),
        })
    }

    /// The f32 values (empty for u32 tensors).
    pub fn as_f32(&self) -> &[f32] {
        match &self.data {
            HostData::F32(v) => v,
            HostData::U32(_) => &[],
        }
    }

    /// The f32 values, moved out (empty for u32 tensors).
    pub fn into_f32(self) -> Vec<f32> {
        match self.data {
            HostData::F32(v) => v,
            HostData::U32(_) => Vec::new(),
        }
    }

    /// The u32 values (empty for f32 tensors).
    pub fn as_u32(&self) -> &[u32] {
        match &self.data {
            HostData::U32(v) => v,
            HostData::F32(_) => &[],
        }
    }
}
