"""The web page keeps the bearer token in memory only: typed in, it authorizes the page's API calls; it is never
written to localStorage, sessionStorage or a cookie, and a reload forgets it (a token an earlier version of the page
stored is removed). The page runs under the Content-Security-Policy the server sends with it, with no violation.
Headless Chromium on loopback (tests/browser.py), against a real server with a token."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from elmo.service.common.limits import Limits

from elmo.runtime import Embedder
from tests.browser import Browser
from tests.service_helpers import ServerThread

TOKEN = "page-s3cret"
# Installed before any of the page's own script runs: CSP violations are recorded, not only printed to the console.
RECORD_VIOLATIONS = """
window.__violations = [];
document.addEventListener("securitypolicyviolation",
  (e) => window.__violations.push(`${e.violatedDirective} ${e.blockedURI} ${e.sample}`));
"""
STORED = "[Object.entries(localStorage), Object.entries(sessionStorage), document.cookie]"


@pytest.fixture(scope="module")
def token_server(tiny_model_dir):
    server = ServerThread(
        {"tiny": Embedder(tiny_model_dir, intra_op_threads=1)}, Limits(drain_seconds=1.0), auth_token=TOKEN, http=True
    )
    server.warm_up()
    yield server
    server.stop()


async def load(page: Browser, url: str) -> str:
    """Navigate (a fresh document: the marker of the last one is gone) and wait until the model list settled."""
    await page.evaluate("window.__old = true")
    await page.send("Page.navigate", url=url)
    await page.wait_for("window.__old === undefined && document.readyState === 'complete'")
    await page.wait_for("['ready', 'error'].includes(document.getElementById('status').dataset.state)")
    return await page.evaluate("document.getElementById('status').dataset.state")


async def drive(url: str, workdir) -> dict:
    seen: dict = {}
    async with Browser(workdir) as page:
        await page.send("Page.addScriptToEvaluateOnNewDocument", source=RECORD_VIOLATIONS)
        await load(page, url)
        await page.evaluate("localStorage.setItem('elmo-token', 'stored by an earlier page')")
        seen["first_load"] = await load(page, url)  # no token yet: the model list is refused
        seen["stale_removed"] = await page.evaluate(STORED)
        # typing: one input event per keystroke, then change when the field is left
        await page.evaluate(
            f"""const field = document.getElementById('token');
                for (const c of {json.dumps(TOKEN)}) {{
                  field.value += c; field.dispatchEvent(new Event('input'));
                }}
                field.dispatchEvent(new Event('change'));"""
        )
        # the models listed, then the worked example compared with the token (the state was 'error' until then)
        await page.wait_for("document.getElementById('status').dataset.state === 'done'")
        seen["example"] = await page.evaluate("document.getElementById('status').textContent")
        seen["models"] = await page.evaluate("document.getElementById('model').value")
        await page.evaluate(
            "document.getElementById('sentences').value = 'a b\\nc d'; document.getElementById('run').click()"
        )
        await page.wait_for("['done', 'error'].includes(document.getElementById('status').dataset.state)")
        seen["compare"] = await page.evaluate("document.getElementById('status').textContent")
        seen["stored_after_use"] = await page.evaluate(STORED)
        seen["violations"] = await page.evaluate("window.__violations")
        seen["after_reload"] = await load(page, url)  # the token is gone with the page
        seen["field_after_reload"] = await page.evaluate("document.getElementById('token').value")
        seen["violations_after_reload"] = await page.evaluate("window.__violations")
    return seen


def test_the_token_lives_in_the_page_only_and_the_csp_blocks_nothing_the_page_does(token_server, tmp_path):
    with urllib.request.urlopen(token_server.http_url + "/", timeout=30) as response:
        assert "script-src 'sha256-" in response.headers["Content-Security-Policy"]  # the page runs under a CSP
    seen = asyncio.run(drive(token_server.http_url + "/", tmp_path))
    assert seen["first_load"] == "error"
    assert seen["stale_removed"] == [[], [], ""]
    assert seen["models"] == "tiny"
    assert "3 sentences" in seen["example"], seen["example"]
    assert "2 sentences" in seen["compare"], seen["compare"]
    assert seen["stored_after_use"] == [[], [], ""]
    assert seen["after_reload"] == "error" and seen["field_after_reload"] == ""
    assert seen["violations"] == [] and seen["violations_after_reload"] == []
