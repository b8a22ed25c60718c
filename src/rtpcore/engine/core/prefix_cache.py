"""Block keys of the prefix cache (docs/design.md §14).

A full block's key is SHA-256 over its parent block's key (the first block's parent is the
engine's *namespace*: everything that changes a block's bytes besides its tokens -- the
model, the draft, the KV dtype and layout, the block size) and the block's token ids. A
chain of keys therefore names a whole prefix, and two different prefixes share a key only
through a SHA-256 collision, which no client can provoke (a non-cryptographic hash, such as
Python's ``hash()``, would let one forge a key and read or poison another user's cached
prefix).

A request's ``cache_salt`` (``SamplingParams.cache_salt``) enters the key of its first block
(:func:`salt_key`), and so every key of its chain: requests share cached blocks only with
requests of the same salt, and unsalted requests only with each other. Without the salt a
client could time its requests, or read ``cached_tokens``, to learn whether another client
sent a prompt; with a salt per tenant it learns nothing about other tenants.

A draft that reads the target's hidden states (multi-token prediction) stores at position
p what it computed from token p + 1: the block's bytes depend on the first token of the
next block too. Such an engine keys each block over its tokens and ``lookahead`` = 1 token
after it, so a block is cached only once that token is known and found only by a prompt
that has it.

Which blocks a request finds and which it adds is the policy of :class:`PrefixCache`; its "off"
is an implementation too (:class:`NoPrefixCache`), so the KV manager
(``rtpcore.engine.core.kv_manager``) never asks whether caching is on.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rtpcore.engine.core.block_pool import BlockAllocator
    from rtpcore.engine.core.request import Request

__all__ = ["KEY_VERSION", "NoPrefixCache", "PrefixCache", "block_keys", "namespace_key", "salt_key"]

KEY_VERSION = 1  # changes when the key's content changes


def namespace_key(identity: Mapping[str, Any]) -> bytes:
    """The parent key of every sequence's first block: SHA-256 of ``identity`` (what besides
    the tokens changes a block's bytes), as canonical JSON."""
    text = json.dumps({"rtpcore_prefix_cache": KEY_VERSION, **identity}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def salt_key(salt: str) -> bytes:
    """What a ``cache_salt`` adds to the hash of a chain's first block: SHA-256 of the salt's
    UTF-8 under a label of its own (32 bytes, whatever the salt's length, so a salted first
    block hashes a longer message than any unsalted one)."""
    return hashlib.sha256(b"rtpcore cache_salt\0" + salt.encode("utf-8", "surrogatepass")).digest()


def block_keys(
    tokens: Sequence[int], tokens_per_block: int, parent: bytes, *, start: int = 0, lookahead: int = 0,
    salt: str | None = None,
) -> list[bytes]:
    """The keys of the full blocks ``start``, ``start + 1``, ... of ``tokens`` whose tokens
    (and ``lookahead`` tokens after each) are all known; ``parent``: the key of block
    ``start - 1`` (the namespace for block 0). ``salt``: the request's ``cache_salt``, hashed
    into block 0 between the namespace and the tokens (:func:`salt_key`)."""
    keys: list[bytes] = []
    tpb = tokens_per_block
    for i in range(start, (len(tokens) - lookahead) // tpb):
        h = hashlib.sha256(parent)
        if i == 0 and salt is not None:
            h.update(salt_key(salt))
        h.update(array("q", tokens[i * tpb : (i + 1) * tpb + lookahead]).tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Prefix caching on: a request finds the longest chain of cached full blocks of its tokens
    and adds its own full blocks once computed. ``namespace``: the key of every chain's root
    (:func:`namespace_key`); ``has_draft``: a speculative draft shares the blocks (a block is
    cached once both models computed it); ``lookahead``: 1 when the draft's bytes of a block
    depend on the token after it (a draft reading the target's hidden states).

    Counts what admitted requests looked up (``queries_total`` tokens) and found
    (``hits_total``)."""

    def __init__(self, namespace: bytes, tokens_per_block: int, *, has_draft: bool = False, lookahead: int = 0):
        self.namespace = namespace
        self.tpb = tokens_per_block
        self.has_draft = has_draft
        self.lookahead = lookahead
        self.queries_total = 0
        self.hits_total = 0

    def keys(self, r: Request) -> list[bytes]:
        """``r``'s block keys (its ``cache_salt`` in the first), extended to the full blocks
        its tokens now make."""
        keys = r.block_keys
        if (len(r.tokens) - self.lookahead) // self.tpb > len(keys):
            parent = keys[-1] if keys else self.namespace
            keys += block_keys(r.tokens, self.tpb, parent, start=len(keys), lookahead=self.lookahead,
                               salt=r.params.cache_salt)
        return keys

    def find(self, pool: BlockAllocator, r: Request) -> list[int]:
        """The cached blocks of ``r``'s longest cached prefix, never the block of its last
        token (always computed: its logits are needed); takes no reference."""
        usable = (len(r.tokens) - 1) // self.tpb
        return pool.lookup(self.keys(r)[:usable])

    def register(self, pool: BlockAllocator, r: Request) -> None:
        """Put ``r``'s full blocks that both models (with a draft) have computed in the cache.
        A block whose key is cached already (another request computed the same prefix in the
        same steps) stays the request's own."""
        limit = min(r.num_cached, r.draft_cached) if self.has_draft else r.num_cached
        full = min(limit // self.tpb, len(r.blocks))
        if full <= r.num_registered:
            return
        keys = self.keys(r)
        full = min(full, len(keys))
        for i in range(r.num_registered, full):
            pool.register(r.blocks[i], keys[i])
        r.num_registered = max(r.num_registered, full)

    def count(self, r: Request, hit: int) -> None:
        """An admitted request looked up its tokens and found ``hit`` of them cached."""
        self.queries_total += len(r.tokens)
        self.hits_total += hit
        if r.num_cached_tokens is None:
            r.num_cached_tokens = min(hit, r.prompt_len)


class NoPrefixCache:
    """Prefix caching off: nothing is found, nothing is added, nothing is counted."""

    queries_total = 0
    hits_total = 0

    def find(self, pool: BlockAllocator, r: Request) -> list[int]:
        return []

    def register(self, pool: BlockAllocator, r: Request) -> None:
        pass

    def count(self, r: Request, hit: int) -> None:
        pass
