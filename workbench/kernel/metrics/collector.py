"""Kernel side: receive the ranks' records while cells run, and fan them out.

Each engine's sender pushes JSON batches over zmq (PUSH → one PULL socket
here). ipyparallel's ``publish_data`` was not used: it keeps only the latest
value per key and the hub does not keep it, while the dashboard, the metrics
file and wandb need every record, in order. A PUSH/PULL pipe over one
connection per engine is ordered and lossless while both ends live, needs no
extra service, and batches cheaply. The socket is a Unix socket (``ipc://``)
in the fleet's private runtime folder; only a fleet with engines on other hosts
(``network=True``) also listens on TCP, as its controller does. Every message is
signed with the run's key (HMAC-SHA256, given to the engines over ipyparallel's
signed channel): one without a valid signature is dropped and counted.

A receiver thread adds records to the :class:`MetricsStore` and hands them to the
run's sinks (:mod:`.sinks`: ``metrics.jsonl``, wandb, TensorBoard, ...) as they come.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import threading
import time

import orjson

from workbench.kernel.metrics.sinks import JSONL_NAME, Sink, SinkPaused
from workbench.kernel.metrics.store import MetricsStore
from workbench.links import route_address
from workbench.messages import sign

RECEIVE_HWM = 64  # messages queued here before the senders feel back-pressure


def _decode(raw: bytes):
    """A sender's message: orjson, or the json module for one that holds NaN or Infinity
    (standard JSON has neither; the ranks write them only then)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


class MetricsCollector:
    """The kernel's end of the metrics pipe for one fleet run."""

    def __init__(self, run_dir: str, runtime_dir: str, sinks: list[Sink] = (), network: bool = False) -> None:
        import zmq

        self.run_dir = run_dir
        self.key = secrets.token_hex(32)  # the senders sign each message with it
        self._key = bytes.fromhex(self.key)
        self.rejected = 0  # messages dropped for a bad signature
        self.store = MetricsStore(spill_path=os.path.join(run_dir, JSONL_NAME))  # old records come back from there
        self.sinks = list(sinks)
        self.errors: list[str] = []
        self._paused_notices: list[str] = []
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        self.address = f"ipc://{os.path.join(runtime_dir, 'metrics.sock')}"
        self._socket.bind(self.address)
        self.port = self._socket.bind_to_random_port("tcp://*") if network else None
        self._stopping = threading.Event()
        self._wake_read, self._wake_write = os.pipe()  # flush() wakes the receiver at once, not after its poll
        os.set_blocking(self._wake_write, False)
        self._flush_wanted = threading.Event()
        self._flushed = threading.Event()
        self._thread = threading.Thread(target=self._receive_loop, name="workbench-collector", daemon=True)
        self._thread.start()

    def _receive_loop(self) -> None:
        """The only thread that touches the sinks: a slow sink never blocks the kernel. It outlives any
        one message or sink: the heartbeats it takes in tell the kernel which ranks are alive."""
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        while not self._stopping.is_set():
            try:
                self._receive_once(poller, zmq)
            except Exception as exc:
                self.errors.append(f"metrics receiver: {type(exc).__name__}: {exc}")
                time.sleep(0.05)

    def _receive_once(self, poller, zmq) -> None:
        ready = dict(poller.poll(50))
        if self._wake_read in ready:
            os.read(self._wake_read, 4096)
        if self._socket in ready:
            while True:
                try:
                    frames = self._socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) == 2 and hmac.compare_digest(frames[0], sign(self._key, frames[1])):
                    self._ingest(frames[1])
                else:
                    self.rejected += 1
                    if self.rejected == 1:
                        self.errors.append("metrics: a message without a valid signature was ignored (not from "
                                           "this fleet's ranks)")
        if self._flush_wanted.is_set():
            self._flush_wanted.clear()
            self._each_sink("flush")
            self._flushed.set()

    def _ingest(self, raw: bytes) -> None:
        try:
            message = _decode(raw)
            records = self.store.add(message, time.time())
        except (ValueError, KeyError, TypeError) as exc:
            self.errors.append(f"a malformed metrics message was ignored ({exc})")
            return
        if records:  # a heartbeat alone has none
            self._each_sink("write", records)

    def _each_sink(self, method: str, *args) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except SinkPaused as exc:  # it keeps its data and tries again: say so once per kind of trouble
                if str(exc).split(";")[0] not in {e.split(";")[0] for e in self._paused_notices}:
                    self.errors.append(str(exc))
                    self._paused_notices.append(str(exc))
            except Exception as exc:  # a sink must not stop the others (or the pipe)
                self.errors.append(f"{type(sink).__name__} stopped: {type(exc).__name__}: {exc}")
                self.sinks.remove(sink)

    def address_for(self, host: str, local: bool) -> str:
        """Where an engine on ``host`` sends: the Unix socket on this host (``local``), else TCP on
        the address of the interface that routes to ``host``."""
        if local or self.port is None:
            return self.address
        return f"tcp://{route_address(host)}:{self.port}"

    def flush(self, timeout: float = 2.0) -> bool:
        """End of a cell: have the receiver push what it has to the sinks (bounded wait)."""
        self._flushed.clear()
        self._flush_wanted.set()
        try:
            os.write(self._wake_write, b"f")
        except BlockingIOError:
            pass  # wake-ups already pending
        return self._flushed.wait(timeout)

    def take_errors(self) -> list[str]:
        errors, self.errors = self.errors, []
        return errors

    def close(self) -> None:
        """Stop receiving and close the sinks (wandb finishes its run here)."""
        self._stopping.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # stuck in a sink: leave it to die with the process
            self.errors.append("the metrics receiver did not stop within 5 s")
            return
        self._socket.close()
        self._context.term()
        os.close(self._wake_read)
        os.close(self._wake_write)
        self._each_sink("close")
        self.sinks = []
