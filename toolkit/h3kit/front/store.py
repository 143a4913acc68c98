"""The front's durable queue: one table of jobs in a real database (SQLAlchemy Core).

SQLite by default (a file in the front's data folder, WAL, synchronous FULL: a job the front answered for is on
disk), PostgreSQL by URL (postgresql://... uses the pure-Python pg8000 driver) when fronts run on several hosts.

Every change of a job's state is one conditional UPDATE, so that two fronts on one database never run one job
twice at once:
- claim: `state='queued'` -> `running` (WHERE state='queued'): of two fronts claiming one job, one updates a row;
- a running job carries a lease (owner, until); its owner renews it while it follows the job, and every later
  write of the owner (publish, requeue, fail) is conditional on still holding it;
- a lease that ran out (its front was killed or hung) is taken over by a conditional UPDATE on the old
  (owner, until) pair, so that one front recovers it;
- publish: `running` -> `done` only for the holder of the lease and the attempt it dispatched
  (server_prompt_id): an output is published under its job once.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import sqlalchemy as sa

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"
STATES = (QUEUED, RUNNING, DONE, FAILED, CANCELLED)
FINAL = (DONE, FAILED, CANCELLED)

metadata = sa.MetaData()
jobs = sa.Table(
    "h3front_jobs", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("kind", sa.String(16), nullable=False),            # comfy | video
    sa.Column("user", sa.String(128), nullable=False),
    sa.Column("state", sa.String(16), nullable=False, index=True),
    sa.Column("npu_count", sa.Integer, nullable=True),          # None: "auto", fits any server
    sa.Column("prompt", sa.Text, nullable=False),               # the API-format prompt, JSON
    sa.Column("extra", sa.Text, nullable=False, default="{}"),  # client_id, extra_data, video parameters
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("dispatched_at", sa.Float, nullable=True),
    sa.Column("finished_at", sa.Float, nullable=True),
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("cause", sa.String(32), nullable=True),           # why the last dispatch happened
    sa.Column("server", sa.String(256), nullable=True),
    sa.Column("server_prompt_id", sa.String(64), nullable=True),
    sa.Column("lease_owner", sa.String(64), nullable=True),
    sa.Column("lease_until", sa.Float, nullable=True),
    sa.Column("cancel", sa.Boolean, nullable=False, default=False),
    sa.Column("outputs", sa.Text, nullable=True),               # published outputs (history form), JSON
    sa.Column("status", sa.Text, nullable=True),                # ComfyUI's history status, JSON
    sa.Column("error", sa.Text, nullable=True),
)


@dataclass
class Job:
    id: str
    kind: str
    user: str
    state: str
    npu_count: int | None
    prompt: dict
    extra: dict
    created_at: float
    dispatched_at: float | None
    finished_at: float | None
    attempts: int
    cause: str | None
    server: str | None
    server_prompt_id: str | None
    lease_owner: str | None
    lease_until: float | None
    cancel: bool
    outputs: dict | None
    status: dict | None
    error: str | None


def _job(row) -> Job:
    m = dict(row._mapping)
    for k in ("prompt", "extra"):
        m[k] = json.loads(m[k] or "{}")
    for k in ("outputs", "status"):
        m[k] = json.loads(m[k]) if m[k] else None
    return Job(**m)


def engine_url(url: str) -> str:
    """postgresql:// (and postgres://) without a driver mean pg8000, the driver the `front` extra installs."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+pg8000://" + url[len(prefix):]
    return url


def make_engine(url: str) -> sa.engine.Engine:
    url = engine_url(url)
    if url.startswith("sqlite"):
        eng = sa.create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @sa.event.listens_for(eng, "connect")
        def _pragmas(dbapi_conn, _record):
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()
        return eng
    return sa.create_engine(url, pool_pre_ping=True, pool_size=4, max_overflow=4)


