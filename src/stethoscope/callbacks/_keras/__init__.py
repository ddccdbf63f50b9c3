"""The in-graph half of the Keras adapter, by responsibility.

Keras hands callbacks neither gradients nor batches, so the probe reduces them inside
the traced train step itself and the callback reads the few numbers that come out:

- :mod:`~stethoscope.callbacks._keras.regime`: how the train step runs (one immutable
  description: steps per execution, replicas, eager or graph, what the step can hand
  back), which every choice below reads;
- :mod:`~stethoscope.callbacks._keras.layers`: the model's layers and its distribution;
- :mod:`~stethoscope.callbacks._keras.ops`: the tensor reductions, as pure functions;
- :mod:`~stethoscope.callbacks._keras.reductions`: one reduction per statistic: where
  the step measures it, what it writes, and how the host decodes it, side by side;
- :mod:`~stethoscope.callbacks._keras.variables`: the probe's variables, the host's
  reads and writes, and how replicas' copies combine;
- :mod:`~stethoscope.callbacks._keras.wrappers`: the wrappers on ``compute_loss``,
  ``train_step``, ``optimizer.apply`` and the layers' ``call`` that run the reductions
  in the step;
- :mod:`~stethoscope.callbacks._keras.store`: where those reductions go (handed back
  with the logs, or into the variables), and what one trace carries between wrappers;
- :mod:`~stethoscope.callbacks._keras.own_loss`: the loss a train step of the user's
  own returns in its logs, when it never calls ``compute_loss``;
- :mod:`~stethoscope.callbacks._keras.probe`: the train functions ``fit`` calls, the
  host's request for each execution, and reading a step back into an observation.
"""
