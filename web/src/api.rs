//! The JavaScript API: `Nibble` (adapter, load, plan, generate, denoise, stats).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::{Arc, Mutex};

use nibble_core::exec::ExecOptions;
use nibble_core::graph::Graph;
use nibble_core::io::model::{open_model, ModelIndex};
use nibble_core::models::dit::DitConfig;
use nibble_core::models::dit::{schedule, Denoiser, DitInputs};
use nibble_core::models::llama::{
    self, Decoder, GenerateOptions, Generation, LlamaShape, Sampling,
};
use nibble_core::models::text::{TextStream, TextTokenizer};
use nibble_core::models::ModelKind;
use nibble_core::plan::budget::{Budget, BudgetDecision, BudgetRequest, DeviceBudget, Machine};
use nibble_wgpu::WgpuBackend;
use serde_json::{json, Value};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;
use web_time::Instant;

use crate::fetch::{FetchFolder, FetchSource, SharedTraffic, Traffic};

/// Memory settings from JavaScript: `{ deviceBudget: bytes | "min", slots, slotBytes }`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    /// `None`: the smallest budget (every group streamed each step).
    pub(crate) device_bytes: Option<u64>,
    pub(crate) slots: u64,
    pub(crate) slot_bytes: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            device_bytes: None,
            slots: 4,
            slot_bytes: 4 << 20,
        }
    }
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) backend: Option<WgpuBackend>,
    pub(crate) model: Option<ModelIndex>,
    pub(crate) kind: Option<ModelKind>,
    pub(crate) settings: Settings,
    busy: bool,
    /// The Flux pipeline folder opened by `loadPipeline` (instead of a model).
    pub(crate) pipeline: Option<Rc<nibble_core::models::flux::pipeline::FluxPipeline>>,
    /// The Wan folder opened by `loadPipeline` (instead of a model or a Flux folder).
    pub(crate) wan: Option<Rc<nibble_core::models::wan::pipeline::WanPipeline>>,
    /// `loadPipeline` was given no device budget: each run's default is every weight resident.
    pub(crate) pipeline_resident: bool,
    /// The language model's tokenizer and chat template, when its folder has them.
    text: Option<Rc<TextTokenizer>>,
    /// End-of-sequence ids (config.json's and generation_config.json's).
    eos: Vec<u32>,
}

/// nibble in a browser tab: one WebGPU device, one model streamed over HTTP Range requests.
#[wasm_bindgen]
pub struct Nibble {
    pub(crate) state: Rc<RefCell<State>>,
    pub(crate) traffic: SharedTraffic,
}

impl Default for Nibble {
    fn default() -> Self {
        Self::new()
    }
}

pub(crate) fn js_err(e: impl std::fmt::Display) -> JsValue {
    js_sys::Error::new(&e.to_string()).into()
}

pub(crate) fn to_js(v: &Value) -> Result<JsValue, JsValue> {
    js_sys::JSON::parse(&v.to_string())
}

pub(crate) fn from_js(v: &JsValue) -> Value {
    if v.is_undefined() || v.is_null() {
        return Value::Null;
    }
    js_sys::JSON::stringify(v)
        .ok()
        .and_then(|s| s.as_string())
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(Value::Null)
}

pub(crate) fn settings_from(v: &Value, base: Settings) -> Result<Settings, JsValue> {
    let mut s = base;
    match v.get("deviceBudget") {
        None | Some(Value::Null) => {}
        Some(Value::String(x)) if x == "min" => s.device_bytes = None,
        Some(Value::String(x)) => {
            s.device_bytes = Some(nibble_core::plan::parse_size(x).map_err(js_err)?)
        }
        Some(Value::Number(n)) => {
            s.device_bytes = Some(n.as_u64().ok_or_else(|| js_err("deviceBudget: bytes"))?)
        }
        Some(other) => return Err(js_err(format!("deviceBudget: {other} is not a size"))),
    }
    if let Some(n) = v.get("slots").and_then(Value::as_u64) {
        s.slots = n;
    }
    match v.get("slotBytes") {
        Some(Value::Number(n)) => s.slot_bytes = n.as_u64().unwrap_or(s.slot_bytes),
        Some(Value::String(x)) => {
            s.slot_bytes = nibble_core::plan::parse_size(x).map_err(js_err)?
        }
        _ => {}
    }
    Ok(s)
}

