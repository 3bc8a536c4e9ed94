"""sandboxns: fast Linux-namespace sandboxes for AI coding agents.

Everything public is re-exported here; the modules behind it are private.
"""

from . import adapters, blocking
from ._backend import Backend, open_backend
from ._bwrap import BwrapDriver
from ._cgroup import CgroupLimits
from ._coding import (
    ArtifactStore,
    CodingHooks,
    CodingLimits,
    CodingTools,
    Tool,
)
from ._coding_tools import create_sandbox_coding_tools
from ._confinement import Confinement, ResourceLimits, SeccompPolicy
from ._driver import ExitStatus, Mount, SandboxDriver, SandboxProcess, StartPlan
from ._errors import ErrorCode, SandboxError
from ._files import DirEntry
from ._gateway import AuditRecord
from ._handle import SessionHandle
from ._native import NativeDriver
from ._network import NetworkPolicy
from ._open import open_sandbox
from ._paths import normalize_path
from ._pump import OutputCollector
from ._rootfs_images import Image
from ._session import RunResult, Session
from ._snapshots import Snapshot
from ._spec import InstallResult, SandboxSpec, SpecLimits, SpecProblem, SpecSandbox
from ._templates import Template

__all__ = [
    "ArtifactStore",
    "AuditRecord",
    "Backend",
    "BwrapDriver",
    "CgroupLimits",
    "CodingHooks",
    "CodingLimits",
    "CodingTools",
    "Confinement",
    "DirEntry",
    "ErrorCode",
    "ExitStatus",
    "Image",
    "InstallResult",
    "Mount",
    "NativeDriver",
    "NetworkPolicy",
    "OutputCollector",
    "ResourceLimits",
    "RunResult",
    "SandboxDriver",
    "SandboxError",
    "SandboxProcess",
    "SandboxSpec",
    "SeccompPolicy",
    "Session",
    "SessionHandle",
    "Snapshot",
    "SpecLimits",
    "SpecProblem",
    "SpecSandbox",
    "StartPlan",
    "Template",
    "Tool",
    "adapters",
    "blocking",
    "create_sandbox_coding_tools",
    "normalize_path",
    "open_backend",
    "open_sandbox",
]
