"""Per-step manifests: what orbax does not check (checksums, shapes, dtypes, the config).

Orbax's atomic rename keeps a half-written step out of sight, but it neither checksums array
data nor notices a truncated file or a dtype change on restore. So every finalized step gets a
manifest, written after orbax renamed the step into place; a step without one is unverified:

- ``manifest.json``, by process 0: ``step``, ``config_hash``, ``meta``, ``process_count`` and per
  leaf path its ``shape``, ``dtype`` and ``crc32`` (of the C-order bytes of a fully replicated
  leaf; None for a sharded one), plus ``shards``: ``{"4:8,0:32": crc32}``, one per shard this
  process holds as replica 0, keyed by the shard's index (:func:`index_key`);
- ``manifest.process-<i>.json``, by each process ``i > 0``: the ``shards`` of its replica-0 shards.

Checksums are read from host copies (:class:`HostCopies`), so they can be computed off the main
thread; the NaN/Inf check runs on the devices (:func:`nonfinite_leaves`). On restore each process
checks the saved regions its device shards hold (:func:`checksum_problems`).
"""

from __future__ import annotations

import functools
import json
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from train import multihost
from train.durable import write_json

__all__ = [
    "CHECKPOINTED",
    "DELETING",
    "MANIFEST",
    "MANIFEST_PART",
    "ORBAX_TMP",
    "HostCopies",
    "checkpointed",
    "checksum_problems",
    "index_key",
    "leaf_records",
    "mark_checkpointed",
    "nonfinite_leaves",
    "read_manifest",
    "structure_problems",
    "write_manifest",
]

MANIFEST = "manifest.json"
MANIFEST_PART = "manifest.process-{}.json"  # the part written by process i > 0
ORBAX_TMP = ".orbax-checkpoint-tmp"
DELETING = ".deleting"  # a step being deleted: renamed first, so no half-deleted step is listed
# In the checkpoints folder once a step of the run was complete (every manifest part written):
# a run directory with it never starts from step 0 unless --restart, whatever was set aside.
CHECKPOINTED = ".checkpointed"


def index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    """A shard's index as a manifest key: ``start:stop`` per dimension, comma-separated.

    >>> index_key((slice(4, 8), slice(None)), (16, 3))
    '4:8,0:3'
    >>> index_key((), ())
    ''
    """
    bounds = (s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
    return ",".join(f"{start}:{stop}" for start, stop in bounds)


def _region(key: str) -> tuple[slice, ...]:
    return tuple(slice(*map(int, part.split(":"))) for part in key.split(",")) if key else ()


def _crc32(host: np.ndarray) -> int:
    # Of the C-order bytes: a region sliced out of a larger host copy sums like the one saved.
    return zlib.crc32(np.ascontiguousarray(host).view(np.uint8).data)


def _inexact(x: Any) -> bool:
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return jnp.issubdtype(dtype, jnp.inexact)


@functools.lru_cache(maxsize=64)  # a few shardings per run; evicting only recompiles
def _finite_fn(out_sharding: Any) -> Any:
    def flags(xs: list[jax.Array]) -> jax.Array:  # (n,) bool: leaf i holds no NaN/Inf
        return jnp.stack([jnp.isfinite(x).all() for x in xs])

    return jax.jit(flags, out_shardings=out_sharding)


def nonfinite_leaves(tree: Any) -> list[str]:
    """Paths of the float leaves of ``tree`` holding NaN or Inf.

    Reduced on the devices (one jitted program per device set, one small host transfer), so no
    host copy of the state is made. With several processes every one gets the same answer.

    >>> nonfinite_leaves({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf]), "n": jnp.arange(2)})
    ["['b']"]
    """
    flat = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]
    bad = [
        p
        for p, x in flat
        if not isinstance(x, jax.Array) and _inexact(x) and not np.isfinite(np.asarray(x)).all()
    ]
    groups: dict[frozenset[Any], list[tuple[str, jax.Array]]] = {}
    for p, x in flat:
        if isinstance(x, jax.Array) and _inexact(x):
            groups.setdefault(frozenset(x.sharding.device_set), []).append((p, x))
    for group in groups.values():
        named = [x.sharding for _, x in group if isinstance(x.sharding, NamedSharding)]
        # Replicated on the group's mesh, so every process reads the flags from its own device.
        flags = _finite_fn(NamedSharding(named[0].mesh, P()) if named else None)
        host = np.asarray(flags([x for _, x in group]).addressable_data(0))
        bad += [p for (p, _), ok in zip(group, host, strict=True) if not ok]
    order = {p: i for i, (p, _) in enumerate(flat)}
    return sorted(bad, key=order.__getitem__)


