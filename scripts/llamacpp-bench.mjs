// llama.cpp (through node-llama-cpp's prebuilt CPU binaries) on a GGUF: prompt tokens/s for a
// prompt of N tokens and decode tokens/s for M generated tokens, greedy, T threads. Prints one
// JSON line, with the prompt's token ids so that nibble can run the same prompt.
//   node llamacpp-bench.mjs MODEL.gguf N M T
import {getLlama} from "node-llama-cpp";

const [modelPath, nPromptStr, nGenStr, threadsStr] = process.argv.slice(2);
const [nPrompt, nGen, threads] = [+nPromptStr, +nGenStr, +threadsStr];
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath, gpuLayers: 0});
const context = await model.createContext({threads, contextSize: 512, batchSize: 512});
const seq = context.getSequence();
const words = "The lighthouse keeper climbed the stairs at dusk, counting each step while the sea " +
    "below gathered its strength and the gulls went quiet, as they did before every storm. ";
let text = "";
let toks = [];
while (toks.length < nPrompt) {
    text += words;
    toks = model.tokenize(text);
}
toks = toks.slice(0, nPrompt);
const t0 = performance.now();
let t1 = 0;
let n = 0;
for await (const tok of seq.evaluate(toks, {temperature: 0})) {
    n++;
    if (n === 1) t1 = performance.now();
    if (n >= nGen + 1) break;
}
const t2 = performance.now();
console.log(JSON.stringify({
    prompt_ids: Array.from(toks, Number),
    prompt_tok_s: toks.length / ((t1 - t0) / 1000),
    decode_tokens: n - 1,
    decode_tok_s: (n - 1) / ((t2 - t1) / 1000),
}));
process.exit(0);
