"""``init_from: {path, what}``: start a fresh run from another run's checkpoint.

``what: params`` takes the model's variables (parameters and BatchNorm statistics) and makes the
optimizer state, step and rng afresh (fine-tuning); ``what: all`` takes the whole train state,
so the run continues at the source's step count on its learning-rate schedule, with this run's
data order from its start. Only a run with no checkpoint of its own starts this way: once it
has saved, it resumes from its own checkpoints.

The source step is the newest one with a manifest (or the step directory named); the leaves
taken are checked against the manifest before restoring (a leaf whose path, shape or dtype
differs is named) and their bytes against its checksums after.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from train import manifest as manifest_lib
from train.config import InitFrom
from train.donation import rematerialize
from train.errors import CheckpointError
from train.state import TrainState

__all__ = ["init_state", "source_step"]

# The TrainState fields each choice takes from the source.
_FIELDS = {"params": ("params", "batch_stats"), "all": TrainState._fields}


def source_step(path: str | Path) -> Path:
    """The step directory ``path`` names: itself, or the newest step with a manifest under it
    (``path`` a run directory or its ``checkpoints/``).

    Raises:
      CheckpointError: no such directory, or no step with a manifest under it.
    """
    p = Path(path).expanduser().absolute()
    if p.name.isdigit() and (p / manifest_lib.MANIFEST).exists():
        return p
    ckpts = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    steps = sorted(
        (
            int(d.name)
            for d in ckpts.iterdir()
            if d.name.isdigit() and (d / manifest_lib.MANIFEST).exists()
        )
        if ckpts.is_dir()
        else []
    )
    if not steps:
        raise CheckpointError(
            f"init_from.path={str(path)!r}: no finished checkpoint there (looked for step "
            f"directories with a {manifest_lib.MANIFEST} in {ckpts}). Fix: a run directory, its "
            "checkpoints/ directory, or one step directory of a run that saved."
        )
    return ckpts / str(steps[-1])


def init_state(spec: InitFrom, abstract: TrainState, fresh: TrainState) -> TrainState:
    """``fresh`` with the fields ``spec.what`` names replaced by the source step's values.

    Args:
      spec: the config's ``init_from``.
      abstract: this run's train state as ShapeDtypeStructs with shardings.
      fresh: this run's initial state (its replaced leaves are deleted).

    Raises:
      CheckpointError: no source step; a leaf taken differs in path, shape or dtype from this
        run's (each is listed); the bytes do not match the source's checksums.
    """
    step_dir = source_step(spec.path)
    fields = _FIELDS[spec.what]
    target = {f: getattr(abstract, f) for f in fields}
    manifest = manifest_lib.read_manifest(step_dir)
    _check_structure(manifest["leaves"], target, step_dir, spec.what)
    restored = ocp.PyTreeCheckpointer().restore(
        step_dir / "state",
        args=ocp.args.PyTreeRestore(
            target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True,
        ),
    )
    for path, x in jax.tree_util.tree_leaves_with_path(restored):
        problems = manifest_lib.checksum_problems(
            jax.tree_util.keystr(path), x, manifest["leaves"][jax.tree_util.keystr(path)]
        )
        if problems:
            raise CheckpointError(
                f"init_from: {step_dir} is damaged: {problems[0]}. Fix: another step of that "
                "run (name its step directory), or repair the source run."
            )
    # Fresh XLA-owned buffers, so the first step donates them (jax#18617).
    restored = rematerialize(restored, jax.tree.map(lambda a: a.sharding, target))
    for f in fields:
        jax.tree.map(lambda x: x.delete(), getattr(fresh, f))
    return fresh._replace(**restored)


def _check_structure(
    saved: dict[str, dict[str, Any]], target: dict[str, Any], step_dir: Path, what: str
) -> None:
    expected = {
        jax.tree_util.keystr(p): {"shape": list(x.shape), "dtype": str(x.dtype)}
        for p, x in jax.tree_util.tree_flatten_with_path(target)[0]
    }
    prefixes = tuple(f"['{f}']" for f in target)
    taken = {k: v for k, v in saved.items() if k.startswith(prefixes)}
    problems = manifest_lib.structure_problems(taken, expected, allow_dtype_cast=False)
    if problems:
        raise CheckpointError(
            f"init_from: {step_dir} does not fit this run's "
            f"{'model' if what == 'params' else 'train state'} (init_from.what={what}: "
            f"{len(problems)} leaves differ, saved vs this run's):\n"
            + "\n".join(problems)
            + "\nFix: the same model and model.options as the source run (its config.yaml)"
            + (
                ", or init_from.what=params to take only the model's variables"
                if what == "all"
                else ""
            )
            + "."
        )
