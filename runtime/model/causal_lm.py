"""The decoder every registered architecture runs: Llama's, with the options its relatives add
(qkv bias, q/k norm, Mixtral's experts). Module names follow Hugging Face's (`model.layers.N...`,
`lm_head`) so checkpoint names map onto parameters directly."""

from __future__ import annotations

import torch
from torch import nn

from adpfleet.runtime.model.config import ModelConfig
from adpfleet.runtime.model.layers import DecoderLayer, Linear, RMSNorm, RotaryEmbedding
from adpfleet.runtime.model.parallel import SINGLE, ParallelContext


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, par: ParallelContext):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, par) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, par: ParallelContext = SINGLE):
        super().__init__()
        self.cfg = cfg
        self.par = par
        self.model = DecoderModel(cfg, par)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)

    def allocate_kv_cache(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V caches, [layers, slots, kv_heads, head_dim] each, on the model's device."""
        p = next(self.parameters())
        shape = (self.cfg.num_hidden_layers, num_slots, self.cfg.num_key_value_heads, self.cfg.head_dim)
        return torch.zeros(shape, dtype=p.dtype, device=p.device), torch.zeros(shape, dtype=p.dtype, device=p.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv_cache) -> torch.Tensor:
        """Packed tokens [T] -> final hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary(positions)  # once per pass, for every layer
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, meta, kv_cache, rope)
        return self.model.norm.add(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