class HostCopies:
    """Host copies of the bytes a manifest checksums, so the crc32s can be computed later.

    Per leaf, this process checksums:

    - a fully replicated leaf (or a host value): the whole leaf, on process 0 only (``crc32``);
    - any other leaf: each addressable shard with ``replica_id`` 0, keyed by :func:`index_key`
      (``shards``); the shards of all processes together cover the leaf exactly once.

    Creating it starts the device-to-host copies (``copy_to_host_async``) of those shards;
    :meth:`take` waits for them, so the arrays may be donated or deleted afterwards (on CPU the
    host copies are views of the device buffers, as orbax's own are: while one is alive JAX does
    not donate its buffer, and a deleted buffer's memory lives on under it, so no value changes
    under a view); :meth:`records` computes the crc32s, in any thread, dropping each host copy
    once summed.

    >>> copies = HostCopies({"w": jnp.arange(4.0)})
    >>> copies.take()
    >>> copies.records()["['w']"]["crc32"] == leaf_records({"w": jnp.arange(4.0)})["['w']"]["crc32"]
    True
    """

    def __init__(self, tree: Any):
        main = multihost.is_main()
        # (path, shape, dtype, whole, [(key, array or host copy)])
        self._leaves: list[tuple[str, list[int], str, bool, list[tuple[str, Any]]]] = []
        for path, x in jax.tree_util.tree_leaves_with_path(tree):
            if not isinstance(x, jax.Array):
                x = np.asarray(x)
                whole, pieces = True, ([("", x)] if main else [])
            elif x.is_fully_replicated:
                # The replica orbax writes (replica 0) when it is here: its host copy is shared.
                shards = sorted(x.addressable_shards, key=lambda s: s.replica_id != 0)
                whole, pieces = True, ([("", shards[0].data)] if main else [])
            else:
                whole = False
                pieces = [
                    (index_key(s.index, x.shape), s.data)
                    for s in x.addressable_shards
                    if s.replica_id == 0
                ]
            for _, data in pieces:
                if isinstance(data, jax.Array):
                    data.copy_to_host_async()
            self._leaves.append(
                (jax.tree_util.keystr(path), list(x.shape), str(x.dtype), whole, pieces)
            )

    def take(self) -> None:
        """Waits for the host copies; after it the device arrays are no longer needed."""
        for *_, pieces in self._leaves:
            pieces[:] = [(key, np.asarray(data)) for key, data in pieces]

    def records(self) -> dict[str, dict[str, Any]]:
        """``{leaf path: {shape, dtype, crc32[, shards]}}`` (``crc32`` None for sharded leaves).

        A leaf's ``crc32`` is None on every process but 0, which writes the whole manifest.
        """
        out = {}
        for path, shape, dtype, whole, pieces in self._leaves:
            record: dict[str, Any] = {"shape": shape, "dtype": dtype, "crc32": None}
            if not whole:
                record["shards"] = {}
            while pieces:
                key, host = pieces.pop(0)
                if whole:
                    record["crc32"] = _crc32(host)
                else:
                    record["shards"][key] = _crc32(host)
                del host
            out[path] = record
        self._leaves = []
        return out


def leaf_records(tree: Any) -> dict[str, dict[str, Any]]:
    """``{leaf path: {shape, dtype, crc32[, shards]}}`` of a pytree of arrays, on this thread.

    See :class:`HostCopies` for what is checksummed (whole leaf or one crc32 per shard).
    """
    copies = HostCopies(tree)
    copies.take()
    return copies.records()


