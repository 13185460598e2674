//! nibble in the browser: the same planner, staging ring and executor as native, on WebGPU
//! (wgpu's browser backend), with weights streamed by `fetch` Range requests into the ring.
//!
//! The JavaScript API (see `web/www/`):
//!
//! ```js
//! import init, { Nibble } from "./pkg/nibble_web.js";
//! await init();
//! const nb = new Nibble();
//! const info = await nb.adapter();                 // adapter name, limits
//! const model = await nb.load(url, { deviceBudget: "min", slots: 2, slotBytes: 65536 });
//! // with LoRA adapters: { ..., lora: ["adapters/style/", "b.safetensors:0.5"] }
//! // model.plan: the memory plan of a default run, before any weight byte is read
//! const out = await nb.generate("Hello", { maxTokens: 16 }, (id, i, text) => ...); // LLMs
//! const dit = await nb.denoise({ steps: 4, inputs }, (step) => ...);             // DiTs
//! await nb.loadPipeline(url, {});                    // a diffusers Flux or Wan folder
//! const img = await nb.generateImage({ prompt, height, width, steps, seed }, (ev) => ...);
//! const vid = await nb.generateVideo({ prompt, frames, height, width }, (ev) => ...); // Wan
//! nb.stats();                                       // every request, bytes fetched vs the plan
//! ```
//!
//! Natively this crate is empty (its code needs a browser); `scripts/build-web.sh` builds it.

#[cfg(target_arch = "wasm32")]
mod api;
#[cfg(target_arch = "wasm32")]
mod fetch;
#[cfg(target_arch = "wasm32")]
mod lora;
#[cfg(target_arch = "wasm32")]
mod pipeline;
#[cfg(target_arch = "wasm32")]
mod video;

#[cfg(target_arch = "wasm32")]
pub use api::Nibble;
