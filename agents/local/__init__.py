"""The `local` backend: every replica of a dispatched gang is a process on this machine."""
