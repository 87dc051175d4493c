"""What checkpointing costs at scale: the train step's time on save, device memory on restore.

Issue #14. A save checks NaN/Inf on the devices and leaves the crc32s to its background thread
(the host copies are taken before ``save`` returns, since the caller donates the state right
after); sharded leaves are checksummed per shard; a restore holds the state plus one leaf, never
two states; a step written with another config is refused unless allowed. Runs in-process on
the 8 fake CPU devices of conftest.py, except the two-process test (localhost, subprocesses).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.ports import held_port
from tests.trainer_cli import child_xla_flags
from train import checkpoint as ckpt_lib
from train import donation, multihost
from train import manifest as manifest_lib
from train.checkpoint import Checkpointer
from train.config import Checkpoint
from train.donation import rematerialize
from train.errors import CheckpointError, CheckpointUnavailableError
from train.state import TrainState

ROOT = Path(__file__).resolve().parents[2]
CFG = Checkpoint(every=1, keep=5, keep_best=0)


def make_state(
    seed: int = 0, *, leaves: int = 2, rows: int = 16, cols: int = 64, flip: tuple[str, int] = ()
) -> TrainState:
    """A train state over the 8 devices (of one or two processes): params ``w*`` and ``mu``
    FSDP-sharded by rows, the rest replicated. ``flip=("w1", r)`` flips one byte of row ``r``."""
    mesh = jax.make_mesh((8,), ("fsdp",))
    fsdp, rep = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
    rng = np.random.default_rng(seed)

    def normal(name: str, sharding: NamedSharding, shape=(rows, cols)) -> jax.Array:
        value = rng.standard_normal(shape, dtype=np.float32)
        if flip and flip[0] == name:
            value.view(np.uint8).reshape(rows, -1)[flip[1], 0] ^= 0x01  # still finite
        return jax.device_put(value, sharding)

    params = {f"w{i}": normal(f"w{i}", fsdp) for i in range(leaves)}
    params["b"] = normal("b", rep, (cols,))
    return TrainState(
        step=jax.device_put(np.int32(7), rep),
        params=params,
        opt_state={"mu": normal("mu", fsdp)},
        batch_stats={},
        rng=jax.device_put(np.zeros(2, np.uint32), rep),
    )


def abstract(state: TrainState) -> TrainState:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def host(state: TrainState) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(state)]


def assert_equal(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
        assert x.dtype == y.dtype


def entries(directory: Path) -> list[str]:
    """The step directories (and set-aside ones) of a checkpoints folder, without dot files."""
    return sorted(n for n in os.listdir(directory) if not n.startswith("."))


def checkpointer(directory: Path, **kw) -> Checkpointer:
    warnings: list[str] = kw.pop("warnings", [])
    return Checkpointer(directory, CFG, warn=warnings.append, **kw)


@pytest.fixture
def gated_writer(monkeypatch):
    """Holds the background manifest writer until ``gate.set()``: what save() left to it has
    not started when save() returns."""
    gate = threading.Event()
    real = Checkpointer._write_manifest

    def held(self, *args):
        assert gate.wait(60)
        real(self, *args)

    monkeypatch.setattr(Checkpointer, "_write_manifest", held)
    yield gate
    gate.set()  # a failed test must not leave the writer waiting


# --- save: the step is not held for the checksums -------------------------------------------------


def test_save_leaves_the_crc32s_to_the_background_writer(tmp_path, monkeypatch, gated_writer):
    threads: list[threading.Thread] = []
    real_crc = manifest_lib._crc32

    def crc(host):
        threads.append(threading.current_thread())
        return real_crc(host)

    monkeypatch.setattr(manifest_lib, "_crc32", crc)
    ck = checkpointer(tmp_path)
    assert ck.save(1, make_state())
    assert threads == []  # save() returned without a single checksum
    gated_writer.set()
    ck.wait()
    ck.close()
    # One per replicated leaf, one per shard of a sharded one: 3 sharded x 8 + 3 replicated.
    assert len(threads) == 3 * 8 + 3
    assert all(t is not threading.main_thread() for t in threads)
    manifest = manifest_lib.read_manifest(tmp_path / "1")
    assert all(r["crc32"] is not None or len(r["shards"]) == 8 for r in manifest["leaves"].values())


def test_state_deleted_as_soon_as_save_returns_is_still_checksummed(tmp_path, gated_writer):
    # The loop donates the state to the next step right after save(): the bytes the writer
    # checksums must already be on the host (a copy taken in the background would fail here).
    state = make_state()
    before = host(state)
    ck = checkpointer(tmp_path)
    assert ck.save(1, state)
    for x in jax.tree.leaves(state):
        x.delete()
    gated_writer.set()
    ck.wait()
    restored, meta, step = ck.restore_latest(abstract(make_state()))
    ck.close()
    assert step == 1 and meta == {"step": 1}
    assert_equal(host(restored), before)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nan_or_inf_state_is_refused_naming_the_leaves(tmp_path, dtype):
    state = make_state()

    def put(x: jax.Array, index: tuple[int, int], value: float, dtype=jnp.float32) -> jax.Array:
        h = np.array(x).astype(dtype)
        h[index] = value
        return jax.device_put(h, x.sharding)

    w0 = put(state.params["w0"], (11, 3), np.nan, dtype)  # in the 6th of 8 shards
    mu = put(state.opt_state["mu"], (0, 0), np.inf)
    bad = state._replace(params={**state.params, "w0": w0}, opt_state={"mu": mu})
    ck = checkpointer(tmp_path)
    assert ck.save(1, state)
    with pytest.raises(CheckpointError) as e:
        ck.save(2, bad)
    ck.wait()
    ck.close()
    named = "non-finite values in ['opt_state']['mu'], ['params']['w0']"  # in tree order
    assert f"refusing to save step 2: {named}" in str(e.value)
    assert "last valid checkpoint is step 1" in str(e.value)
    assert ck.all_steps() == [1]


# --- per-shard checksums --------------------------------------------------------------------------


def _swap_in_state_of(src: Path, dst: Path) -> None:
    # Damage orbax cannot see: another step's (readable) array files under this step's manifest.
    shutil.rmtree(dst / "state")
    shutil.copytree(src / "state", dst / "state")


def test_per_shard_crc32_finds_one_flipped_byte_in_one_fsdp_shard(tmp_path):
    state = make_state()
    ck = checkpointer(tmp_path / "run")
    for step in (1, 2):
        assert ck.save(step, state)
    ck.wait()
    ck.close()
    leaves = manifest_lib.read_manifest(tmp_path / "run" / "2")["leaves"]
    assert leaves["['params']['w1']"]["crc32"] is None
    assert sorted(leaves["['params']['w1']"]["shards"]) == sorted(
        f"{r}:{r + 2},0:64" for r in range(0, 16, 2)
    )
    # Step 2's files replaced by a save whose w1 differs in one byte of rows 10:12.
    other = checkpointer(tmp_path / "other")
    assert other.save(2, make_state(flip=("w1", 10)))
    other.wait()
    other.close()
    _swap_in_state_of(tmp_path / "other" / "2", tmp_path / "run" / "2")

    warnings: list[str] = []
    ck = checkpointer(tmp_path / "run", warnings=warnings)
    restored, _, step = ck.restore_latest(abstract(state))
    ck.close()
    assert step == 1
    assert_equal(host(restored), host(state))
    (warning,) = warnings
    assert "step 2: checksum: leaf ['params']['w1'] shard [10:12,0:64] does not match" in warning
    assert "more shards" not in warning  # the other seven shards match
    assert "2.corrupt-checksum" in sorted(os.listdir(tmp_path / "run"))


def test_whole_leaf_crc32_of_older_manifests_still_verifies_a_sharded_leaf(tmp_path):
    # Manifests written before per-shard checksums hold one crc32 of the whole (gathered) leaf
    # and no config_hash: still checked, still accepted.
    state = make_state()
    ck = checkpointer(tmp_path, config_hash="h")
    assert ck.save(1, state)
    ck.wait()
    ck.close()
    path = tmp_path / "1" / manifest_lib.MANIFEST
    manifest = json.loads(path.read_text())
    del manifest["config_hash"], manifest["process_count"]
    for name in ("w0", "w1"):
        record = manifest["leaves"][f"['params']['{name}']"]
        del record["shards"]
        record["crc32"] = zlib.crc32(np.array(state.params[name]).view(np.uint8).data)
    path.write_text(json.dumps(manifest))
    assert checkpointer(tmp_path, config_hash="h").restore_latest(abstract(state))[2] == 1

    manifest["leaves"]["['params']['w1']"]["crc32"] ^= 1
    path.write_text(json.dumps(manifest))
    warnings: list[str] = []
    with pytest.raises(CheckpointError, match="no checkpoint in .* verifies"):
        checkpointer(tmp_path, warnings=warnings).restore_latest(abstract(state))
    assert "checksum: leaf ['params']['w1'] does not match its manifest" in warnings[0]


# --- config hash ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "metric, values",
    [
        ("eval_accuracy", [0.5, 0.9, 0.6, 0.7, 0.8, 0.4]),
        ("eval_loss", [0.5, 0.1, 0.6, 0.7, 0.3, 0.4]),
    ],
)
def test_keep_best_retains_the_best_step_beside_the_latest(tmp_path, metric, values):
    # Step 2 is the best (highest accuracy / lowest loss); the last 2 are 5 and 6.
    state = make_state()
    cfg = Checkpoint(every=1, keep=2, keep_best=1, best_metric=metric)
    ck = Checkpointer(tmp_path, cfg, warn=[].append)
    for step, value in enumerate(values, start=1):
        assert ck.save(step, state, metrics={metric: value})
        ck.wait()
    ck.close()
    assert sorted(int(n) for n in entries(tmp_path)) == [2, 5, 6]


def test_keep_best_step_survives_a_restart(tmp_path):
    # Item 1 of #31: the ranking lives in each step's manifest, so the best step (1, the lowest
    # eval_loss) is kept by a Checkpointer that did not save it (a resumed run).
    state = make_state()
    cfg = Checkpoint(every=1, keep=1, keep_best=1, best_metric="eval_loss")
    for steps in ((1, 0.1), (2, 0.5)), ((3, 0.7), (4, None)):
        ck = Checkpointer(tmp_path, cfg, warn=[].append)
        for step, loss in steps:
            metrics = None if loss is None else {"eval_loss": loss}
            assert ck.save(step, state, metrics=metrics)
            ck.wait()
        ck.close()
    assert entries(tmp_path) == ["1", "4"]


def test_older_steps_stay_until_the_newer_one_is_complete(tmp_path, gated_writer):
    # Item 2 of #31: with keep=1, step 1 is deleted only once step 2's manifest is written.
    state = make_state()
    ck = Checkpointer(tmp_path, Checkpoint(every=1, keep=1, keep_best=0), warn=[].append)
    gated_writer.set()
    assert ck.save(1, state)
    ck.wait()
    gated_writer.clear()  # step 2's manifest is held back
    assert ck.save(2, state)
    ck._manager.wait_until_finished()  # orbax has renamed step 2 into place
    assert entries(tmp_path) == ["1", "2"] and not (tmp_path / "2" / manifest_lib.MANIFEST).exists()
    gated_writer.set()
    ck.wait()
    ck.close()
    assert entries(tmp_path) == ["2"]


def _save_steps(directory: Path, steps: list[int]) -> TrainState:
    state = make_state()
    ck = checkpointer(directory)
    for step in steps:
        assert ck.save(step, state)
        ck.wait()
    ck.close()
    return state


def test_step_without_manifest_falls_back_to_the_newest_valid_one_and_says_so(tmp_path):
    # A step orbax finished but whose manifest is missing (killed before it was written, or lost)
    # cannot be verified: set aside, naming why, and the newest step that verifies is restored.
    state = _save_steps(tmp_path, [1, 2, 3])
    (tmp_path / "3" / manifest_lib.MANIFEST).unlink()
    warnings: list[str] = []
    restored, meta, step = checkpointer(tmp_path, warnings=warnings).restore_latest(abstract(state))
    assert step == 2 and meta["step"] == 2
    assert_equal(host(restored), host(state))
    (warning,) = warnings
    assert "step 3: no-manifest: no manifest.json" in warning, warning
    assert "moved to 3.corrupt-no-manifest" in warning, warning
    assert entries(tmp_path) == ["1", "2", "3.corrupt-no-manifest"]


def test_only_steps_without_manifest_start_at_0_saying_so_and_keep_them(tmp_path):
    # No step was ever complete (a kill during the first save, after orbax's rename, before the
    # manifest and the checkpointed marker): nothing to resume. The run starts at step 0 with a
    # warning; the step is set aside, not deleted.
    state = _save_steps(tmp_path, [1])
    (tmp_path / "1" / manifest_lib.MANIFEST).unlink()
    (tmp_path / manifest_lib.CHECKPOINTED).unlink()
    warnings: list[str] = []
    assert checkpointer(tmp_path, warnings=warnings).restore_latest(abstract(state)) is None
    assert "no finished checkpoint; starting at step 0" in warnings[-1], warnings
    assert "step 1: no-manifest" in warnings[-1], warnings
    assert sorted(os.listdir(tmp_path)) == ["1.corrupt-no-manifest"]


def test_every_manifest_lost_after_a_complete_step_is_refused_every_time(tmp_path):
    # Item 3 of #31: a directory that held a complete step never starts over from step 0, in
    # this invocation (the steps are set aside) nor in the next (no step is left).
    state = _save_steps(tmp_path, [1, 2])
    for step in ("1", "2"):
        (tmp_path / step / manifest_lib.MANIFEST).unlink()
    for _ in range(2):  # this invocation, then the next
        with pytest.raises(CheckpointError, match="held complete checkpoints") as e:
            checkpointer(tmp_path).restore_latest(abstract(state))
        assert "--restart" in str(e.value), str(e.value)
    assert "1.corrupt-no-manifest, 2.corrupt-no-manifest" in str(e.value), str(e.value)
    assert entries(tmp_path) == ["1.corrupt-no-manifest", "2.corrupt-no-manifest"]


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.EIO, "Input/output error"),
        ValueError("UNAVAILABLE: error reading state/d/1234: timed out"),
    ],
    ids=["EIO", "tensorstore-unavailable"],
)
def test_storage_error_on_restore_sets_nothing_aside(tmp_path, monkeypatch, error):
    # Item 3 of #31: an outage is no damage: a distinct error, every step left where it is.
    state = _save_steps(tmp_path, [1, 2])

    def failing(self, step, abstract_state):
        raise error

    monkeypatch.setattr(Checkpointer, "restore", failing)
    with pytest.raises(CheckpointUnavailableError, match="storage error") as e:
        checkpointer(tmp_path).restore_latest(abstract(state))
    assert "checkpoint step 2" in str(e.value) and "nothing was set aside" in str(e.value)
    assert entries(tmp_path) == ["1", "2"]


def _changed(x: jax.Array) -> jax.Array:
    # Another value of the same dtype, shape and sharding.
    host_value = np.array(x)
    host_value.reshape(-1)[0] += 1
    return jax.device_put(host_value, x.sharding)


@pytest.fixture(scope="module")
def two_good_steps(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("good")
    _save_steps(directory, [1, 2])
    return directory


@pytest.mark.parametrize(
    "leaf",
    [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_leaves_with_path(ckpt_lib._state_tree(make_state()))
    ],
)
def test_each_damaged_leaf_is_named_and_its_step_set_aside(tmp_path, leaf, two_good_steps):
    # Step 2's files replaced by a save in which only `leaf` differs (step and rng included).
    run = tmp_path / "run"
    shutil.copytree(two_good_steps, run)
    state = make_state()
    tree = ckpt_lib._state_tree(state)
    damaged = jax.tree_util.tree_map_with_path(
        lambda p, x: _changed(x) if jax.tree_util.keystr(p) == leaf else x, tree
    )
    other = checkpointer(tmp_path / "other")
    assert other.save(2, TrainState(**damaged))
    other.wait()
    other.close()
    _swap_in_state_of(tmp_path / "other" / "2", run / "2")

    warnings: list[str] = []
    restored, _, step = checkpointer(run, warnings=warnings).restore_latest(abstract(state))
    assert step == 1
    assert_equal(host(restored), host(state))
    (warning,) = warnings
    assert f"step 2: checksum: leaf {leaf}" in warning, warning
    assert entries(run) == ["1", "2.corrupt-checksum"]


def test_damaged_and_manifest_less_steps_are_all_listed_when_none_verifies(tmp_path):
    state = _save_steps(tmp_path, [1, 2])
    (tmp_path / "2" / manifest_lib.MANIFEST).unlink()
    (tmp_path / "1" / manifest_lib.MANIFEST).write_text("{")  # unreadable JSON
    with pytest.raises(CheckpointError) as e:
        checkpointer(tmp_path).restore_latest(abstract(state))
    message = str(e.value)
    assert "  step 2: no-manifest" in message and "  step 1: bad-manifest" in message, message
    assert "--restart" in message


def test_step_written_with_another_config_is_refused_unless_allowed(tmp_path):
    state = make_state()
    ck = checkpointer(tmp_path, config_hash="a" * 64)
    assert ck.save(3, state)
    ck.wait()
    ck.close()

    with pytest.raises(CheckpointError) as e:
        checkpointer(tmp_path, config_hash="b" * 64).restore_latest(abstract(state))
    message = str(e.value)
    assert "checkpoint step 3" in message and "config changed since it was written" in message
    for fix in ("config.yaml", "--allow-config-change", "--restart"):
        assert fix in message
    assert entries(tmp_path) == ["3"]  # refused, not damaged: nothing moved aside

    warnings: list[str] = []
    ck = checkpointer(tmp_path, config_hash="b" * 64, warnings=warnings)
    restored, _, step = ck.restore_latest(abstract(state), allow_config_change=True)
    assert step == 3 and "written with another config" in warnings[0]
    assert_equal(host(restored), host(state))
    # The same config, or a Checkpointer that knows no hash: nothing to say.
    for same in ("a" * 64, ""):
        warnings.clear()
        assert (
            checkpointer(tmp_path, config_hash=same, warnings=warnings).restore_latest(
                abstract(state)
            )[2]
            == 3
        )
        assert warnings == []


# --- restore memory: the state plus one leaf -----------------------------------------------------


def live_device_bytes() -> int:
    """Bytes of the live device buffers (each counted once, however many arrays view it)."""
    buffers = {}
    for a in jax.live_arrays():
        if not a.is_deleted():
            for s in a.addressable_shards:
                buffers[(s.device.id, s.data.unsafe_buffer_pointer())] = s.data.nbytes
    return sum(buffers.values())


def device_bytes(tree) -> list[int]:
    return [sum(s.data.nbytes for s in x.addressable_shards) for x in jax.tree.leaves(tree)]


@pytest.fixture
def copy_peaks(monkeypatch):
    """The live device bytes right after each leaf's copy is made (the old leaf still alive)."""
    peaks: list[int] = []
    real = donation._copy_fn

    def spied(sharding, dtype):
        copy = real(sharding, dtype)

        def run(x):
            y = copy(x)
            y.block_until_ready()
            peaks.append(live_device_bytes())
            return y

        return run

    monkeypatch.setattr(donation, "_copy_fn", spied)
    return peaks


