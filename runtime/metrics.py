"""What `glint serve` reports at /metrics (Prometheus text), gathered from the engine thread."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ServerMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.running = Gauge("glint_requests_running", "sequences holding KV pages", registry=r)
        self.waiting = Gauge("glint_requests_waiting", "requests queued or preempted", registry=r)
        self.pages_in_use = Gauge("glint_kv_pages_in_use", "KV pages in use, all layer groups", registry=r)
        self.pages_total = Gauge("glint_kv_pages_total", "usable KV pages, all layer groups", registry=r)
        self.generated = Counter("glint_generated_tokens", "tokens sampled", registry=r)
        self.preemptions = Counter("glint_preemptions", "requests preempted for recompute", registry=r)
        self.requests = Counter("glint_requests", "requests received, by outcome", ["outcome"], registry=r)
        self.aborted = Counter("glint_aborted_requests",
                               "requests cancelled before they finished: the client left (or the engine failed)",
                               registry=r)
        self.prefix_lookup = Counter("glint_prefix_cache_lookup_tokens", "prompt tokens of admitted requests",
                                     registry=r)
        self.prefix_hits = Counter("glint_prefix_cache_hit_tokens", "of them, found in the prefix cache", registry=r)
        self.prefix_evictions = Counter("glint_prefix_cache_evictions", "cached pages reused for new data",
                                        registry=r)
        self.prefix_pages = Gauge("glint_prefix_cache_pages", "pages in the prefix cache, all layer groups",
                                  registry=r)
        self.step_seconds = Histogram("glint_step_seconds", "engine.step() wall time", buckets=STEP_BUCKETS,
                                      registry=r)
        self._seen = {"generated": 0, "preemptions": 0, "lookup": 0, "hits": 0, "evictions": 0}

    def observe(self, engine, step_s: float | None) -> None:
        """Called by the engine thread after each step (step_s) and when idle (None)."""
        if step_s is not None:
            self.step_seconds.observe(step_s)
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))
        groups = range(engine.cache.num_groups)
        self.pages_in_use.set(sum(engine.control.pages_in_use(g) for g in groups))
        self.pages_total.set(engine.cache.num_groups * (engine.cache.num_pages - 1))
        stats = engine.stats
        self.prefix_pages.set(stats.prefix_cached_pages)
        for name, counter, now in (("generated", self.generated, stats.generated_tokens),
                                   ("preemptions", self.preemptions, stats.preemptions),
                                   ("lookup", self.prefix_lookup, stats.prefix_lookup_tokens),
                                   ("hits", self.prefix_hits, stats.prefix_hit_tokens),
                                   ("evictions", self.prefix_evictions, stats.prefix_evictions)):
            counter.inc(now - self._seen[name])
            self._seen[name] = now

    def text(self) -> bytes:
        return generate_latest(self.registry)
