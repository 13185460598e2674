//! Malformed files: each one must be refused with its own specific error naming the file (and
//! tensor and offset where they apply), never a panic.

use nibble_core::error::{Error, QuantProblem};
use nibble_core::format::bnb::{FloatDtype, QuantType};
use nibble_core::format::quantize::{quantize_4bit, QuantizeOptions};
use nibble_core::io::model::ModelIndex;
use nibble_tests::build::*;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

fn open(path: &std::path::Path) -> Error {
    match ModelIndex::open(path) {
        Ok(_) => panic!("{} was accepted", path.display()),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains(&path.display().to_string()),
                "error does not name the file: {msg}"
            );
            e
        }
    }
}

fn good_tensors() -> Vec<RawEntry> {
    vec![
        f32_entry("a.weight", &[2, 3], &random_values(6, 1)),
        f32_entry("b.bias", &[4], &random_values(4, 2)),
    ]
}

#[test]
fn file_shorter_than_header_length_field() {
    let d = tmp();
    let p = d.path().join("short.safetensors");
    std::fs::write(&p, [1u8, 2, 3]).expect("write");
    assert!(matches!(open(&p), Error::FileTooShort { len: 3, .. }));
}

#[test]
fn header_length_past_end_of_file() {
    let d = tmp();
    let p = d.path().join("past.safetensors");
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&p, bytes).expect("write");
    assert!(matches!(
        open(&p),
        Error::HeaderPastEof {
            header_len: 1000,
            file_len: 10,
            ..
        }
    ));
}

#[test]
fn absurd_header_length() {
    let d = tmp();
    let p = d.path().join("huge.safetensors");
    let mut bytes = u64::MAX.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&p, bytes).expect("write");
    assert!(matches!(open(&p), Error::HeaderTooLarge { .. }));
}

#[test]
fn garbage_json_header() {
    let d = tmp();
    let p = d.path().join("garbage.safetensors");
    write_raw(&p, "{\"a\": [1, 2", &[]);
    let e = open(&p);
    assert!(matches!(e, Error::HeaderJson { .. }), "{e}");
}

#[test]
fn header_that_is_not_an_object() {
    let d = tmp();
    let p = d.path().join("array.safetensors");
    write_raw(&p, "[1, 2, 3]", &[]);
    match open(&p) {
        Error::HeaderJson { msg, .. } => assert!(msg.contains("not a JSON object"), "{msg}"),
        e => panic!("{e}"),
    }
}

