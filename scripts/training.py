"""Small GPT-2 models that have learned something: real English text available offline, seeded training, a
Hugging Face folder out. Used for the reference model of the quality benchmarks and for the tests' trained model
(scripts/train_reference.py, scripts/make_test_fixture.py, tests/test_training.py); no command of the package
trains, so it lives beside its users.

The text: the docstrings of the Python standard library (read with ``ast``, never imported), one document per
module, split into training and held-out text by module (a stable hash of the module name), so held-out text
is text the model never saw. Which modules exist depends on the Python version: the corpus says which one.

The recipe ("tied tail"): with GPT-2's 50,257-token vocabulary the output softmax costs far more than a small
model's blocks, yet the stdlib's docstrings use only ~12,000 of those tokens. Every token that never occurs in
the training text shares one embedding row, so the exact 50,257-way softmax is

    log p(token) = h·e_token − logsumexp(h·e_used…, h·u + log n_tail)

which costs the used rows plus one. The saved model is an ordinary GPT-2: the shared row ``u`` is written at each
tail id, so its full softmax gives exactly the probabilities trained here (no approximation, no renormalising),
and its held-out perplexity is measured on that saved 50,257-row model.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import math
import shutil
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gpt2onnx.artifact.tokenizer import END_OF_TEXT, write_tokenizer_files
from gpt2onnx.errors import BadInput, CheckFailed

log = logging.getLogger(__name__)

SKIPPED_PARTS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    """Documents (one per module: its docstrings joined by blank lines), split by module."""

    train: dict[str, str]
    heldout: dict[str, str]
    source: str  # where the text came from, e.g. "docstrings of the Python 3.11.7 standard library"

    def train_text(self) -> str:
        return "\n\n".join(self.train.values())

    def heldout_text(self, max_chars: int | None = None) -> str:
        """The held-out documents joined by blank lines; ``max_chars``: only the first documents, up to the
        one that reaches that length (a shorter text for quick evaluations)."""
        if max_chars is None:
            return "\n\n".join(self.heldout.values())
        text = ""
        for document in self.heldout.values():
            if len(text) >= max_chars:
                break
            text += ("\n\n" if text else "") + document
        return text


def module_docstrings(path: Path) -> str | None:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return None
    docs = [
        doc
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and (doc := ast.get_docstring(node, clean=True))
    ]
    return "\n\n".join(docs) or None


def stdlib_docstrings(
    *, heldout_percent: int = 10, train_percent: int | None = None, root: Path | None = None
) -> Corpus:
    """The standard library's docstrings; a module is held out when the sha256 of its name, mod 100, is below
    ``heldout_percent`` (a split that does not change when other modules come or go), else trained on, or
    only when that number is below ``heldout_percent + train_percent`` (a smaller, faster corpus)."""
    import platform

    root = Path(root or sysconfig.get_paths()["stdlib"])
    train_end = 100 if train_percent is None else heldout_percent + train_percent
    train, heldout = {}, {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts)
        bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100
        if SKIPPED_PARTS & set(parts) or bucket >= train_end:
            continue
        text = module_docstrings(path)
        if text:
            (heldout if bucket < heldout_percent else train)[name] = text
    return Corpus(
        train=train, heldout=heldout, source=f"docstrings of the Python {platform.python_version()} standard library"
    )


def encode_documents(tokenizer, documents: dict[str, str], eos_id: int) -> np.ndarray:
    """One token stream: each document's ids followed by the end-of-text token (as GPT-2 was trained)."""
    rows = [encoding.ids + [eos_id] for encoding in tokenizer.encode_batch(list(documents.values()))]
    return np.array([i for row in rows for i in row], dtype=np.int64)


