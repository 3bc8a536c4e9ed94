"""Property-based tests (hypothesis): path normalisation and containment,
and network-policy validation, over inputs nobody would think to write."""

from __future__ import annotations

import os
import posixpath

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandboxns import ErrorCode, SandboxError, normalize_path
from sandboxns._files import WorkspaceFiles, open_beneath, walk_beneath
from sandboxns._network import check_network_policy

pytestmark = pytest.mark.smoke

COMPONENTS = st.sampled_from(["..", ".", "", "a", "dir", "inner", "leaf", "mid", "loop", "f", "workspace", "\x00x"])
PATHS = st.one_of(
    st.text(max_size=60),
    st.lists(COMPONENTS, max_size=8).map("/".join),
    st.lists(COMPONENTS, max_size=8).map(lambda parts: "/" + "/".join(parts)),
    st.lists(COMPONENTS, max_size=8).map(lambda parts: "/workspace/" + "/".join(parts)),
)


# No example database: the tests also run from a directory the unprivileged
# CI user cannot write to.
EXAMPLES = settings(database=None)


@EXAMPLES
@given(PATHS)
def test_a_normalised_path_is_canonical_and_inside_the_workspace(path):
    try:
        normal = normalize_path(path)
    except SandboxError as error:
        assert error.code == ErrorCode.SANDBOX_PATH_REFUSED
        return
    assert normal == "/workspace" or normal.startswith("/workspace/")
    assert posixpath.normpath(normal) == normal and "\0" not in normal
    assert normalize_path(normal) == normal
    # It names what the path meant, relative to /workspace.
    joined = path if path.startswith("/") else "/workspace/" + path
    assert posixpath.normpath(joined).lstrip("/") == normal.lstrip("/")


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A workspace full of symlinks that lead out, next to a secret."""
    root = tmp_path_factory.mktemp("planted")
    outside, workspace = root / "outside", root / "workspace"
    outside.mkdir()
    (outside / "f").write_text("SECRET")
    (workspace / "dir").mkdir(parents=True)
    (workspace / "dir" / "inner").write_text("inside")
    for name, target in {
        "leaf": str(outside / "f"), "mid": "../outside", "loop": "loop", "up": "dir/../..", "a": "dir",
    }.items():  # fmt: skip
        os.symlink(target, workspace / name)
    return workspace, outside


@settings(database=None, max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.lists(COMPONENTS.filter(lambda c: "\0" not in c), min_size=1, max_size=6).map("/".join))
@pytest.mark.parametrize("resolver", [open_beneath, walk_beneath])
def test_no_path_reads_or_writes_outside(planted, resolver, path):
    workspace, outside = planted
    files = WorkspaceFiles.of_directory(workspace, resolver)
    try:
        try:
            data = files.read_bytes(normalize_path(path), 100)
        except SandboxError:
            pass
        else:
            assert data != b"SECRET"
        try:
            files.write_bytes(normalize_path(path), b"written")
        except SandboxError:
            pass
    finally:
        files.close()
    assert sorted(os.listdir(outside)) == ["f"] and (outside / "f").read_text() == "SECRET"


# Distinctive, so that finding one in a message cannot be a coincidence;
# some carry characters HTTP refuses, so refusals are exercised too.
HEADER_VALUES = st.text(alphabet="qxzj\r\n\x00 \t", min_size=8, max_size=20).map(lambda text: "s3cr3t" + text)
POLICIES = st.one_of(
    st.none(),
    st.integers(),
    st.text(max_size=20),
    st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    st.fixed_dictionaries(
        {
            "allow": st.lists(
                st.fixed_dictionaries(
                    {
                        "origin": st.one_of(
                            st.text(max_size=40), st.sampled_from(["https://a.example", "http://b:8080"])
                        )
                    },
                    optional={"headers": st.dictionaries(st.text(max_size=12), HEADER_VALUES, max_size=3)},
                ),
                max_size=3,
            )
        }
    ),
)


@EXAMPLES
@given(POLICIES)
def test_a_policy_is_accepted_whole_or_refused_without_showing_header_values(policy):
    try:
        checked = check_network_policy(policy)
    except SandboxError as error:
        assert error.code == ErrorCode.SANDBOX_INVALID_ARGUMENT
        assert "s3cr3t" not in error.message
        return
    assert check_network_policy(checked) is checked
    assert "s3cr3t" not in repr(checked) and "s3cr3t" not in str(checked)
