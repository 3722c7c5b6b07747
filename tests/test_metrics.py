"""Live metrics on a real 2-rank fleet: ordering, built-in measurements, sinks, back-pressure."""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys
import time

import pytest
from wandb_reader import history_rows

from workbench import Fleet, OptionsError
from workbench.kernel.flags import fleet_parser
from workbench.kernel.metrics.dashboard import Dashboard, downsample
from workbench.kernel.metrics.sinks import RunInfo, Sink, register_sink
from workbench.kernel.metrics.wandb_sink import wandb_mode

TRAIN = """
import time, torch
torch.manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = accelerator.prepare(model, optimizer)
for i in range({steps}):
    with accelerator.accumulate(model):
        x = torch.randn(16, 32)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    {log}
"""


def _cell_records(fleet, start):
    return fleet.metrics.store.since(start)


def _after_first_steps(records, skip=2):
    """Each rank's records but its first ``skip`` of the cell: those include set-up, and DDP
    reports a backward's communication time at the next step."""
    return [r for rank in sorted({r.rank for r in records}) for r in [x for x in records if x.rank == rank][skip:]]


def _jsonl(fleet) -> list[dict]:
    with open(fleet.metrics.jsonl_path) as f:
        return [json.loads(line) for line in f]


def test_every_record_arrives_in_order_in_the_aggregator_and_the_file(fleet):
    steps = 300
    start = len(fleet.metrics.store)
    first_step = fleet.run("workbench.step", show_output=False)
    fleet.run(f"for i in range({steps}):\n    workbench.log(value=i * 10 + rank, rank_seen=rank)", show_output=False)
    records = _cell_records(fleet, start)
    assert len(records) == 2 * steps
    for rank in (0, 1):
        mine = [r for r in records if r.rank == rank]
        assert [r.scalars["value"] for r in mine] == [i * 10 + rank for i in range(steps)]
        assert [r.step for r in mine] == list(range(first_step[rank], first_step[rank] + steps))
        assert all(r.scalars["rank_seen"] == rank for r in mine)
    # a loop that only logs is steps of its own unless a prepared optimizer counts them (earlier tests)
    driven = fleet.run("workbench.metrics.logger.LOGGER.optimizer_driven", show_output=False)
    assert fleet.run("workbench.step", show_output=False) == [
        s if d else s + steps for s, d in zip(first_step, driven, strict=True)]
    lines = [line for line in _jsonl(fleet) if "rank_seen" in line["scalars"]]
    assert len(lines) == 2 * steps
    for rank in (0, 1):
        values = [line["scalars"]["value"] for line in lines if line["rank"] == rank]
        assert values == [i * 10 + rank for i in range(steps)]
    assert set(lines[0]) >= {"time", "rank", "step", "scalars", "system"}
    assert oct(os.stat(fleet.metrics.jsonl_path).st_mode & 0o777) == "0o600"


def test_explicit_steps_and_bad_values(fleet):
    start = len(fleet.metrics.store)
    fleet.run("workbench.log(step=1000, a=1.5)\nworkbench.log(b=torch.tensor(2.0) if 'torch' in dir() else 2.0)",
              show_output=False)
    records = _cell_records(fleet, start)
    assert sorted((r.rank, r.step) for r in records) == [(0, 1000), (0, 1001), (1, 1000), (1, 1001)]
    driven = fleet.run("workbench.metrics.logger.LOGGER.optimizer_driven", show_output=False)
    steps = fleet.run("workbench.step", show_output=False)
    assert all(d or s == 1002 for s, d in zip(steps, driven, strict=True))  # else a label only
    with pytest.raises(Exception, match=r"takes real numbers or one-element real tensors, got str"):
        fleet.run("workbench.log(loss='low')", show_output=False)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "none"])
def test_builtin_measurements_without_user_code(fleet, strategy):
    """Steps of 20 ms and more (the sleep) carry every measurement; memory is sampled as the
    records leave the rank (every 0.2 s), so the newest record of each message carries it."""
    start = len(fleet.metrics.store)
    fleet.run(TRAIN.format(steps=12, log="time.sleep(0.02)"), strategy=strategy, show_output=False)
    records = _cell_records(fleet, start)
    assert len(records) == 2 * 12, "one record per optimizer step and rank"
    for record in records:
        assert record.scalars == {}
        assert record.system["step_time_s"] > 0
        assert record.system["samples_per_s"] > 0
    for rank in (0, 1):
        mine = [r for r in records if r.rank == rank]
        assert mine[-1].system["rss_mb"] > 50  # the cell's end sends its last records at once
        assert 1 <= sum("rss_mb" in r.system for r in mine) <= len(mine) // 2
    later = _after_first_steps(records)
    comm = [r.system["comm_s"] for r in later]
    if strategy == "none":
        assert max(comm) == 0
    else:
        assert min(comm) > 0, [(r.rank, r.step, r.system["comm_s"]) for r in records]
        assert statistics.fmean(comm) < statistics.fmean(r.system["step_time_s"] for r in later)


