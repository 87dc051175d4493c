"""The options of the tiny MLPs the trainer tests register (each module its own model).

One options class for every tiny test model, so a change to what they accept is made once.
"""

from __future__ import annotations

import pydantic


class TinyOptions(pydantic.BaseModel):
    """``model.options`` of a tiny test MLP: classes out, hidden width."""

    model_config = pydantic.ConfigDict(extra="forbid")
    num_classes: int = 10
    width: int = 16
