//! Running the tiny Llama fixture through the decoder, for the tests that compare its logits
//! and tokens: the execution options of a resident and of a streamed run, and a decoder at the
//! smallest budget when the options give none.

use nibble_core::backend::Backend;
use nibble_core::exec::ExecOptions;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::llama::{self, Decoder, LlamaShape};
use nibble_core::plan::Budgets;

/// Resident (1 GiB, 4 slots of 1 MiB) or streamed (every group through 2 slots of 64 KiB, the
/// device budget left to [`decoder`]).
pub fn opts(streamed: bool) -> ExecOptions {
    let budgets = if streamed {
        Budgets {
            device_bytes: 0,
            ring_slots: 2,
            slot_bytes: 64 << 10,
            host_tier_bytes: 0,
        }
    } else {
        Budgets {
            device_bytes: 1 << 30,
            ring_slots: 4,
            slot_bytes: 1 << 20,
            host_tier_bytes: 0,
        }
    };
    ExecOptions {
        budgets,
        readers: 2,
        stream_all: streamed,
        naive: false,
    }
}

/// A decoder for `shape`; at the smallest budget (every layer streamed) when `o` has none.
pub fn decoder<B: Backend>(
    m: &ModelIndex,
    make: &mut impl FnMut() -> B,
    shape: LlamaShape,
    o: ExecOptions,
) -> Decoder<B> {
    let lg = llama::build(m, shape).expect("graph");
    let mut o = o;
    if o.budgets.device_bytes == 0 {
        o.budgets.device_bytes =
            nibble_core::plan::min_device_bytes(&lg.graph, m, &mut make()).expect("min budget");
    }
    Decoder::from_graph(lg, m, make(), o).expect("decoder")
}

/// The logits of every position of `tokens` in one prefill pass.
pub fn all_logits(tokens: usize) -> LlamaShape {
    LlamaShape {
        prompt: tokens,
        capacity: tokens,
        all_logits: true,
        hidden_states: false,
    }
}
