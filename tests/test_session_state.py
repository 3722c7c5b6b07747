"""The kernel's session state by hand (no fleet): fresh ranks, cells kept for replay and export,
restarts spent."""

from __future__ import annotations

from workbench.kernel.session_state import SessionState
from workbench.options import CellOptions


def test_fresh_ranks_gather_until_every_rank_has_the_state_or_every_rank_is_fresh():
    session = SessionState()
    session.replaced([2], world_size=4)
    session.replaced([0, 2], world_size=4)
    assert session.fresh_ranks == [0, 2]
    session.fresh_ranks.append(3)  # a copy: only the methods change it
    assert session.fresh_ranks == [0, 2]
    session.every_rank_has_state()
    assert session.fresh_ranks == []
    session.replaced([0, 1], world_size=2)  # every rank starts over: they agree (all empty)
    assert session.fresh_ranks == []


def test_setup_cells_are_kept_once_and_replayed_and_the_training_cell_is_the_last_on_every_rank():
    session, ddp, fsdp = SessionState(), CellOptions(), CellOptions(strategy="fsdp")
    session.cell_ran("model = 1", ddp, setup=True, on_every_rank=True)
    session.cell_ran("data = 2", ddp, setup=True, on_every_rank=True)
    session.cell_ran("model = 1", fsdp, setup=True, on_every_rank=True)  # the same code again: moved last
    session.cell_ran("train()", ddp, setup=False, on_every_rank=True)
    session.cell_ran("print(rank)", ddp, setup=False, on_every_rank=False)  # on some ranks: not training
    assert session.setup_cells == [("data = 2", ddp), ("model = 1", fsdp)]
    assert session.training_cell == ("train()", ddp)
    with session.replay() as cells:
        assert session.replaying and [code for code, _ in cells] == ["data = 2", "model = 1"]
        session.cell_ran("data = 2", ddp, setup=False, on_every_rank=True)  # a replayed cell: not training
    assert not session.replaying and session.training_cell == ("train()", ddp)
    session.forget_setup()
    assert session.setup_cells == [] and [session.next_cell_name(), session.next_cell_name()] == \
        ["distributed-cell-1", "distributed-cell-2"]


def test_restarts_are_spent_one_at_a_time_up_to_the_limit():
    session = SessionState()
    assert [session.take_restart(2) for _ in range(3)] == [1, 2, None]
    assert session.restarts == 2
