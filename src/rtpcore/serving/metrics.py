"""The server's Prometheus metrics (docs/design.md §8), on a registry of its own.

Gauges are read from the engine when ``/metrics`` is scraped (nothing to keep in
step); counters and histograms are fed as tokens stream out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = ["ServerMetrics"]

# Seconds: from a few milliseconds (tiny models, a warm cache) to a minute (a queue).
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_ITERATION_BUCKETS = tuple(float(1 << i) for i in range(15))  # 1, 2, 4, ... 16384 tokens per step


class ServerMetrics:
    """The metrics of one server. ``stats`` returns the engine's live numbers as a mapping
    with ``kv_blocks_total``, ``kv_blocks_free``, ``running`` and ``waiting``."""

    def __init__(self, stats: Callable[[], dict[str, int]]):
        self.registry = CollectorRegistry()
        self._stats = stats
        gauges = {
            "kv_blocks_total": "KV-cache blocks per layer",
            "kv_blocks_free": "KV-cache blocks per layer not held by any request",
            "kv_blocks_cached": "KV-cache blocks per layer in the prefix cache, held or not",
            "requests_running": "requests in the running batch",
            "requests_waiting": "requests waiting to be admitted",
        }
        for name, doc in gauges.items():
            gauge = Gauge(f"rtpcore_{name}", doc, registry=self.registry)
            gauge.set_function(self._reader(name.removeprefix("requests_")))
        self.registry.register(_EngineCounters(stats))
        self.generated_tokens = Counter(
            "rtpcore_generated_tokens", "tokens generated for clients", registry=self.registry
        )
        self.requests = Counter(
            "rtpcore_requests", "finished requests by finish reason", ["finish_reason"], registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "rtpcore_time_to_first_token_seconds", "time from a request's arrival to its first token",
            buckets=_TTFT_BUCKETS, registry=self.registry,
        )
        self.time_between_tokens = Histogram(
            "rtpcore_time_between_tokens_seconds", "time between consecutive tokens of a request",
            buckets=_TBT_BUCKETS, registry=self.registry,
        )

        self.iteration_tokens = Histogram(
            "rtpcore_iteration_tokens", "tokens scheduled per engine step (decodes, prefill chunks, proposals)",
            buckets=_ITERATION_BUCKETS, registry=self.registry,
        )
        self.iteration_sequences = Histogram(
            "rtpcore_iteration_sequences", "sequences in each engine step",
            buckets=_ITERATION_BUCKETS[:13], registry=self.registry,
        )

    def observe_step(self, report: Any) -> None:
        """An engine step ended (``rtpcore.engine.core.outputs.StepReport``; called on the stepping thread)."""
        self.iteration_tokens.observe(report.num_tokens)
        self.iteration_sequences.observe(report.num_seqs)

    def _reader(self, key: str) -> Callable[[], float]:
        return lambda: float(self._stats()[key])

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

# EngineStats fields exposed as counters: name -> (the EngineStats field, help).
_ENGINE_COUNTERS = {
    "rtpcore_speculative_proposed_tokens": ("speculative_proposed_total", "draft tokens proposed by speculative decoding"),
    "rtpcore_speculative_accepted_tokens": ("speculative_accepted_total", "proposed draft tokens the target model accepted"),
    "rtpcore_preemptions": ("preemptions_total", "running requests preempted (to recompute) for want of KV blocks"),
    "rtpcore_request_errors": ("request_errors_total", "requests ended by their own fault (a model fault on them, a non-finite distribution)"),
    "rtpcore_prefix_cache_queries": ("prefix_cache_queries_total", "prompt tokens looked up in the prefix cache"),
    "rtpcore_prefix_cache_hits": ("prefix_cache_hits_total", "prompt tokens found in the prefix cache"),
    "rtpcore_cuda_graph_replays": ("cuda_graph_replays_total", "decode steps replayed from a captured CUDA graph"),
    "rtpcore_eager_decode_steps": ("eager_decode_steps_total", "decode steps run eagerly (a fallback on a GPU with graphs on)"),
    "rtpcore_greedy_picked_steps": ("greedy_picked_steps_total", "steps whose tokens were picked on the device without the sampler (all rows plain greedy)"),
    "rtpcore_overlapped_steps": ("overlapped_steps_total", "steps launched before the previous step's tokens were read (async scheduling)"),
    "rtpcore_async_fallback_steps": ("async_fallback_steps_total", "steps run synchronously with async scheduling on (a batch it does not cover)"),
    "rtpcore_async_discarded_tokens": ("async_discarded_tokens_total", "tokens computed for requests that had finished a step earlier, dropped (async scheduling)"),
}


class _EngineCounters(Collector):
    """Counters the engine keeps itself, read at scrape time: speculative decoding's
    proposed and accepted draft tokens (0 without a draft), preemptions, requests ended by
    their own fault, and the prefix cache's queried and hit tokens."""

    def __init__(self, stats: Callable[[], dict[str, int]]):
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        values = self._stats()
        for name, (key, doc) in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=values.get(key, 0))
