"""The Python API on a real 2-rank gloo fleet (shared across this module)."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import threading
import time

import pytest
from conftest import fleet_processes

from workbench import DistributedCellError, Fleet, FleetError, OptionsError

ALL_REDUCE = "import torch\nt = torch.ones(1)\ntorch.distributed.all_reduce(t)\nt.item()"


def test_ranks_have_their_names_and_a_working_process_group(fleet):
    got = fleet.run("import accelerate\n"
                    "(rank, world_size, local_rank, str(device), isinstance(accelerator, accelerate.Accelerator), "
                    "workbench.__name__)")
    assert got == [(0, 2, 0, "cpu", True, "workbench"), (1, 2, 1, "cpu", True, "workbench")]
    env = fleet.run("import os; {k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')}")
    assert [e["RANK"] for e in env] == ["0", "1"] and {e["WORLD_SIZE"] for e in env} == {"2"}
    assert env[0]["MASTER_ADDR"] == "127.0.0.1" and env[0]["MASTER_PORT"] == env[1]["MASTER_PORT"]
    summed = fleet.run("import torch, torch.distributed as dist\nt = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nt")
    assert [t.item() for t in summed] == [3.0, 3.0]
    assert fleet.run("torch.distributed.get_backend()") == ["gloo", "gloo"]


def test_nothing_listens_beyond_localhost(fleet):
    import psutil

    fleet.run(ALL_REDUCE)
    pids = [m.pid for m in fleet.members] + [fleet.processes.cluster.controller.pid]
    listening = [
        c.laddr for pid in pids for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert listening
    assert {addr.ip for addr in listening} <= {"127.0.0.1", "::1"}, listening


def test_namespace_persists_across_cells_per_rank(fleet):
    fleet.run("counter = rank * 10")
    fleet.run("counter += 1")
    assert fleet.run("counter") == [1, 11]


def test_functions_run_with_the_rank_namespace(fleet):
    def square_rank(offset, scale=1):
        return (rank + offset) ** 2 * scale  # noqa: F821 - defined on the engines

    square_rank.__module__ = "__main__"  # as if typed in a notebook: sent by value
    assert fleet.run(square_rank, 1, scale=2) == [2, 8]


def test_push_and_pull(fleet):
    fleet.push(lr=3e-4, tags=["a", "b"])
    assert fleet.run("lr, tags") == [(3e-4, ["a", "b"]), (3e-4, ["a", "b"])]
    fleet.run("import torch\nweights = torch.full((2,), float(rank))")
    assert fleet.pull("weights", rank=1).tolist() == [1.0, 1.0]
    with pytest.raises(FleetError, match="not defined"):
        fleet.pull("no_such_name")
    with pytest.raises(OptionsError, match="out of range"):
        fleet.pull("weights", rank=7)


def test_subset_of_ranks(fleet):
    assert fleet.run("rank", ranks=[1]) == [1]
    with pytest.raises(OptionsError, match="out of range"):
        fleet.run("rank", ranks=[2])
    with pytest.raises(OptionsError, match="ranks are whole numbers"):
        fleet.run("rank", ranks=["0"])


def test_status_table_rows(fleet):
    rows = fleet.status()
    assert [r["rank"] for r in rows] == [0, 1]
    assert {r["state"] for r in rows} == {"idle"}
    assert all(r["pid"] > 0 and r["memory"].endswith("MiB") and r["device"] == "cpu" for r in rows)
    assert len({r["engine"] for r in rows}) == 2


class _Recorder(io.TextIOBase):
    """A stdout that remembers when each piece of text arrived."""

    def __init__(self):
        self.chunks: list[tuple[float, str]] = []

    def write(self, text):
        self.chunks.append((time.monotonic(), text))
        return len(text)


def test_output_streams_live_labelled_by_rank(fleet, monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(sys, "stdout", recorder)
    started = time.monotonic()
    fleet.run("import time\nprint('tick', rank, flush=True)\ntime.sleep(2.5)\nprint('tock', rank)")
    ended = time.monotonic()
    monkeypatch.undo()
    first_tick = min(t for t, text in recorder.chunks if "tick" in text)
    assert ended - first_tick > 1.5, "output only arrived when the cell ended"
    text = "".join(t for _, t in recorder.chunks)
    for rank in (0, 1):
        assert f"[rank {rank}] tick {rank}" in text and f"[rank {rank}] tock {rank}" in text
    assert first_tick - started < 2.5


def test_output_printed_just_before_the_reply_is_never_lost(fleet, capsys):
    # the reply and the output travel on separate zmq streams: the reply often wins
    capsys.readouterr()
    for i in range(40):
        fleet.run(f"print('end {i}')")
        text = capsys.readouterr().out
        assert all(f"[rank {rank}] end {i}" in text for rank in (0, 1)), (i, text)


def test_error_on_one_rank_releases_the_rank_blocked_in_all_reduce(fleet):
    code = (
        "import torch, torch.distributed as dist\n"
        "if rank == 1:\n"
        "    raise ValueError('bad batch on rank 1')\n"
        "dist.all_reduce(torch.ones(1))\n"
    )
    started = time.monotonic()
    with pytest.raises(DistributedCellError) as info:
        fleet.run(code, show_output=False)
    assert time.monotonic() - started < 10
    err = info.value
    groups = err.groups()
    assert [ranks for ranks, _ in groups] == [[1]]
    assert "ValueError: bad batch on rank 1" in groups[0][1].traceback
    assert "<distributed-cell-" in groups[0][1].traceback and "workbench/rank/engine.py" not in groups[0][1].traceback
    report = err.report()
    assert report.count("bad batch on rank 1") == 2  # the raise line and the message, once
    assert "rank 0 stopped" in report
    # the next cell works on the same fleet, with a rebuilt process group
    assert fleet.run(ALL_REDUCE) == [2.0, 2.0]


def test_same_error_on_every_rank_is_shown_once(fleet):
    with pytest.raises(DistributedCellError) as info:
        fleet.run("undefined_name + 1", show_output=False)
    assert [ranks for ranks, _ in info.value.groups()] == [[0, 1]]
    assert info.value.report().count("NameError") == 2  # header + the traceback's last line
    assert fleet.run("1 + 1") == [2, 2]


def test_prepared_ddp_model_keeps_training_after_a_failure_without_collectives(fleet):
    fleet.run(
        "import torch\nmodel = accelerator.prepare(torch.nn.Linear(4, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    )
    with pytest.raises(DistributedCellError):
        fleet.run("if rank == 0:\n    raise RuntimeError('only rank 0')", show_output=False)
    # nobody was blocked, so the group was kept and the prepared model still works
    loss = fleet.run("l = model(torch.ones(2, 4)).sum()\naccelerator.backward(l)\nopt.step()\nl.item()")
    assert len(loss) == 2


def _seconds_until_interrupted(fleet, code: str, interrupt_after: float) -> float:
    """Run ``code``, SIGINT this process (as Ctrl-C would) after a delay; the run must raise KeyboardInterrupt."""
    pid = os.getpid()
    threading.Timer(interrupt_after, lambda: os.kill(pid, signal.SIGINT)).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        fleet.run(code, show_output=False)
    return time.monotonic() - started


def test_interrupt_stops_every_rank_and_the_fleet_stays_usable(fleet, caplog):
    """The report leaves out workbench's own frames; they are kept in the 'workbench' logger's debug log."""
    import logging

    code = "import time, torch\nif rank == 0:\n    time.sleep(60)\ntorch.distributed.all_reduce(torch.ones(1))"
    logger = logging.getLogger("workbench")
    logger.setLevel(logging.DEBUG)
    try:
        with caplog.at_level(logging.DEBUG, logger="workbench"):
            logger.addHandler(caplog.handler)
            assert _seconds_until_interrupted(fleet, code, 1.0) < 10
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(logging.INFO)
    kept = [r.getMessage() for r in caplog.records if "workbench's own frames" in r.getMessage()]
    assert kept and "execution.py" in kept[0]
    assert fleet.run(ALL_REDUCE) == [2.0, 2.0]


def test_timeout_stops_the_cell(fleet):
    started = time.monotonic()
    with pytest.raises(DistributedCellError, match="timed out after --timeout 1 s") as info:
        fleet.run("import time\ntime.sleep(30)", timeout=1, show_output=False)
    assert time.monotonic() - started < 8
    assert "rank 0,1 stopped because of the timeout" in info.value.report()
    assert fleet.run("rank") == [0, 1]


def test_the_bytes_of_a_gloo_all_reduce_are_seen_moving(fleet):
    """What keeps a slow collective from being called stuck: a 4 MB all_reduce's bytes go
    through gloo's own threads, which ``_collective_bytes`` reads from /proc."""
    code = ("import torch\nfrom workbench.metrics.logger import _collective_bytes\nbefore = _collective_bytes()\n"
            "torch.distributed.all_reduce(torch.ones(1_000_000))\n_collective_bytes() - before")
    moved = fleet.run(code, show_output=False)
    assert all(4_000_000 <= count < 100_000_000 for count in moved), moved


