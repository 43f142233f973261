// transformers.js's own tokenizer (AutoTokenizer) on a deployed folder, local only, plus greedy generation from text.
// Usage: node tokenizer.mjs FOLDER IN.json OUT.json; IN.json: {"texts": [...], "prompt": "...", "new_tokens": N}
// Writes each text's ids and their decoding, and the prompt's ids and generated text (new tokens only).
import fs from "node:fs";
import path from "node:path";
import { env, AutoTokenizer, AutoModelForCausalLM } from "@huggingface/transformers";

const [folder, input, out] = process.argv.slice(2);
env.allowRemoteModels = false; // never the Hub: a local path only
env.allowLocalModels = true;
env.localModelPath = path.dirname(path.resolve(folder));
env.useFSCache = false;
const name = path.basename(folder);
const { texts, prompt, new_tokens: n } = JSON.parse(fs.readFileSync(input, "utf8"));
const tokenizer = await AutoTokenizer.from_pretrained(name);
const encoded = texts.map((text) => tokenizer.encode(text));
const decoded = encoded.map((ids) => tokenizer.decode(ids));
const model = await AutoModelForCausalLM.from_pretrained(name, { dtype: "fp32", device: "cpu" });
const inputs = tokenizer(prompt);
const generated = await model.generate({
  ...inputs, max_new_tokens: n, min_new_tokens: n, do_sample: false, num_beams: 1,
});
const sequence = Array.from(generated.data, Number);
const promptIds = Array.from(inputs.input_ids.data, Number);
fs.writeFileSync(out, JSON.stringify({
  version: env.version,
  ids: encoded,
  decoded,
  prompt_ids: promptIds,
  generated: tokenizer.decode(sequence.slice(promptIds.length), { skip_special_tokens: true }),
}));
await model.dispose();
