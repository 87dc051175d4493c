"""`remat: {policy: auto, budget: ...}`: validated, planned once, saved, reused on resume."""

from pathlib import Path
from typing import Any

import flax.linen as fnn
import jax.numpy as jnp
import pydantic
import pytest

import models
import remat_nn as rn
from remat_nn import nn as rnn
from train import loop
from train.config import AutoRequest, ConfigError, load_config

DEBUG = Path(__file__).resolve().parents[2] / "configs" / "debug.yaml"
NAMED = "named_mlp_for_autoplan_tests"


def cfg_for(run_dir, *overrides):
    base = [f"run_dir={run_dir}", "train.steps=4", "train.eval_every=4", "checkpoint.every=2"]
    return load_config(str(DEBUG), [*base, *overrides])


class _Block(fnn.Module):
    width: int

    @fnn.compact
    def __call__(self, x, _=None):
        # x (B, D) -> (B, D), through a wide hidden layer: recomputing it saves memory.
        h = rn.name(fnn.Dense(self.width)(x), rn.names.MLP_HIDDEN)  # (B, F)
        h = rn.name(jnp.tanh(h), rn.names.MLP_OUT)  # (B, F)
        return x + fnn.Dense(x.shape[-1])(h), None


class NamedMLP(fnn.Module):
    """Residual MLP blocks, each with two named activations, scanned under the plan given.

    Scanned: XLA:CPU keeps remat inside a scan (in an unrolled loop it undoes it).
    """

    num_classes: int = 10
    width: int = 256
    depth: int = 4
    remat: Any = None  # a remat_nn.Plan, "none" (no remat), or None (everything recomputed)
    levels: int = 1  # > 1: the blocks as a nested checkpointed scan (same parameters)

    @fnn.compact
    def __call__(self, x, train: bool = False):
        # x (B, H, W, C) -> logits (B, K)
        h = x.reshape(x.shape[0], -1)  # (B, D)
        if self.levels > 1:
            plan = self.remat if isinstance(self.remat, rn.Plan) else rn.Plan()
            nested = rnn.remat_scan(_Block, length=self.depth, levels=self.levels, policy=plan)
            h, _ = nested(self.width, name="blocks")(h)
            return fnn.Dense(self.num_classes)(h)
        block = _Block
        if self.remat != "none":
            plan = self.remat or rn.plan({"default": "recompute"})
            block = rnn.remat(_Block, policy=plan, prevent_cse=False)
        blocks = fnn.scan(
            block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.depth
        )
        h, _ = blocks(self.width, name="blocks")(x.reshape(x.shape[0], -1), None)  # (B, D)
        return fnn.Dense(self.num_classes)(h)


class NamedOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    num_classes: int = 10
    width: int = 256
    depth: int = 4
    remat: str | pydantic.InstanceOf[rn.Plan] | None = None
    levels: int = 1


@pytest.fixture
def named_mlp():
    # Registered only while a test uses it, so registry-wide tests elsewhere never see it.
    spec = models.ModelSpec(build=NamedMLP, options=NamedOptions, task="classify", doc="tests")
    models.register(NAMED, spec)
    yield NAMED
    models.REGISTRY.pop(NAMED, None)


@pytest.mark.parametrize(
    "remat, path",
    [
        ("{policy: auto}", "remat.budget"),
        ("{policy: auto, budget: lots}", "remat.budget"),
        ("{policy: auto, budget: 1.5}", "remat.budget"),  # not 1 byte: '150%' or '1.5GiB'
        ("{policy: auto, budget: 1GiB, allow: [offload]}", "remat.allow"),
        ("{policy: auto, budget: 1GiB, bugdet: 2}", "remat.bugdet"),
        ("{policy: auto, budget: 1GiB, host_bandwidth: -1}", "remat.host_bandwidth"),
        ("{policy: auto, budget: 1GiB, memory_bandwidth: 0}", "remat.memory_bandwidth"),
        ("{policy: auto, budget: 1GiB, allow: [save, invert]}", "remat.allow"),
        ("{policy: auto, budget: 1GiB, variants: [nested]}", "remat.variants"),
        ("{policy: auto, budget: 1GiB, variants: {nested: {}}}", "remat.variants.nested"),
        ("{policy: auto, budget: 1GiB, variants: {nested: 2}}", "remat.variants.nested"),
    ],
)
def test_bad_auto_plan_configs_name_the_path(tmp_path, remat, path):
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        cfg_for(tmp_path, f"remat={remat}")


