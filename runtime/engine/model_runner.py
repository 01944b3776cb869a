"""Tensors in, tokens out: turns a scheduled batch into model inputs, runs it, samples."""

from __future__ import annotations

import torch

from adpfleet.runtime.engine import attention_metadata
from adpfleet.runtime.engine.attention_metadata import SeqChunk
from adpfleet.runtime.engine.request import Request
from adpfleet.runtime.engine.sampler import Sampler
from adpfleet.runtime.engine.scheduler import ScheduledBatch
from adpfleet.runtime.engine.spec_decode import verify
from adpfleet.runtime.model.attention import default_decode_backend


class ModelRunner:
    def __init__(self, model, num_blocks: int, tokens_per_block: int, device: str = "cpu"):
        self.model = model
        self.tokens_per_block = tokens_per_block
        self.device = device
        # +1: block 0 is the null block
        self.kv_cache = model.allocate_kv_cache((num_blocks + 1) * tokens_per_block)
        self.sampler = Sampler()
        # Load (or, where nothing is built, compile) the C++ decode kernels now, while the server is
        # starting, and never in its first decode: a rank compiling for 10-15 s mid-serving looks hung.
        default_decode_backend(torch.device(device))

    def chunks(self, batch: ScheduledBatch) -> list[SeqChunk]:
        out = []
        for req, n in batch.context:
            start = req.num_computed_tokens
            out.append(SeqChunk(req.prompt_token_ids[start:start + n], start, req.block_table, is_decode=False))
        for req in batch.generation:  # the last token, then the drafts: one query of decode_query_len
            tokens = [0] * batch.decode_query_len if req.is_dummy else [req.last_token_id, *req.draft_token_ids]
            out.append(SeqChunk(tokens, req.num_computed_tokens, req.block_table, is_decode=True))
        return out

    def forward(self, batch: ScheduledBatch, pad_to_tokens: int | None = None) -> torch.Tensor | None:
        """Runs the batch (padded with dummy decodes to `pad_to_tokens`); returns the logits of the
        positions that sample this pass: the last token of each prompt that completes, then every
        query position of each real decode, in `sampling_requests(batch)` order."""
        ids, pos, meta = attention_metadata.build(
            self.chunks(batch), self.tokens_per_block, batch.decode_query_len, pad_to_tokens, self.device)
        # A draft query past the model's last position can only belong to a step whose output is
        # cut by max_tokens (validation keeps prompt + max_tokens within it): its logits are unused.
        pos = pos.clamp(max=self.model.cfg.max_position_embeddings - 1)
        hidden = self.model(ids, pos, meta, self.kv_cache)
        sampling = {req for reqs in sampling_requests(batch) for req in reqs}
        rows = [meta.query_start_loc[i] + n - 1 for i, (req, n) in enumerate(batch.context) if req in sampling]
        qlen = batch.decode_query_len
        for j, req in enumerate(batch.generation):
            if req in sampling:
                start = meta.num_prefill_tokens + j * qlen
                rows.extend(range(start, start + qlen))
        if not rows:
            return None
        return self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])

    def sample(self, batch: ScheduledBatch, logits: torch.Tensor | None) -> dict[Request, list[int]]:
        """The tokens each request emits this pass: one for a completed prompt, 1 to 1 + draft
        tokens for a decode (the drafts are verified, see `spec_decode.verify`)."""
        if logits is None:
            return {}
        greedy = logits.argmax(dim=-1).tolist()

        def pick(req: Request, row: int) -> int:
            return greedy[row] if req.params.greedy else self.sampler.sample(logits[row], req)

        out: dict[Request, list[int]] = {}
        row = 0
        prompts, decodes = sampling_requests(batch)
        for req in prompts:
            out[req] = [pick(req, row)]
            row += 1
        for req in decodes:
            out[req] = verify(req.draft_token_ids, lambda i, req=req, base=row: pick(req, base + i))
            row += batch.decode_query_len
        return out


def sampling_requests(batch: ScheduledBatch) -> tuple[list[Request], list[Request]]:
    """Real requests that sample this pass: prompts whose last chunk runs, and every decode."""
    prompts = [r for r, n in batch.context
               if not r.is_dummy and r.num_computed_tokens + n == r.num_prompt_tokens]
    return prompts, [r for r in batch.generation if not r.is_dummy]
