"""``workbench.step`` and the steps of records, by hand (no fleet): optimizer steps count, once each,
however often and wherever ``workbench.log`` is called; checkpoint code's empty steps never count."""

from __future__ import annotations

from workbench.metrics.logger import MetricsLogger


def _trainer() -> MetricsLogger:
    """A rank's logger once ``accelerator.prepare`` returned an optimizer."""
    logger = MetricsLogger()
    logger.optimizer_prepared()
    return logger


def _labels(logger: MetricsLogger) -> list[int]:
    return [record[2] for record in logger._buffer]


def test_log_after_the_step_labels_the_completed_step():
    logger = _trainer()
    for _ in range(3):
        logger.samples_seen(8)  # forward
        logger.optimizer_stepped()
        logger.log(None, {"loss": 1.0})
    assert logger.step == 3 and _labels(logger) == [0, 1, 2]


def test_log_before_the_step_labels_the_step_in_flight():
    logger = _trainer()
    for _ in range(3):
        logger.samples_seen(8)
        logger.log(None, {"loss": 1.0})
        logger.optimizer_stepped()
    logger.cell_finished()
    assert logger.step == 3 and [r[2] for r in logger._buffer if r[3]] == [0, 1, 2]


def test_no_log_counts_each_step_at_once_and_dcp_steps_do_not_count():
    logger = _trainer()
    for n in range(1, 6):
        logger.samples_seen(8)
        logger.optimizer_stepped()
        assert logger.step == n  # not one behind
    with logger.not_counting():
        logger.optimizer_stepped()  # DCP creating empty optimizer state
    assert logger.step == 5


def test_two_logs_in_one_step_still_count_one_step():
    logger = _trainer()
    for _ in range(4):
        logger.samples_seen(8)
        logger.optimizer_stepped()
        logger.log(None, {"loss": 1.0})
        logger.log(None, {"grad_norm": 2.0})
    assert logger.step == 4


def test_without_an_optimizer_each_record_is_a_step_and_explicit_steps_go_on_from_there():
    logger = MetricsLogger()
    for _ in range(3):
        logger.log(None, {"x": 1})
    logger.log(1000, {"x": 1})
    logger.log(None, {"x": 1})
    assert _labels(logger) == [0, 1, 2, 1000, 1001] and logger.step == 1002


def test_a_loop_that_only_logs_after_training_keeps_its_records_apart():
    logger = _trainer()
    logger.samples_seen(8)
    logger.optimizer_stepped()
    logger.log(None, {"loss": 1.0})
    for _ in range(3):
        logger.log(None, {"eval": 1.0})
    assert _labels(logger) == [0, 1, 2, 3] and logger.step == 1


def test_a_rank_whose_step_was_restored_labels_its_first_record_with_that_step():
    """A rank added by a scale (or replaced by a recover) gets the step from the checkpoint or a
    survivor; a log before any training labels that step, as the survivors' logs do (it said 0)."""
    logger = _trainer()
    logger.step = 20  # restored (workbench.rank.engine.set_step, checkpoint restore)
    logger.log(None, {"loss": 1.0})
    logger.log(None, {"loss": 1.0})
    assert _labels(logger) == [20, 21]


def test_a_collective_wait_restarts_when_the_rank_makes_progress(monkeypatch):
    """Was: the wait clock was keyed on the collective frame's id, which the next step reuses, so
    a slow link summed many steps' waits into one (a false MismatchedCollective after 32 s of DDP
    steps on 50 Mbit/s). Now a wait lasts only while nothing else happens on the rank."""
    from workbench.metrics import logger

    frame = object()  # the same frame id, step after step
    monkeypatch.setattr(logger, "_main_thread_frame", lambda: frame)
    monkeypatch.setattr(logger, "_distributed_call", lambda f, ddp=False: (frame, "backward (DDP's gradient all-reduce)"))
    monkeypatch.setattr(logger, "_stack", lambda f: "its stack")
    monkeypatch.setattr(logger, "_collective_bytes", lambda: 1000)
    pulse = logger._Pulse()
    waits = [pulse.beat(activity, 0, True, now=float(now))["waiting_s"]
             for now, activity in enumerate([5, 6, 7, 8, 9])]  # a bucket launched or a step done each second
    assert waits == [0.0] * 5
    waits = [pulse.beat(9, 0, True, now=float(now))["waiting_s"] for now in range(5, 40, 10)]
    assert waits == [1.0, 11.0, 21.0, 31.0], "a wait with no progress still counts up (a real mismatch)"


def test_a_collective_whose_bytes_still_flow_is_not_waiting(monkeypatch):
    """Was: one backward of DDP over a 50 Mbit/s link lasted longer than the mismatch rule's 5 s,
    so the ranks still receiving the cell's last all-reduce were called stuck as soon as a faster
    peer finished. Bytes moving through the collectives' threads restart the wait clock."""
    from workbench.metrics import logger

    frame = object()
    moved = iter([0, 10, 20, 30, 40, 40, 40, 40])
    monkeypatch.setattr(logger, "_main_thread_frame", lambda: frame)
    monkeypatch.setattr(logger, "_distributed_call", lambda f, ddp=False: (frame, "backward (DDP's gradient all-reduce)"))
    monkeypatch.setattr(logger, "_stack", lambda f: "its stack")
    monkeypatch.setattr(logger, "_collective_bytes", lambda: next(moved))
    pulse = logger._Pulse()
    waits = [pulse.beat(7, 0, True, now=float(now))["waiting_s"] for now in range(0, 16, 2)]
    assert waits == [0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 4.0, 6.0]

