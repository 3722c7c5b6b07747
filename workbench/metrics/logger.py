"""Engine side: ``workbench.log`` and the background sender.

``log()`` only appends a tuple to a bounded in-memory buffer; a daemon thread
wakes every ``SEND_EVERY_S``, encodes what accumulated and pushes it to the
kernel's collector over a zmq PUSH socket (ordered and lossless over one
connection). Every ``BEAT_EVERY_S`` a message goes even without records: the
rank's heartbeat, with an activity counter (records, forward calls,
collectives launched) and, once that counter has stalled, the main thread's
stack, so the kernel can tell a hung rank and say where it is stuck.
When the kernel does not keep up, zmq's high-water mark makes the
non-blocking send fail; the records then stay in the buffer, and once the
buffer is full the oldest are dropped and counted, so the training loop never
waits for the kernel.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
from numbers import Number

from workbench.links import CutOrders
from workbench.messages import Beat, MetricsMessage, sign
from workbench.metrics.comm import CommClock
from workbench.metrics.gpu import GpuProbe

MAX_BUFFERED = 50_000  # records kept while the kernel is not reading
MAX_BATCH = 2_000  # records per message
SEND_EVERY_S = 0.2  # batching interval: latency floor vs. CPU taken from training (ends of cells flush at once)
BACKWARD_FILE = "autograd/graph.py"  # torch.autograd.graph._engine_run_backward: where DDP waits for its all-reduce
DDP_FILE = "nn/parallel/distributed.py"  # DDP's forward calls its collectives (bucket rebuild, buffer sync) in C++
SEND_HWM = 32  # messages zmq queues before a send would block
BEAT_EVERY_S = 1.0  # heartbeat interval (a message goes at least this often)
STACK_AFTER_S = 2.0  # a stalled rank adds its main thread's stack to its heartbeats


class MetricsLogger:
    """One per engine process: the step counter, the buffer and the sender."""

    def __init__(self) -> None:
        self.step = 0  # steps completed so far (``workbench.step``): optimizer steps, else log records
        self.optimizer_driven = False  # an optimizer was prepared: only its steps count
        self._not_counting = 0  # inside checkpoint code whose optimizer steps are not training steps
        self._stepped_step = 0  # the step index of the measurements in ``_stepped``
        self._forward_since_step = False
        self._trained_since_record = False  # a forward or an optimizer step since the last record
        self._last_label = -1  # the step of the last record
        self.seq = 0  # records created by this process
        self.sent_seq = 0  # records handed to zmq
        self.dropped = 0
        self.pushed_back = 0  # sends refused because the kernel was behind
        self.send_error: str | None = None  # the last exception while building a message
        self.total: int | None = None
        self.cells = 0  # cells (and functions) this process has run; heartbeats say which one
        self.activity = 0  # records and forward calls; with collectives launched, the heartbeat's progress
        self.comm = CommClock()
        self.flops_per_token: float | None = None  # set by workbench.llm.track_mfu
        self.peak_flops: float | None = None
        self._buffer: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._flush = threading.Event()
        self._thread: threading.Thread | None = None
        self._address: str | None = None
        self._key = b""  # the run's key: each message is signed with it
        self.cut_links: list[str] = []  # connections to lost hosts this process shut down
        self._suspended = False
        self.cell_started()

    # ------------------------------------------------------------ training thread
    def cell_started(self, stop_on_nan: bool = False) -> None:
        """A new cell: its first step is measured from now (``stop_on_nan``: a NaN or infinite
        value logged in it raises)."""
        self.stop_on_nan = stop_on_nan
        self._interval_start = time.perf_counter()
        self._cell_activity = self.activity + self.comm.launched
        self.cells += 1
        self.total = None  # workbench.progress(total=) belongs to the cell that set it
        self._samples = 0
        self._stepped: dict | None = None  # measurements of an optimizer step not yet logged
        self.comm.restart()

    def cell_finished(self) -> None:
        self._emit_stepped()

    def log(self, step: int | None = None, scalars: dict | None = None) -> None:
        scalars = _checked(scalars or {})
        if self._stepped is not None:  # logged after optimizer.step(): that step's measurements
            system, self._stepped = self._stepped, None
            self._add_rates(system, scalars)
            if step is None and self.optimizer_driven and not self._forward_since_step:
                step = self._stepped_step  # the step that just completed
        else:
            system = self._measure(scalars)
        self._record(step, scalars, system)
        if self.stop_on_nan:
            self._raise_if_not_finite(scalars)

    def _raise_if_not_finite(self, scalars: dict) -> None:
        """--stop-on-nan: a FloatingPointError naming the first NaN or infinite value (the record
        was sent first, so the kernel's summary and panel show it too)."""
        import math

        from workbench.rank_state import STATE

        for name, value in scalars.items():
            number = float(value.item() if hasattr(value, "item") else value)
            if not math.isfinite(number):
                rank = STATE.spec.rank if STATE.spec else 0
                raise FloatingPointError(f"{name} is {number} at step {self._last_label} on rank {rank} "
                                         "(--stop-on-nan)")

    def optimizer_stepped(self) -> None:
        """End of a training step: ``workbench.step`` counts it, the dataloaders' positions
        advance past the batches it used, and its measurements join the next ``log`` call, if
        one comes before the next step, or become a record of their own."""
        if self._not_counting:
            return
        self._emit_stepped()
        self._stepped = self._measure({})
        if not self._suspended:
            from workbench.data_position import step_completed

            self._stepped_step = self.step
            self.step += 1
            step_completed()
        self._forward_since_step = False
        self._trained_since_record = True

    def optimizer_prepared(self) -> None:
        """``accelerator.prepare`` returned an optimizer: from now on its steps are the steps, and
        dataloader positions advance at them."""
        from workbench.data_position import optimizer_prepared

        self.optimizer_driven = True
        optimizer_prepared()

    @contextlib.contextmanager
    def not_counting(self):
        """Optimizer steps inside are not training steps (DCP creates empty optimizer state
        with a step of zero gradients)."""
        self._not_counting += 1
        try:
            yield
        finally:
            self._not_counting -= 1

    def samples_seen(self, n: int) -> None:
        self._samples += n
        self.activity += 1
        self._forward_since_step = self._trained_since_record = True

    def _emit_stepped(self) -> None:
        if self._stepped is not None:
            system, self._stepped = self._stepped, None
            self._record(self._stepped_step if self.optimizer_driven else None, {}, system)

    def _measure(self, scalars: dict) -> dict:
        now = time.perf_counter()
        interval = now - self._interval_start or 1e-9
        comm = self.comm.take(now)
        system = {"step_time_s": interval} if comm is None else {"step_time_s": interval, "comm_s": comm}
        if self._samples:
            system["samples_per_s"] = self._samples / interval
        if "samples" in scalars or "tokens" in scalars:
            self._add_rates(system, scalars)
        self._interval_start, self._samples = now, 0
        return system

    def _add_rates(self, system: dict, scalars: dict) -> None:
        """Throughput from the counts the user logged for this step (``samples=``, ``tokens=``),
        and MFU once :func:`workbench.llm.track_mfu` said the FLOPs per token."""
        interval = system["step_time_s"]
        if scalars.get("samples"):
            system["samples_per_s"] = scalars["samples"] / interval
        if "tokens" in scalars:
            system["tokens_per_s"] = scalars["tokens"] / interval
            if self.flops_per_token and self.peak_flops:
                system["mfu"] = system["tokens_per_s"] * self.flops_per_token / self.peak_flops

    @contextlib.contextmanager
    def suspended(self):
        """Nothing measured inside is recorded (``workbench.tune``'s trials): ``workbench.step``
        and the run's metrics stay as they were; the next step is timed from the end."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False
            self._stepped, self._samples, self._interval_start = None, 0, time.perf_counter()
            self.comm.restart()

    def _record(self, step: int | None, scalars: dict, system: dict) -> None:
        if self._suspended:
            self.activity += 1  # still progress for the hang watch
            return
        if step is None:
            # the step in flight; with no training since the last record (a loop that only logs),
            # the step after the last record's, so such records stay apart and in order
            # (never below the counter: a rank whose step was restored has no record of its own yet)
            step = self.step if self._trained_since_record or not self.optimizer_driven else \
                max(self._last_label + 1, self.step)
        else:
            step = int(step)
        if not self.optimizer_driven:  # no optimizer: each record is a step
            self.step = step + 1
        self._last_label, self._trained_since_record = step, False
        self.seq += 1
        self.activity += 1
        buffer = self._buffer
        with self._lock:
            if len(buffer) >= MAX_BUFFERED:
                buffer.popleft()
                self.dropped += 1
            buffer.append((time.time(), self.seq, step, scalars, system))

    # ------------------------------------------------------------ sender
    def attach(self, address: str, key: str) -> None:
        """Send records to the collector at ``address``, signed with ``key`` (the run's; hex)
        (the sender thread starts once per process)."""
        self._address, self._key = address, bytes.fromhex(key)
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._send_loop, name="workbench-metrics", daemon=True)
            self._thread.start()

    def flush(self, timeout: float = 2.0) -> int:
        """Wait (bounded) until every record so far is handed to zmq; return the last seq."""
        target = self.seq
        if self._thread is None:
            return self.sent_seq
        self._flush.set()
        deadline = time.monotonic() + timeout
        while self.sent_seq < target and time.monotonic() < deadline:
            time.sleep(0.002)
        return self.sent_seq

    def _send_loop(self) -> None:
        import zmq

        context = zmq.Context()
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        socket.setsockopt(zmq.LINGER, 1000)
        connected = self._address
        socket.connect(connected)
        self._last_sent = 0.0
        self._pulse = _Pulse()
        cuts = CutOrders()
        while True:
            self._flush.wait(SEND_EVERY_S)
            self._flush.clear()
            try:
                self._carry_out_cuts(cuts)
                if self._address != connected:  # attached to another fleet's run (engines of an ipcluster)
                    socket.disconnect(connected)
                    connected = self._address
                    socket.connect(connected)
                while self._send_batch(socket, zmq):
                    pass
            except Exception as exc:  # the sender (and with it the heartbeat) must outlive any one message
                self.send_error = f"{type(exc).__name__}: {exc}"
    def _carry_out_cuts(self, cuts: CutOrders) -> None:
        """A host was lost: links to it are cut, so that a collective waiting on it ends now
        (this thread runs while the main thread waits; :mod:`workbench.links`)."""
        from workbench.rank_state import STATE

        if cut := cuts.check(STATE.run_dir):
            self.cut_links += cut

    def _send_batch(self, socket, zmq) -> bool:
        now = time.monotonic()
        if not self._buffer and now - self._last_sent < BEAT_EVERY_S:
            return False
        from workbench.rank_state import STATE

        cell = self.cells
        beat = self._pulse.beat(self.activity + self.comm.launched, self._cell_activity, STATE.in_user_code, now,
                                self.comm.ddp_syncing())
        beat["cell"] = cell
        memory = _memory()
        with self._lock:
            batch = [self._buffer.popleft() for _ in range(min(MAX_BATCH, len(self._buffer)))]
            dropped = self.dropped
        message = MetricsMessage(
            pid=os.getpid(), rank=STATE.spec.rank if STATE.spec else None, dropped=dropped,
            total=self.total, memory=memory, beat=beat,
            records=[[t, seq, step, _plain(scalars), _plain(system)] for t, seq, step, scalars, system in batch],
        )
        try:
            data = _encode(message)
            socket.send_multipart([sign(self._key, data), data], zmq.NOBLOCK)
        except zmq.Again:  # the kernel is behind: keep the records, try again later
            self.pushed_back += 1
            with self._lock:
                self._buffer.extendleft(reversed(batch))
                while len(self._buffer) > MAX_BUFFERED:
                    self._buffer.popleft()
                    self.dropped += 1
            time.sleep(SEND_EVERY_S)
            return False
        self._last_sent = now
        if not batch:
            return False
        self.sent_seq = batch[-1][1]
        return True


class _Pulse:
    """The heartbeat's content. ``stalled_s``: while user code runs and has made
    progress in this cell, the seconds since the activity counter last moved (else
    None); with it, once it reaches ``STACK_AFTER_S``, the main thread's stack.
    ``busy``: a cell's user code is running. ``waiting_in``: the torch.distributed
    call the main thread is inside (``torch.distributed.all_reduce``, ...), or a backward
    that ends in DDP's gradient all-reduce, with ``waiting_s`` the seconds it has been
    there with nothing moving (no new activity, no byte through the collectives' threads),
    and its stack."""

    def __init__(self) -> None:
        self.activity = -1
        self.changed_at = 0.0
        # ((id of the torch.distributed frame, activity, bytes moved), since): a frame id is reused from
        # step to step, so the same id with new activity (a forward, a step, a collective launched) is a new
        # wait; and a collective whose bytes still flow (a thin link) is progressing, not stuck
        self.waiting: tuple[tuple[int, int, int], float] | None = None

    def beat(self, activity: int, at_cell_start: int, in_user_code: bool, now: float,
             ddp_syncing: bool = False) -> Beat:
        if activity != self.activity:
            self.activity, self.changed_at = activity, now
        stalled = now - self.changed_at if in_user_code and activity != at_cell_start else None
        frame = _main_thread_frame() if in_user_code else None
        call, label = _distributed_call(frame, ddp_syncing)
        if call is None:
            self.waiting = None
        else:
            key = (id(call), activity, _collective_bytes())
            if self.waiting is None or self.waiting[0] != key:
                self.waiting = (key, now)
        waiting_s = now - self.waiting[1] if self.waiting else None
        wants_stack = (stalled is not None and stalled >= STACK_AFTER_S) or (waiting_s or 0.0) >= STACK_AFTER_S
        stack = _stack(frame) if wants_stack else None
        return Beat(stalled_s=stalled, stack=stack, busy=in_user_code,
                    waiting_in=label, waiting_s=waiting_s)


def _collective_bytes() -> int:
    """Bytes read and written so far by this process's native threads that are not ZeroMQ's:
    gloo's transport and run-loop threads (the kernel's messages go through ZeroMQ's threads,
    Python's own threads are left out). NCCL moves no bytes through system calls: 0 moves there."""
    import os

    python_threads = {thread.native_id for thread in threading.enumerate()}
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # not Linux
        return 0
    for tid in tasks:
        if int(tid) in python_threads:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().startswith("ZMQbg"):
                    continue
            with open(f"/proc/self/task/{tid}/io") as io:
                for line in io:
                    if line.startswith(("rchar", "wchar")):
                        total += int(line.split()[1])
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return total


def _main_thread_frame():
    import sys

    return sys._current_frames().get(threading.main_thread().ident)


def _distributed_call(frame, ddp_syncing: bool = False) -> tuple:
    """(frame, label) of the collective the main thread waits in, or (None, None): the
    outermost frame of torch.distributed's c10d module on ``frame``'s stack (the collective
    user code called); DDP's own Python code as the innermost frame (its forward runs its
    collectives in C++); or, with ``ddp_syncing`` (a DDP model will all-reduce its gradients),
    autograd's backward: DDP's reducer waits for that all-reduce inside it, in C++."""
    innermost, found, backward = frame, None, None
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.endswith("distributed_c10d.py"):
            found = frame
        elif found is not None and not filename.endswith("c10d_logger.py"):  # its decorator's wrapper
            break
        elif ddp_syncing and frame.f_code.co_name == "_engine_run_backward" and filename.endswith(BACKWARD_FILE):
            backward = frame
        frame = frame.f_back
    if found is not None:
        return found, f"torch.distributed.{found.f_code.co_name}"
    if innermost is not None and innermost.f_code.co_filename.endswith(DDP_FILE):
        return innermost, f"DDP's {innermost.f_code.co_name} (its collectives)"
    if backward is not None:
        return backward, "backward (DDP's gradient all-reduce)"
    return None, None


def _stack(frame, limit: int = 8) -> str | None:
    import traceback

    return "".join(traceback.format_stack(frame, limit=limit)) if frame is not None else None


def _checked(scalars: dict) -> dict:
    """``scalars`` checked (real numbers or one-element real tensors); tensors detached. Plain
    floats, the common case, cost one type check each (this runs on the training thread)."""
    tensors = False
    for name, value in scalars.items():
        kind = type(value)
        if kind is float:
            continue
        if isinstance(value, Number) and not isinstance(value, complex):
            try:
                float(value)
            except (OverflowError, ValueError, TypeError):
                raise TypeError(f"workbench.log({name}=...) takes real numbers a float can hold, got "
                                f"{kind.__name__} {str(value)[:40]}") from None
        elif not _is_scalar_tensor(value) or value.is_complex():
            raise TypeError(f"workbench.log({name}=...) takes real numbers or one-element real tensors, "
                            f"got {kind.__name__}" + (" (complex)" if _is_scalar_tensor(value) else ""))
        else:
            tensors = True
    if not tensors:
        return scalars
    return {name: (value.detach() if hasattr(value, "detach") else value) for name, value in scalars.items()}


def _is_scalar_tensor(value) -> bool:
    return hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1


def _encode(message: MetricsMessage) -> bytes:
    """orjson, a tenth of the json module's time, unless a value is NaN or infinite (orjson would
    write null; the json module writes NaN and Infinity, which the kernel reads back as they were)."""
    import orjson

    for record in message["records"]:
        for values in (record[3], record[4]):
            for value in values.values():
                if value - value != 0:  # NaN or ±inf (x - x is 0 for every finite number)
                    return json.dumps(message).encode()
    try:
        return orjson.dumps(message)
    except TypeError:  # what orjson refuses (an int beyond 64 bits)
        return json.dumps(message).encode()


def _plain(scalars: dict) -> dict:
    """JSON-ready numbers; tensors are read here, off the training thread."""
    if all(type(value) is float for value in scalars.values()):
        return scalars
    out = {}
    for name, value in scalars.items():
        value = value.item() if hasattr(value, "item") else value
        out[name] = value if isinstance(value, (int, float)) else float(value)
    return out


def _memory() -> dict:
    import sys

    memory = {"rss_mb": _this_process().memory_info().rss / 2**20}
    cuda = getattr(sys.modules.get("torch"), "cuda", None)  # torch may be half-imported by the main thread
    if cuda is not None and cuda.is_available() and cuda.is_initialized():
        memory["cuda_max_mb"] = cuda.max_memory_allocated() / 2**20
        memory.update(_GPU.sample(cuda))
    return memory


def _this_process():
    """psutil's handle on this process, made once per process (engines are forked)."""
    import psutil

    global _PROCESS
    if _PROCESS is None or _PROCESS.pid != os.getpid():
        _PROCESS = psutil.Process()
    return _PROCESS


_PROCESS = None
_GPU = GpuProbe()
LOGGER = MetricsLogger()


def log(step: int | None = None, **scalars) -> None:
    """Record scalars for this rank's current step; never blocks training.

    ``workbench.log(loss=loss.item(), lr=lr)``. Without ``step=``, the record belongs to the
    optimizer step just completed (logged after ``optimizer.step()``) or in flight; with no
    prepared optimizer, steps count up by one per call (log once per training step). Values are numbers or
    one-element tensors (read in the background). ``samples=`` or ``tokens=``
    (counts in this step) turn into throughput. Step time, communication time
    and memory are added by workbench.
    """
    LOGGER.log(step, scalars)


CONFIG_VALUE = (str, int, float, bool, type(None))


def config(**values) -> None:
    """Record the run's configuration (``workbench.config(lr=3e-4, batch=32)``) in ``run.json``
    and wandb's config; on a rank or in the kernel. Values are strings, numbers, booleans or
    None (lists and tuples of them too)."""
    for name, value in values.items():
        items = value if isinstance(value, (list, tuple)) else [value]
        if not all(isinstance(v, CONFIG_VALUE) for v in items):
            raise TypeError(f"workbench.config({name}=...) takes a string, number, bool or None (or a list of them), "
                            f"got {type(value).__name__}")
    PENDING_CONFIG.update({k: list(v) if isinstance(v, tuple) else v for k, v in values.items()})


PENDING_CONFIG: dict = {}  # workbench.config values not yet taken into the run's record


def take_config() -> dict:
    """The config recorded since the last call (the kernel merges each rank's after a cell)."""
    taken = dict(PENDING_CONFIG)
    PENDING_CONFIG.clear()
    return taken


def progress(total: int) -> None:
    """Tell the dashboard how many steps this run will take (for the progress bar and ETA)."""
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise TypeError(f"workbench.progress(total=...) takes a whole number of steps, got {total!r}")
    LOGGER.total = total
