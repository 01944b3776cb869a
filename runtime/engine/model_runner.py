"""Tensors in, tokens out: turns a scheduled batch into model inputs, runs it, samples."""

from __future__ import annotations

import torch

from adpfleet.runtime.engine import attention_metadata
from adpfleet.runtime.engine.attention_metadata import SeqChunk
from adpfleet.runtime.engine.request import Request
from adpfleet.runtime.engine.sampling import Sampler
from adpfleet.runtime.engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model, num_blocks: int, tokens_per_block: int, device: str = "cpu"):
        self.model = model
        self.tokens_per_block = tokens_per_block
        self.device = device
        # +1: block 0 is the null block
        self.kv_cache = model.allocate_kv_cache((num_blocks + 1) * tokens_per_block)
        self.sampler = Sampler()

    def chunks(self, batch: ScheduledBatch) -> list[SeqChunk]:
        out = []
        for req, n in batch.context:
            start = req.num_computed_tokens
            out.append(SeqChunk(req.prompt_token_ids[start:start + n], start, req.block_table, is_decode=False))
        for req in batch.generation:
            start = req.num_computed_tokens
            out.append(SeqChunk([req.token_at(p) for p in range(start, start + batch.decode_query_len)]
                                if not req.is_dummy else [0] * batch.decode_query_len,
                                start, req.block_table, is_decode=True))
        return out

    def forward(self, batch: ScheduledBatch, pad_to_tokens: int | None = None) -> torch.Tensor | None:
        """Runs the batch (padded with dummy decodes to `pad_to_tokens`); returns the logits of
        the requests that sample a token this pass, in `sampling_requests(batch)` order."""
        ids, pos, meta = attention_metadata.build(
            self.chunks(batch), self.tokens_per_block, batch.decode_query_len, pad_to_tokens, self.device)
        hidden = self.model(ids, pos, meta, self.kv_cache)
        rows = []
        for i, (req, n) in enumerate(batch.context):
            if req.num_computed_tokens + n == req.num_prompt_tokens:
                rows.append(meta.query_start_loc[i] + n - 1)
        first_decode = meta.num_prefill_tokens
        for j, req in enumerate(batch.generation):
            rows.append(first_decode + (j + 1) * batch.decode_query_len - 1)
        if not rows:
            return None
        return self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])

    def dummy_forward(self, num_tokens: int, decode_query_len: int = 1) -> None:
        """An idle rank's share of a pass: dummy decodes only, through the same metadata path."""
        ids, pos, meta = attention_metadata.build([], self.tokens_per_block, decode_query_len,
                                                  num_tokens, self.device)
        self.model(ids, pos, meta, self.kv_cache)

    def sample(self, batch: ScheduledBatch, logits: torch.Tensor | None) -> dict[Request, int]:
        reqs = sampling_requests(batch)
        if logits is None:
            return {}
        return dict(zip(reqs, self.sampler(logits, reqs)))


def sampling_requests(batch: ScheduledBatch) -> list[Request]:
    """Requests that sample a token this pass: prompts whose last chunk runs, and every decode."""
    reqs = [r for r, n in batch.context if r.num_computed_tokens + n == r.num_prompt_tokens]
    return reqs + [r for r in batch.generation]


