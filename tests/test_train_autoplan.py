"""`remat: {policy: auto, budget: ...}`: validated, planned once, saved, reused on resume."""

from pathlib import Path

import pytest

import remat_nn as rn
from train import loop
from train.config import ConfigError, load_config

DEBUG = Path(__file__).resolve().parents[1] / "configs" / "debug.yaml"


def cfg_for(run_dir, *overrides):
    base = [f"run_dir={run_dir}", "train.steps=4", "train.eval_every=4", "checkpoint.every=2"]
    return load_config(str(DEBUG), [*base, *overrides])


@pytest.mark.parametrize(
    "remat, path",
    [
        ("{policy: auto}", "remat.budget"),
        ("{policy: auto, budget: lots}", "remat.budget"),
        ("{policy: auto, budget: 1GiB, allow: [offload]}", "remat.allow"),
        ("{policy: auto, budget: 1GiB, bugdet: 2}", "remat.bugdet"),
        ("{policy: auto, budget: 1GiB, host_bandwidth: -1}", "remat.host_bandwidth"),
        ("{policy: auto, budget: 1GiB, memory_bandwidth: 0}", "remat.memory_bandwidth"),
        ("{policy: auto, budget: 1GiB, allow: [save, invert]}", "remat.allow"),
    ],
)
def test_bad_auto_plan_configs_name_the_path(tmp_path, remat, path):
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        cfg_for(tmp_path, f"remat={remat}")


def test_auto_plan_is_saved_and_reused_on_resume(tmp_path):
    lines: list[str] = []
    cfg = cfg_for(tmp_path, "remat={policy: auto, budget: 0.6}")
    first = loop.run(cfg, stop_after=2, out=lines.append)
    assert first.step == 2
    plan_file = tmp_path / "remat_plan.yaml"
    saved = rn.plan(plan_file)
    assert any("remat plan (auto, budget 0.6)" in line for line in lines)
    assert any("Pareto front" in line for line in lines)
    lines.clear()
    second = loop.run(cfg, out=lines.append)
    assert second.step == 4 and second.resumed_from == 2
    assert any(f"from {plan_file}" in line for line in lines)
    assert rn.plan(plan_file) == saved


def test_host_offload_on_cpu_warns_once_and_runs(tmp_path):
    lines: list[str] = []
    cfg = cfg_for(tmp_path, "remat={offload: [mlp_hidden], save: [query_proj]}", "train.steps=2")
    with pytest.warns(RuntimeWarning, match="single memory") as caught:
        result = loop.run(cfg, out=lines.append)
    assert result.step == 2
    assert len([w for w in caught if "single memory" in str(w.message)]) == 1
    assert sum("warning: remat plan offloads ['mlp_hidden']" in line for line in lines) == 1


def test_host_offload_on_cpu_can_be_refused(tmp_path):
    cfg = cfg_for(tmp_path, "remat={offload: [mlp_hidden]}", "train.offload_on_cpu=error")
    with pytest.raises(ValueError, match=r"offloads \['mlp_hidden'\].*Fix: run on GPU/TPU"):
        loop.run(cfg, out=lambda line: None)
    assert not (tmp_path / "checkpoints").exists()
