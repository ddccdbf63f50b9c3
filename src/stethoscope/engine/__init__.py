"""The engine: the monitor's state and logic behind one façade,
:class:`~stethoscope.engine.monitor.Monitor`.

An adapter asks it what to measure at a step (``plan``), hands it what was measured
(``observe``, ``observe_loss``, ``observe_validation``), closes each epoch
(``end_epoch``) and acts on the decisions it returns. Behind the façade, and reached by
nothing outside this package:

- the schedule: :mod:`~.sampler` (how often each detector runs), :mod:`~.planner`
  (which statistics a step measures), :mod:`~.budget` (what the sampled steps may cost);
- :mod:`~.judge`, the one path by which detectors judge steps, and :mod:`~.waiting`, the
  quiet steps that wait to be judged together;
- :mod:`~.ledger` (counting, repeats, the sinks, the epoch's summary) and
  :mod:`~.policy` (stop, raise or carry on);
- :mod:`~.held` (what a rank keeps for the next meeting of a distributed run) and
  :mod:`~.validation_window` (the training losses a validation loss is judged against).
"""

from stethoscope.engine.monitor import Monitor
from stethoscope.engine.policy import Decision, StopOn
from stethoscope.engine.settings import Settings

__all__ = ["Decision", "Monitor", "Settings", "StopOn"]
