"""The export-oriented GPT-2: the reference architecture with explicit past/present K/V tensors.

Parameter names follow Hugging Face's GPT2LMHeadModel (less the ``transformer.`` prefix), so a
checkpoint maps onto this module one tensor to one tensor. Linear layers keep GPT-2's Conv1D
layout (weight [in, out], ``x @ W + b``), which exports as MatMul + Add.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from gpt2onnx.pytorch.architecture import Architecture


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh form, exactly as GPT-2 (and transformers' NewGELUActivation) computes it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """GELU, exact: 0.5 · x · (1 + erf(x / √2)) (transformers' "gelu", torch's F.gelu)."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x · sigmoid(1.702 · x) (transformers' QuickGELUActivation)."""
    return x * torch.sigmoid(1.702 * x)


# The activation of each canonical name (pytorch.architecture.ACTIVATIONS), written as the ops the fusions read.
ACTIVATION_FUNCTIONS = {
    "gelu_new": gelu_tanh,
    "gelu": gelu_erf,
    "quick_gelu": quick_gelu,
    "gelu_10": lambda x: torch.clamp(gelu_erf(x), -10.0, 10.0),  # transformers' ClippedGELUActivation(-10, 10)
    "relu": torch.relu,
    "relu2": lambda x: torch.square(torch.relu(x)),
    "relu6": lambda x: torch.clamp(x, 0.0, 6.0),
    "leaky_relu": lambda x: F.leaky_relu(x, 0.01),  # nn.LeakyReLU's default slope, as transformers builds it
    "silu": lambda x: x * torch.sigmoid(x),
    "mish": lambda x: x * torch.tanh(F.softplus(x)),
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "linear": lambda x: x,
}


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight stored [in_features, out_features]."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight) + self.bias


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: Architecture, layer: int = 0):
        super().__init__()
        self.n_head = spec.n_head
        self.head_dim = spec.n_embd // spec.n_head
        # √head_dim, times layer + 1 with scale_attn_by_inverse_layer_idx, 1 without scale_attn_weights: one
        # constant Div (the attention fusion reads it into MultiHeadAttention's scale)
        self.divisor = spec.attention_divisor(layer)
        self.c_attn = Conv1D(spec.n_embd, 3 * spec.n_embd)
        self.c_proj = Conv1D(spec.n_embd, spec.n_embd)

    def forward(self, x, attn_bias, past_key, past_value):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        present_key = torch.cat([past_key, k], dim=2)  # (B, nh, P+T, hs)
        present_value = torch.cat([past_value, v], dim=2)
        scores = torch.matmul(q, present_key.transpose(-1, -2)) / self.divisor
        probs = torch.softmax(scores + attn_bias, dim=-1)  # attn_bias: (B, 1, T, P+T)
        y = torch.matmul(probs, present_value)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.c_proj(y), present_key, present_value


class MLP(nn.Module):
    def __init__(self, spec: Architecture):
        super().__init__()
        self.c_fc = Conv1D(spec.n_embd, spec.n_inner)
        self.c_proj = Conv1D(spec.n_inner, spec.n_embd)
        self.act = ACTIVATION_FUNCTIONS[spec.activation]

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, spec: Architecture, layer: int = 0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.n_embd, eps=spec.layer_norm_epsilon)
        self.attn = CausalSelfAttention(spec, layer)
        self.ln_2 = nn.LayerNorm(spec.n_embd, eps=spec.layer_norm_epsilon)
        self.mlp = MLP(spec)

    def forward(self, x, attn_bias, past_key, past_value):
        a, present_key, present_value = self.attn(self.ln_1(x), attn_bias, past_key, past_value)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, present_key, present_value


# The additive mask's blocked value (GPT-2's own masked_bias): exp(BLOCKED + score) is exactly 0 in fp32 and fp16
# (both underflow below -104), and score + BLOCKED stays finite in fp16. The lowest float32 (-3.4e38) becomes fp16's
# -65504 in an fp16 graph, so a score added to it overflowed to -inf: a fully padded row's softmax was NaN, which
# reached the padded slots' K/V and, through 0 x NaN, every real row (the fp16 check's GPU emulation: 75776 NaN/Inf
# on the trained fixture with the unfused attention).
BLOCKED = -1e4


def attention_bias(attention_mask: torch.Tensor, query_length, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (B, 1, T, P+T): 0 where query t may see key j (causal and not padding), else BLOCKED.

    Built once from the 2-D mask and shared by every layer. Query t sits at absolute slot P + t.
    """
    total = attention_mask.shape[1]
    key_slots = torch.arange(total, device=attention_mask.device)
    query_slots = torch.arange(query_length, device=attention_mask.device) + (total - query_length)
    causal = key_slots[None, :] <= query_slots[:, None]  # (T, P+T)
    allowed = causal[None, None, :, :] & (attention_mask[:, None, None, :] > 0)
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    blocked = torch.full((), BLOCKED, dtype=dtype, device=attention_mask.device)
    return torch.where(allowed, zero, blocked)


class GPT2ForExport(nn.Module):
    """GPT-2 LM with explicit past/present K/V: one forward serves the prompt and each decode step.

    forward(input_ids, attention_mask, position_ids, past_0_key, past_0_value, past_1_key, ...)
    returns (logits, present_0_key, present_0_value, ...).
    """

    def __init__(self, spec: Architecture, *, last_logits_only: bool = False):
        super().__init__()
        self.spec = spec
        self.last_logits_only = last_logits_only
        self.wte = nn.Embedding(spec.vocab_size, spec.n_embd)
        self.wpe = nn.Embedding(spec.n_positions, spec.n_embd)
        self.h = nn.ModuleList(Block(spec, i) for i in range(spec.n_layer))
        self.ln_f = nn.LayerNorm(spec.n_embd, eps=spec.layer_norm_epsilon)
        # Untied checkpoints keep their own head; GPT-2 ties it to wte (stored once in the graph).
        self.lm_head = None if spec.tie_word_embeddings else nn.Parameter(torch.empty(spec.vocab_size, spec.n_embd))

    def forward(self, input_ids, attention_mask, position_ids, *past):
        x = self.wte(input_ids) + self.wpe(position_ids)  # (B, T, C)
        attn_bias = attention_bias(attention_mask, input_ids.shape[1], x.dtype)
        presents = []
        for i, block in enumerate(self.h):
            x, present_key, present_value = block(x, attn_bias, past[2 * i], past[2 * i + 1])
            presents += [present_key, present_value]
        if self.last_logits_only:
            x = x[:, -1:, :]
        head = self.wte.weight if self.lm_head is None else self.lm_head
        # 2-D linear exports as Gemm(transB=1) on the embedding itself: no transposed copy is folded in. The
        # reshape comes before ln_f (the same values: LayerNorm is per row): onnxruntime's transformer
        # optimizer rewrites a Gemm fed by Reshape(LayerNormalization) as if it had a bias and weights [C, V],
        # and crashes (IndexError) on ours.
        B, T, C = x.shape
        logits = F.linear(self.ln_f(x.reshape(B * T, C)), head).reshape(B, T, self.spec.vocab_size)
        return (logits, *presents)


class BlockForExport(nn.Module):
    """One transformer block alone: (hidden_states, attention_mask, past_key, past_value) →
    (hidden_states, present_key, present_value)."""

    def __init__(self, block: Block):
        super().__init__()
        self.block = block

    def forward(self, hidden_states, attention_mask, past_key, past_value):
        attn_bias = attention_bias(attention_mask, hidden_states.shape[1], hidden_states.dtype)
        return self.block(hidden_states, attn_bias, past_key, past_value)
