//! Flux pipeline folders in the browser: `loadPipeline(url)` opens a diffusers folder through
//! the same routine as `nibble run --model URL` (configs, tokenizers, the four models' headers
//! and quant states), `generateImage(opts, onEvent)` runs the same four phases on WebGPU, each
//! planned before the first weight byte is read, weights fetched by Range requests, and resolves
//! to the 8-bit RGB image.

use std::rc::Rc;
use std::sync::Arc;

use nibble_core::exec::ExecOptions;
use nibble_core::io::folder::ModelFolder;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::flux::noise::NoiseMath;
use nibble_core::models::flux::pipeline::{FluxPipeline, FluxRequest, Noise, VaeTiling};
use nibble_core::models::pipeline::{Event, Pipeline};
use nibble_core::models::{Drive, SourceMaker};
use serde_json::{json, Value};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;
use web_time::Instant;

use crate::api::{
    backend_of, decide, from_js, js_err, settings_from, to_js, traffic_bytes, BusyGuard, Nibble,
    Settings,
};
use crate::fetch::{FetchFolder, FetchSource};

/// A whole number option, `d` when absent.
fn uint(v: &Value, k: &str, d: u64) -> Result<u64, JsValue> {
    match v.get(k).filter(|x| !x.is_null()) {
        None => Ok(d),
        Some(x) => x
            .as_u64()
            .ok_or_else(|| js_err(format!("{k}: {x} is not a whole number >= 0"))),
    }
}

/// The request from `{ prompt, height, width, steps, guidance, maxSequenceLength, seed,
/// torchNoise: "avx2" | "scalar", vaeTiling: "auto" | "on" | "off", vaeTileSize }` (defaults
/// as diffusers' `FluxPipeline.__call__`, as `nibble run`'s).
fn request_from(v: &Value) -> Result<FluxRequest, JsValue> {
    let prompt = v
        .get("prompt")
        .and_then(Value::as_str)
        .ok_or_else(|| js_err("prompt: a string is needed"))?
        .to_string();
    let guidance = match v.get("guidance").filter(|x| !x.is_null()) {
        None => 3.5,
        Some(x) => {
            x.as_f64()
                .filter(|g| g.is_finite())
                .ok_or_else(|| js_err(format!("guidance: {x} is not a number")))? as f32
        }
    };
    let math = match v.get("torchNoise").and_then(Value::as_str) {
        None | Some("avx2") => NoiseMath::AvxMathfun,
        Some("scalar") => NoiseMath::Libm,
        Some(o) => return Err(js_err(format!("torchNoise: {o} (avx2 or scalar)"))),
    };
    let vae_tiling = match v.get("vaeTiling").and_then(Value::as_str) {
        None | Some("auto") => VaeTiling::Auto,
        Some("on") => VaeTiling::On,
        Some("off") => VaeTiling::Off,
        Some(o) => return Err(js_err(format!("vaeTiling: {o} (auto, on or off)"))),
    };
    let size = |k: &str, d: u64| -> Result<usize, JsValue> {
        usize::try_from(uint(v, k, d)?).map_err(|_| js_err(format!("{k}: too large")))
    };
    let vae_tile = match v.get("vaeTileSize").filter(|x| !x.is_null()) {
        None => None,
        Some(_) => Some(size("vaeTileSize", 0)?),
    };
    Ok(FluxRequest {
        prompt,
        height: size("height", 1024)?,
        width: size("width", 1024)?,
        steps: size("steps", 28)?,
        guidance,
        max_sequence_length: size("maxSequenceLength", 512)?,
        noise: Noise::Seed(uint(v, "seed", 0)?, math),
        vae_tiling,
        vae_tile,
    })
}

