"""Certifying a budget for a model: how much of what the full cache knows an evicting budget may lose.

A *loss* is a question the full cache answered right and the budget (with the model's gate) answered wrong, on the
same chat, replayed greedily in lockstep. The *risk* a user names is the share of the full cache's right answers a
budget may lose. ``certchat calibrate`` replays long calibration chats under the full cache and several budgets and
records, per budget, the paired counts; this module turns them into certified risks and picks a budget.

The bound. Among the ``n`` probes the full cache answered right, ``lost`` were lost. If those probes are
independent draws from the questions users ask, ``lost`` is binomial in ``n`` with the budget's loss rate ``p``,
whatever ``p`` is, and the one-sided Clopper–Pearson bound ``u`` (the ``p`` at which seeing at most ``lost`` losses
has probability 1 − confidence) satisfies P(p ≤ u) ≥ confidence: exact, no normal approximation, so it is valid
at the small counts a calibration has. Pairing is what makes the count a loss at all: both runs answer the same
question after the same chat, so a lost probe is one the eviction cost, not a different question. Probes the
budget got right and the full cache did not are not set against the losses: the risk is about forgetting what the
full cache knows. Probes of one chat share its history and are not strictly independent; the record therefore keeps
each chat's counts, and a budget is never certified on fewer than :data:`MIN_PROBES` right answers.

Several budgets. They are tested in a fixed sequence, the largest (safest) first, stopping at the first whose
bound exceeds the risk. Fixed-sequence testing controls the chance of certifying any budget whose loss exceeds the
risk at 1 − confidence without splitting it among the budgets (Learn-then-Test, Angelopoulos et al. 2021), so a
budget's *certified risk* is the largest bound among it and every budget before it in the sequence, and the chosen
budget is the cheapest whose certified risk is at most the user's risk. Where none is, the chat keeps its full cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from agent.config import Budget

CONFIDENCE = 0.95
"""The confidence of every certified risk."""
MIN_PROBES = 30
"""Fewest right answers of the full cache a budget is certified on: below it the chats are too few to say much,
whatever the bound (30 losses-free probes bound the loss at 9.5%)."""
NO_BUDGET = "{model}: no budget keeps the loss under {risk} on long chats — full cache"
"""Why a model keeps its full cache under ``budget = "auto"`` when its record certifies no budget at the risk."""
NOT_CERTIFIED = "{model}: no budget certified on long chats (`certchat calibrate` certifies them) — full cache"
"""Why a model keeps its full cache under ``budget = "auto"`` when its record has no certification."""
UNCERTIFIED_BUDGET = "{model}: budget {budget} is not certified on long chats ({detail})"
"""The one line an explicit budget gets when the model's record does not certify it at the risk."""


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X ≤ k) for X ~ Binomial(n, p), summed in log space so large ``n`` does not underflow."""
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
             for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def upper_bound(lost: int, n: int, confidence: float = CONFIDENCE) -> float:
    """The one-sided Clopper–Pearson upper bound on a binomial rate after ``lost`` successes in ``n`` trials: the
    rate at which at most ``lost`` has probability 1 − ``confidence``. 1.0 when ``n`` is 0 or everything was lost."""
    if not 0 <= lost <= n:
        raise ValueError(f"lost must be within 0..n, got {lost} of {n}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence}")
    if n == 0 or lost == n:
        return 1.0
    alpha = 1.0 - confidence
    if lost == 0:
        return 1.0 - alpha ** (1.0 / n)  # closed form: (1 − p)^n = α
    lo, hi = lost / n, 1.0
    for _ in range(100):  # the CDF falls as p rises: bisect to well below any printed precision
        mid = (lo + hi) / 2
        if binomial_cdf(lost, n, mid) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


@dataclass(frozen=True)
class Trial:
    """One budget's paired counts against the full cache, over the calibration chats.

    ``kept``: both right; ``lost``: full right, budget wrong; ``gained``: budget right only; ``neither``."""

    budget: str
    kept: int
    lost: int
    gained: int = 0
    neither: int = 0
    by_chat: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        """The full cache's right answers: the probes a loss is counted among."""
        return self.kept + self.lost

    @property
    def loss(self) -> float | None:
        """The measured loss: lost / n (None without a right answer)."""
        return self.lost / self.n if self.n else None

    def bound(self, confidence: float = CONFIDENCE) -> float:
        return upper_bound(self.lost, self.n, confidence)

    @property
    def share(self) -> float:
        return _share(self.budget)

    def to_json(self) -> dict[str, Any]:
        return {"budget": self.budget, "n": self.n, "kept": self.kept, "lost": self.lost, "gained": self.gained,
                "neither": self.neither, "loss": self.loss, "by_chat": {k: dict(v) for k, v in self.by_chat.items()}}

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> Trial:
        return cls(budget=str(row["budget"]), kept=int(row["kept"]), lost=int(row["lost"]),
                   gained=int(row.get("gained", 0)), neither=int(row.get("neither", 0)),
                   by_chat=dict(row.get("by_chat", {})))


def _share(budget: str) -> float:
    parsed = Budget.parse(budget)
    if parsed.share is None:
        raise ValueError(f"certification budgets are shares of the history (like 25%), got {budget!r}")
    return parsed.share


def pair(full: Mapping[Any, bool], budget: Mapping[Any, bool]) -> tuple[int, int, int, int]:
    """(kept, lost, gained, neither) over the probes both runs answered, keyed alike (e.g. (chat, turn))."""
    kept = lost = gained = neither = 0
    for key, right in full.items():
        if key not in budget:
            continue
        other = budget[key]
        if right and other:
            kept += 1
        elif right:
            lost += 1
        elif other:
            gained += 1
        else:
            neither += 1
    return kept, lost, gained, neither


