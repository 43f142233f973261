// gpt2onnx in the browser: generate text from this folder with transformers.js (wasm, or WebGPU where the
// browser grants an adapter). Written by `gpt2onnx deploy --target web`; served by `gpt2onnx serve FOLDER`.
//
// Automation contract: index.html?prompt=TEXT&max_new_tokens=N starts greedy generation at once. The new text
// goes into #output; document.body.dataset.done becomes "true" when it has finished, or "error" with the message
// in #error. #stats carries the figures as data attributes (data-ids, data-new-tokens, data-tokens-per-second,
// data-decode-tokens-per-second, data-first-token-ms, data-streamed-chunks, data-backend). Options: &backend=wasm|webgpu (default: WebGPU when offered),
// &threads=N (wasm threads; more than 1 needs cross-origin isolation, which `gpt2onnx serve` provides),
// &dtype=D (one of the transformers.js dtypes the folder holds, settings.dtypes: an int4 folder has q4 and q4f16).
import { env, AutoModelForCausalLM, AutoTokenizer, TextStreamer } from "./lib/transformers.min.js";

const $ = (id) => document.getElementById(id);
const settings = JSON.parse($("gpt2onnx-settings").textContent);
const params = new URLSearchParams(location.search);
// The model id: this folder's path on the server ("/" or "/some/dir/"). Not a Hub id, so transformers.js
// fetches it as a local path (it never treats a full http URL as local), and only from this origin.
const folderPath = new URL(".", location.href).pathname;

env.allowRemoteModels = false; // never the Hub: only the files beside this page
env.allowLocalModels = true;
env.useBrowserCache = false; // a redeployed folder at the same address must not be served from a stale cache
env.useWasmCache = false;
env.backends.onnx.wasm.wasmPaths = {
  mjs: new URL(settings.wasm.mjs, location.href).href,
  wasm: new URL(settings.wasm.wasm, location.href).href,
};

class PageError extends Error {}

function fail(err) {
  const message = err instanceof PageError ? err.message : `${err?.name ?? "Error"}: ${err?.message ?? err}`;
  $("error").textContent = message;
  $("status").textContent = "failed";
  document.body.dataset.done = "error";
  console.error(err);
}

function integerParam(name, fallback, { min, max }) {
  const raw = params.get(name);
  if (raw === null || raw === "") return fallback;
  const value = Number(raw);
  if (!Number.isInteger(value) || value < min || value > max) {
    throw new PageError(`?${name}=${raw} is not a whole number from ${min} to ${max}: fix the address`);
  }
  return value;
}

function chooseDtype() {
  const asked = params.get("dtype") ?? settings.dtype;
  const choice = settings.dtypes?.[asked];
  if (!choice) {
    const held = Object.keys(settings.dtypes ?? { [settings.dtype]: null }).join(", ");
    throw new PageError(`?dtype=${asked} is not a dtype this folder holds (${held}): fix the address`);
  }
  return { dtype: asked, ...choice };
}

const chosen = { dtype: settings.dtype, file: settings.model_file, f16: settings.dtype === "fp16" };

async function chooseBackend() {
  const asked = params.get("backend") ?? "auto";
  if (!["auto", "wasm", "webgpu"].includes(asked)) {
    throw new PageError(`?backend=${asked} is not wasm, webgpu or auto: fix the address`);
  }
  if (asked === "wasm") return { device: "wasm", note: "asked for" };
  let adapter = null, reason = "navigator.gpu is absent (no WebGPU in this browser)";
  if ("gpu" in navigator) {
    try {
      adapter = await navigator.gpu.requestAdapter();
      if (!adapter) reason = "the browser granted no WebGPU adapter";
    } catch (err) {
      reason = `requestAdapter failed (${err.message})`;
    }
  }
  if (adapter && chosen.f16 && !adapter.features.has("shader-f16")) {
    reason = `the WebGPU adapter has no shader-f16 (needed by ${chosen.dtype}, which computes in fp16)`;
    adapter = null;
  }
  if (asked === "webgpu" && !adapter) throw new PageError(`WebGPU was asked for, but ${reason}`);
  const info = adapter?.info ?? {};
  const soft = adapter && (info.isFallbackAdapter || /swiftshader/i.test(`${info.vendor} ${info.architecture} ${info.description}`));
  if (asked === "auto" && soft) {
    // a software adapter emulates the GPU on the CPU: measured here, far slower than the wasm kernels
    return { device: "wasm", note: "the only WebGPU adapter is a software one (SwiftShader)" };
  }
  if (!adapter) return { device: "wasm", note: reason };
  return { device: "webgpu", note: [info.vendor, info.architecture, info.description].filter(Boolean).join(" ") };
}

let tokenizer, model, backend;

