"""open_sandbox(): a session over a host directory, for as long as a block."""

from __future__ import annotations

import dataclasses
import os
import secrets
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from ._confinement import Confinement
from ._driver import StartPlan
from ._gateway import GatewayHub, SessionNetwork, service_nursery
from ._registry import driver_class
from ._session import Session


@asynccontextmanager
async def open_sandbox(
    workspace: str | os.PathLike[str],
    *,
    driver: str = "native",
    network: object = "deny-all",
    uid: int = 1000,
    gid: int = 1000,
    upstream_ssl_context: ssl.SSLContext | None = None,
    on_broker_error: Callable[[BaseException], object] | None = None,
    confinement: Confinement | None = None,
) -> AsyncIterator[Session]:
    """Start a sandbox whose ``/workspace`` is the host directory
    ``workspace``; everything in it is killed when the block exits.

    ``upstream_ssl_context`` verifies https upstreams of an allow-list
    policy (default: the system's trust store); ``on_broker_error`` receives
    the gateway's internal errors; ``confinement`` sets the session's
    rlimits, /tmp size and seccomp filter (see :class:`Confinement`)."""
    driver_type = driver_class(driver)
    # Everything is checked before anything starts; the gateway joins the plan once it runs.
    plan = StartPlan(workspace, network=network, uid=uid, gid=gid, confinement=confinement)
    hub = GatewayHub(upstream_ssl_context, on_broker_error)
    async with service_nursery() as nursery:
        network_of_session = SessionNetwork(hub, nursery, f"sandbox-{secrets.token_hex(4)}")
        try:
            gateway = await network_of_session.prepare(plan.network)
            sandbox_driver = await driver_type.start(dataclasses.replace(plan, gateway=gateway))
            try:
                yield Session(sandbox_driver, network=network_of_session)
            finally:
                await sandbox_driver.aclose()
        finally:
            await network_of_session.aclose()