def test_short_ddp_steps_carry_ddps_communication_time_every_20_ms(fleet):
    """Reading DDP's statistics costs tens of µs after a step: steps shorter than 20 ms carry
    it on the first step of a cell and then as soon as 20 ms have passed since the last reading."""
    from workbench.metrics.comm import DDP_READ_EVERY_S

    start = len(fleet.metrics.store)
    fleet.run(TRAIN.format(steps=60, log="pass"), show_output=False)
    for rank in (0, 1):
        records = [r for r in _cell_records(fleet, start) if r.rank == rank]
        assert len(records) == 60 and "comm_s" in records[0].system
        read = [i for i, r in enumerate(records) if "comm_s" in r.system]
        for before, after in zip(read, read[1:], strict=False):
            between = [r.system["step_time_s"] for r in records[before + 1:after + 1]]
            assert sum(between) > DDP_READ_EVERY_S - 1e-9 and sum(between[:-1]) < DDP_READ_EVERY_S + 1e-9, between
        assert sum(r.system["step_time_s"] for r in records[read[-1] + 1:]) < DDP_READ_EVERY_S + 1e-9
        assert all(records[i].system["comm_s"] >= 0 for i in read)


def test_user_logs_carry_the_step_measurements_and_grad_accum_counts_real_steps(fleet):
    start = len(fleet.metrics.store)
    fleet.run(TRAIN.format(steps=10, log="workbench.log(loss=loss.item(), samples=16); time.sleep(0.02)"),
              show_output=False)
    records = _cell_records(fleet, start)
    assert len(records) == 2 * 10
    assert all("loss" in r.scalars for r in records)
    assert all(r.system["comm_s"] > 0 for r in _after_first_steps(records))
    start = len(fleet.metrics.store)
    fleet.run(TRAIN.format(steps=12, log="pass"), grad_accum=3, show_output=False)
    assert len(_cell_records(fleet, start)) == 2 * 4, "12 micro-batches, accumulating 3: 4 optimizer steps"


class _StalledSink:
    """A sink that blocks the kernel's receiver thread until released (a slow consumer)."""

    def __init__(self, collector):
        import threading

        self.collector = collector
        self.gate = threading.Event()

    def write(self, records):
        self.gate.wait(60)

    def flush(self):
        pass

    def __enter__(self):
        self.collector.sinks.append(self)
        return self

    def __exit__(self, *exc):
        self.collector.sinks.remove(self)
        self.gate.set()


def test_a_stalled_consumer_does_not_slow_the_ranks(fleet):
    import workbench.metrics.logger as logger

    start = len(fleet.metrics.store)
    n = 20000
    timing = f"""
import time
t0 = time.perf_counter()
for i in range({n}):
    workbench.log(i=i)
logging_s = time.perf_counter() - t0
t0 = time.perf_counter()
for i in range({n}):
    pass
plain_s = time.perf_counter() - t0
logging_s
"""
    with _StalledSink(fleet.metrics.collector):  # the receiver blocks on its first batch
        blocked = fleet.run(timing, show_output=False)
        arrived_while_blocked = len(fleet.metrics.store) - start
    assert max(blocked) < 1.0, f"{n} log calls took {blocked} s with the kernel not reading"
    assert arrived_while_blocked <= logger.MAX_BATCH * 2
    deadline = time.monotonic() + 20
    while len(fleet.metrics.store) - start < 2 * n and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(fleet.metrics.store) - start == 2 * n, "nothing is lost once the kernel reads again"
    assert fleet.metrics.store.dropped() == 0


def test_overflow_drops_the_oldest_and_counts_them(fleet):
    start = len(fleet.metrics.store)
    # small, frequent messages so that zmq's queues fill while the kernel does not read
    fleet.run("import workbench.metrics.logger as _l\n_saved = (_l.MAX_BUFFERED, _l.MAX_BATCH, _l.SEND_EVERY_S)\n"
              "_l.MAX_BUFFERED, _l.MAX_BATCH, _l.SEND_EVERY_S = 500, 5, 0.0005", show_output=False)
    try:
        with _StalledSink(fleet.metrics.collector):
            fleet.run("for i in range(50000):\n    workbench.log(j=i)\n    if i % 100 == 0: time.sleep(0.001)",
                      show_output=False)
            pushed_back = fleet.run("_l.LOGGER.pushed_back", show_output=False)
        def counts():
            return len(fleet.metrics.store) - start, fleet.metrics.store.dropped()

        deadline = time.monotonic() + 30  # the last batches arrive after the cell on a busy machine
        while sum(counts()) < 2 * 50000 and time.monotonic() < deadline:
            time.sleep(0.1)
        arrived, dropped = counts()
        assert dropped > 0
        assert arrived + dropped == 2 * 50000, (arrived, dropped)
        assert f"{dropped} records dropped" in fleet.metrics.summary(start)
        assert min(pushed_back) > 0, "zmq refused sends while the kernel was not reading"
    finally:
        fleet.run("_l.MAX_BUFFERED, _l.MAX_BATCH, _l.SEND_EVERY_S = _saved", show_output=False)
        for stream in fleet.metrics.store.streams.values():  # later tests expect no drops
            stream.dropped = stream.lost = 0