def test_auto_plan_is_saved_and_reused_on_resume(tmp_path, named_mlp):
    # A model with few names (the planner compiles the gradient once per name, and the
    # transformer has 10): what is tested is the trainer planning once and reusing the plan.
    lines: list[str] = []
    cfg = load_config(
        None,
        [
            f"model.name={named_mlp}",
            "data.source=digits",
            "data.batch_size=256",  # planned on one device's 32: activations worth planning
            f"run_dir={tmp_path}",
            "train.steps=4",
            "train.eval_every=4",
            "train.plot=false",
            "checkpoint.every=2",
            "remat={policy: auto, budget: 0.6}",
        ],
    )
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
    lines.clear()  # --dry-run shows the plan chosen, not only the request
    loop.run(cfg, dry_run=True, out=lines.append)
    assert f"remat plan: {cfg.remat} -> {saved}" in lines, [ln for ln in lines if "remat" in ln]


def test_auto_plan_falls_back_on_a_variant_and_saves_its_options(tmp_path):
    # A budget no plan of the configured model meets, met by its nested scan (`levels: 3`
    # lengths (3, 3): 6 block inputs held, not 9, and no per-layer stack of a saved name). The
    # choice, variant options included, is saved and read back; a plan file from before variants
    # (a bare plan mapping) still reads.

    import jax

    from train import autoplan, state

    def build(policy, options=None):
        return NamedMLP(depth=9, width=64, **{"remat": policy, **(options or {})})

    x = jnp.zeros((32, 8, 8, 1))

    def abstract_state(overrides):
        init = state.make_init(build(None, overrides), __import__("optax").sgd(0.1), x, seed=0)
        return jax.eval_shape(init)

    abstract = abstract_state({})
    batch = {
        "x": jax.ShapeDtypeStruct(x.shape, x.dtype),
        "y": jax.ShapeDtypeStruct((32,), jnp.int32),
    }
    kw = dict(
        build=build,
        abstract_state=abstract_state,
        batch=batch,
        compute_dtype=jnp.float32,
        say=lambda line: None,
    )
    loss = state.make_loss_fn(
        build(rn.Plan(), {"levels": 2}), compute_dtype=jnp.float32, has_batch_stats=False
    )
    args = (abstract.params, abstract.batch_stats, batch, jax.random.key(0))
    budget = rn.compiled_memory(jax.grad(lambda *a: loss(*a)[0]), *args).temp_size_in_bytes
    auto = {"policy": "auto", "budget": budget, "variants": {"nested": {"levels": 2}}}
    request = AutoRequest.from_config(auto)
    choice = autoplan.load_or_plan(request, run_dir=tmp_path, **kw)
    assert choice.variant == "nested" and dict(choice.model_options) == {"levels": 2}
    assert choice.policy == choice.plan  # the variant sets no remat: the plan applies
    assert autoplan.read_choice(tmp_path / autoplan.PLAN_FILE) == choice
    again = autoplan.load_or_plan(request, run_dir=tmp_path, **kw)  # read back, not planned
    assert again == choice
    old = tmp_path / "old"
    old.mkdir()
    (old / autoplan.PLAN_FILE).write_text("save: [mlp_hidden]\n")
    read = autoplan.read_choice(old / autoplan.PLAN_FILE)
    assert read == autoplan.AutoChoice(rn.plan({"save": ["mlp_hidden"]}), {})
    bad = {"policy": "auto", "budget": budget, "variants": {"wide": {"widht": 128}}}
    with pytest.raises(ValueError, match=r"remat\.variants\.wide: .*Fix: fix or drop"):
        autoplan.load_or_plan(AutoRequest.from_config(bad), run_dir=tmp_path / "bad", **kw)


# --- the model's own forms (models.ModelSpec.variants) -------------------------------------------


