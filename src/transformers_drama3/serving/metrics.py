"""`GET /metrics` in the Prometheus text format, through `prometheus-client`.

    drama3_http_requests_total{route, status}   every HTTP request answered, by route and status (4xx and 5xx too)
    drama3_time_to_first_audio_seconds          histogram: request received -> its first audio ready
    drama3_queue_seconds                        histogram: request received -> admitted into the running batch
    drama3_frames_total                         frames generated (frames per second: rate(drama3_frames_total[1m]))
    drama3_audio_seconds_total                  seconds of audio generated
    drama3_speech_requests_total{outcome}       speech requests by outcome: completed, failed, cancelled, rejected
    drama3_frame_steps_total                    frame steps of the engine (mean batch occupancy over a window:
                                                rate(drama3_frames_total) / rate(drama3_frame_steps_total))
    drama3_queue_length, drama3_running         requests waiting for their first frame, and admitted ones, now
    drama3_batch_occupancy                      sequences in the engine's running batch / --max-batch, now
    drama3_prompt_cache_{entries,bytes}         saved voices' cached prompt prefixes now; _hits/_misses/_evictions_total

The worker's counters are read when Prometheus scrapes (`WorkerCollector`), so the worker keeps one set of
counters. Each server has its own registry: several servers in one process (tests) never share series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: from a fast GPU's first chunk to a long queue on a busy CPU.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class WorkerCollector:
    """The generation worker's counters and gauges, read at each scrape (`worker()` is None while loading)."""

    def __init__(self, worker, max_batch: int):
        self.worker, self.max_batch = worker, max_batch

    def collect(self):
        worker = self.worker()
        if worker is None:
            return
        snapshot = worker.snapshot()
        outcomes = CounterMetricFamily("drama3_speech_requests", "Speech requests by outcome", labels=["outcome"])
        for outcome in ("completed", "failed", "cancelled", "rejected"):
            outcomes.add_metric([outcome], snapshot[outcome])
        yield outcomes
        yield CounterMetricFamily("drama3_frames", "Frames generated", value=snapshot["frames"])
        yield CounterMetricFamily("drama3_audio_seconds", "Seconds of audio generated", value=snapshot["audio_seconds"])
        yield CounterMetricFamily("drama3_frame_steps", "Frame steps of the engine", value=snapshot["steps"])
        yield GaugeMetricFamily("drama3_queue_length", "Requests waiting", value=snapshot["queued"])
        yield GaugeMetricFamily("drama3_running", "Requests generating now", value=snapshot["running"])
        yield GaugeMetricFamily("drama3_batch_occupancy", "Sequences in the running batch / --max-batch",
                                value=snapshot["running_sequences"] / self.max_batch)
        cache = snapshot.get("prompt_cache") or {}
        for name in ("entries", "bytes"):
            if name in cache:
                yield GaugeMetricFamily(f"drama3_prompt_cache_{name}", f"Saved voices' cached prefixes: {name}",
                                        value=cache[name])
        for name in ("hits", "misses", "evictions"):
            if name in cache:
                yield CounterMetricFamily(f"drama3_prompt_cache_{name}", f"Saved voices' prefix cache {name}",
                                          value=cache[name])


class ServerMetrics:
    """One server's Prometheus registry and the series the HTTP side records."""

    def __init__(self, worker, max_batch: int):
        self.registry = CollectorRegistry()
        self.requests = Counter("drama3_http_requests", "HTTP requests answered", ["route", "status"],
                                registry=self.registry)
        self.first_audio = Histogram("drama3_time_to_first_audio_seconds", "Request received -> first audio ready",
                                     buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queued = Histogram("drama3_queue_seconds", "Request received -> admitted into the running batch",
                                buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(WorkerCollector(worker, max_batch))

    def observe_start(self, queued_at: float, started_at: float | None, first_audio_at: float | None) -> None:
        """A speech request's first audio arrived: record its queue time and time to first audio."""
        if started_at is not None:
            self.queued.observe(max(0.0, started_at - queued_at))
        if first_audio_at is not None:
            self.first_audio.observe(max(0.0, first_audio_at - queued_at))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class CountRequests:
    """ASGI middleware (the outermost): counts every HTTP response by route template and status, refusals of the
    other middleware included (answered before routing: named by their path when it is a route's). Paths that
    match no route are counted as `other`, so scans cannot add series. `routes()`: the app's route paths."""

    def __init__(self, app, metrics: ServerMetrics, routes):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = []

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            route = getattr(scope.get("route"), "path", None)
            if route is None:
                route = scope["path"] if scope["path"] in self.routes() else "other"
            self.metrics.requests.labels(route, str(status[0] if status else 500)).inc()
