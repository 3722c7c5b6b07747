"""The magics in a real Jupyter kernel: help, bad input, streaming, errors, interrupt."""

from __future__ import annotations

import re

import pytest

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _usage_error(kernel, code):
    reply, messages = kernel.execute(code)
    assert reply["status"] == "error", code
    assert reply["ename"] == "UsageError", (code, reply["ename"], reply["evalue"])
    shown = ANSI.sub("", kernel.text(messages)).strip()
    assert len(shown.splitlines()) == 1, f"expected one line for {code!r}, got:\n{shown}"
    return reply["evalue"]


def _help(kernel, code):
    reply, messages = kernel.execute(code)
    pages = [p["data"].get("text/plain", "") for p in reply.get("payload", []) if p.get("source") == "page"]
    return ANSI.sub("", "\n".join(pages) + kernel.text(messages))


def test_help_text_on_every_magic(kernel):
    text = _help(kernel, "%fleet?")
    assert "%fleet start" in text and "--gpus" in text and "%fleet stop" in text
    assert "--launcher local|mpi|slurm|pbs|ssh" in text and "--memory-limit" in text and "--spares" in text
    text = _help(kernel, "%%distributed?")
    assert "--strategy" in text and "--mixed-precision" in text and "accelerator" in text
    assert "--comm-hook" in text and "--tp N" in text and "--pp N" in text and "--activation-checkpointing" in text


def test_distributed_without_a_fleet(kernel):
    assert "start one with %fleet start" in _usage_error(kernel, "%%distributed\nprint(1)")
    assert "no fleet is running" in _usage_error(kernel, "%checkpoint restore")


@pytest.mark.parametrize(
    "line, hint",
    [
        ("%fleet start -n 0", "at least 1"),
        ("%fleet start -n abc", "not a whole number"),
        ("%fleet start --gpus 0,1", "not visible"),
        ("%fleet start --backend carrier-pigeon", "unknown backend"),
        ("%fleet frobnicate", "invalid choice"),
        ("%fleet strat", "did you mean 'start'?"),
        ("%fleet start --spraes 1", "did you mean '--spares'?"),
        ("%fleet", "needs a command"),
        ("%fleet start -n 2 --launcher slurm --launcher-option bogus=1", "has no option 'bogus'"),
        ("%fleet start -n 2 --launcher yarn", "unknown launcher"),
        ("%fleet start -n 2 --memory-limit lots", "size like 4G"),
        ("%fleet start --launcher mpi", "needs -n"),
        ("%fleet start -n 2 --partition gpu", "option of a cluster launcher"),
    ],
)
def test_bad_start_input_is_one_line(kernel, line, hint):
    assert hint in _usage_error(kernel, line)


def test_fleet_start_status_and_streaming(kernel):
    reply, messages = kernel.execute("%fleet start -n 2")
    assert reply["status"] == "ok"
    assert "2 ranks ready" in kernel.text(messages)
    reply, messages = kernel.execute("%fleet status")
    table = kernel.text(messages)
    assert re.search(r"^0\s+\d+\s+\d+\s+\S+\s+cpu\s+idle", table, re.M), table
    assert re.search(r"^1\s+\d+\s+\d+\s+\S+\s+cpu\s+idle", table, re.M), table

    reply, messages = kernel.execute(
        "%%distributed\nimport time\nprint('first', rank, flush=True)\ntime.sleep(2)\nprint('second', rank)\nrank * 100"
    )
    assert reply["status"] == "ok"
    end = messages[-1][0]
    blocks = [(t, m) for t, m in messages if m["msg_type"] in ("display_data", "update_display_data")]
    first = [t for t, m in blocks if "[rank 1] first 1" in m["content"]["data"].get("text/plain", "")]
    assert first and end - first[0] > 1.0, "rank output was not streamed while the cell ran"
    # one block per rank, updated in place
    ids = {m["content"]["transient"]["display_id"] for _, m in blocks}
    assert len(ids) == 2
    assert any(m["msg_type"] == "update_display_data" for _, m in blocks)
    results = [m for _, m in messages if m["msg_type"] == "execute_result"]
    assert [r["content"]["data"]["text/plain"] for r in results] == ["0"]