def test_the_dashboard_model_holds_the_values(fleet):
    start = len(fleet.metrics.store)
    # labelled by hand: on ranks where a prepared optimizer has stepped (earlier tests), workbench.step
    # counts its steps only, and a loop that only logs labels its records after the last record's
    fleet.run("base = workbench.step\nworkbench.progress(total=base + 40)\nfor i in range(40):\n"
              "    workbench.log(step=base + i, dash=i * (rank + 1))", show_output=False)
    dashboard = Dashboard(fleet.metrics.store, fleet.run_id)
    dashboard.cell_started(start)
    dashboard.refresh(force=True)
    assert "dash" in dashboard.choice.options
    for rank in (0, 1):
        steps, values = dashboard.curve("dash", rank)
        assert values == [i * (rank + 1) for i in range(40)]
        assert steps == [r.step for r in _cell_records(fleet, start) if r.rank == rank]
    dashboard.mode.value = "mean of ranks"
    (mean_line,) = dashboard.scalar_plot.lines.values()
    assert list(mean_line.y) == [i * 1.5 for i in range(40)]
    system = dashboard.system_plots["step"].lines
    assert set(system) == {"rank 0", "rank 1"} and len(system["rank 0"].y) > 0
    bar, label = dashboard._bars[0]
    assert bar.value == bar.max and label.value.startswith(f"step {bar.max}/{bar.max}")


def test_downsampling_keeps_long_series_small_and_its_spikes():
    xs = list(range(10_000))
    ys = [1.0 + (i % 7) * 0.01 for i in xs]
    ys[4321], ys[8765] = 50.0, -3.0  # one spike up, one down
    out_x, out_y = downsample(xs, ys, 500)
    assert len(out_x) <= 500 and (out_x[0], out_x[-1]) == (0, 9999) and out_x == sorted(out_x)
    assert 50.0 in out_y and -3.0 in out_y and 4321 in out_x and 8765 in out_x
    assert downsample(xs[:10], ys[:10], 500) == (xs[:10], ys[:10])


def test_summary_text_for_headless_runs(fleet, capsys):
    fleet.run("for i in range(5):\n    workbench.log(loss=1.0 / (i + 1))")
    out = capsys.readouterr().out
    assert "scalar  rank  last" in out
    loss_rows = [line.split() for line in out.splitlines() if line.startswith("loss")]
    assert [row[1] for row in loss_rows] == ["0", "1"], out
    assert all(row[2:5] == ["0.2", "0.2", "0.4567"] for row in loss_rows), loss_rows
    assert "steps/s" in out and "comm ms" in out


def test_summary_throughput_is_samples_over_the_time_the_steps_took_by_hand(fleet, capsys):
    """Was: the mean of each step's own rate (a few short steps dominate: 7x too high in the
    quickstart) and a step time that included the slow first step. Now computed here by hand from
    metrics.jsonl: per rank sum(samples) / sum(step times) of every step but the first, which is
    shown apart; the fleet's row is the sum over ranks."""
    import json

    first = len(fleet.metrics.store)
    fleet.run("import time\nfor i in range(12):\n    time.sleep(0.3 if i == 0 else 0.002 if i % 2 else 0.03)\n"
              "    workbench.log(loss=1.0, samples=32)", show_output=False)
    fleet.metrics.collector.flush()
    with open(fleet.metrics.jsonl_path) as f:
        lines = [json.loads(line) for line in f][first:]
    text = fleet.metrics.summary(first)
    table = {row.split()[0]: row.split() for row in text.splitlines()[text.splitlines().index(
        next(line for line in text.splitlines() if line.startswith("rank  records"))) + 1:]}
    header = next(line for line in text.splitlines() if line.startswith("rank  records")).split("  ")
    assert [h.strip() for h in header if h.strip()][:7] == ["rank", "records", "steps/s", "step ms", "first step ms",
                                                            "comm ms", "samples/s"]
    fleet_rate = 0.0
    for rank in (0, 1):
        mine = [r for r in lines if r["rank"] == rank]
        steady = mine[1:]
        took = sum(r["system"]["step_time_s"] for r in steady)
        by_hand = 32 * len(steady) / took
        fleet_rate += by_hand
        row = table[str(rank)]
        assert float(row[6]) == pytest.approx(by_hand, rel=1e-3), (row, by_hand)
        assert float(row[3]) == pytest.approx(took / len(steady) * 1e3, rel=1e-3)
        assert float(row[4]) == pytest.approx(mine[0]["system"]["step_time_s"] * 1e3, rel=1e-3)
        assert float(row[4]) >= 300, "the first step (0.3 s) is shown apart"
        naive = sum(r["system"]["samples_per_s"] for r in steady) / len(steady)
        assert naive > 2 * by_hand, "the old mean of rates was far off here"
    assert float(table["all"][6]) == pytest.approx(fleet_rate, rel=1e-3)


