"""Greedy generation with onnxruntime-genai's Python API on a deployed folder (run with .venv-genai's python).

Usage: genai_greedy.py FOLDER OUT.npz PROMPT(comma-separated ids) NEW_TOKENS
Writes the tokens and the logits of every step (the prompt's, then one row per decode step)."""

import sys

import numpy as np
import onnxruntime_genai as og

folder, out, prompt, n_new = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")], int(sys.argv[4])
model = og.Model(folder)
params = og.GeneratorParams(model)
params.set_search_options(do_sample=False, max_length=len(prompt) + n_new, batch_size=1)
generator = og.Generator(model, params)
generator.append_tokens(np.array([prompt], dtype=np.int32))
tokens, steps = [], []
while not generator.is_done() and len(tokens) < n_new:
    generator.generate_next_token()
    steps.append(np.asarray(generator.get_output("logits"))[0])  # the prompt's [P, V], then [1, V] per step
    tokens.append(int(generator.get_next_tokens()[0]))
np.savez(out, tokens=np.array(tokens), logits=np.concatenate(steps, 0), version=og.__version__)
