"""ComfyUI's jobs API on the front (GET /api/jobs, GET /api/jobs/{id}, POST /api/jobs/{id}/cancel,
POST /api/jobs/cancel), which the page's queue and history panel reads: the caller's own jobs of the front's
queue, in the shape of the pin's comfy_execution/jobs.py (id, status pending | in_progress | completed |
failed | cancelled, priority, create_time in ms, execution times, outputs_count, preview_output, workflow_id;
a single job adds outputs, execution_status and workflow)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from h3kit.front import store as st
from h3kit.front.dispatch import output_items

STATUS = {st.QUEUED: "pending", st.RUNNING: "in_progress", st.DONE: "completed", st.FAILED: "failed",
          st.CANCELLED: "cancelled"}


def job_dict(job: st.Job, number: int, full: bool = False) -> dict:
    extra = (job.extra or {}).get("extra_data") or {}
    workflow = (extra.get("extra_pnginfo") or {}).get("workflow") or {}
    outputs = job.outputs or {}
    items = [(node, key, item) for node, out in outputs.items() if isinstance(out, dict)
             for key, lst in out.items() if isinstance(lst, list)
             for item in lst if isinstance(item, dict) and "filename" in item]
    preview = next(({**item, "nodeId": node, "mediaType": key} for node, key, item in items
                    if item.get("type") == "output"), None)
    out = {"id": job.id, "status": STATUS[job.state], "priority": number, "create_time": int(job.created_at * 1000),
           "execution_start_time": int(job.dispatched_at * 1000) if job.dispatched_at else None,
           "execution_end_time": int(job.finished_at * 1000) if job.finished_at else None,
           "execution_error": {"exception_message": job.error} if job.error else None,
           "outputs_count": len(list(output_items(outputs))), "preview_output": preview,
           "workflow_id": workflow.get("id") if isinstance(workflow, dict) else None}
    out = {k: v for k, v in out.items() if v is not None}
    if full:
        out.update(outputs=outputs, execution_status=job.status or {},
                   workflow={"prompt": job.prompt, "extra_data": extra})
    return out


class JobsApi:
    def __init__(self, front):
        self.front = front

    def routes(self) -> list:
        out = []
        for prefix in ("", "/api"):
            out += [web.get(prefix + "/jobs", self.list_jobs), web.get(prefix + "/jobs/{id}", self.get_job),
                    web.post(prefix + "/jobs/{id}/cancel", self.cancel_one),
                    web.post(prefix + "/jobs/cancel", self.cancel_many)]
        return out

    async def list_jobs(self, request: web.Request) -> web.Response:
        q = request.query
        wanted = [s.strip() for s in q.get("status", "").split(",") if s.strip()]
        states = tuple(k for k, v in STATUS.items() if v in wanted) if wanted else None
        try:
            limit = int(q.get("limit", 200))
            offset = max(0, int(q.get("offset", 0)))
        except ValueError:
            return web.json_response({"error": "limit and offset must be integers"}, status=400)
        if limit <= 0:
            return web.json_response({"error": "limit must be a positive integer"}, status=400)
        if wanted and not states:
            return web.json_response({"jobs": [], "pagination": {"offset": offset, "limit": limit, "total": 0,
                                                                 "has_more": False}})
        jobs = await asyncio.to_thread(self.front.store.list, user=request["user"], states=states, kind="comfy",
                                       limit=100000, newest_first=q.get("sort_order", "desc") != "asc")
        page = jobs[offset:offset + limit]
        return web.json_response({"jobs": [job_dict(j, offset + i) for i, j in enumerate(page)],
                                  "pagination": {"offset": offset, "limit": limit, "total": len(jobs),
                                                 "has_more": offset + len(page) < len(jobs)}})

    async def _own(self, request: web.Request, job_id: str):
        job = await asyncio.to_thread(self.front.store.get, job_id)
        return job if job is not None and job.user == request["user"] else None

    async def get_job(self, request: web.Request) -> web.Response:
        job = await self._own(request, request.match_info["id"])
        if job is None:
            return web.json_response({"error": "Job not found"}, status=404)
        return web.json_response(job_dict(job, 0, full=True))

    async def cancel_one(self, request: web.Request) -> web.Response:
        job = await self._own(request, request.match_info["id"])
        if job is None:
            return web.json_response({"error": "Job not found"}, status=404)
        job = await asyncio.to_thread(self.front.store.cancel, job.id)
        return web.json_response({"id": job.id, "status": STATUS[job.state], "cancelled": True})

    async def cancel_many(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = {}
        ids = body.get("job_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list):
            return web.json_response({"error": "job_ids must be a list"}, status=400)
        done = []
        for job_id in ids:
            job = await self._own(request, str(job_id))
            if job is not None:
                await asyncio.to_thread(self.front.store.cancel, job.id)
                done.append(job.id)
        return web.json_response({"cancelled": done})