/// A pipeline folder's models readied (the graph builders and the planner read the quant states
/// synchronously) and described: `{ url, kind, components, bytes, open_ms, open_bytes }`.
async fn loaded(
    url: &str,
    kind: &str,
    models: &[(&str, &ModelIndex)],
    t0: Instant,
    traffic: &crate::fetch::SharedTraffic,
) -> Result<Value, JsValue> {
    for (_, m) in models {
        m.load_quant_states().await.map_err(js_err)?;
    }
    let components: Vec<Value> = models
        .iter()
        .map(|(name, m)| json!({"name": name, "bytes": m.file_bytes(), "tensors": m.len()}))
        .collect();
    Ok(json!({
        "url": url,
        "kind": kind,
        "components": components,
        "bytes": models.iter().map(|(_, m)| m.file_bytes()).sum::<u64>(),
        "open_ms": t0.elapsed().as_secs_f64() * 1e3,
        "open_bytes": traffic_bytes(traffic, "header") + traffic_bytes(traffic, "quant-state"),
    }))
}

/// A run's event for JavaScript (`phases` and `steps` keep the phase and step rows): `{ type:
/// "phase" | "step" | "frames", ... }`; frames carry `rgb` (a Uint8Array `[n, h, w, 3]`).
pub(crate) fn event_js(
    e: Event<'_>,
    phases: &mut Vec<Value>,
    steps: &mut Vec<Value>,
) -> Result<JsValue, JsValue> {
    let v = match e {
        Event::PhaseStart { phase } => json!({"type": "phase", "phase": phase, "state": "start"}),
        Event::Cached { phase } => json!({"type": "phase", "phase": phase, "state": "cached"}),
        Event::PhaseDone {
            phase,
            ms,
            bytes_streamed,
        } => {
            let v = json!({"type": "phase", "phase": phase, "state": "done",
                           "ms": ms, "bytes_streamed": bytes_streamed});
            phases.push(v.clone());
            v
        }
        Event::Step {
            step,
            steps: n,
            info,
        } => {
            let v = json!({"type": "step", "step": step, "steps": n,
                "wall_ms": info.wall.as_secs_f64() * 1e3,
                "bytes_streamed": info.stats.stream.bytes,
                "stall_ms": info.stats.stream.stall.as_secs_f64() * 1e3});
            steps.push(v.clone());
            v
        }
        Event::Frames {
            first,
            total,
            width,
            height,
            rgb,
        } => {
            let v = json!({"type": "frames", "first": first, "total": total,
                "count": rgb.len() / (width * height * 3).max(1), "width": width, "height": height});
            let js = to_js(&v)?;
            js_sys::Reflect::set(
                &js,
                &JsValue::from_str("rgb"),
                &js_sys::Uint8Array::from(rgb),
            )?;
            return Ok(js);
        }
    };
    to_js(&v)
}

/// What [`run_planned`] gives: the output, its plans (JSON), the phase and step rows, the weight
/// bytes fetched and the plans' prediction of them.
pub(crate) struct Ran<O> {
    pub(crate) out: O,
    pub(crate) plans: Vec<Value>,
    pub(crate) phases: Vec<Value>,
    pub(crate) steps: Vec<Value>,
    pub(crate) weight_bytes: u64,
    pub(crate) predicted: u64,
}

