"""Which host user a root host's guests run as.

The kernel would map a root host's guest to host uid 0, so that anything
escaping the sandbox would land as root, and RLIMIT_NPROC (which never
applies to host root) would bound nothing. Instead, such guests run as an
unprivileged host uid and gid: the first ids of the range ``/etc/subuid``
and ``/etc/subgid`` give the name ``sandboxns``, or else
:data:`DEFAULT_HOST_ID`. The workspace keeps its owner on disk: the guest
sees it through an idmapped mount that shows the owner's files as its own.
"""

from __future__ import annotations

import os

# Far above the ranges useradd hands out (subordinate ids start at 100000,
# 65536 per user), so no real user shares it by accident.
DEFAULT_HOST_ID = 2_000_000_000
SUBID_NAME = "sandboxns"


def guest_host_ids() -> tuple[int, int] | None:
    """The host (uid, gid) of this process's guests when it runs as root;
    None otherwise (an ordinary user's guests are that user)."""
    if os.geteuid() != 0:
        return None
    return _first_subordinate_id("/etc/subuid"), _first_subordinate_id("/etc/subgid")


def _first_subordinate_id(path: str) -> int:
    try:
        with open(path) as file:
            for line in file:
                name, _, rest = line.strip().partition(":")
                start, _, count = rest.partition(":")
                if name == SUBID_NAME and start.isdigit() and count.isdigit() and int(count) > 0 and int(start) > 0:
                    return int(start)
    except FileNotFoundError:
        pass
    return DEFAULT_HOST_ID
