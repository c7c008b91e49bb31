"""nats-server authorization generated from the broker config (`muster nats-config`).

One NATS account, one user per role: each team, each cluster's agent, the broker, an admin and
the workloads. Users with subject permissions (not accounts with exports/imports) because every
role speaks on one subject tree that the broker serves; accounts would need an export and an
import per subject and team, and JWT accounts an operator and a resolver to run. Passwords are
nats-server variables (`$MUSTER_<USER>_PASSWORD`), so the file holds no secret. Every user has
a private inbox prefix `_INBOX_<user>` that only it may subscribe to: replies, JetStream
deliveries and log chunks cannot be read by anyone else. The one `workload` user that every
training pod shares may subscribe to nothing at all: whatever one pod could hear, all could.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

from broker.config import LoadedConfig, load_config_full, parse_config
from schemas.config import BrokerConfig
from schemas.subjects import Subjects

BROKER = "broker"
ADMIN = "admin"
WORKLOAD = "workload"


def inbox_prefix(user: str) -> str:
    """The inbox prefix `user` must connect with (nats.connect(inbox_prefix=...))."""
    return f"_INBOX_{user}"


def password_var(user: str) -> str:
    return "MUSTER_" + user.upper().replace("-", "_") + "_PASSWORD"


def team_user(team: str) -> str:
    return f"team-{team}"


def agent_user(cluster: str) -> str:
    return f"agent-{cluster}"


def queues_by_team(
    config: BrokerConfig, aliases: dict[str, str] | None = None
) -> dict[str, list[str]]:
    """Team -> the submit names (queues and their aliases) it owns; a queue without `team` is
    reachable by admins only."""
    owner = {q.name: q.team for q in config.queues if q.team}
    names: dict[str, list[str]] = {}
    for queue, team in owner.items():
        names.setdefault(team, []).append(queue)
    for alias, target in sorted({**config.queue_aliases, **(aliases or {})}.items()):
        if target in owner:
            names[owner[target]].append(alias)
    return {team: sorted(set(qs)) for team, qs in sorted(names.items())}


def _user(
    name: str,
    pub: Iterable[str],
    sub: Iterable[str],
    *,
    responses: bool = False,
    comment: str = "",
) -> str:
    subs = list(sub)
    lines = [f"      # {comment}"] if comment else []
    lines += [
        "      {",
        f"        user: {json.dumps(name)}",
        f"        password: ${password_var(name)}",
        "        permissions: {",
        f"          publish: {{ allow: {json.dumps(list(pub))} }}",
        # An empty allow-list means "everything" to nats-server: say "nothing" as a deny.
        f"          subscribe: {{ allow: {json.dumps(subs)} }}"
        if subs
        else '          subscribe: { deny: [">"] }',
    ]
    if responses:
        lines.append('          allow_responses: { max: 10000, expires: "1h" }')
    lines += ["        }", "      }"]
    return "\n".join(lines)


def leaf_user(cluster: str) -> str:
    """The user a GPU cluster's leaf node is mapped to on the control cluster: the DNS name
    of its client certificate (mTLS, `verify_and_map`), so the link needs no password."""
    return f"muster-leaf-{cluster}"


def render(
    config: BrokerConfig,
    clusters: Iterable[str],
    aliases: dict[str, str] | None = None,
    leaves: Iterable[str] = (),
    frontdoor: Mapping[str, Iterable[str]] | None = None,
) -> str:
    """The `accounts { MUSTER { ... } }` block nats.conf includes. `leaves`: GPU clusters
    that reach the control cluster through a leaf node (`render_leafnode`); each gets a user
    for its leaf connection, which carries its agent's and its training pods' traffic.
    `frontdoor` maps a cluster to the teams its agent's front door submits for
    (agents/kube/frontdoor.py): that agent may also submit to those teams' queues, call their
    API verbs and hear their job events."""
    s = Subjects(prefix=config.subject_prefix)
    p = s.prefix
    teams = queues_by_team(config, aliases)
    doors = {c: sorted(set(ts)) for c, ts in (frontdoor or {}).items()}
    for cluster, door_teams in doors.items():
        unknown = [t for t in door_teams if t not in teams]
        if unknown:
            raise ValueError(
                f"frontdoor: cluster {cluster!r} acts for {unknown}, which own no queue in the "
                f"broker config; give a queue `team: {unknown[0]}` or drop the team"
            )
    askers = (ADMIN, *map(team_user, teams), *map(agent_user, sorted(doors)))
    answers = [inbox_prefix(u) + ".>" for u in askers]
    users = [
        _user(
            BROKER,
            [
                f"{p}.>",
                "$JS.API.>",  # streams, consumers, pulls, KV reads
                "$JS.ACK.>",  # acknowledging submissions
                "$JS.FC.>",  # flow control of the standby's mirror (an ordered push consumer)
                f"$KV.{s.jobs_bucket}.>",
                f"$KV.{s.leader_bucket}.>",
                f"$O.{s.jobs_snapshot_bucket}.>",  # the job bucket's snapshot (its writer)
                s.lease_alive,  # a standby's probes of the leader (broker/liveness.py)
                inbox_prefix(BROKER) + ".>",  # the leader's answers to those probes
                *answers,  # replies to the admin's and each team's requests
            ],
            [f"{p}.>", s.lease_alive, inbox_prefix(BROKER) + ".>"],
            comment="the broker: Muster's subjects, its JetStream and KV, and the inboxes it "
            "answers; its own inbox for JetStream deliveries",
        ),
        _user(
            ADMIN,
            [f"{p}.>"],
            [f"{p}.>", inbox_prefix(ADMIN) + ".>"],
            comment="operators: submit, cancel and read everything",
        ),
    ]
    for cluster in sorted(set(clusters) | set(doors)):
        acts_for = doors.get(cluster, [])
        comment = f"cluster {cluster}'s agent: its own events and commands only"
        if acts_for:
            comment += f"; its front door submits for team {', '.join(acts_for)}"
        users.append(
            _user(
                agent_user(cluster),
                [
                    s.agent_events(cluster),
                    *(s.submit(q) for t in acts_for for q in teams[t]),
                    *(f"{p}.api.{t}.*" for t in acts_for),
                ],
                [
                    s.agent_cmd(cluster),
                    s.agent_logs(cluster),
                    s.agent_nodeops(cluster),  # operators' cordon, drain, notice
                    *(f"{p}.events.team.{t}.*" for t in acts_for),
                    inbox_prefix(agent_user(cluster)) + ".>",
                ],
                responses=True,  # answers commands; a log read streams several chunks back
                comment=comment,
            )
        )
    for cluster in sorted(set(leaves)):
        # What crosses a leaf connection is what its user may publish (leaf to control) and
        # subscribe to (control to leaf). Replies go to named inboxes: a leaf connection has
        # no per-request response permission.
        users.append(
            _leaf_user(
                leaf_user(cluster),
                [
                    s.agent_events(cluster),
                    s.checkpoint_all,  # the cluster's training pods
                    inbox_prefix(BROKER) + ".>",  # command acks
                    *answers,  # log chunks streamed to the admin's and the teams' inboxes
                ],
                [
                    s.agent_cmd(cluster),
                    s.agent_logs(cluster),
                    s.agent_nodeops(cluster),  # operators' cordon, drain, notice
                    inbox_prefix(agent_user(cluster)) + ".>",
                ],
                comment=f"cluster {cluster}'s leaf node (certificate {leaf_user(cluster)}): its "
                "agent's events, commands, log reads and node operations, its pods' checkpoints",
            )
        )
    for team, queues in teams.items():
        user = team_user(team)
        users.append(
            _user(
                user,
                [*(s.submit(q) for q in queues), f"{p}.api.{team}.*"],
                [f"{p}.events.team.{team}.*", inbox_prefix(user) + ".>"],
                comment=f"team {team}: submits to {', '.join(queues)}; sees only its own jobs",
            )
        )
    users.append(
        _user(
            WORKLOAD,
            [s.checkpoint_all],
            [],  # one user for every pod: whatever one could hear, all could
            comment="training pods' checkpoint reports (fenced by attempt token); hears nothing",
        )
    )
    head = (
        "# Generated by `muster nats-config` from the broker config; regenerate, do not edit.\n"
        "# Passwords come from the environment ($MUSTER_<USER>_PASSWORD, the muster-nats-auth\n"
        "# Secret). Each user connects with inbox prefix _INBOX_<user> (see docs/security.md).\n"
    )
    return (
        head
        + "accounts {\n  MUSTER {\n    jetstream: enabled\n    users: [\n"
        + ("\n".join(users) + "\n    ]\n  }\n}\n")
    )


def _leaf_user(name: str, pub: Iterable[str], sub: Iterable[str], *, comment: str) -> str:
    """A user without a password: nats-server maps a leaf connection to it by the subject of
    its verified client certificate."""
    return "\n".join(
        [
            f"      # {comment}",
            "      {",
            f"        user: {json.dumps(name)}",
            "        permissions: {",
            f"          publish: {{ allow: {json.dumps(list(pub))} }}",
            f"          subscribe: {{ allow: {json.dumps(list(sub))} }}",
            "        }",
            "      }",
        ]
    )


def render_leafnode(
    cluster: str,
    hub_urls: Iterable[str],
    *,
    tls_dir: str = "/etc/nats/tls",
    listen: str = "0.0.0.0:4222",
    http: str = "0.0.0.0:8222",
) -> str:
    """nats.conf of the leaf node that runs in GPU cluster `cluster`: the agent and the
    training pods connect to it locally (plain NATS inside the cluster), and it keeps one
    mTLS connection out to the control cluster's leafnode port. Without JetStream: Muster's
    streams live in the control cluster only."""
    urls = [u.strip() for u in hub_urls if u.strip()]
    if not urls:
        raise ValueError("give the control cluster's leafnode URLs (tls://HOST:7422)")
    for url in urls:
        if not url.startswith("tls://"):
            raise ValueError(
                f"leafnode URL {url!r} must use tls://: the link leaves the cluster, so it is "
                "encrypted and the control cluster verifies this cluster's certificate"
            )
    return (
        f"# Leaf node of GPU cluster {cluster}. Generated by `muster nats-config "
        f"--leafnode-for {cluster}\n"
        "# --hub URL`; regenerate, do not edit. The agent and the training pods connect\n"
        "# here; one mTLS connection goes out to the control cluster, authenticated by this\n"
        "# cluster's\n"
        f"# certificate (DNS name {leaf_user(cluster)}; its permissions are in the control\n"
        "# cluster's accounts.conf).\n"
        "server_name: $POD_NAME\n"
        f"listen: {listen}\n"
        f"http: {http}\n"
        "max_payload: 8MB\n"
        "leafnodes {\n"
        '  reconnect: "2s"\n'
        "  remotes: [\n"
        "    {\n"
        f"      urls: {json.dumps(urls)}\n"
        "      tls {\n"
        f"        cert_file: {json.dumps(tls_dir + '/tls.crt')}\n"
        f"        key_file: {json.dumps(tls_dir + '/tls.key')}\n"
        f"        ca_file: {json.dumps(tls_dir + '/ca.crt')}\n"
        "        timeout: 5\n"
        "      }\n"
        "    }\n"
        "  ]\n"
        "}\n"
    )


def render_leafnode_listener(tls_dir: str = "/etc/nats/tls", port: int = 7422) -> str:
    """The control cluster's side: the leafnode port, mTLS, each certificate mapped to its
    cluster's leaf user (`leaf_user`)."""
    return (
        "leafnodes {\n"
        f"  listen: 0.0.0.0:{port}\n"
        # The servers' own addresses mean nothing in another cluster: leaves dial the
        # Service's address only, and reconnect through it.
        "  no_advertise: true\n"
        "  tls {\n"
        f"    cert_file: {json.dumps(tls_dir + '/tls.crt')}\n"
        f"    key_file: {json.dumps(tls_dir + '/tls.key')}\n"
        f"    ca_file: {json.dumps(tls_dir + '/ca.crt')}\n"
        "    verify_and_map: true\n"
        "    timeout: 5\n"
        "  }\n"
        "}\n"
    )


def load_broker_config(path: Path | None) -> LoadedConfig:
    """A broker config file, or the Kubernetes ConfigMap that ships one as `broker.yaml`."""
    if path is not None:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        if isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
            text = (doc.get("data") or {}).get("broker.yaml", "")
            return parse_config(text, source=f"{path}: data.broker.yaml", base_dir=path.parent)
    return load_config_full(path)
