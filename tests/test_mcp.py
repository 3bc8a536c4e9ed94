"""`sandboxns mcp` end to end: a real MCP client session (the official SDK)
talks to the server process over stdio."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("mcp")

from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

pytestmark = pytest.mark.smoke


async def test_an_mcp_client_lists_and_calls_the_tools(driver_name, tmp_path, workspace):
    (workspace / "hello.txt").write_text("hello from the host\n")
    server = StdioServerParameters(
        command=sys.executable,
        args=["-m", "sandboxns", "mcp", "--state-dir", str(tmp_path / "state"), "--workspace", str(workspace),
              "--driver", driver_name],
        cwd=str(tmp_path),
    )  # fmt: skip
    async with stdio_client(server) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        listed = await client.list_tools()
        assert {tool.name for tool in listed.tools} >= {"read_file", "write_file", "edit_file", "run_command"}

        read = await client.call_tool("read_file", {"path": "hello.txt"})
        assert not read.is_error and json.loads(read.content[0].text)["text"] == "hello from the host\n"
        ran = await client.call_tool("run_command", {"executable": "shell", "args": ["-c", "id -un; cat hello.txt"]})
        assert json.loads(ran.content[0].text)["stdout"] == "sandbox\nhello from the host\n"
        refused = await client.call_tool("read_file", {"path": "../../etc/passwd"})
        assert refused.is_error and json.loads(refused.content[0].text)["error"] == "SANDBOX_PATH_REFUSED"
        await client.call_tool("write_file", {"path": "out/made.txt", "content": "by the model"})
    assert (workspace / "out/made.txt").read_text() == "by the model"