/// Core's budget decision for the page's settings over `graphs` (a run's phases): the device
/// budget given; else every weight resident (`resident`, a pipeline opened so), else the least
/// that runs, every group streamed ("min"). The page tells no host memory.
pub(crate) fn decide(
    s: Settings,
    resident: bool,
    graphs: &[(&Graph, &ModelIndex)],
    backend: &mut WgpuBackend,
) -> Result<BudgetDecision, JsValue> {
    let req = BudgetRequest {
        device: match s.device_bytes {
            Some(b) => DeviceBudget::Bytes(b),
            None if resident => DeviceBudget::Resident,
            None => DeviceBudget::Least,
        },
        host: Budget::Auto,
        slots: Some(s.slots),
        slot_size: Some(s.slot_bytes),
        stream_all: s.device_bytes.is_none() && !resident,
    };
    nibble_core::plan::budget::decide(&req, &Machine::unknown(), backend, graphs).map_err(js_err)
}

/// The executor options of one graph's run (one reader: the page's fetches).
fn exec_options(
    s: Settings,
    graph: &Graph,
    model: &ModelIndex,
    backend: &mut WgpuBackend,
) -> Result<ExecOptions, JsValue> {
    Ok(ExecOptions::decided(
        &decide(s, false, &[(graph, model)], backend)?,
        1,
    ))
}

/// Sampling from JavaScript: `{ temperature: 0, topK: 0, topP: 1, seed: 0 }` (greedy by
/// default), as `nibble run`'s `--temperature --top-k --top-p --seed`.
fn sampling_from(v: &Value) -> Result<Sampling, JsValue> {
    let d = Sampling::default();
    let num = |k: &str| v.get(k).filter(|x| !x.is_null());
    let f = |k: &str, d: f32| -> Result<f32, JsValue> {
        match num(k) {
            None => Ok(d),
            Some(x) => x
                .as_f64()
                .map(|x| x as f32)
                .ok_or_else(|| js_err(format!("{k}: {x} is not a number"))),
        }
    };
    let u = |k: &str, d: u64| -> Result<u64, JsValue> {
        match num(k) {
            None => Ok(d),
            Some(x) => x
                .as_u64()
                .ok_or_else(|| js_err(format!("{k}: {x} is not a whole number >= 0"))),
        }
    };
    Ok(Sampling {
        temperature: f("temperature", d.temperature)?,
        top_k: u("topK", d.top_k as u64)? as usize,
        top_p: f("topP", d.top_p)?,
        seed: u("seed", d.seed)?,
    })
}

fn kind_of(config: Option<&Value>) -> Result<ModelKind, JsValue> {
    let c = config.ok_or_else(|| js_err("the model has no config.json"))?;
    match ModelKind::of_config(c) {
        Some(ModelKind::Encoder) => Err(js_err(
            "BERT encoders run natively (nibble run), not yet in the browser: load a \
             Llama-family decoder or a Flux-style DiT",
        )),
        Some(k) => Ok(k),
        None => Err(js_err(
            "config.json describes neither a Llama-family decoder nor a Flux-style DiT",
        )),
    }
}

pub(crate) fn traffic_bytes(t: &SharedTraffic, purpose: &str) -> u64 {
    t.lock().map(|t| t.bytes(Some(purpose))).unwrap_or(0)
}

impl State {
    /// The loaded model, which must be of `kind` (its files and index, cheap to clone: the
    /// index shares its source), and the memory settings with `opts` applied.
    fn loaded(&self, kind: ModelKind, opts: &Value) -> Result<(ModelIndex, Settings), JsValue> {
        let m = self
            .model
            .as_ref()
            .ok_or_else(|| js_err("load a model first"))?;
        if self.kind != Some(kind) {
            return Err(js_err(match kind {
                ModelKind::Llm => "the loaded model is not a language model",
                ModelKind::Dit => "the loaded model is not a diffusion transformer",
                ModelKind::Encoder => "the loaded model is not an encoder",
            }));
        }
        Ok((m.clone(), settings_from(opts, self.settings)?))
    }
}