def test_a_progress_total_belongs_to_its_cell_and_the_whole_run_counts_every_record(fleet):
    """Was: "step 200/150", full and green, in a later cell (the total carried over), and %metrics
    said "whole run · 100 records" for a run of 400 (it counted the last cell)."""
    from workbench.kernel.metrics.dashboard import Dashboard

    fleet.run("total = workbench.step + 3\nworkbench.progress(total=total)\nfor i in range(3):\n    workbench.log(loss=1.0)",
              show_output=False)
    assert {fleet.metrics.store.streams[r].total for r in (0, 1)} == {fleet.run("total")[0]}
    fleet.run("for i in range(4):\n    workbench.log(loss=1.0)", show_output=False)
    assert {fleet.metrics.store.streams[r].total for r in (0, 1)} == {None}
    whole = Dashboard(fleet.metrics.store, fleet.metrics.run_id)
    whole.cell_started(len(fleet.metrics.store) - 8)  # %metrics shown while the last cell ran
    whole.refresh(force=True)
    assert f"whole run · 2 ranks · {len(fleet.metrics.store)} records" in whole.header.value


def test_steps_per_second_over_several_cells_leaves_out_the_idle_time_between_them(fleet):
    from workbench.kernel.metrics.summary import steps_per_second

    first = len(fleet.metrics.store)
    loop = "import time\nfor i in range(10):\n    time.sleep(0.02)\n    workbench.log(x=i)"
    fleet.run(loop, show_output=False)
    time.sleep(1.5)  # the user reads the output: no training happens
    fleet.run(loop, show_output=False)
    records = [r for r in fleet.metrics.store.since(first) if r.rank == 0]
    assert len(records) == 20
    rate = steps_per_second(records)
    assert 25 < rate < 55, rate  # ~1 / 20 ms; counting the 1.5 s pause would give < 12


