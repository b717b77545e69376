"""The report's note on a run that stopped before the end of measuring (results/planned.py):
that it did not finish, and what it never measured."""
from __future__ import annotations

from typing import Optional

from speedbench.results import planned

MOST = 12  # never-measured pairs named; the rest counted


def note(run) -> Optional[str]:
    """The note for `run` (a results.runs.Run), None for a run that got to its end."""
    never = planned.unfinished(run.path, run.trials)
    if never is None:
        return None
    n = len(run.trials)
    text = (f"This run did not finish: it stopped after {n} trial{'s' * (n != 1)}, before the "
            "end of its measurements (a signal, the watchdog or a crash ended the process; the "
            "console's last lines say which). What follows is what it had measured. ")
    if not never:
        return text + "Every planned variant had a trial before it stopped; later rounds are missing."
    named = ", ".join(never[:MOST]) + (f" and {len(never) - MOST} more" if len(never) > MOST
                                       else "")
    return text + f"Never measured: {named}."