def test_live_output_sends_only_a_bounded_tail_while_running(kernel):
    """A long print loop: each live update carries a bounded tail, the end shows every line once."""
    reply, messages = kernel.execute(
        "%%distributed\nimport time\nfor i in range(4000):\n    print('line', i, 'x' * 60)\n"
        "    if i % 400 == 0: time.sleep(0.3)")
    assert reply["status"] == "ok"
    updates = [m["content"]["data"].get("text/plain", "") for _, m in messages
               if m["msg_type"] in ("display_data", "update_display_data")]
    final = {u.splitlines()[0].split("]")[0]: u for u in updates if "line 3999" in u}
    assert len(final) == 2 and all(text.count("\n") >= 4000 for text in final.values()), "every line at the end"
    live = [u for u in updates if "line 3999" not in u]
    assert live and max(len(u) for u in live) < 20_000, "live updates are tails, not the whole output"
    assert sum(len(u) for u in updates) < 6 * sum(len(t) for t in final.values())


def test_bad_cell_flags_leave_the_fleet_untouched(kernel):
    assert "unknown strategy" in _usage_error(kernel, "%%distributed --strategy zero3\n1")
    assert "unknown mixed precision" in _usage_error(kernel, "%%distributed --mixed-precision fp8\n1")
    assert "needs a GPU" in _usage_error(kernel, "%%distributed --mixed-precision fp16\n1")
    assert "out of range" in _usage_error(kernel, "%%distributed --ranks 0,5\n1")
    assert "not a comma-separated list" in _usage_error(kernel, "%%distributed --ranks x\n1")
    assert "already running" in _usage_error(kernel, "%fleet start -n 2")
    assert "not a number" in _usage_error(kernel, "%%distributed --timeout soon\n1")
    reply, messages = kernel.execute("%%distributed\nworld_size")
    assert reply["status"] == "ok" and "2" in kernel.text(messages)


def test_push_pull_and_namespace(kernel):
    reply, _ = kernel.execute("base = 7\n%fleet push offset=base*2")
    assert reply["status"] == "ok"
    reply, _ = kernel.execute("%%distributed\nimport torch\nvalue = torch.tensor([offset + rank])")
    assert reply["status"] == "ok"
    reply, messages = kernel.execute("v = %fleet pull value --rank 1\nprint(v.tolist())")
    assert "[15]" in kernel.text(messages)
    reply, messages = kernel.execute("del value\n%fleet pull value --rank 0\nprint(value.tolist())")
    assert reply["status"] == "ok" and "[14]" in kernel.text(messages)  # pull binds the name in the kernel
    assert "NAME=EXPR" in _usage_error(kernel, "%fleet push 3")


TUNE_SETUP = """%%distributed
import torch

def build_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

def make_batch(size):
    return torch.randn(size, 8), torch.randn(size, 1)

def step(model, batch):
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])
"""


