"""Distributed runs, framework-free: where the ranks meet, what they exchange, how they agree.

The ranks of a distributed run meet on the steps they all agree on: the sampled steps
of the sampler's schedule (a pure function of the step and of the sampler's state,
which itself only changes at a meeting, so it is the same on every rank), plus every
:data:`SYNC_EVERY` steps, at each validation and at each epoch end. At a meeting each
rank contributes one fixed-size byte packet to ONE all-gather: its held decisions as
the flags of :data:`FLAGS`, the statistics the meeting carries (laid out from their
declarations in :mod:`stethoscope.statistics`), then a letter (JSON) with the findings
it raised since the last meeting and the reasons behind its decisions. Every rank
unpacks the same bytes, so every rank reaches the same verdict from them; rank zero
writes the findings.

:class:`RankMeeting` runs the meetings; the adapter only hands it the framework's
all-gather (``strategy.all_gather`` in Lightning); everything here is numpy and the
standard library.

The package: :mod:`~stethoscope.distributed.meeting` (when the ranks meet and how they
agree), :mod:`~.packet` (the bytes of one meeting: the layout every rank builds alike)
and :mod:`~.letter` (the findings and reasons each rank writes into its packet).
"""

from stethoscope.distributed.letter import Letter
from stethoscope.distributed.meeting import FLAGS, SYNC_EVERY, RankMeeting
from stethoscope.distributed.packet import MAIL_BYTES, Entry, Gathered, Packet

__all__ = [
    "FLAGS",
    "MAIL_BYTES",
    "SYNC_EVERY",
    "Entry",
    "Gathered",
    "Letter",
    "Packet",
    "RankMeeting",
]
