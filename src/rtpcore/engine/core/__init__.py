"""Requests and the step plan, per step on rank 0: the scheduler (policy) over the KV manager (blocks per request), the block pool and the prefix cache. Above sample/; step/ runs its plans."""
