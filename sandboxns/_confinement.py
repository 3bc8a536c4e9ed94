"""What the kernel bounds for a session beyond its namespaces: each command's
resource limits, the size of its /tmp and of its workspace, and its seccomp
filter.

Both drivers apply the same values; see the README's "Resource bounds" and
"Seccomp" sections for what each one does and does not bound.
"""

from __future__ import annotations

import resource
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields

from . import _ffi
from ._cgroup import CgroupLimits
from ._errors import ErrorCode, SandboxError, invalid_argument

DEFAULT_PROCESSES = 1024
MAX_TMP_SIZE = 1 << 40
MIN_WORKSPACE_SIZE = 16 << 20
# ext4, a common file system for the state directory, holds no file of 16 TiB
# or more, such as the sparse image a capped workspace lives in.
MAX_WORKSPACE_SIZE = 8 << 40

# The host's own limit for each slot: a guest can be given at most that.
_HOST_RESOURCES = {
    "cpu_seconds": resource.RLIMIT_CPU,
    "address_space": resource.RLIMIT_AS,
    "file_size": resource.RLIMIT_FSIZE,
    "open_files": resource.RLIMIT_NOFILE,
    "processes": resource.RLIMIT_NPROC,
}


@dataclass(frozen=True)
class ResourceLimits:
    """Per-command rlimits, soft and hard alike (a guest may lower them, never
    raise them). ``None`` leaves a limit as the host process has it.

    - ``cpu_seconds``: CPU time of each process (SIGXCPU, then SIGKILL).
    - ``address_space``: virtual memory of each process, in bytes. Off by
      default: JIT runtimes reserve far more than they use.
    - ``file_size``: the largest file a process may write, in bytes (EFBIG).
    - ``open_files``: file descriptors per process.
    - ``processes``: RLIMIT_NPROC, which the kernel counts per user *and*
      user namespace. With the native driver every command of a session
      shares the session's user namespace and user, so this bounds the
      processes alive in the whole session at once (its holder and
      per-command inits included); with bwrap, each command has a user
      namespace of its own and the bound is per command. Default 1024,
      which stops a fork bomb.
    """

    cpu_seconds: int | None = None
    address_space: int | None = None
    file_size: int | None = None
    open_files: int | None = None
    processes: int | None = DEFAULT_PROCESSES

    def __post_init__(self) -> None:
        for slot in fields(self):
            value = getattr(self, slot.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise invalid_argument(f"resource limit {slot.name} must be a positive integer or None, not {value!r}")
            _, host_hard = resource.getrlimit(_HOST_RESOURCES[slot.name])
            if host_hard != resource.RLIM_INFINITY and value > host_hard:
                raise SandboxError(
                    ErrorCode.SANDBOX_LIMIT,
                    f"resource limit {slot.name}={value} is above this host process's own hard limit {host_hard}",
                )

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> ResourceLimits:
        """From a mapping of field names (stored state, a spec); refuses
        unknown names."""
        if not isinstance(values, Mapping):
            raise invalid_argument(f"resource limits must be a mapping, not {type(values).__name__}")
        unknown = set(values) - {slot.name for slot in fields(cls)}
        if unknown:
            raise invalid_argument(f"unknown resource limits: {', '.join(sorted(map(str, unknown)))}")
        return cls(**values)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, int | None]:
        return {slot.name: getattr(self, slot.name) for slot in fields(self)}

    def slots(self) -> list[int]:
        """The values in the holder's request order."""
        values = [_ffi.RLIMIT_INHERIT] * _ffi.RLIMIT_COUNT
        for name, slot in _ffi.RLIMIT_SLOTS.items():
            value = getattr(self, name)
            if value is not None:
                values[slot] = value
        return values

    def init_argument(self) -> str:
        """The same for ``sandboxns-holder --init`` (csrc/bwrap_init.c):
        comma-separated, "-" for a limit left alone."""
        return ",".join("-" if value == _ffi.RLIMIT_INHERIT else str(value) for value in self.slots())


@dataclass(frozen=True)
class SeccompPolicy:
    """Changes to the default seccomp filter (see the README's "Seccomp"):
    ``allow`` lifts whole groups of it (e.g. ``"ptrace"`` for a debugger, or
    ``"perf"``), ``deny`` adds syscalls by name, denied with EPERM. The
    architecture checks (no other ABI) always stay."""

    allow: frozenset[str] = field(default_factory=frozenset)
    deny: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allow", _names(self.allow, "seccomp allow"))
        object.__setattr__(self, "deny", _names(self.deny, "seccomp deny"))
        unknown = self.allow - set(_ffi.SECCOMP_GROUPS)
        if unknown:
            raise invalid_argument(
                f"unknown seccomp groups {', '.join(sorted(unknown))}; the groups are " + ", ".join(_ffi.SECCOMP_GROUPS)
            )
        unknown = {name for name in self.deny if _ffi.syscall_number(name) is None}
        if unknown:
            raise invalid_argument(f"unknown syscalls {', '.join(sorted(unknown))} (names as in <sys/syscall.h>)")
        if len(self.deny) > _ffi.SECCOMP_MAX_EXTRA:
            raise SandboxError(ErrorCode.SANDBOX_LIMIT, f"at most {_ffi.SECCOMP_MAX_EXTRA} extra seccomp denials")

    @property
    def relaxed_mask(self) -> int:
        mask = 0
        for name in self.allow:
            mask |= _ffi.SECCOMP_GROUPS[name]
        return mask

    @property
    def denied_numbers(self) -> list[int]:
        return sorted(_ffi.syscall_number(name) for name in self.deny)  # type: ignore[misc]

    def program(self) -> bytes:
        """The compiled filter (what bwrap's --seccomp reads)."""
        return _ffi.seccomp_program(self.relaxed_mask, self.denied_numbers)


