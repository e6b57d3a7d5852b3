"""``/metrics``: an engine's gauges, counters and histograms in Prometheus' text format,
written by ``prometheus_client`` from the engine's own counters at each scrape (a
collector, so nothing is counted twice). The names are ``forge_jax_*``: requests running
and waiting, pages, the prefix cache, tokens, preemptions, compiled step variants, finished
requests by reason, time to first token and between tokens."""

from __future__ import annotations

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """The Prometheus exposition of one engine (``render()``: the text of a scrape)."""

    def __init__(self, engine):
        from prometheus_client import CollectorRegistry

        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        e = self.engine
        g, s = e.snapshot(), e.stats
        prefix = g.get("prefix")

        def gauge(name, help, value):
            return GaugeMetricFamily(f"forge_jax_{name}", help, value=value)

        def counter(name, help, value):  # the sample is named ..._total
            return CounterMetricFamily(f"forge_jax_{name}", help, value=value)

        yield gauge("requests_running", "Requests running.", g["running"])
        yield gauge("requests_waiting", "Requests waiting.", g["waiting"])
        yield gauge("pages_total", "Pages in the pool.", g.get("pages_total", 0))
        yield gauge("pages_used", "Pages in use (requests and prefix cache).",
                    g.get("pages_used", 0))
        yield gauge("pages_cached", "Pages held by the prefix cache.", g.get("pages_cached", 0))
        yield gauge("pages_reclaimable", "Cached pages no request holds.",
                    g.get("pages_reclaimable", 0))
        if prefix is not None:
            yield gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache over "
                        "tokens looked up.", prefix.hit_rate)
            yield counter("prefix_cache_hit_tokens", "Prompt tokens not prefilled again.",
                          prefix.hit_tokens)
            yield counter("prefix_cache_queried_tokens", "Prompt tokens looked up.",
                          prefix.queried_tokens)
            yield counter("prefix_cache_reused_pages", "Cached pages reused.",
                          prefix.reused_pages)
        yield counter("generated_tokens", "Tokens generated.", s.generated_tokens)
        yield counter("prompt_tokens", "Prompt tokens prefilled.", s.prompt_tokens)
        yield gauge("tokens_per_second", "Tokens generated per second over the last 10 s.",
                    s.tokens_per_second())
        yield counter("preemptions", "Requests preempted (recomputed later).", s.preemptions)
        yield counter("spec_draft_tokens", "Speculative draft tokens verified.", s.draft_tokens)
        yield counter("spec_accepted_tokens", "Speculative draft tokens kept.",
                      s.accepted_tokens)
        yield gauge("spec_acceptance_rate", "Draft tokens kept over drafted (speculative "
                    "decoding).", s.accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0)
        yield gauge("spec_tokens_per_step", "Tokens per speculating sequence per step.",
                    (s.accepted_tokens + s.verified) / s.verified if s.verified else 0.0)
        yield gauge("step_variants", "Compiled shapes of the step.", len(s.compiled))
        finished = CounterMetricFamily("forge_jax_requests_finished",
                                       "Requests finished, by reason.", labels=["reason"])
        for reason, n in dict(s.finished).items():
            finished.add_metric([reason], n)
        yield finished
        for name, help, h in (("time_to_first_token_seconds", "Time to first token.", s.ttft),
                              ("inter_token_latency_seconds", "Time between tokens.",
                               s.inter_token)):
            buckets = [(bound, count) for bound, count in h.cumulative()]
            yield HistogramMetricFamily(f"forge_jax_{name}", help, buckets=buckets,
                                        sum_value=h.total)
