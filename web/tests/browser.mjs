// Browser test: headless Chromium (Debian's) on WebGPU (SwiftShader), driven by playwright-core.
// The demo page loads the shared fixtures over HTTP Range from `nibble serve` and must
//   1. generate tiny-llama's greedy tokens (fixture: greedy_tokens_deq, as many as it holds), every
//      layer streamed through 2 x 64 KiB slots;
//   2. run tiny-dit's Euler loop (as many steps as the fixture's euler_sigmas minus one) from
//      euler_x0 to within 1e-4 x max of euler_final;
//   2b. open tiny-flux-pipeline/pipeline and paint each prompt's image, which must equal the PNG
//      diffusers wrote (within 1 per channel, >= 99% equal);
//   2c. open tiny-wan-pipeline/pipeline and make the recorded video, each frame painted as the VAE
//      decodes it, the video equal to diffusers' 8-bit frames (within 1, >= 99% equal);
// and for all: the weight bytes fetched equal the plan's prediction (resident once + streamed
// bytes per step x steps), the opening reads equal 8 + header per file plus the quant-state
// tensors, and no request to a weight file comes without a Range header. Saves a screenshot.
//
//   node web/tests/browser.mjs NIBBLE_BINARY FIXTURES_DIR OUT_DIR
import { spawn, execFileSync } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, mkdirSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { createRequire } from "node:module";

const [nibbleBin, fixturesDir, outDir] = process.argv.slice(2).map((p) => resolve(p));
const require = createRequire(process.env.PLAYWRIGHT_DIR ? join(process.env.PLAYWRIGHT_DIR, "x.js") : import.meta.url);
const { chromium } = require("playwright-core");

// A minimal safetensors reader (header JSON + little-endian data).
function readSafetensors(path) {
  const b = readFileSync(path);
  const n = Number(b.readBigUInt64LE(0));
  const header = JSON.parse(b.subarray(8, 8 + n).toString("utf8"));
  const data = 8 + n;
  const get = (name) => {
    const t = header[name];
    if (!t) throw new Error(`${path}: no tensor ${name}`);
    const [s, e] = t.data_offsets;
    const bytes = b.subarray(data + s, data + e);
    const ab = bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength);
    if (t.dtype === "F32") return Array.from(new Float32Array(ab));
    if (t.dtype === "I64") return Array.from(new BigInt64Array(ab), Number);
    throw new Error(`${name}: dtype ${t.dtype}`);
  };
  return { header, headerLen: n, get };
}

// What opening a model must read: 8 + header bytes, plus every quant-state component tensor.
function openBytes(modelFile) {
  const st = readSafetensors(modelFile);
  let bytes = 8 + st.headerLen;
  for (const [name, t] of Object.entries(st.header)) {
    if (name === "__metadata__") continue;
    // Only the quant-state JSONs: absmax and code tables stream with their groups.
    if (/\.quant_state\.bitsandbytes__(nf4|fp4)$/.test(name)) {
      bytes += t.data_offsets[1] - t.data_offsets[0];
    }
  }
  return bytes;
}

const results = [];
function check(name, ok, detail) {
  results.push({ name, ok, detail });
  console.log(`${ok ? "ok  " : "FAIL"} ${name}${detail ? `: ${detail}` : ""}`);
}

