"""The engine of one rank: add requests, step, abort; `generate` runs them to completion.

One `step()` is: fetch pending requests (up to max_num_active_requests), schedule (and draft,
when speculative decoding is on), forward, sample and verify, update request states (next
chunk, new tokens, stop checks, newly full blocks into the prefix cache), free what finished,
release held KV that was pulled or expired.
The ADP executor drives the same phases in lockstep across ranks.
"""

from __future__ import annotations

import collections
import itertools
import time

import torch

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.kv_cache import KVCacheManager
from adpfleet.runtime.engine.model_runner import ModelRunner
from adpfleet.runtime.engine.request import Request, RequestOutput, RequestState
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.engine.validation import make_request
from adpfleet.runtime.metrics import RankStats
from adpfleet.runtime.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from adpfleet.runtime.engine.spec_decode import NgramDrafter
from adpfleet.runtime.model.loader import load_model
from adpfleet.runtime.model.parallel import SINGLE, ParallelContext
from adpfleet.runtime.tokenizer import load_tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig, par: ParallelContext = SINGLE, model=None, kv_hold=None):
        config.validate()
        self.config = config
        self.par = par
        self.model = model or load_model(config.model, par, config.device, config.torch_dtype, config.seed)
        self.model_config = self.model.cfg
        self.tokenizer = load_tokenizer(config.model, self.model_config)
        self.kv = KVCacheManager(config.kv_blocks, config.tokens_per_block, config.prefix_cache)
        self.scheduler = Scheduler(self.kv, SchedulerConfig(
            config.max_num_tokens, config.max_batch_size, config.decode_query_len))
        # context role: finished prompts keep their KV for the generation server (see KVHold)
        self.kv_hold = kv_hold(self.kv) if kv_hold else None
        self.drafter = NgramDrafter(config.draft_tokens, config.prompt_lookup_min,
                                    config.prompt_lookup_max) if config.draft_tokens else None
        self.runner = ModelRunner(self.model, config.kv_blocks, config.tokens_per_block, config.device)
        self.pending: collections.deque[Request] = collections.deque()
        self.active: list[Request] = []  # fetched: waiting for KV, in context, or generating
        self.pulling: dict[str, Request] = {}  # generation role: prompt KV on its way (see begin_pull)
        self._ids = itertools.count()
        self.stats = RankStats(kv_cache_capacity_blocks=config.kv_blocks)

    # -- requests in and out ------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None) -> Request:
        """Validates and tokenizes; raises InvalidRequestError naming the parameter."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return make_request(prompt, params, rid, self.tokenizer, self.model_config, self.config)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        req = self.make_request(prompt, params or SamplingParams(), request_id)
        self.pending.append(req)
        return req

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is on this rank: pending, active, its prompt KV still being
        pulled (what the pull brings is dropped), or finished with its KV held for a transfer that
        will not come (the blocks are freed at once). False when it is on none of these."""
        req = self.pulling.pop(request_id, None) or self._take(request_id)
        if req is None:
            return self.kv_hold is not None and self.kv_hold.release(request_id)
        self.kv.free(req)
        req.state, req.finish_reason = RequestState.FINISHED, "abort"
        self.stats.requests_finished["abort"] += 1
        return True

    def _take(self, request_id: str) -> Request | None:
        for queue in (self.pending, self.active):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    return req
        return None

    def begin_pull(self, req: Request) -> None:
        """Generation role: the request's prompt KV is being pulled (off the loop); until
        `end_pull`, an abort cancels the request."""
        self.pulling[req.request_id] = req

    def end_pull(self, req: Request, error: str | None) -> RequestOutput | None:
        """Its pull ended: the request joins the pending ones, or fails with `error` (the output
        says so). One aborted meanwhile is never added: what its pull brought is given back."""
        if self.pulling.pop(req.request_id, None) is not req:
            if req.kv_payload is not None:
                req.kv_payload.release()
                req.kv_payload = None
            return None
        if error is not None:
            return self.fail(req, error)
        self.pending.append(req)
        return None

    @property
    def num_active_real(self) -> int:
        return sum(1 for r in self.active if not r.is_dummy)

    # -- the loop ------------------------------------------------------------------------------
    def fetch(self) -> list[RequestOutput]:
        """Move pending requests onto the rank (up to max_num_active_requests) and place the
        generation-only ones whose KV has arrived; returns the outputs of their first tokens."""
        while self.pending and self.num_active_real < self.config.max_num_active_requests:
            self.active.append(self.pending.popleft())
            self.stats.requests_fetched += 1
        outputs = []
        pulled = [r for r in self.active if r.kv_payload is not None and r.state is RequestState.WAITING]
        self.scheduler.capacity.admit_pulled(pulled, lambda r: outputs.append(self._place_or_fail(r)))
        return outputs

    def _place_or_fail(self, req: Request) -> RequestOutput:
        try:
            return self._place_prefilled(req)
        except (RuntimeError, ValueError) as e:  # this request's pulled KV, not the rank, is broken
            return self.fail(req, f"placing the pulled KV failed: {e}")

    def _place_prefilled(self, req: Request) -> RequestOutput:
        """Place a request whose prompt KV was pulled from a context server (admitted: its blocks
        reserved): copy the KV into its blocks and continue from the first token the context
        server sampled."""
        n = req.num_prompt_tokens
        self.kv.grow(req, n)
        slots = torch.tensor([self.kv.slot(req, p) for p in range(n)], dtype=torch.long)
        k_cache, v_cache = self.runner.kv_cache
        dev = k_cache.device
        payload, req.kv_payload = req.kv_payload, None
        try:
            k_cache.index_copy_(1, slots.to(dev), payload.k.to(dev, k_cache.dtype))
            v_cache.index_copy_(1, slots.to(dev), payload.v.to(dev, v_cache.dtype))
        finally:
            payload.release()  # copied (synchronously, also to a GPU): its buffer may take the next pull
        req.num_computed_tokens = n
        req.state = RequestState.GENERATION
        out = self._append_token(req, req.first_token_id)
        self._finish_if_done(req)
        return out

    def schedule_batch(self) -> ScheduledBatch:
        waiting = [r for r in self.active if r.state is RequestState.WAITING and r.remote_kv is None]
        running = [r for r in self.active if r.state in (RequestState.CONTEXT, RequestState.GENERATION)]
        batch, admitted = self.scheduler.schedule(waiting, running)
        if self.kv.prefix_cache:  # as vLLM counts: prompt tokens looked up at admission, and found
            for req in admitted:
                self.stats.prefix_cache_queries += req.num_prompt_tokens
                self.stats.prefix_cache_hits += req.num_computed_tokens
        if self.drafter is not None:
            for req in batch.generation:
                self.drafter.propose(req)
        return batch

    def step(self) -> list[RequestOutput]:
        outputs = self.fetch()
        batch = self.schedule_batch()
        self.stats.iterations += 1
        if not batch.is_empty:
            logits = self.runner.forward(batch)
            self.stats.forward_steps += 1
            outputs += self.update(batch, self.runner.sample(batch, logits))
        self.release_held_kv()
        self.refresh_gauges()
        return outputs

    def release_held_kv(self) -> None:
        """Context role: free the KV of held prompts that were pulled or whose lease expired."""
        if self.kv_hold is not None:
            self.kv_hold.reap()

    def refresh_gauges(self) -> None:
        s = self.stats
        s.requests_running = sum(1 for r in self.active if r.state is not RequestState.WAITING and not r.is_dummy)
        s.requests_waiting = len(self.pending) + sum(
            1 for r in self.active if r.state is RequestState.WAITING and not r.is_dummy)
        s.kv_cache_blocks_used = self.kv.num_used_blocks
        s.prefix_cache_blocks = self.kv.num_cached_blocks
        s.kv_transfers_in_flight = self.kv_hold.blocks_in_flight if self.kv_hold else 0
        s.kv_transfers_awaiting_pull = self.kv_hold.blocks_awaiting_pull if self.kv_hold else 0

    def update(self, batch: ScheduledBatch, sampled: dict[Request, list[int]]) -> list[RequestOutput]:
        """Advance every request of a pass that ran; emit outputs; free what finished."""
        outputs = []
        prompt_tokens = 0
        for req, n in batch.context:
            req.num_computed_tokens += n
            if not req.is_dummy:
                prompt_tokens += n
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = batch.scheduled_at
                    self.stats.request_queue_time.observe(batch.scheduled_at - req.arrival_time)
                if req.remaining_prompt_tokens == 0:
                    req.state = RequestState.GENERATION
        drafts = batch.decode_query_len - 1
        for req in batch.generation:
            if req.is_dummy:
                continue
            # the query's last token and its accepted drafts now have their K/V in the cache;
            # the rejected drafts' K/V is rolled back
            req.num_computed_tokens += len(sampled[req])
            if drafts:
                self.stats.spec_decode_draft_tokens += drafts
                self.stats.spec_decode_accepted_tokens += len(sampled[req]) - 1
                self.kv.shrink(req, req.num_computed_tokens)
        self.stats.prompt_tokens += prompt_tokens
        failed = []
        for req in batch.requests:
            if req in sampled:
                if req.error is not None:  # its sampling failed: it ends here, the batch goes on
                    failed.append(self.fail(req, req.error))
                    continue
                outputs.append(self._append_tokens(req, sampled[req]))
            # full blocks enter the prefix cache once their tokens are known (accepted drafts
            # included) and before a finished request lets its blocks go
            self.kv.cache_computed_blocks(req)
            self._finish_if_done(req)
        if prompt_tokens or outputs:
            self.stats.last_progress_timestamp = time.time()
        return outputs + failed

    def _finish_if_done(self, req: Request) -> None:
        if not req.is_finished:
            return
        self.active.remove(req)
        if self.kv_hold is not None:
            self.kv_hold.hold(req)
        else:
            self.kv.free(req)
        self.stats.requests_finished[req.finish_reason] += 1

    def fail(self, req: Request, error: str) -> RequestOutput:
        """End a request that cannot go on (e.g. its KV could not be pulled)."""
        for queue in (self.pending, self.active):
            if req in queue:
                queue.remove(req)
        self.kv.free(req)
        req.state, req.finish_reason = RequestState.FINISHED, "error"
        self.stats.requests_finished["error"] += 1
        return RequestOutput(req.request_id, [], "", True, "error", req.num_prompt_tokens,
                             len(req.output_token_ids), error=error)

    def _append_tokens(self, req: Request, tokens: list[int]) -> RequestOutput:
        """Append a pass's tokens up to the first that finishes the request; one output for all."""
        new_ids, text = [], ""
        for token in tokens:
            out = self._append_token(req, token)
            new_ids.append(token)
            text += out.new_text
            if out.finished:
                break
        self.stats.generation_tokens += len(new_ids)
        return RequestOutput(req.request_id, new_ids, text, out.finished, out.finish_reason,
                             req.num_prompt_tokens, len(req.output_token_ids))

    def _append_token(self, req: Request, token: int) -> RequestOutput:
        p = req.params
        req.output_token_ids.append(token)
        now = time.monotonic()
        if req.last_token_time is None:
            self.stats.time_to_first_token.observe(now - req.arrival_time)
            if req.first_scheduled_time is not None:  # its prompt ran here (not pulled from a context server)
                self.stats.request_prefill_time.observe(now - req.first_scheduled_time)
        else:
            self.stats.inter_token_latency.observe(now - req.last_token_time)
        req.last_token_time = now
        reason = None
        if (not p.ignore_eos and token in self.tokenizer.eos_token_ids) or token in p.stop_token_ids:
            reason = "stop"
        elif len(req.output_token_ids) >= p.max_tokens:
            reason = "length"
        text_ids = req.output_token_ids[:-1] if reason == "stop" else req.output_token_ids
        text = self.tokenizer.decode(text_ids)
        for stop in p.stop:
            at = text.find(stop, max(0, len(req.output_text) - len(stop)))
            if at != -1:
                text, reason = text[:at], "stop"
        if reason is None:
            # hold back an unfinished UTF-8 sequence and anything that may begin a stop string
            hold = max((len(s) - 1 for s in p.stop), default=0)
            text = text.rstrip("\ufffd")
            text = text[:max(len(req.output_text), len(text) - hold)]
        delta = text[len(req.output_text):]
        req.output_text = text
        if reason:
            req.state, req.finish_reason = RequestState.FINISHED, reason
        return RequestOutput(req.request_id, [token], delta, reason is not None, reason,
                             req.num_prompt_tokens, len(req.output_token_ids))

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[Request]:
        """Runs the prompts to completion; returns the finished requests in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        deadline = time.monotonic() + 3600
        while any(not r.is_finished for r in reqs):
            self.step()
            if time.monotonic() > deadline:
                raise TimeoutError("generate made no progress for an hour")
        return reqs
