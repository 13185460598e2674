// llama.cpp (node-llama-cpp's prebuilt CPU binaries) decoding C sequences of one context at once:
// node-llama-cpp batches the sequences' pending tokens into one llama_decode per step, as
// llama.cpp's server does. Each sequence: its own short prompt, then M greedy tokens. Prints one
// JSON line: aggregate decode tok/s (all tokens after each sequence's first, from the first
// sequence's first token to the last one's end), mean per-sequence tok/s, mean time to first token.
//   node llamacpp-serve-bench.mjs MODEL.gguf C M T
import {getLlama} from "node-llama-cpp";

const [modelPath, cStr, mStr, tStr] = process.argv.slice(2);
const [conc, nGen, threads] = [+cStr, +mStr, +tStr];
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath, gpuLayers: 0});
const context = await model.createContext({threads, sequences: conc, contextSize: 512 * conc, batchSize: 512});
const topics = ["the sea", "a mountain", "the city at night", "a library", "the desert", "a forest",
    "a train journey", "the moon", "a market", "winter", "a garden", "the river", "a lighthouse",
    "an old clock", "the harbour", "a storm"];
const t0 = performance.now();
const runs = await Promise.all([...Array(conc).keys()].map(async (i) => {
    const seq = context.getSequence();
    const toks = model.tokenize(`<|im_start|>user\nTell a story about ${topics[i % topics.length]}.<|im_end|>\n<|im_start|>assistant\n`, true);
    let n = 0, first = 0;
    for await (const _ of seq.evaluate(toks, {temperature: 0})) {
        n++;
        if (n === 1) first = performance.now();
        if (n >= nGen) break;
    }
    return {first, end: performance.now(), n};
}));
const first = Math.min(...runs.map((r) => r.first));
const last = Math.max(...runs.map((r) => r.end));
const decoded = runs.reduce((a, r) => a + r.n - 1, 0);
console.log(JSON.stringify({
    clients: conc,
    aggregate_tok_s: decoded / ((last - first) / 1000),
    per_request_tok_s: runs.reduce((a, r) => a + (r.n - 1) / ((r.end - r.first) / 1000), 0) / conc,
    ttft_mean_s: runs.reduce((a, r) => a + (r.first - t0) / 1000, 0) / conc,
}));
process.exit(0);
