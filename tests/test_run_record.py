"""``<run>/run.json``: every fleet run leaves a record a user can read and compare (issue 37)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import workbench
from workbench import DistributedCellError
from workbench.kernel.run_record import read


def _record(fleet) -> dict:
    fleet.record.flush()  # written at most every 2 s while cells run
    with open(os.path.join(fleet.run_dir, "run.json")) as f:
        return json.load(f)


def test_each_cell_its_flags_status_and_the_scalars_last_values_are_recorded(fleet):
    before = len(_record(fleet)["cells"])
    fleet.run("workbench.config(lr=3e-4, layers=[4, 4], name='tiny')\nfor i in range(3):\n"
              "    workbench.log(loss=10.0 * (rank + 1) - i)", grad_accum=2, show_output=False)
    with pytest.raises(DistributedCellError):
        fleet.run("1 / 0", show_output=False)
    workbench.config(optimizer="adamw")  # in the kernel: taken at the next cell
    fleet.run("1", show_output=False)
    record = _record(fleet)
    logged, failed, after = record["cells"][before:before + 3]
    assert logged["flags"] == {"grad_accum": 2} and logged["status"] == "ok" and logged["ranks"] == [0, 1]
    assert logged["ended"] >= logged["started"]
    assert failed["status"] == "failed" and failed["error"].startswith("ZeroDivisionError: division by zero")
    assert after["status"] == "ok"
    assert record["final"]["loss"]["value"] == 8.0 and record["final"]["loss"]["rank"] == 0  # rank 0's last
    assert record["config"]["lr"] == 3e-4 and record["config"]["layers"] == [4, 4]
    assert record["config"]["optimizer"] == "adamw"
    assert record["status"] == "running" and record["id"] == fleet.run_id
    assert oct(os.stat(os.path.join(fleet.run_dir, "run.json")).st_mode & 0o777) == "0o600"


def test_config_refuses_what_json_cannot_hold_in_one_line():
    with pytest.raises(TypeError, match=r"workbench.config\(model=...\) takes a string, number, bool or None"):
        workbench.config(model=object())


@pytest.mark.fleet
def test_a_named_run_is_stopped_and_a_killed_owner_reads_as_crashed(tmp_path):
    script = ("import sys\nfrom workbench import Fleet\n"
              "f = Fleet(n=1, progress=False, wandb=False, tensorboard=False, name='exp-7').start()\n"
              "f.run('workbench.log(loss=0.5)', show_output=False)\n"
              "print(f.run_dir, flush=True)\n"
              "if sys.argv[1] == 'stop':\n    f.stop()\nelse:\n    import os; os._exit(9)\n")
    env = {**os.environ, "WORKBENCH_RUNS_DIR": str(tmp_path)}
    stopped = subprocess.run([sys.executable, "-c", script, "stop"], capture_output=True, text=True, env=env,
                             timeout=180).stdout.split()[-1]
    record = read(stopped)
    assert record["name"] == "exp-7" and record["status"] == "stopped" and record["ended"] > record["started"]
    assert record["final"]["loss"]["value"] == 0.5 and record["options"]["n"] == 1
    crashed = subprocess.run([sys.executable, "-c", script, "die"], capture_output=True, text=True, env=env,
                             timeout=180).stdout.split()[-1]
    assert read(crashed)["status"] == "crashed", "its owner died while it was running"


@pytest.mark.fleet
def test_the_config_reaches_tensorboards_hparams_tab(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    from workbench import Fleet

    with Fleet(n=1, progress=False, wandb=False, tensorboard=True, runs_dir=str(tmp_path), name="hp") as fleet:
        fleet.run("workbench.config(lr=0.01, optimizer='sgd', layers=[2, 2])\nworkbench.log(loss=0.5)",
                  show_output=False)
        folder = os.path.join(fleet.run_dir, "tensorboard")
    events = EventAccumulator(folder)
    events.Reload()
    content = events.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert start.hparams["lr"].number_value == 0.01 and start.hparams["optimizer"].string_value == "sgd"
    assert start.hparams["layers"].string_value == "[2, 2]" and start.hparams["name"].string_value == "hp"
    assert "loss" in events.Tags()["scalars"]
