"""``sandboxns mcp``: the coding tools of one sandbox session, served over
MCP's stdio transport with the official ``mcp`` SDK (installed with the
``mcp`` extra: ``pip install 'sandboxns[mcp]'``).

Each tool call returns the same JSON the tools give any agent loop (as text,
and as structured content); a refusal is a tool result with ``isError``
set, so the model reads why.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import trio

from ._backend import open_backend
from ._coding import RESTRICTIONS, CodingTools
from ._coding_tools import create_sandbox_coding_tools
from ._errors import ErrorCode, SandboxError

# A template snapshot from --files holds at most this much.
MAX_TEMPLATE_FILES = 10_000
MAX_TEMPLATE_BYTES = 256 * 1024 * 1024


def _load_mcp():
    try:
        import mcp_types
        from mcp.server.lowlevel import Server
        from mcp.server.stdio import stdio_server
    except ImportError:
        raise SandboxError(
            ErrorCode.SANDBOX_UNAVAILABLE, "the MCP server needs the mcp extra: pip install 'sandboxns[mcp]'"
        ) from None
    return mcp_types, Server, stdio_server


async def serve_tools(tools: CodingTools) -> None:
    """Serve ``tools`` over MCP on this process's stdin and stdout until
    the client goes away."""
    types, Server, stdio_server = _load_mcp()

    async def list_tools(context, params) -> object:
        return types.ListToolsResult(
            tools=[types.Tool(name=t.name, description=t.description, input_schema=t.input_schema) for t in tools]
        )

    async def call_tool(context, params) -> object:
        result = await tools.dispatch(params.name, params.arguments or {})
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=json.dumps(result))],
            structured_content=result,
            is_error="error" in result,
        )

    server = Server("sandboxns", on_list_tools=list_tools, on_call_tool=call_tool)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def _snapshot(directory: Path) -> dict[str, bytes]:
    """The regular files under ``directory`` (symlinks skipped), as a
    template's files."""
    files: dict[str, bytes] = {}
    total = 0
    for parent, subdirectories, names in os.walk(directory):
        subdirectories[:] = [d for d in subdirectories if not os.path.islink(os.path.join(parent, d))]
        for name in names:
            path = os.path.join(parent, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            data = Path(path).read_bytes()
            total += len(data)
            if len(files) >= MAX_TEMPLATE_FILES or total > MAX_TEMPLATE_BYTES:
                raise SandboxError(
                    ErrorCode.SANDBOX_LIMIT,
                    f"{directory} has more than {MAX_TEMPLATE_FILES} files or {MAX_TEMPLATE_BYTES} bytes",
                )
            files[os.path.relpath(path, directory)] = data
    return files


async def run_mcp(args: argparse.Namespace) -> None:
    async with open_backend(driver=args.driver, state_directory=args.state_dir) as backend:
        if args.workspace is not None:
            handle = await backend.create(workspace=args.workspace, network=args.network)
        else:
            files = await trio.to_thread.run_sync(_snapshot, Path(args.files)) if args.files else {}
            template = await backend.prewarm(template=args.template, files=files)
            handle = await backend.create(template=template.template_key, network=args.network)
        try:
            # Nobody sits behind a stdio server to ask: the sandbox itself,
            # with the restrictions verified below, is the policy.
            required = [r for r in RESTRICTIONS if not (r == "network-denied" and args.network == "allow-all")]
            tools = await create_sandbox_coding_tools(
                handle, authorize=lambda operation: True, required_restrictions=required
            )
            await serve_tools(tools)
        finally:
            await handle.shutdown()