#[test]
fn metadata_that_is_not_a_string_map() {
    let d = tmp();
    let p = d.path().join("meta.safetensors");
    write_raw(&p, r#"{"__metadata__": {"format": 3}}"#, &[]);
    match open(&p) {
        Error::HeaderJson { msg, .. } => assert!(msg.contains("__metadata__"), "{msg}"),
        e => panic!("{e}"),
    }
}

#[test]
fn unknown_dtype() {
    let d = tmp();
    let p = d.path().join("dtype.safetensors");
    write_raw(
        &p,
        r#"{"t": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}}"#,
        &[0, 0],
    );
    match open(&p) {
        Error::BadTensorEntry { tensor, .. } => assert_eq!(tensor, "t"),
        e => panic!("{e}"),
    }
}

#[test]
fn offsets_past_end_of_file() {
    let d = tmp();
    let p = d.path().join("offsets.safetensors");
    let h = r#"{"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}"#;
    write_raw(&p, h, &[0; 8]);
    match open(&p) {
        Error::OffsetOutOfRange {
            tensor,
            offset,
            end,
            file_len,
            ..
        } => {
            assert_eq!(tensor, "t");
            assert_eq!(file_len, 8 + h.len() as u64 + 8);
            assert_eq!(end, offset + 16);
        }
        e => panic!("{e}"),
    }
}

#[test]
fn truncated_data() {
    let d = tmp();
    let p = d.path().join("trunc.safetensors");
    build_file(&p, &good_tensors());
    let bytes = std::fs::read(&p).expect("read");
    std::fs::write(&p, &bytes[..bytes.len() - 5]).expect("truncate");
    match open(&p) {
        Error::OffsetOutOfRange { tensor, .. } => assert_eq!(tensor, "b.bias"),
        e => panic!("{e}"),
    }
}

#[test]
fn overlapping_offsets() {
    let d = tmp();
    let p = d.path().join("overlap.safetensors");
    let h = r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
               "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}"#;
    write_raw(&p, h, &[0; 12]);
    match open(&p) {
        Error::OffsetOverlap {
            tensor,
            other,
            other_end,
            offset,
            ..
        } => {
            assert_eq!((tensor.as_str(), other.as_str()), ("b", "a"));
            assert_eq!(other_end - offset, 4, "4 shared bytes");
        }
        e => panic!("{e}"),
    }
}

#[test]
fn gap_between_tensors() {
    let d = tmp();
    let p = d.path().join("gap.safetensors");
    let h = r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
               "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}"#;
    write_raw(&p, h, &[0; 12]);
    match open(&p) {
        Error::OffsetGap { tensor, len, .. } => assert_eq!((tensor.as_str(), len), ("b", 4)),
        e => panic!("{e}"),
    }
}

#[test]
fn trailing_bytes_after_last_tensor() {
    let d = tmp();
    let p = d.path().join("trailing.safetensors");
    write_raw(
        &p,
        r#"{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}"#,
        &[0; 5],
    );
    match open(&p) {
        Error::OffsetGap { tensor, len, .. } => {
            assert_eq!((tensor.as_str(), len), ("<end of file>", 3))
        }
        e => panic!("{e}"),
    }
}

#[test]
fn byte_length_not_shape_times_dtype() {
    let d = tmp();
    let p = d.path().join("len.safetensors");
    write_raw(
        &p,
        r#"{"t": {"dtype": "BF16", "shape": [3, 3], "data_offsets": [0, 16]}}"#,
        &[0; 16],
    );
    match open(&p) {
        Error::ByteLengthMismatch {
            tensor,
            expected,
            actual,
            ..
        } => {
            assert_eq!((tensor.as_str(), expected, actual), ("t", 18, 16))
        }
        e => panic!("{e}"),
    }
}

#[test]
fn shape_product_overflows() {
    let d = tmp();
    let p = d.path().join("overflow.safetensors");
    let h =
        r#"{"t": {"dtype": "F32", "shape": [4294967296, 4294967296, 16], "data_offsets": [0, 0]}}"#;
    write_raw(&p, h, &[]);
    match open(&p) {
        Error::ShapeOverflow { tensor, shape, .. } => {
            assert_eq!(tensor, "t");
            assert_eq!(shape.len(), 3);
        }
        e => panic!("{e}"),
    }
}

#[test]
fn reversed_offsets() {
    let d = tmp();
    let p = d.path().join("reversed.safetensors");
    write_raw(
        &p,
        r#"{"t": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}}"#,
        &[0; 4],
    );
    match open(&p) {
        Error::BadTensorEntry { msg, .. } => {
            assert!(msg.contains("end before they begin"), "{msg}")
        }
        e => panic!("{e}"),
    }
}

#[test]
fn file_truncated_after_open_is_a_short_read() {
    let d = tmp();
    let p = d.path().join("later.safetensors");
    build_file(&p, &good_tensors());
    let model = ModelIndex::open(&p).expect("valid at open");
    let bytes = std::fs::read(&p).expect("read");
    std::fs::write(&p, &bytes[..bytes.len() - 4]).expect("truncate");
    let e = model
        .read_bytes(model.require("b.bias").expect("b"))
        .expect_err("short read");
    match e {
        Error::ShortRead {
            tensor,
            wanted,
            got,
            ..
        } => assert_eq!((tensor.as_str(), wanted, got), ("b.bias", 16, 12)),
        e => panic!("{e}"),
    }
}

#[test]
fn shard_index_naming_a_tensor_no_shard_holds() {
    let d = tmp();
    build_file(
        &d.path().join("model-00001-of-00001.safetensors"),
        &good_tensors(),
    );
    let idx = r#"{"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00001.safetensors",
                  "ghost.weight": "model-00001-of-00001.safetensors"}}"#;
    std::fs::write(d.path().join("model.safetensors.index.json"), idx).expect("write");
    match open(d.path()) {
        Error::Model { msg, .. } => assert!(msg.contains("ghost.weight"), "{msg}"),
        e => panic!("{e}"),
    }
}

