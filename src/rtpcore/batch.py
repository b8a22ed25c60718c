"""``rtpcore.batch.ForwardBatch`` stays a public path; the class lives in :mod:`rtpcore.models.forward_batch`."""

from rtpcore.models.forward_batch import ForwardBatch

__all__ = ["ForwardBatch"]