async function startServer() {
  const www = resolve("web/www");
  const mounts = ["--mount", `fixtures=${fixturesDir}`];
  if (existsSync("models")) mounts.push("--mount", `models=${resolve("models")}`);
  const srv = spawn(nibbleBin, ["serve", www, ...mounts, "--addr", "127.0.0.1:0"], {
    stdio: ["ignore", "pipe", "inherit"],
  });
  const base = await new Promise((res, rej) => {
    let buf = "";
    srv.stdout.on("data", (d) => {
      buf += d;
      const m = buf.match(/at (http:\/\/127\.0\.0\.1:\d+)\//);
      if (m) res(m[1]);
    });
    srv.on("exit", (c) => rej(new Error(`nibble serve exited with ${c}`)));
    setTimeout(() => rej(new Error("nibble serve did not start")), 20000);
  });
  return { srv, base };
}

const flags = [
  "--headless=new", "--no-sandbox", "--disable-quic", "--no-first-run", "--disable-background-networking",
  "--disable-component-update", "--disable-sync", "--enable-unsafe-webgpu",
];

async function main() {
  mkdirSync(outDir, { recursive: true });
  const { srv, base } = await startServer();
  const userDir = mkdtempSync(join(tmpdir(), "nibble-chromium-"));
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    ignoreDefaultArgs: true,
    args: [...flags, `--user-data-dir=${userDir}`, "--remote-debugging-pipe"],
  });
  const report = {};
  try {
    const page = await browser.newPage({ viewport: { width: 1000, height: 1400 } });
    const weightRequests = [];
    page.on("request", (r) => {
      if (r.url().endsWith(".safetensors")) weightRequests.push({ url: r.url(), range: r.headers()["range"] ?? null });
    });
    page.on("console", (m) => { if (m.type() === "error" || m.type() === "warning") console.log(`[page ${m.type()}] ${m.text()}`); });
    page.on("pageerror", (e) => console.log(`[page error] ${e.message}`));
    await page.goto(`${base}/`);
    await page.waitForFunction(() => window.nibbleDemo?.ready === true, null, { timeout: 120000 });
    const adapter = await page.evaluate(() => window.nibbleDemo.adapter ?? null);
    const err = await page.evaluate(() => window.nibbleDemo.error ?? null);
    check("WebGPU adapter", !!adapter, adapter ? adapter.name : err);
    if (!adapter) throw new Error(`no WebGPU adapter: ${err}`);
    report.adapter = adapter;
    const mem = { deviceBudget: "min", slots: 2, slotBytes: 65536 };

    // 1. tiny-llama: the fixture's greedy tokens (one pass for the prompt, one per further token).
    const llamaDir = join(fixturesDir, "tiny-llama-nf4");
    const exp = readSafetensors(join(llamaDir, "expected.safetensors"));
    const prompt = exp.get("prompt_ids");
    const want = exp.get("greedy_tokens_deq");
    const nTokens = want.length;
    if (nTokens < 1) throw new Error("greedy_tokens_deq is empty");
    const llamaUrl = `${base}/fixtures/tiny-llama-nf4/model`;
    const before = await page.evaluate(() => window.nibbleDemo.nb.stats().bytes);
    await page.evaluate(([u, m]) => window.nibbleDemo.openModel(u, m), [llamaUrl, mem]);
    const afterOpen = await page.evaluate(() => window.nibbleDemo.nb.stats().bytes);
    const opened = await page.evaluate(() => window.nibbleDemo.lastModel);
    check("tiny-llama load plans before any weight is read",
      afterOpen.weights === before.weights && opened.plan && opened.plan.streamed_bytes_per_step > 0,
      `${afterOpen.weights - before.weights} weight bytes read while opening; plan ${opened.plan ? opened.plan.streamed_bytes_per_step : "missing"} bytes per step`);
    const wantOpen = openBytes(join(llamaDir, "model/model.safetensors"));
    const gotOpen = afterOpen.header + afterOpen.quant_state - before.header - before.quant_state;
    check("tiny-llama opening reads 8 + header + the quant-state JSONs", gotOpen === wantOpen, `${gotOpen} bytes, expected ${wantOpen}`);
    const t0 = Date.now();
    const r = await page.evaluate(([p, m, n]) => window.nibbleDemo.runLlm(p, { ...m, maxTokens: n, stopAtEos: false }), [prompt, mem, nTokens]);
    const wall = (Date.now() - t0) / 1000;
    check("tiny-llama greedy tokens equal greedy_tokens_deq", JSON.stringify(r.tokens) === JSON.stringify(want),
      `got [${r.tokens}], want [${want}]`);
    check("tiny-llama every group streamed", r.plan.resident_groups === 0 && r.plan.streamed_groups > 0,
      `${r.plan.resident_groups} resident, ${r.plan.streamed_groups} streamed`);
    check("tiny-llama weight bytes fetched equal the plan's prediction", r.weight_bytes === r.predicted_weight_bytes && r.passes === nTokens,
      `${r.weight_bytes} fetched, ${r.predicted_weight_bytes} predicted (${r.passes} passes x ${r.plan.streamed_bytes_per_step})`);
    report.llama = { tokens: r.tokens, prefill_tok_s: r.prefill_tok_s, decode_tok_s: r.decode_tok_s, wall_s: wall,
      weight_bytes: r.weight_bytes, predicted: r.predicted_weight_bytes, open_bytes: gotOpen };
    await page.screenshot({ path: join(outDir, "browser-llama.png"), fullPage: true });

    // 1b. Sampling runs the same loop as `nibble run`: the same temperature, top-k, top-p and seed
    // give the CLI's tokens (the CLI on its CPU backend, the page on WebGPU).
    const samp = { temperature: 0.9, topK: 40, topP: 0.95, seed: 1234 };
    const cliOut = execFileSync(nibbleBin, [
      "run", "--model", join(llamaDir, "model"), "--prompt-ids", Array.from(prompt).join(","),
      "--max-tokens", String(nTokens), "--ignore-eos", "--backend", "cpu", "--json",
      "--temperature", String(samp.temperature), "--top-k", String(samp.topK),
      "--top-p", String(samp.topP), "--seed", String(samp.seed),
    ]);
    const cliTokens = JSON.parse(cliOut.toString()).tokens;
    const rs = await page.evaluate(([p, m, n, sm]) => window.nibbleDemo.runLlm(p, { ...m, ...sm, maxTokens: n, stopAtEos: false }),
      [prompt, mem, nTokens, samp]);
    check("tiny-llama sampled tokens equal nibble run's for the same seed", JSON.stringify(rs.tokens) === JSON.stringify(cliTokens),
      `page [${rs.tokens}], nibble run [${cliTokens}]`);
    check("tiny-llama sampling is in force (the sampled tokens are not the greedy ones)",
      JSON.stringify(rs.tokens) !== JSON.stringify(Array.from(want)), `[${rs.tokens}]`);
    report.llama_sampled = { tokens: rs.tokens, cli: cliTokens, ...samp };

    // 1c. LoRA adapters by URL (the `lora` setting, as `--lora`): two peft folders give peft's
    // greedy tokens; the adapters stay resident and every step fetches the base's bytes.
    const loraExp = readSafetensors(join(llamaDir, "lora/expected.safetensors"));
    const loraWant = loraExp.get("both.greedy_tokens");
    const loraUrls = ["attn_qv", "all_linear"].map((a) => `${base}/fixtures/tiny-llama-nf4/lora/${a}`);
    await page.evaluate(([u, m]) => window.nibbleDemo.openModel(u, m), [llamaUrl, { ...mem, lora: loraUrls }]);
    const rl = await page.evaluate(([p, m, n]) => window.nibbleDemo.runLlm(p, { ...m, maxTokens: n, stopAtEos: false }),
      [prompt, mem, loraWant.length]);
    check("tiny-llama with two peft adapters by URL: peft's greedy tokens", JSON.stringify(rl.tokens) === JSON.stringify(loraWant),
      `got [${rl.tokens}], want [${loraWant}]`);
    check("tiny-llama with adapters: both resident, the base streamed with the same bytes per step",
      rl.plan.resident_groups === 2 && rl.plan.streamed_bytes_per_step === r.plan.streamed_bytes_per_step
        && rl.weight_bytes === rl.predicted_weight_bytes,
      `${rl.plan.resident_groups} resident, ${rl.plan.streamed_bytes_per_step} bytes per step (base ${r.plan.streamed_bytes_per_step}), ${rl.weight_bytes} fetched of ${rl.predicted_weight_bytes} predicted`);

    // 2. tiny-dit: the Euler loop, one step per interval of the fixture's sigma schedule.
    const ditDir = join(fixturesDir, "tiny-dit-nf4");
    const e = readSafetensors(join(ditDir, "expected.safetensors"));
    const inputs = {
      hidden_states: e.get("euler_x0"), encoder_hidden_states: e.get("encoder_hidden_states"),
      pooled_projections: e.get("pooled_projections"), guidance: e.get("guidance"),
      img_ids: e.get("img_ids"), txt_ids: e.get("txt_ids"),
    };
    const final = e.get("euler_final");
    const ditSteps = e.get("euler_sigmas").length - 1;
    if (ditSteps < 1) throw new Error("euler_sigmas holds fewer than 2 sigmas");
    const b1 = await page.evaluate(() => window.nibbleDemo.nb.stats().bytes);
    await page.evaluate(([u, m]) => window.nibbleDemo.openModel(u, m), [`${base}/fixtures/tiny-dit-nf4/model`, mem]);
    const b2 = await page.evaluate(() => window.nibbleDemo.nb.stats().bytes);
    const wantDitOpen = openBytes(join(ditDir, "model/diffusion_pytorch_model.safetensors"));
    const gotDitOpen = b2.header + b2.quant_state - b1.header - b1.quant_state;
    check("tiny-dit opening reads 8 + header + the quant-state JSONs", gotDitOpen === wantDitOpen, `${gotDitOpen} bytes, expected ${wantDitOpen}`);
    const t1 = Date.now();
    const d = await page.evaluate(async ([inp, m, steps]) => {
      const r = await window.nibbleDemo.runDit({ ...m, steps, inputs: inp });
      return { ...r, latent: Array.from(r.latent) };
    }, [inputs, mem, ditSteps]);
    const ditWall = (Date.now() - t1) / 1000;
    const maxAbs = Math.max(...final.map(Math.abs));
    const maxErr = Math.max(...final.map((v, i) => Math.abs(v - d.latent[i])));
    check(`tiny-dit ${ditSteps}-step Euler final within 1e-4 x max of euler_final`,
      d.latent.length === final.length && d.steps.length === ditSteps && maxErr <= 1e-4 * maxAbs, `max error ${(maxErr / maxAbs).toExponential(2)} x max`);
    check("tiny-dit weight bytes fetched equal the plan's prediction", d.weight_bytes === d.predicted_weight_bytes,
      `${d.weight_bytes} fetched, ${d.predicted_weight_bytes} predicted (${ditSteps} x ${d.plan.streamed_bytes_per_step})`);
    report.dit = { steps: d.steps, wall_s: ditWall, rel_err: maxErr / maxAbs, weight_bytes: d.weight_bytes, predicted: d.predicted_weight_bytes };

    // 2b. The Flux pipeline folder: prompt to image through CLIP, T5, the transformer and the VAE
    // on WebGPU, every phase streamed; the image painted into the page's canvas equals the PNG
    // diffusers wrote (every channel within 1, at least 99% equal), and the weight bytes fetched
    // equal the four plans' prediction.
    const fluxDir = join(fixturesDir, "tiny-flux-pipeline");
    const man = JSON.parse(readFileSync(join(fluxDir, "manifest.json"), "utf8"));
    const fluxUrl = `${base}/fixtures/tiny-flux-pipeline/pipeline`;
    const fm = await page.evaluate(([u, m]) => window.nibbleDemo.openModel(u, m), [fluxUrl, mem]);
    check("tiny-flux-pipeline opens as a pipeline", fm.kind === "pipeline" && fm.components.length === 4,
      JSON.stringify(fm.components));
    report.flux = [];
    for (const pr of man.prompts) {
      const t3 = Date.now();
      const img = await page.evaluate(async ([o, m]) => {
        const r = await window.nibbleDemo.runPipeline({ ...m, ...o });
        const c = document.getElementById("image");
        const got = Array.from(c.getContext("2d").getImageData(0, 0, c.width, c.height).data);
        const png = await (await fetch(o.png)).blob();
        const bmp = await createImageBitmap(png);
        const ref = new OffscreenCanvas(bmp.width, bmp.height).getContext("2d");
        ref.drawImage(bmp, 0, 0);
        const want = Array.from(ref.getImageData(0, 0, bmp.width, bmp.height).data);
        return { w: r.width, h: r.height, rw: bmp.width, rh: bmp.height, got, want, steps: r.steps.length,
          phases: r.phases.map((p) => p.phase), plans: r.plans.map((p) => ({ phase: p.phase, streamed: p.streamed_groups, resident: p.resident_groups })),
          weight_bytes: r.weight_bytes, predicted: r.predicted_weight_bytes };
      }, [{ prompt: pr.text, height: man.run.height, width: man.run.width, steps: man.run.num_inference_steps,
        guidance: man.run.guidance_scale, maxSequenceLength: man.run.max_sequence_length, seed: pr.generator_seed,
        png: `${base}/fixtures/tiny-flux-pipeline/images/p${pr.index}.png` }, mem]);
      let within = img.got.length === img.want.length, equal = 0, n = 0, worst = 0;
      for (let i = 0; within && i < img.got.length; i++) {
        if (i % 4 === 3) continue;
        const d = Math.abs(img.got[i] - img.want[i]);
        worst = Math.max(worst, d);
        if (d === 0) equal++;
        n++;
      }
      within = within && worst <= 1;
      check(`tiny-flux-pipeline p${pr.index}: the painted image equals diffusers' PNG (within 1, >= 99% equal)`,
        img.w === img.rw && img.h === img.rh && within && equal >= 0.99 * n,
        `${img.w} x ${img.h} (PNG ${img.rw} x ${img.rh}), worst difference ${worst}, ${(100 * equal / Math.max(n, 1)).toFixed(2)}% equal`);
      check(`tiny-flux-pipeline p${pr.index}: four phases, every one streamed, bytes fetched equal the plans'`,
        JSON.stringify(img.phases) === JSON.stringify(["CLIP", "T5", "transformer", "VAE"]) && img.steps === man.run.num_inference_steps &&
        img.plans.every((p) => p.streamed > 0) && img.weight_bytes === img.predicted,
        `${JSON.stringify(img.plans)}; ${img.weight_bytes} weight bytes fetched, ${img.predicted} predicted`);
      report.flux.push({ prompt: pr.index, wall_s: (Date.now() - t3) / 1000, worst, equal_pct: 100 * equal / Math.max(n, 1),
        weight_bytes: img.weight_bytes, predicted: img.predicted, plans: img.plans });
    }
    await page.screenshot({ path: join(outDir, "browser-flux.png"), fullPage: true });

    // 2c. The Wan 2.1 folder: prompt to video through umT5, the transformer (both guidance
    // sequences in one pass) and the causal VAE on WebGPU, every phase streamed; the frames reach
    // the page as the VAE decodes them, and the video equals diffusers' 8-bit frames (within 1, at
    // least 99% equal); the weight bytes fetched equal the three plans' prediction.
    const wanDir = join(fixturesDir, "tiny-wan-pipeline");
    const wman = JSON.parse(readFileSync(join(wanDir, "manifest.json"), "utf8"));
    const wanUrl = `${base}/fixtures/tiny-wan-pipeline/pipeline`;
    const wm = await page.evaluate(([u, m]) => window.nibbleDemo.openModel(u, m), [wanUrl, mem]);
    check("tiny-wan-pipeline opens as a video folder", wm.kind === "video" && wm.components.length === 3,
      JSON.stringify(wm.components));
    const expected = readFileSync(join(wanDir, "expected.safetensors"));
    const hlen = Number(expected.readBigUInt64LE(0));
    const header = JSON.parse(expected.subarray(8, 8 + hlen).toString("utf8"));
    const wpr = wman.prompts[0];
    const vu8 = header["p0.video_u8"];
    const wantU8 = expected.subarray(8 + hlen + vu8.data_offsets[0], 8 + hlen + vu8.data_offsets[1]);
    const t4 = Date.now();
    const vid = await page.evaluate(async ([o, m]) => {
      const r = await window.nibbleDemo.runVideo({ ...m, ...o });
      window.nibbleDemo.stopPlayback();
      return { frames: r.frames, w: r.width, h: r.height, rgb: Array.from(r.rgb), steps: r.steps.length,
        shown: window.nibbleDemo.framesShown, phases: r.phases.map((p) => p.phase),
        plans: r.plans.map((p) => ({ phase: p.phase, streamed: p.streamed_groups })),
        weight_bytes: r.weight_bytes, predicted: r.predicted_weight_bytes };
    }, [{ prompt: wpr.text, negativePrompt: wpr.negative_prompt, height: wman.run.height, width: wman.run.width,
      frames: wman.run.num_frames, steps: wman.run.num_inference_steps, guidance: wman.run.guidance_scale,
      maxSequenceLength: wman.run.max_sequence_length, seed: wpr.generator_seed }, mem]);
    let vworst = 0, vequal = 0;
    const vsame = vid.rgb.length === wantU8.length;
    for (let i = 0; vsame && i < vid.rgb.length; i++) {
      const d = Math.abs(vid.rgb[i] - wantU8[i]);
      vworst = Math.max(vworst, d);
      if (d === 0) vequal++;
    }
    check("tiny-wan-pipeline p0: the video equals diffusers' 8-bit frames (within 1, >= 99% equal)",
      vsame && vid.frames === wman.run.num_frames && vworst <= 1 && vequal >= 0.99 * vid.rgb.length,
      `${vid.frames} frames of ${vid.w} x ${vid.h}, worst difference ${vworst}, ${(100 * vequal / Math.max(vid.rgb.length, 1)).toFixed(2)}% equal`);
    check("tiny-wan-pipeline p0: every frame shown as it was decoded, before the run ended",
      JSON.stringify(vid.shown) === JSON.stringify([...Array(wman.run.num_frames).keys()]), JSON.stringify(vid.shown));
    check("tiny-wan-pipeline p0: three phases, every one streamed, bytes fetched equal the plans'",
      JSON.stringify(vid.phases) === JSON.stringify(["text encoder", "transformer", "VAE"]) &&
      vid.steps === wman.run.num_inference_steps && vid.plans.every((p) => p.streamed > 0) && vid.weight_bytes === vid.predicted,
      `${JSON.stringify(vid.plans)}; ${vid.weight_bytes} weight bytes fetched, ${vid.predicted} predicted`);
    report.wan = { wall_s: (Date.now() - t4) / 1000, worst: vworst, equal_pct: 100 * vequal / Math.max(vid.rgb.length, 1),
      weight_bytes: vid.weight_bytes, predicted: vid.predicted, plans: vid.plans };
    await page.screenshot({ path: join(outDir, "browser-wan.png"), fullPage: true });

    // 3. SmolLM2-135M-Instruct (when scripts/get-smollm2.sh has converted it): the tokenizer and
    // chat template in wasm give transformers' prompt ids; 8 greedy tokens (within the robust
    // prefix) equal transformers' and say Paris, with part of the model streamed each token.
    const smolDir = resolve("models/smollm2-135m-nf4");
    if (existsSync(join(smolDir, "model.safetensors"))) {
      const ref = JSON.parse(readFileSync(join(fixturesDir, "smollm2/reference.json"), "utf8")).prompts[0];
      const smolMem = { deviceBudget: "140MiB", slots: 4, slotBytes: 4 << 20 };
      const m = await page.evaluate(([u, mm]) => window.nibbleDemo.openModel(u, mm), [`${base}/models/smollm2-135m-nf4`, smolMem]);
      check("SmolLM2 tokenizer and chat template load in wasm", m.tokenizer && m.chat_template, JSON.stringify({ tokenizer: m.tokenizer, chat: m.chat_template }));
      const ids = await page.evaluate((msg) => Array.from(window.nibbleDemo.nb.tokenize(msg, true)), ref.user_message);
      check("SmolLM2 chat prompt ids equal transformers'", JSON.stringify(ids) === JSON.stringify(ref.prompt_ids), `${ids.length} ids`);
      // 8 tokens, or fewer where the reference's robust prefix (margin >= 0.05) is shorter.
      const n = Math.min(8, ref.nf4.robust_prefix_len["0.05"] ?? 8);
      const t2 = Date.now();
      const g = await page.evaluate(([p, mm, n]) => window.nibbleDemo.runLlm(p, { ...mm, maxTokens: n, stopAtEos: false }), [ref.prompt_ids, smolMem, n]);
      const text = await page.evaluate((t) => window.nibbleDemo.nb.detokenize(Uint32Array.from(t)), g.tokens);
      check("SmolLM2 greedy tokens equal transformers' (robust prefix)", JSON.stringify(g.tokens) === JSON.stringify(ref.nf4.greedy_ids.slice(0, n)),
        `got [${g.tokens}] "${text}"`);
      check("SmolLM2 says Paris", /Paris/.test(text), JSON.stringify(text));
      check("SmolLM2 streams part of the model each token", g.plan.streamed_groups > 0 && g.weight_bytes === g.predicted_weight_bytes,
        `${g.plan.resident_groups} groups resident, ${g.plan.streamed_groups} streamed; ${g.weight_bytes} weight bytes fetched, ${g.predicted_weight_bytes} predicted`);
      report.smollm2 = { text, tokens: g.tokens, prefill_tok_s: g.prefill_tok_s, decode_tok_s: g.decode_tok_s, wall_s: (Date.now() - t2) / 1000,
        weight_bytes: g.weight_bytes, plan: { resident: g.plan.resident_groups, streamed: g.plan.streamed_groups, per_token: g.plan.streamed_bytes_per_step } };
      await page.screenshot({ path: join(outDir, "browser-smollm2.png"), fullPage: true });
    } else {
      console.log("skip SmolLM2 in the browser: models/smollm2-135m-nf4 is missing (scripts/get-smollm2.sh converts it)");
    }

    // A server that never answers: each attempt is aborted after the response timeout and
    // tried again, then the load fails with an error that says so (instead of hanging).
    let stalled = 0;
    await page.route("**/stall/**", () => { stalled += 1; });
    const stall = await page.evaluate(async (u) => {
      const nb = window.nibbleDemo.nb;
      nb.setFetchTimeout(300);
      const t0 = performance.now();
      try {
        await nb.load(u, { deviceBudget: "min", slots: 2, slotBytes: 65536 });
        return { ok: true };
      } catch (e) {
        return { ok: false, msg: String(e?.message ?? e), ms: Math.round(performance.now() - t0) };
      } finally {
        nb.setFetchTimeout(30000);
      }
    }, `${base}/stall/model`);
    check("a server that never answers: 4 attempts aborted after the timeout, then a clear error",
      !stall.ok && /no response within 300 ms/.test(stall.msg) && /4 attempts/.test(stall.msg) && stalled === 4,
      `${JSON.stringify(stall)}, ${stalled} requests`);

    // Requests: every read of a weight file was a Range request (seen by the browser and by the page).
    const stats = await page.evaluate(() => window.nibbleDemo.nb.stats());
    const unranged = weightRequests.filter((q) => !q.range);
    check("no request to a weight file without Range", unranged.length === 0 && stats.weight_file_requests_without_range === 0,
      `${weightRequests.length} requests to .safetensors files, ${unranged.length} without Range`);
    report.requests = { weight_file_requests: weightRequests.length, bytes: stats.bytes };
    const shot = join(outDir, "browser-demo.png");
    await page.screenshot({ path: shot, fullPage: true });
    report.screenshot = shot;
  } catch (e) {
    check("browser run", false, String(e.stack ?? e));
  } finally {
    await browser.close();
    srv.kill();
  }
  writeFileSync(join(outDir, "browser-report.json"), JSON.stringify(report, null, 2));
  const failed = results.filter((r) => !r.ok).length;
  console.log(`report: ${join(outDir, "browser-report.json")}`);
  if (report.smollm2) console.log(`SmolLM2 in Chromium: "${report.smollm2.text}" prompt ${report.smollm2.prefill_tok_s.toFixed(1)} tok/s, decode ${report.smollm2.decode_tok_s.toFixed(2)} tok/s`);
  if (report.llama) console.log(`tiny-llama in Chromium (SwiftShader): prompt ${report.llama.prefill_tok_s.toFixed(1)} tok/s, decode ${report.llama.decode_tok_s.toFixed(2)} tok/s, ${report.llama.weight_bytes} weight bytes fetched`);
  console.log(`${results.length - failed} passed, ${failed} failed`);
  process.exit(failed ? 1 : 0);
}

main().catch((e) => { console.error(e); process.exit(1); });
