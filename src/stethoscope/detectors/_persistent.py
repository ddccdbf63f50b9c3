"""The shape of a detector that names a mistake seen on sampled steps once it has
held on several of them in a row, and then has done."""

from __future__ import annotations

from stethoscope.detectors.base import Detector, check_positive

__all__ = ["Persistent"]


class Persistent(Detector):
    """A mistake seen on sampled steps: it is named once it has held on ``patience`` of
    them in a row, and then the detector has done."""

    def __init__(self, *, patience: int = 2) -> None:
        check_positive(self.name, "patience", patience, integer=True)
        self.patience = patience
        super().__init__()

    def _initial_state(self) -> dict:
        return {"streak": 0, "fired": False, "since": 0}

    def finished(self, step: int) -> bool:
        return self.state["fired"]

    def _held(self, seen: bool, *, step: int = 0, span: int = 0) -> bool:
        """Count a step that ``seen`` the mistake or not; True the step it has held on
        ``patience`` in a row (once), and on every sampled step from ``span`` steps
        before ``step`` at least."""
        st = self.state
        if seen and st["streak"] == 0:
            st["since"] = step
        st["streak"] = st["streak"] + 1 if seen else 0
        if not seen or st["fired"] or st["streak"] < self.patience:
            return False
        if step - st.get("since", step) < span:
            return False
        st["fired"] = True
        return True
