// Greedy tokens from onnxruntime-web's wasm build in Node: the browser's kernels, one thread, without a browser,
// so that the same process can run on CPUs emulated by QEMU (tests/test_portability.py). The loop is
// `gpt2onnx generate`'s: the prompt with an empty past, then one token per step with the presents fed back.
//   node wasm_greedy.mjs MODEL.onnx IDS(comma-separated) NEW_TOKENS   → {"ids": [...]} on stdout
import { readFileSync } from "node:fs";
import * as ort from "onnxruntime-web";

const [modelPath, promptArg, newArg] = process.argv.slice(2);
ort.env.wasm.numThreads = 1;
ort.env.logLevel = "error";
const session = await ort.InferenceSession.create(readFileSync(modelPath), { executionProviders: ["wasm"] });
const pasts = session.inputNames.filter((n) => n.startsWith("past_key_values."));
const meta = Object.fromEntries(session.inputMetadata.map((m) => [m.name, m]));
const big = (values) => BigInt64Array.from(values.map((v) => BigInt(v)));

let ids = promptArg.split(",").map(Number);
let length = 0; // tokens in the cache
let past = Object.fromEntries(
  pasts.map((name) => {
    const dims = meta[name].shape.map((d) => (typeof d === "number" ? d : 0)); // [1, heads, 0, head_dim]
    dims[0] = 1;
    const type = meta[name].type === "float16" ? "float16" : "float32";
    return [name, new ort.Tensor(type, type === "float16" ? new Uint16Array(0) : new Float32Array(0), dims)];
  }),
);
const out = [];
for (let step = 0; step < Number(newArg); step++) {
  const feeds = {
    input_ids: new ort.Tensor("int64", big(ids), [1, ids.length]),
    attention_mask: new ort.Tensor("int64", big(Array(length + ids.length).fill(1)), [1, length + ids.length]),
    position_ids: new ort.Tensor("int64", big(ids.map((_, i) => length + i)), [1, ids.length]),
    ...past,
  };
  const result = await session.run(feeds);
  const logits = result.logits;
  const vocab = logits.dims[2];
  const last = logits.data.subarray((logits.dims[1] - 1) * vocab, logits.dims[1] * vocab);
  let best = 0;
  for (let i = 1; i < vocab; i++) if (last[i] > last[best]) best = i;
  out.push(best);
  length += ids.length;
  ids = [best];
  past = Object.fromEntries(pasts.map((name) => [name, result[name.replace("past_key_values.", "present.")]]));
}
process.stdout.write(JSON.stringify({ ids: out }) + "\n");
