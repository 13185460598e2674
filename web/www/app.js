// nibble's browser demo: opens a model over HTTP Range requests, shows the memory plan, then
// generates text (LLMs), denoises (DiTs) or turns a prompt into an image (Flux pipeline folders) on WebGPU, one streaming pass over the layers per
// step. The page's functions are also what the browser test drives (window.nibbleDemo).
import init, { Nibble } from "./pkg/nibble_web.js";

const $ = (id) => document.getElementById(id);
const fmt = (b) => {
  const u = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return `${b.toFixed(i ? 2 : 0)} ${u[i]}`;
};

let nb = null;
let model = null;
const chart = { rows: [] };

function settings() {
  const budget = $("budget").value.trim();
  return {
    deviceBudget: budget === "" || budget === "min" ? "min" : (/^\d+$/.test(budget) ? Number(budget) : budget),
    slots: Number($("slots").value),
    slotBytes: $("slotSize").value.trim(),
    lora: $("lora").value.split(",").map((x) => x.trim()).filter((x) => x.length > 0),
  };
}

function drawChart() {
  const c = $("chart"), g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  const rows = chart.rows;
  if (!rows.length) return;
  const pad = 36, w = c.width - 2 * pad, h = c.height - 2 * pad;
  const maxMs = Math.max(...rows.map((r) => r.wall_ms)) * 1.1 || 1;
  const maxB = Math.max(...rows.map((r) => r.bytes_streamed)) * 1.1 || 1;
  const x = (i) => pad + (rows.length === 1 ? w / 2 : (i * w) / (rows.length - 1));
  g.fillStyle = "#c9dcf0";
  const bw = Math.max(2, w / rows.length - 2);
  rows.forEach((r, i) => {
    const bh = (r.bytes_streamed / maxB) * h;
    g.fillRect(x(i) - bw / 2, pad + h - bh, bw, bh);
  });
  g.strokeStyle = "#2f6fb2"; g.lineWidth = 2; g.beginPath();
  rows.forEach((r, i) => {
    const y = pad + h - (r.wall_ms / maxMs) * h;
    i ? g.lineTo(x(i), y) : g.moveTo(x(i), y);
  });
  g.stroke();
  g.fillStyle = "#333"; g.font = "12px system-ui";
  g.fillText(`${maxMs.toFixed(0)} ms`, 2, pad - 6);
  g.fillText(`${fmt(maxB)} / step`, c.width - pad - 90, pad - 6);
  g.fillText(`step 1 … ${rows.length}`, pad, c.height - 8);
}

