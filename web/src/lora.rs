//! LoRA adapters in the page: the `lora` setting of `load` and `loadPipeline` (adapter URLs, each
//! with an optional `:SCALE`, as `--lora` takes them) opened through fetch and bound to the model
//! by the same core code as `nibble run --lora`.

use std::sync::Arc;

use nibble_core::io::folder::ModelFolder;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::lora::{self, AdapterArg, AdapterFolder, Target};
use nibble_core::Error;
use serde_json::Value;

use crate::fetch::{FetchFolder, SharedTraffic};

/// `model` with the adapters of `settings.lora` (`["URL[:SCALE]", ...]`, or one string of them
/// separated by commas) bound; itself without any. `settings.loraIgnoreUnmatched` skips keys for
/// other models of a pipeline, as `--lora-ignore-unmatched`.
pub(crate) async fn bind(
    model: &ModelIndex,
    settings: &Value,
    target: Target<'_>,
    traffic: &SharedTraffic,
) -> nibble_core::Result<ModelIndex> {
    Ok(bind_pipeline(&[(model, target)], settings, traffic)
        .await?
        .remove(0))
}

/// [`bind`] over the models of a pipeline, each with its target.
pub(crate) async fn bind_pipeline(
    components: &[(&ModelIndex, Target<'_>)],
    settings: &Value,
    traffic: &SharedTraffic,
) -> nibble_core::Result<Vec<ModelIndex>> {
    let list: Vec<String> = match settings.get("lora") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => s.split(',').map(|x| x.trim().to_string()).collect(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(|s| s.trim().to_string())
                    .ok_or_else(|| Error::Invalid(format!("lora: {v} is not a URL string")))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(Error::Invalid(format!(
                "lora: {other} is not a list of URLs"
            )))
        }
    };
    let args = list
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| AdapterArg::parse(s))
        .collect::<nibble_core::Result<Vec<_>>>()?;
    if args.is_empty() {
        return Ok(components.iter().map(|(m, _)| (*m).clone()).collect());
    }
    let t = traffic.clone();
    let folder_of = move |s: &str| -> nibble_core::Result<AdapterFolder> {
        let (dir, file) = lora::url_parts(s);
        let folder: Arc<dyn ModelFolder> = Arc::new(FetchFolder::new(dir, t.clone()));
        Ok((folder, file.map(str::to_string)))
    };
    let files = lora::open_args(&args, &folder_of).await?;
    let ignore = settings
        .get("loraIgnoreUnmatched")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let (bound, _) = lora::bind_pipeline(components, &files, ignore)?;
    Ok(bound)
}
