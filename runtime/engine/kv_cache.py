"""The paged KV block pool: which blocks each request holds, and what is still free.

Block 0 is the null block: it is never handed out, and dummy tokens write their K/V there.
Admission reserves the blocks a request can ever need (prompt + max_tokens), so an admitted
request never waits for blocks mid-generation (guaranteed no evict); blocks are then allocated
as tokens arrive, and trimmed back when a tentative allocation is rolled back.

Under ADP with padding, `padding_reserve_blocks` are kept back from admission for the padding
dummy: finished prompts held for transfer can then never take the last block, and a starved
rank can always afford the dummy that lets its peers' forward (and its own reaping) run.
"""

from __future__ import annotations

from adpfleet.runtime.engine.request import Request


class NoFreeBlocksError(RuntimeError):
    """A request asked for more KV blocks than are free (and not promised to others)."""

    def __init__(self, request_id: str, needed: int, available: int):
        super().__init__(f"request {request_id} needs {needed} more KV blocks, {available} are available")
        self.request_id, self.needed, self.available = request_id, needed, available


class KVCacheManager:
    def __init__(self, num_blocks: int, tokens_per_block: int):
        if num_blocks < 1 or tokens_per_block < 1:
            raise ValueError("num_blocks and tokens_per_block must be positive")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self._free = list(range(num_blocks, 0, -1))  # block ids 1..num_blocks; 0 is the null block
        self._unallocated_reservations = 0
        self.padding_reserve_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_available_blocks(self) -> int:
        """Free blocks not promised to an admitted request (nor kept for the padding dummy)."""
        return max(0, len(self._free) - self._unallocated_reservations - self.padding_reserve_blocks)

    def available_for(self, request: Request) -> int:
        """What `request` may take: a padding dummy may also use the padding reserve."""
        if request.is_dummy:
            return len(self._free) - self._unallocated_reservations
        return self.num_available_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def can_reserve(self, request: Request, num_tokens: int | None = None) -> bool:
        need = self.blocks_for(num_tokens if num_tokens is not None else request.max_total_tokens)
        return need - len(request.block_table) <= self.available_for(request)

    def reserve(self, request: Request, num_tokens: int | None = None) -> None:
        """Promise `request` enough blocks for `num_tokens` (default: prompt + max_tokens)."""
        total = self.blocks_for(num_tokens if num_tokens is not None else request.max_total_tokens)
        extra = total - max(request.reserved_blocks, len(request.block_table))
        if extra > self.available_for(request):
            raise NoFreeBlocksError(request.request_id, extra, self.available_for(request))
        if extra > 0:
            self._unallocated_reservations += extra
            request.reserved_blocks = total

    def grow(self, request: Request, num_tokens: int) -> None:
        """Make the block table cover `num_tokens` tokens, drawing on the reservation first."""
        need = self.blocks_for(num_tokens) - len(request.block_table)
        if need <= 0:
            return
        from_reservation = min(need, max(0, request.reserved_blocks - len(request.block_table)))
        if need - from_reservation > self.available_for(request):
            raise NoFreeBlocksError(request.request_id, need - from_reservation, self.available_for(request))
        self._unallocated_reservations -= from_reservation
        request.block_table.extend(self._free.pop() for _ in range(need))

    def shrink(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks beyond `num_tokens` (a rolled-back tentative allocation)."""
        keep = self.blocks_for(num_tokens)
        while len(request.block_table) > keep:
            self._free.append(request.block_table.pop())
            if len(request.block_table) < request.reserved_blocks:
                self._unallocated_reservations += 1

    def free(self, request: Request) -> None:
        """Return every block and the unused part of the reservation."""
        self._unallocated_reservations -= max(0, request.reserved_blocks - len(request.block_table))
        self._free.extend(reversed(request.block_table))
        request.block_table.clear()
        request.reserved_blocks = 0

    def slot(self, request: Request, position: int) -> int:
        return request.block_table[position // self.tokens_per_block] * self.tokens_per_block \
            + position % self.tokens_per_block
