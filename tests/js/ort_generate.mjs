// One session.run of an ort-generate file (onnxruntime's BeamSearch / GreedySearch / Sampling op) with
// onnxruntime-node, the binding transformers.js brings (tests/js/node_modules). No Python, no tokenizer.
// Usage: node ort_generate.mjs MODEL.onnx INPUTS.json OUT.json
//   INPUTS.json: {"input_ids": [[...], ...], "attention_mask": [[...], ...], "max_length": 24, "num_beams": 4, ...}
//   (int32 except length_penalty and repetition_penalty, which are float32; a scalar setting is a [1] tensor)
// Writes {"version", "sequences": {dims, data}, "sequences_scores"?: {dims, data}}.
import fs from "node:fs";
import * as ort from "onnxruntime-node";

const [modelPath, inputsPath, out] = process.argv.slice(2);
const given = JSON.parse(fs.readFileSync(inputsPath, "utf8"));
const FLOAT = new Set(["length_penalty", "repetition_penalty"]);
const session = await ort.InferenceSession.create(modelPath, { executionProviders: ["cpu"] });
const feeds = {};
for (const name of session.inputNames) {
  const value = given[name];
  if (value === undefined) throw new Error(`INPUTS.json has no '${name}', an input of ${modelPath}`);
  if (Array.isArray(value)) {  // [batch, sequence]
    feeds[name] = new ort.Tensor("int32", Int32Array.from(value.flat()), [value.length, value[0].length]);
  } else {
    feeds[name] = FLOAT.has(name)
      ? new ort.Tensor("float32", Float32Array.from([value]), [1])
      : new ort.Tensor("int32", Int32Array.from([value]), [1]);
  }
}
const results = await session.run(feeds);  // the whole generation loop: one call
const plain = (t) => ({ dims: t.dims, data: Array.from(t.data, Number) });
fs.writeFileSync(out, JSON.stringify({
  version: ort.env.versions?.node ?? null,
  sequences: plain(results.sequences),
  ...(results.sequences_scores ? { sequences_scores: plain(results.sequences_scores) } : {}),
}));
await session.release();