/// Marks the state busy for the life of a call (one run at a time).
pub(crate) struct BusyGuard(Rc<RefCell<State>>);

impl BusyGuard {
    pub(crate) fn take(state: &Rc<RefCell<State>>) -> Result<Self, JsValue> {
        let mut s = state.try_borrow_mut().map_err(|_| js_err("busy"))?;
        if s.busy {
            return Err(js_err("another call is still running on this Nibble"));
        }
        s.busy = true;
        Ok(BusyGuard(state.clone()))
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        if let Ok(mut s) = self.0.try_borrow_mut() {
            s.busy = false;
        }
    }
}

pub(crate) async fn backend_of(state: &Rc<RefCell<State>>) -> Result<WgpuBackend, JsValue> {
    let have = state.borrow_mut().backend.take();
    match have {
        Some(b) => Ok(b),
        None => WgpuBackend::new_async().await.map_err(|e| {
            js_err(format!(
                "WebGPU is not available in this browser ({e}); nibble's browser build needs navigator.gpu (Chrome/Edge 113+, or Chromium with --enable-unsafe-webgpu)"
            ))
        }),
    }
}

#[wasm_bindgen]
impl Nibble {
    /// A new engine; nothing is opened yet.
    #[wasm_bindgen(constructor)]
    pub fn new() -> Nibble {
        Nibble {
            state: Rc::default(),
            traffic: Arc::new(Mutex::new(Traffic::default())),
        }
    }

    /// Opens the WebGPU adapter (once): `{ name, limits: {...} }`.
    pub fn adapter(&self) -> js_sys::Promise {
        let state = self.state.clone();
        future_to_promise(async move {
            let _busy = BusyGuard::take(&state)?;
            let b = backend_of(&state).await?;
            let l = b.limits();
            let i = b.adapter_info();
            // Browsers leave the name empty and say vendor / architecture instead.
            let name = if i.name.is_empty() {
                format!("{} {} ({:?})", i.driver, i.driver_info, i.device_type)
            } else {
                b.describe()
            };
            let v = json!({
                "name": name.trim(),
                "info": format!("{i:?}"),
                "limits": {
                    "max_storage_buffer_binding_size": l.max_storage_buffer_binding_size,
                    "max_buffer_size": l.max_buffer_size,
                    "max_storage_buffers_per_shader_stage": l.max_storage_buffers_per_shader_stage,
                    "max_compute_invocations_per_workgroup": l.max_compute_invocations_per_workgroup,
                    "max_compute_workgroup_storage_size": l.max_compute_workgroup_storage_size,
                },
            });
            state.borrow_mut().backend = Some(b);
            to_js(&v)
        })
    }

