"""rn.explain_peak: the buffers live at XLA's peak, against XLA's own memory analysis."""

import functools
import inspect
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import models
import remat_nn as rn
from models import revnet as rv


def _line(fn, text):
    """``file:line`` of the first line of ``fn`` containing ``text``."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, ln in enumerate(lines) if text in ln)


def known_peak(x):
    a = rn.name(x @ x, "big_a")
    b = rn.name(x.T @ x, "big_b")
    s = rn.name(x[:4], "small_s")
    return jnp.sum(jnp.sort(a + b, axis=0)[:4] * (s @ x))


def test_known_peak_names_exactly_the_two_large_arrays_and_the_small_one():
    x = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    r = rn.explain_peak(known_peak, x)
    temps = {
        (b.name, b.source.rsplit(":", 1)[-1], b.nbytes)
        for b in r.buffers
        if b.category not in ("output", "fragmentation") and not b.category.startswith("argument")
    }
    big, small = 128 * 128 * 4, 4 * 128 * 4
    want = {
        ("big_a", str(_line(known_peak, '"big_a"')), big),
        ("big_b", str(_line(known_peak, '"big_b"')), big),
        ("small_s", str(_line(known_peak, '"small_s"')), small),
    }
    assert temps == want, f"{r}"
    assert r.difference == 0 and r.peak_bytes == rn.compiled_memory(known_peak, x).peak_bytes
    args = [b for b in r.buffers if b.category.startswith("argument")]
    assert [(b.name, b.nbytes) for b in args] == [("x", big)]
    text = str(r)
    for name, line, _ in want:
        assert name in text and f"test_peak.py:{line}" in text


def _mlp_scan(w, x, policy):
    def body(h, wi):
        z = rn.name(h @ wi, "mlp_hidden")
        return jnp.tanh(z), None

    h, _ = jax.lax.scan(jax.checkpoint(body, policy=policy), x, w)
    return jnp.sum(h**2)


SCAN_ARGS = (
    jax.ShapeDtypeStruct((6, 32, 32), jnp.float32),
    jax.ShapeDtypeStruct((8, 32), jnp.float32),
)


def test_a_saved_named_residual_is_attributed_to_its_name():
    saved = rn.explain_peak(
        jax.grad(lambda w, x: _mlp_scan(w, x, rn.policy("save=mlp_hidden"))), *SCAN_ARGS
    )
    named = [b for b in saved.buffers if b.name == "mlp_hidden"]
    # The stacked residual of the 6 layers: (6, 8, 32) float32, on the scan's line.
    assert [(b.shape, b.nbytes, b.category) for b in named] == [
        ("f32[6,8,32]", 6 * 8 * 32 * 4, "saved residual")
    ], f"{saved}"
    assert named[0].source.endswith(f":{_line(_mlp_scan, 'jax.lax.scan')}")
    recomputed = rn.explain_peak(
        jax.grad(lambda w, x: _mlp_scan(w, x, rn.policy("nothing_saveable"))), *SCAN_ARGS
    )
    # Nothing saved: the one mlp_hidden at the peak is a layer's recomputation in the backward.
    assert [(b.shape, b.category) for b in recomputed.buffers if b.name == "mlp_hidden"] in (
        [],
        [("f32[8,32]", "recomputed")],
    ), f"{recomputed}"


def _transformer_step():
    module = models.build(
        "transformer", vocab_size=64, d_model=32, n_heads=2, n_layers=2, max_len=16
    )
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    params = jax.eval_shape(module.init, jax.random.key(0), tokens)["params"]

    def loss(p, t):
        logits = module.apply({"params": p}, t)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), t[:, :, None], -1))

    return jax.grad(loss), (params, tokens), {}


def _revnet_grad():
    arch = rv.Arch((2, 1, 1), (8, 16, 16), 8, bottleneck=False)
    net = rv.RevNet(arch, num_classes=5)
    x = jax.ShapeDtypeStruct((4, 8, 8, 3), jnp.float32)
    variables = jax.eval_shape(net.init, jax.random.key(0), x)

    def loss(params, batch_stats, x):
        v = {"params": params, "batch_stats": batch_stats}
        return jnp.mean(net.apply(v, x, train=False))

    return jax.grad(loss), (variables["params"], variables["batch_stats"], x), {}


def _donated_train_step():
    tx = optax.adamw(1e-3)
    params = {"w1": jnp.zeros((32, 64)), "w2": jnp.zeros((64, 8))}
    state = {"params": params, "opt_state": tx.init(params)}
    batch = jnp.zeros((16, 32))

    def step(state, batch):
        def loss(p):
            return jnp.sum(jnp.tanh(batch @ p["w1"]) @ p["w2"])

        grads = jax.grad(loss)(state["params"])
        updates, opt = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt}

    return step, (state, batch), {"donate_argnums": 0}


def _scan_grad():
    return jax.grad(lambda w, x: _mlp_scan(w, x, rn.policy("save=mlp_hidden"))), SCAN_ARGS, {}


def _offloaded_scan_grad():
    # XLA:CPU has one memory: the offloaded residual is placed in device memory, as XLA counts.
    return jax.grad(lambda w, x: _mlp_scan(w, x, rn.policy("offload=mlp_hidden"))), SCAN_ARGS, {}


def _sharded_grad():
    # Batch sharded over 8 devices: one device's program, its peak as XLA counts it per device.
    mesh = jax.sharding.Mesh(jax.devices()[:8], ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    w = jax.ShapeDtypeStruct((6, 32, 32), jnp.float32)
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=rows)
    return jax.grad(lambda w, x: _mlp_scan(w, x, rn.policy("save=mlp_hidden"))), (w, x), {}


@pytest.mark.parametrize(
    "program",
    [
        _transformer_step,
        _revnet_grad,
        _donated_train_step,
        _scan_grad,
        _offloaded_scan_grad,
        _sharded_grad,
    ],
    ids=lambda f: f.__name__,
)
def test_the_buffers_at_the_peak_sum_to_xla_peak(program):
    fn, args, jit_kwargs = program()
    r = rn.explain_peak(fn, *args, jit_kwargs=jit_kwargs)
    want = rn.compiled_memory(fn, *args, jit_kwargs=jit_kwargs).peak_bytes
    assert r.peak_bytes == want and r.difference == 0, f"{r}"
    # The timeline at the peak index is the peak less the fragmentation row.
    at_peak = sum(v[r.peak_index] for v in r.timeline.values())
    frag = sum(b.nbytes for b in r.buffers if b.category == "fragmentation")
    assert at_peak + frag == want
    assert max(sum(v[t] for v in r.timeline.values()) for t in range(len(r.schedule))) == at_peak
    if program is _sharded_grad:  # one device's program: an eighth of the batch
        assert [b.nbytes for b in r.buffers if b.name == "x"] == [64 * 32 * 4 // 8]
    if jit_kwargs:  # donated: the state's arguments are donated, the batch is not
        roles = {b.name: b.category for b in r.buffers if b.category.startswith("argument")}
        assert roles["batch"] == "argument: batch", roles
        assert all(c.endswith("(donated)") for n, c in roles.items() if n != "batch"), roles
        assert any(c.startswith("argument: optimizer state") for c in roles.values())
        assert any(c.startswith("argument: params") for c in roles.values())


def test_explaining_a_compiled_memory_and_the_timeline_files(tmp_path):
    x = jnp.ones((128, 128))
    m = rn.compiled_memory(known_peak, x)
    r = rn.PeakReport.of(m)
    assert (
        r.peak_bytes == m.peak_bytes and r.peak_index == rn.explain_peak(known_peak, x).peak_index
    )
    data = json.loads(r.save_timeline(tmp_path / "t.png", title="known peak").read_text())
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["peak_index"] == r.peak_index and data["xla_peak_bytes"] == m.peak_bytes
    assert len(data["schedule"]) == len(data["bytes"]["argument"])
    donated = rn.compiled_memory(lambda a: a * 2.0, x, jit_kwargs={"donate_argnums": 0})
    assert donated.alias_size_in_bytes == x.nbytes
    assert rn.PeakReport.of(donated).peak_bytes == donated.peak_bytes  # jit_kwargs kept
    with pytest.raises(ValueError, match="explain_peak"):
        rn.PeakReport.of(rn.CompiledMemory(0, 0, 0, 0))


def test_the_readme_example_runs_and_prints_its_excerpt(tmp_path, monkeypatch, capsys):
    text = (Path(__file__).parents[2] / "README.md").read_text()
    start = text.index("\n## Why is my step this big?\n")
    section = text[start : text.index("\n## ", start + 1)]
    code, excerpt = re.findall(r"```(?:python)?\n(.*?)```", section, flags=re.S)[:2]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "example.py", "exec"), {"__name__": "example"})
    printed = capsys.readouterr().out.splitlines()
    for line in excerpt.splitlines():
        assert line in printed, line
    assert json.loads((tmp_path / "timeline.json").read_text())["peak_bytes"] == int(
        re.search(r"\((\d+) B", excerpt).group(1)
    )


def test_the_planner_report_shows_the_chosen_plans_peak():
    from remat_nn import _demo

    params = _demo.init(jax.random.key(0), depth=4, width=32, hidden=128)
    args = (params, jnp.ones((16, 32)))
    rates = {"flops_per_second": 1e10, "memory_bandwidth": 1e10}
    report = rn.plan_for_budget(_demo.loss, *args, budget=0.6, measure=False, **rates)
    grad = jax.grad(functools.partial(_demo.loss, policy=report.plan))
    peak = report.peak()
    compiled = rn.compiled_memory(grad, *args)
    assert peak.compiled.temp_size_in_bytes == report.compiled_temp_bytes
    assert peak.peak_bytes == compiled.peak_bytes and peak.difference == 0
    assert "largest temp buffers at the chosen plan's peak" in str(report)
    assert peak.top(8, temp_only=True) in str(report)
