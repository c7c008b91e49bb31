"""The operator's node commands (`muster cordon|uncordon|drain|notice`), kept apart from the
job commands in broker.cli."""

from __future__ import annotations

from typing import Annotated

import typer

from shell.cli import CONNECTION, CommonOptions, common, fail

app = typer.Typer(rich_markup_mode=None, pretty_exceptions_show_locals=False)

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


def _run(
    ctx: typer.Context,
    op: str,
    cluster: str,
    node: str | None,
    all_nodes: bool,
    reason: str,
    timeout: float,
    as_json: bool,
) -> None:
    import asyncio

    from broker.cli import print_json
    from broker.client import MusterClient, MusterError
    from broker.nodeops import describe, node_op

    if node is None and not all_nodes:
        raise typer.BadParameter(
            f"name a NODE, or pass --all to {op} every node of cluster {cluster}",
            param_hint="NODE",
        )
    if node is not None and all_nodes:
        raise typer.BadParameter("give a NODE or --all, not both", param_hint="--all")
    opts = CommonOptions.of(ctx).nats_options()

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
        fail(str(exc))


def _node_command(op: str, doc: str) -> None:
    """`muster cordon|uncordon|drain`: one node, or every node with --all."""

    def command(
        cluster: Cluster,
        node: Node = None,
        all_nodes: AllNodes = False,
        reason: Reason = "",
        timeout: Timeout = 10.0,
        as_json: JsonOut = False,
        *,
        ctx: typer.Context,
    ) -> None:
        _run(ctx, op, cluster, node, all_nodes, reason, timeout, as_json)

    app.command(name=op, help=doc, cls=common(*CONNECTION))(command)


_node_command(
    "cordon",
    "Mark a node unschedulable through its cluster's agent: the broker places no new gang "
    "there; what runs there keeps running. Operators only.",
)
_node_command("uncordon", "Undo a cordon through the cluster's agent. Operators only.")
_node_command(
    "drain",
    "Cordon a node, then end the attempts running there as an infrastructure loss (as a "
    "spot reclaim, not a cancel): the broker moves each from its latest checkpoint. On "
    "kube, pods are evicted through the Eviction API (PodDisruptionBudgets apply). "
    "Operators only.",
)


@app.command(cls=common(*CONNECTION))
def notice(
    cluster: Cluster,
    node: Annotated[str, typer.Argument(help="a spot node of a fake or local cluster")],
    timeout: Timeout = 10.0,
    as_json: JsonOut = False,
    *,
    ctx: typer.Context,
) -> None:
    """Announce that a spot node is reclaimed soon (its flavor's notice lead), as the
    provider would: the broker checkpoints and moves what runs there. Simulated clusters
    only (fake, local); a kube cluster refuses it. Operators only."""
    _run(ctx, "notice", cluster, node, False, "", timeout, as_json)
