"""The building blocks of the decoders, written for packed (unpadded) token batches.

Each parameter that a checkpoint fills in pieces (packed, tensor- or expert-parallel) carries
its weight loader (`weights.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adpfleet.runtime.model.attention import paged_attention
from adpfleet.runtime.model.parallel import ParallelContext
from adpfleet.runtime.model.weights import (column_parallel_loader, expert_loader, packed_loader,
                                            row_parallel_loader, set_loader)


# oneDNN's float32 GEMM (torch's mkldnn linear) uses AVX-512 where MKL's does not (AMD): measured
# 1.7-2.4x MKL's throughput on the benchmark model's shapes there (docs/benchmarks.md).
_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): through oneDNN for float32 on the CPU, torch's default elsewhere."""
    if _ONEDNN_LINEAR and x.dtype == torch.float32 and x.device.type == "cpu" and x.numel():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose product goes through `linear` (every projection of every model family)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension as Hugging Face computes it: normalised in float32, cast
    back, then scaled by the weight (hidden states, and per-head q/k norms alike)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rope:
    """The cos/sin of one pass's positions, gathered once and applied in every layer."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin  # [T, 1, head_dim]

    def __call__(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for x in xs:
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            out.append((x.float() * self.cos + rotated.float() * self.sin).to(x.dtype))
        return out


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
        gate, up = self.gate_up_proj(x).split(self.local, dim=-1)
        return self.par.reduce_to_local(self.down_proj(F.silu(gate) * up))


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
        self.inter = inter

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
            gate, up = linear(x[token_idx], self.gate_up[local]).split(self.inter, dim=-1)
            y = linear(F.silu(gate) * up, self.down[local]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y)
        return self.par.reduce_to_local(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, par: ParallelContext):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg, par) if cfg.is_moe else MLP(cfg, par)

    def forward(self, x, meta, kv_cache, rope: Rope):
        x = x + self.self_attn(self.input_layernorm(x), meta, kv_cache, rope)
        return x + self.mlp(self.post_attention_layernorm(x))
