"""A backend owner in its own OS process, driven by test_leases.py.

python lease_owner.py STATE_DIR create MARKER [RETENTION]
                                                new session (with that
                                                retention); prints its state,
                                                then "running" once a command
                                                (sleep MARKER) runs; waits
python lease_owner.py STATE_DIR resume STATE    prints "resumed <file>" and waits
                                                for stdin to close, or the
                                                SandboxError code on failure
"""

from __future__ import annotations

import json
import sys

import trio
from conftest import FirstLine

import sandboxns


async def main(driver: str, state_dir: str, mode: str, argument: str, retention: str | None = None) -> None:
    async with sandboxns.open_backend(driver=driver, state_directory=state_dir) as backend:
        template = await backend.prewarm(template="lease-test", files={"kept.txt": b"from the template"})
        try:
            if mode == "create":
                handle = await backend.create(
                    template=template.template_key, retention=None if retention is None else float(retention)
                )
                await handle.session.write_file("written.txt", b"before the crash")
                print(json.dumps(handle.capture_state()), flush=True)
                started = FirstLine()
                process = await handle.session.driver.spawn(
                    ["sh", "-c", f"echo running; exec sleep {argument}"],
                    env={"PATH": "/usr/bin:/bin"},
                    cwd="/workspace",
                    output=started,
                )
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(process.wait)
                    await started.arrived.wait()
                    print(started.stdout.decode().strip(), flush=True)
                    await trio.sleep_forever()
            handle = await backend.create(template=template.template_key, state=json.loads(argument))
        except sandboxns.SandboxError as error:
            print(error.code.value, error.message, flush=True)
            return
        content = await handle.session.read_text_file("written.txt")
        print("resumed", content.replace(" ", "_"), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)
        await handle.shutdown()


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:6])
