//! The graph layer: ops as data ([`OpKind`], shape inference with errors that say which input is
//! wrong), the values that flow between them ([`ValueInfo`], [`HostTensor`]) and the [`Graph`]
//! builder (programs, inputs, state values, dense and 4-bit weights in weight groups).
//!
//! Owns: what a model computes, independent of where it runs or where its weights come from.
//! May import: `error` only. Backends, the planner and the executor read graphs; a graph knows
//! nothing of them.

mod builder;
mod ops;
mod tensor;

pub(crate) use builder::Source;
pub use builder::{Graph, LowRankPath, Node, ValueId, WeightId};
pub use ops::{bf16_input_allowed, infer, OpKind, RopeMode};
pub use tensor::{ElemType, HostData, HostTensor, Q4Info, ValueInfo, MAX_ELEMENTS};
