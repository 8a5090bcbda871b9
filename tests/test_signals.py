"""Every registered gate signal on constructed turns (no model): what it declares it needs, when it is read and
whether it names messages, checked against what it reads; and the registry as configuration and the gate use it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agent import config
from agent.gate import calibration, signals
from agent.gate.certificate import CertificateForm, Component
from agent.gate.decision import Gate, TurnCertificates
from agent.gate.signals import SIGNALS, Need, Signal
from native import poisson

EVERY_NEED: frozenset[Need] = frozenset({signals.QUESTION_CERTIFICATE, signals.ANSWER_STEPS,
                                         signals.QUESTION_ATTENTION, signals.SKETCH})
DOUBLED = CertificateForm((Component(2.0),))


def _turn(needs: frozenset[Need]) -> TurnCertificates:
    """A turn that gathered exactly ``needs``: certificate rows in (rows, layers, heads), steps in (layers, heads)."""
    rng = np.random.default_rng(7)
    turn = TurnCertificates()
    if signals.QUESTION_CERTIFICATE in needs:
        turn.question = rng.uniform(0.1, 1.0, size=(4, 3, 2))
    if signals.ANSWER_STEPS in needs:
        turn.answer = [rng.uniform(0.1, 1.0, size=(3, 2)) for _ in range(3)]
    if signals.QUESTION_ATTENTION in needs:
        turn.evicted_share = {"question.evicted_share": 0.2, "question.evicted_share_layer_max": 0.35}
    if signals.SKETCH in needs:
        turn.sketch = {"sketch.max": 6.5, "sketch.evicted_mass": 0.4}
        turn.anomalies = {3: 6.5, 7: 1.5}
    return turn


EVERY = pytest.mark.parametrize("signal", list(SIGNALS.values()), ids=list(SIGNALS))


@EVERY
def test_a_signal_reads_what_the_turn_records(signal: Signal) -> None:
    """On a turn that gathered everything, its value is the turn's own record of that statistic, in either form."""
    turn = _turn(EVERY_NEED)
    for form in (CertificateForm(), DOUBLED):
        value = signal.read(turn, form)
        assert value is not None and math.isfinite(value)
        assert value == turn.statistics(form)[signal.name]


@EVERY
def test_its_declared_needs_are_what_it_reads(signal: Signal) -> None:
    """Its needs alone give it a value; without any one of them it reads nothing."""
    assert signal.needs and signal.needs <= EVERY_NEED
    assert signal.read(_turn(signal.needs), CertificateForm()) is not None
    for need in signal.needs:
        assert signal.read(_turn(signal.needs - {need}), CertificateForm()) is None, need


@EVERY
def test_its_phase_and_form_follow_what_it_reads(signal: Signal) -> None:
    """An answer signal reads the answer's steps; a certificate signal scales with the certificate form, any other
    does not."""
    assert (signal.phase == signals.ANSWER) == (signals.ANSWER_STEPS in signal.needs)
    turn = _turn(EVERY_NEED)
    plain, doubled = signal.read(turn, CertificateForm()), signal.read(turn, DOUBLED)
    assert plain is not None and doubled is not None
    if signal.certificate:
        assert doubled == pytest.approx(2 * plain)
    else:
        assert doubled == plain
    assert calibration.is_certificate_statistic(signal.name) == signal.certificate


@EVERY
def test_a_signal_names_messages_when_it_ranks_them(signal: Signal) -> None:
    """A signal that names messages scores every evicted message the turn ranked; any other scores none."""
    scores = signal.scores(_turn(EVERY_NEED))
    if signal.names_messages:
        assert scores == {3: 6.5, 7: 1.5}
        assert signal.scores(_turn(EVERY_NEED - signal.needs)) == {}
    else:
        assert scores == {}
    assert signal.reads_evicted == (signals.SKETCH in signal.needs)


@EVERY
def test_the_gate_reads_it_in_its_phase(signal: Signal) -> None:
    """A gate on the signal asks for answer certificates only when it reads them, decides in its phase, reaches τ on
    its value and names messages only through a signal that ranks them."""
    gate = Gate(config.Config(gate="0.05", gate_stat=signal.name), None)
    assert gate.signal is signal and gate.statistic == signal.name
    assert gate.wants_answer_certificates() == (signals.ANSWER_STEPS in signal.needs)
    gate.turn = _turn(EVERY_NEED)
    decision = gate.question_decision()
    if signal.phase == signals.QUESTION:
        assert decision.fire and decision.value == signal.read(gate.turn, gate.turn.form)
    else:
        assert not decision.fire and decision.value is None


def test_the_registry_is_every_statistic_the_turn_records() -> None:
    """The certificate aggregates are native.poisson's; every statistic a full turn records is registered, and
    configuration takes exactly the registered names."""
    assert signals.AGGREGATES == tuple(poisson.window_statistics(np.ones((1, 1, 1))))
    assert set(_turn(EVERY_NEED).statistics()) == set(SIGNALS)
    for name in signals.NAMES:
        config.Config(gate_stat=name).validate()
        assert signals.get(name).name == name
    with pytest.raises(ValueError, match="unknown gate statistic"):
        signals.get("question.median")
    with pytest.raises(config.ConfigError, match="gate_stat"):
        config.Config(gate_stat="question.median").validate()