def test_rematerialize_holds_the_state_plus_one_leaf(copy_peaks):
    state = make_state(leaves=6, rows=64, cols=1024)  # 6 x 256 KiB sharded + replicated leaves
    old, sizes = jax.tree.leaves(state), device_bytes(state)
    base = live_device_bytes()  # with the state
    fresh = rematerialize(state, jax.tree.map(lambda x: x.sharding, state))
    assert len(copy_peaks) == len(old)
    assert max(copy_peaks) <= base + max(sizes)  # copying the whole tree at once: 2x the state
    assert all(x.is_deleted() for x in old)
    assert live_device_bytes() <= base
    # Fresh buffers, which the next step can donate.
    step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    given = jax.tree.leaves(fresh)
    step(fresh)
    assert all(x.is_deleted() for x in given)


@pytest.mark.parametrize("cast", [False, True], ids=["same-dtypes", "cast-to-bfloat16"])
def test_restore_latest_donatable_peak_is_the_state_plus_one_leaf(tmp_path, copy_peaks, cast):
    state = make_state(leaves=6, rows=64, cols=1024)
    ck = checkpointer(tmp_path)
    assert ck.save(1, state)
    ck.wait()
    saved_bytes = device_bytes(state)
    target = abstract(state)
    if cast:
        target = target._replace(
            params=jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=a.sharding),
                target.params,
            )
        )
    del state
    base = live_device_bytes()
    restored, _, _ = ck.restore_latest(target, allow_dtype_cast=cast, donatable=True)
    ck.close()
    assert len(copy_peaks) == len(saved_bytes)  # every leaf re-made: donatable
    # While leaf i is copied: the saved state (leaves >= i), the copies (< i), and leaf i twice.
    assert max(copy_peaks) <= base + sum(saved_bytes) + max(saved_bytes)
    assert live_device_bytes() <= base + sum(device_bytes(restored))  # no restored leaf left
    if cast:
        assert {x.dtype for x in jax.tree.leaves(restored.params)} == {jnp.dtype(jnp.bfloat16)}


