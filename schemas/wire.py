"""The version of the agent protocol (the msgpack messages of schemas/agent.py).

MAJOR.MINOR. A minor release only adds: optional fields (an older peer ignores them: no agent
message forbids unknown fields) and nothing a peer of the previous minor would have to
understand. A new message kind, a new required field or a changed meaning is a major release.
So a broker and an agent of the same major, one minor apart in either direction, interoperate;
`tests/nats/test_wire_versions.py` holds the previous release's messages and schema and checks
both directions. An agent sends its version in every EventBatch (`wire`); the 0.1.0 release
sent none, which reads as 1.0. The broker refuses batches of another major and tells their
agent so (the `wire_refused` command: a message kind a minor added, as only an agent of
another major ever receives it). 1.2 added `Dispatch.revision`: an elastic attempt's new nodes,
sent as the same attempt again, which a 1.1 agent acknowledges as a duplicate; and
`FlavorInfo.provision` (optional) with the `provision` command, which the broker sends only for
a flavor whose agent declared `provision`: an agent of 1.1 or older declares none, so it never
receives one. 1.3 added the `dispatch_batch` command (several Dispatches to one cluster in one
request, answered by `DispatchAcks`), which the broker sends only to an agent whose batches say
1.3 or newer (`takes_dispatch_batches`); an older agent gets one Dispatch a request, as before.
1.4 added `CommandAck.ended` (optional): the answer to a Cancel of an attempt that had already
ended carries that ending, which the broker takes before it starts the job again; an older
broker ignores it, and an older agent's Cancels carry none (the job then runs again from its
latest checkpoint when a spot notice moved it just after it succeeded, as before).
"""

from __future__ import annotations

import re

WIRE_VERSION = "1.4"
DISPATCH_BATCHES = (1, 3)  # the first version an agent takes `dispatch_batch` in
UNVERSIONED = "1.0"  # what a message without `wire` comes from (release 0.1.0)
_FORM = re.compile(r"^(\d{1,4})\.(\d{1,4})$")


def parse(version: str) -> tuple[int, int]:
    """(major, minor); "" is the unversioned first release. Raises ValueError otherwise."""
    match = _FORM.match(version or UNVERSIONED)
    if match is None:
        raise ValueError(f"wire version {version!r} is not MAJOR.MINOR")
    return int(match[1]), int(match[2])


def compatible(peer: str, ours: str = WIRE_VERSION) -> bool:
    """True when a peer speaking `peer` and one speaking `ours` understand each other."""
    try:
        return parse(peer)[0] == parse(ours)[0]
    except ValueError:
        return False


def takes_dispatch_batches(version: str) -> bool:
    """Whether an agent whose batches carry `version` may be sent a `dispatch_batch`."""
    try:
        major, minor = parse(version)
    except ValueError:
        return False
    return major == DISPATCH_BATCHES[0] and minor >= DISPATCH_BATCHES[1]
