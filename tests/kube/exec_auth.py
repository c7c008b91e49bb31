"""A kubeconfig whose user authenticates through an exec credential plugin reading a token
file the test rewrites, so tests can expire and rotate the agent's token."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml

EXEC_PLUGIN = """
import json, sys
token, expiry = open(sys.argv[1]).read().split()
print(json.dumps({
    "apiVersion": "client.authentication.k8s.io/v1beta1",
    "kind": "ExecCredential",
    "status": {"token": token, "expirationTimestamp": expiry},
}))
"""


def write_kubeconfig(tmp: Path, server: str) -> tuple[Path, Path]:
    plugin = tmp / "plugin.py"
    plugin.write_text(EXEC_PLUGIN)
    token_file = tmp / "token"
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [
            {
                "name": "u",
                "user": {
                    "exec": {
                        "apiVersion": "client.authentication.k8s.io/v1beta1",
                        "command": sys.executable,
                        "args": [str(plugin), str(token_file)],
                        "interactiveMode": "Never",
                    }
                },
            }
        ],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    }
    path = tmp / "kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    return path, token_file


def expiry(in_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + in_s))