def test_each_model_offers_only_its_valid_forms():
    forms = lambda name, **o: models.get(name).variants(o)  # noqa: E731
    assert set(forms("transformer", n_layers=9)) == {"nested", "reversible"}
    assert forms("transformer", n_layers=9)["nested"] == {"scan_levels": 2}
    assert forms("transformer", n_layers=9)["reversible"]["reversible"] is True
    assert set(forms("transformer", n_layers=4)) == {"reversible"}  # 2 + 2 inputs: no gain
    assert set(forms("transformer", n_layers=9, dropout=0.1)) == {"reversible"}
    assert set(forms("transformer", n_layers=9, scan_layers=False)) == {"reversible"}
    assert set(forms("transformer", n_layers=9, scan_levels=3)) == {"reversible"}
    assert forms("transformer", reversible=True) == {}
    assert forms("resnet110") == {"nested": {"scan_units": True, "scan_levels": 2}}
    assert forms("resnet", depth=164) == forms("resnet110")
    assert forms("resnet32") == {} and forms("resnet110", scan_units=True, scan_levels=2) == {}
    assert all(models.get(n).variants is None for n in ("revnet38", "revnet", "nnx_revnet"))
    # Every form offered builds (the reversible one with its own remat, the plan not applied).
    for name, o in (
        ("transformer", {"n_layers": 9, "d_model": 16, "n_heads": 2}),
        ("resnet110", {}),
    ):
        for overrides in models.get(name).variants(o).values():
            models.build(name, **{**o, **overrides})


def test_variants_config_adds_replaces_drops_and_switches_off(monkeypatch):
    # What reaches the planner, per `variants:` form (the planner itself is replaced: the
    # choice among the forms is tested with real compiles below and above).
    import jax

    from train import autoplan
    from train.errors import SetupError

    seen = []

    def spy(fn, *args, variants=None, **kw):
        seen.append(variants)
        raise rn.PlanError("spy")

    monkeypatch.setattr(autoplan.rn, "plan_for_budget", spy)
    own = {"nested": {"levels": 2}, "reversible": {"reversible": True, "remat": "none"}}
    built = []

    def build(policy, overrides):
        built.append((policy, dict(overrides)))
        return NamedMLP(depth=4, width=16, remat=policy)

    x = jax.ShapeDtypeStruct((8, 4, 4, 1), jnp.float32)
    state = __import__("train.state", fromlist=["make_init"])
    kw = dict(
        build=build,
        abstract_state=lambda o: jax.eval_shape(
            state.make_init(NamedMLP(depth=4, width=16), __import__("optax").sgd(0.1), x, seed=0)
        ),
        batch={"x": x, "y": jax.ShapeDtypeStruct((8,), jnp.int32)},
        compute_dtype=jnp.float32,
        say=lambda line: None,
        model_variants=own,
        write=False,
    )

    def planned(variants):
        request = {"policy": "auto", "budget": 0.5}
        if variants is not ...:
            request["variants"] = variants
        with pytest.raises(SetupError, match=r"remat\.budget=0\.5: spy"):
            autoplan.load_or_plan(
                AutoRequest.from_config(request), run_dir=Path("/nonexistent"), **kw
            )
        return None if seen[-1] is None else sorted(seen[-1])

    assert planned(...) == ["nested", "reversible"]  # no `variants:`: the model's own
    assert planned({}) is None  # switched off: the planner gets none
    assert planned({"wide": {"width": 32}}) == ["nested", "reversible", "wide"]
    assert planned({"reversible": None}) == ["nested"]
    built.clear()
    planned({"nested": {"levels": 3}})  # replaced by label
    assert (rn.Plan(), {"levels": 3}) in built and (rn.Plan(), {"levels": 2}) not in built
    # A form that sets its own remat is built without the planner's plan.
    assert (None, {"reversible": True, "remat": "none"}) in built
    bogus = {"policy": "auto", "budget": 0.5, "variants": {"bogus": None}}
    with pytest.raises(SetupError, match=r"remat\.variants\.bogus: null drops .*Fix: drop"):
        autoplan.load_or_plan(AutoRequest.from_config(bogus), run_dir=Path("/nonexistent"), **kw)


