"""The lab panel's kernel side (workbench.kernel.panel) in a real kernel, over the messaging
protocol: state and metrics over the comm while a cell runs, one comm per browser tab."""

from __future__ import annotations

import queue
import time
import uuid

import pytest
from conftest import Kernel


class PanelClient:
    """A panel's end of the comm, reading every iopub message of the kernel."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel, self.kc = kernel, kernel.kc
        self.comms: dict[str, list[dict]] = {}
        self.closed: set[str] = set()
        self.read: dict[str, int] = {}  # comm id -> messages already matched past

    def open(self, client: str) -> str:
        comm_id = uuid.uuid4().hex
        self.comms[comm_id], self.read[comm_id] = [], 0
        self.kc.shell_channel.send(self.kc.session.msg(
            "comm_open", {"comm_id": comm_id, "target_name": "workbench.panel", "data": {"client": client}}))
        return comm_id

    def execute(self, code: str) -> str:
        """Send ``code`` without waiting, so the comm can be read while it runs."""
        return self.kc.execute(code)

    def reply(self, msg_id: str, timeout: float = 60) -> dict:
        while True:
            msg = self.kc.get_shell_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg["content"]

    def drain(self, seconds: float = 0.1) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                continue
            content = msg["content"]
            if msg["msg_type"] == "comm_msg" and content["comm_id"] in self.comms:
                self.comms[content["comm_id"]].append(content["data"])
            elif msg["msg_type"] == "comm_close":
                self.closed.add(content["comm_id"])

    def wait_for(self, comm_id: str, predicate, timeout: float = 60) -> dict:
        """The first message after the last one matched on this comm that fits ``predicate``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.drain()
            messages = self.comms[comm_id]
            for index in range(self.read[comm_id], len(messages)):
                if predicate(messages[index]):
                    self.read[comm_id] = index + 1
                    return messages[index]
        raise AssertionError(f"no such message; the last ones: {self.comms[comm_id][-2:]}")


@pytest.fixture(scope="module")
def panel():
    kernel = Kernel()
    reply, _ = kernel.execute("%load_ext workbench")
    assert reply["status"] == "ok"
    yield PanelClient(kernel)
    kernel.shutdown()


def _state(data) -> bool:
    return data["type"] == "state"


def _all_engines(state: str):
    return lambda d: _state(d) and d["engines"] and all(e["state"] == state for e in d["engines"])


def test_state_and_metrics_stream_while_a_cell_runs(panel):
    comm = panel.open("tab-1")
    first = panel.wait_for(comm, _state)
    assert first["running"] is False and first["engines"] == []

    panel.execute("%fleet start -n 2 --no-wandb")
    state = panel.wait_for(comm, lambda d: _all_engines("idle")(d) and len(d["engines"]) == 2, timeout=120)
    assert [e["rank"] for e in state["engines"]] == [0, 1] and state["world_size"] == 2
    assert all(e["memory_mb"] > 50 for e in state["engines"])

    # the kernel's main thread is in this cell for 4 s: the panel still hears about it
    panel.execute("%%distributed\nimport time\nfor i in range(40):\n    workbench.log(loss=1.0 / (i + 1))\n"
                  "    time.sleep(0.1)")
    busy = panel.wait_for(comm, _all_engines("busy"))
    points = panel.wait_for(comm, lambda d: d["type"] == "metrics" and len(d["points"]) > 0)
    assert points["run"] == busy["run"]
    rank, step, _time, scalars, _throughput, step_time = points["points"][0]
    assert rank in (0, 1) and "loss" in scalars and step_time > 0
    panel.wait_for(comm, _all_engines("idle"))
    before_idle = panel.comms[comm][:panel.read[comm] - 1]
    streamed = [d for d in before_idle if d["type"] == "metrics" and d["points"]]
    assert streamed, "metrics only arrived after the cell"

    # the same tab again (a reload): the old comm is closed, the new one gets the whole run
    again = panel.open("tab-1")
    panel.wait_for(again, _state)  # a new comm gets the state first, then the history
    history = panel.wait_for(again, lambda d: d["type"] == "metrics")
    assert comm in panel.closed
    assert len(history["points"]) == 80 and {p[0] for p in history["points"]} == {0, 1}

    stop = panel.execute("%fleet stop")
    stopped = panel.wait_for(again, lambda d: _state(d) and not d["running"], timeout=60)
    assert stopped["engines"] == [] and stopped["run"] == busy["run"]  # the last run stays shown
    assert panel.reply(stop)["status"] == "ok"
