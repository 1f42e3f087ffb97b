"""Statistics an operator may watch continuously: the mixture sequential probability ratio test (mSPRT).

An A/B test read over and over with a fixed-horizon test (a t-test at 95%, say) declares a false difference far
more often than 5% of the time: every look is another chance for noise to cross the line. The mSPRT (Robbins
1970; Johari, Pekelis and Walsh, "Always valid inference", 2017) gives p-values and confidence intervals that
hold at every sample size at once, so an experiment can be read at any moment and stopped when it has an answer,
without a sample size fixed up front.

For the difference ``theta`` between two arms' means, estimated by ``d`` with variance ``v`` (the two means'
variances summed), and a normal mixing distribution N(0, ``tau``\\ :sup:`2`) over the alternatives, the mixture
likelihood ratio against ``theta = 0`` is::

    L = sqrt(v / (v + tau^2)) * exp(d^2 tau^2 / (2 v (v + tau^2)))

and {L >= 1/alpha}, checked after every sample, happens with probability at most ``alpha`` when the arms do not
differ. The same ratio centred on any ``theta`` gives the confidence sequence `Comparison.low`..`high`, which
covers the true difference at every sample size with probability ``1 - alpha``. ``tau`` is the scale of the
differences the test is most sensitive to (any difference is found eventually); the variance is estimated from
the samples, which is the usual large-sample use of the test, so a minimum sample precedes any verdict.

Latency is compared on the log scale (the difference of mean log-latency is the log of the ratio of geometric
means: 0.1 is ~10% slower), error rates as proportions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["Comparison", "Moments", "Verdict", "compare", "mixture_ratio"]

Verdict = Literal["better", "worse", "no difference yet"]


@dataclass(slots=True)
class Moments:
    """Count, mean and sum of squared deviations of a stream of numbers (Welford's update: exact, O(1) memory)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (value - self.mean)

    def replace(self, old: float, new: float) -> None:
        """The moments as if one value ``old`` added before had been ``new`` (a request's outcome corrected)."""
        if not self.count:
            raise ValueError("no value to replace")
        mean = self.mean + (new - old) / self.count
        self.m2 = max(self.m2 + (new - old) * (new - mean + old - self.mean), 0.0)
        self.mean = mean

    @property
    def variance(self) -> float:
        """The sample variance (0 for fewer than two values)."""
        return self.m2 / (self.count - 1) if self.count > 1 else 0.0

    def merged(self, other: Moments) -> Moments:
        """The moments of both streams together (Chan et al.'s pairwise rule)."""
        count = self.count + other.count
        if not count:
            return Moments()
        delta = other.mean - self.mean
        mean = self.mean + delta * other.count / count
        return Moments(count, mean, self.m2 + other.m2 + delta * delta * self.count * other.count / count)


@dataclass(frozen=True, slots=True)
class Comparison:
    """One metric of a treatment arm against the control: ``difference`` (treatment minus control) with the
    always-valid confidence interval ``low``..``high`` at level ``1 - alpha``, the always-valid ``p_value``, and the
    ``verdict``. ``lower_is_better`` says which sign is good (latency, error rate)."""

    difference: float
    low: float
    high: float
    p_value: float
    verdict: Verdict
    control_count: int
    treatment_count: int


def mixture_ratio(difference: float, variance: float, tau: float) -> float:
    """The mSPRT's mixture likelihood ratio of a difference ``difference`` with variance ``variance`` against no
    difference, for a N(0, tau^2) mixture. Infinite for a non-zero difference known exactly (variance 0)."""
    if variance <= 0:
        return 1.0 if difference == 0 else math.inf
    total = variance + tau * tau
    exponent = difference * difference * tau * tau / (2 * variance * total)
    if exponent > 700:
        return math.inf
    return math.sqrt(variance / total) * math.exp(exponent)


def half_width(variance: float, tau: float, alpha: float) -> float:
    """Half the width of the mSPRT's confidence interval: the differences ``t`` it keeps are those whose centred
    ratio stays under 1/alpha, i.e. ``|d - t| < half_width``."""
    if variance <= 0:
        return 0.0
    total = variance + tau * tau
    return math.sqrt(variance * total / (tau * tau) * (2 * math.log(1 / alpha) + math.log(total / variance)))


def compare(
    control: Moments,
    treatment: Moments,
    *,
    tau: float,
    alpha: float = 0.05,
    min_samples: int = 200,
    lower_is_better: bool = True,
) -> Comparison:
    """The treatment's mean against the control's, with an always-valid interval and p-value. No verdict before
    each arm has ``min_samples`` values (the variances are estimates), and none while the interval holds 0.

    The p-value here is the current look's ``min(1, 1/L)``; an operator's running minimum over looks is valid too
    (the experiment keeps that)."""
    if not (0 < alpha < 1) or not tau > 0:
        raise ValueError(f"alpha must be in (0, 1) and tau > 0; got {alpha!r}, {tau!r}")
    difference = treatment.mean - control.mean
    if control.count < 2 or treatment.count < 2:
        return Comparison(difference, -math.inf, math.inf, 1.0, "no difference yet", control.count, treatment.count)
    variance = control.variance / control.count + treatment.variance / treatment.count
    ratio = mixture_ratio(difference, variance, tau)
    p_value = min(1.0, 1.0 / ratio) if ratio > 0 else 1.0
    width = half_width(variance, tau, alpha)
    low, high = difference - width, difference + width
    verdict: Verdict = "no difference yet"
    if min(control.count, treatment.count) >= min_samples and (low > 0 or high < 0):
        good = high < 0 if lower_is_better else low > 0
        verdict = "better" if good else "worse"
    return Comparison(difference, low, high, p_value, verdict, control.count, treatment.count)
