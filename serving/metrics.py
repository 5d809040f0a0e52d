"""Prometheus metrics with vLLM's names (prefix ``jaxpage:`` instead of ``vllm:``), in a registry of their own.

Latencies and token counts are observed by the request handlers, as the client sees them from the server:
time to first token counts from the moment the call reached the handler. Engine state (running, waiting,
KV usage, preemptions, prefix cache) is read from ``AsyncEngine.stats()`` at scrape time. With data-parallel
replicas, every series of one replica's work (the engine's and its requests') carries ``replica="<rank>"``.
The HTTP endpoint is served by serving.security (``/metrics`` only, TLS and the bearer token when configured).
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxpage.engine.routing import DECISIONS

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
PREFIX = "jaxpage:"


class EngineStatsCollector:
    """Gauges and engine-side counters, read from the engine's stats at each scrape."""

    def __init__(self, stats: Callable[[], dict | None], model_name: Callable[[], str]):
        self._stats = stats
        self._model_name = model_name

    def describe(self):
        return []  # collected lazily: the engine may still be loading when the registry is built

    def collect(self):
        """One series per metric; with data-parallel replicas (stats with ``"replicas"``), one per replica,
        labelled ``replica="<rank>"``."""
        stats = self._stats()
        if stats is None:
            return
        model_name = self._model_name()
        replicas = stats.get("replicas")
        labels = ["model_name"] + (["replica"] if replicas else [])
        rows = ([([model_name, str(rank)], s) for rank, s in enumerate(replicas)] if replicas
                else [([model_name], stats)])

        def family(kind, name, doc, value):
            f = kind(PREFIX + name, doc, labels=labels)
            for values, s in rows:
                f.add_metric(values, value(s))
            return f

        gauge, counter = (lambda *a: family(GaugeMetricFamily, *a)), (lambda *a: family(CounterMetricFamily, *a))
        yield gauge("num_requests_running", "Sequences being generated (in the batch).", lambda s: s["num_running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s["num_waiting"])
        yield gauge("num_requests_swapped", "Requests swapped out to host memory.", lambda s: s["num_swapped"])
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
                    lambda s: 1 - s["num_free_blocks"] / s["num_blocks"] if s["num_blocks"] else 0.0)
        yield gauge("kv_blocks_free", "KV blocks that can be handed out (cached, unreferenced ones included).",
                    lambda s: s["num_free_blocks"])
        yield gauge("kv_blocks_total", "KV blocks in the pool (the null block excluded).", lambda s: s["num_blocks"])
        yield counter("num_preemptions", "Preemptions of running sequences.", lambda s: s["num_preemptions"])
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      lambda s: s["prefix_cache_queries"])
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      lambda s: s["prefix_cache_hits"])
        if "spec_decode_num_drafts" in stats:  # speculative decoding on
            yield from spec_decode_families(rows, labels)
        if "kv_offload_host_hits" in stats:  # the prefix cache's host (and disk) tiers on
            for name, doc in KV_OFFLOAD_COUNTERS:
                yield counter(name, doc, lambda s, name=name: s[name])
            yield gauge("kv_offload_host_blocks", "Blocks held in the prefix cache's host tier.",
                        lambda s: s["kv_offload_host_blocks"])
            yield gauge("kv_offload_disk_bytes", "Bytes of the prefix cache's disk tier's files.",
                        lambda s: s["kv_offload_disk_bytes"])
        if "routing" in stats:  # the data-parallel front end's
            yield routing_family(model_name, stats["routing"])


def routing_family(model_name: str, routing: dict):
    """The data-parallel router's decisions (jaxpage/engine/routing.py), by kind (label ``decision``)."""
    f = CounterMetricFamily(PREFIX + "router_decisions", "Requests routed to a data-parallel replica, by how the "
                            "replica was chosen.", labels=["model_name", "policy", "decision"])
    for decision in DECISIONS:
        f.add_metric([model_name, routing["policy"], decision], routing[f"routed_{decision}"])
    return f