def test_fleet_tune_shows_a_table_and_the_next_cells_default_to_the_fastest(kernel):
    assert kernel.execute(TUNE_SETUP)[0]["status"] == "ok"
    assert "no micro-batch size divides" in _usage_error(
        kernel, "%fleet tune step --model build_model --batch make_batch --micro-batches 3 --global-batch 8")
    reply, messages = kernel.execute("%fleet tune step --model build_model --batch make_batch --micro-batches 4,16 "
                                     "--global-batch 32 --strategies ddp,fsdp --steps 2 --warmup 1")
    text = ANSI.sub("", kernel.text(messages))
    assert reply["status"] == "ok", text
    assert re.search(r"strategy +precision +micro-batch +accum +samples/s +peak memory +result", text), text
    best = re.search(r"(ddp|fsdp) +no +(4|16) +(4|1) +[0-9,.]+ +[0-9,]+ MiB +ok  <- fastest", text)
    assert best, text
    strategy, size, accum = best.groups()
    assert f"the next cells run with --strategy {strategy} --mixed-precision no --grad-accum {accum}" in text
    reply, messages = kernel.execute("%%distributed\nprint(accelerator.distributed_type.value, "
                                     "accelerator.gradient_accumulation_steps, micro_batch_size)")
    expected = f"{'FSDP' if strategy == 'fsdp' else 'MULTI_CPU'} {accum} {size}"
    assert f"[rank 1] {expected}" in kernel.text(messages)
    status = ANSI.sub("", kernel.text(kernel.execute("%fleet status")[1]))
    tuned = re.search(r"cell defaults \(from %fleet tune\): (.*)", status)
    differing = " ".join(([f"--strategy {strategy}"] if strategy != "ddp" else [])
                         + ([f"--grad-accum {accum}"] if accum != "1" else []))
    assert (tuned.group(1).strip() if tuned else "") == differing, status
    reply, messages = kernel.execute("%%distributed --strategy ddp --grad-accum 1\n"
                                     "print(accelerator.distributed_type.value, accelerator.gradient_accumulation_steps)")
    assert "[rank 0] MULTI_CPU 1" in kernel.text(messages), "a flag on the cell overrides the tuned default"
    kernel.execute("from workbench import current_fleet\nfrom workbench import CellOptions\n"
                   "current_fleet().cell_defaults = CellOptions()")


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def test_a_logging_cell_shows_the_dashboard_live_then_a_summary(kernel):
    code = "%%distributed\nimport time\nfor i in range(120):\n    workbench.log(loss=1 / (i + 1))\n    time.sleep(0.02)"
    reply, messages = kernel.execute(code)
    assert reply["status"] == "ok"
    views = [(t, m) for t, m in messages if m["msg_type"] == "display_data" and WIDGET_VIEW in m["content"]["data"]]
    assert len(views) == 1, "one dashboard view per cell"
    shown_at = views[0][0]
    summary_at = next(t for t, m in messages if m["msg_type"] == "stream" and "scalar" in m["content"]["text"])
    assert shown_at < summary_at - 0.3, "the dashboard appears while the cell runs"
    models = {m["content"]["comm_id"]: m["content"]["data"]["state"].get("_model_name")
              for _, m in messages if m["msg_type"] == "comm_open"}
    assert "FigureModel" in models.values() and "LinesModel" in models.values()
    updates = {}
    for t, m in messages:
        if m["msg_type"] == "comm_msg" and m["content"]["data"].get("method") == "update":
            updates.setdefault(m["content"]["comm_id"], []).append(t)
    line_updates = [ts for cid, ts in updates.items() if models.get(cid) == "LinesModel"]
    assert line_updates, "the curves were updated while the cell ran"
    duration = messages[-1][0] - shown_at
    assert max(len(ts) for ts in line_updates) <= 4.5 * duration + 3, "updates are coalesced to ~4 a second"
    streams = [m["content"]["text"] for _, m in messages if m["msg_type"] == "stream"]
    assert "scalar  rank  last" in streams[-1] and "loss" in streams[-1], "the output ends with the summary"
    assert re.search(r"loss\s+0\s+0\.008333\s+0\.008333", streams[-1]), streams[-1]


def test_metrics_magic(kernel):
    text = _help(kernel, "%metrics?")
    assert "--summary" in text and "workbench.log" in text
    reply, messages = kernel.execute("%metrics")
    assert reply["status"] == "ok"
    assert any(m["msg_type"] == "display_data" and WIDGET_VIEW in m["content"]["data"] for _, m in messages)
    reply, messages = kernel.execute("%metrics --summary")
    assert "scalar  rank  last" in kernel.text(messages)
    reply, messages = kernel.execute("%metrics --path")
    path = re.search(r"metrics:\s+(\S+metrics\.jsonl)", kernel.text(messages)).group(1)
    reply, messages = kernel.execute(f"print(sum(1 for _ in open({path!r})) >= 160)")
    assert "True" in kernel.text(messages)
    assert "unrecognized arguments" in _usage_error(kernel, "%metrics --bogus")


