"""What a process finds wrong with a checkpoint step, and the verdict every process agrees on.

A step's manifest or bytes give one verdict per process (:data:`OK` ... :data:`CONFIG`);
:func:`agree` combines them, the worst winning, so every process restores, sets aside or
refuses the same step. A storage error (:func:`storage_failure`) is no evidence of damage.
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from train import multihost

__all__ = [
    "BAD_MANIFEST",
    "CHECKSUM",
    "CONFIG",
    "CONFIG_CHANGED",
    "KINDS",
    "MISFIT",
    "OK",
    "STORAGE",
    "UNFINISHED",
    "UNREADABLE",
    "Damaged",
    "SetAside",
    "agree",
    "storage_failure",
    "storage_message",
    "unreadable",
]


def unreadable(step_dir: Path, error: Exception, tree: dict[str, Any]) -> str:
    """Why orbax could not read a step, naming the leaf when TensorStore's error gives its
    kvstore path (``'path': 'params.Dense_0.kernel/'``) and the file when orbax's tree metadata
    is gone (orbax then reports only a pytree structure error)."""
    if not (step_dir / "state" / "_METADATA").exists():
        return "unreadable: state/_METADATA is missing (orbax's tree metadata)"
    message = str(error)
    first = message.strip().splitlines()[0][:300] if message.strip() else ""
    dotted = {_orbax_key(path): path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}
    named = [p for p in re.findall(r"'path': '([^'/][^']*?)/?'", message) if p in dotted]
    leaf = f"leaf {jax.tree_util.keystr(dotted[named[-1]])}: " if named else ""
    return f"unreadable: {leaf}{type(error).__name__}: {first}"


def _orbax_key(path: tuple[Any, ...]) -> str:
    # The name orbax stores a leaf under: ['opt_state'][0][0].trace -> opt_state.0.0.trace
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


@dataclass
class SetAside:
    """The steps one :meth:`train.checkpoint.Checkpointer.restore_latest` moved aside, as warning
    lines."""

    damaged: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)  # no manifest: killed before writing it
    lines: list[str] = field(default_factory=list)  # both, newest first

    def add(self, line: str, *, unfinished: bool) -> None:
        self.lines.append(line)
        (self.unfinished if unfinished else self.damaged).append(line)


class Damaged(ValueError):
    """A restored step whose bytes do not match its manifest."""


# A process's verdict on a step. Combined over processes by the largest, so this is also the
# order of precedence: a refusal (raised) over damage (set aside) over an unfinished save.
OK, UNFINISHED, BAD_MANIFEST, UNREADABLE, CHECKSUM, STORAGE, MISFIT, CONFIG = range(8)
KINDS = {
    UNFINISHED: "no-manifest",
    BAD_MANIFEST: "bad-manifest",
    UNREADABLE: "unreadable",
    CHECKSUM: "checksum",
    STORAGE: "storage-error",
    MISFIT: "misfit",
    CONFIG: "config-changed",
}

CONFIG_CHANGED = """\
checkpoint step {step} in {directory} was written with another config (config hash {written}, \
this run's {now}): the config changed since it was written, in keys that change what the run \
computes. Fix: rerun with the run's config (config.yaml in the run directory), pass \
--allow-config-change to resume this state with the new config, or --restart to start at step 0."""


# Errors of the storage rather than of the bytes stored: the step may read fine once it is back.
_STORAGE_ERRNOS = {
    errno.EIO,
    errno.EAGAIN,
    errno.EACCES,
    errno.EPERM,
    errno.ETIMEDOUT,
    errno.ESTALE,
    errno.ENOTCONN,
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.EHOSTDOWN,
    errno.EHOSTUNREACH,
    errno.ENETDOWN,
    errno.ENETUNREACH,
    errno.ENOMEM,
    errno.EMFILE,
    errno.ENFILE,
    errno.EINTR,
}
# TensorStore's status codes for the same (its errors are ValueErrors named by their status).
_STORAGE_STATUSES = (
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "ABORTED",
    "CANCELLED",
)


def storage_failure(error: BaseException) -> bool:
    """Whether ``error`` (or its cause) is the storage failing rather than the bytes stored."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in _STORAGE_ERRNOS:
            return True
        if str(cause).lstrip().startswith(_STORAGE_STATUSES):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def storage_message(step: int, directory: Path, reason: str) -> str:
    """The message of a :class:`train.errors.CheckpointUnavailableError`."""
    return (
        f"reading checkpoint step {step} in {directory} failed with a storage error ({reason}). "
        "That is no evidence of damage: nothing was set aside and training did not start. Fix: "
        "rerun the same command once the storage is reachable again."
    )


def agree(code: int, reason: str) -> tuple[int, str]:
    """The verdict of the process that found the worst, so every process accepts, sets aside or
    refuses the same step; the reason is local when it is ours."""
    worst, who = multihost.worst_verdict(code)
    if who is None:
        return code, reason
    return worst, f"{KINDS[worst]}: found by process {who}, whose log says where"
