"""Engine planning: how many engines and which GPU each one sees.

A GPU cannot exist on these machines, so the visible GPU list is passed in
(that is the only stand-in here); the rest of the fleet is tested for real."""

import pytest

from workbench.errors import OptionsError
from workbench.kernel.devices import EngineSlot, parse_gpu_list, plan_engines, visible_gpus


def test_cpu_default_and_explicit_count():
    assert plan_engines(visible=[]) == [EngineSlot(0), EngineSlot(1)]
    assert [s.slot for s in plan_engines(3, visible=[])] == [0, 1, 2]
    assert all(s.device_type == "cpu" for s in plan_engines(3, visible=[]))


def test_gpu_machine_defaults_to_one_engine_per_visible_gpu():
    slots = plan_engines(visible=["0", "1", "2", "3"])
    assert [(s.slot, s.gpu) for s in slots] == [(0, "0"), (1, "1"), (2, "2"), (3, "3")]
    assert {s.device_type for s in slots} == {"cuda"}


def test_gpus_flag_picks_devices_each_engine_gets_exactly_one():
    slots = plan_engines(gpus=parse_gpu_list("0,2"), visible=["0", "1", "2", "3"])
    assert [(s.slot, s.gpu) for s in slots] == [(0, "0"), (1, "2")]


def test_cpu_flag_on_gpu_machine():
    assert {s.gpu for s in plan_engines(2, cpu=True, visible=["0", "1"])} == {None}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "at least 1"),
        (dict(n=-3), "at least 1"),
        (dict(n="abc"), "whole number"),
        (dict(n=3, visible=["0", "1"]), "only 2 GPUs are visible"),
        (dict(gpus=["0", "5"], visible=["0", "1"]), "GPU 5 is not visible"),
        (dict(gpus=["0"], visible=[]), "visible GPUs: none"),
        (dict(n=3, gpus=["0", "1"], visible=["0", "1"]), "does not match"),
        (dict(gpus=["0"], cpu=True, visible=["0"]), "contradict"),
    ],
)
def test_bad_plans_are_refused_with_a_hint(kwargs, message):
    kwargs.setdefault("visible", [])
    with pytest.raises(OptionsError, match=message):
        plan_engines(**kwargs)


def test_gpu_list_parsing():
    assert parse_gpu_list(" 1, 3 ") == ["1", "3"]
    with pytest.raises(OptionsError, match="twice"):
        parse_gpu_list("1,1")
    with pytest.raises(OptionsError):
        parse_gpu_list(",")


def test_visible_gpus_honours_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
