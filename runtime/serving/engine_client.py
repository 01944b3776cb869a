"""The HTTP front end's view of the engine: validate here, run on the ranks, stream back.

The server process holds no weights: it validates and tokenizes requests with the model's
config and tokenizer, hands them to the rank group, and turns the ranks' outputs (delivered on
reader threads) into per-request asyncio streams.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.request import Request, RequestOutput
from adpfleet.runtime.engine.sampling import InvalidRequestError, SamplingParams
from adpfleet.runtime.engine.validation import make_request
from adpfleet.runtime.executor.rank_group import RankGroup
from adpfleet.runtime.model.tiny import load_model_config
from adpfleet.runtime.tokenizer import load_tokenizer


class EngineUnavailable(RuntimeError):
    pass


class EngineClient:
    def __init__(self, config: EngineConfig, dp: int, role: str, on_dead=None, **group_kw):
        config.validate()
        self.config = config
        self.role = role
        self.model_config = load_model_config(config.model)
        self.tokenizer = load_tokenizer(config.model, self.model_config)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.group = RankGroup(config, dp, role, on_output=self._deliver, on_dead=on_dead, **group_kw)

    def make_request(self, prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        rid = request_id or f"req-{next(self._ids)}"
        return make_request(prompt, params, rid, self.tokenizer, self.model_config, self.config)

    def make_generation_request(self, params: SamplingParams, disagg, request_id: str) -> Request:
        """Generation role: the prompt was run by a context server; its KV is pulled from there."""
        req = make_request(list(disagg.prompt_token_ids), params, request_id, self.tokenizer,
                           self.model_config, self.config)
        if not 0 <= disagg.first_token_id < self.model_config.vocab_size:
            raise InvalidRequestError("'disaggregated_params.first_token_id' is outside the vocabulary",
                                      "disaggregated_params")
        req.remote_kv = (disagg.kv_endpoint, disagg.kv_handle)
        req.first_token_id = disagg.first_token_id
        return req

    def release_kv(self, output: RequestOutput) -> None:
        """Context role: a request that finished at its first token needs no transfer."""
        self.group.transfer_done(output.request_id, output.rank)

    def health(self) -> tuple[bool, str]:
        return self.group.health()

    @property
    def requests_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def kv_held(self) -> int:
        """Context role: KV blocks its ranks hold for generation servers to pull."""
        return sum(s.kv_transfers_in_flight for _, s in self.group.rank_stats(whole_server=True))

    def hand_back(self, reason: str) -> None:
        """End every request in flight with an explicit error (the server is going away): the
        router retries a request on another server when none of its tokens reached the client."""
        with self._lock:
            streams = list(self._streams.items())
        for rid, (loop, queue) in streams:
            self.group.abort(rid)
            loop.call_soon_threadsafe(queue.put_nowait, RequestOutput(rid, [], "", True, "error", 0, 0, error=reason))

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[request.request_id] = (asyncio.get_running_loop(), queue)
        finished = False
        rank = None
        try:
            try:
                rank = self.group.submit(request)
            except RuntimeError as e:
                raise EngineUnavailable(str(e)) from None
            while True:
                out: RequestOutput = await queue.get()
                if out.finish_reason == "error":
                    finished = True  # nothing left to abort on the rank
                    raise EngineUnavailable(out.error or self.group.dead or "the engine failed this request")
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
            if not finished:  # the client went away or the server failed: free the request's KV
                self.group.abort(request.request_id)
                if self.role == "context" and rank is not None:
                    # its prompt may have finished on the rank (the rank group forgets it then, and its
                    # output never reached this stream): the KV held for a transfer nobody will make goes
                    self.group.transfer_done(request.request_id, rank)

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            target = self._streams.get(out.request_id)
        if target:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, out)

    def close(self) -> None:
        self.group.close()
