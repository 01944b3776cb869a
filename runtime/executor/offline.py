"""A synchronous driver of a rank group, for scripts, benchmarks and tests (no HTTP)."""

from __future__ import annotations

import threading
import time

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.engine.validation import make_request
from adpfleet.runtime.executor.rank_group import RankGroup
from adpfleet.runtime.model.tiny import load_model_config
from adpfleet.runtime.tokenizer import load_tokenizer


class OfflineRanks:
    """`OfflineRanks(2, "tiny", role="context", kv_blocks=8)`: engine knobs go to EngineConfig,
    the rest to RankGroup / RankSpec."""

    def __init__(self, dp: int, model: str = "tiny", **kw):
        engine_kw = {k: kw.pop(k) for k in list(kw) if k in EngineConfig.__dataclass_fields__}
        self.config = EngineConfig(model=model, **engine_kw)
        self.model_config = load_model_config(model)
        self.tokenizer = load_tokenizer(model, self.model_config)
        self.done: dict = {}
        self.tokens: dict[str, list[int]] = {}
        self.cond = threading.Condition()
        self.group = RankGroup(self.config, dp, on_output=self._on_output, **kw)
        self._n = 0

    def _on_output(self, out) -> None:
        with self.cond:
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                self.done[out.request_id] = out
            self.cond.notify_all()

    def submit(self, prompt, rank: int | None = None, **params) -> str:
        self._n += 1
        req = make_request(prompt, SamplingParams(**params), f"r{self._n}", self.tokenizer,
                           self.model_config, self.config)
        self.group.submit(req, rank)
        return req.request_id

    def wait(self, ids, timeout: float) -> bool:
        """True when every id finished within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(i in self.done for i in ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
        return True

    def wait_progress(self, ids, stall_after: float, timeout: float) -> bool:
        """Like wait, but gives up early once no output has arrived for `stall_after` seconds."""
        deadline = time.monotonic() + timeout
        with self.cond:
            last, seen = time.monotonic(), -1
            while not all(i in self.done for i in ids):
                now = time.monotonic()
                progress = sum(len(t) for t in self.tokens.values()) + sum(
                    s.prompt_tokens + s.generation_tokens for s in self.group.stats.values())
                if progress != seen:
                    last, seen = now, progress
                if now - last > stall_after or now > deadline:
                    return False
                self.cond.wait(0.2)
        return True

    def stats(self, rank: int):
        return self.group.stats[rank]

    def close(self) -> None:
        self.group.close()
