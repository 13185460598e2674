//! Wan 2.1 folders in the browser: `loadPipeline(url)` opens a `WanPipeline` folder (see
//! [`crate::pipeline`]), `generateVideo(opts, onEvent)` runs the same three phases as `nibble
//! run --model WAN_FOLDER` on WebGPU, each planned before the first weight byte is read, the
//! weights fetched by Range requests; the frames reach `onEvent` as the VAE decodes them, and the
//! promise resolves to the whole video's 8-bit frames.

use nibble_core::models::pipeline::{Event, Pipeline, VaeTiling};
use nibble_core::models::wan::pipeline::WanRequest;
use nibble_core::models::wan::WanTiling;
use serde_json::{json, Value};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;

use crate::api::{from_js, js_err, settings_from, to_js, BusyGuard, Nibble};
use crate::pipeline::run_planned;

/// A whole number option, `d` when absent.
fn size(v: &Value, k: &str, d: usize) -> Result<usize, JsValue> {
    match v.get(k).filter(|x| !x.is_null()) {
        None => Ok(d),
        Some(x) => x
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| js_err(format!("{k}: {x} is not a whole number >= 0"))),
    }
}

/// `[h, w]` or one number for both, in pixels.
fn pair(v: &Value, k: &str) -> Result<Option<(usize, usize)>, JsValue> {
    let one = |x: &Value| {
        x.as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| js_err(format!("{k}: {x} is not a whole number or [h, w]")))
    };
    match v.get(k).filter(|x| !x.is_null()) {
        None => Ok(None),
        Some(Value::Array(a)) if a.len() == 2 => Ok(Some((one(&a[0])?, one(&a[1])?))),
        Some(x) => one(x).map(|n| Some((n, n))),
    }
}

/// The request from `{ prompt, negativePrompt, height, width, frames, steps, guidance,
/// maxSequenceLength, seed, vaeTiling: "auto" | "on" | "off", vaeTileSize, vaeTileStride }`
/// (defaults as `WanPipeline.__call__`'s and `nibble run`'s; tiles in pixels).
fn request_from(v: &Value) -> Result<WanRequest, JsValue> {
    let d = WanRequest::default();
    let prompt = v
        .get("prompt")
        .and_then(Value::as_str)
        .ok_or_else(|| js_err("prompt: a string is needed"))?
        .to_string();
    let guidance = match v.get("guidance").filter(|x| !x.is_null()) {
        None => d.guidance,
        Some(x) => {
            x.as_f64()
                .filter(|g| g.is_finite())
                .ok_or_else(|| js_err(format!("guidance: {x} is not a number")))? as f32
        }
    };
    let vae_tiling = match v.get("vaeTiling").and_then(Value::as_str) {
        None | Some("auto") => VaeTiling::Auto,
        Some("on") => VaeTiling::On,
        Some("off") => VaeTiling::Off,
        Some(o) => return Err(js_err(format!("vaeTiling: {o} (auto, on or off)"))),
    };
    let def = WanTiling::default();
    let vae_tile = Some(WanTiling {
        tile: pair(v, "vaeTileSize")?.unwrap_or(def.tile),
        stride: pair(v, "vaeTileStride")?.unwrap_or(def.stride),
    });
    Ok(WanRequest {
        prompt,
        negative_prompt: v
            .get("negativePrompt")
            .and_then(Value::as_str)
            .map(str::to_string),
        height: size(v, "height", d.height)?,
        width: size(v, "width", d.width)?,
        frames: size(v, "frames", d.frames)?,
        steps: size(v, "steps", d.steps)?,
        guidance,
        seed: v.get("seed").and_then(Value::as_u64).unwrap_or(0),
        max_sequence_length: size(v, "maxSequenceLength", d.max_sequence_length)?,
        vae_tiling,
        vae_tile,
        keep_video: false,
        checkpoint: None,
        resume: None,
    })
}

#[wasm_bindgen]
impl Nibble {
    /// Text to video with the loaded Wan folder: `opts` as `nibble run` on a Wan folder (see
    /// [`request_from`]) and memory settings; `on_event` gets `{ type: "plans", plans }` before
    /// the first weight byte is read, then `{ type: "phase", ... }`, `{ type: "step", ... }` and,
    /// as the VAE decodes them, `{ type: "frames", first, count, total, width, height, rgb }`.
    /// Resolves to `{ frames, width, height, rgb (Uint8Array, [frames, h, w, 3]), plans,
    /// phases, steps, weight_bytes, predicted_weight_bytes }`.
    #[wasm_bindgen(js_name = generateVideo)]
    pub fn generate_video(&self, opts: JsValue, on_event: js_sys::Function) -> js_sys::Promise {
        let (state, traffic) = (self.state.clone(), self.traffic.clone());
        let opts_v = from_js(&opts);
        future_to_promise(async move {
            let _busy = BusyGuard::take(&state)?;
            let (pipe, s, resident) = {
                let st = state.borrow();
                let p = st
                    .wan
                    .clone()
                    .ok_or_else(|| js_err("load a Wan folder first (loadPipeline)"))?;
                (
                    p,
                    settings_from(&opts_v, st.settings)?,
                    st.pipeline_resident,
                )
            };
            let resident = resident && opts_v.get("deviceBudget").is_none_or(Value::is_null);
            let req = request_from(&opts_v)?;
            let mut prepared = pipe.prepare(&req).map_err(js_err)?;
            let steps = req.steps as u64;
            let mut rgb = Vec::new();
            let r = run_planned(
                &*pipe,
                &mut prepared,
                &state,
                &traffic,
                (s, resident),
                &on_event,
                |prepared, plans| {
                    // The text encoder runs once per prompt (twice guided), the transformer once
                    // per step for both, the VAE once per latent frame.
                    let sides = 1 + u64::from(prepared.negative.is_some());
                    plans
                        .iter()
                        .map(|(phase, p)| match *phase {
                            "text encoder" => p.read_bytes(sides),
                            "transformer" => p.read_bytes(steps),
                            _ => p.read_bytes(prepared.dims.0 as u64),
                        })
                        .sum()
                },
                // The page keeps the 8-bit frames it is handed, not the float video.
                |e| {
                    if let Event::Frames { rgb: f, .. } = e {
                        rgb.extend_from_slice(f);
                    }
                },
            )
            .await?;
            let v = json!({
                "frames": r.out.frames,
                "width": r.out.width,
                "height": r.out.height,
                "plans": r.plans,
                "phases": r.phases,
                "steps": r.steps,
                "weight_bytes": r.weight_bytes,
                // A tiled decode opens one decoder per tile shape: predicted only untiled.
                "predicted_weight_bytes": if prepared.tiling.is_some() { None } else { Some(r.predicted) },
            });
            let js = to_js(&v)?;
            js_sys::Reflect::set(
                &js,
                &JsValue::from_str("rgb"),
                &js_sys::Uint8Array::from(rgb.as_slice()),
            )?;
            Ok(js)
        })
    }
}
