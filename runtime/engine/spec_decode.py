"""Speculative decoding by prompt lookup (vLLM's `ngram` method): propose drafts, verify them.

With `draft_tokens` k > 0 every decode step of a request carries 1 + k query tokens: its last
token and k drafts (uniform decode: every decode request, dummies included, has exactly that
many). One forward then scores all 1 + k positions at once.

Proposing: the drafter looks for the latest earlier occurrence of the sequence's last n tokens
(n from `prompt_lookup_max` down to `prompt_lookup_min`) in the prompt and output so far, and
proposes the k tokens that followed it — continued periodically when the occurrence is so recent
that fewer than k tokens follow it. Without a match the draft is the last token repeated (the
query still needs k tokens; such drafts are rarely accepted and cost only their share of the
forward).

Verifying: the target is sampled at the query positions in order, and the token sampled at
position i is emitted as long as every draft before it equalled the token sampled one position
earlier: the step emits 1 to 1 + k tokens. For greedy requests the output is token-identical
to decoding without drafts (each emitted token is the argmax given the same prefix). For sampled
requests each emitted token is drawn from the target's distribution given the accepted prefix,
so the output distribution is the target's; positions are sampled lazily, one draw per emitted
token, so a seeded request draws the same random numbers as without drafting. The KV written for
rejected positions is rolled back by the engine (`LLMEngine.update`).
"""

from __future__ import annotations

from collections.abc import Callable


class PromptLookup:
    """One request's n-gram index: for each n, the last position where each n-gram ended."""

    def __init__(self, n_min: int, n_max: int):
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_max, n_min - 1, -1)}
        self.indexed = 0  # n-grams ending before this position are in the index

    def propose(self, tokens: list[int], k: int) -> list[int]:
        length = len(tokens)
        for end in range(self.indexed, length - 1):  # an occurrence must end before the last token
            for n, table in self.ends.items():
                if end + 1 >= n:
                    table[tuple(tokens[end + 1 - n:end + 1])] = end
        self.indexed = max(self.indexed, length - 1)
        for n, table in self.ends.items():  # longest n first
            end = table.get(tuple(tokens[length - n:])) if length >= n else None
            if end is not None:
                draft: list[int] = []
                for i in range(k):  # tokens that followed the occurrence; past the end, the drafts repeat
                    pos = end + 1 + i
                    draft.append(tokens[pos] if pos < length else draft[pos - length])
                return draft
        return [tokens[-1]] * k


class NgramDrafter:
    def __init__(self, draft_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k, self.n_min, self.n_max = draft_tokens, prompt_lookup_min, prompt_lookup_max

    def propose(self, request) -> None:
        """Set `request.draft_token_ids` for its next decode step."""
        if request.prompt_lookup is None:
            request.prompt_lookup = PromptLookup(self.n_min, self.n_max)
        request.draft_token_ids = request.prompt_lookup.propose(request.all_token_ids, self.k)


def verify(drafts: list[int], target: Callable[[int], int]) -> list[int]:
    """The tokens one decode step emits. `target(i)` samples query position i (the token after
    the query's i-th token); it is called in order and only while the drafts hold."""
    out = [target(0)]
    for i, draft in enumerate(drafts, 1):
        if draft != out[-1]:
            break
        out.append(target(i))
    return out