def _names(value: object, what: str) -> frozenset[str]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise invalid_argument(f"{what} must be a collection of names, not {value!r}")
    names = frozenset(value)
    if not all(isinstance(name, str) for name in names):
        raise invalid_argument(f"{what} must name things with strings: {sorted(map(repr, names))}")
    return names


@dataclass(frozen=True)
class Confinement:
    """A session's kernel bounds, fixed when it starts: ``limits`` (each
    command's default rlimits, see :class:`ResourceLimits`; a command may
    be given others), ``tmp_size`` (bytes of each command's private /tmp,
    memory-backed; default 256 MiB), ``seccomp`` (see
    :class:`SeccompPolicy`), ``cgroup`` (a cgroup v2 of the session's
    own, see :class:`CgroupLimits`; none by default) and ``workspace_size``
    (bytes the session's workspace may hold, for a backend session made
    from a template; no cap by default; see sandboxns._image)."""

    limits: ResourceLimits = field(default_factory=ResourceLimits)
    tmp_size: int = _ffi.TMP_BYTES
    seccomp: SeccompPolicy = field(default_factory=SeccompPolicy)
    cgroup: CgroupLimits | None = None
    workspace_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.limits, ResourceLimits):
            raise invalid_argument(f"limits must be a sandboxns.ResourceLimits, not {self.limits!r}")
        if not isinstance(self.seccomp, SeccompPolicy):
            raise invalid_argument(f"seccomp must be a sandboxns.SeccompPolicy, not {self.seccomp!r}")
        if self.cgroup is not None and not isinstance(self.cgroup, CgroupLimits):
            raise invalid_argument(f"cgroup must be a sandboxns.CgroupLimits or None, not {self.cgroup!r}")
        size = self.tmp_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 << 20 <= size <= MAX_TMP_SIZE:
            raise invalid_argument(f"tmp_size must be an integer number of bytes from 1 MiB to 1 TiB, not {size!r}")
        size = self.workspace_size
        if size is not None and (
            isinstance(size, bool) or not isinstance(size, int) or not MIN_WORKSPACE_SIZE <= size <= MAX_WORKSPACE_SIZE
        ):
            raise invalid_argument(
                f"workspace_size must be None or an integer number of bytes from 16 MiB to 8 TiB, not {size!r}"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> Confinement:
        """The inverse of :meth:`to_dict` (stored session state)."""
        seccomp = values.get("seccomp", {})
        cgroup = values.get("cgroup")
        if not isinstance(seccomp, Mapping) or not isinstance(cgroup, (Mapping, type(None))):
            raise invalid_argument("confinement.seccomp and confinement.cgroup must be mappings")
        return cls(
            limits=ResourceLimits.from_dict(values.get("limits", {})),  # type: ignore[arg-type]
            tmp_size=values.get("tmp_size", _ffi.TMP_BYTES),  # type: ignore[arg-type]
            seccomp=SeccompPolicy(allow=seccomp.get("allow", ()), deny=seccomp.get("deny", ())),
            cgroup=None if cgroup is None else _stored_cgroup(cgroup),
            workspace_size=values.get("workspace_size"),  # type: ignore[arg-type]
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "limits": self.limits.to_dict(),
            "tmp_size": self.tmp_size,
            "seccomp": {"allow": sorted(self.seccomp.allow), "deny": sorted(self.seccomp.deny)},
            "cgroup": None if self.cgroup is None else self.cgroup.to_dict(),
            "workspace_size": self.workspace_size,
        }

    def holder_arguments(self) -> list[str]:
        """The native holder's options for the session-wide parts."""
        arguments = [f"--tmp-bytes={self.tmp_size}"]
        if self.seccomp.relaxed_mask:
            arguments.append(f"--seccomp-relax={self.seccomp.relaxed_mask}")
        arguments += [f"--seccomp-deny={nr}" for nr in self.seccomp.denied_numbers]
        return arguments


def _stored_cgroup(values: Mapping[str, object]) -> CgroupLimits:
    try:
        return CgroupLimits(**values)  # type: ignore[arg-type]
    except TypeError as exc:
        raise invalid_argument(f"confinement.cgroup: {exc}") from None


DEFAULT_CONFINEMENT = Confinement()


def check_confinement(value: object) -> Confinement:
    if value is None:
        return DEFAULT_CONFINEMENT
    if not isinstance(value, Confinement):
        raise invalid_argument(f"confinement must be a sandboxns.Confinement, not {value!r}")
    return value
