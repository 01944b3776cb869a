"""Turning a user's prompt and parameters into a Request, or a clear error naming the parameter.

Shared by the engine and by the HTTP front end (which validates before a rank sees anything).
"""

from __future__ import annotations

from adpfleet.runtime.engine.request import Request
from adpfleet.runtime.engine.sampling import InvalidRequestError, SamplingParams


def tokenize(prompt, tokenizer) -> list[int]:
    """A text prompt's token ids (a list of ids passes through); InvalidRequestError if neither."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("'prompt' must not be empty", "prompt")
        try:
            return tokenizer.encode(prompt)
        except UnicodeEncodeError as e:  # JSON allows lone surrogates ("\ud800"); text cannot hold them
            raise InvalidRequestError(f"'prompt' is not valid Unicode text: {e.reason} at {e.start}",
                                      "prompt") from None
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise InvalidRequestError("'prompt' must be a string or a list of token ids", "prompt")


def make_request(prompt, params: SamplingParams, request_id: str, tokenizer, model_config,
                 engine_config) -> Request:
    params.validate()
    ids = tokenize(prompt, tokenizer)
    if not ids:
        raise InvalidRequestError("'prompt' must not be empty", "prompt")
    vocab = model_config.vocab_size
    if any(t < 0 or t >= vocab for t in ids):
        raise InvalidRequestError(f"'prompt' has token ids outside the vocabulary [0, {vocab})", "prompt")
    limit = model_config.max_position_embeddings
    if len(ids) + params.max_tokens > limit:
        raise InvalidRequestError(
            f"this model's maximum context length is {limit} tokens; the prompt has {len(ids)} "
            f"and max_tokens asks for {params.max_tokens} more",
            "prompt" if len(ids) >= limit else "max_tokens")
    capacity = engine_config.max_request_tokens  # what one request can ever get on a rank
    if len(ids) + params.max_tokens > capacity:
        raise InvalidRequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the {capacity} "
            f"tokens of KV cache one request can have on a rank of this server", "max_tokens")
    return Request(request_id, ids, params)
