"""The `muster` command: the top of the import graph, joining the broker's, the agent's and the
load programs' commands into one CLI (broker and agents never import each other)."""
