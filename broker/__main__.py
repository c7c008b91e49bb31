"""`python -m broker ...` is the `muster` command."""

from broker.cli import main

main()