def test_checkpoint_magic(kernel):
    text = _help(kernel, "%checkpoint?")
    assert "%checkpoint save" in text and "--async" in text and "--to DIR|URL" in text and "restore [TAG|latest|PATH|URL]" in text
    setup = ("%%distributed --strategy fsdp\nimport torch\nmodel = torch.nn.Linear(8, 8)\n"
             "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
             "model, optimizer = accelerator.prepare(model, optimizer)")
    assert kernel.execute(setup)[0]["status"] == "ok"
    reply, messages = kernel.execute("%checkpoint save --tag magic-1")
    assert reply["status"] == "ok" and "checkpoint 'magic-1' saved" in kernel.text(messages)
    reply, messages = kernel.execute("%checkpoint list")
    rows = [line.split() for line in kernel.text(messages).splitlines()]
    assert rows[0][:2] == ["tag", "step"] and any(r[0] == "magic-1" and r[-1] == "complete" for r in rows[1:])
    reply, messages = kernel.execute("%checkpoint restore")
    assert "restored checkpoint 'magic-1'" in kernel.text(messages) and "model, optimizer" in kernel.text(messages)
    assert "complete checkpoints: magic-1" in _usage_error(kernel, "%checkpoint restore nope")
    assert "not a usable checkpoint tag" in _usage_error(kernel, "%checkpoint save --tag 'bad tag'")
    assert "needs a command" in _usage_error(kernel, "%checkpoint")
    reply, messages = kernel.execute("%checkpoint rm magic-1")
    assert "removed" in kernel.text(messages)
    assert "no checkpoint named 'magic-1'" in _usage_error(kernel, "%checkpoint rm magic-1")


def test_fleet_scale_replays_setup_cells(kernel):
    setup = ("%%distributed --setup\nimport torch\nmodel = torch.nn.Linear(4, 6)\n"
             "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
             "model, optimizer = accelerator.prepare(model, optimizer)")
    assert kernel.execute(setup)[0]["status"] == "ok"
    reply, messages = kernel.execute("%fleet scale 3")
    assert reply["status"] == "ok", kernel.text(messages)
    assert "scale 2→3: done" in kernel.text(messages) and "restored model, optimizer" in kernel.text(messages)
    reply, messages = kernel.execute("%%distributed\n(world_size, type(model).__name__)")
    assert "(3, 'DistributedDataParallel')" in kernel.text(messages)
    assert "already has 3 ranks" in _usage_error(kernel, "%fleet scale 3")
    reply, messages = kernel.execute("%fleet scale 2")
    assert reply["status"] == "ok" and "scale 3→2: done" in kernel.text(messages)