#[test]
fn shard_index_pointing_outside_the_folder() {
    let d = tmp();
    let idx = r#"{"weight_map": {"a.weight": "../elsewhere.safetensors"}}"#;
    std::fs::write(d.path().join("model.safetensors.index.json"), idx).expect("write");
    match open(d.path()) {
        Error::Model { msg, .. } => assert!(msg.contains("not a file in the folder"), "{msg}"),
        e => panic!("{e}"),
    }
}

// ---- 4-bit quant state -------------------------------------------------------------------

/// A valid double-quantized NF4 weight as raw entries (37 x 53: odd count, partial last block).
fn quant_entries(double_quant: bool) -> Vec<RawEntry> {
    let w = random_values(37 * 53, 7);
    let opts = QuantizeOptions {
        quant_type: QuantType::Nf4,
        blocksize: 64,
        double_quant,
    };
    let q = quantize_4bit(&w, &[37, 53], FloatDtype::F32, opts).expect("quantize");
    q.tensors("l.weight")
        .into_iter()
        .map(|(n, d, s, b)| (n, nibble_core::format::dtype::dtype_name(d), s, b))
        .collect()
}

fn quant_error(entries: &[RawEntry]) -> QuantProblem {
    let d = tmp();
    let p = d.path().join("q.safetensors");
    build_file(&p, entries);
    let model = ModelIndex::open(&p).expect("the container itself is valid");
    let result = model.q4_weights().map(<[_]>::to_vec).and_then(|ws| {
        ws.iter()
            .map(|k| model.quant_state(k))
            .collect::<Result<Vec<_>, _>>()
    });
    match result {
        Err(Error::Quant {
            tensor,
            problem,
            file,
        }) => {
            assert_eq!(tensor, "l.weight");
            assert!(file.contains("q.safetensors"));
            problem
        }
        Err(e) => panic!("unexpected error kind: {e}"),
        Ok(_) => panic!("malformed quant state accepted"),
    }
}

fn replace(entries: &mut [RawEntry], suffix: &str, f: impl FnOnce(&mut RawEntry)) {
    let e = entries
        .iter_mut()
        .find(|e| e.0.ends_with(suffix))
        .expect("entry");
    f(e);
}

fn set_json(entries: &mut [RawEntry], json: &str) {
    replace(entries, "bitsandbytes__nf4", |e| {
        e.2 = vec![json.len() as u64];
        e.3 = json.as_bytes().to_vec();
    });
}

#[test]
fn valid_quant_states_load() {
    for dq in [false, true] {
        let d = tmp();
        let p = d.path().join("ok.safetensors");
        build_file(&p, &quant_entries(dq));
        let model = ModelIndex::open(&p).expect("open");
        let ws = model.q4_weights().map(<[_]>::to_vec).expect("find");
        let s = model.quant_state(&ws[0]).expect("load");
        assert_eq!(s.json.shape, vec![37, 53]);
        assert_eq!(s.absmax.len(), 31);
    }
}

#[test]
fn absmax_with_wrong_block_count() {
    let mut e = quant_entries(false);
    replace(&mut e, ".absmax", |t| {
        t.2 = vec![30];
        t.3.truncate(30 * 4);
    });
    assert_eq!(
        quant_error(&e),
        QuantProblem::WrongCount {
            component: "absmax",
            expected: 31,
            actual: 30
        }
    );
}