    /// Opens the model folder at `url` (headers and quant states only) with memory settings
    /// `{ deviceBudget: bytes | "1.5GiB" | "min", slots, slotBytes }`; resolves to the model's
    /// kind, its size and the plan for a default run.
    pub fn load(&self, url: String, settings: JsValue) -> js_sys::Promise {
        let (state, traffic) = (self.state.clone(), self.traffic.clone());
        let settings = from_js(&settings);
        future_to_promise(async move {
            let _busy = BusyGuard::take(&state)?;
            let s = settings_from(&settings, Settings::default())?;
            // A new model (or the same one, changed on the server) starts new validators.
            if let Ok(mut t) = traffic.lock() {
                t.forget_validators();
            }
            let t0 = Instant::now();
            let before = traffic_bytes(&traffic, "header") + traffic_bytes(&traffic, "quant-state");
            let folder = std::sync::Arc::new(FetchFolder::new(&url, traffic.clone()));
            let model = open_model(folder, None).await.map_err(js_err)?;
            // The graph builders and the planner read the quant states synchronously.
            model.load_quant_states().await.map_err(js_err)?;
            let model = crate::lora::bind(
                &model,
                &settings,
                nibble_core::models::lora::Target::model(),
                &traffic,
            )
            .await
            .map_err(js_err)?;
            let open_bytes =
                traffic_bytes(&traffic, "header") + traffic_bytes(&traffic, "quant-state") - before;
            let kind = kind_of(model.config.as_ref())?;
            let (text, eos) = if kind == ModelKind::Llm {
                language_side_files(&model).await?
            } else {
                (None, Vec::new())
            };
            let open_ms = t0.elapsed().as_secs_f64() * 1e3;
            let files = model.source().files().to_vec();
            let total: u64 = files.iter().map(|f| f.len).sum();
            let summary = json!({
                "url": url,
                "kind": match kind { ModelKind::Llm => "llm", ModelKind::Dit => "dit", ModelKind::Encoder => "encoder" },
                "files": files.iter().map(|f| json!({"url": f.name, "bytes": f.len})).collect::<Vec<_>>(),
                "bytes": total,
                "tensors": model.len(),
                "open_bytes": open_bytes,
                "open_ms": open_ms,
                "tokenizer": text.is_some(),
                "chat_template": text.as_ref().is_some_and(|t| t.has_chat_template()),
            });
            {
                let mut st = state.borrow_mut();
                st.model = Some(model);
                st.kind = Some(kind);
                st.settings = s;
                st.text = text.map(Rc::new);
                st.eos = eos;
            }
            // The plan of a default run (16 prompt + 16 new tokens, or a 4 x 4 latent), before
            // any weight is read; `plan()` gives it for other shapes.
            let mut summary = summary;
            summary["plan"] = plan_for(&state, &Value::Null).await?;
            to_js(&summary)
        })
    }

    /// The memory plan of a run before it starts: `{ promptTokens, maxTokens }` for LLMs,
    /// `{ height, width, textTokens }` for DiTs (and any memory setting, as in `load`).
    pub fn plan(&self, opts: JsValue) -> js_sys::Promise {
        let state = self.state.clone();
        let opts = from_js(&opts);
        future_to_promise(async move {
            let _busy = BusyGuard::take(&state)?;
            to_js(&plan_for(&state, &opts).await?)
        })
    }