def test_wandb_mode_is_offline_without_a_key(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() is None
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() is None


def test_without_wandb_installed_a_run_keeps_its_jsonl_and_tensorboard_and_wandb_true_is_refused(tmp_path,
                                                                                                 monkeypatch):
    """wandb is an extra: without it the default sinks are metrics.jsonl and TensorBoard, and
    asking for wandb says how to install it, before anything starts."""
    from workbench.kernel.metrics.live import FleetMetrics

    monkeypatch.setitem(sys.modules, "wandb", None)  # its import fails, as where it is not installed
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(OptionsError, match=r"^wandb=True needs the wandb package: pip install 'torch-workbench\[wandb\]'$"):
        Fleet(n=2, wandb=True)
    metrics = FleetMetrics("run", str(tmp_path), str(tmp_path), lambda: 1, {})
    try:
        assert [sink.kind for sink in metrics.collector.sinks] == ["metrics", "tensorboard"]
    finally:
        metrics.close()


@pytest.mark.fleet
def test_one_offline_wandb_run_per_fleet_run_holds_the_values(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no key configured
    with Fleet(n=2, progress=False, wandb=True, runs_dir=str(tmp_path / "runs")) as fleet:
        fleet.run("for i in range(6):\n    workbench.log(loss=i + rank * 0.5)", show_output=False)
        fleet.run("for i in range(400):\n    workbench.log(fast=i)", show_output=False)  # ~ms a step
        run_dir = fleet.run_dir
    files = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, files
    history = list(history_rows(files[0]))
    rows = [row for row in history if "loss" in row]
    assert [row["workbench/step"] for row in rows] == list(range(6))
    fast = [row["workbench/step"] for row in history if "fast" in row]
    assert fast[:10] == list(range(6, 16)) and fast[-1] == 405, fast  # a burst, then the rate limit
    assert len(fast) < 120, f"{len(fast)} rows: wandb gets at most a burst and then a few rows a second"
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert sum('"fast"' in line for line in f) == 800  # every step of every rank
    for i, row in enumerate(rows):
        assert row["rank0/loss"] == i and row["rank1/loss"] == i + 0.5
        assert row["loss"] == pytest.approx(i + 0.25)
        assert row["step_time_s"] > 0
    assert "rank1/rss_mb" in rows[-1]  # memory: sampled as records leave the rank, on the newest
    assert os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
    modes = {oct(os.stat(os.path.join(folder, name)).st_mode & 0o777)
             for folder, _, names in os.walk(os.path.join(run_dir, "wandb")) for name in names
             if not os.path.islink(os.path.join(folder, name))}
    assert modes == {"0o600"}, modes  # wandb's files are owner-only, like the rest of the run


def test_metrics_jsonl_goes_on_after_a_full_disk(tmp_path):
    """A full disk pauses metrics.jsonl, keeps what it could not write, and writes it once space is back."""
    from test_checkpoints import _tmpfs

    from workbench.kernel.metrics.sinks import JsonlSink, SinkPaused
    from workbench.kernel.metrics.store import Record

    def records(start, n):
        return [Record(time=1.0, arrived=1.0, rank=0, step=i, scalars={"loss": 1.0}, system={})
                for i in range(start, start + n)]

    with _tmpfs("64k") as disk:
        sink = JsonlSink(os.path.join(disk, "metrics.jsonl"))
        filler = os.path.join(disk, "filler")
        with open(filler, "wb") as f:
            try:
                f.write(b"x" * 70_000)
            except OSError:
                pass
        paused = 0
        for start in range(0, 300, 50):
            try:
                sink.write(records(start, 50))
            except SinkPaused:
                paused += 1
        assert paused, "the disk really was full"
        os.remove(filler)  # space is back
        sink.write(records(300, 50))
        sink.close()
        lines = open(os.path.join(disk, "metrics.jsonl")).read().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(350)), "every record, in order, none lost"


def test_tensorboard_shows_the_run_with_a_line_per_rank_and_the_mean(fleet, tmp_path):
    """Event files next to metrics.jsonl, read back by a real TensorBoard server (what
    ``%tensorboard --logdir workbench-runs`` starts)."""
    import subprocess
    import sys
    import urllib.parse
    import urllib.request

    from conftest import free_port

    fleet.run("for i in range(4):\n    workbench.log(step=50_000 + i, tb_probe=i + rank * 0.5)", show_output=False)
    folder = os.path.join(fleet.run_dir, "tensorboard")
    assert {"rank0", "rank1"} <= set(os.listdir(folder))
    assert all(os.stat(os.path.join(d, n)).st_mode & 0o077 == 0 for d, _, ns in os.walk(folder) for n in ns)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", os.path.dirname(fleet.run_dir), "--host", "127.0.0.1",
         "--port", str(port), "--load_fast", "false", "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "tb.log", "w"))
    try:
        def scalars(run):
            query = urllib.parse.urlencode({"run": f"{fleet.run_id}/tensorboard{run}", "tag": "tb_probe"})
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?{query}", timeout=5) as r:
                return {step: value for _, step, value in json.load(r)}

        deadline = time.monotonic() + 60
        while True:
            try:
                mean, rank1 = scalars(""), scalars("/rank1")
                if len(mean) == 4 and len(rank1) == 4:
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "tb.log").read_text()[-2000:]
            time.sleep(0.5)
    finally:
        server.kill()
        server.wait()
    assert rank1 == {50_000 + i: i + 0.5 for i in range(4)}
    assert mean == {50_000 + i: pytest.approx(i + 0.25) for i in range(4)}


def test_each_cell_has_its_own_dashboard_that_keeps_its_numbers(fleet, monkeypatch):
    """Two cells in a row: the first cell's widget still reads as it ended (the bug was one shared
    widget: a 150-step cell ended up reading "step 200/150"). Warm-up steps do not set the axis."""
    from workbench.kernel.metrics import live
    from workbench.kernel.metrics.live import FleetMetrics

    shown = []
    monkeypatch.setattr(live, "in_kernel", lambda: True)
    monkeypatch.setattr(FleetMetrics, "display_dashboard", lambda self, dashboard=None: shown.append(dashboard))
    cell = ("import time\nworkbench.progress(total=workbench.step + {n})\nfor i in range({n}):\n"
            "    time.sleep(0.4 if i == 0 else 0.002)\n    workbench.log(each=i)")
    fleet.run(cell.format(n=30), show_output=True)
    first = shown[0]
    label, header = first._bars[0][1].value, first.header.value
    assert label.startswith("step") and "/" in label and "this cell" in header and "60 records" in header, header
    step_plot = first.system_plots["step"]
    assert step_plot.y_scale.max is not None and step_plot.y_scale.max < 300, step_plot.y_scale.max  # ms
    assert "above the chart" in step_plot.note.value and "above" not in step_plot.figure.title
    assert "rank 0" in step_plot.legend.value and "rank 1" in step_plot.legend.value
    memory = first.system_plots["memory"]  # from 0: nearly constant RSS no longer repeats one tick
    assert memory.y_scale.min == 0.0 and memory.figure.axes[1].label == "MiB"
    fleet.run(cell.format(n=10), show_output=True)
    assert len(shown) == 2 and shown[1] is not first
    assert first._bars[0][1].value == label and first.header.value == header  # untouched by the second cell
    assert "20 records" in shown[1].header.value


