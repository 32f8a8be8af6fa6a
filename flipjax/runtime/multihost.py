"""Several processes, one engine: joining a `jax.distributed` cluster, and agreeing to serve.

flipjax uses JAX's multi-controller model: every process runs the same programs over one global
mesh and the collectives cross hosts (gloo on CPUs, NCCL on GPUs, ICI/DCN on TPUs). Process 0
serves and schedules; the others follow its plan (`flipjax.runtime.mirror`).

`initialize` takes the arguments of `jax.distributed.initialize` (and the CLI flags named after
them). Without them it joins a cluster JAX detects by itself (SLURM, Open MPI, Kubernetes) and
otherwise stays single-process. It must run before any JAX computation. `agree` refuses a start
where processes differ in checkpoint, config or flags, naming the first difference.
"""

from __future__ import annotations

import atexit
import json
import logging
from dataclasses import dataclass

import jax
import numpy as np
from jax._src import clusters, distributed
from jax.experimental import multihost_utils

log = logging.getLogger("flipjax.multihost")

_FACTS_BYTES = 16384  # room for one process's start facts in the agreement
EXIT_WAIT_S = 120  # how long a finished process waits for the others before it leaves anyway


class ClusterMismatch(RuntimeError):
    """The processes of a cluster were started differently; nothing was served."""


class ProcessLost(Exception):
    """A process of the cluster died; the engine cannot step any more."""

    def __init__(self, lost: list[int], cause: BaseException | None = None):
        self.lost = lost
        names = ", ".join(f"process {i}" for i in lost) or "a process (unknown which)"
        super().__init__(f"{names} of the cluster lost" + (f": {cause}" if cause else ""))


@dataclass(frozen=True)
class Cluster:
    process_id: int = 0
    num_processes: int = 1
    coordinator_address: str | None = None

    @property
    def multi(self) -> bool:
        return self.num_processes > 1

    @property
    def leader(self) -> bool:
        return self.process_id == 0


_cluster = Cluster()


def current() -> Cluster:
    """The cluster this process joined (one process unless `initialize` joined more)."""
    return _cluster


def initialize(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    heartbeat_timeout_s: int,
) -> Cluster:
    """Join the cluster (see the module doc); a process that stops answering for
    `heartbeat_timeout_s` is lost (`DistributedConfig` holds the defaults)."""
    global _cluster
    given = (coordinator_address, num_processes, process_id)
    if all(v is None for v in given) and not _cluster_detected():
        return _cluster
    if _cluster.multi:
        raise RuntimeError("flipjax: the cluster is already initialized in this process")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A lost process must leave the others running, so that they can report it.
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
    )
    # Runs before JAX's own exit hook (registered at import), which shuts the client down.
    atexit.register(_leave_together)
    state = distributed.global_state  # what was given, or what JAX detected
    coordinator_address = state.coordinator_address
    _cluster = Cluster(state.process_id, state.num_processes, coordinator_address)
    log.info(
        "process %d of %d, coordinator %s: %d local of %d devices",
        _cluster.process_id,
        _cluster.num_processes,
        coordinator_address,
        jax.local_device_count(),
        jax.device_count(),
    )
    return _cluster


def agree(facts: dict[str, object]) -> None:
    """Check that every process was started with the same `facts` (checkpoint, config, flags);
    `ClusterMismatch` naming the first difference otherwise, raised in every process."""
    if not _cluster.multi:
        return
    mine = json.dumps(facts, sort_keys=True, default=str).encode()
    if len(mine) > _FACTS_BYTES - 4:
        raise ValueError(f"agree: {len(mine)} bytes of start facts, at most {_FACTS_BYTES - 4}")
    frame = np.zeros(_FACTS_BYTES, np.uint8)
    frame[:4] = np.frombuffer(np.uint32(len(mine)).tobytes(), np.uint8)
    frame[4 : 4 + len(mine)] = np.frombuffer(mine, np.uint8)
    frames = np.asarray(multihost_utils.process_allgather(frame))
    every = [json.loads(bytes(f[4 : 4 + int(f[:4].view(np.uint32)[0])])) for f in frames]
    first = every[0]
    for pid, other in enumerate(every[1:], start=1):
        for key in sorted(set(first) | set(other)):
            if first.get(key) != other.get(key):
                raise ClusterMismatch(
                    f"process {pid} was started with {key}={other.get(key)!r}, but process 0 "
                    f"with {key}={first.get(key)!r}; start every process with the same "
                    "checkpoint, config and flags"
                )


def lost_processes() -> list[int]:
    """The processes the coordinator no longer hears from (waits up to the heartbeat timeout
    for a process that has just died; call it only once a collective has failed)."""
    if not _cluster.multi:
        return []
    client = distributed.global_state.client
    if client is None:
        return []
    everyone = list(range(_cluster.num_processes))
    live = client.get_live_nodes(everyone)
    return [p for p in everyone if p not in live]


def _leave_together() -> None:
    """With recoverable tasks the coordinator's shutdown barrier waits for no one, so process 0
    could stop the coordination service while another process is still finishing or still
    disconnecting, and that process would abort on its way out. So every process meets here,
    the others disconnect, and process 0 stops the service once they are gone: asking which of
    all the processes are alive is itself a barrier, which a process passes by calling it or
    by leaving (the others leave)."""
    state = distributed.global_state
    if state.client is None:
        return
    try:
        state.client.wait_at_barrier("flipjax-exit", EXIT_WAIT_S * 1000)
    except Exception as err:  # JaxRuntimeError: a process died, or is still busy
        log.warning("process %d leaves without the others: %s", _cluster.process_id, err)
        return
    if not _cluster.leader:
        state.shutdown()
        return
    try:
        state.client.get_live_nodes(list(range(_cluster.num_processes)))  # returns once they left
    except Exception as err:  # JaxRuntimeError: the service could not answer
        log.warning("process 0 could not see the others leave: %s", err)
    state.shutdown()


def _cluster_detected() -> bool:
    # As `jax.distributed.initialize` does: the opt-in kinds (mpi4py) only when asked for.
    kinds = clusters.ClusterEnv._cluster_types
    return any(env.is_env_present() for env in kinds if not env.opt_in_only_method)
