"""Virtual-clock simulator: the pure lifecycle `Machine` driven by real traces.

Production runs the `Machine` behind an asyncio shell over NATS. Here a discrete-event loop
plays the shell instead: it feeds the machine inputs with a virtual `now`, carries out its
effects at once (`Send` goes to a simulated cluster, `Publish` updates the metrics), and the
simulated clusters answer as agents would, with `EventBatch`es (snapshot first, increasing
`seq`), heartbeats, spot notices and workload progress. Each simulated cluster is the fake
backend's `ClusterModel` (agents/fake/model.py) on this loop's virtual clock, with a
`WorkloadTiming` per dispatch for GPU speed, checkpoint cost and restore delay. Nothing sleeps
and nothing does I/O after the traces are read, so a week of Philly jobs replays in seconds.

Jobs come from Philly (`philly.csv`), spot reclaims from Bamboo (`bamboo-p3.csv`,
`bamboo-g4dn.csv`) or a Poisson process. Policies differ only in what the simulated workloads
and job specs do with checkpoints, so the broker under test is the same code every time.

Run `python -m load.sim --help`. The parts: `policies` (what each policy changes), `jobs`
(Philly jobs and their specs), `world` (ground-truth logs, heap event kinds, spot slots, the
result), `agent` (one simulated cluster), `spots` (the fleet and its reclaims), `checks` (the
safety checks), `loop` (the event loop, `Sim`), `results` (runs, bounds, summaries), `cli`.
"""

from load.sim.agent import SimAgent
from load.sim.cli import app, config_from_args, main
from load.sim.jobs import SimJob, broker_config, job_spec, make_jobs
from load.sim.loop import Sim
from load.sim.policies import ABLATIONS, BASELINES, COMPARISON, EXTENSIONS, POLICIES, Policy
from load.sim.results import bound_for, run
from load.sim.world import SPOT_TRACE, AttemptLog, ElasticModel, SimResult, Violation
from load.simconfig import SimConfig

__all__ = [
    "ABLATIONS",
    "BASELINES",
    "COMPARISON",
    "EXTENSIONS",
    "POLICIES",
    "SPOT_TRACE",
    "AttemptLog",
    "ElasticModel",
    "Policy",
    "Sim",
    "SimAgent",
    "SimConfig",
    "SimJob",
    "SimResult",
    "Violation",
    "app",
    "bound_for",
    "broker_config",
    "config_from_args",
    "job_spec",
    "main",
    "make_jobs",
    "run",
]
