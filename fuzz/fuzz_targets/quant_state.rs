//! Arbitrary bytes as a bitsandbytes quant state (JSON blob, NUL, absmax, nested absmax,
//! packed codes): parse, validate, dequantize with both paths.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| nibble_core::tooling::fuzzing::quant_state(data));
