"""Block keys of the prefix cache (docs/design.md §14).

A full block's key is SHA-256 over its parent block's key (the first block's parent is the
engine's *namespace*: everything that changes a block's bytes besides its tokens -- the
model, the draft, the KV dtype and layout, the block size) and the block's token ids. A
chain of keys therefore names a whole prefix, and two different prefixes share a key only
through a SHA-256 collision, which no client can provoke (a non-cryptographic hash, such as
Python's ``hash()``, would let one forge a key and read or poison another user's cached
prefix).

A draft that reads the target's hidden states (multi-token prediction) stores at position
p what it computed from token p + 1: the block's bytes depend on the first token of the
next block too. Such an engine keys each block over its tokens and ``lookahead`` = 1 token
after it, so a block is cached only once that token is known and found only by a prompt
that has it.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["KEY_VERSION", "block_keys", "namespace_key"]

KEY_VERSION = 1  # changes when the key's content changes


def namespace_key(identity: Mapping[str, Any]) -> bytes:
    """The parent key of every sequence's first block: SHA-256 of ``identity`` (what besides
    the tokens changes a block's bytes), as canonical JSON."""
    text = json.dumps({"rtpcore_prefix_cache": KEY_VERSION, **identity}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def block_keys(
    tokens: Sequence[int], tokens_per_block: int, parent: bytes, *, start: int = 0, lookahead: int = 0,
) -> list[bytes]:
    """The keys of the full blocks ``start``, ``start + 1``, ... of ``tokens`` whose tokens
    (and ``lookahead`` tokens after each) are all known; ``parent``: the key of block
    ``start - 1`` (the namespace for block 0)."""
    keys: list[bytes] = []
    tpb = tokens_per_block
    for i in range(start, (len(tokens) - lookahead) // tpb):
        h = hashlib.sha256(parent)
        h.update(array("q", tokens[i * tpb : (i + 1) * tpb + lookahead]).tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys
