//! Arbitrary bytes as a safetensors file: header length, JSON, offset validation.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| nibble_core::tooling::fuzzing::safetensors_file(data));