def test_failing_cell_raises_in_the_kernel_once_per_traceback(kernel):
    reply, messages = kernel.execute(
        "%%distributed\nimport torch.distributed as dist\n"
        "if rank == 0:\n    raise KeyError('missing column')\n"
        "dist.all_reduce(torch.ones(1))"
    )
    assert reply["status"] == "error"
    text = ANSI.sub("", kernel.text(messages))
    assert "KeyError on rank 0 of 2" in text
    assert text.count("raise KeyError('missing column')") == 1
    assert "rank 1 stopped" in text
    assert "magics.py" not in text and "execution.py" not in text  # no kernel-side traceback spam
    assert "replaced" not in text, text
    reply, messages = kernel.execute("%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
    assert reply["status"] == "ok" and "2.0" in kernel.text(messages), text + kernel.text(messages)[-1500:]


def test_percent_run_and_progress_bars_in_a_distributed_cell(kernel, tmp_path):
    """In a real kernel: %run runs the script on every rank (its output and exit code shown), a tqdm
    bar is one text line in rank 0's live block (no widget), rank 1's bar is not shown."""
    script = tmp_path / "job.py"
    script.write_text("import sys\nprint('job', __name__, sys.argv[1:])\nif sys.argv[1:] == ['fail']:\n"
                      "    sys.exit(7)\n")
    reply, messages = kernel.execute(f"%%distributed\n%run {script} a 1")
    text = kernel.text(messages)
    assert reply["status"] == "ok", text
    assert "[rank 0] job __main__ ['a', '1']" in text and "[rank 1] job __main__ ['a', '1']" in text
    reply, messages = kernel.execute(f"%%distributed\n%run {script} fail")
    assert reply["status"] == "error" and "rank 0,1 of 2 exited with code 7" in kernel.text(messages)

    reply, messages = kernel.execute("%%distributed\nfrom tqdm.auto import tqdm\nimport time\n"
                                     "for _ in tqdm(range(20), desc=f'bar{rank}', mininterval=0):\n"
                                     "    time.sleep(0.05)")
    assert reply["status"] == "ok"
    assert not [m for _, m in messages if "application/vnd.jupyter.widget-view+json" in
                m["content"].get("data", {})], "no widget: a rank is a batch process"
    blocks = [m["content"]["data"]["text/plain"] for _, m in messages
              if m["msg_type"] in ("display_data", "update_display_data")]
    assert re.search(r"\[rank 0 stderr\] bar0: 100%\|[^\n]*\| 20/20", blocks[-1] if blocks else ""), blocks
    assert all(block.count("bar0") <= 1 for block in blocks), "a bar is redrawn in place, never stacked"
    assert not any("bar1" in block for block in blocks)


def test_interrupting_the_kernel_stops_every_rank(kernel):
    reply, messages = kernel.execute(
        "%%distributed\nimport time\nif rank == 1:\n    time.sleep(120)\ndist.all_reduce(torch.ones(1))",
        interrupt_after=2.0,
        timeout=30,
    )
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    assert messages[-1][0] < 15
    reply, messages = kernel.execute("%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
    assert reply["status"] == "ok" and "2.0" in kernel.text(messages), kernel.text(messages)[-1500:]
    reply, _ = kernel.execute("%fleet stop")
    assert reply["status"] == "ok"


@pytest.mark.parametrize("line, shown", [
    ("%fleet -h", "usage: %fleet scale [--hosts HOST:N,...] n"),
    ("%fleet start --help", "number of engines (default: one per GPU, or 2 on CPU)"),
    ("%checkpoint save -h", "--keep-last"),
    ("%metrics -h", "--summary"),
    ("%fleet replace -h", "the ranks to swap for fresh engines"),
])
def test_dash_h_prints_help_generated_from_the_parser(kernel, line, shown):
    reply, messages = kernel.execute(line)
    assert reply["status"] == "ok" and shown in kernel.text(messages)


def test_distributed_help_flags_are_generated_and_typos_get_a_suggestion(kernel):
    reply, messages = kernel.execute("%%distributed --help\nprint('not run')")
    text = kernel.text(messages)
    assert reply["status"] == "ok" and "--fsdp-wrap" in text and "not run" not in text
    assert "did you mean '--strategy'?" in _usage_error(kernel, "%%distributed --strtegy fsdp\n1")
    from workbench.kernel.magics import WorkbenchMagics

    doc = WorkbenchMagics.fleet.__doc__  # what %fleet? shows
    assert "Flags (also: %fleet -h)" in doc and "warm engines kept ready outside the group" in doc


@pytest.mark.fleet
def test_unload_ext_stops_the_fleet_and_unregisters_the_magics():
    import psutil
    from conftest import Kernel

    kernel = Kernel()
    try:
        reply, _ = kernel.execute("%load_ext workbench\n%fleet start -n 1 --no-wandb")
        assert reply["status"] == "ok"
        reply, messages = kernel.execute(
            "from workbench import current_fleet\n"
            "print('pids', *[m.pid for m in current_fleet().members])")
        pids = [int(p) for p in kernel.text(messages).split("pids")[1].split()]
        reply, _ = kernel.execute("%unload_ext workbench")
        assert reply["status"] == "ok"
        procs = []
        for pid in pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=10)
        assert not alive, alive
        reply, _ = kernel.execute("%fleet status")
        assert reply["status"] == "error" and "not found" in reply["evalue"]
        reply, _ = kernel.execute("%load_ext workbench\n%fleet status")
        assert reply["status"] == "error" and "no fleet is running" in reply["evalue"]  # registered again
    finally:
        kernel.shutdown()


def test_the_whole_output_is_shown_at_the_end_even_when_the_last_live_tail_was_current(monkeypatch):
    """A rank that printed its last line before the last live refresh: that refresh showed a
    tail of the same text; the end must still show every line (it once kept the tail)."""
    import IPython.display

    from workbench.kernel import output

    shown = []

    class Handle:
        def update(self, bundle, raw):
            shown.append(bundle["text/plain"])

    def display(bundle, raw, display_id):
        shown.append(bundle["text/plain"])
        return Handle()

    monkeypatch.setattr(IPython.display, "display", display)
    text = "".join(f"line {i} {'x' * 60}\n" for i in range(2000))
    block = output.RankOutput([0], live_blocks=True)
    block.update({0: (text, "")})  # live: a tail
    block.update({0: (text, "")}, force=True)  # the end, same text
    assert "earlier lines" in shown[0] and len(shown) == 2
    assert shown[-1].count("\n") == 2000 and "line 0 " in shown[-1]