    /// Generation: `prompt` is text (through the tokenizer; as a chat turn unless
    /// `opts.chat` is false and when the model has a chat template) or token ids; `opts =
    /// { maxTokens: 16, stopAtEos: true, chat, temperature: 0, topK: 0, topP: 1, seed: 0 }`
    /// (greedy by default; a sampling and seed give the tokens `nibble run` gives with them)
    /// plus any memory setting; `on_token(id, index, text)` is called as each token is chosen (`text`: the newly complete text, when the model
    /// has a tokenizer). Resolves to `{ tokens, text_tail, plan, prefill_tok_s, decode_tok_s,
    /// passes, weight_bytes, predicted_weight_bytes }` (`text_tail`: text held back to the end, a
    /// character the last tokens left incomplete, to append to the pieces).
    pub fn generate(
        &self,
        prompt: JsValue,
        opts: JsValue,
        on_token: js_sys::Function,
    ) -> js_sys::Promise {
        let (state, traffic) = (self.state.clone(), self.traffic.clone());
        let opts = from_js(&opts);
        let prompt: Result<Vec<u32>, JsValue> = match prompt.as_string() {
            Some(text) => {
                let chat = opts.get("chat").and_then(Value::as_bool).unwrap_or(true)
                    && self.text().is_ok_and(|t| t.has_chat_template());
                self.tokenize(text, chat)
            }
            None => Ok(js_sys::Uint32Array::new(&prompt).to_vec()),
        };
        future_to_promise(async move {
            let prompt = prompt?;
            let _busy = BusyGuard::take(&state)?;
            // Everything that can be refused is checked before the device is taken out of the
            // state (it goes back when the run ends).
            let (model, s) = state.borrow().loaded(ModelKind::Llm, &opts)?;
            let max_tokens = opts
                .get("maxTokens")
                .and_then(Value::as_u64)
                .unwrap_or(16)
                .max(1) as usize;
            let gen_opts = GenerateOptions {
                max_tokens,
                stop_at_eos: opts
                    .get("stopAtEos")
                    .and_then(Value::as_bool)
                    .unwrap_or(true),
                sampling: sampling_from(&opts)?,
            };
            gen_opts.sampling.check().map_err(js_err)?;
            if prompt.is_empty() {
                return Err(js_err("the prompt has no tokens"));
            }
            let lg = llama::build(&model, LlamaShape::generate(prompt.len(), max_tokens))
                .map_err(js_err)?;
            let mut backend = backend_of(&state).await?;
            let (eos, text) = {
                let st = state.borrow();
                (st.eos.clone(), st.text.clone())
            };
            let mut stream = TextStream::default();
            let mut piece = |id: u32| -> JsValue {
                match &text {
                    Some(t) => JsValue::from(stream.push(t, id).unwrap_or_default()),
                    None => JsValue::UNDEFINED,
                }
            };
            let o = match exec_options(s, &lg.graph, &model, &mut backend) {
                Ok(o) => o,
                Err(e) => {
                    state.borrow_mut().backend = Some(backend);
                    return Err(e);
                }
            };
            let before = traffic_bytes(&traffic, "weights");
            let mut make = FetchSource::maker(&model, &traffic);
            let mut d = Decoder::from_graph_async(lg, &model, backend, o, &mut make)
                .await
                .map_err(js_err)?;
            // One pass for the prompt, one per further token: no read runs past the last.
            d.executor_mut().limit_stream_passes(max_tokens as u64);
            let plan = d.executor().plan().clone();
            let mut gen = Generation::new(d, prompt.clone(), eos, gen_opts).map_err(js_err)?;
            let (mut prefill_s, mut decode_s) = (0f64, 0f64);
            let run = async {
                while let Some(t) = gen.next_token_async().await.map_err(js_err)? {
                    if t.index == 0 {
                        prefill_s = t.wall.as_secs_f64();
                    } else {
                        decode_s += t.wall.as_secs_f64();
                    }
                    let p = piece(t.id);
                    let _ = on_token.call3(
                        &JsValue::NULL,
                        &JsValue::from(t.id),
                        &JsValue::from(t.index as u32),
                        &p,
                    );
                }
                Ok::<_, JsValue>(())
            };
            let r = run.await;
            // The text held back at the end (a character the last tokens left incomplete).
            let tail = match &text {
                Some(t) => JsValue::from(stream.finish(t).unwrap_or_default()),
                None => JsValue::UNDEFINED,
            };
            let tokens = gen.tokens().to_vec();
            let passes = tokens.len() as u64;
            let (backend, _ring) = gen.into_decoder().into_parts();
            state.borrow_mut().backend = Some(backend);
            r?;
            let decoded = tokens.len().saturating_sub(1);
            let v = json!({
                "tokens": tokens,
                "text_tail": tail.as_string(),
                "plan": plan.to_json(),
                "prefill_tok_s": prompt.len() as f64 / prefill_s.max(1e-9),
                "decode_tok_s": if decoded > 0 { decoded as f64 / decode_s.max(1e-9) } else { 0.0 },
                "passes": passes,
                "weight_bytes": traffic_bytes(&traffic, "weights") - before,
                "predicted_weight_bytes": plan.read_bytes(passes),
            });
            to_js(&v)
        })
    }

