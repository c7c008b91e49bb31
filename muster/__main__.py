"""`python -m muster ...` is the `muster` command."""

from muster.cli import main

main()