async function load() {
  const threads = integerParam("threads", undefined, { min: 1, max: 64 });
  if (threads !== undefined) env.backends.onnx.wasm.numThreads = threads;
  Object.assign(chosen, chooseDtype());
  backend = await chooseBackend();
  const started = performance.now();
  try {
    tokenizer = await AutoTokenizer.from_pretrained(folderPath);
  } catch (err) {
    throw new PageError(`cannot load the tokenizer (tokenizer.json) from ${folderPath}: ${err.message}`);
  }
  try {
    model = await AutoModelForCausalLM.from_pretrained(folderPath, { dtype: chosen.dtype, device: backend.device });
  } catch (err) {
    throw new PageError(
      `cannot load the model ${chosen.file} (${chosen.dtype}) from ${folderPath} on ${backend.device}: ${err.message}`,
    );
  }
  const loadSeconds = (performance.now() - started) / 1000;
  const wasm = env.backends.onnx.wasm;
  const where = backend.device === "wasm"
    ? `wasm, ${wasm.numThreads ?? 1} thread(s), ${crossOriginIsolated ? "cross-origin isolated" : "not cross-origin isolated"}`
    : "WebGPU";
  $("backend").textContent = `backend: ${where}${backend.note ? ` (${backend.note})` : ""}; loaded in ${loadSeconds.toFixed(2)} s`;
  $("backend").dataset.backend = backend.device;
  $("backend").dataset.dtype = chosen.dtype;
  $("backend").dataset.threads = String(wasm.numThreads ?? 1);
  $("backend").dataset.crossOriginIsolated = String(crossOriginIsolated);
  $("about").textContent =
    `${settings.precision} as ${chosen.dtype} (${chosen.file}${settings.external_data ? " + external data" : ""}), ` +
    `transformers.js ${settings.transformers_js}, onnxruntime-web ${settings.onnxruntime_web}`;
}

async function generate(prompt, maxNewTokens) {
  $("generate").disabled = true;
  $("error").textContent = "";
  $("output").textContent = "";
  $("shown-prompt").textContent = prompt;
  $("status").textContent = "generating…";
  delete document.body.dataset.done;
  const inputs = tokenizer(prompt);
  const promptLength = inputs.input_ids.dims[1];
  if (promptLength === 0) throw new PageError("the prompt is empty: give some text");
  if (settings.n_positions && promptLength + maxNewTokens > settings.n_positions) {
    throw new PageError(
      `the prompt (${promptLength} tokens) plus ${maxNewTokens} new tokens exceeds the model's context of ` +
        `${settings.n_positions}: shorten the prompt or ask for fewer tokens`,
    );
  }
  const times = [];
  let chunks = 0; // text pieces streamed into #output while generating
  const streamer = new TextStreamer(tokenizer, {
    skip_prompt: true,
    skip_special_tokens: true,
    callback_function: (text) => {
      $("output").textContent += text;
      chunks += 1;
    },
    token_callback_function: () => times.push(performance.now()),
  });
  const started = performance.now();
  const sequences = await model.generate({
    ...inputs, max_new_tokens: maxNewTokens, do_sample: false, num_beams: 1, streamer,
  });
  const seconds = (performance.now() - started) / 1000;
  const ids = Array.from(sequences.data, Number).slice(promptLength);
  // the whole row decoded at once is the reference text (a streamer may hold back an incomplete character)
  $("output").textContent = tokenizer.decode(ids, { skip_special_tokens: true });
  const decodeSeconds = times.length > 1 ? (times.at(-1) - times[0]) / 1000 : NaN;
  const perSecond = ids.length / seconds, decodePerSecond = (times.length - 1) / decodeSeconds;
  const firstMs = times.length ? times[0] - started : NaN;
  const stats = $("stats");
  stats.textContent = `${ids.length} new tokens in ${seconds.toFixed(2)} s: ${perSecond.toFixed(1)} tokens/s ` +
    `(first token ${firstMs.toFixed(0)} ms, then ${Number.isFinite(decodePerSecond) ? decodePerSecond.toFixed(1) : "–"} tokens/s)`;
  Object.assign(stats.dataset, {
    ids: ids.join(","),
    promptIds: Array.from(inputs.input_ids.data, Number).join(","),
    newTokens: String(ids.length),
    seconds: String(seconds),
    firstTokenMs: String(firstMs),
    tokensPerSecond: String(perSecond),
    decodeTokensPerSecond: String(decodePerSecond),
    streamedChunks: String(chunks),
    backend: backend.device,
  });
  $("status").textContent = "done";
  $("generate").disabled = false;
  document.body.dataset.done = "true";
}

async function main() {
  const prompt = params.get("prompt");
  const maxNewTokens = integerParam("max_new_tokens", 32, { min: 1, max: settings.n_positions ?? 100000 });
  await load();
  $("status").textContent = "ready";
  $("generate").disabled = false;
  $("max-new-tokens").value = String(maxNewTokens);
  $("form").addEventListener("submit", (event) => {
    event.preventDefault();
    generate($("prompt").value, Number($("max-new-tokens").value)).catch(fail);
  });
  if (prompt !== null) {
    $("prompt").value = prompt;
    await generate(prompt, maxNewTokens);
  }
}

main().catch(fail);
