"""GET /metrics: Prometheus text with SGLang's metric names, from the engine's request counters
and scheduler state at scrape time (a registry per server, so several can live in a process)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from spec_engine.core.stats import LATENCY_BUCKETS
from spec_engine.engine import Engine


class EngineCollector:
    """A prometheus_client collector reading one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        labels = {"model_name": self.engine.args.served_model_name or ""}
        names, values = list(labels), list(labels.values())
        stats = self.engine.stats.snapshot()
        load = self.engine.get_load(["core"])["loads"][0]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge("sglang:num_running_reqs", "Running requests.", load["num_running_reqs"])
        yield gauge("sglang:num_queue_reqs", "Waiting requests.", load["num_waiting_reqs"])
        yield gauge("sglang:num_used_tokens", "KV tokens in use.", load["num_used_tokens"])
        yield gauge("sglang:token_usage", "Fraction of the KV pool in use.", load["token_usage"])
        yield gauge(
            "sglang:max_total_num_tokens", "KV pool size in tokens.", load["max_total_num_tokens"]
        )
        yield gauge("sglang:gen_throughput", "Last decode step's tokens/s.", load["gen_throughput"])
        yield gauge(
            "sglang:cache_hit_rate",
            "Prompt tokens served from the prefix cache.",
            load["cache_hit_rate"],
        )
        yield gauge("sglang:utilization", "Load (SGLang's definition).", load["utilization"])
        verify = stats["spec_verify_ct"]
        yield gauge(
            "sglang:spec_accept_length",
            "Tokens per verify pass (finished requests).",
            stats["spec_emitted"] / verify if verify else 0.0,
        )
        # CounterMetricFamily appends _total to the names.
        yield counter("sglang:prompt_tokens", "Prompt tokens.", stats["prompt_tokens"])
        yield counter("sglang:generation_tokens", "Generated tokens.", stats["generation_tokens"])
        yield counter(
            "sglang:cached_tokens", "Prompt tokens from the prefix cache.", stats["cached_tokens"]
        )
        finished = stats["requests"]
        yield counter("sglang:num_requests", "Finished requests.", sum(finished.values()))
        yield counter("sglang:num_aborted_requests", "Aborted requests.", finished.get("abort", 0))
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], stats["latency_counts"]):
            cumulative += count
            buckets.append((bound, cumulative))
        latency = HistogramMetricFamily(
            "sglang:e2e_request_latency_seconds", "End-to-end request latency.", labels=names
        )
        latency.add_metric(values, buckets, stats["latency_sum"])
        yield latency


def metrics_text(registry: Any) -> tuple[bytes, str]:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry), CONTENT_TYPE_LATEST


def make_registry(engine: Engine) -> Any:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry
