"""Several ADP ranks in one process: real `ADPExecutor`s stepping in lockstep on threads, joined by
an in-process all-gather, optionally on a fake model (a token table instead of a network).

    fleet = LockstepFleet([engine0, engine1])      # one ADPExecutor per engine
    results = fleet.step({0: [request]})           # one pass on every rank
    fleet.close()
"""

from __future__ import annotations

import queue
import threading

import torch

from adpfleet.runtime.executor.adp_executor import ADPExecutor
from adpfleet.runtime.model.attention import check_uniform_decode
from adpfleet.runtime.model.tiny import tiny_config

BARRIER_TIMEOUT_S = 60.0


class LockstepComm:
    """The all-gather of N ranks on N threads: each call returns every rank's values once all N
    ranks have made their call. Records the values of every call (rank order) for inspection."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._slots: list[list[int] | None] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=BARRIER_TIMEOUT_S)
        self.gathered: list[list[list[int]]] = []  # every call's result, in call order
        self.ranks = [_RankComm(self, r) for r in range(world_size)]

    def _gather(self, rank: int, values: list[int]) -> list[list[int]]:
        self._slots[rank] = list(values)
        if self._barrier.wait() == 0:
            self.gathered.append([list(v) for v in self._slots])
        out = [list(v) for v in self._slots]
        self._barrier.wait()  # nobody overwrites a slot before every rank has read it
        return out

    def abort(self) -> None:
        self._barrier.abort()


class _RankComm:
    def __init__(self, group: LockstepComm, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.world_size
        self.calls = 0

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        self.calls += 1
        return self.group._gather(self.rank, values)


class LockstepFleet:
    """One ADPExecutor per engine, each stepping on its own thread; `step` runs one pass on all."""

    def __init__(self, engines, pad_empty_batch: bool = True):
        self.comm = LockstepComm(len(engines))
        self.executors = [ADPExecutor(e, self.comm.ranks[r], pad_empty_batch) for r, e in enumerate(engines)]
        self._tasks = [queue.SimpleQueue() for _ in engines]
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._worker, args=(r,), daemon=True, name=f"lockstep-rank{r}")
                         for r in range(len(engines))]
        for t in self._threads:
            t.start()

    @property
    def engines(self):
        return [x.engine for x in self.executors]

    def _worker(self, rank: int) -> None:
        while True:
            task = self._tasks[rank].get()
            if task is None:
                return
            try:
                self._done.put((rank, self.executors[rank].step(task), None))
            except BaseException as exc:  # unblock the peers, then report
                self.comm.abort()
                self._done.put((rank, None, exc))

    def step(self, new: dict[int, list] | None = None):
        """One pass on every rank; returns the PassResult of each rank, in rank order."""
        new = new or {}
        for r in range(len(self.executors)):
            self._tasks[r].put(list(new.get(r, ())))
        results, errors = [None] * len(self.executors), []
        for _ in self.executors:
            rank, result, exc = self._done.get()
            results[rank] = result
            if exc is not None:
                errors.append((rank, exc))
        if errors:
            rank, exc = min(errors, key=lambda x: isinstance(x[1], threading.BrokenBarrierError))
            raise RuntimeError(f"rank {rank} failed in its pass: {exc!r}") from exc
        return results

    def close(self) -> None:
        for q in self._tasks:
            q.put(None)
        for t in self._threads:
            t.join(5)


class TableModel:
    """Stands in for the network: the next token after token t is `table[t]` (short cycles, so
    prompt lookup finds real drafts), whatever came before. Asserts the uniform-decode invariant
    like the attention backend, and counts the forwards it ran."""

    def __init__(self, table: list[int], name: str = "tiny-dense"):
        self.cfg = tiny_config(name)
        self.table = torch.tensor(table, dtype=torch.long)
        self.forwards = 0

    def allocate_kv_cache(self, num_slots: int):
        # one layer of one value per slot: enough for a generation rank to place pulled KV
        return torch.zeros(1, num_slots, 1, 1), torch.zeros(1, num_slots, 1, 1)

    def __call__(self, input_ids, positions, meta, kv_cache):
        check_uniform_decode(meta)
        assert input_ids.numel() == positions.numel() == meta.num_tokens
        self.forwards += 1
        return input_ids

    def compute_logits(self, hidden):
        return torch.nn.functional.one_hot(self.table[hidden], self.cfg.vocab_size).float()


def cycle_table(rng, vocab: int, tokens: int, max_cycle: int = 6) -> list[int]:
    """A next-token table over the first `tokens` ids made of short cycles; the rest map to 0."""
    order = list(range(tokens))
    rng.shuffle(order)
    table = [0] * vocab
    i = 0
    while i < tokens:
        n = min(rng.randint(1, max_cycle), tokens - i)
        cycle = order[i:i + n]
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            table[a] = b
        i += n
    return table
