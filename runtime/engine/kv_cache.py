"""The paged KV block pool and its prefix cache: which blocks each request holds, which of them
hold a cached prefix, and what is still available.

Block 0 is the null block: it is never handed out, and dummy tokens write their K/V there.
Admission reserves the blocks a request can ever need (prompt + max_tokens), so an admitted
request never waits for blocks mid-generation (guaranteed no evict); blocks are then allocated
as tokens arrive, and trimmed back when a tentative allocation is rolled back.

Under ADP with padding, `padding_reserve_blocks` are kept back from admission for the padding
dummy: finished prompts held for transfer can then never take the last block, and a starved
rank can always afford the dummy that lets its peers' forward (and its own reaping) run.

The prefix cache (`prefix_cache`, on by default; `--no-prefix-cache`), per rank:
  - a block enters it once it is full and its K/V are computed, under the hash of its tokens
    chained from its parent (`block_hash.py`); a second block with the same hash stays out (the
    first one serves the hits);
  - admission starts a new request from the longest run of its leading blocks found there,
    shared with whoever else holds them; those tokens count as computed, so chunked prefill
    continues from the first unmatched token. Never the whole prompt: its last token always
    runs, for the logits the first output token is sampled from;
  - blocks are reference-counted. A block that no request references is *free*, cached or not:
    uncached free blocks are handed out first, then cached ones in least-recently-released order
    (a request releases its blocks last first, so a prefix's tail goes before its head), and a
    block handed out leaves the cache;
  - KV pulled from a context server (`Request.remote_kv`) and padding dummies never enter it;
  - every block that enters or leaves it is logged (`events`, `cache_events.py`): the server's
    ADP dispatcher places requests by what each rank's log said.
Every count of what can be given — admission, reservations, growth, the padding reserve and the
dummy — counts cached-but-unreferenced blocks as free. So the cache can never starve a rank:
whatever fits a pool with nothing cached fits this one, and a hit only lowers the cost.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine import block_hash
from adpfleet.runtime.engine.cache_events import CacheEventLog
from adpfleet.runtime.engine.request import Request


class NoFreeBlocksError(RuntimeError):
    """A request asked for more KV blocks than are free (and not promised to others)."""

    def __init__(self, request_id: str, needed: int, available: int):
        super().__init__(f"request {request_id} needs {needed} more KV blocks, {available} are available")
        self.request_id, self.needed, self.available = request_id, needed, available


class KVCacheManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, prefix_cache: bool = EngineConfig.prefix_cache):
        if num_blocks < 1 or tokens_per_block < 1:
            raise ValueError("num_blocks and tokens_per_block must be positive")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.prefix_cache = prefix_cache
        self._free = list(range(num_blocks, 0, -1))  # unreferenced and uncached; 0 is the null block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced and cached, least recently released first
        self._refs = [0] * (num_blocks + 1)  # requests holding each block
        self._cached: dict[bytes, int] = {}  # block hash -> the block holding those K/V
        self._hash_of: dict[int, bytes] = {}  # the inverse, for every cached block
        self._unallocated_reservations = 0
        self.padding_reserve_blocks = 0
        self.evictions = 0  # cached blocks handed out to new tokens
        # twice the pool: a log nobody drains is compacted to at most half its capacity
        self.events = CacheEventLog(2 * (num_blocks + 1), self.cached_hashes)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references: uncached, or cached and evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request references."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, referenced or not."""
        return len(self._hash_of)

    @property
    def num_available_blocks(self) -> int:
        """Free blocks not promised to an admitted request (nor kept for the padding dummy)."""
        return max(0, self.num_free_blocks - self._unallocated_reservations - self.padding_reserve_blocks)

    def available_for(self, request: Request) -> int:
        """What `request` may take: a padding dummy may also use the padding reserve."""
        if request.is_dummy:
            return self.num_free_blocks - self._unallocated_reservations
        return self.num_available_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    # -- admission and reservations ------------------------------------------------------------
    def admit(self, request: Request, num_tokens: int) -> bool:
        """Admit a new request: start it from its cached prefix and reserve KV for `num_tokens`.
        False, changing nothing, when that does not fit."""
        prefix = self.cached_prefix(request)
        if self._cost(request, num_tokens, prefix) > self.available_for(request):
            return False
        for block in prefix:
            self._reference(block)
        request.block_table.extend(prefix)
        request.num_cached_blocks = len(prefix)
        request.num_computed_tokens = len(prefix) * self.tokens_per_block
        self.reserve(request, num_tokens)
        return True

    def can_reserve(self, request: Request, num_tokens: int | None = None) -> bool:
        return self._cost(request, num_tokens) <= self.available_for(request)

    def reserve(self, request: Request, num_tokens: int | None = None) -> None:
        """Promise `request` enough blocks for `num_tokens` (default: prompt + max_tokens)."""
        extra = self._cost(request, num_tokens)
        if extra > self.available_for(request):
            raise NoFreeBlocksError(request.request_id, extra, self.available_for(request))
        if extra > 0:
            self._unallocated_reservations += extra
            request.reserved_blocks = self.blocks_for(self._tokens(request, num_tokens))

    def _cost(self, request: Request, num_tokens: int | None, prefix: Sequence[int] = ()) -> int:
        """The free blocks a reservation takes: those not yet held or promised, plus the cached
        prefix blocks nobody references (sharing them takes them out of the free pool)."""
        held = max(request.reserved_blocks, len(request.block_table) + len(prefix))
        return max(0, self.blocks_for(self._tokens(request, num_tokens)) - held) \
            + sum(1 for block in prefix if self._refs[block] == 0)

    @staticmethod
    def _tokens(request: Request, num_tokens: int | None) -> int:
        return num_tokens if num_tokens is not None else request.max_total_tokens

    # -- allocation ------------------------------------------------------------------------------
    def grow(self, request: Request, num_tokens: int) -> None:
        """Make the block table cover `num_tokens` tokens, drawing on the reservation first."""
        need = self.blocks_for(num_tokens) - len(request.block_table)
        if need <= 0:
            return
        from_reservation = min(need, max(0, request.reserved_blocks - len(request.block_table)))
        if need - from_reservation > self.available_for(request):
            raise NoFreeBlocksError(request.request_id, need - from_reservation, self.available_for(request))
        self._unallocated_reservations -= from_reservation
        request.block_table.extend(self._allocate() for _ in range(need))

    def shrink(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks beyond `num_tokens` (a rolled-back tentative allocation)."""
        keep = self.blocks_for(num_tokens)
        while len(request.block_table) > keep:
            self._release(request.block_table.pop())
            if len(request.block_table) < request.reserved_blocks:
                self._unallocated_reservations += 1
        request.num_cached_blocks = min(request.num_cached_blocks, keep)

    def free(self, request: Request) -> None:
        """Return every block and the unused part of the reservation."""
        self._unallocated_reservations -= max(0, request.reserved_blocks - len(request.block_table))
        for block in reversed(request.block_table):  # the tail first: evicted before the head
            self._release(block)
        request.block_table.clear()
        request.reserved_blocks = request.num_cached_blocks = 0

    def _allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently released cached block
            block, _ = self._evictable.popitem(last=False)
            key = self._hash_of.pop(block)
            del self._cached[key]
            self.events.removed(key)
            self.evictions += 1
        self._refs[block] = 1
        return block

    def _reference(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # -- the prefix cache --------------------------------------------------------------------------
    def cached_hashes(self) -> Iterable[bytes]:
        """The identities of every block in the cache."""
        return self._cached.keys()

    def cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks of the request's longest cached prefix, never covering its last token."""
        if not self._caches(request):
            return []
        tokens = request.all_token_ids
        blocks = []
        for i in range(block_hash.matchable_blocks(len(tokens), self.tokens_per_block)):
            block = self._cached.get(self._block_hash(request, i, tokens))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Enter the request's newly full blocks whose K/V are computed into the cache (after the
        pass that computed them: a vetoed pass never gets here)."""
        if not self._caches(request):
            return
        full = min(request.num_computed_tokens, request.num_tokens) // self.tokens_per_block
        if full <= request.num_cached_blocks:
            return
        tokens = request.all_token_ids
        for i in range(request.num_cached_blocks, full):
            key = self._block_hash(request, i, tokens)
            if key not in self._cached:
                block = request.block_table[i]
                self._cached[key], self._hash_of[block] = block, key
                self.events.stored(key)
        request.num_cached_blocks = full

    def _caches(self, request: Request) -> bool:
        return self.prefix_cache and not request.is_dummy and request.remote_kv is None

    def _block_hash(self, request: Request, i: int, tokens: list[int]) -> bytes:
        """Block i's chained hash; a request's hashes are computed once, as far as they are needed."""
        hashes, bs = request.block_hashes, self.tokens_per_block
        while len(hashes) <= i:
            j = len(hashes)
            hashes.append(block_hash.chain(hashes[-1] if hashes else block_hash.ROOT, tokens[j * bs:(j + 1) * bs]))
        return hashes[i]

    def slot(self, request: Request, position: int) -> int:
        return request.block_table[position // self.tokens_per_block] * self.tokens_per_block \
            + position % self.tokens_per_block
