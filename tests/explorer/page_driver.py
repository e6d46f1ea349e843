"""Driving the explorer page in a real browser (Playwright, Debian's chromium) and reading what it shows from its
DOM hooks (data-testid, data-token-id, data-p, data-kept, data-stage, data-block, data-ref)."""

from __future__ import annotations

import json
import re
from collections import Counter
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright
except ImportError:  # the browser fixture skips (or fails, where a browser is required)
    PlaywrightTimeout = sync_playwright = None


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--disable-gpu", "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]  # fmt: skip
VIEWPORT = {"width": 1280, "height": 900}
REPO = Path(__file__).parents[2]
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 3}
BIASED = 17  # "." in the tiny tokenizer: a logit bias lifts it over the raw favourites
REPETITIVE = "Hello world! Hello tokenizers, hello templates. " * 3

# --- what the page shows, read from its DOM -------------------------------------------------------------------------

# The page has settled: no action running, a token selected and the detail of that very token drawn (a detail
# fetched for another step is never drawn).
SETTLED = """() => {
  const gen = document.querySelector("[data-testid=generate]");
  const sel = document.querySelector("[data-testid=token].selected");
  const det = document.querySelector("[data-testid=node-detail]");
  return gen !== null && !gen.disabled && sel !== null && det !== null && det.dataset.node === sel.dataset.node;
}"""
TOKENS = """els => els.map(e => ({id: Number(e.dataset.tokenId), p: e.dataset.p, node: e.dataset.node,
  branch: e.dataset.branch, classes: [...e.classList], how: e.title.split("\\n").pop()}))"""
STAGES = """els => els.map(s => ({name: s.dataset.stage, candidates: [...s.querySelectorAll("[data-testid=candidate]")]
  .map(c => ({id: Number(c.dataset.tokenId), p: c.dataset.p, kept: c.dataset.kept, stage: c.dataset.stage,
              text: c.textContent, selected: c.classList.contains("selected")}))}))"""
# Stage names and each candidate's kept flag, in the DOM: compared with a reshape answer to know it is drawn.
DRAWN = """want => JSON.stringify([...document.querySelectorAll("[data-testid=stage]")].map(s => [s.dataset.stage,
  [...s.querySelectorAll("[data-testid=candidate]")].map(c => [Number(c.dataset.tokenId), c.dataset.kept === "true"])
  .sort((a, b) => a[0] - b[0])])) === want"""
KV_ROW = """els => els.map(e => [Number(e.dataset.block), e.dataset.ref])"""

ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_token(text: str) -> str:
    """The page's escapeToken: JSON-style escapes without the quotes."""
    return re.sub(r"[\\\x00-\x1f\x7f]", lambda m: ESCAPES.get(m[0], f"\\u{ord(m[0]):04x}"), text)


def percent(p: float) -> str:
    """JavaScript's (p * 100).toFixed(1) + "%": the same double, rounded half up from its exact decimal value."""
    return f"{Decimal(p * 100).quantize(Decimal('0.1'), rounding=ROUND_HALF_UP)}%"


def node_url(tree: dict, node: str, action: str = "") -> str:
    """The API's address of a node the page names "<branch>:<position>": .../nodes/<branch>/<position>."""
    branch, position = node.split(":")
    return f"/explore/api/trees/{tree['id']}/nodes/{branch}/{position}{action}"


class Watch:
    """Everything the page logged as an error, threw, requested and was answered with. A test that provokes a 4xx
    on purpose says so (`provoked`): that answer, and Chrome's "Failed to load resource" for it, are tolerated once."""

    def __init__(self, page, origin: str) -> None:
        self.origin = origin
        self.console: list[tuple[str, str]] = []  # (text, url of the resource or script)
        self.page_errors: list[str] = []
        self.requests: list[str] = []
        self.failed: list[tuple[int, str]] = []  # (status, url) of answers >= 400
        self.provoked: list[tuple[int, str]] = []
        page.on("console", lambda m: m.type == "error" and self.console.append((m.text, m.location.get("url", ""))))
        page.on("pageerror", lambda e: self.page_errors.append(str(e)))
        page.on("request", lambda r: self.requests.append(r.url))
        page.on("response", lambda r: r.status >= 400 and self.failed.append((r.status, r.url)))

    def unexpected(self) -> list[str]:
        out = [f"page error: {e}" for e in self.page_errors]
        logged, answered = Counter(url for _, url in self.provoked), Counter(self.provoked)
        for text, url in self.console:
            if text.startswith("Failed to load resource: the server responded with a status of 4") and logged[url]:
                logged[url] -= 1
            else:
                out.append(f"console error: {text} ({url})")
        out += [f"answered {status}: {url}" for status, url in (Counter(self.failed) - answered).elements()]
        out += [f"request off the origin: {url}" for url in self.requests if not url.startswith(self.origin + "/")]
        return out


