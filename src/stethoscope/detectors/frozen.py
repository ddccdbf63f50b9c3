"""Parameters that require grad but never change: in no optimizer, or stepped by one
that holds other tensors than those the loss reaches."""

from __future__ import annotations

import numpy as np

from stethoscope.advice import optimizer_advice, unoptimized_advice
from stethoscope.detectors._stats import is_finite, median
from stethoscope.detectors._underflow import flushed
from stethoscope.detectors._updates import MOVED, listed, unmoved_cause
from stethoscope.detectors.base import Detector, check_positive
from stethoscope.findings import Finding
from stethoscope.number_formats import HALF
from stethoscope.observation import Observation

__all__ = ["FrozenWeights"]


class FrozenWeights(Detector):
    """Parameters that require grad but never change while the others do.

    Rule: a parameter that requires grad but is in no optimizer is a warning at
    once. A parameter whose update is exactly zero on ``patience`` sampled steps
    in a row, while the others changed (their median update is at least 1e-6
    of their norm), is a warning too (a param group with learning rate 0, an
    optimizer built before the layer was replaced). When everything barely
    moves, float32 rounds an update of 1e-9 to exactly zero: that is
    ``small_updates``' finding, not this one.
    Parameters with ``requires_grad=False`` are frozen on purpose and never
    watched; a parameter whose gradient is zero, or under 1e-6 of its norm, is
    not frozen but starved (see ``all_zero``, ``dead_relu``, ``vanishing_gradients``).

    Two cases where nothing trains at all:

    * the optimizers stepped no parameter that had a gradient (they hold only
      parameters with ``requires_grad=False``, or a module forward does not use, or
      tensors that are not the model's), while parameters in no optimizer got one: an
      error at once, naming both;
    * nothing moved on ``patience`` sampled steps in a row at a learning rate above 0
      while the loss is not 0, either because every gradient stepped is exactly zero
      (the optimizer holds parameters the loss does not reach) or although they are
      not, at a learning rate whose steps float32 could not round away (the update
      does not reach the parameters: a stale optimizer, weights restored after each
      step): a warning, once. Not a small learning rate: ``small_updates`` skips it.
      Nor gradients that a 16-bit backward pass flushed whole to zero with no loss
      scaling: the format lost them (``gradient_underflow``'s finding).
    A parameter held in 16 bits that does not move under a non-zero learning rate has
    its updates rounded away (``rounded_updates``' finding, not this one).

    Sources: SageMaker Debugger ``unchanged_tensor`` (allclose over 3 steps);
    here the comparison is exact, since any optimizer step with a non-zero
    gradient and learning rate changes a parameter.

    Args:
        patience: Consecutive sampled steps with a zero update for a warning.
    """

    name = "frozen_weights"
    needs = frozenset({"weights", "updates"})
    wants = frozenset({"grads"})  # a starved parameter is not a frozen one
    base_interval = 32  # slow faults; the snapshot they need is the costliest probe
    advice = "check the optimizer's param groups and their LR"

    def __init__(self, *, patience: int = 3) -> None:
        check_positive(self.name, "patience", patience, integer=True)
        self.patience = patience
        super().__init__()

    def _initial_state(self) -> dict:
        # moving: the median update ratio of the parameters that last moved; unmoved:
        # sampled steps in a row on which nothing moved though a learning rate would have;
        # said: the rules about the whole run already said ("nothing", "unmoved")
        return {"streaks": {}, "reported": [], "moving": None, "unmoved": 0, "said": []}

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        findings: list[Finding] = []
        nothing = self._nothing_trains(obs)
        if nothing is not None:
            findings.append(nothing)
        missing = [n for n in obs.unoptimized if n not in st["reported"]]
        if missing:
            st["reported"].extend(missing)
            findings.append(
                self.finding(
                    obs,
                    "warning",
                    f"Parameters that require grad are in no optimizer ({len(missing)}: "
                    f"{listed(missing)}), so they keep their initial values; "
                    f"{unoptimized_advice(self.setup)}.",
                    value=float(len(missing)),
                    where=missing[0],
                )
            )
        upd = obs.update_norm
        if len(upd) == 0:
            return findings  # no parameter stepped: the rule above has said it
        unmoved = self._unmoved(obs)
        if unmoved is not None:
            return [*findings, unmoved]
        moved = np.isfinite(upd) & (upd > 0)
        base = obs.prev_weight_norm if obs.prev_weight_norm is not None else obs.weight_norm
        usable = moved & np.isfinite(base) & (base > 0)
        if usable.any():
            st["moving"] = median((upd[usable] / base[usable]).tolist())
        elif np.isfinite(upd).all():
            st["moving"] = 0.0  # every parameter was measured and none moved (LR 0 for all)
        # judged on the last step that measured moving parameters (large models take turns)
        if st["moving"] is None or st["moving"] < MOVED:
            return findings  # nothing (or nothing much) changed anywhere: not one frozen part
        grads = obs.grad_norm
        frozen_now: list[str] = []
        rounding = is_finite(obs.lr) and obs.lr > 0
        for i, name in enumerate(obs.names):
            if rounding and i < len(obs.dtypes) and obs.dtypes[i] in HALF:
                continue  # a 16-bit weight that does not move: its updates round away
            # a gradient < 1e-6 of the weight (vanishing) can round to a zero update in float32
            starved = grads is not None and not grads[i] > MOVED * base[i]
            if not np.isfinite(upd[i]):
                continue  # not measured this step (a large model's snapshots take turns)
            if moved[i] or starved:
                st["streaks"].pop(name, None)
                continue
            st["streaks"][name] = st["streaks"].get(name, 0) + 1
            if st["streaks"][name] >= self.patience and name not in st["reported"]:
                frozen_now.append(name)
        if frozen_now:
            st["reported"].extend(frozen_now)
            lr = f" (learning rate of the first group: {obs.lr:.3g})" if is_finite(obs.lr) else ""
            findings.append(
                self.finding(
                    obs,
                    "warning",
                    f"Parameter {frozen_now[0]}"
                    + (
                        f" and {len(frozen_now) - 1} other parameter(s)"
                        if len(frozen_now) > 1
                        else ""
                    )
                    + f" did not change on {self.patience} sampled steps up to step {obs.step} "
                    f"despite non-zero gradients, while other parameters changed{lr}: its "
                    "param group likely has a learning rate of 0; check the optimizer's "
                    "param_groups and the scheduler.",
                    value=float(len(frozen_now)),
                    where=frozen_now[0],
                )
            )
        return findings

    def _nothing_trains(self, obs: Observation) -> Finding | None:
        """The optimizers stepped no parameter that had a gradient while parameters in
        no optimizer got one: an error, once, naming what the optimizers hold."""
        st = self.state
        if obs.names or not obs.idle_held or not obs.unoptimized or "nothing" in st["said"]:
            return None
        st["said"].append("nothing")
        got = list(obs.unoptimized)
        st["reported"].extend(n for n in got if n not in st["reported"])
        return self.finding(
            obs,
            "error",
            f"Nothing trains: the optimizer stepped no parameter that gets a gradient at "
            f"step {obs.step}; it holds only {listed(obs.idle_held)}, while the "
            f"{len(got)} parameter(s) that get gradients ({listed(got)}) are in no "
            f"optimizer; {optimizer_advice(self.setup)}.",
            value=float(len(got)),
            where=got[0],
        )

    def _unmoved(self, obs: Observation) -> Finding | None:
        """Nothing moved on ``patience`` sampled steps in a row, and a small learning rate
        is not why (see :func:`_unmoved_cause`): a warning, once."""
        st = self.state
        cause = unmoved_cause(obs, self.setup.adaptive)
        still = np.isfinite(obs.update_norm) & (obs.update_norm == 0)
        if cause is None or not still.any() or not np.all(still | ~np.isfinite(obs.update_norm)):
            st["unmoved"] = 0
            return None
        if cause == "no gradient" and flushed(obs, self.setup):  # gradient_underflow's
            st["unmoved"] = 0
            return None
        if is_finite(obs.loss) and obs.loss == 0:  # a loss of 0 has nothing left to learn
            st["unmoved"] = 0
            return None
        st["unmoved"] += 1
        if st["unmoved"] < self.patience or "unmoved" in st["said"]:
            return None
        st["said"].append("unmoved")
        where = obs.names[int(np.flatnonzero(still)[0])]
        head = (
            f"The optimizer moved none of the {int(still.sum())} parameters it steps on "
            f"{self.patience} sampled steps up to step {obs.step}, at a learning rate of "
            f"{obs.lr:.3g}"
        )
        if cause == "no gradient":
            others = (
                f", while {len(obs.unoptimized)} parameter(s) that get gradients "
                f"({listed(list(obs.unoptimized))}) are in no optimizer"
                if obs.unoptimized
                else ""
            )
            why = (
                ": their gradients are exactly zero, so no learning rate would move them; "
                "the loss does not reach the parameters the optimizer holds (it was built "
                "before the layers were replaced, or over a module forward does not use), "
                f"or every path from them to the loss is cut (dead units, a detach){others}; "
                f"{optimizer_advice(self.setup)}."
            )
        else:
            total = float(np.sqrt(np.nansum(np.square(obs.grad_norm))))
            why = (
                f", although their gradients are not zero (norm {total:.3g}) and float32 "
                "rounds no such step away: the update does not reach these tensors, and a "
                "larger learning rate would not help; check that the optimizer stepped is "
                "the one built over the model's parameters now (not one made before the "
                "model or its layers were replaced), and that nothing restores or "
                "overwrites the weights after each step."
            )
        return self.finding(
            obs,
            "warning",
            head + why,
            value=float(still.sum()),
            where=where,
        )
