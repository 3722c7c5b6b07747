"""(b) Round trip of an empty %%distributed cell vs raw ipyparallel %%px on the same engines.

Both magics run through a real IPython shell, interleaved. Target ratio <= 1.2 (issue 19).
"""

from __future__ import annotations

import time

from common import median, p95, report
from IPython.core.interactiveshell import InteractiveShell

REPEATS = 200


def main() -> dict:
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "workbench")
    shell.run_line_magic("fleet", "start -n 2")
    from workbench import current_fleet

    try:
        view = current_fleet().client[:]
        view.block = True
        view.activate()  # registers %%px on these engines
        ours, raw = [], []
        for i in range(REPEATS + 10):
            start = time.perf_counter()
            shell.run_cell_magic("distributed", "", "pass")
            mid = time.perf_counter()
            shell.run_cell_magic("px", "", "pass")
            end = time.perf_counter()
            if i >= 10:
                ours.append(mid - start)
                raw.append(end - mid)
    finally:
        shell.run_line_magic("fleet", "stop")
    return report("roundtrip", {
        "distributed_median_ms": 1e3 * median(ours),
        "distributed_p95_ms": 1e3 * p95(ours),
        "px_median_ms": 1e3 * median(raw),
        "px_p95_ms": 1e3 * p95(raw),
        "ratio_distributed_over_px": median(ours) / median(raw),
        "target": "<= 1.2",
    })


if __name__ == "__main__":
    main()