def test_restore_latest_casts_only_the_leaves_whose_dtype_differs(tmp_path, copy_peaks):
    state = make_state()
    ck = checkpointer(tmp_path)
    assert ck.save(1, state)
    ck.wait()
    target = abstract(state)
    w0 = target.params["w0"]
    target = target._replace(params={**target.params, "w0": w0.update(dtype=jnp.bfloat16)})
    warnings: list[str] = []
    ck._warn = warnings.append
    restored, _, _ = ck.restore_latest(target, allow_dtype_cast=True)
    ck.close()
    assert len(copy_peaks) == 1  # one cast, no other copy
    assert restored.params["w0"].dtype == jnp.bfloat16
    assert "casting 1 leaves" in warnings[0]


# --- two processes --------------------------------------------------------------------------------


def _worker(directory: str, other: str) -> None:
    """One of two processes (4 CPU devices each): saves steps 1 and 2 of an FSDP state over all
    8 devices, damages one byte of step 2 in a shard only process 1 holds, restores."""
    state = make_state()
    me = jax.process_index()
    ck = checkpointer(Path(directory))
    for step in (1, 2):
        assert ck.save(step, state)
    ck.wait()
    ck.close()
    ck = checkpointer(Path(other))
    assert ck.save(2, make_state(flip=("w1", 13)))
    ck.wait()
    ck.close()
    multihost.sync("saved")
    if me == 0:
        _swap_in_state_of(Path(other) / "2", Path(directory) / "2")
    multihost.sync("damaged")
    warnings: list[str] = []
    restored, _, step = checkpointer(Path(directory), warnings=warnings).restore_latest(
        abstract(state), donatable=True
    )
    same = all(
        np.array_equal(np.asarray(a.data), np.asarray(b.data))
        for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True)
        for a, b in zip(x.addressable_shards, y.addressable_shards, strict=True)
    )
    print("RESULT " + json.dumps({"step": step, "same": same, "warnings": warnings}), flush=True)


