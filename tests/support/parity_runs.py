"""Parity runs that share one parity worker (parity.run_jobs): the test files' module fixtures run their jobs once,
and each test reads its own run's report."""

from __future__ import annotations

from h3kit.runtime import parity as parity_lib


def runs(installed_tree, comfy_python, jobs: dict, transport: str, timeout: float = 1800) -> dict:
    """{name: (report, npu_count)} for jobs {name: run_jobs job}, all in one worker (and one group with "process")."""
    reports = parity_lib.run_jobs(installed_tree, "cpu", list(jobs.values()), python=comfy_python, timeout=timeout,
                                  transport=transport)
    return {name: (report, jobs[name]["npu_count"]) for name, report in zip(jobs, reports, strict=True)}


def run(runs: dict, name: str) -> dict:
    """The report of one run of the shared worker, or its error raised (as parity_lib.run raises it)."""
    return parity_lib.checked(*runs[name])
