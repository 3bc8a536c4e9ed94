"""A forked guest against the layers under it and its sibling forks: none is
reachable through what /proc tells it, through a symlink, or through the
host's file API, and nothing it writes reaches the snapshot."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

import sandboxns
from sandboxns import ErrorCode

pytestmark = pytest.mark.smoke

# Prints each path the workspace's mount names in /proc/self/mountinfo,
# and whether it (or any parent of it but /) exists in the guest. Layers
# mounted by fd are named relative to their own detached mounts ("/",
# "/workspace"): those names are the guest's own root and workspace, not a
# way anywhere. Layers mounted by path (kernels before 6.13) are named by
# their paths when the holder mounted them: the host's, or, on a root host,
# under the /tmp the holder built its root in, which is the guest's own
# empty tmpfs now.
NAMED_PATHS = r"""
import os, re
for line in open("/proc/self/mountinfo"):
    if " /workspace " not in line:
        continue
    for path in re.findall(r"(?:lowerdir\+?|upperdir|workdir)=([^,\s]+)", line):
        if path in ("/", "/workspace"):
            continue
        parents = [path]
        while os.path.dirname(parents[-1]) not in ("/", parents[-1]):
            parents.append(os.path.dirname(parents[-1]))
        print(path, any(os.path.lexists(p) and not p.startswith(("/tmp", "/workspace")) for p in parents))
"""


def digest(tree: Path) -> str:
    """Every name, mode and content in a tree, hashed."""
    hashed = hashlib.sha256()
    for directory, directories, files in sorted(os.walk(tree)):
        for name in sorted(directories + files):
            path = os.path.join(directory, name)
            info = os.lstat(path)
            hashed.update(f"{os.path.relpath(path, tree)} {info.st_mode} {info.st_rdev}\n".encode())
            if os.path.isfile(path) and not os.path.islink(path):
                hashed.update(Path(path).read_bytes())
    return hashed.hexdigest()


async def sh(handle, script: str):
    return await handle.session.run("sh", ["-c", script], timeout=30)


async def test_a_fork_reaches_no_layer_and_no_other_fork(backend, state_dir):
    template = await backend.prewarm(template="layers", files={"shared": b"template\n"})
    async with await backend.create(template=template.template_key) as origin:
        await sh(origin, "echo origin > mine")
        a, b = await origin.fork(2)
        snapshot_layers = state_dir / "snapshots"
        before = digest(snapshot_layers)
        try:
            assert (await sh(a, "echo a-secret > secret; echo changed > shared; rm mine")).exit_code == 0
            # What the mount table names is nowhere in b's own root (the
            # names under /tmp are the holder's, before its pivot: b's /tmp
            # is its own empty tmpfs).
            named = await b.session.run("python3", ["-c", NAMED_PATHS])
            assert named.exit_code == 0 and all(line.endswith(" False") for line in named.stdout.splitlines()), named
            # The host paths of a's upper layer and of the snapshot's layer,
            # through symlinks: resolved in b's root, they lead nowhere.
            a_upper = state_dir / "sessions" / a.session_id / "workspace"
            layer = next(snapshot_layers.glob("*/files"))
            script = f"ln -s {a_upper} to-a; ln -s {layer} to-layer; cat to-a/secret to-layer/mine; ls to-a/ to-layer/"
            through_links = await sh(b, script)
            assert through_links.exit_code != 0 and "secret" not in through_links.stdout, through_links
            assert (await sh(b, "cat shared mine")).stdout == "template\norigin\n"
            for link in ("to-a/secret", "to-layer/mine"):
                with pytest.raises(sandboxns.SandboxError) as refused:
                    await b.session.read_file(link)
                assert refused.value.code in (ErrorCode.SANDBOX_PATH_REFUSED, ErrorCode.SANDBOX_NOT_FOUND)
            # Writing over what came from the snapshot writes the fork's own
            # layer; the origin, which stands on the snapshot too, its own.
            assert (await sh(b, "echo b > shared; chmod 600 mine; rm -f secret")).exit_code == 0
            assert (await sh(origin, "echo o > shared; rm mine; mkdir mine; chmod 700 .")).exit_code == 0
            assert digest(snapshot_layers) == before
        finally:
            await a.delete()
            await b.delete()
