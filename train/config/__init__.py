"""Run configuration: YAML validated into typed pydantic models.

A config is one YAML file (``configs/*.yaml``) plus dotted command-line overrides
(``optim.lr=3e-4 train.steps=200``). Every section rejects unknown keys; every error (an unknown
key, a wrong type, a value out of range, a bad model option or remat plan) is collected and
reported at once with its dotted path, as a :class:`ConfigError`.

>>> cfg = load_config(None, ["model.name=transformer", "data.source=corpus", "train.steps=3"])
>>> cfg.train.steps, cfg.optim.lr
(3, 0.1)
>>> load_config(None, ["optim.lr=-1", "train.stepz=3"])
Traceback (most recent call last):
...
train.config.ConfigError: ... 2 errors
  optim.lr: Input should be greater than 0 (got -1)
  train.stepz: unknown key; did you mean 'train.steps'? ...

The parts, one file each:

- ``_yaml``: the reader (strict safe loader, duplicate keys, tabs, ``key.sub=value`` overrides);
- ``_schema``: the sections, resume-safe fields marked with :func:`safe_field`;
- ``_checks``: cross-checks against the model registry (model options, remat plan, data);
- ``_remat``: the ``remat`` request parsed once (:class:`RematRequest`, :func:`parse_remat`), and
  the ``{policy: auto, ...}`` request's checks and :class:`AutoRequest`;
- ``_load``: :func:`load_config` / :func:`dump_config`, the three above in order;
- ``_resume``: which keys a resumed run may change, and the effective form configs compare in;
- ``_describe``: :func:`describe_options`, the ``--help`` text;
- ``_errors``: :class:`ConfigError`;
- ``_sources``: the table of data sources (:data:`DATA_SOURCES`), which the schema, the checks
  and ``train.data``'s loaders read.
"""

from train.config._describe import describe_options
from train.config._errors import ConfigError
from train.config._load import dump_config, load_config
from train.config._remat import AutoRequest, RematRequest, is_auto, parse_remat, request_errors
from train.config._resume import is_resume_safe, resume_safe_keys, resume_view
from train.config._sources import DATA_SOURCES, DataSource, Task, sources_fitting
from train.config._schema import (
    Checkpoint,
    Config,
    Data,
    Distributed,
    InitFrom,
    Mesh,
    Model,
    Optim,
    Profile,
    Synthetic,
    Tokens,
    Train,
    safe_field,
)
from train.config._yaml import YamlLoader, apply_overrides

__all__ = [
    "AutoRequest",
    "Checkpoint",
    "Config",
    "ConfigError",
    "DATA_SOURCES",
    "Data",
    "DataSource",
    "Distributed",
    "InitFrom",
    "Mesh",
    "Model",
    "Optim",
    "Profile",
    "RematRequest",
    "Synthetic",
    "Task",
    "Tokens",
    "Train",
    "YamlLoader",
    "apply_overrides",
    "describe_options",
    "dump_config",
    "is_auto",
    "is_resume_safe",
    "load_config",
    "parse_remat",
    "request_errors",
    "resume_safe_keys",
    "resume_view",
    "safe_field",
    "sources_fitting",
]
