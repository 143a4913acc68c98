"""The front's queue on a real PostgreSQL: claims racing from two stores, and two `h3kit front` processes on one
database over the same two servers, one of them killed -9 mid-run: every job runs once and finishes.

The database comes from H3KIT_TEST_POSTGRES_URL (a role that may create databases; .ci/run starts Debian's
postgresql and sets it with tools/start-test-postgres.sh). Each test makes a database of its own and drops it.
"""

from __future__ import annotations

import os
import threading
import uuid

import pytest

from tests.support import requires
from tests.support.service_helpers import free_port

for _m in ("aiohttp", "sqlalchemy", "prometheus_client", "pg8000"):
    requires.module(_m, "the front extra (pip install 'h3kit[front]'; toolkit/requirements/test.txt lists it)",
                    allow_module_level=True)

from h3kit.front import store as st  # noqa: E402
from tests.support.front_helpers import Front, Standin, sleep_prompt, starts, wait_for  # noqa: E402

URL_ENV = "H3KIT_TEST_POSTGRES_URL"
BAND = (8700, 8799)


@pytest.fixture
def pg_url():
    import sqlalchemy as sa

    admin = os.environ.get(URL_ENV)
    if not admin:
        requires.skip(f"no PostgreSQL: set {URL_ENV} (export {URL_ENV}=$(tools/start-test-postgres.sh) starts "
                      "Debian's postgresql and prints it; .ci/run does)")
    name = "h3kit_front_" + uuid.uuid4().hex[:12]
    engine = sa.create_engine(st.engine_url(admin), isolation_level="AUTOCOMMIT")
    with engine.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    yield admin.rsplit("/", 1)[0] + "/" + name
    with engine.connect() as c:
        c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    engine.dispose()


def test_claims_and_take_overs_race_on_postgres(pg_url):
    a, b = st.Store(pg_url), st.Store(pg_url)
    try:
        ids = {a.add(kind="comfy", user=f"u{i % 3}", prompt={}, extra={}, npu_count=None).id for i in range(60)}
        claimed, lock = [], threading.Lock()

        def worker(store, owner):
            while (job := store.claim(server="http://s", devices=1, owner=owner, lease=0.01)) is not None:
                with lock:
                    claimed.append(job.id)
        threads = [threading.Thread(target=worker, args=(s, f"{n}{i}")) for n, s in (("a", a), ("b", b))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(claimed) == sorted(ids)
        wait_for("the leases to run out", lambda: len(a.expired()) == 60, timeout=30)
        taken = []
        expired = a.expired()

        def take(store, owner):
            for job in expired:
                if store.take_over(job, owner, 30):
                    with lock:
                        taken.append(job.id)
        threads = [threading.Thread(target=take, args=(s, n)) for n, s in (("A", a), ("B", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(taken) == sorted(ids)        # each expired job taken over by exactly one front
    finally:
        a.close()
        b.close()


def test_two_fronts_on_one_postgres_run_each_job_once(pg_url, tmp_path):
    procs = []
    try:
        servers = [Standin(tmp_path / n, free_port(*BAND)) for n in ("a", "b")]
        procs += servers
        urls = [s.url for s in servers]
        fronts = [Front(tmp_path / f"front{i}", free_port(*BAND), urls, db=pg_url, extra=["--lease", "4"])
                  for i in range(2)]
        procs += fronts
        ids = {f"p{i}": fronts[i % 2].submit(sleep_prompt(0.7, f"p{i}")) for i in range(10)}
        wait_for("some jobs started", lambda: starts(*servers) and len(starts(*servers)) >= 3, timeout=60)
        fronts[0].kill9()                       # its running jobs are taken over by the other front
        hist = fronts[1].wait_done(list(ids.values()), timeout=180)
        assert all(e["h3front"]["state"] == "done" for e in hist.values())
        ran = starts(*servers)
        assert sorted(ran) == sorted(ids) and all(len(v) == 1 for v in ran.values()), ran
    finally:
        for p in reversed(procs):
            p.stop()