def checksum_problems(path: str, x: Any, record: dict[str, Any]) -> list[str]:
    """Where a restored leaf's bytes differ from its manifest record, as reasons.

    Checks every recorded region (the whole leaf, or one saved shard) that this process holds:
    each saved shard contained in one of its device shards (the same sharding, or a coarser one
    after a change of topology), and any region of a fully addressable leaf, read whole on the
    host. Host copies are made one device shard at a time. A saved region that no process holds
    whole (a finer sharding across hosts than the one saved) is not checked.

    Args:
      path: the leaf's path (for the message).
      x: the restored leaf, in its saved dtype.
      record: its manifest record (``crc32`` and/or ``shards``).
    """
    shape = tuple(x.shape)
    full = tuple(slice(0, n) for n in shape)
    pending: list[tuple[str | None, tuple[slice, ...], int]] = []
    if record.get("crc32") is not None:
        pending.append((None, full, int(record["crc32"])))
    pending += [(key, _region(key), int(crc)) for key, crc in record.get("shards", {}).items()]
    problems: list[str] = []

    def check(host: np.ndarray, origin: tuple[slice, ...], regions: list[Any]) -> None:
        for key, region, want in regions:
            rel = tuple(
                slice(r.start - o.start, r.stop - o.start)
                for r, o in zip(region, origin, strict=True)
            )
            got = _crc32(host[rel])
            if got != want:
                where = f"leaf {path}" if key is None else f"leaf {path} shard [{key}]"
                problems.append(
                    f"checksum: {where} does not match its manifest (crc32 "
                    f"{got:#010x}, manifest {want:#010x})"
                )

    def inside(region: tuple[slice, ...], origin: tuple[slice, ...]) -> bool:
        return all(
            o.start <= r.start and r.stop <= o.stop for r, o in zip(region, origin, strict=True)
        )

    if pending and isinstance(x, jax.Array):
        for shard in x.addressable_shards:  # replicas of one index: the first checks it
            origin = _region(index_key(shard.index, shape))
            mine = [r for r in pending if inside(r[1], origin)]
            if mine:
                check(np.asarray(shard.data), origin, mine)
                pending = [r for r in pending if r not in mine]
    if pending and (not isinstance(x, jax.Array) or x.is_fully_addressable):
        check(np.asarray(x), full, pending)  # regions spanning device shards: the whole leaf
    return problems


def write_manifest(step_dir: Path, manifest: dict[str, Any], *, process: int = 0) -> None:
    """Writes ``step_dir/manifest.json`` (process 0) or this process's part, atomically.

    Process 0 writes the whole manifest (``process_count``, per leaf shape, dtype, crc32 and its
    own shards' crc32s); process ``i > 0`` writes ``manifest.process-<i>.json`` holding
    ``{"step", "process", "shards": {leaf path: {index key: crc32}}}``. See :func:`write_json`.
    """
    write_json(step_dir / (MANIFEST if process == 0 else MANIFEST_PART.format(process)), manifest)


def mark_checkpointed(directory: Path, step: int) -> None:
    """Records that ``directory`` held a complete step (once; see :data:`CHECKPOINTED`)."""
    if not (directory / CHECKPOINTED).exists():
        write_json(directory / CHECKPOINTED, {"first_complete_step": step})


def checkpointed(directory: Path) -> bool:
    """Whether ``directory`` ever held a complete step (its :data:`CHECKPOINTED` marker)."""
    return (directory / CHECKPOINTED).exists()


def read_manifest(step_dir: Path) -> dict[str, Any]:
    """The step's manifest with every process's shards merged in.

    Raises:
      ValueError: ``no-manifest: ...`` if it or a process's part is missing (the save did not
        finish), ``bad-manifest: ...`` if one is unreadable.
    """
    path = step_dir / MANIFEST
    if not path.exists():
        raise ValueError("no-manifest: no manifest.json (the save did not finish)")
    try:
        manifest = json.loads(path.read_text())
        leaves = manifest["leaves"]
        leaves.items()
        count = int(manifest.get("process_count", 1))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"bad-manifest: manifest.json is unreadable ({e})") from None
    for i in range(1, count):
        part = step_dir / MANIFEST_PART.format(i)
        if not part.exists():
            raise ValueError(f"no-manifest: no {part.name} (process {i} did not finish the save)")
        try:
            for leaf, shards in json.loads(part.read_text())["shards"].items():
                leaves[leaf].setdefault("shards", {}).update(shards)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"bad-manifest: {part.name} is unreadable ({e})") from None
    return manifest


def structure_problems(
    saved: dict[str, dict[str, Any]], expected: dict[str, Any], *, allow_dtype_cast: bool
) -> list[str]:
    """Every leaf whose path, shape or dtype differs, as ``path: saved ..., expected ...``."""

    def show(r: dict[str, Any] | None) -> str:
        return "(absent)" if r is None else f"{tuple(r['shape'])} {r['dtype']}"

    problems = []
    for path in sorted(set(saved) | set(expected)):
        s, e = saved.get(path), expected.get(path)
        if s is not None and e is not None and s["shape"] == e["shape"]:
            if s["dtype"] == e["dtype"] or allow_dtype_cast:
                continue
        problems.append(f"  {path}: saved {show(s)}, expected {show(e)}")
    return problems