def certified_risks(trials: Iterable[Trial], confidence: float = CONFIDENCE,
                    min_probes: int = MIN_PROBES) -> dict[str, float | None]:
    """Each budget's certified risk under fixed-sequence testing, largest budget first: the largest bound among it
    and the budgets before it. None for a budget on fewer than ``min_probes`` right answers, and for every budget
    after it (the sequence stops there)."""
    out: dict[str, float | None] = {}
    worst = 0.0
    stopped = False
    for t in sorted(trials, key=lambda t: -t.share):
        if stopped or t.n < min_probes:
            stopped = True
            out[t.budget] = None
            continue
        worst = max(worst, t.bound(confidence))
        out[t.budget] = worst
    return out


@dataclass(frozen=True)
class Choice:
    """What ``budget = "auto"`` runs for a risk: a certified budget, or None (the full cache) with why."""

    budget: str | None
    certified_risk: float | None
    reason: str | None = None


def choose(trials: Sequence[Trial], risk: float, model: str, confidence: float = CONFIDENCE,
           min_probes: int = MIN_PROBES) -> Choice:
    """The cheapest budget whose certified risk is at most ``risk``; else the full cache, with the one line why."""
    risks = certified_risks(trials, confidence, min_probes)
    best: tuple[float, str, float] | None = None
    for t in trials:
        r = risks.get(t.budget)
        if r is not None and r <= risk and (best is None or t.share < best[0]):
            best = (t.share, t.budget, r)
    if best is None:
        return Choice(None, None, NO_BUDGET.format(model=model, risk=percent(risk)))
    return Choice(best[1], best[2])


def percent(x: float, up: bool = True) -> str:
    """A share as the user would write it (5%, 2.5%, 24%): rounded up unless ``up`` is false, so a printed bound
    never understates it."""
    v = x * 100
    step = 10 if v < 10 else 1
    rounded = (math.ceil(v * step - 1e-9) if up else round(v * step)) / step
    return f"{rounded:g}%"


@dataclass(frozen=True)
class Certification:
    """A model record's ``certification``: the paired trials per budget and what they were measured on."""

    trials: tuple[Trial, ...]
    confidence: float = CONFIDENCE
    min_probes: int = MIN_PROBES
    record: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_record(cls, data: Mapping[str, Any] | None) -> Certification | None:
        if not data or not data.get("budgets"):
            return None
        return cls(trials=tuple(Trial.from_json(b) for b in data["budgets"]),
                   confidence=float(data.get("confidence", CONFIDENCE)),
                   min_probes=int(data.get("min_probes", MIN_PROBES)), record=dict(data))

    def choose(self, risk: float, model: str) -> Choice:
        return choose(self.trials, risk, model, self.confidence, self.min_probes)

    def certified_risk(self, budget: Budget | str) -> float | None:
        """The risk ``budget`` is certified at (None: not measured, or on too few probes)."""
        wanted = Budget.parse(budget)
        risks = certified_risks(self.trials, self.confidence, self.min_probes)
        return next((risks[t.budget] for t in self.trials if Budget.parse(t.budget) == wanted), None)

    def explain(self, budget: Budget | str, risk: float, model: str) -> str | None:
        """The one line for an explicit ``budget`` not certified at ``risk`` (None when it is)."""
        r = self.certified_risk(budget)
        if r is not None and r <= risk:
            return None
        if r is None:
            measured = next((t for t in self.trials if Budget.parse(t.budget) == Budget.parse(budget)), None)
            detail = ("not measured" if measured is None
                      else f"measured on {measured.n} right answers, fewer than {self.min_probes}")
        else:
            detail = f"certified ≤ {percent(r)} loss, above the risk {percent(risk)}"
        return UNCERTIFIED_BUDGET.format(model=model, budget=budget, detail=detail)

    def to_json(self) -> dict[str, Any]:
        risks = certified_risks(self.trials, self.confidence, self.min_probes)
        return {**self.record, "confidence": self.confidence, "min_probes": self.min_probes,
                "bound": "one-sided Clopper-Pearson, fixed-sequence over budgets (largest first)",
                "budgets": [{**t.to_json(), "bound": t.bound(self.confidence), "certified_risk": risks[t.budget]}
                            for t in sorted(self.trials, key=lambda t: -t.share)]}


def setting_line(cert: Certification | None, risk: float, model: str) -> str:
    """What ``budget = "auto"`` runs for ``model`` at ``risk``, with the figures behind it, in one line: the README's
    model table and ``certchat models list`` print it, so the advice on choosing a model is the record's."""
    if cert is None:
        return "full cache: not certified on long chats"
    choice = cert.choose(risk, model)
    if choice.budget is not None:
        t = next(t for t in cert.trials if t.budget == choice.budget)
        return (f"{choice.budget} · certified ≤ {percent(choice.certified_risk or 0.0)} loss (lost {t.lost} of "
                f"{t.n} right answers)")
    measured = sorted((t for t in cert.trials if t.n), key=lambda t: -t.share)
    if not measured:
        return "full cache: not certified on long chats"
    t = measured[0]
    return (f"full cache: no budget certified ≤ {percent(risk)} loss ({t.budget} lost {t.lost} of {t.n} right "
            f"answers, bound {percent(t.bound(cert.confidence))})")
