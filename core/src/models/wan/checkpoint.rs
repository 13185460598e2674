//! A Wan run's resumable denoising state, as the DiT's checkpoints: after every step the latent,
//! the steps done and the sampler's history (UniPC's last model outputs and the sample it
//! corrects) are written atomically into a folder; a run given that checkpoint to resume checks
//! it was made by the same request (the prompts' ids, the latent's size, the initial noise, the
//! schedule and the guidance) and continues to the same latents as an uninterrupted run.

use crate::error::{Error, Result};

/// File name of the checkpoint inside a checkpoint folder.
pub const WAN_CHECKPOINT_FILE: &str = "wan-checkpoint.safetensors";

/// What a Wan checkpoint holds.
#[derive(Debug, Clone, PartialEq)]
pub struct WanCheckpoint {
    /// Steps done.
    pub done: usize,
    /// The latent after them.
    pub latent: Vec<f32>,
    /// The sampler's state after them (named values).
    pub sampler: Vec<(String, Vec<f32>)>,
    /// The schedule.
    pub sigmas: Vec<f32>,
    /// The initial latents.
    pub x0: Vec<f32>,
    /// The request's fingerprint: prompt ids, negative ids, latent size, guidance.
    pub key: Vec<f32>,
}

impl WanCheckpoint {
    /// Refuses a checkpoint made by another request, saying what differs.
    pub fn check(&self, sigmas: &[f32], x0: &[f32], key: &[f32]) -> Result<()> {
        if self.sigmas != sigmas {
            return Err(Error::Invalid(format!(
                "the checkpoint's schedule ({} steps) is not this run's ({} steps)",
                self.sigmas.len().saturating_sub(1),
                sigmas.len().saturating_sub(1)
            )));
        }
        if self.key != key {
            return Err(Error::Invalid(
                "the checkpoint was made for another prompt, size or guidance".into(),
            ));
        }
        if self.x0 != x0 {
            return Err(Error::Invalid(
                "the checkpoint was made from other initial noise (seed)".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(feature = "native")]
impl WanCheckpoint {
    /// Writes `dir/wan-checkpoint.safetensors` atomically (a temporary file, then a rename, and
    /// the folder synced): a crash leaves the previous complete checkpoint.
    pub fn save(&self, dir: &std::path::Path) -> Result<()> {
        use crate::format::dtype::{f32_to_bytes, Dtype};
        let disp = dir.display().to_string();
        std::fs::create_dir_all(dir).map_err(|e| Error::io(disp, e))?;
        let t = |name: &str, v: &[f32]| {
            (
                name.to_string(),
                Dtype::F32,
                vec![v.len() as u64],
                f32_to_bytes(v),
            )
        };
        let mut tensors = vec![
            t("latent", &self.latent),
            t("sigmas", &self.sigmas),
            t("x0", &self.x0),
            t("key", &self.key),
        ];
        for (name, v) in &self.sampler {
            tensors.push(t(&format!("sampler.{name}"), v));
        }
        let mut meta = std::collections::BTreeMap::new();
        meta.insert("steps_done".to_string(), self.done.to_string());
        meta.insert("format".to_string(), "nibble-wan-checkpoint-1".to_string());
        let path = dir.join(WAN_CHECKPOINT_FILE);
        crate::format::writer::write_safetensors(&path, &tensors, &meta)?;
        if let Ok(f) = std::fs::File::open(dir) {
            let _ = f.sync_all();
        }
        Ok(())
    }

    /// Reads `dir/wan-checkpoint.safetensors`; `Ok(None)` when there is none yet.
    pub fn load(dir: &std::path::Path) -> Result<Option<Self>> {
        let path = dir.join(WAN_CHECKPOINT_FILE);
        if !path.is_file() {
            return Ok(None);
        }
        let m = crate::io::model::ModelIndex::open(&path)?;
        let get = |n: &str| -> Result<Vec<f32>> { m.read_f32(m.require(n)?) };
        let header = crate::io::model::read_header(&path)?;
        let bad = |msg: &str| Error::Model {
            file: path.display().to_string(),
            msg: msg.into(),
        };
        if header.metadata.get("format").map(String::as_str) != Some("nibble-wan-checkpoint-1") {
            return Err(bad("not a nibble Wan checkpoint"));
        }
        let done = header
            .metadata
            .get("steps_done")
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad("no steps_done"))?;
        let mut sampler = Vec::new();
        for e in m.tensors() {
            if let Some(name) = e.name.strip_prefix("sampler.") {
                sampler.push((name.to_string(), m.read_f32(e)?));
            }
        }
        Ok(Some(WanCheckpoint {
            done,
            latent: get("latent")?,
            sampler,
            sigmas: get("sigmas")?,
            x0: get("x0")?,
            key: get("key")?,
        }))
    }
}
