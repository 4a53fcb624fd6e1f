"""The benchmarks' number options as argparse types: each reads an option's text as a pydantic
type with its bounds, so a value that is no number, NaN, infinite or out of range is refused
before any work, on one line naming the option (argparse's error, exit 2)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError

Duration = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A length of time in the unit the option's name gives (`--soak` seconds, `--hold-ms`); 0
where that means none (no soak, no warm-up)."""
PositiveDuration = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A length of time that must pass for anything to be measured (a ramp's step)."""
Count = Annotated[int, Field(ge=1)]
"""A whole number of at least one: seeds, nodes, GPUs per node, requests per second."""


def _commas(text: Any) -> Any:
    return text.split(",") if isinstance(text, str) else text


def comma_list(item: Any) -> Any:
    """A comma-separated list of `item`s, such as '250,500,1000'."""
    return Annotated[list[item], BeforeValidator(_commas)]


def port_base(above: int) -> Any:
    """The first of the ports a bench's own stack listens on, the last `above` ports further
    up: none of them privileged (below 1024) or past 65535."""
    return Annotated[int, Field(ge=1024, le=65_535 - above)]


def option(annotation: Any) -> Callable[[str], Any]:
    """An argparse `type=` that reads the option's text as `annotation`; what it refuses is
    argparse's error, such as `argument --soak: '-5': Input should be greater than or equal
    to 0`."""
    adapter = TypeAdapter(annotation)

    def read(text: str) -> Any:
        try:
            return adapter.validate_python(text)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError("; ".join(
                f"{error['input']!r}: {error['msg']}" for error in exc.errors())) from None

    return read