class Page:
    """The explorer page of one server, with the actions the tests take through its controls."""

    def __init__(self, page, server) -> None:
        self.page = page
        self.server = server
        self.watch = Watch(page, server.url)
        self.live: dict[str, float] = {}  # what show_reshaped typed into the live controls
        page.goto(f"{server.url}/explore")
        page.get_by_test_id("prompt").wait_for()

    def settle(self) -> None:
        self.page.wait_for_function(SETTLED)

    def fill(self, **fields: str) -> None:
        """Inputs by test id (underscores for dashes: max_tokens → max-tokens)."""
        for name, value in fields.items():
            self.page.get_by_test_id(name.replace("_", "-")).fill(value)

    def generate(self, prompt: str, **fields: str) -> dict:
        """Generate through the form; the tree the page got back."""
        self.fill(prompt=prompt, **fields)
        with self.page.expect_response(lambda r: r.url == f"{self.server.url}/explore/api/trees" and
                                       r.request.method == "POST") as answer:  # fmt: skip
            self.page.get_by_test_id("generate").click()
        tree = answer.value.json()
        self.settle()
        return tree

    def tokens(self) -> list[dict]:
        return self.page.locator("[data-testid=token]").evaluate_all(TOKENS)

    def token_ids(self) -> list[int]:
        return [t["id"] for t in self.tokens()]

    def stages(self) -> list[dict]:
        return self.page.locator("[data-testid=stage]").evaluate_all(STAGES)

    def selected_node(self) -> str:
        return self.page.get_by_test_id("node-detail").get_attribute("data-node")

    def select(self, index: int) -> str:
        """Click the index-th shown token; its node id once its detail is drawn."""
        token = self.page.locator("[data-testid=token]").nth(index)
        token.click()
        node = token.get_attribute("data-node")
        self.page.wait_for_function(
            "n => document.querySelector('[data-testid=node-detail]')?.dataset.node === n", arg=node
        )
        self.settle()
        return node

    def branch_with(self, token_id: int) -> dict:
        """Click the candidate in the last stage column, then the branch button; the tree the page got back."""
        self.page.locator(f"[data-testid=stage]:last-child [data-testid=candidate][data-token-id='{token_id}']").click()
        button = self.page.get_by_test_id("branch")
        assert button.text_content().startswith("continue from here with")
        with self.page.expect_response(lambda r: r.url.endswith("/branch") and r.request.method == "POST") as answer:
            button.click()
        tree = answer.value.json()
        self.settle()
        return tree

    def kv_row(self, branch: str) -> list[tuple[int, str]]:
        """(block id, data-ref) of each block in the KV panel's row of the branch, once the row is drawn."""
        row = self.page.locator(f"[data-testid=kv-panel] .kv-row[data-branch-id='{branch}']")
        row.wait_for()
        return [tuple(x) for x in row.locator("[data-block]").evaluate_all(KV_ROW)]

    def show_reshaped(self, http, tree: dict, node: str, **live: str) -> None:
        """Type into the live controls; wait until the columns draw what the API's reshape answers for them."""
        for name, value in live.items():
            self.page.get_by_test_id(f"live-{name.replace('_', '-')}").fill(value)
            self.live[name] = float(value) if name != "top_k" else int(value)
        params = tree["params"] | self.live  # the live fields keep what was typed before
        r = http.post(node_url(tree, node, "/reshape"), json={"params": params})
        assert r.status_code == 200, r.text
        answer = r.json()
        ids = [c["token_id"] for c in answer["candidates"]]
        want = [[s["name"], sorted([t, k] for t, k in zip(ids, s["kept"]))] for s in answer["stages"]]
        try:
            self.page.wait_for_function(DRAWN, arg=json.dumps(want, separators=(",", ":")), timeout=10_000)
        except PlaywrightTimeout:
            pass  # the page draws something else: the test's own comparison says what

    def screenshot(self, folder: Path, name: str) -> Path:
        path = folder / f"{name}.png"
        self.page.screenshot(path=str(path))
        print(f"screenshot: {path}")
        return path