def _mismatch(fleet, code: str, waiting_in: str) -> DistributedCellError:
    """Run ``code``, in which rank 0 waits for rank 1 after rank 1 finished the cell: the cell
    fails within seconds (the group's timeout is 300 s), naming where rank 0 waited."""
    started = time.monotonic()
    with pytest.raises(DistributedCellError) as info:
        fleet.run(code, show_output=False)
    assert time.monotonic() - started < 30
    assert str(info.value).startswith("MismatchedCollective: waited ")
    assert f"in {waiting_in} while rank 1 had already finished the cell" in str(info.value)
    return info.value


def test_a_mismatched_collective_is_named_within_seconds_not_after_the_pg_timeout(fleet):
    """Rank 0 all_reduces, rank 1 has finished the cell: nobody will ever join rank 0."""
    fleet.run("survivor = 'kept'", show_output=False)
    pids = [m.pid for m in fleet.members]
    error = _mismatch(fleet, "import torch\nif rank == 0:\n    torch.distributed.all_reduce(torch.ones(3))",
                      "torch.distributed.all_reduce")
    assert "(rank 0 of 2)" in str(error)
    assert "in all_reduce" in error.report()  # rank 0's stack, where it waited
    assert [m.pid for m in fleet.members] == pids  # released, not killed
    assert fleet.run("survivor", show_output=False) == ["kept", "kept"]
    assert fleet.run(ALL_REDUCE) == [2.0, 2.0]


