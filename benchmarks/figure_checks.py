"""Checks that a benchmark's figures can be true, run on each figure before it is written.

A published figure was once negative seconds, extrapolated from right measurements by a wrong scale, and the tokens/s
and ratios built on it were printed as results. A check here raises :class:`FigureError` naming the figure and why
it cannot be right; :class:`FigureAudit` collects those errors per report section, so that the failing figure is
reported as a failure and withheld while the others are kept, and the run exits non-zero. ``gpu_offload.py`` imports
it as a sibling script (the benchmarks are scripts, not a package).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class FigureError(ValueError):
    """A figure that cannot be right.

    Args:
        figure: What the figure is, as the report names it.
        why: What is wrong with it.
    """

    def __init__(self, figure: str, why: str):
        super().__init__(f"{figure}: {why}")
        self.figure = figure
        self.why = why


@dataclass(frozen=True)
class Noise:
    """How far measured figures may stray from what must hold before a check calls them wrong.

    Args:
        fall: How much faster, relatively, a forward over more tokens may be than one over fewer, beyond the spread
            of the repeats of each.
        over_bound: The largest multiple of its measured bound an achieved bandwidth may reach (the bound is itself
            a median of measurements).
        split: How much, relatively, parts of a time timed by other clocks may add up to more than the whole.
    """

    fall: float = 0.05
    over_bound: float = 1.05
    split: float = 0.02


MEASURED = Noise()
# On the CPU stand-in (--tiny) the timings are a shared machine's noise and mean nothing (a millisecond forward
# delayed 5x by another process's turn is common on 2 cores): the checks still run there, so that a sign, a NaN, a
# zero or a collapse fails the rehearsal, but a fall up to fivefold and a bandwidth up to tenfold its bound do not.
STAND_IN = Noise(fall=0.8, over_bound=10.0)


def positive(figure: str, value: Any) -> float:
    """``value`` if it is a finite number above zero (seconds, tokens/s, GB/s, ratios); else :class:`FigureError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise FigureError(figure, f"{value!r} is not a finite number above zero")
    return float(value)


def non_negative(figure: str, value: Any) -> float:
    """``value`` if it is a finite number of at least zero (a time that may be nothing); else :class:`FigureError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise FigureError(figure, f"{value!r} is not a finite number of at least zero")
    return float(value)


def positive_curve(figure: str, curve: Mapping[str, Any]) -> None:
    """Every point of a figure per token count (``{"16": seconds, ...}``) is :func:`positive`."""
    if not curve:
        raise FigureError(figure, "no point at all")
    for tokens, value in curve.items():
        positive(f"{figure} at {tokens} tokens", value)


def not_falling(
    figure: str, seconds: Mapping[str, float], spread: Mapping[str, Sequence[float]] | None, noise: Noise
) -> None:
    """Raises :class:`FigureError` where a forward over more tokens took less time than one over fewer, beyond noise.

    More tokens are more work over the same weights, so the time cannot fall; it may seem to, by noise. A fall is
    noise while the slowest repeat at the larger count is within ``noise.fall`` of the fastest repeat at the smaller
    count (their ranges overlap, give or take that much).

    Args:
        figure: The curve's name.
        seconds: Median seconds by token count (as strings).
        spread: Each count's repeats, or their ``[fastest, slowest]``; a count without is its median alone.
        noise: ``noise.fall`` is the relative fall allowed beyond the spread.
    """
    positive_curve(figure, seconds)
    counts = sorted(seconds, key=int)
    fastest = {n: min((spread or {}).get(n) or [seconds[n]]) for n in counts}
    slowest = {n: max((spread or {}).get(n) or [seconds[n]]) for n in counts}
    for position, fewer in enumerate(counts):
        for more in counts[position + 1 :]:
            if slowest[more] < fastest[fewer] * (1 - noise.fall):
                spread_text = (f"slowest repeat {slowest[more]:.4g} s against the fastest {fastest[fewer]:.4g} s, "
                               "beyond the repeats' spread" if spread else "no repeats' spread recorded")
                raise FigureError(figure, f"{seconds[more]:.4g} s over {more} tokens, less than {seconds[fewer]:.4g} s "
                                  f"over {fewer} ({spread_text} and {noise.fall:.0%})")


def within_bound(figure: str, gbps: Any, bound_gbps: Any, noise: Noise) -> float:
    """An achieved bandwidth, if it is :func:`positive` and at most ``noise.over_bound`` times its measured bound."""
    achieved = positive(figure, gbps)
    bound = positive(f"the bound of {figure}", bound_gbps)
    if achieved > bound * noise.over_bound:
        raise FigureError(figure, f"{achieved:.4g} GB/s is above {noise.over_bound:g}x the measured bound of "
                          f"{bound:.4g} GB/s: the bytes or the seconds are wrong")
    return achieved


def parts_within(figure: str, whole: Any, parts: Mapping[str, Any], noise: Noise) -> float:
    """What is left of a :func:`positive` time ``whole`` after its :func:`non_negative` ``parts`` (a split of it),
    raising :class:`FigureError` if the parts exceed the whole by more than ``noise.split`` of it."""
    total = positive(figure, whole)
    spent = sum(non_negative(f"{figure}: {name}", value) for name, value in parts.items())
    if spent > total * (1 + noise.split):
        raise FigureError(figure, f"its parts ({', '.join(f'{name} {value:.4g} s' for name, value in parts.items())}) "
                          f"add up to more than the whole {total:.4g} s")
    return total - spent


def ratio(figure: str, numerator: Any, denominator: Any) -> float:
    """A ratio derived from two :func:`positive` parts (each checked first, so a ratio of two wrong signs fails)."""
    return positive(figure, positive(f"{figure}: numerator", numerator) / positive(f"{figure}: denominator",
                                                                                     denominator))


@dataclass
class FigureAudit:
    """Runs checks over a report's figures and keeps what failed, by section.

    Args:
        noise: What the checks allow.
        failures: ``{"section", "figure", "why"}`` for each check that failed.
    """

    noise: Noise
    failures: list[dict[str, str]] = field(default_factory=list)

    def passes(self, section: str, check: Callable[[], Any]) -> bool:
        """Whether ``check()`` raises no :class:`FigureError`; the error is recorded under ``section`` if it does."""
        try:
            check()
        except FigureError as error:
            self.failures.append({"section": section, "figure": error.figure, "why": error.why})
            return False
        return True
