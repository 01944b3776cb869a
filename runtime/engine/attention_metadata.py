"""One builder of attention metadata for every batch: prefill chunks, decode tokens, and padding.

Real batches and dummy batches go through the same builder. Padding (to the token count the ADP
ranks agreed on) is added as dummy decode requests of `decode_query_len` tokens each that read
and write only the null block (block 0), so the padded metadata keeps the uniform-decode
invariant: `num_decode_tokens == num_decodes * decode_query_len` — the padded token count goes
to the builder together with the padded request count, never one without the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NULL_BLOCK = 0  # never handed out; dummy tokens write their K/V here


@dataclass
class SeqChunk:
    """The tokens one request runs this pass: `token_ids` at positions start_pos.. (K/V of the
    positions before start_pos are already in the cache through `block_table`)."""
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    is_decode: bool


@dataclass
class AttentionMetadata:
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    decode_query_len: int
    num_actual_reqs: int  # before padding
    num_actual_tokens: int
    query_start_loc: list[int] = field(default_factory=list)  # prefills, len num_prefills + 1
    context_lens: list[int] = field(default_factory=list)  # prefills: tokens already cached
    prefill_slots: list[torch.Tensor | None] = field(default_factory=list)
    slot_mapping: torch.Tensor | None = None  # [num_tokens]
    tokens_per_block: int = 16
    # decodes: where each request's K/V lives, read in place by the attention backend
    decode_block_tables: torch.Tensor | None = None  # int32 [num_decodes, max blocks], null-block padded
    decode_seq_lens: torch.Tensor | None = None  # int32 [num_decodes], this pass's query tokens included

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


def dummy_decode(decode_query_len: int) -> SeqChunk:
    # one null-block entry per token covers every position, whatever the block size
    return SeqChunk([0] * decode_query_len, 0, [NULL_BLOCK] * decode_query_len, is_decode=True)


def build(chunks: list[SeqChunk], tokens_per_block: int, decode_query_len: int = 1,
          pad_to_tokens: int | None = None, device: str | torch.device = "cpu"
          ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Order the chunks (prefills first), pad with dummy decodes up to `pad_to_tokens`, and return
    (input_ids, positions, metadata)."""
    prefills = [c for c in chunks if not c.is_decode]
    decodes = [c for c in chunks if c.is_decode]
    for c in decodes:
        if len(c.token_ids) != decode_query_len:
            raise ValueError(f"decode chunk of {len(c.token_ids)} tokens, expected {decode_query_len}")
    actual = sum(len(c.token_ids) for c in chunks)
    if pad_to_tokens is not None and pad_to_tokens > actual:
        # Every rank must reach exactly the agreed count: whole dummy decodes, and a remainder
        # (only when decode_query_len > 1) as one short dummy prefill on the null block.
        full, rest = divmod(pad_to_tokens - actual, decode_query_len)
        decodes += [dummy_decode(decode_query_len) for _ in range(full)]
        if rest:
            prefills.append(SeqChunk([0] * rest, 0, [NULL_BLOCK] * rest, is_decode=False))

    bs = tokens_per_block
    ids, pos, slots = [], [], []
    for c in prefills + decodes:
        ids += c.token_ids
        for p in range(c.start_pos, c.start_pos + len(c.token_ids)):
            pos.append(p)
            slots.append(c.block_table[p // bs] * bs + p % bs)

    meta = AttentionMetadata(
        num_prefills=len(prefills), num_prefill_tokens=sum(len(c.token_ids) for c in prefills),
        num_decodes=len(decodes), num_decode_tokens=len(decodes) * decode_query_len,
        decode_query_len=decode_query_len, num_actual_reqs=len(chunks), num_actual_tokens=actual,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device), tokens_per_block=bs)
    loc = 0
    for c in prefills:
        meta.query_start_loc.append(loc)
        meta.context_lens.append(c.start_pos)
        meta.prefill_slots.append(
            _slots([c.block_table], c.start_pos + len(c.token_ids), bs, device)[0] if c.start_pos else None)
        loc += len(c.token_ids)
    meta.query_start_loc.append(loc)
    if decodes:
        seq_lens = [c.start_pos + decode_query_len for c in decodes]
        meta.decode_block_tables = _block_table([c.block_table for c in decodes], -(-max(seq_lens) // bs), device)
        meta.decode_seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return (torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(pos, dtype=torch.long, device=device), meta)


def _block_table(block_tables: list[list[int]], width: int, device, dtype=torch.int32) -> torch.Tensor:
    """The block tables as one tensor [len(block_tables), width], padded with the null block."""
    return torch.tensor([(bt + [NULL_BLOCK] * width)[:width] for bt in block_tables], dtype=dtype, device=device)


def _slots(block_tables: list[list[int]], length: int, bs: int, device) -> torch.Tensor:
    """Cache slots of positions 0..length-1 for each block table, [len(block_tables), length]."""
    table = _block_table(block_tables, -(-length // bs), device, torch.long)
    p = torch.arange(length, device=device)
    return table[:, p // bs] * bs + p % bs
