"""What the broker and the agents share to run as processes over NATS: the nats-py shims, the
logging setup and the command-line options. Imports `schemas` only, so both may import it."""
