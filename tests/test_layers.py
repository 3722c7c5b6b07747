"""The engine side never loads the kernel side: each rank imports only what it runs."""

from __future__ import annotations

import json
import subprocess
import sys

ENGINE_SIDE = [
    "workbench",
    "workbench.engine",
    "workbench.rendezvous",
    "workbench.strategies",
    "workbench.llm",
    "workbench.models",
    "workbench.metrics",
    "workbench.metrics.logger",
    "workbench.metrics.instrument",
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
KERNEL_SIDE = ("ipyparallel.client", "ipywidgets", "IPython.core.magic", "workbench.fleet", "workbench.execution",
               "workbench.panel", "workbench.magics", "workbench.elastic", "workbench.metrics.dashboard",
               "workbench.metrics.collector", "workbench.checkpoint.control")

PROBE = """
import importlib, json, sys
for name in {modules!r}:
    importlib.import_module(name)
import workbench
for name in ("log", "progress", "checkpoint", "llm", "step", "CheckpointError"):  # what cells use
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
