"""A dead leader found without waiting out its lease.

When a process dies, its operating system closes its sockets and nats-server drops its
subscriptions at once; a request to a subject nobody subscribes to is answered at once with
"no responders" (NATS 2.2+ headers; nats-py raises `NoRespondersError`). A leader that is slow,
starved or stopped (SIGSTOP) still holds its subscription: a request to it times out, it is
never "no responders". So the leader answers probes on a subject of its own while it holds the
lease (`LivenessAnswer`), and a standby probes it (`DeathWatch`) and judges it dead only on
all of:

- "no responders" on consecutive probes spanning at least `CONFIRM_S` (any answer, timeout or
  other error in between starts over);
- no write of the lease key seen on the standby's watch for half a TTL (two renewals missed):
  a leader whose connection blinks (a reconnect, a route between NATS servers re-forming)
  has stopped answering but still renews, and one renewal seen starts over;
- the key's holder has answered a probe before: a leader of an earlier release answers none,
  and one of its late renewals must not read as death (during a rolling upgrade).

The standby then takes the key with a compare-and-set on the revision it saw last
(`LeaderLease._take_from_dead`): it fails if anyone wrote the key since. Why that is safe is
in broker/lease.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError

log = structlog.get_logger("muster.lease")

PROBE_EVERY_S = 0.15  # a standby's probes of the leader, one at a time
PROBE_TIMEOUT_S = 0.25  # an answer later than this counts as alive (a slow leader)
CONFIRM_S = 0.2  # "no responders" must last this long, on two probes at least


class Alive(msgspec.Struct, frozen=True):
    """The leader's answer to a probe."""

    holder: str
    epoch: int


class LivenessAnswer:
    """The leader's side: a subscription that answers probes while the lease is held. It is
    what nats-server drops the moment the process dies."""

    def __init__(self, nc: Client, subject: str, alive: Callable[[], Alive]) -> None:
        self.nc = nc
        self.subject = subject
        self.alive = alive  # the holder and epoch now (a new leader may raise its epoch)
        self._sub: Subscription | None = None

    async def start(self) -> None:
        if self._sub is None:
            self._sub = await self.nc.subscribe(self.subject, cb=self._on_probe)

    async def _on_probe(self, msg: Msg) -> None:
        # Answers go to inboxes only: a reply subject is the asker's choice, and the broker may
        # publish on its KV subjects (only brokers may probe, where NATS permissions are set).
        if msg.reply.split(".", 1)[0].startswith("_INBOX") and "." in msg.reply:
            await self.nc.publish(msg.reply, msgspec.json.encode(self.alive()))

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # NATS away: the server drops it with the connection
                log.warning("lease.liveness_unsubscribe_failed", error=str(exc))


class DeathWatch:
    """The standby's side: fed the lease key's writes its watch sees (`saw`) and probing the
    leader (`probe`), it names the revision to take the key from once the leader is dead."""

    def __init__(self, nc: Client, subject: str, ttl: float) -> None:
        self.nc = nc
        self.subject = subject
        self.quiet_s = ttl / 2  # two renewals missed (RENEWALS_PER_TTL is 4)
        self.revision = 0  # the key's revision last seen written; 0: none, or deleted
        self.holder = ""  # who wrote it
        self._answered_by = ""  # the holder named by the last answer to a probe
        self._seen_at = 0.0  # loop time it was seen
        self._gone_since: float | None = None  # first "no responders" of the current run
        self._probed_at = 0.0
        self.probes = 0  # probes sent (a metric)
        self.no_responders = 0  # probes answered "no responders" (a metric)
        self.timeouts = 0  # probes unanswered in time: a slow or stopped leader (a metric)

    def saw(self, revision: int, holder: str = "") -> None:
        """A write of the key by `holder` (revision > 0) or its delete (0): the leader was
        alive then."""
        self.revision = revision
        self.holder = holder
        self._seen_at = asyncio.get_running_loop().time()
        self._gone_since = None

    def quiet_for(self) -> float:
        """Seconds since the last write of the key seen."""
        return asyncio.get_running_loop().time() - self._seen_at

    def next_probe_in(self) -> float:
        return max(0.0, self._probed_at + PROBE_EVERY_S - asyncio.get_running_loop().time())

    async def probe(self) -> int:
        """Probe the leader once; the revision to take the key from when it is dead, else 0."""
        loop = asyncio.get_running_loop()
        self._probed_at = loop.time()
        if not self.revision:
            return 0  # no live key seen: the watch's delete or the TTL path applies
        self.probes += 1
        try:
            reply = await self.nc.request(self.subject, b"", timeout=PROBE_TIMEOUT_S)
        except NoRespondersError:
            self.no_responders += 1
        except TimeoutError:  # nats' TimeoutError is one too: slow or stopped, alive
            self.timeouts += 1
            self._gone_since = None
            return 0
        except Exception:  # NATS away: we cannot tell
            self._gone_since = None
            return 0
        else:
            self._gone_since = None
            self._answered_by = answered_by(reply.data)
            return 0
        now = loop.time()
        if self._gone_since is None:
            self._gone_since = now
            return 0
        if now - self._gone_since < CONFIRM_S or self.quiet_for() < self.quiet_s:
            return 0
        if not self.holder or self._answered_by != self.holder:
            return 0  # a holder that never answered: the expiry path applies
        log.warning(
            "lease.leader_gone",
            revision=self.revision,
            no_responders_for_s=round(now - self._gone_since, 3),
            quiet_for_s=round(self.quiet_for(), 3),
        )
        return self.revision


def answered_by(data: bytes) -> str:
    """The holder an answer names; "" for one that does not decode."""
    try:
        return msgspec.json.decode(data, type=Alive).holder
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""