def train_byte_level_bpe(text: str, *, vocab_size: int, folder: Path) -> tuple[Path, Path]:
    """A small GPT-2 style byte-level BPE trained on ``text``, its end-of-text token last (as in GPT-2);
    writes vocab.json and merges.txt into ``folder`` and returns their paths."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tokenizer.train_from_iterator([text], trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab = dict(model["vocab"])
    vocab[END_OF_TEXT] = len(vocab)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{m}\n" for m in merges))
    return folder / "vocab.json", folder / "merges.txt"


@dataclass(frozen=True, kw_only=True)
class Recipe:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    n_positions: int = 256
    block: int = 128  # tokens per training row
    batch: int = 16  # rows per step
    steps: int = 1000
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.01
    seed: int = 0
    threads: int = 2  # fixed: the order of floating-point sums, hence the result, depends on it
    eval_every: int = 0  # steps between held-out evaluations (0: none; train_gpt2's ``evaluate``)
    patience: int = 2  # stop after this many evaluations without a lower held-out perplexity


@dataclass(frozen=True)
class Quality:
    """Held-out quality by the sliding-window protocol of transformers' perplexity guide."""

    perplexity: float
    median_top1: float  # median over scored positions of the largest next-token probability
    tokens: int  # tokens scored
    context: int
    stride: int


@dataclass
class TrainResult:
    model: object  # transformers.GPT2LMHeadModel with the full vocabulary
    recipe: Recipe
    rows_trained: int  # vocabulary rows with their own embedding (the rest share one)
    final_loss: float  # mean training loss (nats) over the last 10 % of steps
    seconds: float
    losses: list[float] = field(default_factory=list)
    curve: list[dict] = field(default_factory=list)  # each evaluation: step, train_loss, heldout_ppl, seconds
    steps_run: int = 0
    best_step: int | None = None  # the evaluated step whose weights the model holds (None: the last step's)
    stopped: str = "steps"  # "steps", "early stop" (held-out perplexity stopped falling) or "time budget"


