"""`python -m broker ...` runs the whole `muster` command, as it always has."""

from muster.cli import main

main()
