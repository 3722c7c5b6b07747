"""Options defined once: the dataclasses of workbench.options generate the magics' flags,
defaults and help, and Fleet(...) takes the same fields."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from workbench import CellOptions, Fleet, FleetOptions, OptionsError
from workbench.kernel.flags import distributed_parser, field_docs, fleet_parser, options_from
from workbench.kernel.magics import WorkbenchMagics
from workbench.options import CellCall, TuneOptions

OPTION_CLASSES = (FleetOptions, CellOptions, CellCall, TuneOptions)


@pytest.mark.parametrize("cls", OPTION_CLASSES)
def test_every_field_has_a_docstring_and_is_keyword_only(cls):
    docs = field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
    assert missing == [], f"fields without a docstring: {missing}"
    assert all(f.kw_only for f in dataclasses.fields(cls))
    first = dataclasses.fields(cls)[0].name
    with pytest.raises(TypeError):
        cls(getattr(cls(), first))  # positional: refused


def _flag_fields(cls):
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("api_only")]


def test_an_empty_line_gives_the_dataclass_defaults():
    start = fleet_parser().parse_args(["start"])
    start.launcher_options = start.launcher_options or None
    assert options_from(start, FleetOptions) == FleetOptions()
    cell = distributed_parser().parse_args([])
    assert options_from(cell, CellOptions) == CellOptions()
    assert options_from(cell, CellCall) == CellCall()


def test_flags_parse_into_the_fields():
    args = distributed_parser().parse_args(["--strategy", "fsdp", "--tp", "2", "--activation-checkpointing",
                                             "--ranks", "0,1", "--timeout", "5", "--setup"])
    assert options_from(args, CellOptions) == CellOptions(strategy="fsdp", tp=2, activation_checkpointing=True)
    assert options_from(args, CellCall) == CellCall(ranks=[0, 1], timeout=5.0, setup=True)
    args = fleet_parser().parse_args(["start", "-n", "3", "--no-wandb", "--hang-timeout", "0", "--spares", "1"])
    options = options_from(args, FleetOptions)
    assert (options.n, options.wandb, options.hang_timeout, options.spares) == (3, False, 0.0, 1)


@pytest.mark.parametrize("cls, magic", [(FleetOptions, WorkbenchMagics.fleet), (TuneOptions, WorkbenchMagics.fleet),
                                        (CellOptions, WorkbenchMagics.distributed),
                                        (CellCall, WorkbenchMagics.distributed)])
def test_help_shows_every_flag_with_its_doc_choices_and_default(cls, magic):
    help_text = " ".join(magic.__doc__.split())  # what %fleet? / %%distributed? show
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in _flag_fields(cls):
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        assert flag in help_text, flag
        assert docs[f.name][:40] in help_text, docs[f.name]
        kind = hints[f.name]
        kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind) \
            if typing.get_origin(kind) in (typing.Union, __import__("types").UnionType) else kind
        if typing.get_origin(kind) is typing.Literal:
            assert f"{flag} {'|'.join(typing.get_args(kind))}" in help_text
        if f.default not in (None, False) and not isinstance(f.default, bool):
            assert f"(default {f.default:g})" in help_text if isinstance(f.default, float) \
                else f"(default {f.default})" in help_text


def test_flags_not_given_take_the_fleets_cell_defaults():
    tuned = CellOptions(strategy="fsdp", grad_accum=4).to_dict()
    args = distributed_parser().parse_line("--grad-accum 1", defaults=tuned)
    assert options_from(args, CellOptions) == CellOptions(strategy="fsdp", grad_accum=1)
    assert options_from(distributed_parser().parse_line(""), CellOptions) == CellOptions(), "the parser is unchanged"


def test_tune_flags_and_the_defaults_filled_in_for_a_fleet():
    args = fleet_parser().parse_args(["tune", "step", "--model", "build", "--batch", "make", "--micro-batches", "8,16",
                                      "--strategies", "ddp,fsdp", "--max-memory", "4G", "--no-apply"])
    assert (args.step, args.model, args.batch, args.optimizer) == ("step", "build", "make", None)
    assert options_from(args, TuneOptions) == TuneOptions(micro_batches=[8, 16], strategies=["ddp", "fsdp"],
                                                          max_memory="4G", apply=False)
    filled = TuneOptions(global_batch=64).validate("cpu", world_size=2)
    assert filled.micro_batches == [1, 2, 4, 8, 16, 32] and filled.strategies == ["ddp", "fsdp"]
    assert filled.precisions == ["no"] and TuneOptions().validate("cuda", 8, nodes=2).precisions == ["no", "bf16"]
    assert TuneOptions().validate("cuda", 8, nodes=2).strategies == ["ddp", "fsdp", "hsdp"]
    assert TuneOptions(micro_batches=[3, 4, 8], global_batch=16).validate("cpu", 2).micro_batches == [4, 8]
    for bad, message in [({"steps": 0}, "--steps must be a whole number >= 1"),
                         ({"precisions": ["fp8"]}, "unknown mixed precision 'fp8'"),
                         ({"micro_batches": [0]}, "a micro-batch size must be"),
                         ({"max_memory": "12"}, "--max-memory '12' is below 1 MiB")]:
        with pytest.raises(OptionsError, match=message):
            TuneOptions(**bad).validate("cpu", 2)


def test_fleet_takes_the_fields_and_names_the_nearest_for_a_typo():
    fleet = Fleet(n=2, spares=1, auto_recover=True, wandb=False)
    assert (fleet.options.spares, fleet.options.auto_recover, fleet.options.wandb) == (1, True, False)
    same = Fleet(options=FleetOptions(n=2, spares=1, auto_recover=True, wandb=False))
    assert same.options == fleet.options
    with pytest.raises(OptionsError, match=r"^Fleet\(\) has no option 'spars'; did you mean 'spares'\?"):
        Fleet(n=2, spars=1)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_restarts": -1}, "--max-restarts must be a whole number >= 0"),
    ({"spares": 1.5}, "--spares must be a whole number >= 0"),
    ({"backend": "glooo"}, "unknown backend 'glooo'"),
    ({"hang_timeout": -1}, "--hang-timeout must be >= 0 seconds"),
    ({"pg_timeout": 0}, "--pg-timeout must be a positive number"),
    ({"launcher": "slurmm"}, "unknown launcher 'slurmm'"),
    ({"launcher": "slurm"}, "--launcher slurm needs -n"),
])
def test_bad_fleet_options_are_one_line_errors_before_anything_starts(kwargs, message):
    with pytest.raises(OptionsError, match=message) as info:
        Fleet(**kwargs)
    assert "\n" not in str(info.value)
