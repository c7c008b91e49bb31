"""The operator's node commands (`muster cordon|uncordon|drain|notice`), kept apart from the
job commands in broker.cli.

No `from __future__ import annotations` here: the commands are defined inside
`register_nodeops` and typer must see their annotations as objects, not names to look up.
"""

from collections.abc import Callable
from typing import Annotated

import typer

from shell import cli as base

Cluster = Annotated[str, typer.Argument(help="cluster name (as `muster clusters` lists it)")]
Node = Annotated[
    str | None, typer.Argument(help="node name; omit it and pass --all for every node")
]
AllNodes = Annotated[
    bool, typer.Option("--all", help="act on every node of the cluster (NODE omitted)")
]
Reason = Annotated[str, typer.Option("--reason", help="why; shown with the node and recorded")]
Timeout = Annotated[float, typer.Option("--timeout", help="seconds to wait for the agent")]
JsonOut = Annotated[bool, typer.Option("--json", help="print the agent's reply as JSON")]


def register_nodeops(app: typer.Typer, print_json: Callable[[object], None]) -> None:
    """Add the node commands to the broker's part of the `muster` CLI."""

    def run(
        op: str,
        cluster: str,
        node: str | None,
        all_nodes: bool,
        reason: str,
        timeout: float,
        as_json: bool,
        opts: object,
    ) -> None:
        import asyncio

        from broker.client import MusterClient, MusterError
        from broker.nodeops import describe, node_op
        from schemas.natsopts import NatsOptions

        if node is None and not all_nodes:
            raise typer.BadParameter(
                f"name a NODE, or pass --all to {op} every node of cluster {cluster}",
                param_hint="NODE",
            )
        if node is not None and all_nodes:
            raise typer.BadParameter("give a NODE or --all, not both", param_hint="--all")
        assert isinstance(opts, NatsOptions)

        async def main() -> None:
            async with MusterClient(opts) as client:
                reply = await node_op(
                    client,
                    cluster,
                    op,  # type: ignore[arg-type]
                    node,
                    all_nodes=all_nodes,
                    reason=reason,
                    timeout=timeout,
                )
            if as_json:
                print_json(reply)
            else:
                typer.echo(describe(cluster, reply))

        try:
            asyncio.run(main())
        except MusterError as exc:
            base.fail(str(exc))

    def node_command(op: str, short_help: str, doc: str) -> None:
        @app.command(name=op, short_help=short_help, help=doc)
        @base.with_nats_auth
        def command(
            cluster: Cluster,
            node: Node = None,
            all_nodes: AllNodes = False,
            reason: Reason = "",
            nats: base.NatsUrl = None,
            timeout: Timeout = 10.0,
            as_json: JsonOut = False,
            *,
            auth: base.NatsAuth,
        ) -> None:
            opts = base.nats_options(nats, auth)
            run(op, cluster, node, all_nodes, reason, timeout, as_json, opts)

    node_command(
        "cordon",
        "Stop placing new gangs on a node (or every node).",
        "Mark a node unschedulable through its cluster's agent: the broker places no new gang "
        "there; what runs there keeps running. Operators only.",
    )
    node_command(
        "uncordon",
        "Let a cordoned node take new gangs again.",
        "Undo a cordon through the cluster's agent. Operators only.",
    )
    node_command(
        "drain",
        "Cordon a node and move what runs there.",
        "Cordon a node, then end the attempts running there as an infrastructure loss (as a "
        "spot reclaim, not a cancel): the broker moves each from its latest checkpoint. On "
        "kube, pods are evicted through the Eviction API (PodDisruptionBudgets apply). "
        "Operators only.",
    )

    @app.command(short_help="Send a spot notice for a node of a fake or local cluster.")
    @base.with_nats_auth
    def notice(
        cluster: Cluster,
        node: Annotated[str, typer.Argument(help="a spot node of a fake or local cluster")],
        nats: base.NatsUrl = None,
        timeout: Timeout = 10.0,
        as_json: JsonOut = False,
        *,
        auth: base.NatsAuth,
    ) -> None:
        """Announce that a spot node is reclaimed soon (its flavor's notice lead), as the
        provider would: the broker checkpoints and moves what runs there. Simulated clusters
        only (fake, local); a kube cluster refuses it. Operators only."""
        run("notice", cluster, node, False, "", timeout, as_json, base.nats_options(nats, auth))
