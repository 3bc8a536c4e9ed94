"""The one exception type of the public API, with stable string codes."""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    """Stable error codes. Each member equals its own name as a string, so
    ``ErrorCode.SANDBOX_BUSY == "SANDBOX_BUSY"`` and codes survive JSON."""

    SANDBOX_BUSY = "SANDBOX_BUSY"
    SANDBOX_UNAVAILABLE = "SANDBOX_UNAVAILABLE"
    SANDBOX_NOT_FOUND = "SANDBOX_NOT_FOUND"
    SANDBOX_STATE_MISMATCH = "SANDBOX_STATE_MISMATCH"
    SANDBOX_POLICY_REFUSED = "SANDBOX_POLICY_REFUSED"
    SANDBOX_PATH_REFUSED = "SANDBOX_PATH_REFUSED"
    SANDBOX_LIMIT = "SANDBOX_LIMIT"
    SANDBOX_STOPPED = "SANDBOX_STOPPED"
    SANDBOX_INVALID_ARGUMENT = "SANDBOX_INVALID_ARGUMENT"
    # The session lacks a restriction the caller requires (coding tools).
    SANDBOX_INSUFFICIENT = "SANDBOX_INSUFFICIENT"
    # The host's authorize hook said no (coding tools).
    FORBIDDEN = "FORBIDDEN"

    def __str__(self) -> str:
        return self.value


class SandboxError(Exception):
    """Raised for every refusal or failure of the sandbox API.

    ``code`` is an :class:`ErrorCode`; ``message`` says what was wrong. A
    refusal never leaves stored state half-changed.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = ErrorCode(code)
        self.message = message

    def __reduce__(self) -> tuple:
        # Pickled whole (for another process: a Ray actor's caller, say).
        return (type(self), (self.code, self.message))


def invalid_argument(message: str) -> SandboxError:
    """The SANDBOX_INVALID_ARGUMENT refusal, the most common one."""
    return SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, message)
