"""Make-before-break: a job's replacement attempt placed while its current attempt still runs.

A job holds quota once. The reservation records which two attempts share that one charge and
who holds it: the replacement from its commit on (it took the charge over from the attempt it
replaces), and the replaced attempt again if the replacement ends first. Once either ends, the
reservation is gone and the survivor holds the charge alone.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Reservation:
    job_id: str
    replaced: int  # the attempt still running (uncharged while the reservation lives)
    replacement: int  # the attempt placed to take over (holds the job's quota charge)