#[test]
fn missing_absmax() {
    let mut e = quant_entries(false);
    e.retain(|t| !t.0.ends_with(".absmax"));
    assert_eq!(quant_error(&e), QuantProblem::MissingComponent("absmax"));
}

#[test]
fn missing_quant_map() {
    let mut e = quant_entries(true);
    e.retain(|t| !t.0.ends_with(".quant_map") || t.0.ends_with("nested_quant_map"));
    assert_eq!(quant_error(&e), QuantProblem::MissingComponent("quant_map"));
}

#[test]
fn unknown_quant_type() {
    let mut e = quant_entries(false);
    set_json(
        &mut e,
        r#"{"quant_type": "nf5", "blocksize": 64, "dtype": "float32", "shape": [37, 53]}"#,
    );
    assert_eq!(
        quant_error(&e),
        QuantProblem::UnknownQuantType("nf5".into())
    );
}

#[test]
fn blocksize_not_a_power_of_two() {
    let mut e = quant_entries(false);
    set_json(
        &mut e,
        r#"{"quant_type": "nf4", "blocksize": 48, "dtype": "float32", "shape": [37, 53]}"#,
    );
    assert_eq!(
        quant_error(&e),
        QuantProblem::BadBlocksize {
            field: "blocksize",
            value: 48
        }
    );
}

#[test]
fn blocksize_out_of_range() {
    let mut e = quant_entries(false);
    set_json(
        &mut e,
        r#"{"quant_type": "nf4", "blocksize": 8192, "dtype": "float32", "shape": [37, 53]}"#,
    );
    assert_eq!(
        quant_error(&e),
        QuantProblem::BadBlocksize {
            field: "blocksize",
            value: 8192
        }
    );
}

#[test]
fn quant_state_blob_is_not_json() {
    let mut e = quant_entries(false);
    set_json(&mut e, "\u{1}\u{2}not json");
    assert!(matches!(quant_error(&e), QuantProblem::BadJson(_)));
}

#[test]
fn quant_state_missing_shape() {
    let mut e = quant_entries(false);
    set_json(
        &mut e,
        r#"{"quant_type": "nf4", "blocksize": 64, "dtype": "float32"}"#,
    );
    assert_eq!(
        quant_error(&e),
        QuantProblem::BadJson("missing field 'shape'".into())
    );
}

#[test]
fn unknown_recorded_dtype() {
    let mut e = quant_entries(false);
    set_json(
        &mut e,
        r#"{"quant_type": "nf4", "blocksize": 64, "dtype": "float64", "shape": [37, 53]}"#,
    );
    assert_eq!(
        quant_error(&e),
        QuantProblem::UnknownDtype("float64".into())
    );
}

#[test]
fn logical_shape_overflows() {
    let mut e = quant_entries(false);
    set_json(
        &mut e,
        r#"{"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [4294967296, 4294967296, 2]}"#,
    );
    assert_eq!(quant_error(&e), QuantProblem::ShapeOverflow);
}

#[test]
fn packed_bytes_do_not_match_logical_shape() {
    let mut e = quant_entries(false);
    // 37 x 54 = 1998 elements: 999 packed bytes and 32 blocks; the file has 981 and 31.
    set_json(
        &mut e,
        r#"{"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [37, 54]}"#,
    );
    assert_eq!(
        quant_error(&e),
        QuantProblem::WrongCount {
            component: "absmax",
            expected: 32,
            actual: 31
        }
    );
    let mut e = quant_entries(false);
    set_json(
        &mut e,
        r#"{"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [36, 54]}"#,
    );
    assert_eq!(
        quant_error(&e),
        QuantProblem::WrongCount {
            component: "packed weight (bytes)",
            expected: 972,
            actual: 981
        }
    );
}

#[test]
fn nested_absmax_without_nested_quant_map() {
    let mut e = quant_entries(true);
    e.retain(|t| !t.0.ends_with(".nested_quant_map"));
    assert!(matches!(
        quant_error(&e),
        QuantProblem::InconsistentNesting(_)
    ));
}

