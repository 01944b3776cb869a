"""Drawing a token for a sampled request (torch): kept apart from the request parameters in
`sampling.py`, which the router and the HTTP layer import without torch."""

from __future__ import annotations

import torch


class Sampler:
    """Draws tokens for sampled (non-greedy) requests from their own generator, so a seeded request
    draws the same tokens whatever it is batched with. (Greedy rows are one batched argmax, in
    `ModelRunner.sample`.) A draw that fails sets the request's `error`: the engine fails that
    request alone, and the token returned in its place is never emitted."""

    @staticmethod
    def sample(row: torch.Tensor, req) -> int:
        """One draw from a row of logits under the request's temperature, top-k and top-p."""
        try:
            return Sampler._draw(row, req)
        except (RuntimeError, ValueError) as e:  # e.g. a seed torch refuses, probabilities not finite
            req.error = f"sampling failed: {e}"
            return int(row.argmax())

    @staticmethod
    def _draw(row: torch.Tensor, req) -> int:
        p = req.params
        x = row.float() / p.temperature
        if p.top_k and p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            drop = sorted_p.cumsum(0) - sorted_p > p.top_p  # keep the smallest prefix reaching top_p
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        return int(torch.multinomial(probs.cpu(), 1, generator=req.generator()).item())