KV_OFFLOAD_COUNTERS = (  # vLLM's external_prefix_cache_* (tokens), then the tiers' own (blocks, bytes, seconds)
    ("external_prefix_cache_queries", "Prompt tokens looked up in the prefix cache's host and disk tiers."),
    ("external_prefix_cache_hits", "Prompt tokens found in the host or disk tier (restored, not computed)."),
    ("kv_offload_host_hits", "KV blocks restored from the host tier."),
    ("kv_offload_host_hit_bytes", "Bytes of KV blocks restored from the host tier."),
    ("kv_offload_disk_hits", "KV blocks restored from the disk tier."),
    ("kv_offload_disk_hit_bytes", "Bytes of KV blocks restored from the disk tier."),
    ("kv_offload_stores", "KV blocks copied from the device to the host tier."),
    ("kv_offload_store_bytes", "Bytes of KV blocks copied from the device to the host tier."),
    ("kv_offload_restores", "KV blocks restored into the device pool from the host or disk tier."),
    ("kv_offload_disk_writes", "KV blocks written from the host tier to the disk tier."),
    ("kv_offload_disk_rejected", "Disk-tier files found truncated, corrupt or foreign, and deleted."),
    ("kv_offload_store_seconds", "Host seconds spent storing offloaded blocks into the host tier."),
    ("kv_offload_restore_seconds", "Host seconds spent restoring blocks into the device pool."),
    ("kv_offload_disk_read_seconds", "Seconds spent reading and checking disk-tier files."),
    ("kv_offload_disk_write_seconds", "Seconds spent writing disk-tier files."),
)


def spec_decode_families(rows: list, labels: list[str]):
    """vLLM's speculative-decoding counters: drafts, draft tokens, accepted tokens, and accepted tokens by draft
    position (label ``position``)."""
    for name, doc in (("num_drafts", "Draft proposals verified."), ("num_draft_tokens", "Draft tokens verified."),
                      ("num_accepted_tokens", "Draft tokens accepted.")):
        f = CounterMetricFamily(PREFIX + "spec_decode_" + name, doc, labels=labels)
        for values, s in rows:
            f.add_metric(values, s["spec_decode_" + name])
        yield f
    f = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position.",
                            labels=labels + ["position"])
    for values, s in rows:
        for pos, n in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
            f.add_metric(values + [str(pos)], n)
    yield f


class Metrics:
    def __init__(self, stats: Callable[[], dict | None] = lambda: None, model_name: Callable[[], str] = lambda: "",
                 replicas: int = 1):
        """replicas: the data-parallel size; above 1 the requests' latencies, token counts and successes are
        labelled by the replica that served them (``replica``); queue-level series (in flight, errors) are not."""
        disable_created_metrics()  # no *_created series (process-wide; they only add noise here)
        self.registry = CollectorRegistry(auto_describe=False)
        self._model_name = model_name
        self._children: dict[tuple, object] = {}
        r, labels = self.registry, ["model_name"]
        self.by_replica = replicas > 1
        served = labels + (["replica"] if self.by_replica else [])
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token, at the server.",
                              served, registry=r, buckets=TTFT_BUCKETS)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two streamed outputs.",
                             served, registry=r, buckets=ITL_BUCKETS)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             served, registry=r, buckets=E2E_BUCKETS)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests.", served,
                                     registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens sent back.", served,
                                         registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Requests finished, by finish reason.",
                                       served + ["finished_reason"], registry=r)
        self.request_errors = Counter(PREFIX + "request_errors", "Requests that ended with an error status.",
                                      labels + ["code"], registry=r)
        self.in_flight = Gauge(PREFIX + "num_requests_in_flight", "Generate calls being handled.", labels,
                               registry=r)
        r.register(EngineStatsCollector(stats, model_name))

    def served_by(self, rank: int) -> dict:
        """The extra labels of a request's series: its replica's rank, when there are several."""
        return {"replica": str(rank)} if self.by_replica else {}

    def labels(self, metric, **extra):
        """The metric's child for the served model (cached: this is on the per-token path)."""
        key = (id(metric), *extra.values())
        child = self._children.get(key)
        if child is None:
            model_name = self._model_name()
            child = metric.labels(model_name=model_name, **extra)
            if model_name:  # known for good once the engine is up
                self._children[key] = child
        return child
