"""binder/: its environment, built from scratch in a clean virtual environment, installs
workbench with the lab panel enabled and runs the quickstart notebook."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from conftest import fleet_processes

pytestmark = pytest.mark.fleet  # engines, kernels or installs: the slow tier

REPO = pathlib.Path(__file__).parent.parent


@pytest.mark.timeout(900)
def test_binder_environment_runs_the_quickstart(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    bin_dir = venv / "bin"
    # the CPU wheel index in requirements.txt is unreachable here: fail over to PyPI at once
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", PIP_RETRIES="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    install = subprocess.run([str(bin_dir / "pip"), "install", "-q", "-r", "binder/requirements.txt"],
                             cwd=REPO, env=env, capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]

    # the wheel's prebuilt labextension is enabled: users need no node
    listing = subprocess.run([str(bin_dir / "jupyter"), "labextension", "list"], env=env,
                             capture_output=True, text=True)
    text = listing.stdout + listing.stderr
    line = next((t for t in text.splitlines() if "workbench-panel" in t), "")
    assert "enabled" in line and "OK" in line and str(venv) in text, text
    server = subprocess.run([str(bin_dir / "jupyter"), "server", "extension", "list"], env=env,
                            capture_output=True, text=True)
    assert "workbench.kernel.labpanel enabled" in (server.stdout + server.stderr).replace("\x1b[32m", "").replace(
        "\x1b[0m", ""), server.stderr

    before = {p.pid for p in fleet_processes()}
    run = subprocess.run(
        [str(bin_dir / "jupyter"), "nbconvert", "--to", "markdown", "--execute", "--stdout",
         "--ExecutePreprocessor.timeout=600", "notebooks/01_quickstart.ipynb"],
        cwd=REPO, env={**env, "WORKBENCH_RUNS_DIR": str(tmp_path / "runs"), "WANDB_MODE": "offline"},
        capture_output=True, text=True, timeout=800)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "DDP   loss:" in run.stdout and "FSDP  loss:" in run.stdout, run.stdout[-3000:]
    installed = subprocess.run([str(bin_dir / "python"), "-c", "import workbench; print(workbench.__file__)"],
                               cwd=tmp_path, env=env, capture_output=True, text=True).stdout
    assert installed.startswith(str(venv)), installed  # the wheel, not this checkout
    leftover = [p for p in fleet_processes() if p.pid not in before and p.is_running()]
    assert not leftover, [p.cmdline() for p in leftover]