#[test]
fn nested_fields_without_nested_tensors() {
    let mut e = quant_entries(false);
    set_json(
        &mut e,
        r#"{"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [37, 53], "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.5}"#,
    );
    assert!(matches!(
        quant_error(&e),
        QuantProblem::InconsistentNesting(_)
    ));
}

#[test]
fn quant_map_with_wrong_length() {
    let mut e = quant_entries(false);
    replace(&mut e, ".quant_map", |t| {
        t.2 = vec![15];
        t.3.truncate(60);
    });
    assert_eq!(
        quant_error(&e),
        QuantProblem::WrongCount {
            component: "quant_map",
            expected: 16,
            actual: 15
        }
    );
}

#[test]
fn absmax_with_wrong_dtype() {
    let mut e = quant_entries(false);
    replace(&mut e, ".absmax", |t| {
        t.1 = "I32".into();
    });
    assert!(matches!(
        quant_error(&e),
        QuantProblem::WrongDtype {
            component: "absmax",
            ..
        }
    ));
}

#[test]
fn key_suffix_and_json_disagree_on_quant_type() {
    let mut e = quant_entries(false);
    set_json(
        &mut e,
        r#"{"quant_type": "fp4", "blocksize": 64, "dtype": "float32", "shape": [37, 53]}"#,
    );
    assert!(
        matches!(quant_error(&e), QuantProblem::UnknownQuantType(m) if m.contains("key says nf4"))
    );
}

/// A copy of a fixture's model folder (files and sub-folders) with `edit` applied to the JSON
/// file `json` in it.
fn edited_copy(
    fixture_model: &str,
    json: &str,
    edit: impl FnOnce(&mut serde_json::Value),
) -> tempfile::TempDir {
    fn copy(from: &std::path::Path, to: &std::path::Path) {
        std::fs::create_dir_all(to).expect("dir");
        for e in std::fs::read_dir(from).expect("read dir") {
            let p = e.expect("entry").path();
            let t = to.join(p.file_name().expect("name"));
            if p.is_dir() {
                copy(&p, &t);
            } else {
                std::fs::copy(&p, &t).expect("copy");
            }
        }
    }
    let d = tmp();
    copy(&nibble_tests::fixture(fixture_model), d.path());
    let p = d.path().join(json);
    let mut v = nibble_tests::read_json(&p);
    edit(&mut v);
    std::fs::write(&p, serde_json::to_vec(&v).expect("json")).expect("write");
    d
}

/// The error of reading `what` from the edited copy; it must name the file and contain `field`.
fn config_error(
    d: &tempfile::TempDir,
    file: &str,
    field: &str,
    what: impl FnOnce(&ModelIndex) -> Result<(), Error>,
) {
    let m = ModelIndex::open(d.path()).expect("the weights are fine");
    let e = what(&m).expect_err(field).to_string();
    let path = d.path().join(file).display().to_string();
    assert!(e.contains(&path), "the error names {path}: {e}");
    assert!(e.contains(field), "the error names {field}: {e}");
}

