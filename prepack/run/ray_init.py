"""Connecting to Ray: the one place a command starts or joins a Ray cluster (``prepack run``,
``prepack latents``).

Local by default, on loopback with no dashboard and no usage stats; under ``ray job submit`` (or
with ``$RAY_ADDRESS``) the cluster's.
"""

from __future__ import annotations

import logging
import os


def init_ray(address: str | None, num_cpus: int | None = None):
    """Connect to ``address`` (or $RAY_ADDRESS), else start a local Ray on loopback.

    The local Ray listens on 127.0.0.1 only and dies with this process, so it runs without token
    authentication unless RAY_AUTH_MODE says otherwise (so no token warning).  Ray's info
    messages are shown with ``-v`` only; its warnings (a retried task, a dead worker) always.
    """
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    quiet = not logging.getLogger().isEnabledFor(logging.INFO)
    level = logging.WARNING if quiet else logging.INFO  # warnings stay: a retried task is worth a line
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=level, log_to_driver=True)
    else:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=num_cpus,
                 logging_level=level, log_to_driver=True)
    return ray
