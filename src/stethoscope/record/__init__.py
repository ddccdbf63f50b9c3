"""The run's record: statistics and findings kept in a file that outlives the run.

:class:`RunRecorder` writes it (the callbacks' ``record=``), :class:`RunRecord` reads
it, ``stethoscope report`` draws it, ``stethoscope watch`` follows it live.
"""

from stethoscope.record.reader import RunRecord
from stethoscope.record.store import RecordError
from stethoscope.record.writer import RunRecorder

__all__ = ["RecordError", "RunRecord", "RunRecorder"]
