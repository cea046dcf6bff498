"""The web page at / in headless Chromium on loopback: type sentences, press Compare, read the rendered heatmaps and the
nearest tokens back out of the page, and check them against cosines computed here from the HTTP API's vectors.

Regenerate the screenshot in docs with the shipped model:
    ELMO_PAGE_MODEL=models/default ELMO_PAGE_SCREENSHOT=docs/page.png \
        .venv/bin/python -m pytest tests/service/test_page.py
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from elmo.service.common.limits import Limits

from elmo.runtime import Embedder
from elmo.runtime.tasks import Task, save_task
from tests.browser import Browser
from tests.service_helpers import ServerThread

SENTENCES = ["我买了一台苹果电脑。", "苹果很好吃，又甜又脆。", "He ate an apple ."]
TASK = "pos_demo"


@pytest.fixture(scope="module")
def page_server(tiny_model_dir, tmp_path_factory):
    directory = Path(os.environ.get("ELMO_PAGE_MODEL") or tmp_path_factory.mktemp("page") / "model")
    if "ELMO_PAGE_MODEL" not in os.environ:
        shutil.copytree(tiny_model_dir, directory)
        save_task(directory, Task(TASK, "tagging", 3, 16, [0.4, -0.9, 1.7], 0.8, layer_norm=True))
    server = ServerThread({"": Embedder(directory, intra_op_threads=1)}, Limits(drain_seconds=1.0), http=True)
    server.warm_up()
    yield server
    server.stop()


def api_cosines(url: str, task: str, sentences: list[str] = SENTENCES) -> dict[str, np.ndarray]:
    """Per heatmap name, the token-by-token cosine matrix over all sentences, from /v1/embed (JSON floats)."""
    body = json.dumps({"input": sentences, **({"task": task} if task else {})}).encode()
    request = urllib.request.Request(f"{url}/v1/embed", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    vectors: dict[str, list] = {}
    for embedding in answer["embeddings"]:
        for layer, values in zip(answer["layers"], embedding["layers"]):
            vectors.setdefault(f"layer{layer}", []).extend(values)
        if task:
            vectors.setdefault(f"mix:{task}", []).extend(embedding["mix"])
    cosines = {}
    for name, rows in vectors.items():
        matrix = np.asarray(rows, dtype=np.float64)
        unit = matrix / np.linalg.norm(matrix, axis=1, keepdims=True)
        cosines[name] = unit @ unit.T
    return cosines


READ_MAPS = """Array.from(document.querySelectorAll('table.heatmap')).map((table) => {
                 const cells = Array.from(table.querySelectorAll('td'));
                 const n = Math.round(Math.sqrt(cells.length));
                 const values = Array.from({length: n}, () => new Array(n));
                 for (const td of cells) values[Number(td.dataset.i)][Number(td.dataset.j)] = Number(td.dataset.value);
                 return {name: table.dataset.name, values};
               })"""
SETTLED = "['done', 'error'].includes(document.getElementById('status').dataset.state)"


async def first_load(url: str, workdir: Path) -> dict:
    """The page as it first shows, nothing clicked or typed: its worked example, compared."""
    async with Browser(workdir) as page:
        await page.goto(url + "/")
        await page.wait_for(SETTLED)
        return {
            "status": await page.evaluate("document.getElementById('status').textContent"),
            "sentences": await page.evaluate("document.getElementById('sentences').value"),
            "maps": await page.evaluate(READ_MAPS),
            "label": await page.evaluate("document.getElementById('token').parentElement.textContent.trim()"),
        }


def test_the_page_shows_its_worked_example_compared_on_first_load(page_server, tmp_path):
    """No click: the 苹果 sentences' heatmaps are drawn on first load, one per layer, with the API's cosines."""
    seen = asyncio.run(first_load(page_server.http_url, tmp_path))
    sentences = seen["sentences"].split("\n")
    assert len(sentences) >= 2 and all("苹果" in sentence for sentence in sentences)
    assert f"{len(sentences)} sentences" in seen["status"], seen["status"]
    expected = api_cosines(page_server.http_url, "", sentences)
    assert [m["name"] for m in seen["maps"]] == [f"layer{i}" for i in range(page_server.model().n_layers)]
    for rendered in seen["maps"]:
        values = np.asarray(rendered["values"], dtype=np.float64)
        np.testing.assert_allclose(values, expected[rendered["name"]], atol=1e-6, err_msg=rendered["name"])
    assert seen["label"] == "API token"


async def drive_page(url: str, workdir: Path, task: str) -> dict:
    async with Browser(workdir) as page:
        await page.goto(url + "/")
        await page.wait_for(SETTLED)  # the worked example, compared on load
        await page.evaluate(
            f"document.getElementById('sentences').value = {json.dumps(chr(10).join(SENTENCES))};"
            f"document.getElementById('task').value = {json.dumps(task)};"
            "document.getElementById('run').click()"
        )
        await page.wait_for(SETTLED)
        status = await page.evaluate("document.getElementById('status').textContent")
        maps = await page.evaluate(READ_MAPS)
        tokens = await page.evaluate("Array.from(document.querySelectorAll('.tok')).map((t) => t.textContent)")
        # click the first 苹 (first sentence): the nearest-token table appears, one column per heatmap
        await page.evaluate("document.querySelector('.tok[data-k=\"5\"]').click()")
        await page.wait_for("document.querySelector('#nearest table[data-k=\"5\"]') !== null")
        nearest = await page.evaluate(
            """Array.from(document.querySelectorAll('#nearest tr')).slice(1).map((tr) =>
                 Array.from(tr.querySelectorAll('td')).map((td) => Number(td.dataset.value)))"""
        )
        png = await page.screenshot()
    return {"status": status, "maps": maps, "tokens": tokens, "nearest": nearest, "png": png}


def test_the_page_renders_the_apis_cosines_and_nearest_tokens(page_server, tmp_path):
    task = TASK if "ELMO_PAGE_MODEL" not in os.environ else page_server.model().tasks.names()[0]
    seen = asyncio.run(drive_page(page_server.http_url, tmp_path, task))
    assert "sentences" in seen["status"], seen["status"]
    expected = api_cosines(page_server.http_url, task)
    n_layers = page_server.model().n_layers
    assert [m["name"] for m in seen["maps"]] == [f"layer{i}" for i in range(n_layers)] + [f"mix:{task}"]
    n_tokens = expected["layer0"].shape[0]
    assert len(seen["tokens"]) == n_tokens and seen["tokens"][5] == "苹"
    for rendered in seen["maps"]:
        values = np.asarray(rendered["values"], dtype=np.float64)
        assert values.shape == (n_tokens, n_tokens)
        np.testing.assert_allclose(values, expected[rendered["name"]], atol=1e-6, err_msg=rendered["name"])
    # nearest tokens of token 5 per heatmap, best first: the largest cosines of its row, itself left out
    nearest = np.asarray(seen["nearest"], dtype=np.float64)  # (5 ranks, heatmaps)
    for column, rendered in enumerate(seen["maps"]):
        row = np.delete(expected[rendered["name"]][5], 5)
        np.testing.assert_allclose(nearest[:, column], np.sort(row)[::-1][:5], atol=1e-6)
    assert seen["png"][:8] == b"\x89PNG\r\n\x1a\n" and len(seen["png"]) > 10_000
    if os.environ.get("ELMO_PAGE_SCREENSHOT"):
        Path(os.environ["ELMO_PAGE_SCREENSHOT"]).write_bytes(seen["png"])


def test_the_page_needs_nothing_from_outside(page_server):
    """No CDN, no web fonts, no external script or stylesheet: every URL the page names is its own."""
    with urllib.request.urlopen(page_server.http_url + "/", timeout=30) as response:
        html = response.read().decode()
        assert response.headers["Content-Type"].startswith("text/html")
    assert "<script src" not in html and "<link" not in html and "@import" not in html and "url(" not in html
    assert "http://" not in html and "https://" not in html
