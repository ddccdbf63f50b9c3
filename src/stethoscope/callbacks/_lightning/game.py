"""Whether a run with several optimizers is a game: its optimizers step in turn, each
over its own players' parameters (a GAN's generator and discriminator), rather than one
after another for long stretches (layer-wise training, forward-forward).

Lightning's manual optimization lets a training step step any of its optimizers, so
having several says nothing yet: a GAN steps both in every batch (or its critic a few
times for each step of its generator), while layer-wise training steps the first layer's
for thousands of steps, then the next layer's, and never comes back. Which it is shows
as the run goes: each optimizer's step is heard through torch's public
``Optimizer.register_step_post_hook``, one Python call per step, until it is decided.

In a game each player descends a loss of its own, so each player's step follows a
backward pass of its own. An encoder and a head stepped by two optimizers after one
backward pass descend one loss: they step in turn too, but they are not a game. The
backward passes are heard through ``manual_backward`` (Lightning's
``on_before_backward``); a run that calls ``loss.backward()`` itself is heard through none,
and is judged by the order of its steps alone.

Layer-wise training is no game, but it has stages: a batch whose optimizers all differ
from the batch before's, one of them never heard before, begins one (forward-forward's
next layer takes over). Its loss is another objective's from then on (``new_stage``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

__all__ = ["GameWatch"]


class GameWatch:
    """Hears each optimizer step of a run with several optimizers, until they turn out to
    play a game: an optimizer steps again within ``span`` batches of its last step, another
    optimizer over parameters disjoint from its own having stepped in between, after a
    backward pass of its own (when backward passes are heard at all).

    Args:
        optimizers: The Trainer's optimizers (two or more).
        span: The most batches between two steps of one player in a game.
    """

    def __init__(self, optimizers: Sequence[Any], *, span: int = 16) -> None:
        self.optimizers = list(optimizers)
        self.span = span
        #: Whether the optimizers play a game (found once: then nothing is heard any more).
        self.found = False
        #: Whether the batch just done began a new stage (see the module's docstring).
        self.new_stage = False
        self._now: set[int] = set()  # the optimizers that stepped in this batch
        self._before: set[int] = set()  # those of the last batch that stepped any
        self._ever: set[int] = set()
        self._batch = 0
        self._order = 0  # counts the steps heard, to order them
        self._backwards = 0  # counts the backward passes heard
        #: Per optimizer (by its place): the batch, the order of its last step and the
        #: backward passes heard by then.
        self._last: dict[int, tuple[int, int, int]] = {}
        self._handles = [
            opt.register_step_post_hook(functools.partial(self._stepped, k))
            for k, opt in enumerate(self.optimizers)
            if hasattr(opt, "register_step_post_hook")
        ]

    def batch_done(self) -> bool:
        """A batch ended: whether the game was found in it (True once); whether it began a
        new stage is :attr:`new_stage`."""
        self._batch += 1
        now, self._now = self._now, set()
        self.new_stage = bool(self._ever and now - self._ever and not now & self._before)
        self._ever |= now
        self._before = now or self._before
        if self.found and self._handles:
            self.close()
            return True
        return False

    def backward(self) -> None:
        """A backward pass began (``on_before_backward``)."""
        self._backwards += 1

    def close(self) -> None:
        """Take the hooks off the user's optimizers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _stepped(self, k: int, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer ``k`` stepped (torch's post-step hook)."""
        self._order += 1
        self._now.add(k)
        last = self._last.get(k)
        self._last[k] = (self._batch, self._order, self._backwards)
        if self.found or last is None or self._batch - last[0] > self.span:
            return
        for j, (_, order, backwards) in self._last.items():
            # a backward pass before the other's step and another before this one: each
            # stepped on a loss of its own
            own_loss = self._backwards == 0 or last[2] < backwards < self._backwards
            if j != k and order > last[1] and own_loss and _disjoint(optimizer, self.optimizers[j]):
                self.found = True
                return


def _disjoint(a: Any, b: Any) -> bool:
    """Whether two optimizers hold no parameter in common."""
    held = {id(p) for group in a.param_groups for p in group["params"]}
    return not any(id(p) in held for group in b.param_groups for p in group["params"])
