"""The floating-point formats training runs in, and the limits a precision detector
judges against: how many significant bits each keeps, its largest finite value, its
smallest normal and smallest subnormal magnitude.

A dtype is named as both frameworks print it without their prefix (``"bfloat16"``,
``"float16"``, ``"float8_e4m3fn"``); :func:`format_of` takes either spelling.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["E4M3", "E5M2", "FORMATS", "HALF", "NumberFormat", "format_of", "sum_tolerance"]


@dataclass(frozen=True)
class NumberFormat:
    """One floating-point format.

    Args:
        name: Its dtype name (``"bfloat16"``).
        bits: Significant bits, the implicit leading one included (bfloat16: 8).
        max: The largest finite magnitude.
        tiny: The smallest normal magnitude: below it a value is subnormal and keeps
            fewer significant bits, down to one at :attr:`smallest`.
        smallest: The smallest subnormal magnitude; half of it rounds to zero.
    """

    name: str
    bits: int
    max: float
    tiny: float
    smallest: float

    @property
    def eps(self) -> float:
        """The gap between 1 and the next larger value: an update smaller than half of
        ``eps * |w|`` leaves a weight ``w`` as it was (round to nearest)."""
        return 2.0 ** (1 - self.bits)


FORMATS: dict[str, NumberFormat] = {
    f.name: f
    for f in (
        NumberFormat("float64", 53, 1.7976931348623157e308, 2.0**-1022, 2.0**-1074),
        NumberFormat("float32", 24, 3.4028234663852886e38, 2.0**-126, 2.0**-149),
        NumberFormat("bfloat16", 8, 3.3895313892515355e38, 2.0**-126, 2.0**-133),
        NumberFormat("float16", 11, 65504.0, 2.0**-14, 2.0**-24),
        # fp8 as Transformer Engine uses it: e4m3 (no infinities, max 448) for weights and
        # activations, e5m2 for gradients
        NumberFormat("float8_e4m3fn", 4, 448.0, 2.0**-6, 2.0**-9),
        NumberFormat("float8_e5m2", 3, 57344.0, 2.0**-14, 2.0**-16),
    )
}
#: The 16-bit formats weights, gradients and activations are held in when a run trains
#: in low precision: what the precision detectors judge (float32 and float64: silent).
HALF = frozenset({"bfloat16", "float16"})
E4M3 = FORMATS["float8_e4m3fn"]
E5M2 = FORMATS["float8_e5m2"]

_ALIASES = {"half": "float16", "bf16": "bfloat16", "float": "float32", "double": "float64"}


def format_of(dtype: object) -> NumberFormat | None:
    """The format of ``dtype`` (a ``torch.dtype``, a Keras or numpy dtype, or its name),
    or None for a type that is not floating point."""
    name = getattr(dtype, "name", None)
    if not isinstance(name, str):  # a torch.dtype, a string, or a numpy scalar type
        name = str(dtype) if not isinstance(dtype, type) else dtype.__name__
    name = name.rsplit(".", 1)[-1]
    return FORMATS.get(_ALIASES.get(name, name))


def sum_tolerance(dtype: object) -> float:
    """How far from 1 a row of probabilities held in ``dtype`` may sum and still be
    probabilities: each value is rounded to half a unit in its last place, and the
    softmax that made them computed in that dtype, so a few ulps (a bfloat16 softmax's
    rows stray by up to a few 1e-3; float32's by far less than the 1e-3 kept as the
    floor)."""
    fmt = format_of(dtype)
    return max(1e-3, 4 * fmt.eps) if fmt is not None else 1e-3