#[test]
fn llama_configs_with_wrong_types_and_sizes_are_refused_naming_the_field() {
    use nibble_core::models::llama::{self, LlamaConfig, LlamaShape};
    type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "rms_norm_eps",
            Box::new(|c| c["rms_norm_eps"] = "1e-6".into()),
        ),
        (
            "rms_norm_eps",
            Box::new(|c| c["rms_norm_eps"] = (-1.0).into()),
        ),
        ("hidden_size", Box::new(|c| c["hidden_size"] = (-64).into())),
        (
            "num_hidden_layers",
            Box::new(|c| c["num_hidden_layers"] = 0.into()),
        ),
        (
            "num_attention_heads",
            Box::new(|c| {
                c.as_object_mut().expect("object").remove("head_dim");
                c["num_attention_heads"] = 3.into();
                c["num_key_value_heads"] = 3.into();
            }),
        ),
        (
            "num_key_value_heads",
            Box::new(|c| c["num_key_value_heads"] = 3.into()),
        ),
        (
            "eos_token_id",
            Box::new(|c| c["eos_token_id"] = ((1u64 << 32) + 102).into()),
        ),
        (
            "rope_theta",
            Box::new(|c| c["rope_parameters"]["rope_theta"] = 0.0.into()),
        ),
        (
            "rope_scaling.factor",
            Box::new(|c| {
                c["rope_parameters"]["rope_type"] = "linear".into();
                c["rope_parameters"]["factor"] = 0.0.into();
            }),
        ),
        ("hidden_act", Box::new(|c| c["hidden_act"] = "relu".into())),
    ];
    for (field, edit) in cases {
        let d = edited_copy("tiny-llama-nf4/model", "config.json", edit);
        config_error(&d, "config.json", field, |m| LlamaConfig::of(m).map(drop));
        // The graph builder reads the same config and refuses the same way.
        config_error(&d, "config.json", field, |m| {
            llama::build(m, LlamaShape::generate(2, 2)).map(drop)
        });
    }
}

#[test]
fn quantization_the_planner_cannot_run_is_refused() {
    use nibble_core::backend::cpu_ref::CpuRefBackend;
    use nibble_core::models::llama::{self, LlamaShape};
    let d = edited_copy("tiny-llama-nf4/model", "config.json", |c| {
        c["quantization_config"]["load_in_8bit"] = true.into();
    });
    config_error(&d, "config.json", "load_in_8bit", |m| {
        let g = llama::build(m, LlamaShape::generate(2, 2))?;
        nibble_core::plan::min_device_bytes(&g.graph, m, &mut CpuRefBackend::new()).map(drop)
    });
}

#[test]
fn dit_and_bert_configs_with_wrong_types_are_refused_naming_the_field() {
    use nibble_core::models::bert::BertConfig;
    use nibble_core::models::dit::DitConfig;
    let d = edited_copy("tiny-dit-nf4/model", "config.json", |c| {
        c["axes_dims_rope"] = serde_json::json!([2, 2, 2]);
    });
    config_error(&d, "config.json", "axes_dims_rope", |m| {
        DitConfig::of(m).map(drop)
    });
    let d = edited_copy("tiny-dit-nf4/model", "config.json", |c| {
        c["num_layers"] = "2".into();
    });
    config_error(&d, "config.json", "num_layers", |m| {
        DitConfig::of(m).map(drop)
    });
    let d = edited_copy("minilm-nf4/model", "config.json", |c| {
        c["hidden_size"] = "384".into();
    });
    config_error(&d, "config.json", "hidden_size", |m| {
        BertConfig::of(m).map(drop)
    });
}

#[test]
fn sentence_transformers_files_cannot_lead_outside_the_model_folder() {
    use nibble_core::models::bert::Pooling;
    for path in ["../../etc", "/etc", "%2e%2e/%2e%2e/x"] {
        let d = edited_copy("minilm-nf4/model", "modules.json", |m| {
            for module in m.as_array_mut().expect("list") {
                if module["type"]
                    .as_str()
                    .is_some_and(|t| t.ends_with(".Pooling"))
                {
                    module["path"] = path.into();
                }
            }
        });
        let m = ModelIndex::open(d.path()).expect("open");
        let e = Pooling::for_model(&m).expect_err(path).to_string();
        assert!(e.contains("inside the model folder"), "{path}: {e}");
    }
    let d = edited_copy("minilm-nf4/model", "1_Pooling/config.json", |c| {
        c["pooling_mode_mean_tokens"] = "yes".into();
    });
    config_error(
        &d,
        "1_Pooling/config.json",
        "pooling_mode_mean_tokens",
        |m| Pooling::for_model(m).map(drop),
    );
}

