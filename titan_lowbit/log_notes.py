"""torchtitan's log lines that titan_lowbit knows to be wrong for a job, dropped.

torchtitan logs through the root logger. A few of its warnings are wrong where titan_lowbit
changed the situation they describe (the CPU path, the offline corpus' own tokenizer) and
send users looking for a fault that is not there. Each is dropped by the fragment of its
text, from the point where titan_lowbit knows it is wrong, and only then; every other line
is kept.
"""

from __future__ import annotations

import logging


class DroppedNotes(logging.Filter):
    """Drops the records whose message contains one of ``fragments``."""

    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = tuple(fragments)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def drop_notes(*fragments: str) -> None:
    """Drop torchtitan's log records containing any of ``fragments`` from now on (once per
    process however often it is called)."""
    root = logging.getLogger()
    if not any(isinstance(f, DroppedNotes) and f.fragments == fragments for f in root.filters):
        root.addFilter(DroppedNotes(fragments))


def keep_notes(*fragments: str) -> None:
    """Undo :func:`drop_notes` for ``fragments`` (a process that parses another job)."""
    root = logging.getLogger()
    for f in [f for f in root.filters if isinstance(f, DroppedNotes) and f.fragments == fragments]:
        root.removeFilter(f)
