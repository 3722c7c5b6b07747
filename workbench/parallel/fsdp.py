"""Which modules become their own FSDP2 units (``--fsdp-wrap``), and how much of the
model is unsharded at once (the memory FSDP exists to save).

torchtitan's rule: ``fully_shard`` every block, then the root, so a forward all-gathers
one block at a time instead of the whole model. ``auto`` finds the blocks as:

1. a Hugging Face model's ``_no_split_modules`` classes (its decoder layers);
2. else the items of the model's ``nn.ModuleList`` s (a list of transformer blocks);
3. else the children of a top-level ``nn.Sequential`` that hold parameters.
"""

from __future__ import annotations

WRAP_AUTO, WRAP_NONE = "auto", "none"


def parse_wrap(text: str) -> tuple[str, ...]:
    """``auto`` / ``none`` / ``ClassName[,ClassName]`` → ("auto",) / () / the class names."""
    from workbench.errors import OptionsError

    text = (text or "").strip()
    if text.lower() == WRAP_AUTO:
        return (WRAP_AUTO,)
    if text.lower() == WRAP_NONE:
        return ()
    names = tuple(name.strip() for name in text.split(","))
    bad = [name for name in names if not name.isidentifier()]
    if bad or not names:
        raise OptionsError(f"--fsdp-wrap takes auto, none or class names like LlamaDecoderLayer,MLP (got {text!r})")
    return names


def _inner(module):
    """The module inside an activation-checkpoint wrapper (the module itself otherwise)."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def _has_params(module) -> bool:
    return any(True for _ in module.parameters())


def _outermost(model, chosen) -> list:
    """The modules of ``model`` for which ``chosen(module)`` holds, skipping those inside a chosen
    one (nested units would shard a block's parameters twice) and the root itself."""
    units, inside = [], set()
    for name, module in model.named_modules():
        if module is model or any(name.startswith(prefix) for prefix in inside):
            continue
        if chosen(module) and _has_params(module):
            units.append(module)
            inside.add(name + ".")
    return units


def blocks(model) -> list:
    """The model's repeated blocks: its ``nn.ModuleList`` items (transformer layers), else the
    children of a top-level ``nn.Sequential`` that hold parameters."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if lists:
        return [block for layer_list in lists for block in layer_list]
    if isinstance(model, torch.nn.Sequential):
        return [child for child in model.children() if _has_params(child)]
    return []


def fsdp_units(model, wrap: str = WRAP_AUTO) -> list:
    """The modules to shard as their own FSDP units before the root, by ``--fsdp-wrap``."""
    names = parse_wrap(wrap)
    if not names:
        return []
    if names == (WRAP_AUTO,):
        no_split = set(getattr(model, "_no_split_modules", None) or ())
        units = _outermost(model, lambda m: type(_inner(m)).__name__ in no_split) if no_split else []
        if units:
            return units
        found = {id(b) for b in blocks(model)}
        return _outermost(model, lambda m: id(m) in found)
    units = _outermost(model, lambda m: type(_inner(m)).__name__ in names)
    if not units:
        from workbench.errors import OptionsError

        classes = sorted({type(_inner(m)).__name__ for m in model.modules() if _has_params(m)} - {type(model).__name__})
        raise OptionsError(f"--fsdp-wrap {','.join(names)} matched no module of {type(model).__name__}; "
                           f"its classes with parameters: {', '.join(classes[:12])}")
    return units


def _leaves_a_rank_empty(unit, ranks: int) -> bool:
    """FSDP2 cuts each parameter's first dimension into ``ranks`` chunks of ``ceil(d/ranks)``;
    when the last rank gets no element of any of the unit's parameters, it has no gradient
    (hence no optimizer state) for them, and a checkpoint cannot be resharded onto it."""
    return all((ranks - 1) * -(-p.shape[0] // ranks) >= p.shape[0] for p in unit.parameters() if p.dim())


def shard_units(model, wrap: str, **fully_shard_kwargs) -> int:
    """``fully_shard`` each unit of :func:`fsdp_units` (the caller shards the root after).
    A unit too small to give every rank a piece (a 1-output head on 3 ranks) stays with the
    root. Returns how many units were sharded."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = fully_shard_kwargs.get("mesh")
    ranks = mesh.size(mesh.ndim - 1) if mesh is not None else dist.get_world_size()
    units = [u for u in fsdp_units(model, wrap) if not isinstance(u, FSDPModule) and not _leaves_a_rank_empty(u, ranks)]
    for unit in units:
        fully_shard(unit, **fully_shard_kwargs)
    return len(units)


def fsdp_unit_count(model) -> int:
    """How many FSDP2 units ``model`` holds (its root included)."""
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.modules())


class UnshardedPeak:
    """Measures the most parameter bytes that were unsharded (all-gathered) at once during
    forward passes, on CPU as on GPU: hooks after FSDP's own pre-forward (which all-gathers)
    sum the full sizes of the parameter groups that are unsharded at that moment.

    >>> with UnshardedPeak(model) as peak: model(x)
    >>> peak.bytes, peak.full_bytes
    """

    def __init__(self, model) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.bytes = 0
        self._groups = []
        self._sizes: list[int] | None = None  # known once FSDP's lazy init set the compute dtypes
        self._handles = []
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            group = module._get_fsdp_state()._fsdp_param_group
            if group is None:
                continue
            self._groups.append(group)
            self._handles.append(module.register_forward_pre_hook(self._sample))
            self._handles.append(module.register_forward_hook(self._sample))

    @property
    def full_bytes(self) -> int:
        """Every FSDP-managed parameter, unsharded (in its compute dtype)."""
        return sum(self._group_sizes())

    def _group_sizes(self) -> list[int]:
        if self._sizes is None:
            self._sizes = [sum(p._orig_size.numel() * (getattr(p, "param_dtype", None) or p.sharded_param.dtype).itemsize
                               for p in group.fsdp_params) for group in self._groups]
        return self._sizes

    def _sample(self, *_args) -> None:
        now = sum(size for group, size in zip(self._groups, self._group_sizes(), strict=True) if group.is_unsharded)
        self.bytes = max(self.bytes, now)

    def __enter__(self) -> "UnshardedPeak":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
