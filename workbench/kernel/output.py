"""Each rank's stdout/stderr, shown while a cell runs.

In a Jupyter kernel every rank gets one output block that is updated in place
(``display_id``); headless runs (nbconvert) keep the final text of each block.
In a terminal or script, new lines are printed as they arrive, labelled by rank.
Every line carries its rank label, so saved output reads well as plain text.
"""

from __future__ import annotations

import sys
import time

from workbench.messages import REDRAW_MARK

REFRESH_S = 0.1
LIVE_TAIL_CHARS = 8_000  # while a cell runs, a rank's block shows its last lines (each update resends the block)


def last_line(text: str, limit: int | None = 200) -> str:
    """The last non-empty line of ``text``, cut to ``limit`` characters."""
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


def in_kernel() -> bool:
    """Whether we run inside a Jupyter kernel (where display updates work)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def settle_bars(text: str, keep_bars: bool = True) -> str:
    """``text`` as a terminal shows it: a line redrawn with ``\\r`` (a progress bar) shows its
    newest state instead of every state; ``keep_bars=False`` drops such lines (another rank's bars)."""
    if "\r" not in text and REDRAW_MARK not in text:
        return text
    shown = []
    lines = text.split("\n")
    for number, body in enumerate(lines):
        end = "\n" if number < len(lines) - 1 else ""
        body = body.removesuffix("\r")  # a \r\n line end
        if "\r" not in body and REDRAW_MARK not in body:
            shown.append(body + end)
            continue
        if not keep_bars:
            continue
        newest = next((part for part in reversed(body.split("\r")) if part), "").replace(REDRAW_MARK, "")
        if newest.strip():  # a bar cleared with spaces (leave=False) leaves nothing
            shown.append(newest + end)
    return "".join(shown)


def label_lines(rank: int, text: str, stream: str = "") -> str:
    tag = f"[rank {rank}{' ' + stream if stream else ''}] "
    return "".join(tag + line for line in text.splitlines(True))


class RankOutput:
    """Live per-rank output for one cell run."""

    def __init__(self, ranks: list[int], live_blocks: bool | None = None, all_progress: bool = False) -> None:
        self.ranks = ranks
        self.bar_ranks = set(ranks) if all_progress else set(ranks[:1])  # whose progress bars are shown
        self.live_blocks = in_kernel() if live_blocks is None else live_blocks
        self._shown = {r: "" for r in ranks}  # the text each block shows now
        self._printed = {r: [0, 0] for r in ranks}  # text mode: characters printed
        self._handles = {}
        self._last_refresh = 0.0

    def update(self, texts: dict[int, tuple[str, str]], force: bool = False) -> None:
        """Show the accumulated ``(stdout, stderr)`` of each rank."""
        now = time.monotonic()
        if not force and now - self._last_refresh < REFRESH_S:
            return
        self._last_refresh = now
        for rank, (out, err) in texts.items():
            if self.live_blocks:
                self._update_block(rank, out, err, final=force)
            else:
                self._print_new(rank, out, err, final=force)

    def _update_block(self, rank: int, out: str, err: str, final: bool) -> None:
        if not (out or err):
            return
        keep = rank in self.bar_ranks
        out, err = settle_bars(out, keep), settle_bars(err, keep)
        if not final:  # an update resends the whole block: keep it small while the cell runs
            out, err = _tail(out, rank), _tail(err, rank)
        text = label_lines(rank, out) + label_lines(rank, err, "stderr")
        if text == self._shown[rank]:  # (a tail shown while running is not the whole output)
            return
        from IPython.display import display

        self._shown[rank] = text
        bundle = {"text/plain": text}
        handle = self._handles.get(rank)
        if handle is None:
            self._handles[rank] = display(bundle, raw=True, display_id=True)
        else:
            handle.update(bundle, raw=True)

    def _print_new(self, rank: int, out: str, err: str, final: bool) -> None:
        for index, (text, stream, target) in enumerate(((out, "", sys.stdout), (err, "stderr", sys.stderr))):
            done = self._printed[rank][index]
            new = text[done:]
            if not final:
                new = new[: new.rfind("\n") + 1]  # whole lines only while running
            if new:
                self._printed[rank][index] = done + len(new)
                new = settle_bars(new, rank in self.bar_ranks)
            if new:
                target.write(label_lines(rank, new if new.endswith("\n") else new + "\n", stream))
                target.flush()


def _tail(text: str, rank: int) -> str:
    """The last lines of ``text`` (about LIVE_TAIL_CHARS), saying how many came before."""
    if len(text) <= LIVE_TAIL_CHARS:
        return text
    cut = text.find("\n", len(text) - LIVE_TAIL_CHARS) + 1
    earlier = text.count("\n", 0, cut)
    return f"… {earlier} earlier lines (all shown when the cell ends)\n" + text[cut:]


class ProgressLine:
    """One line of progress for long work (engine start-up), updated in place."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._handle = None
        self._last = ""

    def show(self, text: str, key: object = None) -> None:
        """Show ``text``; outside a kernel only when ``key`` (default: the text) changes."""
        key = text if key is None else key
        if not self.enabled or key == self._last:
            return
        self._last = key
        if in_kernel():
            from IPython.display import display

            bundle = {"text/plain": text}
            if self._handle is None:
                self._handle = display(bundle, raw=True, display_id=True)
            else:
                self._handle.update(bundle, raw=True)
        else:
            print(text, file=sys.stderr, flush=True)