def test_the_axis_top_leaves_out_rare_outliers_but_shows_99_percent():
    from workbench.kernel.metrics.dashboard import steady_top

    steady = [7.0, 7.2, 6.9, 7.1, 7.0, 7.3, 6.8, 7.0]
    assert 7.3 <= steady_top(steady) < 30  # nothing clipped without outliers (the plot leaves out warm-ups)
    top = steady_top([2600.0, *steady * 20])
    assert 7.3 < top < 30, "one outlier in 161 values is off the chart"
    assert steady_top([1.0, 2.0]) is None  # too few points: the axis fits them all
    # comm times with a long tail (10 % of the points at 4-9x the median): at most 1 % clipped
    tail = [1.0] * 900 + [4.0 + (i % 6) for i in range(100)]
    top = steady_top(tail)
    assert sum(v > top for v in tail) <= len(tail) // 100


class _FakeCuda:
    """Stands in for torch.cuda on a GPU (none exists on the CI machines): NVML's answers."""

    def __init__(self, fail=False):
        self.calls, self.fail = 0, fail

    def current_device(self):
        return 0

    def utilization(self, device):
        self.calls += 1
        if self.fail:
            raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed")
        return 87

    def device_memory_used(self, device):
        return 3 * 2**30


def test_gpu_utilisation_and_memory_from_nvml_are_sampled_once_a_second_and_shown():
    from workbench.kernel.metrics.store import Record
    from workbench.kernel.metrics.summary import summary_text
    from workbench.metrics.gpu import GpuProbe

    cuda, probe = _FakeCuda(), GpuProbe()
    assert probe.sample(cuda) == {"gpu_util_pct": 87.0, "gpu_mem_used_mb": 3072.0}
    assert probe.sample(cuda)["gpu_util_pct"] == 87.0 and cuda.calls == 1  # cached within the second
    broken, off = _FakeCuda(fail=True), GpuProbe()
    assert off.sample(broken) == {} and off.off and off.sample(broken) == {} and broken.calls == 1
    records = [Record(0.0, 0.0, r, s, {}, {"step_time_s": 0.01, "gpu_util_pct": 80.0 + r, "gpu_mem_used_mb": 2048.0})
               for s in range(3) for r in (0, 1)]
    text = summary_text(records, "run")
    assert "GPU util %" in text and "GPU mem MiB" in text and "81" in text
    dashboard = Dashboard(_StoreOf(records), "run")
    assert dashboard.system_plots["gpu"].widget.layout.display is None
    assert Dashboard(_StoreOf([]), "run").system_plots["gpu"].widget.layout.display == "none"


class _StoreOf:
    def __init__(self, records):
        self.records, self.streams = records, {}

    def __len__(self):
        return len(self.records)

    def since(self, start):
        return self.records[start:]

    def dropped(self):
        return 0