// Progress within a step: weight bytes fetched since the run started, modulo one step's bytes.
function watchStep(perStep) {
  const start = nb.stats().bytes.weights;
  let live = true;
  const tick = () => {
    if (!live) return;
    const done = nb.stats().bytes.weights - start;
    const frac = perStep > 0 ? (done % perStep) / perStep : 1;
    $("stepBar").style.width = `${(frac * 100).toFixed(1)}%`;
    requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
  return () => { live = false; $("stepBar").style.width = "100%"; };
}

// A diffusers pipeline folder has a model_index.json at its root.
async function isPipeline(url) {
  try {
    const r = await fetch(`${url.replace(/\/+$/, "")}/model_index.json`);
    return r.ok;
  } catch { return false; }
}

export async function openModel(url, s = settings()) {
  if (await isPipeline(url)) return openPipeline(url, s);
  $("url").value = url;
  $("budget").value = s.deviceBudget ?? "min";
  if (s.slots) $("slots").value = s.slots;
  if (s.slotBytes) $("slotSize").value = typeof s.slotBytes === "number" ? fmt(s.slotBytes).replace(" ", "") : s.slotBytes;
  $("lora").value = (s.lora ?? []).join(", ");
  $("openStatus").textContent = `opening ${url} …`;
  $("openBar").style.width = "15%";
  const t0 = performance.now();
  model = await nb.load(url, s);
  window.nibbleDemo.lastModel = model;
  $("plan").textContent = model.plan.text;
  $("openBar").style.width = "100%";
  $("openStatus").textContent =
    `${model.kind === "llm" ? "language model" : "diffusion transformer"}: ${model.tensors} tensors, ` +
    `${fmt(model.bytes)} in ${model.files.length} file(s); opened with ${fmt(model.open_bytes)} ` +
    `(headers and quant states) in ${(performance.now() - t0).toFixed(0)} ms` +
    (model.kind === "llm" ? (model.tokenizer ? `; tokenizer${model.chat_template ? " and chat template" : ""}` : "; no tokenizer.json: prompts are token ids") : "");
  $("runCard").hidden = false;
  $("pipelineControls").hidden = true;
  $("llmControls").hidden = model.kind !== "llm";
  $("ditControls").hidden = model.kind !== "dit";
  $("runTitle").textContent = model.kind === "llm" ? "Generate" : "Denoise";
  $("textPrompt").hidden = !(model.kind === "llm" && model.tokenizer);
  $("idsPrompt").hidden = !!(model.kind === "llm" && model.tokenizer);
  $("chat").disabled = !model.chat_template;
  $("chat").checked = !!model.chat_template;
  return model;
}

export async function showPlan(opts) {
  const p = await nb.plan(opts);
  $("plan").textContent = p.text;
  return p;
}

export async function runLlm(promptIds, opts = {}) {
  const maxTokens = opts.maxTokens ?? Number($("maxTokens").value);
  const plan = await showPlan({ ...opts, promptTokens: promptIds.length, maxTokens });
  chart.rows = []; drawChart();
  $("output").textContent = "";
  const tokens = [];
  let last = performance.now();
  let stop = watchStep(plan.streamed_bytes_per_step);
  let prevWeights = nb.stats().bytes.weights;
  let text = "";
  const onToken = (id, i, piece) => {
    tokens.push(id);
    const now = performance.now(), w = nb.stats().bytes.weights;
    chart.rows.push({ wall_ms: now - last, bytes_streamed: w - prevWeights });
    last = now; prevWeights = w;
    drawChart();
    if (typeof piece === "string") text += piece;
    $("output").textContent = typeof piece === "string" ? text : tokens.join(" ");
    $("runStatus").textContent = `token ${i + 1} of at most ${maxTokens}`;
  };
  try {
    const r = await nb.generate(Uint32Array.from(promptIds), { ...opts, maxTokens }, onToken);
    if (typeof r.text_tail === "string" && r.text_tail) $("output").textContent = text + r.text_tail;
    $("runStatus").textContent =
      `${r.tokens.length} tokens; prompt ${r.prefill_tok_s.toFixed(1)} tok/s, decode ${r.decode_tok_s.toFixed(2)} tok/s; ` +
      `streamed ${fmt(r.weight_bytes)} (plan: ${fmt(r.predicted_weight_bytes)})`;
    return r;
  } finally { stop(); }
}

export async function runDit(opts = {}) {
  const o = {
    steps: Number($("steps").value), height: Number($("height").value), width: Number($("width").value),
    textTokens: Number($("textTokens").value), seed: Number($("seed").value), ...opts,
  };
  for (const k of ["steps", "height", "width", "textTokens", "seed"]) $(k).value = o[k];
  const plan = await showPlan(o);
  chart.rows = []; drawChart();
  $("output").textContent = "";
  let stop = watchStep(plan.streamed_bytes_per_step);
  try {
    const r = await nb.denoise(o, (row) => {
      chart.rows.push(row);
      drawChart();
      $("runStatus").textContent =
        `step ${row.step} of ${o.steps}: ${row.wall_ms.toFixed(0)} ms, ${fmt(row.bytes_streamed)} streamed, stall ${row.stall_ms.toFixed(0)} ms`;
    });
    const l = r.latent;
    let sum = 0, sq = 0;
    for (const v of l) { sum += v; sq += v * v; }
    const mean = sum / l.length;
    $("output").textContent =
      `final latent: ${l.length} values, mean ${mean.toFixed(4)}, std ${Math.sqrt(sq / l.length - mean * mean).toFixed(4)}`;
    return r;
  } finally { stop(); }
}

// A Flux pipeline folder: CLIP, T5, the transformer and the VAE, each phase planned before the
// first weight byte; the image is painted into the canvas.
export async function openPipeline(url, s = settings()) {
  $("url").value = url;
  $("lora").value = (s.lora ?? []).join(", ");
  $("openStatus").textContent = `opening the pipeline ${url} …`;
  $("openBar").style.width = "15%";
  const t0 = performance.now();
  model = await nb.loadPipeline(url, s);
  window.nibbleDemo.lastModel = model;
  $("openBar").style.width = "100%";
  const video = model.kind === "video";
  $("openStatus").textContent =
    `${video ? "Wan video folder" : "Flux pipeline"}: ${model.components.map((c) => `${c.name} ${fmt(c.bytes)}`).join(", ")}; opened with ` +
    `${fmt(model.open_bytes)} (configs, tokenizers, headers, quant states) in ${(performance.now() - t0).toFixed(0)} ms`;
  $("plan").textContent = "(each phase's plan is printed when the run starts, before the first weight byte is read)";
  $("runCard").hidden = false;
  $("pipelineControls").hidden = false;
  $("llmControls").hidden = true;
  $("ditControls").hidden = true;
  $("videoControls").hidden = !video;
  $("runTitle").textContent = video ? "Text to video" : "Text to image";
  if (video) {
    // WanPipeline's defaults.
    $("imgHeight").value = 480; $("imgWidth").value = 832; $("imgSteps").value = 50; $("guidance").value = 5;
  }
  return model;
}

export async function runPipeline(opts = {}) {
  const o = {
    prompt: $("imagePrompt").value, height: Number($("imgHeight").value), width: Number($("imgWidth").value),
    steps: Number($("imgSteps").value), guidance: Number($("guidance").value),
    maxSequenceLength: Number($("maxSeqLen").value), seed: Number($("imgSeed").value), ...opts,
  };
  $("imagePrompt").value = o.prompt;
  for (const [k, id] of [["height", "imgHeight"], ["width", "imgWidth"], ["steps", "imgSteps"], ["guidance", "guidance"], ["maxSequenceLength", "maxSeqLen"], ["seed", "imgSeed"]]) $(id).value = o[k];
  chart.rows = []; drawChart();
  $("output").textContent = "";
  let stop = () => {};
  try {
    const r = await nb.generateImage(o, (ev) => {
      if (ev.type === "plans") {
        $("plan").textContent = ev.plans.map((p, i) => `phase ${i + 1} of ${ev.plans.length}, ${p.phase}:\n${p.text}`).join("");
        const dit = ev.plans.find((p) => p.phase === "transformer");
        stop = watchStep(dit ? dit.streamed_bytes_per_step : 0);
      } else if (ev.type === "phase") {
        $("runStatus").textContent = ev.state === "done"
          ? `${ev.phase} done in ${ev.ms.toFixed(0)} ms, ${fmt(ev.bytes_streamed)} streamed`
          : ev.state === "cached" ? `${ev.phase}: from the cache` : `${ev.phase} …`;
        $("output").textContent += `${$("runStatus").textContent}\n`;
      } else if (ev.type === "step") {
        chart.rows.push(ev);
        drawChart();
        $("runStatus").textContent =
          `step ${ev.step} of ${ev.steps}: ${ev.wall_ms.toFixed(0)} ms, ${fmt(ev.bytes_streamed)} streamed, stall ${ev.stall_ms.toFixed(0)} ms`;
      }
    });
    paint(r.rgb, r.width, r.height);
    $("runStatus").textContent =
      `${r.width} x ${r.height} image; streamed ${fmt(r.weight_bytes)} (plan: ${fmt(r.predicted_weight_bytes)})`;
    return r;
  } finally { stop(); }
}

// A Wan folder: umT5, the transformer (both guidance sequences in one pass over the weights per
// step) and the causal VAE; each frame is painted as the VAE decodes it, then the whole video
// plays in the canvas at Wan's 16 frames a second.
export async function runVideo(opts = {}) {
  const o = {
    prompt: $("imagePrompt").value, height: Number($("imgHeight").value), width: Number($("imgWidth").value),
    frames: Number($("vidFrames").value), steps: Number($("imgSteps").value), guidance: Number($("guidance").value),
    maxSequenceLength: Number($("maxSeqLen").value), seed: Number($("imgSeed").value), ...opts,
  };
  if (!("negativePrompt" in opts) && $("negPrompt").value) o.negativePrompt = $("negPrompt").value;
  for (const [k, id] of [["height", "imgHeight"], ["width", "imgWidth"], ["frames", "vidFrames"], ["steps", "imgSteps"], ["guidance", "guidance"], ["maxSequenceLength", "maxSeqLen"], ["seed", "imgSeed"]]) $(id).value = o[k];
  stopPlayback();
  chart.rows = []; drawChart();
  $("output").textContent = "";
  const shown = [];
  let stop = () => {};
  try {
    const r = await nb.generateVideo(o, (ev) => {
      if (ev.type === "plans") {
        $("plan").textContent = ev.plans.map((p, i) => `phase ${i + 1} of ${ev.plans.length}, ${p.phase}:\n${p.text}`).join("");
        const dit = ev.plans.find((p) => p.phase === "transformer");
        stop = watchStep(dit ? dit.streamed_bytes_per_step : 0);
      } else if (ev.type === "phase") {
        $("runStatus").textContent = ev.state === "done"
          ? `${ev.phase} done in ${ev.ms.toFixed(0)} ms, ${fmt(ev.bytes_streamed)} streamed` : `${ev.phase} …`;
        $("output").textContent += `${$("runStatus").textContent}\n`;
      } else if (ev.type === "step") {
        chart.rows.push(ev);
        drawChart();
        $("runStatus").textContent =
          `step ${ev.step} of ${ev.steps}: ${ev.wall_ms.toFixed(0)} ms, ${fmt(ev.bytes_streamed)} streamed, stall ${ev.stall_ms.toFixed(0)} ms`;
      } else if (ev.type === "frames") {
        // Show each decoded frame as it comes.
        const per = ev.width * ev.height * 3;
        for (let k = 0; k < ev.count; k++) {
          paint(ev.rgb.subarray(k * per, (k + 1) * per), ev.width, ev.height);
          shown.push(ev.first + k);
        }
        $("videoStatus").hidden = false;
        $("videoStatus").textContent = `decoded frames ${ev.first + 1}-${ev.first + ev.count} of ${ev.total}`;
      }
    });
    window.nibbleDemo.framesShown = shown;
    $("runStatus").textContent =
      `${r.frames} frames of ${r.width} x ${r.height}; streamed ${fmt(r.weight_bytes)}` +
      (r.predicted_weight_bytes == null ? "" : ` (plan: ${fmt(r.predicted_weight_bytes)})`);
    play(r.rgb, r.frames, r.width, r.height);
    return r;
  } finally { stop(); }
}

// Plays [n, h, w, 3] frames in the image canvas in a loop at 16 frames a second.
let playback = null;
function play(rgb, n, w, h) {
  const per = w * h * 3;
  let k = 0;
  playback = setInterval(() => {
    paint(rgb.subarray(k * per, (k + 1) * per), w, h);
    $("videoStatus").textContent = `playing: frame ${k + 1} of ${n} (16 fps)`;
    k = (k + 1) % n;
  }, 1000 / 16);
}
function stopPlayback() {
  if (playback !== null) clearInterval(playback);
  playback = null;
}

// 8-bit RGB [h, w, 3] into the image canvas.
function paint(rgb, w, h) {
  const c = $("image");
  c.width = w; c.height = h;
  const img = new ImageData(w, h);
  for (let i = 0; i < w * h; i++) {
    img.data[4 * i] = rgb[3 * i];
    img.data[4 * i + 1] = rgb[3 * i + 1];
    img.data[4 * i + 2] = rgb[3 * i + 2];
    img.data[4 * i + 3] = 255;
  }
  c.getContext("2d").putImageData(img, 0, 0);
}

async function main() {
  await init();
  nb = new Nibble();
  window.nibbleDemo = { nb, openModel, openPipeline, showPlan, runLlm, runDit, runPipeline, runVideo, stopPlayback, promptIds };
  try {
    const a = await nb.adapter();
    // Browsers give wgpu no adapter name; ask WebGPU itself for vendor and architecture.
    if (!a.name || a.name === "(Cpu)" || a.name.startsWith("(")) {
      const info = (await navigator.gpu?.requestAdapter())?.info;
      if (info) a.name = [info.vendor, info.architecture, info.description].filter(Boolean).join(" ") || a.name;
    }
    $("adapter").textContent =
      `WebGPU adapter: ${a.name || "(unnamed)"}; max storage binding ${fmt(a.limits.max_storage_buffer_binding_size)}, ` +
      `max buffer ${fmt(a.limits.max_buffer_size)}, ${a.limits.max_storage_buffers_per_shader_stage} storage buffers per stage, ` +
      `${a.limits.max_compute_invocations_per_workgroup} invocations per workgroup`;
    window.nibbleDemo.adapter = a;
  } catch (e) {
    $("adapter").hidden = true;
    $("nowebgpu").hidden = false;
    $("nowebgpu").textContent = String(e.message ?? e);
    window.nibbleDemo.error = String(e.message ?? e);
  }
  const params = new URLSearchParams(location.search);
  if (params.get("model")) $("url").value = params.get("model");
  if (params.get("open") !== null) $("load").click();
  $("settings").addEventListener("submit", (ev) => {
    ev.preventDefault();
    openModel($("url").value.trim()).catch((e) => { $("openStatus").textContent = `error: ${e.message ?? e}`; });
  });
  $("showPlan").addEventListener("click", () => {
    if (model?.kind === "pipeline" || model?.kind === "video") {
      $("plan").textContent = "(a pipeline's four plans are printed when the run starts, before any weight byte is read)";
      return;
    }
    const o = model?.kind === "llm"
      ? { promptTokens: promptIds().length, maxTokens: Number($("maxTokens").value) }
      : { height: Number($("height").value), width: Number($("width").value), textTokens: Number($("textTokens").value) };
    showPlan({ ...settings(), ...o }).catch((e) => { $("plan").textContent = `error: ${e.message ?? e}`; });
  });
  $("run").addEventListener("click", () => {
    const p = model?.kind === "video" ? runVideo({ ...settings() }) : model?.kind === "pipeline" ? runPipeline({ ...settings() }) : model?.kind === "llm"
      ? runLlm(promptIds(), {
        ...settings(), stopAtEos: $("stopAtEos").checked,
        temperature: Number($("temperature").value), topK: Number($("topK").value),
        topP: Number($("topP").value), seed: Number($("sampleSeed").value),
      })
      : runDit(settings());
    p.catch((e) => { $("runStatus").textContent = `error: ${e.message ?? e}`; });
  });
  window.nibbleDemo.ready = true;
}

// The prompt as token ids: the text through the model's tokenizer (and chat template), or the
// ids typed in for models without a tokenizer.
function promptIds() {
  if (model?.tokenizer) return Array.from(nb.tokenize($("prompt").value, $("chat").checked));
  return $("promptIds").value.split(/[\s,]+/).filter(Boolean).map(Number);
}

main();
