"""The identity of a full KV block in the prefix cache: a hash chained from its parent block.

The K/V of a token depend on the token, on its position (RoPE) and on every token before it
(attention). Block i of a sequence covers positions i·B .. i·B + B - 1, so its identity is
`chain(identity of block i - 1, its B token ids)`, from `ROOT` at block 0: the chain fixes both
the whole prefix and the positions. Nothing else enters it, because nothing else varies per
request here: the model, its dtype, RoPE and the block size are per server, and a cache lives
and dies with its rank (no LoRA adapters, no per-request RoPE scaling or position offsets, no
multimodal inputs; validation refuses non-default RoPE). Whatever a request may one day bring
that changes its K/V for the same tokens (an adapter, image features, a tenant's cache salt)
must enter the chain too, as vLLM's "extra keys" do.

SHA-256 over the parent's digest and the token ids as little-endian uint32: no per-process seed,
so every rank and server (and a router that tokenizes) computes the same chain for the same
tokens and block size; a collision would need a SHA-256 collision. Standard library only.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT = b""  # the parent of block 0
SCHEME = "sha256-chained-uint32le"  # how a router that tokenizes computes the same identities


def chain(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


def matchable_blocks(num_tokens: int, tokens_per_block: int) -> int:
    """How many leading full blocks of a new request's tokens a cache hit may cover: never the
    last token, which must run for the logits its first output token is sampled from."""
    return max(0, num_tokens - 1) // tokens_per_block


def prefix_hashes(token_ids: Sequence[int], tokens_per_block: int) -> list[bytes]:
    """The identities of the blocks a new request with these tokens may find cached, in order
    (what the server's ADP dispatcher looks up in its view of each rank)."""
    return block_hashes(token_ids[:matchable_blocks(len(token_ids), tokens_per_block) * tokens_per_block],
                        tokens_per_block)


def block_hashes(token_ids: Sequence[int], tokens_per_block: int, parent: bytes = ROOT) -> list[bytes]:
    """The chained identities of every full block of `token_ids`."""
    out = []
    for start in range(0, len(token_ids) - tokens_per_block + 1, tokens_per_block):
        parent = chain(parent, token_ids[start:start + tokens_per_block])
        out.append(parent)
    return out
