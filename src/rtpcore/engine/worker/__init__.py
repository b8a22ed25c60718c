"""On every rank: the shard (model, KV pools, CUDA graphs), devices and KV memory sizing; step/ drives it through the worker group. Above step/."""
