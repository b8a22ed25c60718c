"""How a model plugin splits its layers over tensor-parallel ranks (docs/design.md §21).

``column_shard``/``row_shard``/``head_shard``/``kv_head_shard`` say which slice of a dimension a
rank holds (a :class:`Shard`, with the rule a size breaks named in its error);
:class:`ParallelContext` is what ``build_model`` receives as ``parallel``: the rank, the world size
and the collectives. The code lives in :mod:`rtpcore.parallel`, whose module paths may move;
import these names from here.
"""

from rtpcore.parallel.context import ParallelContext
from rtpcore.parallel.sharding import Shard, column_shard, head_shard, kv_head_shard, row_shard

__all__ = ["ParallelContext", "Shard", "column_shard", "head_shard", "kv_head_shard", "row_shard"]
