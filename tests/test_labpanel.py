"""The lab panel's server routes in a real Jupyter server: authentication on every route,
and the runs, checkpoints and metrics of a real fleet run."""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from conftest import free_port, wait_for_jupyter

from workbench.kernel import labpanel

pytest.importorskip("jupyter_server")


@pytest.fixture(scope="module")
def trained_run(fleet):
    """The session fleet's run, with metrics and a checkpoint on disk."""
    fleet.run("import torch\nmodel = torch.nn.Linear(4, 1)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "model, optimizer = accelerator.prepare(model, optimizer)\n"
              "for _ in range(3):\n    workbench.log(loss=1.0 + rank)\nprint('panel log line of rank', rank)",
              show_output=False)
    tag = fleet.checkpoints.save(tag="panel-test")
    return fleet.run_id, tag, os.path.dirname(fleet.run_dir)


def _start_server(root: pathlib.Path, env_extra: dict):
    """A real Jupyter server on ``root`` with the extension enabled as the wheel enables it."""
    port, token = free_port(), secrets.token_hex(16)
    # the config the wheel installs into etc/jupyter/jupyter_server_config.d enables the extension
    config = root / "config" / "jupyter_server_config.d"
    config.mkdir(parents=True)
    shutil.copy(pathlib.Path(__file__).parent.parent / "extensions" / "jupyter-config" / "workbench.json", config)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(root / "config"),
           "JUPYTER_RUNTIME_DIR": str(root / "runtime"), "JUPYTER_DATA_DIR": str(root / "data"), **env_extra}
    env = {k: v for k, v in env.items() if v is not None}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_for_jupyter(url, token, proc, lambda: proc.stderr.read() if proc.poll() is not None else "timeout")
    return proc, url, token


@pytest.fixture(scope="module")
def server(trained_run, tmp_path_factory):
    _run_id, _tag, runs_root = trained_run
    proc, url, token = _start_server(tmp_path_factory.mktemp("server-root"), {"WORKBENCH_RUNS_DIR": runs_root})
    yield url, token
    proc.terminate()
    proc.wait(timeout=10)


def _not_json(name):
    raise AssertionError(f"{name} is not JSON: a browser's JSON.parse rejects it")


def _get(url: str, token: str | None = None):
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read(), parse_constant=_not_json)
    except urllib.error.HTTPError as exc:
        return exc.code, None


def _routes(run_id: str) -> list[str]:
    """One concrete path for every route the extension registers."""
    return [pattern.replace(f"({labpanel.RUN_ID})", run_id).replace(f"({labpanel.LOG_NAME})", "rank-0.log")
            for pattern, _ in labpanel.HANDLERS]


def test_every_route_refuses_a_request_without_a_token(server, trained_run):
    url, _token = server
    for path in _routes(trained_run[0]):
        status, _ = _get(f"{url}/{path}")
        assert status == 403, f"/{path} answered {status} without authentication"


def test_every_handler_method_is_decorated_with_tornados_authenticated():
    for _pattern, handler in labpanel.HANDLERS:
        for name in ("get", "post", "put", "patch", "delete"):
            method = handler.__dict__.get(name)
            if method is not None:
                assert hasattr(method, "__wrapped__") and method.__code__.co_filename.endswith(
                    os.path.join("tornado", "web.py")), f"{handler.__name__}.{name} lacks @web.authenticated"


