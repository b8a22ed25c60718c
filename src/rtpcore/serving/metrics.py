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
    with ``kv_blocks_total``, ``kv_blocks_free``, ``running`` and ``waiting``.

    Besides rtpcore's own names, the ones vLLM's published Grafana dashboard reads, labelled
    ``model_name`` (docs/design.md §17), so that dashboard works unchanged:
    ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
    (0 to 1), ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
    ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
    ``vllm:e2e_request_latency_seconds``, ``vllm:prefix_cache_queries_total`` and
    ``vllm:prefix_cache_hits_total``. Feed them through :meth:`tokens`, :meth:`first_token`,
    :meth:`between_tokens`, :meth:`prompt` and :meth:`finished`."""

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str = "model"):
        self.registry = CollectorRegistry()
        self._stats = stats
        self.model_name = model_name
        gauges = {
            "kv_blocks_total": "KV-cache blocks per layer",
            "kv_blocks_free": "KV-cache blocks per layer not held by any request",
            "kv_blocks_cached": "KV-cache blocks per layer in the prefix cache, held or not",
            "requests_running": "requests in the running batch",
            "requests_waiting": "requests waiting to be admitted",
            "requests_paused": "requests paused: their streams' clients read nothing, their unsent output is at "
                               "--stream-buffer-bytes",
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

        label = {"model_name": model_name}
        for name, doc, read in (
            ("num_requests_running", "requests in the running batch", self._reader("running")),
            ("num_requests_waiting", "requests waiting to be admitted", self._reader("waiting")),
            ("kv_cache_usage_perc", "share of the KV-cache blocks in use, 0 to 1", self._usage),
        ):
            Gauge(f"vllm:{name}", doc, ["model_name"], registry=self.registry).labels(**label).set_function(read)
        self._vllm_prompt = Counter("vllm:prompt_tokens", "prompt tokens of the requests started", ["model_name"],
                                    registry=self.registry).labels(**label)
        self._vllm_generation = Counter("vllm:generation_tokens", "tokens generated for clients", ["model_name"],
                                        registry=self.registry).labels(**label)
        self._vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "time from arrival to the first token",
                                    ["model_name"], buckets=_TTFT_BUCKETS, registry=self.registry).labels(**label)
        self._vllm_itl = Histogram("vllm:inter_token_latency_seconds", "time between consecutive tokens",
                                   ["model_name"], buckets=_TBT_BUCKETS, registry=self.registry).labels(**label)
        self._vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "time from arrival to the last token",
                                   ["model_name"], buckets=_TTFT_BUCKETS, registry=self.registry).labels(**label)
        self.registry.register(_VllmEngineCounters(stats, model_name))

    def tokens(self, count: int) -> None:
        """``count`` tokens were generated for a client."""
        self.generated_tokens.inc(count)
        self._vllm_generation.inc(count)

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)
        self._vllm_ttft.observe(seconds)

    def between_tokens(self, seconds: float) -> None:
        self.time_between_tokens.observe(seconds)
        self._vllm_itl.observe(seconds)

    def prompt(self, count: int) -> None:
        """An engine request of ``count`` prompt tokens was started."""
        self._vllm_prompt.inc(count)

    def finished(self, reason: str, seconds: float | None) -> None:
        """A request ended with ``reason``, ``seconds`` after it arrived (None: it produced nothing)."""
        self.requests.labels(finish_reason=reason).inc()
        if seconds is not None:
            self._vllm_e2e.observe(seconds)

    def _usage(self) -> float:
        stats = self._stats()
        total = stats["kv_blocks_total"]
        return (total - stats["kv_blocks_free"]) / total if total else 0.0

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
    their own fault, the prefix cache's queried and hit tokens, attention calls by backend and
    steps by kernel."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        values = self._stats()
        for name, (key, doc) in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=values.get(key, 0))
        calls = CounterMetricFamily("rtpcore_attention_calls", "attention calls (one per layer per forward) by "
                                    "attention backend (rtpcore.attention)", labels=["backend"])
        for backend, n in sorted(values.get("attention_calls", {}).items()):
            calls.add_metric([backend], n)
        yield calls
        steps = CounterMetricFamily("rtpcore_kernel_steps", "model steps by the kernel that ran them "
                                    "(rtpcore.models.kernel_table; rtpcore info)", labels=["kernel"])
        for kernel, n in sorted(values.get("kernel_calls", {}).items()):
            steps.add_metric([kernel], n)
        yield steps


class _VllmEngineCounters(Collector):
    """The prefix cache's counters under vLLM's names, labelled ``model_name``."""

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str):
        self._stats, self._model = stats, model_name

    def collect(self) -> Iterator[CounterMetricFamily]:
        values = self._stats()
        for name, key, doc in (
            ("vllm:prefix_cache_queries", "prefix_cache_queries_total", "prompt tokens looked up in the prefix cache"),
            ("vllm:prefix_cache_hits", "prefix_cache_hits_total", "prompt tokens found in the prefix cache"),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model], values.get(key, 0))
            yield family
