"""torch.distributed set-up and tear-down, run on the engines.

Single-host fleets rendezvous through a ``FileStore`` in the fleet's private
runtime folder and bind gloo to loopback, so nothing listens beyond localhost.
Fleets that span hosts use TCP on ``MASTER_ADDR:MASTER_PORT`` (rank 0's host).
The chosen ``MASTER_ADDR``/``MASTER_PORT`` are exported on every rank either
way, for code that reads them.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from datetime import timedelta

from workbench.links import route_address
from workbench.messages import Identity, Joined

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class RendezvousSpec:
    """Everything one rank needs to join the process group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    backend: str
    timeout_s: float
    generation: int
    store_path: str | None = None  # FileStore for single-host fleets
    node_rank: int = 0  # this rank's host, in the order of the hosts' first ranks
    nodes: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


def identify() -> Identity:
    """Who this engine is: its slot (set by the fleet at launch), pid, host and GPU. The engines of
    one Slurm job share ``WORKBENCH_SLOTS`` (``3,4``): each takes the one of its task (SLURM_PROCID)."""
    if "WORKBENCH_SLOTS" in os.environ:
        slot = int(os.environ["WORKBENCH_SLOTS"].split(",")[int(os.environ.get("SLURM_PROCID", "0"))])
    else:
        slot = int(os.environ.get("WORKBENCH_SLOT", "-1"))
    return Identity(slot=slot, pid=os.getpid(), host=hostname(), gpu=os.environ.get("CUDA_VISIBLE_DEVICES"))


def free_port(loopback: bool = True) -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK if loopback else "", 0))
        return sock.getsockname()[1]


def hostname() -> str:
    """This engine's host name; ``WORKBENCH_HOSTNAME`` overrides it (simulated nodes in tests)."""
    return os.environ.get("WORKBENCH_HOSTNAME") or socket.gethostname()


def host_address(peer: str | None = None) -> str:
    """An address of this host that other hosts can reach: the one of the interface that routes to
    ``peer`` (another rank's host), never a loopback one (``gethostbyname(getfqdn())`` is 127.0.1.1
    on many Debian hosts); loopback for a simulated node."""
    if os.environ.get("WORKBENCH_HOSTNAME"):
        return LOOPBACK
    if peer:
        try:
            address = route_address(peer)
            if not address.startswith("127."):
                return address
        except OSError:
            pass
    address = socket.gethostbyname(socket.getfqdn())
    if address.startswith("127."):
        raise RuntimeError(f"rank 0's host {socket.gethostname()} resolves to the loopback address {address} and no "
                           f"route to {peer or 'the other hosts'} was found; give --master-addr ADDRESS")
    return address


def join(spec: dict) -> Joined:
    """Join the process group described by ``spec`` (a :class:`RendezvousSpec` dict)."""
    import torch
    import torch.distributed as dist

    from workbench.rank_state import STATE, apply_memory_limit

    spec = RendezvousSpec(**spec)
    leave()
    os.environ.update(
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(spec.local_rank),
        LOCAL_WORLD_SIZE=str(spec.local_world_size),
        NODE_RANK=str(spec.node_rank),
        GROUP_RANK=str(spec.node_rank),  # torchrun's name for it
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
    )
    if spec.master_addr == LOOPBACK:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if os.environ.get("CUDA_VISIBLE_DEVICES") and torch.cuda.is_available():
        # a local fleet gives each engine exactly one GPU (cuda:0); engines started by a cluster
        # launcher see the node's GPUs and take the one of their local rank
        device = torch.device("cuda", spec.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    elif os.environ.get("CUDA_VISIBLE_DEVICES"):
        raise RuntimeError(
            f"engine was given GPU {os.environ['CUDA_VISIBLE_DEVICES']} but torch sees no CUDA device "
            "(is this a CPU build of torch?)"
        )
    else:
        device = torch.device("cpu")
    _accelerate_launch_environment(device)
    before = _tcp_connections()
    timeout = timedelta(seconds=spec.timeout_s)
    kwargs = dict(backend=spec.backend, rank=spec.rank, world_size=spec.world_size, timeout=timeout)
    # torch names groups by a per-process count; every rank starts this generation's count at the
    # same place, past the names older generations used: objects a survivor still holds from
    # them (a model's DeviceMesh) then never resolve, or unregister, a group of this one
    dist.distributed_c10d._world.group_count = spec.generation * GROUP_NAMES_PER_GENERATION
    if spec.store_path:
        store = dist.FileStore(spec.store_path, spec.world_size)
        dist.init_process_group(store=store, **kwargs)
    else:
        dist.init_process_group(init_method=f"tcp://{spec.master_addr}:{spec.master_port}", **kwargs)
    STATE.joined(spec, device, _tcp_connections() - before, dist.distributed_c10d._get_default_group())
    apply_memory_limit()
    return Joined(rank=spec.rank, device=str(device), backend=dist.get_backend())


def _accelerate_launch_environment(device) -> None:
    """What ``accelerate launch`` exports for its processes, so that user code building its own
    ``Accelerator()`` / ``PartialState()`` gets the same distributed environment as ours."""
    if device.type == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "True"  # else accelerate sees no distributed CPU run
    else:
        os.environ.pop("ACCELERATE_USE_CPU", None)
    if device.type == "cuda" and device.index != int(os.environ["LOCAL_RANK"]):
        # one GPU per engine: cuda:0 is this rank's GPU, not cuda:LOCAL_RANK as accelerate's DDP
        # wrapper assumes (device_ids=[local rank]); DDP then takes the model's own device
        os.environ["ACCELERATE_BYPASS_DEVICE_MAP"] = "true"


def _tcp_connections() -> set[tuple]:
    import psutil

    return {
        (c.laddr, c.raddr)
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.status == psutil.CONN_ESTABLISHED
    }


def sever(peer_pids: list[int] = ()) -> int:
    """Shut down this rank's connections to its peers; returns how many.

    Peers blocked in a gloo collective with this rank then fail at once with
    "Connection closed by peer". Destroying the process group is not enough:
    a prepared model (DDP, FSDP) keeps the group, and its sockets, alive.
    The connections are those the rendezvous opened, plus any to local peer
    engines (groups made later with ``new_group``).
    """
    import psutil

    from workbench.rank_state import STATE

    targets = set(STATE.pg_sockets)
    peer_ports = set()
    for pid in peer_pids:
        try:
            peer_ports |= {c.laddr for c in psutil.Process(pid).net_connections(kind="tcp") if c.laddr}
        except psutil.Error:
            pass
    count = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.fd < 0 or not conn.raddr:
            continue
        if (conn.laddr, conn.raddr) in targets or conn.raddr in peer_ports:
            try:
                with socket.socket(fileno=os.dup(conn.fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:
                pass
    return count


GROUP_NAMES_PER_GENERATION = 10_000


def leave(peer_pids: list[int] = ()) -> None:
    """Release peers, destroy this rank's process group and accelerate's singletons."""
    from workbench.rank_state import STATE

    if peer_pids:
        sever(peer_pids)
    STATE.left()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group may fail to close; it is gone either way
            pass
    if dist.is_available():
        # a failed init_process_group still counted its groups: without this the rank's next
        # groups get other names than its fresh peers' and never match (what destroy would reset)
        dist.distributed_c10d._world.group_count = 0
    try:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)
    except ImportError:
        pass



def healthy(timeout_s: float = 5.0) -> bool:
    """Whether every rank still answers on the current process group (gloo only)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    if dist.get_backend() != "gloo":
        return False  # no cheap check with a timeout: the caller rebuilds
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        return True
    except Exception:
        return False
