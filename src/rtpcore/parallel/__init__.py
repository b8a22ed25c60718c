"""Tensor parallelism: ranks, their messages and how weights split.

``context`` is a rank's view of its group (collectives over torch.distributed;
``sealing`` authenticates every object ranks exchange); ``leader`` runs in the
engine's process and drives the ``follower`` ranks, whose failures come back
through ``failures``; ``sharding`` says which slice of each weight a rank owns and
``layers`` finishes row- and vocabulary-parallel layers. The engine stage builds
one rank's state on each of them (``rtpcore.engine.worker.rank``).

Run a rank of a multi-machine group with ``python -m rtpcore.parallel.leader``.
"""