    /// Flow-matching Euler denoising: `opts = { steps: 4, inputs: { hidden_states,
    /// encoder_hidden_states, pooled_projections, guidance, img_ids, txt_ids } (Float32Arrays or
    /// arrays), seed, height, width, textTokens, shift }`; without `inputs` they are random from
    /// the seed. `on_step({ step, wall_ms, bytes_streamed, stall_ms })` after each step.
    /// Resolves to `{ latent, steps, plan, weight_bytes, predicted_weight_bytes }`.
    pub fn denoise(&self, opts: JsValue, on_step: js_sys::Function) -> js_sys::Promise {
        let (state, traffic) = (self.state.clone(), self.traffic.clone());
        let opts_v = from_js(&opts);
        let inputs_js = js_sys::Reflect::get(&opts, &JsValue::from_str("inputs")).ok();
        future_to_promise(async move {
            let _busy = BusyGuard::take(&state)?;
            let (model, s) = state.borrow().loaded(ModelKind::Dit, &opts_v)?;
            let index = model.clone();
            let inputs = dit_inputs(&index, &opts_v, inputs_js.as_ref())?;
            let steps = opts_v
                .get("steps")
                .and_then(Value::as_u64)
                .unwrap_or(4)
                .max(1) as usize;
            let shift = opts_v.get("shift").and_then(Value::as_f64).unwrap_or(1.0);
            let sigmas = schedule(steps, shift, false, inputs.image_tokens()).map_err(js_err)?;
            let graph = Denoiser::<WgpuBackend>::graph_for(&index, &inputs).map_err(js_err)?;
            // The device leaves the state only now that nothing before the run can be refused.
            let mut backend = backend_of(&state).await?;
            let o = match exec_options(s, &graph, &index, &mut backend) {
                Ok(o) => o,
                Err(e) => {
                    state.borrow_mut().backend = Some(backend);
                    return Err(e);
                }
            };
            drop(graph);
            let before = traffic_bytes(&traffic, "weights");
            let mut make = FetchSource::maker(&model, &traffic);
            let mut den =
                Denoiser::with_source_async(&index, backend, inputs, sigmas, o, &mut make)
                    .await
                    .map_err(js_err)?;
            den.executor_mut().limit_stream_passes(steps as u64);
            let plan = den.executor().plan().clone();
            let mut rows = Vec::new();
            let r = async {
                while let Some(st) = den.step_async().await.map_err(js_err)? {
                    let row = json!({
                        "step": st.step,
                        "wall_ms": st.wall.as_secs_f64() * 1e3,
                        "bytes_streamed": st.stats.stream.bytes,
                        "stall_ms": st.stats.stream.stall.as_secs_f64() * 1e3,
                    });
                    let _ = on_step.call1(&JsValue::NULL, &to_js(&row)?);
                    rows.push(row);
                }
                Ok::<_, JsValue>(())
            }
            .await;
            let latent = js_sys::Float32Array::from(den.latent());
            let (backend, _ring) = den.into_parts();
            state.borrow_mut().backend = Some(backend);
            r?;
            let v = json!({
                "steps": rows,
                "plan": plan.to_json(),
                "weight_bytes": traffic_bytes(&traffic, "weights") - before,
                "predicted_weight_bytes": plan.read_bytes(steps as u64),
            });
            let out = to_js(&v)?;
            js_sys::Reflect::set(&out, &JsValue::from_str("latent"), &latent)?;
            Ok(out)
        })
    }

    /// Token ids of `text` with the model's tokenizer; with `chat`, as the user's turn of the
    /// model's chat template, ready for the assistant's answer (as `nibble run --chat`).
    pub fn tokenize(&self, text: String, chat: bool) -> Result<Vec<u32>, JsValue> {
        self.text()?.prompt_ids(&text, chat).map_err(js_err)
    }

    /// How long each later request waits for its response before it is aborted and tried again
    /// (up to 4 attempts): `ms` milliseconds (default 30000, as the native HTTP source).
    #[wasm_bindgen(js_name = setFetchTimeout)]
    pub fn set_fetch_timeout(&self, ms: u32) {
        crate::fetch::set_response_timeout_ms(ms);
    }

    /// The text of token ids (special tokens skipped).
    pub fn detokenize(&self, ids: Vec<u32>) -> Result<String, JsValue> {
        self.text()?.decode(&ids, true).map_err(js_err)
    }

    /// Every request so far and the bytes by purpose: `{ requests: [{url, range, status,
    /// bytes, purpose}], bytes: { header, quant_state, weights, side_file, total },
    /// weight_file_requests_without_range }`.
    pub fn stats(&self) -> Result<JsValue, JsValue> {
        let t = self.traffic.lock().map_err(|_| js_err("stats poisoned"))?;
        let requests: Vec<Value> = t
            .requests
            .iter()
            .map(|r| {
                json!({
                    "url": r.url, "range": r.range.map(|(a, b)| vec![a, b]),
                    "status": r.status, "bytes": r.bytes, "purpose": r.purpose,
                })
            })
            .collect();
        let unranged = t
            .requests
            .iter()
            .filter(|r| r.range.is_none() && r.url.ends_with(".safetensors"))
            .count();
        to_js(&json!({
            "requests": requests,
            "bytes": {
                "header": t.bytes(Some("header")),
                "quant_state": t.bytes(Some("quant-state")),
                "weights": t.bytes(Some("weights")),
                "side_file": t.bytes(Some("side-file")),
                "total": t.bytes(None),
            },
            "weight_file_requests_without_range": unranged,
        }))
    }
}

