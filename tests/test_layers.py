"""The engine side never loads the kernel side: each rank imports only what it runs."""

from __future__ import annotations

import json
import subprocess
import sys

ENGINE_SIDE = [
    "workbench",
    "workbench.rank.engine",
    "workbench.rank.batch_process",
    "workbench.trials",
    "workbench.rank.rendezvous",
    "workbench.rank.strategies",
    "workbench.options",
    "workbench.messages",
    "workbench.llm",
    "workbench.models",
    "workbench.metrics",
    "workbench.metrics.logger",
    "workbench.rank.instrument",
    "workbench.metrics.gpu",
    "workbench.checkpoint",
    "workbench.checkpoint.api",
    "workbench.checkpoint.replica",
    "workbench.checkpoint.writer",
    "workbench.parallel.model",
    "workbench.parallel.pipeline",
    "workbench.parallel.tensor",
    "workbench.parallel.hooks",
]
KERNEL_SIDE = ("ipyparallel.client", "ipywidgets", "IPython.core.magic", "workbench.kernel.fleet", "workbench.kernel.cells",
               "workbench.kernel.execution", "workbench.kernel.panel", "workbench.kernel.magics", "workbench.kernel.elastic",
               "workbench.kernel.metrics.dashboard", "workbench.kernel.metrics.collector", "workbench.kernel.checkpoints")

PROBE = """
import importlib, json, sys
for name in {modules!r}:
    importlib.import_module(name)
import workbench
for name in ("log", "progress", "checkpoint", "llm", "step", "tune", "CheckpointError"):  # what cells use
    getattr(workbench, name)
print(json.dumps(sorted(sys.modules)))
"""


