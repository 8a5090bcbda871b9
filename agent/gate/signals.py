"""The gate's signals: every statistic the gate can hold against a bar, each one small object.

A signal declares what a turn must have gathered for it (``needs``), the phase of the turn it is read in, whether it
ranks the evicted messages (and so can name the ones a firing brings back), and reads a turn's measurements into its
value and, where it ranks them, a score per evicted message. ``SIGNALS`` is the one registry: configuration
validation, the calibration and the gate look a statistic up there and ask it, never its name's text. A new signal is
one class (or one instance of an existing one) and an entry in ``SIGNALS``; ``tests/test_signals.py`` runs every entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

import numpy as np

from native import poisson

if TYPE_CHECKING:
    from collections.abc import Sequence

Phase = Literal["question", "answer"]
QUESTION: Phase = "question"
"""Read once the question is prefilled, before the answer."""
ANSWER: Phase = "answer"
"""Read at every answer step."""

Need = Literal["question certificate", "answer steps", "question attention", "sketch"]
QUESTION_CERTIFICATE: Need = "question certificate"
"""The kept sample's relative certificate over the question window's rows."""
ANSWER_STEPS: Need = "answer steps"
"""One relative certificate per answer step (costly: the gate asks for them only when a signal needs them)."""
QUESTION_ATTENTION: Need = "question attention"
"""The question's attention readout over the live cells with their inclusion probabilities."""
SKETCH: Need = "sketch"
"""The evicted-key sketch scored against the question's queries, with each message's baseline."""

AGGREGATES: tuple[str, ...] = ("layer_max_head_mean", "q", "mean", "max", "step_max_layer_max_head_mean",
                               "step_max_q")
"""The aggregates of a certificate window (``native.poisson.window_statistics``)."""


class Measured(Protocol):
    """What a turn measured that signals read (``agent.gate.decision.TurnCertificates`` is one)."""

    question: np.ndarray | None
    answer: list[np.ndarray]
    evicted_share: dict[str, float]
    sketch: dict[str, float]
    anomalies: dict[int, float]


class Form(Protocol):
    """How raw certificate rows become the certificate read (``agent.gate.certificate.CertificateForm``)."""

    def apply(self, rel: np.ndarray) -> np.ndarray: ...


def _window(turn: Measured, form: Form, phase: Phase) -> np.ndarray | None:
    """A certificate window in ``form``: the question's rows, or the answer's steps stacked; None where empty."""
    if phase == QUESTION:
        return form.apply(turn.question) if turn.question is not None and turn.question.size else None
    return form.apply(np.stack(turn.answer)) if turn.answer else None


def _has_certificate(turn: Measured) -> bool:
    # the turn's record lists the readout's statistics only beside a certificate window (TurnCertificates.statistics)
    return (turn.question is not None and bool(turn.question.size)) or bool(turn.answer)


@dataclass(frozen=True)
class Signal:
    """The base every signal shares: its name, what it reads, when, and whether it names messages."""

    name: str
    phase: ClassVar[Phase] = QUESTION
    needs: ClassVar[frozenset[Need]] = frozenset()
    names_messages: ClassVar[bool] = False
    """Ranks the evicted messages (:meth:`scores`): a firing can bring back the ones it points at."""
    certificate: ClassVar[bool] = False
    """A value of the kept sample's certificate: a calibrated τ holds on the certificate form it was fitted in."""

    @property
    def reads_evicted(self) -> bool:
        """Reads every evicted cell rather than the kept sample, so it speaks where too few pages were sampled to
        certify the turn."""
        return SKETCH in self.needs

    def read(self, turn: Measured, form: Form) -> float | None:
        """The turn's value (None: the turn did not gather what this signal reads); ``form`` the certificate form."""
        raise NotImplementedError

    def scores(self, turn: Measured) -> dict[int, float]:
        """Message index → score, for every evicted message the signal ranks ({} for a signal that names none)."""
        return {}


@dataclass(frozen=True)
class QuestionCertificate(Signal):
    """An aggregate (``AGGREGATES``) of the certificate over the question window's rows."""

    aggregate: str = "max"
    needs: ClassVar[frozenset[Need]] = frozenset({QUESTION_CERTIFICATE})
    certificate: ClassVar[bool] = True

    def read(self, turn: Measured, form: Form) -> float | None:
        window = _window(turn, form, self.phase)
        return None if window is None else poisson.window_statistics(window)[self.aggregate]


@dataclass(frozen=True)
class AnswerCertificate(QuestionCertificate):
    """An aggregate (``AGGREGATES``) of the certificate over the answer's steps so far."""

    phase: ClassVar[Phase] = ANSWER
    needs: ClassVar[frozenset[Need]] = frozenset({ANSWER_STEPS})


@dataclass(frozen=True)
class EvictedShare(Signal):
    """The share of the question's attention standing in for evicted cells (``decision.evicted_share``), the mean
    over layers or the largest layer's; read with the question's certificate."""

    needs: ClassVar[frozenset[Need]] = frozenset({QUESTION_CERTIFICATE, QUESTION_ATTENTION})

    def read(self, turn: Measured, form: Form) -> float | None:
        return turn.evicted_share.get(self.name) if _has_certificate(turn) else None


@dataclass(frozen=True)
class SketchSignal(Signal):
    """A reading of the evicted-key sketch (``Gate.read_sketch``): ``sketch.max``, the largest anomaly over the
    mostly evicted messages, or ``sketch.evicted_mass``. Either way the sketch's read ranks the evicted messages by
    their anomaly, which is what a firing names."""

    needs: ClassVar[frozenset[Need]] = frozenset({SKETCH})
    names_messages: ClassVar[bool] = True

    def read(self, turn: Measured, form: Form) -> float | None:
        return turn.sketch.get(self.name)

    def scores(self, turn: Measured) -> dict[int, float]:
        return dict(turn.anomalies)


def _registry(signals: Sequence[Signal]) -> dict[str, Signal]:
    return {s.name: s for s in signals}


SIGNALS: dict[str, Signal] = _registry([
    *(QuestionCertificate(f"question.{a}", a) for a in AGGREGATES),
    EvictedShare("question.evicted_share"),
    EvictedShare("question.evicted_share_layer_max"),
    *(AnswerCertificate(f"answer.{a}", a) for a in AGGREGATES),
    SketchSignal("sketch.max"),
    SketchSignal("sketch.evicted_mass"),
])
"""Every statistic the gate can read, by name: the one list of them."""

NAMES: tuple[str, ...] = tuple(SIGNALS)


def get(name: str) -> Signal:
    """The signal called ``name``; ValueError naming the choices otherwise."""
    try:
        return SIGNALS[name]
    except KeyError:
        raise ValueError(f"unknown gate statistic {name!r}; choose one of {', '.join(SIGNALS)}") from None
