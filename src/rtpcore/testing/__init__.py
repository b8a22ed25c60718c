"""What a plugin's own tests use (docs/design.md §21): demo checkpoints now; the conformance kit
of §19 joins them here.

:func:`demo_checkpoint` builds (once, then from the cache) a small, deterministic, random-weight
checkpoint of any model type whose plugin has a ``demo_config()``: a plugin's test gets a real
checkpoint folder without a download. :func:`ensure_demo_checkpoint` does the same for a plugin
object in hand, and :func:`demo_cache_dir` says where they are kept.
"""

from rtpcore.testing.demo import demo_cache_dir, demo_checkpoint, ensure_demo_checkpoint

__all__ = ["demo_cache_dir", "demo_checkpoint", "ensure_demo_checkpoint"]
