"""open_sandbox(): a session over a host directory, for as long as a block."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ._bwrap import BwrapDriver
from ._errors import ErrorCode, SandboxError
from ._native import NativeDriver
from ._session import Session, create_sandbox_session

DRIVERS = {"native": NativeDriver, "bwrap": BwrapDriver}


def driver_class(name: object):
    """The driver class called ``name``."""
    try:
        return DRIVERS[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise SandboxError(
            ErrorCode.SANDBOX_INVALID_ARGUMENT, f"unknown driver {name!r}; choose one of {', '.join(DRIVERS)}"
        ) from None


@asynccontextmanager
async def open_sandbox(
    workspace: str | os.PathLike[str],
    *,
    driver: str = "native",
    network: object = "deny-all",
    uid: int = 1000,
    gid: int = 1000,
) -> AsyncIterator[Session]:
    """Start a sandbox whose ``/workspace`` is the host directory
    ``workspace``; everything in it is killed when the block exits."""
    sandbox_driver = await driver_class(driver).start(workspace, network=network, uid=uid, gid=gid)
    try:
        yield create_sandbox_session(sandbox_driver)
    finally:
        await sandbox_driver.aclose()
