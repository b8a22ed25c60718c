"""``rtpcore.batch.ForwardBatch`` stays a public path; the class lives in :mod:`rtpcore.engine.batch`."""

from rtpcore.engine.batch import ForwardBatch

__all__ = ["ForwardBatch"]
