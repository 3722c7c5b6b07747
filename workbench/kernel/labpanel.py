"""Jupyter server extension: what lives on disk about fleet runs, for the lab panel.

Read-only JSON routes under ``<base_url>/workbench/api/``, all behind Jupyter's
authentication (``tornado.web.authenticated`` on jupyter_server's
``APIHandler``: a request without a token or login gets 403):

- ``runs``: the runs in the runs folder, newest first;
- ``runs/<id>/checkpoints``: complete checkpoints (tag, step, world size,
  strategy, size, created) and those still being written;
- ``runs/<id>/metrics?since=N``: records of ``metrics.jsonl`` from line N;
- ``runs/<id>/logs``: the run's log files (``logs/rank-<N>.log``, ``engine-*.log``);
  ``runs/<id>/logs/<name>``: the last ``LOG_TAIL_BYTES`` of one.

The runs folder is ``WORKBENCH_RUNS_DIR`` if the server has it, else the
``workbench-runs`` folder next to the notebook, where its kernel writes: every
route takes ``?folder=<the notebook's folder, relative to the server root>``
(the panel sends it; none means the server root). A folder that leaves the
server root is refused.

These serve what outlives a kernel (runs and checkpoints on disk). The live
fleet (engines and their state) belongs to the kernel that owns it.
"""

from __future__ import annotations

import json
import os
import re

from tornado import web

from workbench.checkpoint import layout
from workbench.kernel import run_record
from workbench.kernel.metrics.store import json_safe
from workbench.kernel.ranklogs import logs_dir
from workbench.kernel.runs import RUNS_DIR_ENV, RUNS_FOLDER

MAX_RECORDS = 5000  # per metrics request
LOG_TAIL_BYTES = 64 * 1024  # of one log file per request
RUN_ID = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
LOG_NAME = r"(?:rank|engine)-[A-Za-z0-9_.-]+\.log"

try:  # only inside a Jupyter server
    from jupyter_server.base.handlers import APIHandler
    from jupyter_server.utils import url_path_join
except ImportError:  # pragma: no cover - the module is imported without jupyter_server too
    APIHandler, url_path_join = web.RequestHandler, None


class _RunsHandler(APIHandler):
    @property
    def runs_root(self) -> str:
        fixed = self.settings.get("workbench_runs_root")
        if fixed:
            return fixed
        server_root = os.path.realpath(self.settings["workbench_server_root"])
        folder = self.get_argument("folder", "").strip("/")
        path = os.path.realpath(os.path.join(server_root, folder))
        if path != server_root and not path.startswith(server_root + os.sep):
            raise web.HTTPError(403, "folder is outside the server root")
        return os.path.join(path, RUNS_FOLDER)

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
                    checkpoints = _checkpoints(path)
                    runs.append({"id": name, "modified": os.path.getmtime(path),
                                 "checkpoints": sum(e.state == "complete" for e in checkpoints),
                                 "metrics": os.path.isfile(os.path.join(path, "metrics.jsonl")),
                                 **_summary(run_record.read(path))})
        runs.sort(key=lambda r: r["modified"], reverse=True)
        self.send({"root": self.runs_root, "runs": runs})


def _checkpoints(run_dir: str) -> list:
    """The checkpoints of a past run: in its folder, or where its record says they went
    (``--checkpoint-dir``); none when that storage cannot be reached."""
    record = run_record.read(run_dir) or {}
    options = record.get("options") if isinstance(record.get("options"), dict) else {}
    folder = options.get("checkpoint_dir") if isinstance(options.get("checkpoint_dir"), str) else None
    try:
        return layout.list_checkpoints(folder or os.path.join(run_dir, "checkpoints"), clean=False)
    except Exception:  # noqa: BLE001 - storage unreachable (or its library missing) from this server
        return []


def _summary(record: dict | None) -> dict:
    """What the runs list shows of a run's record: name, status, duration, final loss."""
    if record is None:
        return {}
    started, ended = record.get("started"), record.get("ended")
    loss = (record.get("final") or {}).get("loss") or {}
    return {"name": str(record.get("name", "")), "status": str(record.get("status", "")),
            "duration_s": (ended - started) if isinstance(started, (int, float)) and isinstance(ended, (int, float))
            else None, "loss": loss.get("value") if isinstance(loss, dict) else None}


class CheckpointsHandler(_RunsHandler):
    @web.authenticated
    def get(self, run_id: str):
        rows = []
        for entry in _checkpoints(self.run_dir(run_id)):
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


class LogsHandler(_RunsHandler):
    @web.authenticated
    def get(self, run_id: str, name: str | None = None):
        folder = logs_dir(self.run_dir(run_id))
        if name is None:
            files = []
            if os.path.isdir(folder):
                files = [{"name": n, "size": os.path.getsize(os.path.join(folder, n))}
                         for n in os.listdir(folder) if re.fullmatch(LOG_NAME, n)]
            files.sort(key=lambda f: _log_order(f["name"]))
            self.send({"run": run_id, "logs": files})
            return
        path = os.path.join(folder, name)
        if not re.fullmatch(LOG_NAME, name) or not os.path.isfile(path) or not self.inside_root(path):
            raise web.HTTPError(404, f"no log {name!r}")
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - LOG_TAIL_BYTES))
            text = f.read().decode("utf-8", errors="replace")
        self.send({"run": run_id, "name": name, "size": size, "text": text, "cut": size > LOG_TAIL_BYTES})


def _log_order(name: str) -> tuple:
    """rank-0, rank-1, ..., rank-10, then the engines' own logs."""
    number = re.fullmatch(r"rank-(\d+)\.log", name)
    return (0, int(number.group(1)), "") if number else (1, 0, name)


HANDLERS = [
    (r"workbench/api/runs", RunsHandler),
    (rf"workbench/api/runs/({RUN_ID})/checkpoints", CheckpointsHandler),
    (rf"workbench/api/runs/({RUN_ID})/metrics", MetricsHandler),
    (rf"workbench/api/runs/({RUN_ID})/logs", LogsHandler),
    (rf"workbench/api/runs/({RUN_ID})/logs/({LOG_NAME})", LogsHandler),
]


def _jupyter_server_extension_points():
    return [{"module": "workbench.kernel.labpanel"}]


def _load_jupyter_server_extension(serverapp) -> None:
    web_app = serverapp.web_app
    fixed = os.environ.get(RUNS_DIR_ENV)
    web_app.settings["workbench_runs_root"] = os.path.abspath(fixed) if fixed else None
    web_app.settings["workbench_server_root"] = os.path.abspath(serverapp.root_dir)
    base = web_app.settings["base_url"]
    web_app.add_handlers(".*$", [(url_path_join(base, pattern), handler) for pattern, handler in HANDLERS])
    where = os.path.abspath(fixed) if fixed else f"{RUNS_FOLDER} next to each notebook"
    serverapp.log.info(f"workbench: lab panel routes for runs in {where}")
