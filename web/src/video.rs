//! Wan 2.1 folders in the browser: `loadPipeline(url)` opens a `WanPipeline` folder (see
//! [`crate::pipeline`]), `generateVideo(opts, onEvent)` runs the same three phases as `nibble
//! run --model WAN_FOLDER` on WebGPU, each planned before the first weight byte is read, the
//! weights fetched by Range requests; the frames reach `onEvent` as the VAE decodes them, and the
//! promise resolves to the whole video's 8-bit frames.

use nibble_core::exec::ExecOptions;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::pipeline::{Pipeline, VaeTiling};
use nibble_core::models::wan::pipeline::WanRequest;
use nibble_core::models::wan::WanTiling;
use nibble_core::models::{Drive, SourceMaker};
use serde_json::{json, Value};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;

use crate::api::{
    backend_of, decide, from_js, js_err, settings_from, to_js, traffic_bytes, BusyGuard, Nibble,
};
use crate::fetch::FetchSource;
use crate::pipeline::event_js;

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
        // The page keeps the 8-bit frames it is handed (`Event::Frames`), not the float video.
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
            let mut backend = backend_of(&state).await?;
            let planned = (|| {
                let phases = pipe.budget_graphs(&prepared).map_err(js_err)?;
                let graphs: Vec<_> = phases.iter().map(|(_, g, m)| (g, *m)).collect();
                let d = decide(s, resident, &graphs, &mut backend)?;
                drop(graphs);
                drop(phases);
                let opts = ExecOptions::decided(&d, 1);
                let plans = pipe
                    .plans(&mut prepared, &mut backend, opts)
                    .map_err(js_err)?;
                Ok::<_, JsValue>((opts, plans))
            })();
            let (opts, plans) = match planned {
                Ok(x) => x,
                Err(e) => {
                    state.borrow_mut().backend = Some(backend);
                    return Err(e);
                }
            };
            let plans_v: Vec<Value> = plans.iter().map(|(phase, p)| p.phase_json(phase)).collect();
            // The text encoder runs once per prompt (twice guided), the transformer once per
            // step for both, the VAE once per latent frame.
            let sides = 1 + u64::from(prepared.negative.is_some());
            let predicted: u64 = plans
                .iter()
                .map(|(phase, p)| match *phase {
                    "text encoder" => p.read_bytes(sides),
                    "transformer" => p.read_bytes(req.steps as u64),
                    _ => p.read_bytes(prepared.dims.0 as u64),
                })
                .sum();
            if let Ok(js) = to_js(&json!({"type": "plans", "plans": plans_v})) {
                let _ = on_event.call1(&JsValue::NULL, &js);
            }
            let before = traffic_bytes(&traffic, "weights");
            let t = traffic.clone();
            let maker =
                move |m: &ModelIndex| -> SourceMaker { Box::new(FetchSource::maker(m, &t)) };
            let (mut phases, mut steps, mut rgb) = (Vec::new(), Vec::new(), Vec::new());
            let out = pipe
                .run_with(&prepared, backend, opts, &Drive::EventLoop(&maker), |e| {
                    if let nibble_core::models::pipeline::Event::Frames { rgb: f, .. } = &e {
                        rgb.extend_from_slice(f);
                    }
                    if let Ok(js) = event_js(e, &mut phases, &mut steps) {
                        let _ = on_event.call1(&JsValue::NULL, &js);
                    }
                })
                .await;
            let (out, backend) = out.map_err(js_err)?;
            state.borrow_mut().backend = Some(backend);
            let v = json!({
                "frames": out.frames,
                "width": out.width,
                "height": out.height,
                "plans": plans_v,
                "phases": phases,
                "steps": steps,
                "weight_bytes": traffic_bytes(&traffic, "weights") - before,
                // A tiled decode opens one decoder per tile shape: predicted only untiled.
                "predicted_weight_bytes": if prepared.tiling.is_some() { None } else { Some(predicted) },
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
