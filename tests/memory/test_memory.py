"""memory_report / compiled_memory / compare_policies against XLA's and JAX's own numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_nn as rn
from remat_nn import _demo
from remat_nn._jax_internals import saved_residuals


@pytest.fixture(scope="module")
def stack():
    params = _demo.init(jax.random.key(0), depth=16, width=32, hidden=128)
    x = jax.random.normal(jax.random.key(1), (16, 32))
    return params, x


def test_compiled_temp_falls_as_the_policy_recomputes_more(stack):
    temp = {
        label: rn.compiled_memory(
            jax.grad(lambda p, x, s=spec: _demo.loss(p, x, policy=s)), *stack
        ).temp_size_in_bytes
        for label, spec in [("none", None), ("dots", "dots_saveable"), ("nothing", "full")]
    }
    assert temp["nothing"] < temp["dots"] < temp["none"], temp


def test_compiled_memory_fields_and_true_peak():
    x = jnp.ones((128, 128))
    m = rn.compiled_memory(lambda a: (a @ a) @ a, x)
    assert m.argument_size_in_bytes == x.nbytes and m.output_size_in_bytes == x.nbytes
    assert m.flops >= 2 * 2 * 128**3
    donated = rn.compiled_memory(lambda a: a * 2, x, jit_kwargs={"donate_argnums": 0})
    assert donated.alias_size_in_bytes == x.nbytes
    assert "peak" in str(m)


@pytest.mark.parametrize(
    "fn, donate, live",
    [
        (lambda a: a * 2, False, 2),  # a, out
        (lambda a: a * 2, True, 1),  # out written over a
        (lambda a: (a @ a) @ a, False, 3),  # a, a @ a, out
        (lambda a: (a @ a) @ a, True, 3),  # a is read by the last matmul: out cannot reuse it
    ],
    ids=["scale", "scale-donated", "two-matmuls", "two-matmuls-donated"],
)
def test_peak_is_the_buffers_live_at_once(fn, donate, live):
    # Counted by hand from the program: the (128, 128) float32 buffers live at the same time.
    x = jnp.ones((128, 128))
    m = rn.compiled_memory(fn, x, jit_kwargs={"donate_argnums": 0} if donate else None)
    assert m.peak_bytes == live * x.nbytes, str(m)


def test_memory_report_sees_names_inside_scanned_layers(stack):
    fn = lambda p, x: _demo.loss(p, x, policy="offload=mlp_hidden")  # noqa: E731
    report = rn.memory_report(fn, *stack)
    by_name = report.by_name()
    assert by_name["mlp_hidden"]["actions"] == {"offloaded"}
    assert by_name["mlp_hidden"]["shapes"] == {(16, 16, 128)}  # (depth, B, hidden)
    assert report.offloaded_bytes == 16 * 16 * 128 * 4
    expected = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, _ in saved_residuals(fn, *stack))
    assert report.total_bytes == expected
    assert "p['w_in']" in str(report)  # arguments by parameter name and path


def test_memory_report_names_with_either_remat(stack, jax_upgrade_flags):
    """Names are found whichever remat JAX stages (jax_remat3 wraps them in call_hi_primitive)."""
    fn = lambda p, x: _demo.loss(p, x, policy="save=mlp_hidden")  # noqa: E731
    by_name = rn.memory_report(fn, *stack).by_name()
    assert by_name["mlp_hidden"]["actions"] == {"saved"}
    assert by_name["mlp_hidden"]["shapes"] == {(16, 16, 128)}  # (depth, B, hidden)


def test_compare_policies_table(stack):
    table = rn.compare_policies(
        _demo.loss, stack, {"no remat": None, "dots": "dots", "full": "nothing_saveable"}
    )
    rows = {r["policy"]: r for r in table.rows()}
    assert rows["full"]["residual_bytes"] < rows["dots"]["residual_bytes"]
    assert rows["dots"]["residual_bytes"] < rows["no remat"]["residual_bytes"]
    assert rows["full"]["temp_bytes"] < rows["no remat"]["temp_bytes"]
    text = str(table)
    assert text.startswith("| policy |") and "| full |" in text


def test_demo_entry_point_runs(capsys, monkeypatch):
    from remat_nn import __main__ as demo

    monkeypatch.setattr("sys.argv", ["python -m remat_nn", "--depth", "4", "--batch", "8"])
    demo.main()
    out = capsys.readouterr().out
    assert "| nothing_saveable |" in out and "reproduce: python -m remat_nn" in out


def test_compiled_memory_reports_host_fields_apart_from_device(stack):
    # XLA counts host memory (where an offloaded residual goes on GPU / TPU) in its own fields.
    # XLA:CPU has one memory: an offloaded residual stays in device memory, the host fields are 0.
    grad = jax.grad(lambda p, x: _demo.loss(p, x, policy="offload=mlp_hidden"))
    raw = jax.jit(grad).lower(*stack).compile().memory_analysis()
    assert raw is not None
    m = rn.compiled_memory(grad, *stack)
    for kind in ("temp", "argument", "output", "alias", "generated_code"):
        assert getattr(m, f"host_{kind}_size_in_bytes") == getattr(
            raw, f"host_{kind}_size_in_bytes"
        )
    assert m.temp_size_in_bytes == raw.temp_size_in_bytes
    saved_grad = jax.grad(lambda p, x: _demo.loss(p, x, policy="save=mlp_hidden"))
    saved = rn.compiled_memory(saved_grad, *stack)
    assert jax.default_backend() == "cpu" and m.host_peak_bytes == 0
    assert m.temp_size_in_bytes == saved.temp_size_in_bytes  # stays on the one memory


def test_host_fields_are_read_field_by_field():
    # What an accelerator backend reports (CPU's are all 0): every field lands in its own place.
    import dataclasses
    from types import SimpleNamespace

    from remat_nn._memory import _from_stats

    kinds = ("temp", "argument", "output", "alias", "generated_code")
    values = {f"{k}_size_in_bytes": 10 + i for i, k in enumerate(kinds)}
    values |= {f"host_{k}_size_in_bytes": 100 * (i + 1) for i, k in enumerate(kinds)}
    m = _from_stats(SimpleNamespace(**values), flops=1.0)
    assert {k: getattr(m, k) for k in values} == values
    # The README's names (the fields) and XLA's (read-only aliases) read the same values.
    short = {k.replace("_size_in_bytes", "_bytes"): v for k, v in values.items()}
    assert {k: getattr(m, k) for k in short} == short
    assert dataclasses.asdict(m).keys() >= short.keys()
    assert m.peak_bytes == 10 + 11 + 12 - 13
    assert m.host_peak_bytes == 100 + 200 + 300 - 400
    assert "host peak" in str(m)


def test_the_printed_report_holds_the_arguments_in_one_row():
    # A VJP reads its weights: each was one row of both printed tables (57 for a 4-block NNX
    # model). Printed, they are one row; by_name() still lists each.
    ws = {f"w{i}": jnp.full((8, 8), 0.1 * (i + 1)) for i in range(6)}

    def loss(ws, x):
        for w in ws.values():
            x = jnp.tanh(x @ w)
        return jnp.sum(x)

    r = rn.memory_report(loss, ws, jnp.ones((4, 8)))
    args = [k for k in r.by_name() if k.startswith("(argument ")]
    assert len(args) == 7, r.by_name()  # the six weights, and x (read by the first dW)
    text = str(r)
    rows = [ln for ln in text.splitlines() if ln.startswith("(arguments")]
    assert len(rows) == 2, text  # one in each table
    row = rows[0]
    assert "held by the caller" in row and " +4;" in row, row  # the 3 largest named, 4 more
    assert " 7 " in row and rn.format_bytes(6 * 8 * 8 * 4 + 4 * 8 * 4) in row, row
    assert "(argument ws" not in text, text
