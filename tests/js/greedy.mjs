// Greedy generation with transformers.js (Node, onnxruntime-node on CPU) from a deployed folder, local only.
// Usage: node greedy.mjs FOLDER DTYPE PROMPT(comma-separated ids) NEW_TOKENS OUT.json
// Writes the generated tokens and the logits of one forward over prompt + generated tokens (all but the last).
import fs from "node:fs";
import path from "node:path";
import { env, AutoModelForCausalLM, Tensor } from "@huggingface/transformers";

const [folder, dtype, promptArg, newArg, out] = process.argv.slice(2);
env.allowRemoteModels = false; // never the Hub: a local path only
env.allowLocalModels = true;
env.localModelPath = path.dirname(path.resolve(folder));
env.useFSCache = false;
const model = await AutoModelForCausalLM.from_pretrained(path.basename(folder), { dtype, device: "cpu" });
const prompt = promptArg.split(",").map(BigInt);
const n = Number(newArg);
const ids = (values) => new Tensor("int64", BigInt64Array.from(values), [1, values.length]);
const ones = (length) => new Tensor("int64", new BigInt64Array(length).fill(1n), [1, length]);
const generated = await model.generate({
  input_ids: ids(prompt), attention_mask: ones(prompt.length),
  max_new_tokens: n, min_new_tokens: n, do_sample: false, num_beams: 1,
});
const sequence = Array.from(generated.data, BigInt);
const { logits } = await model({ input_ids: ids(sequence.slice(0, -1)), attention_mask: ones(sequence.length - 1) });
fs.writeFileSync(out, JSON.stringify({
  version: env.version,
  tokens: sequence.slice(prompt.length).map(Number),
  dims: logits.dims,
  logits: Array.from(logits.data),
}));
await model.dispose();