def test_engine_side_modules_load_no_kernel_side_module():
    out = subprocess.run([sys.executable, "-c", PROBE.format(modules=ENGINE_SIDE)],
                         capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    kernel = [m for m in loaded if m.startswith(KERNEL_SIDE)]
    assert kernel == [], f"engine-side imports loaded kernel-side modules: {kernel}"
    assert set(ENGINE_SIDE) <= set(loaded)


def test_the_kernel_names_still_import_from_the_package():
    out = subprocess.run([sys.executable, "-c", "from workbench import Fleet, DistributedCellError, CellOptions\n"
                          "import workbench\nprint(sorted(set(workbench.__all__) - set(dir(workbench))))"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# The engine side, bottom layer first: a module imports only from its own layer or below.
LAYERS = [
    ["workbench.rank", "workbench.rank_state", "workbench.errors", "workbench.messages", "workbench.data_position",
     "workbench.rank.batch_process", "workbench.reaper", "workbench.rank.stacks", "workbench.placement",
     "workbench.links", "workbench.launcher_kinds"],
    ["workbench.metrics.comm", "workbench.metrics.gpu", "workbench.metrics.logger", "workbench.metrics"],
    ["workbench.parallel.data_parallel", "workbench.parallel.options", "workbench.parallel.plan", "workbench.parallel.fsdp", "workbench.parallel.hooks",
     "workbench.parallel.tensor", "workbench.parallel.pipeline", "workbench.parallel.model", "workbench.parallel",
     "workbench.options"],
    ["workbench.rank.instrument"],
    ["workbench.rank.strategies"],
    ["workbench.rank.rendezvous", "workbench.checkpoint.state", "workbench.checkpoint.storage", "workbench.checkpoint.layout",
     "workbench.checkpoint.safe_io",
     "workbench.checkpoint.writer", "workbench.checkpoint.failures", "workbench.checkpoint.api", "workbench.checkpoint.replica", "workbench.checkpoint",
     "workbench.checkpoint.hf_export",
     "workbench.llm", "workbench.models"],
    ["workbench.rank.engine", "workbench.trials"],
    ["workbench.rank.template"],
]  # workbench.script is both sides at once: in a batch job, rank 0 also runs the collector


def _imports() -> dict[str, set[str]]:
    """Every workbench module and the workbench modules it imports (also inside functions)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "workbench"
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:  # annotations only: nothing is imported at run time
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                while target not in names and "." in target:
                    target = target.rpartition(".")[0]
                if target in names and target != name:
                    found.add(target)
                    break
        graph[name] = found
    return graph


def _assert_no_circle(edges: dict[str, set[str]], what: str) -> None:
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError(f"{what} circle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        path.append(name)
        for target in sorted(edges.get(name, ())):
            visit(target)
        path.pop()
        done.add(name)

    for name in sorted(edges):
        visit(name)


def test_no_import_circle():
    _assert_no_circle(_imports(), "import")


def test_engine_side_layers_import_downward_only():
    graph = _imports()
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    assert set(ENGINE_SIDE) - {"workbench"} <= set(layer), "every engine-side module has a layer"
    upward = sorted(f"{a} -> {b}" for a in layer for b in graph[a] if layer.get(b, -1) > layer[a])
    kernel = sorted(f"{a} -> {b}" for a in layer for b in graph[a] if b not in layer and b != "workbench")
    assert upward == [] and kernel == [], (upward, kernel)


# The kernel side above the engine side (which it may import), bottom layer first.
KERNEL_LAYERS = [
    ["workbench.kernel", "workbench.kernel.metrics", "workbench.kernel.devices", "workbench.kernel.flags", "workbench.kernel.output", "workbench.kernel.runs", "workbench.kernel.ranklogs",
     "workbench.reaper", "workbench.kernel.launchers", "workbench.kernel.metrics.store", "workbench.kernel.metrics.step_rows",
     "workbench.kernel.metrics.summary", "workbench.kernel.metrics.sinks", "workbench.kernel.metrics.tensorboard_sink",
     "workbench.kernel.metrics.wandb_sink", "workbench.kernel.notices", "workbench.kernel.run_record", "workbench.kernel.session_state"],
    ["workbench.kernel.processes", "workbench.kernel.metrics.collector", "workbench.kernel.metrics.stragglers", "workbench.kernel.metrics.dashboard",
     "workbench.kernel.watchdog"],
    ["workbench.kernel.pool", "workbench.kernel.metrics.live", "workbench.kernel.execution", "workbench.kernel.export"],
    ["workbench.kernel.group", "workbench.kernel.status", "workbench.kernel.checkpoints", "workbench.kernel.cells",
     "workbench.kernel.tuner"],
    ["workbench.kernel.elastic", "workbench.kernel.parking"],
    ["workbench.kernel.fleet"],
    ["workbench.kernel.panel", "workbench.kernel.labpanel", "workbench.kernel.testing"],
    ["workbench.kernel.magics"],
]


def test_kernel_side_layers_import_downward_only():
    graph = _imports()
    engine_side = {name for names in LAYERS for name in names} | {"workbench.script", "workbench.llm"}
    layer = {name: i for i, names in enumerate(KERNEL_LAYERS) for name in names}
    unplaced = set(graph) - set(layer) - engine_side - {"workbench"}
    assert not unplaced, f"every module has a layer: {sorted(unplaced)}"
    upward = sorted(f"{a} -> {b}" for a in layer for b in graph[a] if layer.get(b, -1) > layer[a])
    assert upward == [], upward


def test_the_packages_show_the_two_sides():
    """Every kernel-side module lives under workbench/kernel/, every engine-side one outside it,
    and nothing outside workbench/kernel/ imports it (but the package's lazy names and the batch
    script, which is both sides at once)."""
    graph = _imports()
    engine_side = {name for names in LAYERS for name in names}
    kernel_side = {name for names in KERNEL_LAYERS for name in names}
    assert sorted(n for n in kernel_side - engine_side if not n.startswith("workbench.kernel")) == []
    assert sorted(n for n in engine_side if n.startswith("workbench.kernel")) == []
    reaching_in = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                         if b.startswith("workbench.kernel") and not a.startswith("workbench.kernel")
                         and a not in ("workbench", "workbench.script"))
    assert reaching_in == [], reaching_in


def test_no_import_circle_between_sibling_packages():
    """rank/, kernel/, checkpoint/, metrics/, parallel/ (and the top level) import each other one
    way (a package and its own sub-package, kernel/ and kernel/metrics/, may share base modules)."""
    graph = _imports()
    packages = {name: name.rpartition(".")[0] if name.count(".") > 1 or not _is_package(name) else name
                for name in graph}
    edges: dict[str, set[str]] = {}
    for a, targets in graph.items():
        for b in targets:
            pa, pb = packages[a], packages[b]
            if pa != pb and not pa.startswith(pb + ".") and not pb.startswith(pa + "."):
                edges.setdefault(pa, set()).add(pb)
    _assert_no_circle(edges, "package")


def _is_package(name: str) -> bool:
    import pathlib

    return (pathlib.Path(__file__).resolve().parent.parent / name.replace(".", "/") / "__init__.py").exists()


FLEET_CHANGED_ONLY_BY = {"workbench/kernel/parking.py": {"park", "unpark"}}  # they set fleet.parked


def test_the_fleets_state_is_changed_by_its_owners_not_by_free_functions():
    """Module-level functions that take a ``fleet`` and assign to its attributes: the state they
    change belongs to an owner (the fleet, its session state, Cells, Elastic) with methods."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    found = {}
    for path in sorted((root / "workbench").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:  # module level only: methods are their class's
            if not isinstance(node, ast.FunctionDef) or "fleet" not in [a.arg for a in node.args.args]:
                continue
            assigned = {target.attr for statement in ast.walk(node) if isinstance(statement, (ast.Assign, ast.AugAssign))
                        for target in (statement.targets if isinstance(statement, ast.Assign) else [statement.target])
                        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "fleet"}
            if assigned:
                found.setdefault(str(path.relative_to(root)), set()).add(node.name)
    assert found == FLEET_CHANGED_ONLY_BY
