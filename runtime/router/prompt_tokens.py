"""What a request's prompt is in tokens, as the servers will see it: the cache-aware policy needs
the token ids to compute the blocks' chained hashes (`engine/block_hash.py`) a rank may hold.

The router reads the body exactly as a server does — the same request models, the same chat
template, the same tokenizer (`--tokenizer`: a built-in model name or a model directory, the
servers' `--model`) — so it computes the very identities the ranks compute. Anything it cannot
read (no tokenizer, a body the server will refuse) is `None`: the request is routed by load, and
the server gives the client its 4xx.

Nothing here imports torch (tests/router/test_prefix_policy.py checks it): a router that routes by
prefix stays the small process a least-loaded one is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("adpfleet.router")

# A chat request without max_tokens may decode this many (the server caps it by the model's
# context; the router does not know that limit, and an upper bound is what the books keep).
_NO_LIMIT = 1 << 30


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    max_tokens: int  # what the request may still decode: the load it adds beyond its prefill


class PromptReader:
    def __init__(self, tokenizer_spec: str):
        from adpfleet.runtime.model.tiny import load_model_config
        from adpfleet.runtime.serving import protocol
        from adpfleet.runtime.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_spec, load_model_config(tokenizer_spec))
        self._models = {"/v1/completions": protocol.CompletionRequest,
                        "/v1/chat/completions": protocol.ChatCompletionRequest}
        self._parse = protocol.parse

    def read(self, path: str, body: dict) -> Prompt | None:
        """The prompt's token ids and its max_tokens, or None when the server would refuse the body."""
        from adpfleet.runtime.engine.validation import tokenize

        try:
            req = self._parse(self._models[path], body)
            ids = tokenize(req.prompt_input(self.tokenizer), self.tokenizer)
        except Exception as e:  # noqa: BLE001 - the server validates and answers; the router only routes
            log.debug("prompt not read for prefix routing: %s", e)
            return None
        return Prompt(ids, req.requested_max_tokens(len(ids), _NO_LIMIT))