/// Fault class 4: sizes from config.json are checked against what the file holds and against
/// overflow before anything is allocated or looped over.
#[test]
fn config_sizes_no_file_backs_are_refused_at_once() {
    use nibble_core::models::dit;
    use nibble_core::models::llama::{self, LlamaShape};
    let t0 = std::time::Instant::now();
    type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;
    let llama_cases: Vec<(&str, Edit)> = vec![
        (
            "num_hidden_layers",
            Box::new(|c| c["num_hidden_layers"] = 1_000_000_000_000_000_000u64.into()),
        ),
        (
            "num_hidden_layers",
            Box::new(|c| c["num_hidden_layers"] = 1_000_000_000_000_000u64.into()),
        ),
        (
            "num_hidden_layers",
            Box::new(|c| c["num_hidden_layers"] = 3.into()),
        ),
        (
            "head_dim",
            Box::new(|c| c["head_dim"] = ((1u64 << 62) + 8).into()),
        ),
        (
            "vocab_size",
            Box::new(|c| c["vocab_size"] = (1u64 << 40).into()),
        ),
    ];
    for (field, edit) in llama_cases {
        let d = edited_copy("tiny-llama-nf4/model", "config.json", edit);
        config_error(&d, "config.json", field, |m| {
            llama::build(m, LlamaShape::generate(2, 2)).map(drop)
        });
    }
    let dit_cases: Vec<(&str, Edit)> = vec![
        (
            "axes_dims_rope",
            Box::new(|c| {
                c["axes_dims_rope"] = serde_json::json!([1u64 << 63, 1u64 << 63, 16]);
            }),
        ),
        (
            "num_layers",
            Box::new(|c| c["num_layers"] = 1_000_000_000_000_000_000u64.into()),
        ),
        (
            "num_single_layers",
            Box::new(|c| c["num_single_layers"] = 1000.into()),
        ),
    ];
    for (field, edit) in dit_cases {
        let d = edited_copy("tiny-dit-nf4/model", "config.json", edit);
        config_error(&d, "config.json", field, |m| dit::build(m, 4, 2).map(drop));
    }
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(20),
        "refused at once, not after looping: {:?}",
        t0.elapsed()
    );
}

/// Fault class 5: a quant-state component declared far larger than its weight needs (a sparse
/// file of 64 GiB) is refused from the header, before anything is allocated; and no tensor is
/// read whole when it is larger than the memory available.
#[test]
fn huge_declared_components_are_refused_before_allocation() {
    let d = tmp();
    let p = d.path().join("q.safetensors");
    let mut entries = quant_entries(false);
    let huge: u64 = 64 << 30;
    // absmax declared as 16 Gi f32 (64 GiB), placed last so that the file can be sparse.
    let i = entries
        .iter()
        .position(|e| e.0.ends_with(".absmax"))
        .expect("absmax");
    let absmax = entries.remove(i);
    let (mut header, data) = header_and_data(&entries);
    let start = data.len() as u64;
    let obj = header
        .trim_end()
        .strip_suffix('}')
        .expect("a JSON object")
        .to_string();
    header = format!(
        "{obj},\"{}\":{{\"dtype\":\"F32\",\"shape\":[{}],\"data_offsets\":[{start},{}]}}}}",
        absmax.0,
        huge / 4,
        start + huge
    );
    write_raw(&p, &header, &data);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .expect("open");
    f.set_len(8 + header.len() as u64 + start + huge)
        .expect("sparse file");
    let model = ModelIndex::open(&p).expect("the container itself is valid");
    let k = model.q4_weights().expect("keys")[0].clone();
    match model.quant_state(&k) {
        Err(Error::Quant {
            problem: QuantProblem::WrongCount { component, .. },
            ..
        }) => assert_eq!(component, "absmax"),
        other => panic!("expected a wrong absmax count, got {other:?}"),
    }
    let e = model
        .read_bytes(model.require(&absmax.0).expect("entry"))
        .expect_err("64 GiB");
    assert!(e.to_string().contains("available"), "{e}");
}
