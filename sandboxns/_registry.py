"""The drivers by name, for everything that starts a session from a name
(open_sandbox, the backend, a spec, the CLI)."""

from __future__ import annotations

from ._bwrap import BwrapDriver
from ._errors import ErrorCode, SandboxError
from ._native import NativeDriver

DRIVERS = {"native": NativeDriver, "bwrap": BwrapDriver}


def driver_class(name: object):
    """The driver class called ``name``."""
    try:
        return DRIVERS[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise SandboxError(
            ErrorCode.SANDBOX_INVALID_ARGUMENT, f"unknown driver {name!r}; choose one of {', '.join(DRIVERS)}"
        ) from None
