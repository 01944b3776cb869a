"""The building blocks of the decoders, written for packed (unpadded) token batches.

Each parameter that a checkpoint fills in pieces (packed, tensor- or expert-parallel) carries
its weight loader (`weights.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adpfleet.runtime.model import kernels
from adpfleet.runtime.model.attention import paged_attention
from adpfleet.runtime.model.parallel import ParallelContext
from adpfleet.runtime.model.weights import (column_parallel_loader, expert_loader, packed_loader,
                                            row_parallel_loader, set_loader)


# oneDNN's float32 GEMM (torch's mkldnn linear) uses AVX-512 where MKL's does not (AMD): measured
# 1.7-2.4x MKL's throughput on the benchmark model's shapes there (docs/benchmarks.md).
_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# The batch a prepacked weight's layout is chosen for (vLLM's choice too); any batch runs on it.
_PACK_FOR_TOKENS = 32


def onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """A parameter's weight reordered once into oneDNN's blocked layout, as vLLM prepacks its CPU
    linears (a plain weight is reordered inside oneDNN on calls); kept on the parameter and redone
    when the parameter is written again (its _version). A view, as an expert's slice, stays plain."""
    if not isinstance(weight, nn.Parameter):
        return weight
    packed = getattr(weight, "onednn_packed", None)
    if packed is None or packed[0] != weight._version:
        packed = (weight._version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_FOR_TOKENS))
        weight.onednn_packed = packed
    return packed[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): through oneDNN for float32 on the CPU, torch's default elsewhere."""
    if _ONEDNN_LINEAR and x.dtype == torch.float32 and x.device.type == "cpu" and x.numel():
        return torch.ops.mkldnn._linear_pointwise(x, onednn_weight(weight), bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose product goes through `linear` (every projection of every model family)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension as Hugging Face computes it: normalised in float32, cast
    back, then scaled by the weight (hidden states, and per-head q/k norms alike)."""
    if fused(x) and weight.dtype == torch.float32:
        return torch.ops.adpfleet.rms_norm(x, weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def fused(x: torch.Tensor) -> bool:
    """Whether the C++ kernels fuse this tensor's elementwise steps (float32 on the CPU, built):
    one pass and one parallel region where torch runs up to ten operators (kernels/elementwise.cpp)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and kernels.available()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: SiLU of the first half of the last dimension times the second half."""
    if fused(x):
        return torch.ops.adpfleet.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm of x + residual, x + residual): a decoder layer's residual add and the next norm."""
        if fused(x) and self.weight.dtype == torch.float32:
            return tuple(torch.ops.adpfleet.add_rms_norm(x, residual, self.weight, self.eps))
        total = x + residual
        return rms_norm(total, self.weight, self.eps), total


class Rope:
    """The cos/sin of one pass's positions, gathered once and applied in every layer."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin  # [T, 1, head_dim]

    def __call__(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        return [torch.ops.adpfleet.rope(x, self.cos, self.sin) if fused(x) and fused(self.cos) else self.rotate(x)
                for x in xs]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x.float() * self.cos + rotated.float() * self.sin).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout, as Hugging Face Llama): `rotary(positions)`
    is the Rope of a pass."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> Rope:
        return Rope(self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v projections stacked into one matmul (the loader fills the three row ranges).
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        for p in self.qkv_proj.parameters():
            set_loader(p, packed_loader({"q": self.q_size, "k": self.kv_size, "v": self.kv_size}))
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # Qwen3: each head of q and k normalised before RoPE
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, meta, kv_cache, rope: Rope):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, k)
        k_cache, v_cache = kv_cache[0][self.layer_idx], kv_cache[1][self.layer_idx]
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    """SwiGLU MLP, tensor-parallel over the intermediate dimension."""

    def __init__(self, cfg, par: ParallelContext):
        super().__init__()
        self.par = par
        lo, hi = par.shard(cfg.intermediate_size, "intermediate_size")
        self.local = hi - lo
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.local, bias=False)
        self.down_proj = Linear(self.local, cfg.hidden_size, bias=False)
        set_loader(self.gate_up_proj.weight, column_parallel_loader(cfg.intermediate_size, lo, hi, ("gate", "up")))
        set_loader(self.down_proj.weight, row_parallel_loader(cfg.intermediate_size, lo, hi))

    def forward(self, x):
        x = self.par.gather_tokens(x)
        return self.par.reduce_to_local(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


class MoE(nn.Module):
    """Mixtral sparse MoE: softmax router, top-k experts, weights renormalised; experts sharded
    across ranks (expert parallelism)."""

    def __init__(self, cfg, par: ParallelContext):
        super().__init__()
        self.par = par
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.num_local_experts
        self.first_expert, last = par.shard(cfg.num_local_experts, "num_local_experts")
        n_local, inter = last - self.first_expert, cfg.intermediate_size
        self.gate = Linear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(n_local, 2 * inter, cfg.hidden_size))
        self.down = nn.Parameter(torch.empty(n_local, cfg.hidden_size, inter))
        set_loader(self.gate_up, expert_loader(self.num_experts, self.first_expert, last, ("gate", "up")))
        set_loader(self.down, expert_loader(self.num_experts, self.first_expert, last))

    def forward(self, x):
        x = self.par.gather_tokens(x)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for local in range(self.gate_up.shape[0]):
            token_idx, slot = torch.where(experts == self.first_expert + local)
            if token_idx.numel() == 0:
                continue
            y = linear(silu_and_mul(linear(x[token_idx], self.gate_up[local])), self.down[local])
            y = y * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y)
        return self.par.reduce_to_local(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, par: ParallelContext):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg, par) if cfg.is_moe else MLP(cfg, par)

    def forward(self, x, residual, meta, kv_cache, rope: Rope):
        """(this layer's output, the residual stream before it): the residual add is left to the
        next layer's first norm (or the model's final one), fused with it."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h, residual = self.post_attention_layernorm.add(self.self_attn(h, meta, kv_cache, rope), residual)
        return self.mlp(h), residual
