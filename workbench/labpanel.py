"""Jupyter server extension: what lives on disk about fleet runs, for the lab panel.

Read-only JSON routes under ``<base_url>/workbench/api/``, all behind Jupyter's
authentication (``tornado.web.authenticated`` on jupyter_server's
``APIHandler``: a request without a token or login gets 403):

- ``runs``: the runs in the runs folder (``WORKBENCH_RUNS_DIR``, else
  ``<server root>/workbench-runs``), newest first;
- ``runs/<id>/checkpoints``: complete checkpoints (tag, step, world size,
  strategy, size, created) and those still being written;
- ``runs/<id>/metrics?since=N``: records of ``metrics.jsonl`` from line N.

These serve what outlives a kernel (runs and checkpoints on disk). The live
fleet (engines and their state) belongs to the kernel that owns it.
"""

from __future__ import annotations

import json
import os
import re

from tornado import web

from .checkpoint import layout
from .metrics.store import json_safe
from .runs import RUNS_DIR_ENV

MAX_RECORDS = 5000  # per metrics request
RUN_ID = r"[A-Za-z0-9][A-Za-z0-9_.-]*"

try:  # only inside a Jupyter server
    from jupyter_server.base.handlers import APIHandler
    from jupyter_server.utils import url_path_join
except ImportError:  # pragma: no cover - the module is imported without jupyter_server too
    APIHandler, url_path_join = web.RequestHandler, None


class _RunsHandler(APIHandler):
    @property
    def runs_root(self) -> str:
        return self.settings["workbench_runs_root"]

    def run_dir(self, run_id: str) -> str:
        path = os.path.join(self.runs_root, run_id)
        if not re.fullmatch(RUN_ID, run_id) or not os.path.isdir(path) or not self.inside_root(path):
            raise web.HTTPError(404, f"no run {run_id!r}")
        return path

    def inside_root(self, path: str) -> bool:
        """Whether ``path``, symbolic links resolved, stays inside the runs folder."""
        root = os.path.realpath(self.runs_root)
        return os.path.realpath(path).startswith(root + os.sep)

    def send(self, payload: dict) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(json_safe(payload), allow_nan=False))


class RunsHandler(_RunsHandler):
    @web.authenticated
    def get(self):
        runs = []
        if os.path.isdir(self.runs_root):
            for name in os.listdir(self.runs_root):
                path = os.path.join(self.runs_root, name)
                if re.fullmatch(RUN_ID, name) and os.path.isdir(path) and self.inside_root(path):
                    checkpoints = layout.list_checkpoints(os.path.join(path, "checkpoints"), clean=False)
                    runs.append({"id": name, "modified": os.path.getmtime(path),
                                 "checkpoints": sum(e.state == "complete" for e in checkpoints),
                                 "metrics": os.path.isfile(os.path.join(path, "metrics.jsonl"))})
        runs.sort(key=lambda r: r["modified"], reverse=True)
        self.send({"root": self.runs_root, "runs": runs})


class CheckpointsHandler(_RunsHandler):
    @web.authenticated
    def get(self, run_id: str):
        folder = os.path.join(self.run_dir(run_id), "checkpoints")
        rows = []
        for entry in layout.list_checkpoints(folder, clean=False):
            row = {"tag": entry.tag, "state": entry.state}
            if entry.manifest is not None:
                m = entry.manifest
                row.update(step=m.step, world_size=m.world_size, strategy=m.strategy, size=m.size, created=m.created)
            rows.append(row)
        self.send({"run": run_id, "checkpoints": rows})


class MetricsHandler(_RunsHandler):
    @web.authenticated
    def get(self, run_id: str):
        try:
            since = int(self.get_argument("since", "0"))
        except ValueError:
            raise web.HTTPError(400, "since must be a line number")
        path = os.path.join(self.run_dir(run_id), "metrics.jsonl")
        records, skipped, number = [], 0, since - 1
        if os.path.isfile(path) and self.inside_root(path):
            with open(path) as f:
                for number, text in enumerate(f):
                    if number < since:
                        continue
                    if len(records) >= MAX_RECORDS or not text.endswith("\n"):  # a line still being written
                        number -= 1
                        break
                    try:
                        records.append(json.loads(text))  # also reads the bare NaN of older runs
                    except ValueError:
                        skipped += 1  # a damaged line must not hide the rest of the run
        self.send({"run": run_id, "records": records, "skipped": skipped, "next": max(since, number + 1)})


HANDLERS = [
    (r"workbench/api/runs", RunsHandler),
    (rf"workbench/api/runs/({RUN_ID})/checkpoints", CheckpointsHandler),
    (rf"workbench/api/runs/({RUN_ID})/metrics", MetricsHandler),
]


def _jupyter_server_extension_points():
    return [{"module": "workbench.labpanel"}]


def _load_jupyter_server_extension(serverapp) -> None:
    web_app = serverapp.web_app
    root = os.path.abspath(os.environ.get(RUNS_DIR_ENV) or os.path.join(serverapp.root_dir, "workbench-runs"))
    web_app.settings["workbench_runs_root"] = root
    base = web_app.settings["base_url"]
    web_app.add_handlers(".*$", [(url_path_join(base, pattern), handler) for pattern, handler in HANDLERS])
    serverapp.log.info(f"workbench: lab panel routes for runs in {root}")
