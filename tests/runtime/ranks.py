"""Drive a real RankGroup (rank processes) from a test without HTTP."""

from __future__ import annotations

import threading
import time

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.engine.validation import make_request
from adpfleet.runtime.executor.rank_group import RankGroup
from adpfleet.runtime.model.tiny import tiny_config
from adpfleet.runtime.tokenizer import load_tokenizer


class Ranks:
    def __init__(self, dp: int, model: str = "tiny", **kw):
        engine_kw = {k: kw.pop(k) for k in list(kw) if k in EngineConfig.__dataclass_fields__}
        self.config = EngineConfig(model=model, **engine_kw)
        self.model_config = tiny_config(model)
        self.tokenizer = load_tokenizer(model, self.model_config)
        self.done: dict[str, list] = {}
        self.tokens: dict[str, list[int]] = {}
        self.cond = threading.Condition()
        self.group = RankGroup(self.config, dp, on_output=self._on_output, **kw)
        self._n = 0

    def _on_output(self, out):
        with self.cond:
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                self.done[out.request_id] = out
                self.cond.notify_all()

    def submit(self, prompt, rank=None, **params) -> str:
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

    def stats(self, rank: int):
        return self.group.stats[rank]

    def close(self):
        self.group.close()
