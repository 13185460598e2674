//! Output shared by the subcommands: stdout that tolerates a closed pipe, the op profile, named
//! float32 tensors (a pipeline's intermediates).

/// Prints an op profile (slowest first) to stderr.
pub fn print_profile(p: &[(String, u64, std::time::Duration)]) {
    let total: f64 = p.iter().map(|x| x.2.as_secs_f64()).sum();
    eprintln!("op profile ({:.1} ms in ops):", total * 1e3);
    for (name, calls, t) in p.iter().take(20) {
        eprintln!(
            "  {:>9.2} ms {:>5.1}%  {:>7} calls  {:>8.1} us/call  {name}",
            t.as_secs_f64() * 1e3,
            t.as_secs_f64() * 100.0 / total.max(1e-12),
            calls,
            t.as_secs_f64() * 1e6 / (*calls).max(1) as f64
        );
    }
}

/// Writes to stdout; a closed pipe (`nibble inspect ... | head`) is not an error.
pub(crate) fn write_stdout(s: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(s.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

pub mod chart;
pub mod folder;
pub mod frames;
pub mod mp4;
pub mod paths;

/// Writes named float32 tensors (shape and values) as one safetensors file.
pub fn write_f32_tensors(
    path: &std::path::Path,
    tensors: &std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)>,
) -> anyhow::Result<()> {
    let tensors: Vec<_> = tensors
        .iter()
        .map(|(name, (shape, v))| {
            (
                name.clone(),
                nibble_core::format::dtype::Dtype::F32,
                shape.iter().map(|&d| d as u64).collect(),
                nibble_core::format::dtype::f32_to_bytes(v),
            )
        })
        .collect();
    nibble_core::format::writer::write_safetensors(path, &tensors, &Default::default())?;
    Ok(())
}

/// 8-bit RGB `[h, w, 3]` as a PNG; every write and the final flush report their errors (a full
/// disk is an error, not a truncated file and "wrote").
pub fn write_png(path: &std::path::Path, rgb: &[u8], w: usize, h: usize) -> anyhow::Result<()> {
    use anyhow::Context;
    let mut out = nibble_core::format::writer::OutputFile::create(path)?;
    let mut enc = png::Encoder::new(&mut out, w as u32, h as u32);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut writer = enc
        .write_header()
        .with_context(|| path.display().to_string())?;
    writer
        .write_image_data(rgb)
        .with_context(|| path.display().to_string())?;
    writer
        .finish()
        .with_context(|| path.display().to_string())?;
    out.finish()?;
    Ok(())
}