/// A prepared pipeline request on the page's backend, for every pipeline family: the budgets
/// decided for `s` (`resident`: every weight on the device by default) from the graphs that
/// size them, what they decide settled, `{ type: "plans" }` sent to `on_event` before the first
/// weight byte is read; then every phase with its weights fetched by Range requests, each event
/// handed to `on` and, as JSON, to `on_event`. The backend goes back to the page either way.
/// `predicted` gives the weight bytes the plans read.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_planned<P: Pipeline>(
    pipe: &P,
    prepared: &mut P::Prepared,
    state: &Rc<std::cell::RefCell<crate::api::State>>,
    traffic: &crate::fetch::SharedTraffic,
    (s, resident): (Settings, bool),
    on_event: &js_sys::Function,
    predicted: impl FnOnce(&P::Prepared, &[(&'static str, nibble_core::plan::MemoryPlan)]) -> u64,
    mut on: impl FnMut(&Event<'_>),
) -> Result<Ran<P::Output>, JsValue> {
    let mut backend = backend_of(state).await?;
    let planned = (|| {
        // "min": every group of every phase streamed (as `load`'s "min").
        let phases = pipe.budget_graphs(prepared).map_err(js_err)?;
        let graphs: Vec<_> = phases.iter().map(|(_, g, m)| (g, *m)).collect();
        let d = decide(s, resident, &graphs, &mut backend)?;
        drop(graphs);
        drop(phases);
        let opts = ExecOptions::decided(&d, 1);
        let plans = pipe.plans(prepared, &mut backend, opts).map_err(js_err)?;
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
    let predicted = predicted(prepared, &plans);
    if let Ok(js) = to_js(&json!({"type": "plans", "plans": plans_v})) {
        let _ = on_event.call1(&JsValue::NULL, &js);
    }
    let before = traffic_bytes(traffic, "weights");
    let t = traffic.clone();
    let maker = move |m: &ModelIndex| -> SourceMaker { Box::new(FetchSource::maker(m, &t)) };
    let (mut phases, mut steps) = (Vec::new(), Vec::new());
    let out = pipe
        .run_with(prepared, backend, opts, &Drive::EventLoop(&maker), |e| {
            on(&e);
            if let Ok(js) = event_js(e, &mut phases, &mut steps) {
                let _ = on_event.call1(&JsValue::NULL, &js);
            }
        })
        .await;
    let (out, backend) = out.map_err(js_err)?;
    state.borrow_mut().backend = Some(backend);
    Ok(Ran {
        out,
        plans: plans_v,
        phases,
        steps,
        weight_bytes: traffic_bytes(traffic, "weights") - before,
        predicted,
    })
}

#[wasm_bindgen]
impl Nibble {
    /// Opens the diffusers Flux pipeline folder at `url` (its `model_index.json`, scheduler
    /// config, tokenizers and the four models' headers and quant states; no weight byte) with
    /// memory settings as `load`'s (`deviceBudget` absent: the largest phase with every weight
    /// resident); resolves to the components' sizes.
    #[wasm_bindgen(js_name = loadPipeline)]
    pub fn load_pipeline(&self, url: String, settings: JsValue) -> js_sys::Promise {
        let (state, traffic) = (self.state.clone(), self.traffic.clone());
        let settings = from_js(&settings);
        future_to_promise(async move {
            let _busy = BusyGuard::take(&state)?;
            let s = settings_from(
                &settings,
                Settings {
                    device_bytes: None,
                    ..Settings::default()
                },
            )?;
            let resident = settings.get("deviceBudget").is_none_or(Value::is_null);
            if let Ok(mut t) = traffic.lock() {
                t.forget_validators();
            }
            let t0 = Instant::now();
            let base = url.trim_end_matches('/').to_string();
            let t = traffic.clone();
            let folder = move |sub: &str| -> nibble_core::Result<Arc<dyn ModelFolder>> {
                let at = if sub.is_empty() {
                    base.clone()
                } else {
                    format!("{base}/{sub}")
                };
                Ok(Arc::new(FetchFolder::new(&at, t.clone())))
            };
            let class = match folder("")
                .map_err(js_err)?
                .read_small("model_index.json", 1 << 20)
                .await
            {
                Ok(Some(b)) => serde_json::from_slice::<Value>(&b).ok().and_then(|v| {
                    v.get("_class_name")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                }),
                _ => None,
            };
            if class.as_deref() == Some("WanPipeline") {
                let mut pipe =
                    nibble_core::models::wan::pipeline::WanPipeline::open_in(&url, &folder)
                        .await
                        .map_err(js_err)?;
                pipe.transformer.load_quant_states().await.map_err(js_err)?;
                pipe.transformer = crate::lora::bind(
                    &pipe.transformer,
                    &settings,
                    nibble_core::models::wan::lora::transformer_target(),
                    &traffic,
                )
                .await
                .map_err(js_err)?;
                let models = [
                    ("text_encoder", &pipe.text_encoder),
                    ("transformer", &pipe.transformer),
                    ("vae", &pipe.vae),
                ];
                let v = loaded(&url, "video", &models, t0, &traffic).await?;
                let mut st = state.borrow_mut();
                st.wan = Some(Rc::new(pipe));
                st.pipeline = None;
                st.pipeline_resident = resident;
                st.model = None;
                st.kind = None;
                st.settings = s;
                return to_js(&v);
            }
            let mut pipe = FluxPipeline::open_in(&url, &folder).await.map_err(js_err)?;
            {
                // Binding checks every pair against the weight it adapts (its quant state).
                use nibble_core::models::flux::lora::{clip_target, t5_target, transformer_target};
                for m in [&pipe.transformer, &pipe.text_encoder, &pipe.text_encoder_2] {
                    m.load_quant_states().await.map_err(js_err)?;
                }
                let mut bound = crate::lora::bind_pipeline(
                    &[
                        (&pipe.transformer, transformer_target()),
                        (&pipe.text_encoder, clip_target()),
                        (&pipe.text_encoder_2, t5_target()),
                    ],
                    &settings,
                    &traffic,
                )
                .await
                .map_err(js_err)?;
                pipe.text_encoder_2 = bound.pop().ok_or_else(|| js_err("three models"))?;
                pipe.text_encoder = bound.pop().ok_or_else(|| js_err("three models"))?;
                pipe.transformer = bound.pop().ok_or_else(|| js_err("three models"))?;
            }
            let models = [
                ("text_encoder", &pipe.text_encoder),
                ("text_encoder_2", &pipe.text_encoder_2),
                ("transformer", &pipe.transformer),
                ("vae", &pipe.vae),
            ];
            let v = loaded(&url, "pipeline", &models, t0, &traffic).await?;
            let mut st = state.borrow_mut();
            st.pipeline = Some(Rc::new(pipe));
            st.wan = None;
            st.pipeline_resident = resident;
            st.model = None;
            st.kind = None;
            st.settings = s;
            to_js(&v)
        })
    }

    /// Text to image with the loaded pipeline: `opts` as `nibble run` on a pipeline folder
    /// (`{ prompt, height, width, steps, guidance, maxSequenceLength, seed, torchNoise,
    /// vaeTiling, vaeTileSize }` and memory settings); `on_event` gets `{ type: "plans", plans
    /// }` before the first weight byte is read, then `{ type: "phase", phase, state: "start" |
    /// "done" | "cached", ms, bytes_streamed }` and `{ type: "step", step, steps, wall_ms,
    /// bytes_streamed }`. Resolves to `{ width, height, rgb (Uint8Array, [h, w, 3]), plans,
    /// phases, steps, weight_bytes, predicted_weight_bytes }`.
    #[wasm_bindgen(js_name = generateImage)]
    pub fn generate_image(&self, opts: JsValue, on_event: js_sys::Function) -> js_sys::Promise {
        let (state, traffic) = (self.state.clone(), self.traffic.clone());
        let opts_v = from_js(&opts);
        future_to_promise(async move {
            let _busy = BusyGuard::take(&state)?;
            let (pipe, s, resident) = {
                let st = state.borrow();
                let p = st
                    .pipeline
                    .clone()
                    .ok_or_else(|| js_err("load a pipeline first (loadPipeline)"))?;
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
            let r = run_planned(
                &*pipe,
                &mut prepared,
                &state,
                &traffic,
                (s, resident),
                &on_event,
                |prepared, plans| {
                    plans
                        .iter()
                        .map(|(phase, p)| match *phase {
                            "transformer" => p.read_bytes(steps),
                            "CLIP" | "T5" if prepared.embeds.is_some() => 0,
                            _ => p.read_bytes(1),
                        })
                        .sum()
                },
                |_| {},
            )
            .await?;
            let out = r.out;
            let v = json!({
                "width": out.width,
                "height": out.height,
                "plans": r.plans,
                "phases": r.phases,
                "steps": r.steps,
                "mu": prepared.mu,
                "weight_bytes": r.weight_bytes,
                // A tiled decode opens one decoder per tile shape: predicted only untiled.
                "predicted_weight_bytes": if prepared.tiling.is_some() { None } else { Some(r.predicted) },
                "vae_tile": prepared.tiling.map(|t| t.latent_tile),
            });
            let js = to_js(&v)?;
            js_sys::Reflect::set(
                &js,
                &JsValue::from_str("rgb"),
                &js_sys::Uint8Array::from(out.rgb.as_slice()),
            )?;
            Ok(js)
        })
    }
}
