"""onnxruntime-genai's own tokenizer (og.Tokenizer) on a deployed folder, plus greedy generation from text
(run with .venv-genai's python).

Usage: genai_tokenizer.py FOLDER IN.json OUT.json; IN.json: {"texts": [...], "prompt": "...", "new_tokens": N}
Writes each text's ids and their decoding, and the prompt's ids and generated text (new tokens only)."""

import json
import sys

import numpy as np
import onnxruntime_genai as og

folder, source, out = sys.argv[1:4]
request = json.loads(open(source, encoding="utf-8").read())
model = og.Model(folder)
tokenizer = og.Tokenizer(model)
ids = [np.asarray(tokenizer.encode(text)).tolist() for text in request["texts"]]
decoded = [tokenizer.decode(np.array(row, dtype=np.int32)) if row else "" for row in ids]
prompt = np.asarray(tokenizer.encode(request["prompt"]), dtype=np.int32)
params = og.GeneratorParams(model)
params.set_search_options(do_sample=False, max_length=len(prompt) + request["new_tokens"], batch_size=1)
generator = og.Generator(model, params)
generator.append_tokens(prompt[None])
new = []
while not generator.is_done() and len(new) < request["new_tokens"]:
    generator.generate_next_token()
    new.append(int(generator.get_next_tokens()[0]))
result = {
    "version": og.__version__,
    "ids": ids,
    "decoded": decoded,
    "prompt_ids": prompt.tolist(),
    "new_ids": new,
    "generated": tokenizer.decode(np.array(new, dtype=np.int32)),
}
open(out, "w", encoding="utf-8").write(json.dumps(result))