def test_a_ddp_backward_no_peer_will_join_is_named_within_seconds(fleet):
    """DDP runs its collectives in C++, not through a torch.distributed call: rank 0 runs one
    more step than rank 1, which has finished the cell (rank 0 then waits in the forward's
    bucket rebuild); on a fresh model, only rank 0 steps (it waits in backward)."""
    fleet.run("import torch\nddp_model = accelerator.prepare(torch.nn.Linear(4, 4))", show_output=False)
    _mismatch(fleet, "for _ in range(2 if rank == 0 else 1):\n    ddp_model(torch.ones(2, 4)).sum().backward()",
              "DDP's _pre_forward (its collectives)")
    assert fleet.run(ALL_REDUCE) == [2.0, 2.0]
    # DDP's first backward of a new model waits for its gradient all-reduce inside C++ autograd
    fleet.run("ddp_model = accelerator.prepare(torch.nn.Linear(4, 4))", show_output=False)
    _mismatch(fleet, "if rank == 0:\n    ddp_model(torch.ones(2, 4)).sum().backward()",
              "backward (DDP's gradient all-reduce)")
    assert fleet.run(ALL_REDUCE) == [2.0, 2.0]
    # a backward under no_sync all-reduces nothing: it is not taken for a wait
    fleet.run("ddp_model = accelerator.prepare(torch.nn.Linear(4, 4))", show_output=False)
    syncing = ("from workbench.metrics.logger import LOGGER\nwith ddp_model.no_sync():\n"
               "    ddp_model(torch.ones(2, 4)).sum().backward()\n    inside = LOGGER.comm.ddp_syncing()\n"
               "ddp_model(torch.ones(2, 4)).sum().backward()\n(inside, LOGGER.comm.ddp_syncing())")
    assert fleet.run(syncing, show_output=False) == [(False, True), (False, True)]