def test_routes_serve_the_runs_checkpoints_and_metrics_on_disk(server, trained_run):
    url, token = server
    run_id, tag, _root = trained_run
    status, runs = _get(f"{url}/workbench/api/runs", token)
    assert status == 200 and run_id in [r["id"] for r in runs["runs"]]
    mine = next(r for r in runs["runs"] if r["id"] == run_id)
    assert mine["metrics"] and mine["checkpoints"] >= 1
    assert mine["status"] == "running" and mine["loss"] == 1.0 and mine["name"], mine  # from run.json
    status, checkpoints = _get(f"{url}/workbench/api/runs/{run_id}/checkpoints", token)
    row = next(c for c in checkpoints["checkpoints"] if c["tag"] == tag)
    assert status == 200 and row["state"] == "complete" and row["world_size"] == 2 and row["size"] > 0
    status, metrics = _get(f"{url}/workbench/api/runs/{run_id}/metrics", token)
    assert status == 200 and {r["rank"] for r in metrics["records"]} == {0, 1}
    assert any(r["scalars"].get("loss") == 2.0 for r in metrics["records"])
    status, later = _get(f"{url}/workbench/api/runs/{run_id}/metrics?since={metrics['next']}", token)
    assert status == 200 and later["records"] == [] and later["next"] == metrics["next"]
    assert _get(f"{url}/workbench/api/runs/no-such-run/checkpoints", token)[0] == 404
    assert _get(f"{url}/workbench/api/runs/{run_id}/metrics?since=x", token)[0] == 400
    status, logs = _get(f"{url}/workbench/api/runs/{run_id}/logs", token)
    names = [f["name"] for f in logs["logs"]]
    assert status == 200 and names[:2] == ["rank-0.log", "rank-1.log"], names
    status, log = _get(f"{url}/workbench/api/runs/{run_id}/logs/rank-1.log", token)
    assert status == 200 and "panel log line of rank 1" in log["text"] and not log["cut"]
    assert _get(f"{url}/workbench/api/runs/{run_id}/logs/rank-9.log", token)[0] == 404
    assert _get(f"{url}/workbench/api/runs/{run_id}/logs/..%2Fmetrics.jsonl", token)[0] == 404


def test_runs_are_found_next_to_a_notebook_in_a_sub_folder(tmp_path):
    """No WORKBENCH_RUNS_DIR: a kernel writes workbench-runs/ next to its notebook (the binder
    layout: notebooks/ under the server root); the panel passes the notebook's folder."""
    run = tmp_path / "notebooks" / "workbench-runs" / "20261205-101010-abcd"
    (run / "logs").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"time": 1.0, "rank": 0, "step": 0, "scalars": {"loss": 2.0},
                                                   "system": {}}) + "\n")
    (run / "logs" / "rank-0.log").write_text("hello\n")
    proc, url, token = _start_server(tmp_path, {"WORKBENCH_RUNS_DIR": None})
    try:
        status, runs = _get(f"{url}/workbench/api/runs?folder=notebooks", token)
        assert status == 200 and [r["id"] for r in runs["runs"]] == [run.name]
        assert _get(f"{url}/workbench/api/runs", token)[1]["runs"] == []  # the server root has none
        status, metrics = _get(f"{url}/workbench/api/runs/{run.name}/metrics?folder=notebooks", token)
        assert status == 200 and metrics["records"][0]["scalars"]["loss"] == 2.0
        assert _get(f"{url}/workbench/api/runs/{run.name}/logs/rank-0.log?folder=notebooks", token)[1]["text"] == "hello\n"
        assert _get(f"{url}/workbench/api/runs?folder=../..", token)[0] == 403
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_diverged_damaged_and_escaping_runs_are_served_as_valid_json(server, trained_run, tmp_path):
    url, token = server
    _run_id, _tag, runs_root = trained_run
    run = pathlib.Path(runs_root) / "diverged-run"
    run.mkdir(exist_ok=True)
    record = {"time": 1.0, "rank": 0, "step": 0, "scalars": {"loss": 1.5}, "system": {}}
    lines = [json.dumps(record), '{"time": 2.0, "rank": 0, "step": 1, "scalars": {"loss": NaN}, "system": {}}',
             "{damaged", json.dumps({**record, "step": 2, "scalars": {"loss": float("inf")}})]  # older runs wrote bare NaN
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    (pathlib.Path(runs_root) / "escape").symlink_to(outside)
    status, runs = _get(f"{url}/workbench/api/runs", token)
    assert status == 200 and "diverged-run" in [r["id"] for r in runs["runs"]]
    assert "escape" not in [r["id"] for r in runs["runs"]], "a link out of the runs folder is not followed"
    status, metrics = _get(f"{url}/workbench/api/runs/diverged-run/metrics", token)
    assert status == 200 and metrics["skipped"] == 1 and metrics["next"] == 4
    assert [r["scalars"]["loss"] for r in metrics["records"]] == [1.5, None, None]
    assert _get(f"{url}/workbench/api/runs/escape/metrics", token)[0] == 404


def test_a_diverged_loss_is_written_as_valid_json(fleet):
    fleet.run("workbench.log(loss=float('nan'), other=float('inf'))", show_output=False)
    path = pathlib.Path(fleet.run_dir) / "metrics.jsonl"
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "other" not in path.read_text():
        time.sleep(0.1)
    last = [line for line in path.read_text().splitlines() if '"other"' in line]
    assert last and all(json.loads(line, parse_constant=_not_json)["scalars"]["loss"] is None for line in last)