def _lr(step: int, recipe: Recipe, time_progress: float = 0.0) -> float:
    """Linear warmup, then a cosine decay to a tenth of ``recipe.lr`` at the last step, or at the end of a
    wall-clock budget (``time_progress``: the share of it spent) when that comes first."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = min(1.0, max((step - recipe.warmup) / max(1, recipe.steps - recipe.warmup), time_progress))
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_gpt2(
    train_ids: np.ndarray,
    *,
    vocab_size: int,
    eos_id: int,
    recipe: Recipe,
    progress: Callable[[int, float], None] | None = None,
    evaluate: Callable[[object], float] | None = None,
    max_seconds: float | None = None,
    decay_to_budget: bool = False,
) -> TrainResult:
    """Train a GPT-2 on a token stream with the tied-tail softmax (see the module's docstring); deterministic
    for a given recipe, stream and torch version. Returns the model expanded to ``vocab_size`` rows.

    ``evaluate``: every ``recipe.eval_every`` steps (and after the last), called with the model expanded to the
    full vocabulary (in eval mode) and returns its held-out perplexity; training stops after ``recipe.patience``
    evaluations without a new lowest one, and the model returned holds the weights of the lowest. The learning
    rate follows ``recipe.steps`` whatever stops the run, so a run that stops by steps or by evaluation is
    reproducible; ``max_seconds``: a wall-clock budget that also stops it (where it stops then depends on the
    machine's speed, the report says which stopped it); ``decay_to_budget``: the learning rate decays by the
    share of ``max_seconds`` spent when that is ahead of the share of steps (a run on a slow or busy machine
    still anneals, at the price of depending on its speed)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    torch.use_deterministic_algorithms(True)
    used = np.unique(train_ids)  # full ids with their own row, ascending
    n_tail = vocab_size - len(used)
    compact = np.full(vocab_size, len(used), dtype=np.int64)  # full id → row; the tail → the shared last row
    compact[used] = np.arange(len(used))
    rows = len(used) + (1 if n_tail else 0)
    config = GPT2Config(
        vocab_size=rows,
        n_positions=recipe.n_positions,
        n_embd=recipe.n_embd,
        n_layer=recipe.n_layer,
        n_head=recipe.n_head,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    model = GPT2LMHeadModel(config)
    stream = torch.from_numpy(compact[train_ids])
    tail_row = len(used)
    # log n_tail on the shared row's logit makes its softmax share the whole tail's mass; a tail target then
    # costs log n_tail more (it is one of n_tail equally likely tokens)
    tail_bias = torch.zeros(rows)
    if n_tail:
        tail_bias[tail_row] = math.log(n_tail)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(recipe.seed)
    span = recipe.block + 1
    if len(stream) <= span:
        raise BadInput(f"the training text has {len(stream)} tokens: give more than {span} (the rows are {span} long)")
    model.train()
    losses, start = [], time.perf_counter()
    curve, best, best_step, stale, stopped = [], math.inf, None, 0, "steps"

    def budget_spent() -> float:
        return (time.perf_counter() - start) / max_seconds if decay_to_budget and max_seconds else 0.0

    best_state = None

    def evaluation(step: int) -> bool:
        """Evaluate after ``step``; True when the run should stop (no improvement for ``patience``)."""
        nonlocal best, best_step, stale, best_state
        model.eval()
        ppl = float(evaluate(_expand(model, used, vocab_size, eos_id)))
        model.train()
        window = losses[-recipe.eval_every :] if recipe.eval_every else losses[-1:]
        curve.append(
            {
                "step": step + 1,
                "train_loss": round(float(np.mean(window)), 4),
                "heldout_ppl": round(ppl, 3),
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
        log.info("step %d: train loss %.3f, held-out perplexity %.2f", step + 1, curve[-1]["train_loss"], ppl)
        if ppl < best:
            best, best_step, stale = ppl, step + 1, 0
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            return False
        stale += 1
        return stale >= recipe.patience

    for step in range(recipe.steps):
        offsets = torch.randint(0, len(stream) - span, (recipe.batch,), generator=generator)
        batch = torch.stack([stream[o : o + span] for o in offsets.tolist()])
        inputs, targets = batch[:, :-1], batch[:, 1:]
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, recipe, time_progress=budget_spent())
        logits = model(input_ids=inputs).logits + tail_bias
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, rows), targets.reshape(-1))
        if n_tail:
            loss = loss + (targets == tail_row).float().mean() * math.log(n_tail)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if progress:
            progress(step, losses[-1])
        last = step == recipe.steps - 1
        out_of_time = max_seconds is not None and time.perf_counter() - start >= max_seconds
        if evaluate and recipe.eval_every and ((step + 1) % recipe.eval_every == 0 or last or out_of_time):
            if evaluation(step):
                stopped = "early stop"
                break
        if out_of_time and not last:
            stopped = "time budget"
            break
    seconds = time.perf_counter() - start
    steps_run = len(losses)
    if best_state is not None and best_step != steps_run:
        model.load_state_dict(best_state)
    if best_state is None:
        best_step = None
    full = _expand(model, used, vocab_size, eos_id)
    # the saved model's full softmax must give the loss trained here: check it on one batch (dropout off)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=inputs).logits + tail_bias
        trained = torch.nn.functional.cross_entropy(logits.reshape(-1, rows), targets.reshape(-1))
        if n_tail:
            trained = trained + (targets == tail_row).float().mean() * math.log(n_tail)
        ids = torch.from_numpy(used[np.minimum(batch.numpy(), len(used) - 1)])
        ids[batch == tail_row] = int(np.setdiff1d(np.arange(vocab_size), used)[0]) if n_tail else 0
        full_logits = full(input_ids=ids[:, :-1]).logits
        expanded = torch.nn.functional.cross_entropy(full_logits.reshape(-1, vocab_size), ids[:, 1:].reshape(-1))
    if not math.isclose(trained.item(), expanded.item(), rel_tol=1e-4):
        raise CheckFailed(
            f"the saved model's loss {expanded.item():.6f} differs from the trained {trained.item():.6f}: a bug in the"
            " tied-tail expansion (scripts/training.py)"
        )
    tail = losses[-max(1, steps_run // 10) :]
    return TrainResult(
        model=full,
        recipe=recipe,
        rows_trained=len(used),
        final_loss=float(np.mean(tail)),
        seconds=seconds,
        losses=losses,
        curve=curve,
        steps_run=steps_run,
        best_step=best_step,
        stopped=stopped,
    )


def block_share(model) -> tuple[int, int]:
    """(all parameters, the transformer blocks' parameters) of a GPT-2, tied weights counted once (GPT-2 124M:
    124.4M, 69 % in its blocks; the rest is the embeddings and the last layer norm)."""
    total = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for p in model.transformer.h.parameters())
    return total, blocks


def cpu_info() -> dict:
    """The CPU's model name and whether it has the vector and matrix extensions that matter to matmuls."""
    import os
    import platform
    import subprocess

    name, flags = platform.processor() or platform.machine(), set()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            name = value.strip()
        elif key.strip() == "Flags":
            flags = set(value.split())
    return {
        "model_name": name,
        "avx2": "avx2" in flags,
        "avx512": sorted(f for f in flags if f.startswith("avx512")),
        "amx": sorted(f for f in flags if f.startswith("amx")),
        "logical_cpus": os.cpu_count(),
    }


def _expand(model, used: np.ndarray, vocab_size: int, eos_id: int):
    """The compact model as an ordinary GPT-2 with ``vocab_size`` rows: each tail id gets the shared row."""
    from transformers import GPT2Config, GPT2LMHeadModel

    params = model.config.to_dict()
    for key in ("vocab_size", "architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        params.pop(key, None)
    config = GPT2Config(**{**params, "vocab_size": vocab_size, "bos_token_id": eos_id, "eos_token_id": eos_id})
    full = GPT2LMHeadModel(config)
    state = {k: v for k, v in model.state_dict().items() if k not in ("transformer.wte.weight", "lm_head.weight")}
    wte = model.transformer.wte.weight.detach()
    rows = wte[len(used)].expand(vocab_size, -1).clone() if len(used) < vocab_size else torch.empty_like(wte)
    rows[torch.from_numpy(used)] = wte[: len(used)]
    state["transformer.wte.weight"] = rows
    full.load_state_dict(state, strict=False)
    full.tie_weights()
    full.eval()
    return full


@torch.no_grad()
def heldout_quality(model, ids: np.ndarray, *, context: int | None = None, stride: int | None = None) -> Quality:
    """Perplexity and median top-1 probability of ``model`` on a token stream: windows of ``context`` tokens
    every ``stride`` (default: the model's positions and half of them), each token scored once, as in
    transformers' perplexity guide (a window's first token is never scored; the loss is weighted by tokens)."""
    model.eval()
    context = context or model.config.n_positions
    stride = stride or context // 2
    stream = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    nll, scored, top1 = 0.0, 0, []
    prev_end = 0
    for begin in range(0, len(stream), stride):
        end = min(begin + context, len(stream))
        window = stream[begin:end][None]
        fresh = end - prev_end  # tokens not scored by an earlier window
        targets = window[0, 1:]
        keep = slice(max(0, len(targets) - fresh), len(targets))
        hidden = model.transformer(input_ids=window).last_hidden_state[0, :-1]
        logprobs = torch.log_softmax(model.lm_head(hidden[keep]).float(), dim=-1)  # only the scored rows
        picked = logprobs.gather(1, targets[keep, None])[:, 0]
        nll -= picked.sum().item()
        scored += len(picked)
        top1.append(logprobs.max(dim=-1).values.exp())
        prev_end = end
        if end == len(stream):
            break
    return Quality(
        perplexity=math.exp(nll / scored),
        median_top1=float(torch.cat(top1).median()),
        tokens=scored,
        context=context,
        stride=stride,
    )


def save_folder(
    model,
    folder: Path,
    *,
    vocab_file: Path,
    merges_file: Path,
    extra: dict[str, str] | None = None,
    replace: bool = False,
) -> Path:
    """A Hugging Face GPT-2 folder: config.json, model.safetensors, generation_config.json and the tokenizer
    files of the public gpt2 folder; ``extra``: more text files to write (name → text). Written beside the folder
    first and moved into place when complete; ``replace``: an existing folder is replaced."""
    folder = Path(folder)
    staging = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.generation_config.bos_token_id = model.config.bos_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.save_pretrained(staging)
    write_tokenizer_files(
        staging, vocab_file=vocab_file, merges_file=merges_file, model_max_length=model.config.n_positions
    )
    for name, text in (extra or {}).items():
        (staging / name).write_text(text, encoding="utf-8")
    if replace:
        shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder
