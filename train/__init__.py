"""The trainer: ``python -m train --config configs/revnet.yaml`` (see docs/trainer.md).

One module per responsibility, in the order a run uses them:

- ``__main__``: the command line; exit codes come from :mod:`train.errors`.
- ``config/``: the YAML config, validated into typed sections (the remat request included),
  and the table of data sources (``DATA_SOURCES``).
- ``errors``: the errors reported without a traceback, each with its exit code.
- ``run_dir``: the run directory's lock, the config it was trained with, stale files.
- ``multihost``: process 0's checks and what every process must agree on.
- ``experiment``: the :class:`~train.experiment.Experiment` built from the config (data, model,
  mesh, optimizer, compiled donated step); ``dry_run`` reports on it.
- ``remat`` / ``autoplan``: the config's remat plan, and ``policy: auto`` by the budget planner.
- ``data/``: one loader per data source, and the grain batch pipeline; ``losses``: the loss
  and its metrics.
- ``state``: the train state, optimizer and step functions; ``fused``: the update in the
  backward; ``sharding``: mesh, shardings, multi-process start; ``dtypes``: matmul dtypes.
- ``donation``: the proofs that the step donates the state, and the buffer refit after a restore.
- ``loop``: ``run(cfg)``: start, restore or init, the step loop, finish.
- ``checkpoint``: orbax saves and verified restores; ``manifest``: per-step checksums;
  ``restore_verdicts``: what is wrong with a step, agreed by every process; ``durable``: atomic
  file writes; ``init_from``: start from another run's checkpoint.
- ``metrics_file``, ``tensorboard``, ``plot``, ``profile``, ``save_timer``: what a run writes
  besides checkpoints, and when.
- ``faults``: fault injection for the crash tests.
"""
