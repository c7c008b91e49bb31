"""The simulator's safety checks after every step: gangs whole and on one pool, no two live
attempts, no claim on a gone node, no node over-committed, incremental usage exact."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from broker.core.invariants import violations
from broker.core.machine import Machine
from broker.core.records import JobRecord
from load.sim.agent import SimAgent


class Checks:
    """The `Sim`'s safety checks: each step's touched records and nodes, and full sweeps."""

    machine: Machine
    clusters: dict[str, SimAgent]
    node_home: dict[str, tuple[str, str]]
    now: float
    checks: int
    _touched: set[str]
    _open: set[str]
    _claims: dict[str, dict[str, int]]
    _usage: dict[str, int]

    if TYPE_CHECKING:  # the loop's (load/sim/loop.py)

        def violation(self, now: float, kind: str, detail: str) -> None: ...

    # -- invariants --------------------------------------------------------------------
    def _claims_of(self, record: JobRecord) -> dict[str, int]:
        """GPUs per node that the machine's record says this job holds (live + reserved)."""
        claims: dict[str, int] = {}
        per = {p.name: p.gpu for p in record.spec.gang}
        attempts = []
        current = record.current
        if current is not None:
            attempts.append(current)
        if record.preempting is not None and record.preempting.replacement is not None:
            attempts.append(record.preempting.replacement)
        for a in attempts:
            for ps in a.assignment:
                for n in ps.nodes:
                    claims[n] = claims.get(n, 0) + per.get(ps.podset, 0)
        return claims

    def _check_record(self, record: JobRecord, nodes: set[str]) -> None:
        live = [a for a in record.attempts if a.ended_at is None]
        if len(live) > 1 or (live and live[-1] is not record.attempts[-1]):
            self.violation(
                self.now,
                "two-live-attempts",
                f"{record.job_id}: live attempts {[a.attempt for a in live]}",
            )
        attempts = list(live)
        if record.preempting is not None and record.preempting.replacement is not None:
            attempts.append(record.preempting.replacement)
        for a in attempts:
            got = {ps.podset: len(ps.nodes) for ps in a.assignment}
            # Whole, or between an elastic podset's minimum and maximum.
            if not all(p.admits(got.get(p.name, 0)) for p in record.spec.gang):
                self.violation(self.now, "partial-gang", f"{record.job_id}#{a.attempt}")
            for ps in a.assignment:
                for n in ps.nodes:
                    home = self.node_home.get(n)
                    if home != (a.cluster, a.flavor):
                        self.violation(
                            self.now,
                            "gang-split",
                            f"{record.job_id}#{a.attempt} on {a.cluster}/{a.flavor} "
                            f"uses node {n} of {home}",
                        )
        claims = self._claims_of(record)
        old = self._claims.get(record.job_id, {})
        if claims != old:
            for n, g in old.items():
                self._usage[n] = self._usage.get(n, 0) - g
                nodes.add(n)
            for n, g in claims.items():
                self._usage[n] = self._usage.get(n, 0) + g
                nodes.add(n)
            if claims:
                self._claims[record.job_id] = claims
            else:
                self._claims.pop(record.job_id, None)

    def _check_nodes(self, nodes: Iterable[str]) -> None:
        for n in nodes:
            used = self._usage.get(n, 0)
            if used <= 0:
                continue
            home = self.node_home.get(n)
            node = self.clusters[home[0]].model.node_state(n) if home else None
            if node is None:
                if home is not None and n in self.clusters[home[0]].unreported:
                    continue  # the broker cannot know yet: its poll has not come round
                self.violation(self.now, "claim-on-gone-node", f"{n}: {used} GPUs")
            elif used > node.gpu:
                self.violation(self.now, "over-commit", f"{n}: {used} > {node.gpu} GPUs")

    def _check_touched(self) -> None:
        if not self._touched:
            return
        self.checks += 1
        nodes: set[str] = set()
        jobs = self.machine.jobs
        for jid in self._touched:
            record = jobs.get(jid)
            if record is not None:
                self._check_record(record, nodes)
        self._touched.clear()
        self._check_nodes(nodes)

    def check_all(self, *, everything: bool = True) -> None:
        """Every record and every node, not just those touched by the last step. The periodic
        sweep (`everything=False`) reads only open records and those still holding claims: a
        terminal record was checked when it turned terminal, so it costs O(open jobs), not
        O(jobs ever submitted); the final sweep reads them all."""
        self.checks += 1
        for problem in violations(self.machine):
            self.violation(self.now, "core-invariant", problem)
        nodes: set[str] = set()
        jobs = self.machine.jobs
        ids = jobs.keys() if everything else sorted(self._open | self._claims.keys())
        for jid in ids:
            record = jobs.get(jid)
            if record is not None:
                self._check_record(record, nodes)
        usage: dict[str, int] = {}
        for claims in self._claims.values():
            for n, g in claims.items():
                usage[n] = usage.get(n, 0) + g
        if {k: v for k, v in self._usage.items() if v} != usage:
            self.violation(self.now, "accounting", "incremental node usage drifted")
            self._usage = usage
        self._check_nodes(usage)
        for c in self.clusters.values():
            for node in c.model.node_states():
                if node.used_gpu > node.usable_gpu:
                    self.violation(self.now, "cluster-over-commit", f"{node.name}: {node.used_gpu}")
