"""`python -m load.sim`: the simulator's command line (load/sim/cli.py)."""

from load.sim.cli import app

app(prog_name="python -m load.sim")
