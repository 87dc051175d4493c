"""Donation: what ``donate_argnums`` saves on a whole train step.

The same train step (the scanned transformer, optax ``adamw``, state = parameters + optimizer
state) jitted with and without ``donate_argnums=0``. XLA's compiled memory analysis gives the
argument, output, alias and temp bytes; peak = temp + argument + output - alias. Donation should
let the new state reuse the old state's buffers: alias ~ bytes(params) + bytes(opt_state), and
the peak lower by about that amount (JAX docs: donation saves one copy of the donated buffers).
One donated step is also run, to check that the old state's buffers were consumed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib
import optax

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import models  # noqa: E402
import remat_nn as rn  # noqa: E402
from benchmarks import _workloads as wl  # noqa: E402
from benchmarks._common import Result, Target, paired, verdict  # noqa: E402
from remat_nn import format_bytes  # noqa: E402


def run(quick: bool = False) -> Result:
    config = wl.LM_QUICK if quick else wl.LM_FULL
    model = wl.lm(config)
    tx = optax.adamw(1e-3, weight_decay=0.1)
    state = (model.params, tx.init(model.params))

    train_step = _two_phase(functools.partial(model.loss, policy="full"), tx)
    state_bytes = wl.tree_bytes(state)
    params_bytes, opt_bytes = wl.tree_bytes(state[0]), wl.tree_bytes(state[1])
    mems = {}
    for label, kw in (("not donated", {}), ("donate_argnums=0", {"donate_argnums": 0})):
        compiled, mems[label] = wl.compile_step(train_step, state, model.tokens, **kw)

    # Evidence: the optimizer update alone (gradients given as an argument), same state.
    def update(state: Any, grads: Any) -> Any:
        params, opt_state = state
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    jits = (("not donated", {}), ("donate_argnums=0", {"donate_argnums": 0}))
    upd = {label: wl.compile_step(update, state, model.params, **kw)[1] for label, kw in jits}
    upd_saving = upd["not donated"].peak_bytes - upd["donate_argnums=0"].peak_bytes
    # What is live at each step's peak, from XLA's buffer assignment (before the run donates).
    peaks = {
        label: rn.explain_peak(train_step, state, model.tokens, jit_kwargs=kw) for label, kw in jits
    }
    # Before the donated run below consumes model.params.
    # The backward's working set the non-donated step keeps in its fresh output buffers.
    hidden = sum(
        b.nbytes for b in peaks["not donated"].buffers if b.category == "output" and b.holds
    )
    fused_lines, fused_targets = _fused_section(model, tx, mems, hidden, quick)
    fused_lines += _clip_section(model, tx, quick)
    fused_lines += _stack_forms_section(model, tx, quick)
    fused_lines += _revnet_section(tx, quick)
    fused_lines += _resnet_section(tx, quick)
    # Run the donated step once: the old state's buffers must be consumed.
    leaves = jax.tree.leaves(state)
    new_state, _ = compiled(state, model.tokens)
    jax.block_until_ready(new_state)
    deleted = sum(x.is_deleted() for x in leaves)

    plain, donated = mems["not donated"], mems["donate_argnums=0"]
    saving = plain.peak_bytes - donated.peak_bytes
    alias_frac = donated.alias_size_in_bytes / state_bytes
    saving_frac = saving / state_bytes
    lines = [
        f"Train step of the scanned transformer ({config}; remat preset `full`), optax adamw; "
        f"state = parameters {format_bytes(params_bytes)} + optimizer state "
        f"{format_bytes(opt_bytes)} = {format_bytes(state_bytes)}. XLA's compiled memory "
        "analysis (peak = temp + argument + output - alias):",
        "",
        "| jit | argument | output | alias | temp | peak |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for label, m in mems.items():
        lines.append(
            f"| {label} | {format_bytes(m.argument_size_in_bytes)} | "
            f"{format_bytes(m.output_size_in_bytes)} | {format_bytes(m.alias_size_in_bytes)} | "
            f"{format_bytes(m.temp_size_in_bytes)} | {format_bytes(m.peak_bytes)} |"
        )
    lines += [
        f"| update only, not donated | {format_bytes(upd['not donated'].argument_size_in_bytes)}"
        f" | {format_bytes(upd['not donated'].output_size_in_bytes)} | "
        f"{format_bytes(upd['not donated'].alias_size_in_bytes)} | "
        f"{format_bytes(upd['not donated'].temp_size_in_bytes)} | "
        f"{format_bytes(upd['not donated'].peak_bytes)} |",
        f"| update only, donate_argnums=0 | "
        f"{format_bytes(upd['donate_argnums=0'].argument_size_in_bytes)} | "
        f"{format_bytes(upd['donate_argnums=0'].output_size_in_bytes)} | "
        f"{format_bytes(upd['donate_argnums=0'].alias_size_in_bytes)} | "
        f"{format_bytes(upd['donate_argnums=0'].temp_size_in_bytes)} | "
        f"{format_bytes(upd['donate_argnums=0'].peak_bytes)} |",
    ]
    temp_rise = donated.temp_size_in_bytes - plain.temp_size_in_bytes
    lines += [
        "",
        f"Peak saved by donation: {format_bytes(saving)} = {saving_frac:.1%} of "
        f"bytes(params + opt_state); alias = {alias_frac:.1%} of it. After one donated step, "
        f"{deleted} of the {len(leaves)} input state buffers are deleted (consumed).",
        "",
        f"Why the peak falls by less than the aliased bytes: donating makes XLA's temp grow by "
        f"{format_bytes(temp_rise)} ({temp_rise / state_bytes:.0%} of the state). Without "
        f"donation the fresh output buffers are free until the new state is written, and XLA "
        f"uses them as scratch: the gradients (bytes(params) = {format_bytes(params_bytes)}) "
        f"and activations live in the space the new state later fills, so they never show up "
        f"as temp. With donation the outputs are the old state's buffers, which the forward and "
        f"backward still read (the parameters) or the update still reads (the moments), so the "
        f"gradients need temp of their own. The optimizer update alone (gradients passed in) "
        f"saves {format_bytes(upd_saving)} = {upd_saving / state_bytes:.1%} of the state: "
        f"donation itself is complete; a fused grad + update step can save at most about "
        f"bytes(state) - bytes(grads) = {format_bytes(state_bytes - params_bytes)} "
        f"({(state_bytes - params_bytes) / state_bytes:.0%} for adamw), since the gradients "
        f"must coexist with the parameters they are taken from.",
    ]
    lines += ["", *_peak_section(peaks, temp_rise)]
    lines += ["", *fused_lines]

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    parts = [
        ("temp", "temp_size_in_bytes"),
        ("argument", "argument_size_in_bytes"),
        ("output", "output_size_in_bytes"),
    ]
    labels = list(mems)
    left = [0.0] * len(labels)
    for part, attr in parts:
        widths = [getattr(mems[k], attr) / 2**20 for k in labels]
        ax.barh(labels, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    alias = [-mems[k].alias_size_in_bytes / 2**20 for k in labels]
    ax.barh(labels, alias, left=left, color="none", edgecolor="k", hatch="//", label="- alias")
    ax.scatter(
        [m.peak_bytes / 2**20 for m in mems.values()], labels, color="k", zorder=3, label="peak"
    )
    ax.set_xlabel("MiB")
    ax.set_title(f"Train-step memory with and without donation ({config})", fontsize=7)
    ax.legend(fontsize=7, loc="lower right")

    targets = [
        Target(
            "alias >= 99% of bytes(params + opt_state)",
            alias_frac >= 0.99,
            f"{format_bytes(donated.alias_size_in_bytes)} = {alias_frac:.1%}",
        ),
        Target(
            "peak lower by >= 80% of bytes(params + opt_state)",
            saving_frac >= 0.80,
            f"{format_bytes(saving)} = {saving_frac:.1%}",
        ),
        Target(
            "donated input buffers consumed after a step",
            deleted == len(leaves),
            f"{deleted}/{len(leaves)}",
        ),
    ]
    targets.append(
        Target(
            "rn.explain_peak's buffers sum to XLA's peak (both steps)",
            all(r.difference == 0 for r in peaks.values()),
            ", ".join(f"{k}: {r.difference:+d} B" for k, r in peaks.items()),
        )
    )
    targets += fused_targets
    donated_peak = peaks["donate_argnums=0"]
    figures = {
        "donation_memory.png": fig,
        "donation_peak_timeline.png": donated_peak.timeline_figure(
            f"Donated train step ({config}): live bytes over XLA's schedule"
        ),
    }
    return Result("donation", "\n".join(lines), figures, targets)


def _peak_section(peaks: dict[str, rn.PeakReport], temp_rise: int) -> list[str]:
    plain, donated = peaks["not donated"], peaks["donate_argnums=0"]
    temp_cats = ("saved residual", "recomputed", "gradient", "transient", "fragmentation")
    cats = {k: {c: g["bytes"] for c, g in r.by_category().items()} for k, r in peaks.items()}
    held: dict[str, int] = {}
    for b in plain.buffers:
        if b.category == "output" and b.holds:
            held[b.holds] = held.get(b.holds, 0) + b.nbytes
    rows = [
        f"| {c} | {format_bytes(cats['not donated'].get(c, 0))} | "
        f"{format_bytes(cats['donate_argnums=0'].get(c, 0))} | "
        f"{format_bytes(cats['donate_argnums=0'].get(c, 0) - cats['not donated'].get(c, 0))} |"
        for c in temp_cats
    ]
    growth = sum(
        cats["donate_argnums=0"].get(c, 0) - cats["not donated"].get(c, 0) for c in temp_cats
    )
    held_text = ", ".join(
        f"{format_bytes(v)} {k}" for k, v in sorted(held.items(), key=lambda kv: -kv[1])
    )
    return [
        "## What is live at the peak (`rn.explain_peak`)",
        "",
        f"XLA's buffers at each step's peak (schedule index {plain.peak_index} of "
        f"{len(plain.schedule)} without donation, {donated.peak_index} of "
        f"{len(donated.schedule)} with it), read from XLA's buffer assignment and live ranges; "
        f"they sum to XLA's peak to the byte ({plain.peak_bytes} B and {donated.peak_bytes} B). "
        "Temp at the peak by category:",
        "",
        "| category | not donated | donate_argnums=0 | difference |",
        "|---|--:|--:|--:|",
        *rows,
        f"| **temp** | {format_bytes(plain.compiled.temp_size_in_bytes)} | "
        f"{format_bytes(donated.compiled.temp_size_in_bytes)} | {format_bytes(growth)} |",
        "",
        f"The temp growth of {format_bytes(temp_rise)} is the difference column "
        f"({format_bytes(growth)}). Without donation, at the peak the output allocations hold "
        f"{held_text} of the backward pass (the scanned layers' gradient accumulators, the "
        "blocks' recomputed activations): XLA places them in the fresh output buffers, which "
        "stay free until the new state is written. With donation those buffers are the old "
        "state, still read by the backward and the update, so the same values need temp.",
        "",
        "Largest temp buffers at the donated step's peak (the arguments are the donated state, "
        f"{format_bytes(donated.compiled.argument_size_in_bytes)}):",
        "",
        "```",
        donated.top(12, temp_only=True),
        "```",
    ]


def _two_phase(
    loss: Callable[[Any, jax.Array], jax.Array], tx: optax.GradientTransformation
) -> Callable[[Any, jax.Array], tuple[Any, jax.Array]]:
    """The two-phase step of ``loss``: ``(params, opt_state), tokens -> (new state, loss)``."""

    def step(state: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return step


def _sequenced_loss(model: wl.LM) -> Callable[[Any, jax.Array], jax.Array]:
    """The benchmark transformer's loss with each block recomputed as the fused step recomputes
    it (an experiment, not the model's remat): a custom VJP that saves the block's input, and
    in the backward takes the plain block's VJP there with its forward finished before the
    backward starts (the same optimization barrier)."""
    from models import transformer as tf

    parts = tf.layer_stack(model.module.clone(remat=None))

    @jax.custom_vjp
    def block(p: Any, h: jax.Array) -> jax.Array:
        return parts.layer(p, h)

    def block_fwd(p: Any, h: jax.Array) -> tuple[jax.Array, Any]:
        return parts.layer(p, h), (p, h)

    def block_bwd(saved: Any, dy: jax.Array) -> Any:
        _, pullback = jax.vjp(parts.layer, *saved)
        dy, pullback = jax.lax.optimization_barrier((dy, pullback))
        return pullback(dy)

    block.defvjp(block_fwd, block_bwd)

    def loss(params: Any, tokens: jax.Array) -> jax.Array:
        rest = {k: v for k, v in params.items() if k != parts.key}
        h = parts.embed(rest, tokens[:, :-1])  # (B, T, D)
        h = jax.lax.scan(lambda h, p: (block(p, h), None), h, params[parts.key])[0]
        return wl.next_token_loss(parts.head(rest, h), tokens)

    return loss


def _fused_step(module: Any, tx: optax.GradientTransformation, **kw: Any) -> Any:
    """The transformer ``module`` as ``rn.fused_update_step`` takes it, as the trainer's
    ``train.update_in_backward`` builds it: its own parts (``models.transformer.layer_stack``,
    with a reversible stack's fused backward and a nested one's ``save_every``), the parameters
    as they are (``stack_key="blocks"``)."""
    from models import transformer as tf  # the benchmark's model, as the workloads build it

    parts = tf.layer_stack(module)
    return rn.fused_update_step(
        lambda rest, tokens: parts.embed(rest, tokens[:, :-1]),  # (B, T, D)
        parts.layer,
        lambda rest, h, tokens: wl.next_token_loss(parts.head(rest, h), tokens),
        tx,
        stack_key=parts.key,
        backward_fn=parts.backward,
        save_every=parts.save_every,
        **kw,
    )


def _lm_fused_step(model: wl.LM, tx: optax.GradientTransformation, plan: Any, **kw: Any) -> Any:
    """The benchmark transformer's fused step, each block under ``plan``."""
    return _fused_step(model.module.clone(remat=plan), tx, **kw)


def _runner(advance: Callable[[Any], Any], state: Any) -> Callable[[], Any]:
    """A timed call: ``advance`` one step from a private copy of ``state``, kept for the next."""
    cell = [jax.tree.map(jnp.copy, state)]

    def run() -> Any:
        cell[0] = advance(cell[0])
        return jax.block_until_ready(cell[0])

    return run


def _fused_section(
    model: wl.LM,
    tx: optax.GradientTransformation,
    mems: dict[str, rn.CompiledMemory],
    hidden: int,
    quick: bool,
) -> tuple[list[str], list[Target]]:
    """The donated fused step against the non-donated and donated two-phase steps (``mems``);
    ``hidden``: the bytes of the non-donated step's backward held in its output buffers."""
    from models import transformer as tf

    plain, donated = mems["not donated"], mems["donate_argnums=0"]

    step = _lm_fused_step(model, tx, tf.remat_plan("full"))
    params = model.params
    opt_state = tx.init(params)
    state_bytes = wl.tree_bytes((params, opt_state))
    donate = {"donate_argnums": (0, 1)}
    compiled, fused = wl.compile_step(step, params, opt_state, model.tokens, **donate)
    # The same step with each block under the `minimal` plan inside its recomputation.
    inner_plan = wl.compile_step(
        _lm_fused_step(model, tx, tf.remat_plan("minimal")),
        params,
        opt_state,
        model.tokens,
        **donate,
    )[1]
    # The two-phase step with each block recomputed as the fused step recomputes it.
    sequenced = _sequenced_loss(model)
    seq = {
        label: wl.compile_step(_two_phase(sequenced, tx), (params, opt_state), model.tokens, **kw)[
            1
        ]
        for label, kw in (("not donated", {}), ("donate_argnums=0", {"donate_argnums": 0}))
    }
    seq_grad_err = float(
        rn.relative_error(
            jax.jit(jax.grad(sequenced))(params, model.tokens),
            jax.jit(jax.grad(model.loss))(params, model.tokens),
            floor=0.01,  # the key bias's exact gradient is 0 (softmax ignores it): round-off
        )
    )
    # Same loss as the model's own: the decomposition is the model.
    loss = jax.jit(step)(params, opt_state, model.tokens)[2]
    model_loss = jax.jit(model.loss)(model.params, model.tokens)
    loss_err = float(rn.relative_error(loss, model_loss))
    saving = plain.peak_bytes - fused.peak_bytes
    below_donated = donated.peak_bytes - fused.peak_bytes
    grads = wl.tree_bytes(params)  # the gradient stack of the two-phase step
    peak = rn.explain_peak(step, params, opt_state, model.tokens, jit_kwargs=donate)
    grad_bytes = sum(b.nbytes for b in peak.buffers if b.category == "gradient")

    two = jax.jit(_two_phase(functools.partial(model.loss, policy="full"), tx), donate_argnums=0)
    runs = {
        "two-phase": _runner(lambda st: two(st, model.tokens)[0], (params, opt_state)),
        "fused": _runner(lambda st: compiled(*st, model.tokens)[:2], (params, opt_state)),
    }
    timed = paired(runs, itself="two-phase", rounds=1 if quick else 9)
    ratio = timed.ratio("fused", "two-phase")
    lines = [
        "## The optimizer update inside the backward (`rn.fused_update_step`)",
        "",
        "The same model as its parts (`models.transformer.layer_stack`, the blocks under the "
        "model's plan `full`): the backward is a reverse scan over the "
        "blocks that recomputes each block from its saved input, takes its VJP and applies "
        "adamw to that block's slice of the parameters and moments in place; the embeddings "
        "and the final norm are updated at the end. A block under `full` is handed over "
        "plain: its VJP at the saved input is the recomputation, and the step finishes that "
        "forward before the block's backward starts (an optimization barrier), so XLA cannot "
        "start the backward early and hold its first cotangents across the recomputation; "
        "`rn.explain_peak` therefore files the recomputed values as saved residuals (of the "
        "VJP). Jitted with `donate_argnums=(0, 1)`. Its "
        f"loss equals the model's (max-scaled relative error {loss_err:.1e}). Second row: each "
        "block under the plan `minimal` (q, k, v, out_proj and mlp_hidden saved inside the "
        "block's recomputation, the rest recomputed a second time inside its backward, which "
        "the barrier cannot order).",
        "",
        "| jit | argument | output | alias | temp | peak |",
        "|---|--:|--:|--:|--:|--:|",
        f"| fused, donated | {format_bytes(fused.argument_size_in_bytes)} | "
        f"{format_bytes(fused.output_size_in_bytes)} | {format_bytes(fused.alias_size_in_bytes)} "
        f"| {format_bytes(fused.temp_size_in_bytes)} | {format_bytes(fused.peak_bytes)} |",
        f"| fused, donated, blocks under `minimal` | "
        f"{format_bytes(inner_plan.argument_size_in_bytes)} | "
        f"{format_bytes(inner_plan.output_size_in_bytes)} | "
        f"{format_bytes(inner_plan.alias_size_in_bytes)} | "
        f"{format_bytes(inner_plan.temp_size_in_bytes)} | {format_bytes(inner_plan.peak_bytes)} |",
        *(
            f"| two-phase, blocks recomputed as the fused step does (experiment), {label} | "
            f"{format_bytes(m.argument_size_in_bytes)} | {format_bytes(m.output_size_in_bytes)} | "
            f"{format_bytes(m.alias_size_in_bytes)} | {format_bytes(m.temp_size_in_bytes)} | "
            f"{format_bytes(m.peak_bytes)} |"
            for label, m in seq.items()
        ),
        "",
        f"Peak below the non-donated two-phase step's: {format_bytes(saving)} = "
        f"{saving / state_bytes:.1%} of bytes(params + opt_state); with the blocks under "
        f"`minimal`: {format_bytes(plain.peak_bytes - inner_plan.peak_bytes)} = "
        f"{(plain.peak_bytes - inner_plan.peak_bytes) / state_bytes:.1%}. Gradient buffers "
        "at the "
        f"fused step's peak (`rn.explain_peak`): {format_bytes(grad_bytes)}, the cotangents "
        f"and weight gradients of one block; no stack of weight gradients. Step time fused / "
        f"donated two-phase: {ratio:.3f} "
        f"({timed.noise_text()}).",
        "",
        f"Peak below the donated two-phase step's: {format_bytes(below_donated)} = "
        f"{below_donated / grads:.1%} of bytes(params) = {format_bytes(grads)}, the gradient "
        "stack the fused step does without. Against the non-donated step: both write the "
        "new state, so the saving is that step's temp less the fused step's, plus its "
        "output bytes (less the fused step's own unaliased outputs, "
        f"{format_bytes(fused.output_size_in_bytes - fused.alias_size_in_bytes)}): "
        f"{format_bytes(plain.temp_size_in_bytes)} - "
        f"{format_bytes(fused.temp_size_in_bytes)} + "
        f"{format_bytes(plain.output_size_in_bytes)}. The fused step's temp is one block's "
        "backward working set; the non-donated step's temp is lower than its working set by "
        f"the {format_bytes(hidden)} it keeps in its fresh output buffers (the output "
        "allocations above), scratch until the new state is written. 90% of bytes(state) "
        "needs the fused temp at most the non-donated temp + 10% of bytes(state): "
        f"{format_bytes(plain.temp_size_in_bytes + state_bytes // 10)}.",
        "",
        "Part of the saving is the ordering, not the update inside the backward: the last two "
        "rows are the two-phase step with each block recomputed as the fused step recomputes "
        "it (a custom VJP per block that saves its input and takes the plain block's VJP "
        "there behind the same barrier; not the model's remat, and not in the toolkit; its "
        f"gradient equals the model's: max-scaled relative error {seq_grad_err:.1e}, leaf "
        "scales floored at 1% of the largest). Against "
        "it the fused step's peak is lower by "
        f"{format_bytes(seq['not donated'].peak_bytes - fused.peak_bytes)} = "
        f"{(seq['not donated'].peak_bytes - fused.peak_bytes) / state_bytes:.1%} of "
        "bytes(params + opt_state) (not donated) and by "
        f"{format_bytes(seq['donate_argnums=0'].peak_bytes - fused.peak_bytes)} = "
        f"{(seq['donate_argnums=0'].peak_bytes - fused.peak_bytes) / grads:.1%} of "
        "bytes(params) (donated: the gradient stack).",
        "",
        "```",
        *str(peak).splitlines()[:12],
        "```",
    ]
    targets = [
        Target(
            "fused donated step: peak lower than the non-donated two-phase step's by >= 90% of "
            "bytes(params + opt_state)",
            saving >= 0.9 * state_bytes,
            f"{format_bytes(saving)} = {saving / state_bytes:.1%}",
        ),
        Target(
            "fused donated step time <= 1.05x the donated two-phase step's",
            verdict(ratio, 1.05, timed.noise, at_most=True),
            f"{ratio:.3f}x",
            timed.noise_text(),
        ),
    ]
    return lines, targets


def _three_steps(
    module: Any, tokens: jax.Array, tx: optax.GradientTransformation
) -> tuple[int, list[str]]:
    """bytes(state) and the table rows of ``module``'s two-phase steps and its fused step.

    The fused step is ``models.transformer.layer_stack(module)`` as the trainer's
    ``train.update_in_backward`` builds it (a reversible stack's fused backward, ``save_every``).
    """

    params = jax.jit(module.init)(jax.random.key(0), tokens[:, :-1])["params"]
    state = (params, tx.init(params))

    two_phase = _two_phase(
        lambda p, tokens: wl.next_token_loss(module.apply({"params": p}, tokens[:, :-1]), tokens),
        tx,
    )
    fused = _fused_step(module, tx)
    mems = {
        "two-phase, not donated": wl.compile_step(two_phase, state, tokens)[1],
        "two-phase, donate_argnums=0": wl.compile_step(two_phase, state, tokens, donate_argnums=0)[
            1
        ],
        "fused, donated": wl.compile_step(fused, *state, tokens, donate_argnums=(0, 1))[1],
    }
    state_bytes = wl.tree_bytes(state)
    return state_bytes, _step_rows(mems, state_bytes)


def _stack_forms_section(model: wl.LM, tx: optax.GradientTransformation, quick: bool) -> list[str]:
    """The fused step of the transformer's other stack forms: reversible, and nested."""
    import models

    state_bytes, reversible = _three_steps(
        model.module.clone(reversible=True, remat=None), model.tokens, tx
    )
    config = (
        wl.LMConfig(n_layers=6, d_model=32, n_heads=2, seq_len=16, batch=2)
        if quick
        else wl.LMConfig(n_layers=16, d_model=128, n_heads=4, seq_len=256, batch=8)
    )
    tokens = wl.lm_tokens(config)
    nested_kw = dict(config.options(), remat="full")
    forms = {
        label: _three_steps(
            models.build("transformer", **nested_kw, scan_levels=levels), tokens, tx
        )
        for label, levels in (("scan", None), ("nested", 2))
    }
    inner = rn.remat_scan_lengths(config.n_layers, 2)[1]
    return [
        "",
        "### The reversible transformer",
        "",
        "The same model with `reversible: true` (additive couplings: attention F, MLP G; the "
        "backward rebuilds each coupling's input from its output): state "
        f"{format_bytes(state_bytes)}. The fused step takes `backward_fn=` the coupling's "
        "inverse fused with its VJP (`models.transformer.layer_stack`, as the trainer's "
        "`train.update_in_backward` does), so it keeps no coupling inputs either.",
        "",
        *reversible,
        "",
        "### The nested transformer (`scan_levels: 2`)",
        "",
        f"A deeper transformer ({config}; blocks under the plan `full`), state "
        f"{format_bytes(forms['nested'][0])}: with `scan_levels: 2` its blocks run in "
        "`rn.remat_scan` (two levels), and the fused step saves the input of every k-th "
        f"block (`save_every={inner}`, the nesting's inner length) and recomputes a "
        "segment's inputs in the backward. The same model with one scan level for comparison.",
        "",
        "**scan_layers, one level**",
        "",
        *forms["scan"][1],
        "",
        "**scan_levels: 2**",
        "",
        *forms["nested"][1],
    ]


def _clip_section(model: wl.LM, tx: optax.GradientTransformation, quick: bool) -> list[str]:
    """What ``clip_norm=`` costs the fused step: its second backward pass, timed and measured."""
    from models import transformer as tf

    plan, donate = tf.remat_plan("full"), {"donate_argnums": (0, 1)}
    state = (model.params, tx.init(model.params))
    steps = {
        label: wl.compile_step(
            _lm_fused_step(model, tx, plan, **kw), *state, model.tokens, **donate
        )
        for label, kw in (("fused", {}), ("fused, clip_norm=1.0", {"clip_norm": 1.0}))
    }
    runs = {
        label: _runner(lambda st, f=compiled: f(*st, model.tokens)[:2], state)
        for label, (compiled, _) in steps.items()
    }
    timed = paired(runs, itself="fused", rounds=1 if quick else 9)
    mem = {label: m for label, (_, m) in steps.items()}
    return [
        "",
        "### The global-norm clip (`clip_norm=`)",
        "",
        "The fused step above with `clip_norm=1.0` (adamw without the clip: the norm of the "
        "whole gradient comes from a first backward pass that keeps only its running sum, then "
        "the fused pass scales each layer's gradient):",
        "",
        "| jit | temp | peak |",
        "|---|--:|--:|",
        *(
            f"| {label}, donated | {format_bytes(m.temp_size_in_bytes)} | "
            f"{format_bytes(m.peak_bytes)} |"
            for label, m in mem.items()
        ),
        "",
        f"Step time with the clip / without: {timed.ratio('fused, clip_norm=1.0', 'fused'):.3f} "
        f"({timed.noise_text()}).",
    ]


def _revnet_section(tx: optax.GradientTransformation, quick: bool) -> list[str]:
    """RevNet-38's two-phase steps and its fused step over its stages (``rn.fused_update_stages``):
    the coupling stacks updated per layer, BatchNorm statistics in the donated state."""
    from benchmarks import revnet as revnet_bench  # its RevNet-38, batch and image size

    module = revnet_bench._module("revnet38", quick)
    batch, image, state_bytes, rows = _stages_steps("revnet38", module, tx, quick)
    arch = revnet_bench._arch("revnet38", quick)
    return [
        "",
        "### RevNet-38 (`rn.fused_update_stages`)",
        "",
        f"RevNet-38 (units per stage {arch.units}, widths {arch.widths}; batch {batch} of "
        f"{image}x{image} images, as `python -m benchmarks revnet`{' --quick' if quick else ''} "
        "measures it; the downsampling units under `full`), adamw; state = parameters + "
        f"optimizer state + BatchNorm statistics = {format_bytes(state_bytes)}. The fused step "
        "is its stages as `models.revnet.stage_stacks` gives them (as the trainer's "
        "`train.update_in_backward` builds it): per stage a reverse scan over the couplings, "
        "each rebuilt from its output and updated right after its VJP; the stem, downsampling "
        "units and head updated at the end; the new batch statistics the forward pass's.",
        "",
        *rows,
    ]


def _resnet_section(tx: optax.GradientTransformation, quick: bool) -> list[str]:
    """ResNet-32's (``scan_units``, every unit under ``full``) two-phase steps and its fused
    step over its stages: the scanned units updated per layer, as the RevNet's couplings."""
    from benchmarks import revnet as revnet_bench  # the same architectures at --quick
    from models import resnet as RN

    arch = revnet_bench._arch("resnet32", quick)
    module = RN.ResNet(arch, remat=RN.REMAT_PRESETS["full"], scan_units=True)
    batch, image, state_bytes, rows = _stages_steps("resnet32", module, tx, quick)
    return [
        "",
        "### ResNet-32 (`rn.fused_update_stages`)",
        "",
        f"ResNet-32 (units per stage {arch.units}, widths {arch.widths}; batch {batch} of "
        f"{image}x{image} images; `scan_units: true`: each stage's identical units in one "
        "`nn.scan`; every unit under `full`), adamw; state = parameters + optimizer state + "
        f"BatchNorm statistics = {format_bytes(state_bytes)}. The fused step is its stages as "
        "`models.resnet.stage_stacks` gives them: per stage the first unit (which changes the "
        "width or resolution) differentiated by `jax.vjp`, then a reverse scan over the "
        "scanned units, each recomputed from its saved input and updated right after its VJP; "
        "the stem, first units and head updated at the end.",
        "",
        *rows,
    ]


def _stages_steps(
    name: str, module: Any, tx: optax.GradientTransformation, quick: bool
) -> tuple[int, int, int, list[str]]:
    """Batch, image size, bytes(state) and the table rows of the registry model ``name``'s
    two-phase steps and its fused step over its stages (the registry's ``stage_stacks``)."""
    batch, image = (8, 8) if quick else (128, 32)
    model = wl.classifier(name, batch=batch, image_size=image, module=module, materialize=False)
    state = (model.params, jax.eval_shape(tx.init, model.params), model.batch_stats)

    def two_phase(state: Any, images: jax.Array, labels: jax.Array) -> tuple[Any, jax.Array]:
        params, opt_state, stats = state
        (value, new), grads = jax.value_and_grad(model.loss, has_aux=True)(
            params, stats, images, labels
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, new["batch_stats"]), value

    parts = models.get(name).stage_stacks(module)
    fused = rn.fused_update_stages(
        lambda rest, stats, batch: parts.embed(rest, stats, batch[0]),
        parts.stages,
        lambda rest, stats, h, batch: _xent(parts.head(rest, stats, h), batch[1]),
        tx,
    )
    args = (model.images, model.labels)
    mems = {
        "two-phase, not donated": wl.compile_step(two_phase, state, *args)[1],
        "two-phase, donate_argnums=0": wl.compile_step(two_phase, state, *args, donate_argnums=0)[
            1
        ],
        "fused, donated": wl.compile_step(fused, *state, args, donate_argnums=(0, 1, 2))[1],
    }
    state_bytes = wl.tree_bytes(state)
    return batch, image, state_bytes, _step_rows(mems, state_bytes)


def _step_rows(mems: dict[str, rn.CompiledMemory], state_bytes: int) -> list[str]:
    """A table of each step's temp and peak, and its peak below the non-donated two-phase
    step's (``mems["two-phase, not donated"]``) as a share of ``state_bytes``."""
    plain = mems["two-phase, not donated"].peak_bytes
    return [
        "| step | temp | peak | peak below the non-donated two-phase step (of the state) |",
        "|---|--:|--:|--:|",
        *(
            f"| {label} | {format_bytes(m.temp_size_in_bytes)} | {format_bytes(m.peak_bytes)} "
            f"| {format_bytes(plain - m.peak_bytes)} = {(plain - m.peak_bytes) / state_bytes:.1%} |"
            for label, m in mems.items()
        ),
    ]


def _xent(head: tuple[jax.Array, Any], labels: jax.Array) -> tuple[jax.Array, Any]:
    """``(logits, batch_stats)`` -> (cross-entropy, batch_stats), as ``wl.Classifier.loss``."""
    logits, stats = head
    return wl.cross_entropy(logits, labels), stats