@pytest.mark.slow
def test_tiny_transformer_picks_reversible_by_default_trains_and_resumes_bitwise(tmp_path):
    # The debug transformer at 4 layers (d_model 32, 32 tokens, 16 per device): the least per-name
    # plan compiles to 1.89 MiB of temp, the reversible form to 1.64 MiB (measured; no nested
    # form at 4 layers): at 1.75 MiB only the reversible form fits, and no `variants:` is set.
    import numpy as np

    from train import autoplan
    from train.errors import CheckpointError

    def cfg(run_dir):
        return cfg_for(
            run_dir,
            "model.options.n_layers=4",
            "data.batch_size=128",  # 16 on each of the suite's 8 devices (planned on one)
            "train.plot=false",
            "remat={policy: auto, budget: 1.75MiB}",
        )

    lines: list[str] = []
    first = loop.run(cfg(tmp_path / "run"), stop_after=2, out=lines.append)
    assert first.step == 2
    plan_file = tmp_path / "run" / autoplan.PLAN_FILE
    choice = autoplan.read_choice(plan_file)
    assert choice.variant == "reversible", "\n".join(lines)
    assert choice.model_options["reversible"] is True
    assert choice.policy is None  # reversible blocks: remat none, not the plan
    assert any("variant 'reversible' chosen" in line for line in lines)
    resumed = loop.run(cfg(tmp_path / "run"), out=lines.append)
    assert resumed.step == 4 and resumed.resumed_from == 2
    # Uninterrupted, from the same plan file (read back, not planned again).
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / autoplan.PLAN_FILE).write_text(plan_file.read_text())
    ref = loop.run(cfg(tmp_path / "ref"), out=lines.append)
    assert "f" in ref.state.params["blocks"]["layers"]  # the couplings' parameters (F, G)
    for a, b in zip(jax_leaves(resumed.state.params), jax_leaves(ref.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert resumed.eval == ref.eval
    # A plan file that builds another model than the checkpoints': an error naming it.
    plan_file.write_text("save: [mlp_in]\n")  # a bare plan: the model as configured
    with pytest.raises(CheckpointError, match=r"(?s)does not fit.*remat_plan\.yaml.*--restart"):
        loop.run(cfg(tmp_path / "run"), out=lines.append)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


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


# --- train/remat.py: the config's remat read into one remat_nn.Plan ------------------------------

LM = ["model.name=transformer", "data.source=corpus"]


def _resolve(cfg):
    from train import remat as remat_lib

    return remat_lib.resolve(cfg.remat_request, cfg.model.spec())


def test_resolve_reads_every_form_into_a_plan():
    import models
    from train import remat as remat_lib
    from train.config import AutoRequest

    presets = models.get("transformer").remat_presets
    resolve = lambda *o: _resolve(load_config(None, [*LM, *o]))  # noqa: E731
    assert resolve("remat=minimal") == presets["minimal"]
    assert resolve("remat=none") == remat_lib.NO_REMAT
    assert resolve() is None  # the model's default plan stands
    plan = rn.plan({"save": ["query_proj"], "offload": ["mlp_hidden"]})
    assert resolve("remat={save: [query_proj], offload: [mlp_hidden]}") == plan
    auto = resolve("remat={policy: auto, budget: 2GiB, allow: [save, recompute]}")
    assert auto == AutoRequest(budget="2GiB", allow=("save", "recompute"))
    # The model's own option, as a preset or the transformer's custom spelling.
    assert resolve("model.options.remat=save_out_proj") == presets["save_out_proj"]
    custom = resolve("model.options.remat=custom", "model.options.custom_plan={save: [context]}")
    assert custom == rn.plan({"save": ["context"]})


def test_the_model_gets_the_plan_object_itself():
    import models
    from train import remat as remat_lib

    plan = rn.plan({"save": ["query_proj"], "offload": ["mlp_hidden"]})
    opts = {"d_model": 32, "n_heads": 2, "remat": "custom", "custom_plan": {"save": ["x"]}}
    built = models.build("transformer", **remat_lib.model_options_with_plan(opts, plan))
    assert built.remat is plan  # not a mapping parsed again on the way
    none = remat_lib.model_options_with_plan(opts, remat_lib.NO_REMAT)
    assert models.build("transformer", **none).remat is None
    for keep in (None, _resolve(cfg_for("x", "remat={policy: auto, budget: 0.5}"))):
        assert remat_lib.model_options_with_plan(opts, keep) == opts


def test_offload_check_on_the_plan(monkeypatch):
    import warnings

    from train import remat as remat_lib
    from train.errors import SetupError

    lines: list[str] = []
    offloading = rn.plan({"offload": ["mlp_hidden"], "save": ["query_proj"]})
    with pytest.warns(RuntimeWarning, match=r"offloads \['mlp_hidden'\].*single memory"):
        remat_lib.check_offload(offloading, "warn", lines.append)
    assert len(lines) == 1 and lines[0].startswith("warning: remat plan offloads")
    with pytest.raises(SetupError, match=r"offloads \['mlp_hidden'\].*Fix: run on GPU/TPU"):
        remat_lib.check_offload(offloading, "error", lines.append)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for quiet in (rn.plan({"save": ["query_proj"]}), remat_lib.NO_REMAT, None):
            remat_lib.check_offload(quiet, "error", lines.append)
        monkeypatch.setattr(remat_lib.jax, "default_backend", lambda: "gpu")
        remat_lib.check_offload(offloading, "error", lines.append)  # offload is real there
    assert len(lines) == 1


def test_auto_request_passes_only_the_keys_given():
    from train.config import AutoRequest

    plain = AutoRequest.from_config({"policy": "auto", "budget": "1GiB"})
    assert plain.planner_kwargs() == {"flops_per_second": 1e12, "memory_bandwidth": 1e11}
    full = AutoRequest.from_config(
        {
            "policy": "auto",
            "budget": 0.5,
            "allow": ["save"],
            "host_bandwidth": 8e9,
            "flops_per_second": 2e12,
        }
    )
    want = {
        "allow": ["save"],
        "host_bandwidth": 8e9,
        "flops_per_second": 2e12,
        "memory_bandwidth": 1e11,
    }
    assert full.planner_kwargs() == want
    with pytest.raises(ValueError, match=r"remat\.budget.*remat\.bugdet|remat\.bugdet.*budget"):
        AutoRequest.from_config({"policy": "auto", "bugdet": 1})


def test_a_plan_naming_what_the_model_never_produces_is_a_config_error():
    load_config(None, ["model.name=revnet38", "remat=full"])  # image models take plans
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.name=resnet32", "remat={save: [mlp_hidden]}"])
    errors = dict(info.value.errors)
    assert set(errors) == {"remat"} and "resnet32: option remat=" in errors["remat"]
    assert "['mlp_hidden'], which resnet32 never produces" in errors["remat"]
    # Planned plans reach a reversible transformer no better than written ones: refused upfront.
    reversible = [*LM, "model.options.reversible=true", "remat={policy: auto, budget: 0.5}"]
    with pytest.raises(ConfigError, match=r"remat: policy: auto .*reversible=true"):
        load_config(None, reversible)


def test_resnet110_picks_its_nested_form_below_every_per_name_plan(tmp_path):
    # ResNet-110 at width 0.25 on 8x8 images, batch 32, units scanned: every per-name plan
    # compiles to >= 1.08 MiB of temp (conv_out recomputed: 1.079 MiB), the nested scan of its
    # 17 units per stage to 0.54 MiB (measured): 0.8 MiB is met by the nested form only.
    import jax
    import optax

    from train import autoplan, state

    spec = models.get("resnet110")
    options = {"width": 0.25, "image_size": 8, "in_channels": 1, "scan_units": True}

    def build(policy, overrides):
        return models.build(spec, **{**options, **overrides, "remat": policy or "full"})

    x = jax.ShapeDtypeStruct((1, 8, 8, 1), jnp.float32)
    lines: list[str] = []
    choice = autoplan.load_or_plan(
        AutoRequest.from_config({"policy": "auto", "budget": "0.8MiB"}),
        run_dir=tmp_path,
        build=build,
        abstract_state=lambda o: jax.eval_shape(
            state.make_init(build(None, o), optax.sgd(0.1), x, seed=0)
        ),
        batch={
            "x": jax.ShapeDtypeStruct((32, 8, 8, 1), jnp.float32),
            "y": jax.ShapeDtypeStruct((32,), jnp.int32),
        },
        compute_dtype=jnp.float32,
        say=lines.append,
        model_variants=spec.variants(options),
    )
    assert choice.variant == "nested", "\n".join(lines)
    assert dict(choice.model_options) == {"scan_units": True, "scan_levels": 2}
    assert autoplan.read_choice(tmp_path / autoplan.PLAN_FILE) == choice
