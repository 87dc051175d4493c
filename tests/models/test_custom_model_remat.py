"""Your own model (``model.module``) takes the registered models' ``remat:`` vocabulary.

The contract (models/__init__.py, README "Train your model"): ``build``'s ``remat`` parameter
receives ``"none"``, a policy name or alias, or a ``rn.Plan`` (a plan mapping, or the plan
``{policy: auto}`` chose), and hands it to ``nn.remat``. The module here wraps a scanned block
(XLA:CPU undoes remat in an unrolled Python loop; inside ``scan`` it works as on accelerators),
so the plans change the compiled temp; the parameter tree stays the same, so a checkpoint saved
under one remat restores under another.
"""

from __future__ import annotations

import re
import textwrap

import pytest

from tests.trainer_cli import run_in_process

MODEL = textwrap.dedent(
    """
    import flax.linen as fnn
    import jax

    import remat_nn as rn
    from remat_nn import nn as rnn


    class Block(fnn.Module):
        width: int

        @fnn.compact
        def __call__(self, x, _):
            h = rn.name(jax.nn.relu(fnn.Dense(4 * self.width)(x)), "mlp_hidden")
            return x + fnn.Dense(self.width)(h), None


    class Net(fnn.Module):
        num_classes: int
        width: int
        remat: object

        @fnn.compact
        def __call__(self, x, train: bool = False):
            x = fnn.Dense(self.width)(x.reshape(x.shape[0], -1))
            block = rnn.remat(Block, policy=self.remat, prevent_cse=False)
            stack = fnn.scan(
                block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4
            )
            x, _ = stack(self.width)(x, None)
            return fnn.Dense(self.num_classes)(x)


    def build(num_classes: int, width: int = 32, remat="none"):
        return Net(num_classes=num_classes, width=width, remat=remat)
    """
)


@pytest.fixture
def base(user_model):
    return ["model.module=remat_model:build", *user_model("remat_model", MODEL)]


def _temp(out: str) -> str:
    return re.search(r"temp: (.*)", out).group(1)


def test_module_takes_policy_names_aliases_plans_and_auto(base):
    temps = {}
    for remat in ("none", "full", "dots", "nothing_saveable", "{save: [mlp_hidden]}"):
        code, out = run_in_process([*base, f"remat={remat}", "--dry-run"])
        assert code == 0, out
        temps[remat] = _temp(out)
    assert temps["full"] == temps["nothing_saveable"] != temps["none"], temps
    assert len(set(temps.values())) >= 3, temps  # the plans reach the model
    code, out = run_in_process([*base, "remat={policy: auto, budget: 0.9}", "--dry-run"])
    assert code == 0 and "remat plan (auto, budget 0.9)" in out, out


def test_config_errors_in_plans_exit_2_with_the_dotted_path(base):
    code, out = run_in_process([*base, "remat={save: [mlp_hiden]}", "--dry-run"])
    assert code == 2 and "remat: plan names ['mlp_hiden'] never occur in Block" in out, out
    assert "'mlp_hiden' -> 'mlp_hidden'" in out and "Traceback" not in out, out
    code, out = run_in_process([*base, "remat=fulll", "--dry-run"])
    assert code == 2 and "remat: 'fulll' is not a remat_nn policy name" in out, out
    assert "Did you mean 'full'?" in out and "Traceback" not in out, out


def test_checkpoint_saved_with_remat_restores_without_it(base):
    code, out = run_in_process([*base, "remat=full"])
    assert code == 0 and "step      2/2" in out, out
    more = [*base, "train.steps=4", "optim.schedule_steps=2", "--allow-config-change"]
    code, out = run_in_process([*more, "remat=none"])
    assert code == 0 and "resumed from" in out and "step      4/4" in out, out
