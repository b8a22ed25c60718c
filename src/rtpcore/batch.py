"""What a model plugin's ``forward`` receives (docs/design.md §21): :class:`ForwardBatch`, the
forward contract's one argument besides the KV caches -- the step's tokens, positions, sequence
lengths and block tables. It lives in :mod:`rtpcore.models.forward_batch`, whose path may move;
import it from here.
"""

from rtpcore.models.forward_batch import ForwardBatch

__all__ = ["ForwardBatch"]
