//! Every `shaders/*.wgsl` parses and validates with naga, without a GPU; and every file is one
//! embedded kernel whose entry point is named after the file. The same for the roofline's peak
//! shaders (`shaders/peaks/`).

use nibble_wgpu::{shader_source, PEAK_SHADERS, SHADERS};

#[test]
fn every_shader_validates_with_naga() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .expect("shaders folder")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".wgsl") && n != "common.wgsl")
        .collect();
    files.sort();
    let embedded: Vec<String> = SHADERS.iter().map(|(n, _)| format!("{n}.wgsl")).collect();
    assert_eq!(
        files, embedded,
        "every shader file is embedded, and nothing else"
    );
    let peaks = PEAK_SHADERS.iter().map(|(n, src)| {
        (
            *n,
            src.to_string(),
            dir.join("peaks").join(format!("{n}.wgsl")),
        )
    });
    let kernels = SHADERS.iter().map(|(n, _)| {
        let src = shader_source(n).expect("source");
        (*n, src, dir.join(format!("{n}.wgsl")))
    });
    for (name, src, path) in kernels.chain(peaks) {
        assert!(path.is_file(), "{}", path.display());
        let module = match naga::front::wgsl::parse_str(&src) {
            Ok(m) => m,
            Err(e) => panic!(
                "{}",
                e.emit_to_string_with_path(&src, &path.display().to_string())
            ),
        };
        let mut v = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::empty(),
        );
        if let Err(e) = v.validate(&module) {
            panic!(
                "{}",
                e.emit_to_string_with_path(&src, &path.display().to_string())
            );
        }
        assert!(
            module.entry_points.iter().any(|ep| ep.name == name),
            "{name}.wgsl has no entry point named {name}"
        );
    }
}
