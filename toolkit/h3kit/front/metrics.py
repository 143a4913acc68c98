"""The front's /metrics (prometheus_client, its own registry):

- h3front_jobs{state}:                 jobs in the queue database by state (every front of it), read at scrape;
- h3front_queue_wait_seconds:          histogram, acceptance to first dispatch, observed by the front dispatching;
- h3front_servers{state}:              this front's servers by state (up, down, hung), and h3front_server_up{server};
- h3front_dispatches_total{cause}:     prompts this front sent to a server, by why (new, or a re-dispatch cause);
- h3front_redispatches_total{cause}:   jobs this front took off a server and queued again (server_died,
                                       server_hung, server_restarted, front_lost, dispatch_failed).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from h3kit.front import store as st
from h3kit.front.dispatch import CAUSES

WAIT_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600)


class _Live:
    def __init__(self, store, pool):
        self.store, self.pool = store, pool

    def collect(self):
        jobs = GaugeMetricFamily("h3front_jobs", "Jobs in the queue database by state", labels=["state"])
        for state, n in self.store.counts().items():
            jobs.add_metric([state], n)
        yield jobs
        servers = GaugeMetricFamily("h3front_servers", "This front's servers by state", labels=["state"])
        for state, n in self.pool.counts().items():
            servers.add_metric([state], n)
        yield servers
        up = GaugeMetricFamily("h3front_server_up", "1 when the server answers its health check", labels=["server"])
        for s in list(self.pool.servers.values()):
            up.add_metric([s.url], 1.0 if s.healthy else 0.0)
        yield up


class Metrics:
    def __init__(self, store, pool):
        self.registry = CollectorRegistry()
        self.registry.register(_Live(store, pool))
        self.wait = Histogram("h3front_queue_wait_seconds", "Seconds from a job's acceptance to its first dispatch",
                              buckets=WAIT_BUCKETS, registry=self.registry)
        self.dispatches = Counter("h3front_dispatches", "Prompts this front dispatched to a server, by cause",
                                  ["cause"], registry=self.registry)
        self.redispatches = Counter("h3front_redispatches", "Jobs taken off a server and queued again, by cause",
                                    ["cause"], registry=self.registry)
        for cause in CAUSES:
            self.dispatches.labels(cause)
            if cause != "new":
                self.redispatches.labels(cause)

    def dispatched(self, job: st.Job) -> None:
        self.dispatches.labels(job.cause or "new").inc()
        if job.attempts == 1 and job.dispatched_at:
            self.wait.observe(max(0.0, job.dispatched_at - job.created_at))

    def redispatch(self, cause: str) -> None:
        self.redispatches.labels(cause).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
