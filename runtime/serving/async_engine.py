"""Runs one engine's loop on a background thread and streams its outputs to asyncio callers."""

from __future__ import annotations

import asyncio
import logging
import threading
import traceback
from collections.abc import AsyncIterator

from adpfleet.runtime.engine.llm_engine import LLMEngine, RequestOutput
from adpfleet.runtime.engine.request import Request

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._cond = threading.Condition()
        self._adds: list[Request] = []
        self._aborts: list[str] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # -- called from the event loop ------------------------------------------------------------
    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        if self.error:
            raise EngineDeadError(self.error)
        queue: asyncio.Queue = asyncio.Queue()
        with self._cond:
            self._streams[request.request_id] = (asyncio.get_running_loop(), queue)
            self._adds.append(request)
            self._cond.notify()
        finished = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            with self._cond:
                self._streams.pop(request.request_id, None)
                if not finished:  # the caller went away: free the request's KV
                    self._aborts.append(request.request_id)
                    self._cond.notify()

    def health(self) -> tuple[bool, str]:
        if self.error:
            return False, self.error
        if not self._thread.is_alive():
            return False, "engine loop thread is not running"
        return True, "ok"

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._stopped or self._adds or self._aborts or engine.has_work):
                        self._cond.wait()
                    if self._stopped:
                        return
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                engine.pending.extend(adds)
                for rid in aborts:
                    engine.abort(rid)
                if engine.has_work:
                    for out in engine.step():
                        self._deliver(out.request_id, out)
        except Exception as e:  # a crashed loop must not leave callers hanging
            self.error = f"engine loop failed: {e!r}"
            log.error("%s\n%s", self.error, traceback.format_exc())
            with self._cond:
                streams = list(self._streams)
            for rid in streams:
                self._deliver(rid, EngineDeadError(self.error))

    def _deliver(self, request_id: str, item) -> None:
        with self._cond:
            target = self._streams.get(request_id)
        if target:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)