def test_ranks_stuck_in_cpp_are_killed_and_replaced(fleet):
    """Both ranks wait for each other in recv: SIGINT cannot reach them, so they are replaced."""
    fleet.run("marker = 'old namespace'")
    old_pids = [m.pid for m in fleet.members]
    code = "import torch, torch.distributed as dist\ndist.recv(torch.zeros(1), src=1 - rank)"
    assert _seconds_until_interrupted(fleet, code, 0.5) < 30
    assert all(p not in old_pids for p in (m.pid for m in fleet.members))
    assert fleet.run("'marker' in dir()") == [False, False]
    assert fleet.run(ALL_REDUCE) == [2.0, 2.0]


def test_bad_options_are_refused_before_anything_runs(fleet):
    with pytest.raises(OptionsError, match="unknown strategy"):
        fleet.run("1", strategy="zero3")
    with pytest.raises(OptionsError, match="unknown mixed precision"):
        fleet.run("1", mixed_precision="fp8")
    with pytest.raises(OptionsError, match="fp16 mixed precision needs a GPU"):
        fleet.run("1", mixed_precision="fp16")
    with pytest.raises(OptionsError, match="grad-accum"):
        fleet.run("1", grad_accum=0)


def test_a_run_folder_that_cannot_be_made_is_one_line_and_starts_nothing(tmp_path):
    before = {p.pid for p in fleet_processes()}
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(FleetError, match=r"^cannot create the run folder under .*a-file/runs: Not a directory; "):
        Fleet(n=1, progress=False, runs_dir=str(blocker / "runs")).start()
    assert {p.pid for p in fleet_processes()} <= before


@pytest.mark.fleet
def test_start_twice_and_use_after_stop_are_refused():
    f = Fleet(n=1, progress=False)
    with pytest.raises(FleetError, match="no fleet is running"):
        f.run("1")
    with f:
        with pytest.raises(FleetError, match="already running"):
            f.start()
        assert f.run("world_size") == [1]
    assert not f.running


def test_status_while_a_cell_runs_shows_busy(fleet):
    pending = fleet.client[fleet.engine_ids([1])].apply_async(__import__("time").sleep, 2)
    time.sleep(0.3)
    rows = fleet.status()
    pending.get()
    assert [r["state"] for r in rows] == ["idle", "busy"]
    assert rows[1]["memory"].endswith("MiB")


def test_a_fleet_the_machine_cannot_hold_is_refused_before_starting(capfd):
    import psutil

    from workbench import OptionsError
    from workbench.kernel.devices import ENGINE_MEMORY_BYTES

    too_many = psutil.virtual_memory().available // ENGINE_MEMORY_BYTES + 8
    with pytest.raises(OptionsError, match=f"^{too_many} CPU engines need about .* use at most -n"):
        Fleet(n=too_many)
    Fleet(n=os.cpu_count() * 4 + 1)  # fits in memory: only a warning, nothing started
    assert "will be slow" in capfd.readouterr().err


def test_status_is_bounded_when_the_controller_is_frozen(fleet):
    import psutil

    controllers = [p for p in psutil.Process().children(recursive=True)
                   if "ipyparallel.controller" in " ".join(p.cmdline()) and p.pid in _cluster_pids(fleet)]
    assert controllers
    for proc in controllers:
        proc.suspend()
    started = time.monotonic()
    try:
        with pytest.raises(FleetError, match="the controller did not answer within 5 s"):
            fleet.status()
    finally:
        for proc in controllers:
            proc.resume()
    assert time.monotonic() - started < 10
    assert len(fleet.status()) == 2  # answers again once it runs


def _cluster_pids(fleet) -> set[int]:
    import psutil

    launcher = fleet.processes.cluster.controller
    root = psutil.Process(launcher.process.pid)
    return {root.pid, *(c.pid for c in root.children(recursive=True))}


