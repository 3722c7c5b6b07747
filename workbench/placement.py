"""Kernel side: which host each rank's engine starts on (``--hosts hostA:2,hostB:2``,
``--hostfile FILE``).

Ranks fill the hosts in the order given, each up to its slots, as torchrun and mpirun
number them (a host's ranks are consecutive). An engine added later (scale-up, a spare)
goes to the first host with a free slot; a replacement goes where the rank it replaces
was. A hostfile holds one host a line: ``hostA slots=2`` (OpenMPI, DeepSpeed), ``hostA:2``
or ``hostA`` (one slot); ``#`` starts a comment.
"""

from __future__ import annotations

import re
from collections import Counter

from workbench.errors import OptionsError

_ENTRY = re.compile(r"^(?P<host>[A-Za-z0-9_.@-]+)(?::(?P<n>\d+))?$")
_HOSTFILE_LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.@-]+)(?:\s*:\s*(?P<colon>\d+)|\s+slots\s*=\s*(?P<slots>\d+))?$")


class Hosts:
    """The hosts a fleet may use, each with its number of slots (engines), in order."""

    def __init__(self, slots: dict[str, int]) -> None:
        if not slots:
            raise OptionsError("--hosts names no host (e.g. --hosts hostA:2,hostB:2)")
        self.slots = dict(slots)

    @classmethod
    def parse(cls, text: str) -> "Hosts":
        """``hostA:2,hostB:2`` (a host without ``:N`` has one slot)."""
        slots: dict[str, int] = {}
        for entry in (e.strip() for e in text.split(",")):
            match = _ENTRY.match(entry)
            if not match or (match["n"] is not None and int(match["n"]) < 1):
                raise OptionsError(f"--hosts takes HOST:N,HOST:N (N >= 1), e.g. hostA:2,hostB:2; got {entry!r}")
            _add(slots, match["host"], int(match["n"] or 1), "--hosts")
        return cls(slots)

    @classmethod
    def read(cls, path: str) -> "Hosts":
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise OptionsError(f"--hostfile {path!r}: {exc.strerror or exc}") from None
        slots: dict[str, int] = {}
        for number, line in enumerate(lines, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            match = _HOSTFILE_LINE.match(line)
            n = int(match["colon"] or match["slots"] or 1) if match else 0
            if not match or n < 1:
                raise OptionsError(f"--hostfile {path} line {number}: expected 'HOST slots=N', 'HOST:N' or 'HOST', "
                                   f"got {line!r}")
            _add(slots, match["host"], n, f"--hostfile {path}")
        return cls(slots)

    @property
    def total(self) -> int:
        return sum(self.slots.values())

    def add(self, other: "Hosts") -> None:
        """More hosts (``%fleet scale N --hosts hostC:2``); a host named again gets the larger count."""
        for host, n in other.slots.items():
            self.slots[host] = max(n, self.slots.get(host, 0))

    def assign(self, count: int, used: list[str]) -> list[str]:
        """Hosts for ``count`` more engines, given the hosts of the engines there are (``used``):
        the first hosts with free slots, in order."""
        taken = Counter(used)
        chosen = []
        for host, n in self.slots.items():
            free = n - taken[host]
            chosen += [host] * max(0, min(free, count - len(chosen)))
        if len(chosen) < count:
            free = ", ".join(f"{h}:{n - taken[h]}" for h, n in self.slots.items() if n > taken[h]) or "none"
            raise OptionsError(f"{count} more engines need {count} free slots but the hosts have {len(chosen)} "
                               f"(free: {free}); add hosts with --hosts HOST:N")
        return chosen

    def __str__(self) -> str:
        return ",".join(f"{h}:{n}" for h, n in self.slots.items())


def _add(slots: dict[str, int], host: str, n: int, where: str) -> None:
    if host in slots:
        raise OptionsError(f"{where} names {host} twice")
    slots[host] = n
