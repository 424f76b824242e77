"""The base of every recipe mapping: unknown keys refused, values frozen, no inf/nan, no booleans for numbers.

`schema` builds the recipe's models on it, and `layer_choice` builds ``moe_layers: {every: k, start: s}`` on it,
so a whole number is read and worded the same in every field: ``"4"`` (quoted, as pydantic and mergekit-moe
read it) is 4, ``4.0`` is 4, ``2.5`` is "not a whole number", ``yes`` is "a boolean, not a number", and
the bounds say "too small; write at least 1". The messages themselves are `schema.format_errors`'.
It knows no field of the recipe.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from moe_upcycle.recipe.values import strict_bools_and_numbers


class StrictModel(BaseModel):
    """A recipe mapping: extra keys forbidden, frozen, finite numbers only, booleans never read as numbers."""

    # inf/nan in a scale or std would silently fill the output with inf/nan
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, os.PathLike):  # a pathlib.Path from Python (a model folder, a prompt file): its text
            value = os.fspath(value)
        # YAML reads yes/no/on/off as booleans, and pydantic would turn them into 1/0
        return strict_bools_and_numbers(value, cls.model_fields[info.field_name].annotation)
