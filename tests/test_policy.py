"""stop_on / raise_on: parsing with errors that name the value, and the pure decision."""

from __future__ import annotations

import pytest

from stethoscope.detectors import DETECTORS
from stethoscope.engine.policy import Decision, Policy, decide, parse_policy
from stethoscope.findings import Finding

KNOWN = tuple(DETECTORS)


def finding(detector: str = "loss_spike", severity: str = "warning", step: int = 3) -> Finding:
    return Finding(step=step, epoch=0, detector=detector, severity=severity, message="m.")


def parse(value, argument: str = "stop_on") -> Policy:
    return parse_policy(value, argument=argument, known=KNOWN)


# -- parse_policy ---------------------------------------------------------------------------------
NAMES = ("loss_spike", "unstable_loss", "nonfinite_loss")
CASES = {(n, s) for n in NAMES for s in ("info", "warning", "error")}


def _at_least(severities: tuple[str, ...], names: tuple[str, ...] = NAMES):
    return {(n, s) for n in names for s in severities}


@pytest.mark.parametrize(
    ("value", "matches"),
    [
        pytest.param(None, set(), id="None-never"),
        pytest.param("error", _at_least(("error",)), id="error"),
        pytest.param("warning", _at_least(("warning", "error")), id="warning-and-up"),
        pytest.param({"loss_spike"}, _at_least(("warning", "error"), ("loss_spike",)), id="names"),
        pytest.param(
            ["unstable_loss", "nonfinite_loss"],
            _at_least(("warning", "error"), ("unstable_loss", "nonfinite_loss")),
            id="list-of-names",
        ),
        pytest.param(frozenset(), set(), id="empty-set-never"),
        pytest.param(
            (n for n in ["loss_spike"]),
            _at_least(("warning", "error"), ("loss_spike",)),
            id="generator",
        ),
    ],
)
def test_parse_policy_matches(value, matches):
    policy = parse(value)
    assert {c for c in CASES if policy.matches(finding(*c))} == matches


@pytest.mark.parametrize("bad", ["fatal", "Error", "info", "", "loss_spike", "errors"])
@pytest.mark.parametrize("argument", ["stop_on", "raise_on"])
def test_parse_policy_bad_string_names_value_and_choices(bad, argument):
    with pytest.raises(ValueError, match=rf"{argument}={bad!r} is not valid") as info:
        parse(bad, argument)
    msg = str(info.value)
    for choice in ("None", "'error'", "'warning'", "detector names"):
        assert choice in msg


def test_parse_policy_unknown_names_are_listed_with_the_known_ones():
    with pytest.raises(ValueError) as info:
        parse({"loss_spike", "zebra", "nope"}, "raise_on")
    msg = str(info.value)
    assert "raise_on" in msg
    assert "['nope', 'zebra']" in msg
    for name in KNOWN:
        assert name in msg


def test_parse_policy_known_names_come_from_the_caller():
    assert parse_policy({"my_detector"}, argument="stop_on", known=["my_detector"]).matches(
        finding("my_detector")
    )
    with pytest.raises(ValueError, match="my_detector"):
        parse({"my_detector"})


# regression of d6cb240: frozenset(5) raised TypeError "'int' object is not iterable"
@pytest.mark.parametrize("bad", [5, True, 1.5])
def test_parse_policy_non_iterable_names_value_and_choices(bad):
    with pytest.raises(ValueError, match=rf"stop_on={bad!r}") as info:
        parse(bad)
    for choice in ("None", "'error'", "'warning'", "detector names"):
        assert choice in str(info.value)


# regression of d6cb240: sorting {'nope', 3} raised TypeError "'<' not supported ..."
def test_parse_policy_mixed_types_raise_value_error():
    with pytest.raises(ValueError, match=r"stop_on names unknown detectors \['nope', 3\]"):
        parse({"nope", 3})


def test_parse_policy_non_str_names_raise_value_error():
    with pytest.raises(ValueError, match=r"\[3\]"):
        parse({3})


# -- decide ---------------------------------------------------------------------------------------
def test_decide_nothing_to_do():
    assert decide([], parse("warning"), parse("error")) == Decision()
    assert decide([finding(severity="info")], parse("warning"), parse("warning")) == Decision()
    d = decide([finding(severity="error")], parse(None), parse(None))
    assert (d.stop, d.raise_, d.reason) == (False, False, None)


def test_decide_stops_on_the_first_match():
    fs = [
        finding(severity="info", step=1),
        finding(severity="warning", step=2),
        finding(severity="error", step=3),
    ]
    d = decide(fs, parse("warning"), parse(None))
    assert (d.stop, d.raise_, d.reason) == (True, False, fs[1])
    d = decide(fs, parse("error"), parse(None))
    assert d.reason is fs[2]


def test_decide_raise_on_wins_over_stop_on():
    fs = [finding("loss_spike", "warning", 1), finding("nonfinite_loss", "error", 2)]
    d = decide(fs, parse("warning"), parse("error"))
    assert (d.stop, d.raise_, d.reason) == (True, True, fs[1])
    d = decide(fs, parse("warning"), parse({"loss_spike"}))
    assert (d.stop, d.raise_, d.reason) == (True, True, fs[0])


def test_decide_by_names_ignores_other_detectors_even_errors():
    fs = [finding("nonfinite_loss", "error"), finding("unstable_loss", "warning", 9)]
    d = decide(fs, parse({"unstable_loss"}), parse(None))
    assert (d.stop, d.reason) == (True, fs[1])
    assert decide(fs[:1], parse({"unstable_loss"}), parse({"loss_spike"})) == Decision()
