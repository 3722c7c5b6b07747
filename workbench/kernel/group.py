"""Building the torch.distributed process group over a pool's engines. Kernel side: each
rank joins with :func:`workbench.rank.rendezvous.join` on its engine, with the address, port and
numbering chosen here (a host's ranks are consecutive, as torchrun numbers them)."""

from __future__ import annotations

import concurrent.futures
import os
import time

from workbench.errors import FleetError
from workbench.kernel.pool import EnginePool
from workbench.kernel.processes import one_line
from workbench.rank import rendezvous

POLL_S = 0.5  # how often the joining ranks' processes are checked


def join_all(pool: EnginePool, *, backend: str, timeout_s: float, generation: int, runtime_dir: str | None,
             master_addr: str | None = None) -> list[int]:
    """Every rank joins a new group (generation ``generation``, on a fresh port); returns the
    ranks to replace (dead while joining, and the ranks left waiting for them), or [] once the
    group is up. Records each rank's device on its member. ``master_addr``: where the others
    reach rank 0 (default: its address on the interface that routes to another rank's host)."""
    members = pool.members
    hosts = {m.host for m in members}
    rank0 = pool.client[pool.member(0).engine_id]
    single_host = len(hosts) == 1
    port = rank0.apply_async(rendezvous.free_port, single_host).get()
    if single_host:
        addr = rendezvous.LOOPBACK
    else:
        peer = next(m.host for m in members if m.host != pool.member(0).host)
        addr = master_addr or rank0.apply_async(rendezvous.host_address, peer).get()
    store = os.path.join(runtime_dir, f"store-{generation}") if single_host and runtime_dir else None
    pending = []
    started = time.monotonic()
    host_order = list(dict.fromkeys(m.host for m in members))  # ranks are grouped by host
    for member in members:
        peers = [m for m in members if m.host == member.host]
        spec = rendezvous.RendezvousSpec(
            rank=member.rank, world_size=len(members),
            local_rank=peers.index(member), local_world_size=len(peers),
            node_rank=host_order.index(member.host), nodes=len(host_order),
            master_addr=addr, master_port=port, backend=backend,
            timeout_s=timeout_s, generation=generation, store_path=store,
        )
        pending.append((member, pool.client[member.engine_id].apply_async(rendezvous.join, spec.to_dict())))
    deadline = time.monotonic() + min(timeout_s, 120) + 10
    waiting, lost = {member.rank: (member, result) for member, result in pending}, set()
    while waiting:
        concurrent.futures.wait([result for _, result in waiting.values()], timeout=POLL_S,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        for rank, (member, result) in list(waiting.items()):
            if result.ready():
                del waiting[rank]
                try:
                    member.device = result.get()["device"]
                except Exception as exc:
                    if not pool.gone_ranks([rank]):
                        raise FleetError(f"rank {rank} could not join the process group: {one_line(exc)}") from None
                    lost.add(rank)
        lost |= set(pool.gone_ranks(list(waiting)))
        if lost:
            return sorted(lost | set(waiting))
        if time.monotonic() > deadline:
            raise FleetError(f"rank {','.join(map(str, waiting))} did not join the process group "
                             f"within {deadline - started:.0f} s")
    return []