class Store:
    """The queue. Methods are synchronous (the front calls them in a worker thread); each is one transaction."""

    def __init__(self, url: str, clock=time.time):
        self.url = url
        self.engine = make_engine(url)
        self.clock = clock
        metadata.create_all(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------------------------------------ writes

    def add(self, *, kind: str, user: str, prompt: dict, extra: dict, npu_count: int | None,
            job_id: str | None = None) -> Job:
        row = {"id": job_id or str(uuid.uuid4()), "kind": kind, "user": user, "state": QUEUED,
               "npu_count": npu_count, "prompt": json.dumps(prompt), "extra": json.dumps(extra),
               "created_at": self.clock(), "attempts": 0, "cancel": False}
        with self.engine.begin() as c:
            c.execute(jobs.insert().values(**row))
        return self.get(row["id"])

    def claim(self, *, server: str, devices: int | None, owner: str, lease: float) -> Job | None:
        """Take the next queued job that fits a server with `devices` devices: the user whose last dispatch is
        the oldest goes first (users take turns), then that user's oldest job. None when nothing fits."""
        for job_id in self._candidates(devices):
            now = self.clock()
            values = {"state": RUNNING, "server": server, "server_prompt_id": str(uuid.uuid4()),
                      "lease_owner": owner, "lease_until": now + lease, "dispatched_at": now,
                      "attempts": jobs.c.attempts + 1, "cause": sa.func.coalesce(jobs.c.cause, "new")}
            with self.engine.begin() as c:
                hit = c.execute(jobs.update().where(jobs.c.id == job_id, jobs.c.state == QUEUED,
                                                    jobs.c.cancel == sa.false()).values(**values))
            if hit.rowcount == 1:
                return self.get(job_id)
        return None

    def _candidates(self, devices: int | None, limit: int = 500) -> list[str]:
        fits = jobs.c.npu_count.is_(None)
        if devices is not None:
            fits = sa.or_(fits, jobs.c.npu_count == devices)
        with self.engine.connect() as c:
            queued = c.execute(sa.select(jobs.c.id, jobs.c.user).where(jobs.c.state == QUEUED, fits,
                                                                       jobs.c.cancel == sa.false())
                               .order_by(jobs.c.created_at, jobs.c.id).limit(limit)).all()
            users = {u for _, u in queued}
            last = dict(c.execute(sa.select(jobs.c.user, sa.func.max(jobs.c.dispatched_at))
                                  .where(jobs.c.user.in_(users)).group_by(jobs.c.user)).all()) if users else {}
        first_seen: dict[str, int] = {}
        for i, (_, u) in enumerate(queued):
            first_seen.setdefault(u, i)
        order = sorted(users, key=lambda u: (last.get(u) is not None, last.get(u) or 0.0, first_seen[u]))
        by_user = {u: [j for j, uu in queued if uu == u] for u in users}
        return [j for u in order for j in by_user[u]]

    def renew(self, owner: str, lease: float) -> int:
        """Extend the lease of every running job `owner` holds; the number renewed."""
        with self.engine.begin() as c:
            return c.execute(jobs.update().where(jobs.c.lease_owner == owner, jobs.c.state == RUNNING)
                             .values(lease_until=self.clock() + lease)).rowcount

    def holds(self, job_id: str, owner: str, server_prompt_id: str) -> bool:
        with self.engine.begin() as c:
            return c.execute(jobs.update().where(*self._held(job_id, owner, server_prompt_id))
                             .values(lease_until=jobs.c.lease_until)).rowcount == 1

    @staticmethod
    def _held(job_id: str, owner: str, server_prompt_id: str):
        return (jobs.c.id == job_id, jobs.c.state == RUNNING, jobs.c.lease_owner == owner,
                jobs.c.server_prompt_id == server_prompt_id)

    def publish(self, job_id: str, owner: str, server_prompt_id: str, *, state: str, outputs: dict | None,
                status: dict | None, error: str | None = None) -> bool:
        """running -> done/failed/cancelled for the lease holder of this attempt only; True when it published."""
        assert state in FINAL
        with self.engine.begin() as c:
            hit = c.execute(jobs.update().where(*self._held(job_id, owner, server_prompt_id)).values(
                state=state, outputs=json.dumps(outputs) if outputs is not None else None,
                status=json.dumps(status) if status is not None else None, error=error,
                finished_at=self.clock(), lease_owner=None, lease_until=None))
        return hit.rowcount == 1

    def requeue(self, job_id: str, owner: str, server_prompt_id: str, cause: str, *, max_attempts: int) -> str | None:
        """Hand a running job back to the queue (or fail it after `max_attempts` dispatches); the new state."""
        job = self.get(job_id)
        if job is None:
            return None
        final = job.cancel or job.attempts >= max_attempts
        values = {"state": CANCELLED if job.cancel else FAILED, "finished_at": self.clock(),
                  "error": f"gave up after {job.attempts} dispatch(es); the last ended with: {cause}"} if final else \
            {"state": QUEUED, "cause": cause}
        values.update(lease_owner=None, lease_until=None)
        if not job.cancel and not final:
            values.update(server=None)
        with self.engine.begin() as c:
            hit = c.execute(jobs.update().where(*self._held(job_id, owner, server_prompt_id)).values(**values))
        return values["state"] if hit.rowcount == 1 else None

    def take_over(self, job: Job, owner: str, lease: float) -> bool:
        """Take the lease of a running job whose lease ran out (its front died or hung)."""
        with self.engine.begin() as c:
            hit = c.execute(jobs.update().where(
                jobs.c.id == job.id, jobs.c.state == RUNNING, jobs.c.lease_owner == job.lease_owner,
                jobs.c.lease_until == job.lease_until, jobs.c.lease_until < self.clock())
                .values(lease_owner=owner, lease_until=self.clock() + lease))
        return hit.rowcount == 1

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a job: a queued one at once; a running one is marked (its front interrupts it and publishes it
        cancelled). Final jobs are left as they are."""
        with self.engine.begin() as c:
            c.execute(jobs.update().where(jobs.c.id == job_id, jobs.c.state == QUEUED)
                      .values(state=CANCELLED, cancel=True, finished_at=self.clock()))
            c.execute(jobs.update().where(jobs.c.id == job_id, jobs.c.state == RUNNING).values(cancel=True))
        return self.get(job_id)

    def delete(self, job_id: str) -> None:
        with self.engine.begin() as c:
            c.execute(jobs.delete().where(jobs.c.id == job_id, jobs.c.state.in_(FINAL)))

    # ------------------------------------------------------------------------------------------- reads

    def get(self, job_id: str) -> Job | None:
        with self.engine.connect() as c:
            row = c.execute(sa.select(jobs).where(jobs.c.id == job_id)).first()
        return _job(row) if row else None

    def list(self, *, user: str | None = None, states: tuple[str, ...] | None = None, kind: str | None = None,
             limit: int = 1000, newest_first: bool = False) -> list[Job]:
        q = sa.select(jobs)
        if user is not None:
            q = q.where(jobs.c.user == user)
        if states:
            q = q.where(jobs.c.state.in_(states))
        if kind:
            q = q.where(jobs.c.kind == kind)
        order = (jobs.c.created_at.desc(), jobs.c.id.desc()) if newest_first else (jobs.c.created_at, jobs.c.id)
        with self.engine.connect() as c:
            return [_job(r) for r in c.execute(q.order_by(*order).limit(limit)).all()]

    def expired(self) -> list[Job]:
        with self.engine.connect() as c:
            rows = c.execute(sa.select(jobs).where(jobs.c.state == RUNNING, jobs.c.lease_until < self.clock())).all()
        return [_job(r) for r in rows]

    def busy_servers(self) -> dict[str, int]:
        """{server: running jobs} over every front of this database."""
        with self.engine.connect() as c:
            rows = c.execute(sa.select(jobs.c.server, sa.func.count()).where(jobs.c.state == RUNNING)
                             .group_by(jobs.c.server)).all()
        return {s: n for s, n in rows if s}

    def counts(self) -> dict[str, int]:
        with self.engine.connect() as c:
            rows = c.execute(sa.select(jobs.c.state, sa.func.count()).group_by(jobs.c.state)).all()
        out = dict.fromkeys(STATES, 0)
        out.update({s: n for s, n in rows})
        return out

    def position(self, job: Job) -> int:
        """How many queued jobs were accepted before this one (its place in line, 0 = next)."""
        with self.engine.connect() as c:
            return c.execute(sa.select(sa.func.count()).select_from(jobs).where(
                jobs.c.state == QUEUED, jobs.c.created_at < job.created_at)).scalar_one()
