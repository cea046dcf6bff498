"""Headless Chromium (Debian's package) driven over the DevTools protocol, for the web page's browser test.

No Selenium or Playwright: Chromium is started with ``--remote-debugging-port=0``, its page target is reached over a
WebSocket (aiohttp, which the HTTP API needs anyway), and the test evaluates JavaScript in the page: fill the form,
click, read the rendered heatmap, take a screenshot. Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser")
SKIP_ENV = "ELMO_SKIP_BROWSER"  # set to 1 on a machine without Chromium (make test installs it)
# Flags from the machine notes: without the background-networking ones, Chromium tries Google's hosts at start.
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
    "--window-size=1400,1000",
]


def chromium_or_fail() -> str:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"no Chromium here and {SKIP_ENV}=1")
    pytest.fail(
        "Chromium is not installed: `make test` installs Debian's chromium package; elsewhere install it "
        f"(apt-get install chromium) or set {SKIP_ENV}=1 to skip the browser test knowingly",
        pytrace=False,
    )


class Browser:
    """One headless Chromium with one page. ``async with Browser(workdir) as page: await page.goto(url)``."""

    def __init__(self, workdir: Path):
        self.profile = workdir / "chromium-profile"
        self.process: subprocess.Popen | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> Browser:
        binary = chromium_or_fail()
        self.profile.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port = await self._devtools_port()
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        page = next(t for t in targets if t["type"] == "page")
        self._ws = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.ensure_future(self._read())
        await self.send("Page.enable")
        await self.send("Runtime.enable")
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    async def _devtools_port(self, wait_s: float = 60.0) -> int:
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"Chromium exited at start with code {self.process.returncode}")
            if port_file.is_file() and port_file.read_text().strip():
                return int(port_file.read_text().split()[0])
            await asyncio.sleep(0.05)
        raise TimeoutError("Chromium did not open its DevTools port")

    async def _read(self) -> None:
        async for message in self._ws:
            payload = json.loads(message.data)
            future = self._pending.pop(payload.get("id"), None)
            if future is not None and not future.done():
                future.set_result(payload)

    async def send(self, method: str, **params: Any) -> dict:
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        await self._ws.send_json({"id": call_id, "method": method, "params": params})
        payload = await asyncio.wait_for(future, 60)
        if "error" in payload:
            raise RuntimeError(f"{method}: {payload['error']}")
        return payload["result"]

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited, the value returned as JSON)."""
        result = await self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page error: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'")

    async def wait_for(self, condition: str, wait_s: float = 60.0) -> None:
        deadline = time.monotonic() + wait_s
        while not await self.evaluate(f"Boolean({condition})"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never satisfied: {condition}")
            await asyncio.sleep(0.05)

    async def screenshot(self) -> bytes:
        """The whole page, not only the window."""
        size = (await self.send("Page.getLayoutMetrics"))["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        result = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True, clip=clip)
        return base64.b64decode(result["data"])


__all__ = ["Browser", "chromium_or_fail"]
