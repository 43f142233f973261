// Tokens per second of transformers.js in Node (onnxruntime-node, CPU) on a deployed folder: greedy generation
// from a text prompt, timed per token with a streamer, as the web page times it. Local files only.
// Usage: node speed.mjs FOLDER DTYPE PROMPT NEW_TOKENS THREADS REPEAT  → one JSON line
import path from "node:path";
import { env, AutoModelForCausalLM, AutoTokenizer, TextStreamer } from "@huggingface/transformers";

const [folder, dtype, prompt, newArg, threadsArg, repeatArg] = process.argv.slice(2);
env.allowRemoteModels = false;
env.allowLocalModels = true;
env.localModelPath = path.dirname(path.resolve(folder));
env.useFSCache = false;
const id = path.basename(folder);
const threads = Number(threadsArg);
const tokenizer = await AutoTokenizer.from_pretrained(id);
const model = await AutoModelForCausalLM.from_pretrained(id, {
  dtype, device: "cpu", session_options: { intraOpNumThreads: threads, interOpNumThreads: 1 },
});
const runs = [];
for (let r = 0; r < Number(repeatArg); r++) {
  const times = [];
  const streamer = new TextStreamer(tokenizer, {
    skip_prompt: true, callback_function: () => {}, token_callback_function: () => times.push(performance.now()),
  });
  const inputs = tokenizer(prompt);
  const started = performance.now();
  const out = await model.generate({ ...inputs, max_new_tokens: Number(newArg), do_sample: false, streamer });
  const seconds = (performance.now() - started) / 1000;
  const n = out.dims[1] - inputs.input_ids.dims[1];
  runs.push({
    new_tokens: n, seconds, tokens_per_s: n / seconds, first_token_ms: times[0] - started,
    decode_tokens_per_s: (times.length - 1) / ((times.at(-1) - times[0]) / 1000),
    ids: Array.from(out.data, Number).slice(inputs.input_ids.dims[1]),
  });
}
console.log(JSON.stringify({ version: env.version, threads, runs }));
await model.dispose();