def test_a_million_records_keep_the_kernel_memory_bounded_and_old_records_come_back_from_disk(tmp_path):
    """Was: about 1.1 KiB per record for the whole run (240k records: 101 -> 373 MiB). Now the store
    keeps a window in memory; older records are read back from metrics.jsonl, in order."""
    import gc

    import psutil

    from workbench.kernel.metrics.sinks import JsonlSink
    from workbench.kernel.metrics.store import WINDOW, MetricsStore

    path = str(tmp_path / "metrics.jsonl")
    store, sink = MetricsStore(spill_path=path), JsonlSink(path)
    gc.collect()
    before = psutil.Process().memory_info().rss
    batch, total, seq = 1000, 1_000_000, 0
    for n in range(total // batch):
        rank = n % 4
        records = []
        for _ in range(batch):
            seq += 1
            records.append([1.7e9 + seq, seq, seq // 4, {"loss": seq * 1e-6, "lr": 0.001},
                            {"step_time_s": 0.01, "samples_per_s": 3200.0}])
        sink.write(store.add({"rank": rank, "pid": 100 + rank, "records": records, "dropped": 0,
                              "memory": {"rss_mb": 512.0}}, 1.7e9 + seq))
    sink.close()
    gc.collect()
    grown_mib = (psutil.Process().memory_info().rss - before) / 2**20
    assert len(store) == total
    assert grown_mib < 250, f"the store grew by {grown_mib:.0f} MiB for {total} records"
    old = store.since(10, limit=5)  # far older than the window: from disk
    assert [r.scalars["loss"] for r in old] == pytest.approx([(11 + i) * 1e-6 for i in range(5)])
    assert [r.rank for r in old] == [0] * 5
    tail = store.since(total - 3)
    assert [r.step for r in tail] == [(total - 2) // 4, (total - 1) // 4, total // 4]
    boundary = store._first  # the oldest record in memory; the ones before it come from disk
    assert total - boundary >= WINDOW
    joined = store.since(boundary - 10, limit=20)
    assert [r.time - 1.7e9 for r in joined] == [boundary - 9 + i for i in range(20)], "no gap, no repeat"


def test_a_nan_or_inf_loss_is_named_once_in_the_cell_output(fleet, capsys):
    fleet.run("for i in range(6):\n    workbench.log(loss=float('nan') if rank == 1 and i >= 3 else 1.0,"
              " grad=float('inf') if rank == 0 and i == 4 else 0.5)")
    err = capsys.readouterr().err
    assert re.search(r"workbench: loss is nan at step \d+ on rank 1 \(3 non-finite values in this cell\)\n", err), err
    assert re.search(r"workbench: grad is inf at step \d+ on rank 0\n", err), err
    assert err.count("loss is nan") == 1
    fleet.run("workbench.log(loss=1.0)")
    assert "non-finite" not in capsys.readouterr().err, "said once: the next cell is clean"


def test_stop_on_nan_ends_the_cell_at_the_first_non_finite_value(fleet):
    from workbench import CellOptions, DistributedCellError
    from workbench.kernel.flags import distributed_parser, options_from
    from workbench.options import CellCall

    code = ("import torch\nworkbench.step = 0\nfor i in range(8):\n"
            "    workbench.log(loss=torch.tensor(float('nan')) if rank == 1 and i == 3 else 1.0)\n"
            "    done = i")
    with pytest.raises(DistributedCellError, match=r"FloatingPointError: loss is nan at step \d+ on rank 1 "
                                                   r"\(--stop-on-nan\)") as info:
        fleet.execute(code, CellOptions(), show_output=False, stop_on_nan=True)
    assert "\n" not in str(info.value).splitlines()[0]
    assert fleet.run("done", ranks=[1], show_output=False) == [2], "rank 1 stopped at the NaN"
    fleet.execute(code, CellOptions(), show_output=False)  # without the flag the loop runs to its end
    assert fleet.run("done", show_output=False) == [7, 7]
    assert options_from(distributed_parser().parse_line("--stop-on-nan"), CellCall).stop_on_nan


def test_workbench_notices_go_through_the_workbench_logger(fleet, capsys):
    import logging

    logger = logging.getLogger("workbench")
    try:
        logger.setLevel(logging.WARNING)  # the user's choice: no notices
        fleet.run("workbench.log(loss=float('nan'))")
        assert "loss is nan" not in capsys.readouterr().err
    finally:
        logger.setLevel(logging.INFO)
    fleet.run("workbench.log(loss=float('nan'))")
    assert "workbench: loss is nan" in capsys.readouterr().err


class KeptSink(Sink):
    """A sink of a user's own: keeps what it is given."""

    made: list[KeptSink] = []

    def __init__(self, run: RunInfo) -> None:
        self.records, self.flushes, self.closed, self.config = [], 0, False, dict(run.config)
        KeptSink.made.append(self)

    def write(self, records) -> None:
        self.records += records

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closed = True


def test_a_sink_name_nobody_registered_is_one_line_before_anything_starts():
    with pytest.raises(OptionsError, match=r"^no sink named 'csv'; known: .*register_sink\(name, factory\)"):
        Fleet(n=2, sinks=["csv"])
    assert "--sink NAME[,NAME]" in fleet_parser().help_text("start")


@pytest.mark.fleet
def test_one_throughput_figure_in_every_place_by_hand(tmp_path, monkeypatch):
    """Each step's samples/s is 32 ÷ that step's time (by hand from metrics.jsonl) and is the same
    number in the dashboard's throughput chart, the panel's points (live; from disk the panel
    reads metrics.jsonl itself), wandb's and TensorBoard's rank<N>/samples_per_s; the summary's
    and the dashboard's figures for the cell are samples ÷ the time the steady steps took."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from workbench.kernel.metrics.summary import per_rank, steps_per_second
    from workbench.kernel.panel import _points

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    register_sink("kept-in-memory", KeptSink)  # a sink someone adds: one class, one line to register it
    steps = 30
    with Fleet(n=2, progress=False, wandb=True, tensorboard=True, sinks=["kept-in-memory"],
               runs_dir=str(tmp_path / "runs")) as fleet:
        fleet.run(f"import time\nfor i in range({steps}):\n    time.sleep(0.04 if i % 3 else 0.08)\n"
                  "    workbench.log(loss=1.0 / (i + 1), samples=32)", show_output=False)
        store, run_dir = fleet.metrics.store, fleet.run_dir
        records = store.since(0)
        dashboard = Dashboard(store, fleet.metrics.run_id)
        summary = fleet.metrics.summary(0)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == 2 * steps
    by_hand = {(r["rank"], r["step"]): 32 / r["system"]["step_time_s"] for r in lines}
    for line in lines:
        assert line["system"]["samples_per_s"] == pytest.approx(by_hand[line["rank"], line["step"]], rel=1e-9)
    # the panel's live points
    points = _points(records)
    assert {(p[0], p[1]): p[4] for p in points} == pytest.approx(by_hand, rel=1e-9)
    assert {(p[0], p[1]): 32 / p[5] for p in points} == pytest.approx(by_hand, rel=1e-9)
    # the dashboard's throughput chart: a line per rank
    for rank in (0, 1):
        line = dashboard.system_plots["throughput"].lines[f"rank {rank}"]
        assert dict(zip(line.x, line.y, strict=True)) == pytest.approx(
            {s: v for (r, s), v in by_hand.items() if r == rank}, rel=1e-9)
    # a sink of the user's own, given every record as it arrived, flushed at the end of the cell, closed at stop
    kept = KeptSink.made[-1]
    assert {(r.rank, r.step): 32 / r.system["step_time_s"] for r in kept.records} == pytest.approx(by_hand, rel=1e-9)
    assert kept.flushes >= 1 and kept.closed and kept.config["ranks"] == 2
    # wandb (30 rows: within its burst) and TensorBoard (within its burst too)
    wandb_file = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))[0]
    rows = [row for row in history_rows(wandb_file) if "rank0/samples_per_s" in row]
    assert len(rows) == steps
    for row in rows:
        for rank in (0, 1):
            assert row[f"rank{rank}/samples_per_s"] == pytest.approx(by_hand[rank, row["workbench/step"]], rel=1e-9)
    for rank in (0, 1):
        events = EventAccumulator(os.path.join(run_dir, "tensorboard", f"rank{rank}"))
        events.Reload()
        scalars = events.Scalars("samples_per_s")
        assert len(scalars) == steps
        for event in scalars:  # TensorBoard keeps 32-bit floats
            assert event.value == pytest.approx(by_hand[rank, event.step], rel=1e-6)
    # the cell's figures: samples ÷ the time the steps after the first took, per rank and summed
    table = {row.split()[0]: row.split() for row in summary.splitlines() if re.match(r"^(\d+|all)\s", row)}
    fleet_rate = 0.0
    for rank, mine in per_rank(records).items():
        steady = [r for r in lines if r["rank"] == rank][1:]
        rate = 32 * len(steady) / sum(r["system"]["step_time_s"] for r in steady)
        fleet_rate += rate
        assert float(table[str(rank)][6]) == pytest.approx(rate, rel=1e-3)
        steps_rate = len(steady) / sum(r["system"]["step_time_s"] for r in steady)
        assert float(table[str(rank)][2]) == pytest.approx(steps_rate, rel=1e-3)
        assert f"{steps_rate:.1f} steps/s" in dashboard._bars[rank][1].value  # the dashboard's progress label
        assert steps_per_second(mine[1:]) == pytest.approx(steps_rate, rel=1e-9)
    assert float(table["all"][6]) == pytest.approx(fleet_rate, rel=1e-3)


def test_the_collector_takes_only_messages_signed_with_the_runs_key(tmp_path):
    """Also over TCP (engines on other hosts): a message without the run's signature is dropped,
    counted and named once."""
    import zmq

    from workbench.kernel.metrics.collector import MetricsCollector
    from workbench.messages import sign

    collector = MetricsCollector(str(tmp_path), str(tmp_path), network=True)
    try:
        address = collector.address_for("127.0.0.1", local=False)
        assert address == f"tcp://127.0.0.1:{collector.port}"
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.connect(address)
        message = {"pid": 7, "rank": 0, "dropped": 0, "total": None, "memory": {}, "beat": None,
                   "records": [[1.0, 1, 0, {"loss": 0.5}, {"step_time_s": 0.1}]]}
        data = json.dumps(message).encode()
        push.send_multipart([b"x" * 32, data])  # a wrong signature
        push.send(data)  # none
        push.send_multipart([sign(bytes.fromhex(collector.key), data), data])
        deadline = time.monotonic() + 10
        while len(collector.store) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(collector.store) == 1 and collector.store.since(0)[0].scalars == {"loss": 0.5}
        assert collector.rejected == 2
        assert collector.take_errors() == ["metrics: a message without a valid signature was ignored (not from "
                                           "this fleet's ranks)"]
        push.close(linger=0)
        context.term()
    finally:
        collector.close()