def test_two_processes_check_their_own_shards_and_agree_on_the_step(tmp_path):
    with held_port() as port:  # held until both processes exit (tests/ports.py)
        results = _two_workers(tmp_path, port)
    # Only process 1 holds rows 12:14 of w1; both set step 2 aside and restore step 1.
    assert [r["step"] for r in results] == [1, 1] and all(r["same"] for r in results)
    assert "shard [12:14,0:64] does not match" in results[1]["warnings"][0]
    assert "checksum: found by process 1" in results[0]["warnings"][0]


def _two_workers(tmp_path, port: int) -> list[dict]:
    code = (
        f"import sys; sys.path[:0] = [{str(ROOT)!r}]; import jax; "
        "jax.config.update('jax_cpu_collectives_implementation', 'gloo'); "
        f"jax.distributed.initialize('127.0.0.1:{port}', num_processes=2, "
        "process_id=int(sys.argv[1])); "
        "import tests.train.test_checkpoint_scale as t; "
        f"t._worker({str(tmp_path / 'run')!r}, {str(tmp_path / 'other')!r})"
    )
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "4", "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = child_xla_flags()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(i)],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = []
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
        results.append(json.loads(out.split("RESULT ", 1)[1].splitlines()[0]))
    return results
    run = tmp_path / "run"
    assert sorted(os.listdir(run)) == ["1", "2.corrupt-checksum"]
    part = json.loads((run / "1" / manifest_lib.MANIFEST_PART.format(1)).read_text())
    assert set(part["shards"]["['params']['w1']"]) == {f"{r}:{r + 2},0:64" for r in (8, 10, 12, 14)}
    main = manifest_lib.read_manifest(run / "1")
    assert main["process_count"] == 2 and len(main["leaves"]["['params']['w1']"]["shards"]) == 8
