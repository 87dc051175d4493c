"""Device mesh, shardings and multi-process setup.

The mesh has two axes, ``data`` and ``fsdp``. Batches are split over both (every device sees
different examples); parameters and optimizer state are split over ``fsdp`` (each array along
its largest dimension that ``fsdp`` divides; small arrays stay replicated). With ``fsdp: 1``
that is plain data parallelism. The same code runs on CPU, GPU and TPU: nothing here assumes a
platform, and a batch size per device scales with the mesh.

>>> from train.config import Mesh
>>> mesh = make_mesh(Mesh(data=-1, fsdp=2))
>>> dict(mesh.shape)
{'data': 4, 'fsdp': 2}
>>> array_sharding(jax.ShapeDtypeStruct((64, 32), jnp.float32), mesh, min_size=0).spec
P('fsdp', None)
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from train.config import Distributed, Mesh
from train.errors import SetupError

__all__ = [
    "BATCH_AXES",
    "array_sharding",
    "batch_sharding",
    "global_batch",
    "initialize_distributed",
    "make_mesh",
    "per_device_bytes",
    "replicated",
    "state_shardings",
]

BATCH_AXES = ("data", "fsdp")


def initialize_distributed(cfg: Distributed, *, auto: bool = False) -> bool:
    """Calls ``jax.distributed.initialize`` when more than one process is configured or detected.

    Explicit values come from the config (or CLI flags), else from ``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``. With none of them, a Slurm job step or an
    Open MPI launch of more than one task is detected from its environment, and
    ``jax.distributed.initialize()`` is called without arguments so that JAX reads the
    coordinator, the process count and id from the cluster (as it also does for TPU pods and
    Kubernetes, whose detection queries a metadata server: ask for it with ``auto=True``,
    the CLI's ``--distributed-auto``). Must run before any JAX computation.

    Returns:
      Whether the distributed system was initialised.

    Raises:
      SetupError: a process count without a coordinator or id, or ``auto`` finding no cluster.
    """
    address = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    env_n, env_id = os.environ.get("JAX_NUM_PROCESSES"), os.environ.get("JAX_PROCESS_ID")
    num = cfg.num_processes or _env_count("JAX_NUM_PROCESSES", env_n, least=1)
    pid = cfg.process_id if cfg.process_id is not None else _env_count("JAX_PROCESS_ID", env_id)
    if address is None and num is None and pid is None:
        cluster = _detected_cluster()
        if not (auto or cluster):
            return False
        _enable_cpu_collectives()
        try:
            # JAX reads the cluster's environment.
            jax.distributed.initialize(heartbeat_timeout_seconds=cfg.heartbeat_timeout)
        except (ValueError, RuntimeError) as e:
            raise SetupError(
                f"distributed: automatic set-up ({cluster or 'requested by --distributed-auto'}) "
                f"failed: {e}. Fix: pass --coordinator HOST:PORT --num-processes N "
                "--process-id I explicitly."
            ) from e
        return True
    if not num or num == 1:
        return False
    if address is None or pid is None:
        raise SetupError(
            f"distributed: num_processes={num} needs a coordinator address and a process id; "
            f"got address={address!r}, process_id={pid!r}. Fix: --coordinator HOST:PORT "
            "--process-id I (or JAX_COORDINATOR_ADDRESS / JAX_PROCESS_ID)."
        )
    _enable_cpu_collectives()
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=num,
        process_id=pid,
        heartbeat_timeout_seconds=cfg.heartbeat_timeout,
    )
    return True


def _env_count(name: str, value: str | None, *, least: int = 0) -> int | None:
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        n = least - 1
    if n < least:
        raise SetupError(
            f"distributed: {name}={value!r} is not an integer >= {least}. Fix: set it to the "
            f"{'number of processes' if least else 'process id (0, 1, ...)'}, or unset it."
        )
    return n


def _detected_cluster() -> str | None:
    # Launchers that say in their environment that they started several processes.
    env = os.environ
    if "SLURM_JOB_ID" in env and "SLURM_STEP_NODELIST" in env and _int(env, "SLURM_NTASKS") > 1:
        return f"Slurm job {env['SLURM_JOB_ID']}, {env['SLURM_NTASKS']} tasks"
    if "OMPI_MCA_orte_hnp_uri" in env and _int(env, "OMPI_COMM_WORLD_SIZE") > 1:
        return f"Open MPI, {env['OMPI_COMM_WORLD_SIZE']} processes"
    return None


def _int(env: Any, key: str) -> int:
    try:
        return int(env.get(key, "1"))
    except ValueError:
        return 1


def _enable_cpu_collectives() -> None:
    # Cross-process collectives of the CPU backend (a no-op for GPU/TPU devices): without it
    # a multi-process CPU run cannot all-reduce.
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def make_mesh(cfg: Mesh, devices: list[Any] | None = None) -> jax.sharding.Mesh:
    """The ``(data, fsdp)`` mesh over ``devices`` (default: all devices of all processes).

    With both sizes given and their product smaller than the device count, the mesh uses the
    first ``data * fsdp`` devices (e.g. ``mesh: {data: 1, fsdp: 1}`` runs on one device).
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    data, fsdp = cfg.data, cfg.fsdp
    if data == -1:
        data = n // fsdp if n % fsdp == 0 else 0
    if fsdp == -1:
        fsdp = n // data if n % data == 0 else 0
    if data * fsdp == 0 or data * fsdp > n:
        raise SetupError(
            f"mesh: data={cfg.data} x fsdp={cfg.fsdp} does not fit the {n} devices. Fix: sizes "
            f"whose product divides {n}, or -1 for one axis."
        )
    if data * fsdp < n and jax.process_count() > 1:
        raise SetupError(
            f"mesh: data={data} x fsdp={fsdp} leaves devices unused in a {jax.process_count()}-"
            "process run; every process needs devices in the mesh. Fix: use -1 for one axis."
        )
    return jax.make_mesh(
        (data, fsdp),
        BATCH_AXES,
        axis_types=(AxisType.Auto, AxisType.Auto),
        devices=devices[: data * fsdp],
    )


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Leading (batch) dimension split over every device of the mesh."""
    return NamedSharding(mesh, P(BATCH_AXES))


def array_sharding(x: Any, mesh: jax.sharding.Mesh, *, min_size: int) -> NamedSharding:
    """FSDP sharding of one state array: its largest dimension divisible by ``fsdp``."""
    n = mesh.shape["fsdp"]
    if n == 1 or x.ndim == 0 or math.prod(x.shape) < min_size:
        return replicated(mesh)
    for dim in sorted(range(x.ndim), key=lambda d: -x.shape[d]):
        if x.shape[dim] % n == 0:
            spec = [None] * x.ndim
            spec[dim] = "fsdp"
            return NamedSharding(mesh, P(*spec))
    return replicated(mesh)


def state_shardings(abstract_state: Any, mesh: jax.sharding.Mesh, *, min_size: int) -> Any:
    """A sharding for every leaf of the train state (optimizer state follows param shapes)."""
    return jax.tree.map(lambda x: array_sharding(x, mesh, min_size=min_size), abstract_state)


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Assembles each process's rows into global arrays split over the batch axes."""
    n = jax.process_count()
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (v.shape[0] * n, *v.shape[1:]))
        for k, v in local.items()
    }


def per_device_bytes(tree: Any) -> int:
    """Bytes of ``tree`` held on one device (the largest shard of each array)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total
