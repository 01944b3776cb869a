"""Sampling parameters (greedy, temperature, top-k, top-p, per-request seed) and their validation,
without torch (the router reads requests with them); the draw itself is `sampler.py`'s."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


SEED_RANGE = (-2**63, 2**63 - 1)  # int64, as OpenAI documents it and vLLM checks it
# Below this temperature a request samples greedily (the limit of temperature -> 0): dividing
# logits by a smaller one overflows float32 into inf/NaN (vLLM clamps the same range to 1e-2).
MIN_TEMPERATURE = 1e-2
# Stop strings are checked for every request on every token of the lockstep batch: bounded.
MAX_STOP_STRINGS, MAX_STOP_LENGTH, MAX_STOP_TOKEN_IDS = 16, 256, 256


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        def bad(param: str, why: str):
            raise InvalidRequestError(f"'{param}' {why}", param)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            bad("temperature", f"must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be a non-negative integer, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            bad("seed", f"must be a 64-bit signed integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            bad("stop", f"takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"takes at most {MAX_STOP_TOKEN_IDS} token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

