"""How long the broker waits for an agent's ack, learnt per cluster from the acks it has seen.

A fixed wait (`dispatch_ack_s`, 2 s) turned a slow moment into a retry storm: when a loaded
agent or a busy broker loop took longer than that to answer, every request of a batch timed
out, its ack was thrown away when it did come, the batch was sent again (more work for the
agent that was already behind) and, once the retries ran out, every job went to a second
attempt. Three rules now keep a slow moment slow, not worse:

- **The wait follows the cluster's round trips**: a smoothed round-trip time and its mean
  deviation (the retransmission timer of RFC 6298, section 2: `srtt + 4 * rttvar`, gains 1/8
  and 1/4), never below `dispatch_ack_s` (the floor) nor above `dispatch_ack_max_s`.
- **Each retry doubles the wait** (RFC 6298, section 5.5), up to the same ceiling.
- **A retry does not abandon the request before it**: the ack of any copy counts, and its round
  trip is measured from that copy's own send (every copy has its own reply token, so a sample
  is never ambiguous, which is why RFC 6298 section 3 would otherwise have to drop it). The agent
  acknowledges a repeated Dispatch of the attempt it already holds without doing it twice
  (`agents/runtime.py`, `_dispatch`), so a retry is a question, "did my Dispatch arrive?",
  not a second attempt. The agent runs one job's commands one after the other, so when an
  early copy is refused while a later one is outstanding, the later one's answer decides.
- **A busy agent is waited for, not asked again**: when a Dispatch copy's wait ends, the next
  copy goes out only if the cluster did not move on other Dispatches during that wait (answer
  one, or report a phase of one of ours: an agent reports nothing of an attempt before its
  Dispatch is carried out in full). An agent that does is working through a backlog (a
  kube agent's API budget spent on a burst, a long batch), and another copy would only queue
  behind the first while the next timeout cancelled work that was about to be done. The wait
  then starts again as it was, without a copy and without doubling (RFC 6298, section 5.3,
  restarts the timer on every ACK of new data), for at most `patience` in all: the ceiling
  times the copies allowed. A Dispatch its cluster already reported is asked again as before (it
  was carried out; its answer was lost or is slow, and the agent acknowledges a copy at once),
  and so is one whose cluster answered nothing else: heartbeats and the answers to other
  commands do not count, since a stuck Dispatch path answers those too.

`broker/sequencer.py` hands these waits to the executor and to the deterministic simulation
(`load/vopr.py`), so both wait the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.config import Timeouts

RTT_GAIN = 1 / 8  # RFC 6298 alpha
VAR_GAIN = 1 / 4  # RFC 6298 beta
VAR_FACTOR = 4.0  # RFC 6298 K


@dataclass(slots=True)
class AckWait:
    """One cluster's round-trip estimate and the waits it gives (seconds)."""

    floor: float
    ceiling: float
    srtt: float | None = None
    rttvar: float = 0.0
    samples: int = 0
    heard: int = 0  # Dispatches answered or reported carried out: its Dispatch path's progress

    def observe(self, rtt: float) -> None:
        """Fold in the round trip of one acknowledged request."""
        rtt = max(rtt, 0.0)
        self.samples += 1
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
            return
        self.rttvar += VAR_GAIN * (abs(self.srtt - rtt) - self.rttvar)
        self.srtt += RTT_GAIN * (rtt - self.srtt)

    def wait(self, retry: int = 0) -> float:
        """How long to wait for the ack of copy number `retry` (0 = the first send)."""
        base = self.floor
        if self.srtt is not None:
            base = max(base, self.srtt + VAR_FACTOR * self.rttvar)
        return min(self.ceiling, base * (1 << min(retry, 30)))

    def patience(self, copies: int) -> float:
        """The longest a Dispatch is waited for while its cluster is busy with others."""
        return self.ceiling * max(copies, 1)


class AckWaits:
    """An `AckWait` per cluster, all with the configured floor and ceiling."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.floor = timeouts.dispatch_ack_s
        self.ceiling = max(timeouts.dispatch_ack_max_s, self.floor)
        self._by_cluster: dict[str, AckWait] = {}

    def of(self, cluster: str) -> AckWait:
        wait = self._by_cluster.get(cluster)
        if wait is None:
            wait = self._by_cluster[cluster] = AckWait(self.floor, self.ceiling)
        return wait

    def forget(self, cluster: str) -> None:
        """A cluster gone from the fleet: start from the floor if it comes back."""
        self._by_cluster.pop(cluster, None)