@pytest.mark.fleet
def test_a_dead_nanny_or_a_dead_engine_and_nanny_hang_nothing():
    import psutil

    with Fleet(n=2, progress=False, wandb=False) as fleet:
        for nanny in psutil.Process(fleet.member(1).pid).children():
            nanny.kill()  # only rank 1's nanny: signals to it used to block forever
        started = time.monotonic()
        with pytest.raises(DistributedCellError, match="timed out after --timeout 2 s"):
            fleet.run("import time\ntime.sleep(60)", timeout=2, show_output=False)
        assert time.monotonic() - started < 20

        victim = psutil.Process(fleet.member(1).pid)  # engine and nanny die mid-all_reduce
        threading.Timer(1.5, lambda: [p.kill() for p in [victim, *victim.children()]]).start()
        started = time.monotonic()
        with pytest.raises(DistributedCellError) as info:
            fleet.run("import time, torch, torch.distributed as dist\nif rank == 1:\n    time.sleep(30)\n"
                      "t = torch.ones(1)\ndist.all_reduce(t)", show_output=False)
        assert time.monotonic() - started < 20, "the cell ends within seconds, not at a gloo or hub timeout"
        assert str(info.value).startswith("rank 1 of 2 died"), str(info.value)
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 30, "stop() is bounded"


def test_each_rank_output_is_kept_in_the_run_folder(fleet):
    for i in range(40):  # not shown: the reply still often wins over the output, which the log must keep
        fleet.run(f"print('logged {i}', rank)", show_output=False)
        for rank in (0, 1):
            with open(os.path.join(fleet.run_dir, "logs", f"rank-{rank}.log")) as f:
                assert f"logged {i} {rank}\n" in f.read()[-2000:], (i, rank)
    fleet.run("import sys\nprint('kept for later', rank)\nprint('a warning', rank, file=sys.stderr)", show_output=False)
    for rank in (0, 1):
        path = os.path.join(fleet.run_dir, "logs", f"rank-{rank}.log")
        text = open(path).read()
        assert f"kept for later {rank}\n── stderr ──\na warning {rank}\n" in text, text[-500:]
        assert "── distributed-cell-" in text
        assert os.stat(path).st_mode & 0o077 == 0


@pytest.mark.fleet
def test_an_engine_process_output_outlives_the_runtime_folder():
    """What an engine writes to its own file descriptors (a C library, a crash) is kept at stop."""
    with Fleet(n=1, progress=False) as one:
        one.run("import os\nos.write(2, b'straight to fd 2\\n')", show_output=False)
        logs = os.path.join(one.run_dir, "logs")
    names = [n for n in os.listdir(logs) if n.startswith("engine-")]
    assert any("straight to fd 2" in open(os.path.join(logs, n)).read() for n in names), names


def test_stacks_show_where_each_rank_is_now_grouped_and_without_stopping_it(fleet):
    """%fleet stacks while a cell runs (from another thread, as the panel would ask): rank 0 waits in
    all_reduce, rank 1 sleeps in the cell; both go on and finish the cell."""
    seen = {}

    def look():
        time.sleep(2.5)
        seen["stacks"] = fleet.stacks()

    looker = threading.Thread(target=look)
    looker.start()
    got = fleet.run("import time, torch, torch.distributed as dist\nif rank == 1:\n    time.sleep(5)\n"
                    "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()", show_output=False)
    looker.join()
    assert got == [2.0, 2.0], "the ranks were not stopped"
    text = seen["stacks"]
    waiting = text[text.index("── rank 0 of 2 ──"):text.index("── rank 1 of 2 ──")]
    assert "in all_reduce" in waiting and 'File "<distributed-cell-' in waiting
    sleeping = text[text.index("── rank 1 of 2 ──"):]
    assert re.search(r'File "<distributed-cell-\d+>", line 3 in <module>', sleeping)
    assert "ipyparallel" not in text and "threads of the engine itself" in text
    idle = fleet.stacks()
    assert idle.startswith("── rank 0,1 of 2 ──") and "idle: waiting for a cell" in idle
    assert "/ipyparallel/" in fleet.stacks(everything=True)