impl Nibble {
    /// The loaded language model's tokenizer.
    fn text(&self) -> Result<Rc<TextTokenizer>, JsValue> {
        self.state
            .try_borrow()
            .map_err(|_| js_err("busy"))?
            .text
            .clone()
            .ok_or_else(|| js_err("the loaded model has no tokenizer.json: give token ids"))
    }
}

/// The plan for a run of the loaded model with `opts` (shape and memory settings), on the
/// state's device (opened if needed, put back after).
async fn plan_for(state: &Rc<RefCell<State>>, opts: &Value) -> Result<Value, JsValue> {
    let mut backend = backend_of(state).await?;
    let r = (|| -> Result<Value, JsValue> {
        let st = state.borrow();
        let model = st
            .model
            .as_ref()
            .ok_or_else(|| js_err("load a model first"))?;
        let s = settings_from(opts, st.settings)?;
        let graph = match st.kind {
            Some(ModelKind::Llm) => {
                let p = opts
                    .get("promptTokens")
                    .and_then(Value::as_u64)
                    .unwrap_or(16) as usize;
                let m = opts.get("maxTokens").and_then(Value::as_u64).unwrap_or(16) as usize;
                llama::build(model, LlamaShape::generate(p, m))
                    .map_err(js_err)?
                    .graph
            }
            _ => {
                let inputs = dit_inputs(model, opts, None)?;
                Denoiser::<WgpuBackend>::graph_for(model, &inputs).map_err(js_err)?
            }
        };
        let d = decide(s, false, &[(&graph, model)], &mut backend)?;
        match &d.phases[0].plan {
            Ok(plan) => Ok(plan.to_json()),
            Err(e) => Err(js_err(e)),
        }
    })();
    state.borrow_mut().backend = Some(backend);
    r
}

/// The tokenizer (with its chat template) and the end-of-sequence ids of a language model.
async fn language_side_files(
    model: &ModelIndex,
) -> Result<(Option<TextTokenizer>, Vec<u32>), JsValue> {
    let cfg = llama::LlamaConfig::of(model).map_err(js_err)?;
    let eos = llama::eos_ids(model, &cfg).await.map_err(js_err)?;
    let t = TextTokenizer::load(model).await.map_err(js_err)?;
    Ok((t, eos))
}

/// The DiT's inputs: from JavaScript (`inputs`), else random from the seed at the size asked.
fn dit_inputs(
    index: &ModelIndex,
    opts: &Value,
    js: Option<&JsValue>,
) -> Result<DitInputs, JsValue> {
    let cfg = DitConfig::of(index).map_err(js_err)?;
    if let Some(obj) = js.filter(|v| v.is_object()) {
        let get = |name: &str| -> Result<Vec<f32>, JsValue> {
            let v = js_sys::Reflect::get(obj, &JsValue::from_str(name))?;
            if v.is_undefined() {
                return Err(js_err(format!("inputs.{name} is missing")));
            }
            Ok(js_sys::Float32Array::new(&v).to_vec())
        };
        let inputs = DitInputs::from_named(&cfg, get)?;
        inputs.check(&cfg).map_err(js_err)?;
        return Ok(inputs);
    }
    let h = opts.get("height").and_then(Value::as_u64).unwrap_or(4) as usize;
    let w = opts.get("width").and_then(Value::as_u64).unwrap_or(4) as usize;
    let t = opts.get("textTokens").and_then(Value::as_u64).unwrap_or(8) as usize;
    let seed = opts.get("seed").and_then(Value::as_u64).unwrap_or(0);
    let g = opts.get("guidance").and_then(Value::as_f64).unwrap_or(3.5) as f32;
    DitInputs::random(&cfg, h, w, t, g, seed).map_err(js_err)
}
