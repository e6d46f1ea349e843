"""The explorer page in a real browser (Playwright driving Debian's chromium) against `tokenloop serve` on the tiny
model: what the page shows is what the engine did. Its tokens are the completions API's greedy tokens, its
probabilities the API's, each live control keeps the set computed here from the raw logits, the grammar's count is
llguidance's, branches share their prefix's KV blocks, speculative marks add up to the engine's counters, an
export imports back to the same tokens, and the keyboard drives it. Nothing leaves the origin and nothing logs an
error. Each test saves a screenshot under its tmp_path (the path is printed)."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.explorer.page_driver import (
    BIASED,
    REPETITIVE,
    REPO,
    VIEWPORT,
    Page,
    escape_token,
    node_url,
    percent,
)
from tests.server.conftest import MODEL_NAME, start_server, stop_server


def test_the_page_loads_with_no_errors_and_requests_nothing_off_its_origin(page, http, tmp_path):
    assert page.page.title() == "tokenloop explorer"
    # A 400 on purpose: the server's message lands in the error line, and Chrome's "Failed to load resource" for
    # this one URL is the only console error tolerated.
    page.fill(regex="(")
    page.page.get_by_test_id("prompt").fill("Hello")
    with page.page.expect_response(lambda r: r.request.method == "POST") as answer:
        page.page.get_by_test_id("generate").click()
    assert answer.value.status == 400
    page.watch.provoked.append((400, answer.value.url))
    error = page.page.get_by_test_id("error")
    error.wait_for()
    assert error.text_content() == answer.value.json()["error"]["message"]
    assert error.text_content().startswith("structured_outputs.regex")
    page.fill(regex="")
    tree = page.generate("Hello world!", temperature="0", max_tokens="4")
    assert page.token_ids() == tree["branches"][0]["token_ids"] and page.page.get_by_test_id("error").is_hidden()
    page.kv_row("b0")
    page.screenshot(tmp_path, "loaded")
    assert page.watch.unexpected() == []
    assert [text for text, _ in page.watch.console] == [
        "Failed to load resource: the server responded with a status of 400 (Bad Request)"
    ]
    assert page.watch.page_errors == [] and page.watch.failed == [(400, answer.value.url)]
    assert f"{page.server.url}/explore/static/app.js" in page.watch.requests
    assert all(url.startswith(f"{page.server.url}/explore") for url in page.watch.requests)


def test_greedy_steps_are_the_completions_apis_greedy_tokens(page, http, tmp_path):
    prompt = "Hello world! Hello tokenizers"
    page.generate(prompt, temperature="0", max_tokens="12")
    shown = page.tokens()
    ids = [t["id"] for t in shown]
    prompt_ids = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": prompt}).json()["tokens"]
    assert page.page.locator("[data-testid=tokens] .ptok").count() == len(prompt_ids)
    # The same request through the explore API (ids) and the completions API (text, and each token's logprob).
    tree = http.post(
        "/explore/api/trees", json={"prompt": prompt, "params": {"temperature": 0}, "max_tokens": 12}
    ).json()
    assert tree["prompt_token_ids"] == prompt_ids
    assert ids == tree["branches"][0]["token_ids"] and len(ids) == 12
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1}
    completion = http.post("/v1/completions", json=body).json()["choices"][0]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == completion["text"]
    logprobs = completion["logprobs"]["token_logprobs"]
    assert len(logprobs) == 12
    for token, logprob in zip(shown, logprobs):  # greedy, nothing shapes it: the final p is the raw one
        assert abs(float(token["p"]) - math.exp(logprob)) <= 1e-5, (token, logprob)
    assert [t["how"] for t in shown] == ["argmax"] * 12
    page.screenshot(tmp_path, "greedy")


def test_shown_probabilities_are_the_apis_and_sorted(page, http, tmp_path):
    # A logit bias reorders the candidates (the page sorts each column by its own p); top-k greys some out.
    tree = page.generate(
        "Hello world! Hello", temperature="0.7", top_k="5", seed="3", max_tokens="6", logit_bias=f"{BIASED}:8"
    )
    node = page.select(2)
    assert node == f"b0:{len(tree['prompt_token_ids']) + 2}"
    detail = http.get(node_url(tree, node)).json()
    columns = page.stages()
    assert [c["name"] for c in columns] == [s["name"] for s in detail["stages"]]
    assert [c["name"] for c in columns] == ["raw", "logit_bias", "temperature", "top_k", "final"]
    index = {c["token_id"]: i for i, c in enumerate(detail["candidates"])}
    for column, stage in zip(columns, detail["stages"]):
        shown = column["candidates"]
        assert sorted(c["id"] for c in shown) == sorted(index)
        for c in shown:
            i = index[c["id"]]
            p = float(c["p"])
            assert abs(p - stage["p"][i]) <= 1e-5, (stage["name"], c)
            assert c["kept"] == ("true" if stage["kept"][i] else "false") and c["stage"] == stage["name"]
            assert c["text"] == f"{escape_token(detail['candidates'][i]['text'])} {percent(p)}", c
        kept = [float(c["p"]) for c in shown if c["kept"] == "true"]
        assert kept == sorted(kept, reverse=True) and len(kept) == sum(stage["kept"])
    order = [c["id"] for c in columns[1]["candidates"]]
    assert order[0] == BIASED and order != [c["token_id"] for c in detail["candidates"]]  # the sort did something
    top_k = columns[3]["candidates"]
    assert sum(c["kept"] == "true" for c in top_k) == 5 and all(float(c["p"]) == 0 for c in top_k[5:])
    page.screenshot(tmp_path, "probabilities")


def _top_k(logits: dict[int, float], k: int) -> set[int]:
    return set(sorted(logits, key=lambda t: (-logits[t], t))[:k])


def _min_p(logits: dict[int, float], min_p: float, temperature: float) -> set[int]:
    # p_i / p_max at a temperature is exp((logit_i - logit_max) / T): no normalisation needed.
    top = max(logits.values())
    return {t for t, x in logits.items() if math.exp((x - top) / temperature) >= min_p}


def _top_p(logits: dict[int, float], logsumexp: float, top_p: float) -> set[int]:
    """At temperature 1: sorted descending, a token is kept while the mass before it is below top_p (exact for the
    raw top-N: every more likely token is among them)."""
    kept, before = set(), 0.0
    for t in sorted(logits, key=lambda t: (-logits[t], t)):
        if before < top_p or not kept:
            kept.add(t)
        before += math.exp(logits[t] - logsumexp)
    return kept


def test_each_live_control_keeps_exactly_the_set_computed_from_the_raw_stage(page, http, tmp_path):
    tree = page.generate("Hello world! Hello", temperature="1", seed="5", max_tokens="4")
    node = page.selected_node()
    detail = http.get(node_url(tree, node)).json()
    raw = detail["stages"][0]
    assert raw["name"] == "raw"
    logits = {c["token_id"]: raw["logit"][i] for i, c in enumerate(detail["candidates"])}

    def kept_in(stage: str) -> set[int]:
        (column,) = [c for c in page.stages() if c["name"] == stage]
        return {c["id"] for c in column["candidates"] if c["kept"] == "true"}

    page.show_reshaped(http, tree, node, top_k="3")
    assert page.page.locator(".live-note").is_visible()
    assert kept_in("top_k") == _top_k(logits, 3)

    page.show_reshaped(http, tree, node, top_k="-1", min_p="0.1")
    at_1 = _min_p(logits, 0.1, 1.0)
    assert kept_in("min_p") == at_1
    page.show_reshaped(http, tree, node, temperature="0.5")
    at_half = _min_p(logits, 0.1, 0.5)
    assert kept_in("min_p") == at_half and at_half != at_1  # the temperature moved the cut
    (column,) = [c for c in page.stages() if c["name"] == "temperature"]
    best = max(logits, key=logits.get)
    p_best = float(next(c["p"] for c in column["candidates"] if c["id"] == best))
    for c in column["candidates"]:  # p_i / p_best = exp((logit_i - logit_best) / T)
        assert abs(float(c["p"]) / p_best - math.exp((logits[c["id"]] - logits[best]) / 0.5)) <= 1e-5
    page.screenshot(tmp_path, "live_min_p")

    page.show_reshaped(http, tree, node, temperature="1", min_p="0", top_p="0.6")
    expected = _top_p(logits, raw["logsumexp"], 0.6)
    assert kept_in("top_p") == expected and 1 < len(expected) < len(logits)
    page.page.get_by_test_id("reset").click()
    page.live.clear()
    page.page.wait_for_function("() => document.querySelector('.live-note') === null")
    assert [c["name"] for c in page.stages()] == [s["name"] for s in detail["stages"]]


def test_the_grammars_allowed_count_is_llguidances_mask(page, http, tiny_model_folder, tmp_path):
    from tokenloop.models.loader import load_config, load_tokenizer
    from tokenloop.sampling.structured import GrammarCompiler, StructuredOutputsParams

    tree = page.generate("Hello", temperature="0", regex="[0-9]+", max_tokens="3")
    tokenizer = load_tokenizer(tiny_model_folder)
    compiler = GrammarCompiler(
        tokenizer.backend.to_str(), load_config(tiny_model_folder).vocab_size, tokenizer.eos_token_ids
    )
    matcher = compiler.matcher(StructuredOutputsParams(regex="[0-9]+"))
    generated = tree["branches"][0]["token_ids"]
    for i in range(2):  # the first token (nothing consumed yet), then the second (after the first)
        if i:
            page.select(i)
        matcher.sync(generated[:i])
        mask = matcher.allowed()
        line = page.page.get_by_test_id("grammar").text_content()
        allowed = int(re.fullmatch(r"grammar: allowed (\d+) tokens, removed mass [0-9.]+%", line)[1])
        assert allowed == int(mask.sum()), (i, line)
        (column,) = [c for c in page.stages() if c["name"] == "grammar"]
        assert {c["id"] for c in column["candidates"] if c["kept"] == "true"} == {
            c["id"] for c in column["candidates"] if mask[c["id"]]
        }
    assert (
        page.page.get_by_test_id("node-detail")
        .get_attribute("data-node")
        .endswith(f":{len(tree['prompt_token_ids']) + 1}")
    )
    page.screenshot(tmp_path, "grammar")


def _second_candidate(page: Page) -> int:
    """The second candidate of the last stage column, as drawn."""
    return page.stages()[-1]["candidates"][1]["id"]


def test_a_branch_shares_its_prefix_blocks_and_diverges_in_its_own(page, http, tmp_path):
    tree = page.generate("Hello world! Hello", temperature="0", max_tokens="30")
    bs = tree["block_size"]
    start = len(tree["prompt_token_ids"])
    index = 20 - start  # the token at position 20: inside the second block
    node = page.select(index)
    assert node == "b0:20"
    other = _second_candidate(page)
    after = page.branch_with(other)
    (b1,) = [b for b in after["branches"] if b["id"] == "b1"]
    assert (b1["parent"], b1["start"], b1["token_ids"][0]) == ("b0", 20, other)
    page.page.locator("[data-testid=kv-panel] .kv-row[data-branch-id='b1']").wait_for()
    b0_row, b1_row = page.kv_row("b0"), page.kv_row("b1")
    split = 20 // bs
    assert split == 1
    assert b1_row[:split] == b0_row[:split] and all(ref == "2" for _, ref in b1_row[:split])
    assert b1_row[split][0] != b0_row[split][0] and b1_row[split][1] == "1" and b0_row[split][1] == "1"
    kv = http.get(f"/explore/api/trees/{tree['id']}/kv").json()
    assert [b for b, _ in b0_row] == kv["branches"]["b0"]["blocks"]
    assert [b for b, _ in b1_row] == kv["branches"]["b1"]["blocks"]
    assert kv["cow"] == [{"branch": "b1", "index": split, "parent_block": b0_row[split][0], "block": b1_row[split][0]}]
    cow = page.page.locator(f"[data-testid=kv-panel] .kv-row[data-branch-id='b1'] [data-block='{b1_row[split][0]}']")
    assert "cow" in cow.get_attribute("class").split()
    page.screenshot(tmp_path, "kv_branch")


def test_speculative_marks_add_up_to_the_engines_counts(open_page, spec_server, spec_http, http, tmp_path):
    page = open_page(spec_server)
    before = spec_server.metrics()
    tree = page.generate(REPETITIVE, temperature="0", max_tokens="24")
    after = spec_server.metrics()
    api = spec_http.get(f"/explore/api/trees/{tree['id']}").json()
    delta = {
        name: after[f"tokenloop_spec_decode_num_{name}_total"] - before[f"tokenloop_spec_decode_num_{name}_total"]
        for name in ("drafts", "draft_tokens", "accepted_tokens")
    }
    (b0,) = api["branches"]
    shown = page.tokens()
    assert [t["id"] for t in shown] == b0["token_ids"]
    plain = http.post("/explore/api/trees", json={"prompt": REPETITIVE, "params": {"temperature": 0}, "max_tokens": 24})
    assert plain.json()["branches"][0]["token_ids"] == b0["token_ids"]  # drafts never change a greedy token
    # Each token's mark is its `how`; a speculative step's first token carries the spec-start mark.
    assert [t["how"] for t in shown] == b0["how"]
    marks = {"accepted": "how-accepted", "recovery": "how-recovery", "bonus": "how-bonus"}
    for token, how in zip(shown, b0["how"]):
        assert {c for c in token["classes"] if c.startswith("how-")} == ({marks[how]} if how in marks else set())
    steps = [s for s in b0["spec"] if s is not None]
    starts = [i for i, t in enumerate(shown) if "spec-start" in t["classes"]]
    assert starts == [i for i, s in enumerate(b0["spec"]) if s is not None] and steps
    # The engine's counters for this one request: drafts, draft tokens, accepted tokens.
    assert delta == {
        "drafts": len(steps),
        "draft_tokens": sum(len(s["drafted"]) for s in steps),
        "accepted_tokens": sum(s["accepted"] for s in steps),
    }
    assert sum(t["how"] == "accepted" for t in shown) == delta["accepted_tokens"] > 0
    for kind in ("recovery", "bonus"):
        assert sum(t["how"] == kind for t in shown) == sum(s["final_kind"] == kind for s in steps)
    # The detail of the step with the most accepted draft tokens.
    i = max(starts, key=lambda i: b0["spec"][i]["accepted"])
    step = b0["spec"][i]
    page.select(i)
    spec = page.page.get_by_test_id("spec")
    assert (
        spec.text_content()
        .strip()
        .endswith(f"→ {step['accepted']} accepted, then a {step['final_kind']} token (id {step['final']})")
    )
    assert [int(x) for x in spec.locator("[data-token-id]").evaluate_all("e => e.map(x => x.dataset.tokenId)")] == (
        step["drafted"]
    )
    assert spec.locator(".draft.accepted").count() == step["accepted"]
    legend = page.page.locator(".marks .mark").all_text_contents()
    assert "speculative step" in legend and "accepted draft" in legend
    page.screenshot(tmp_path, "speculative")
    assert page.watch.unexpected() == []


def test_export_then_import_shows_the_same_tokens(page, http, tmp_path):
    tree = page.generate("Hello world! Hello", temperature="1", seed="11", max_tokens="8")
    page.select(2)
    page.branch_with(_second_candidate(page))
    original = http.get(f"/explore/api/trees/{tree['id']}").json()
    assert [b["id"] for b in original["branches"]] == ["b0", "b1"]
    page.page.locator("[data-testid=tree-branch][data-branch-id='b0']").click()
    page.settle()
    b0_shown = page.token_ids()
    with page.page.expect_download() as download:
        page.page.get_by_test_id("export").click()
    assert download.value.suggested_filename == f"tokenloop-{tree['id']}.json"
    path = tmp_path / download.value.suggested_filename
    download.value.save_as(path)
    exported = json.loads(path.read_text())
    assert [b["token_ids"] for b in exported["tree"]["branches"]] == [b["token_ids"] for b in original["branches"]]

    with page.page.expect_response(lambda r: r.url.endswith("/explore/api/import")) as answer:
        page.page.get_by_test_id("import").set_input_files(path)
    imported = answer.value.json()
    assert imported["id"] != tree["id"]
    notice = page.page.get_by_test_id("notice")
    page.page.wait_for_function(
        "t => document.querySelector('[data-testid=notice]').textContent.endsWith(' as ' + t)", arg=imported["id"]
    )
    assert notice.text_content() == f"imported {path.name} as {imported['id']}"
    page.settle()
    assert page.token_ids() == b0_shown == original["branches"][0]["token_ids"]
    again = http.get(f"/explore/api/trees/{imported['id']}").json()
    assert [(b["id"], b["parent"], b["start"], b["token_ids"]) for b in again["branches"]] == [
        (b["id"], b["parent"], b["start"], b["token_ids"]) for b in original["branches"]
    ]
    page.page.locator("[data-testid=tree-branch][data-branch-id='b1']").click()
    page.settle()
    b1 = original["branches"][1]
    assert (
        page.token_ids()
        == original["branches"][0]["token_ids"][: b1["start"] - len(tree["prompt_token_ids"])] + (b1["token_ids"])
    )
    page.screenshot(tmp_path, "imported")


def test_the_keyboard_moves_branches_and_steps(page, http, tmp_path):
    tree = page.generate("Hello world! Hello", temperature="0", max_tokens="6")
    start = len(tree["prompt_token_ids"])
    page.page.locator("h1").click()  # the keys act unless a field has the focus
    assert page.selected_node() == f"b0:{start}"
    for key, position in (("ArrowRight", start + 1), ("ArrowRight", start + 2), ("ArrowLeft", start + 1)):
        page.page.keyboard.press(key)
        page.page.wait_for_function(
            "n => document.querySelector('[data-testid=node-detail]')?.dataset.node === n", arg=f"b0:{position}"
        )
    final = page.stages()[-1]["candidates"]
    assert final[0]["selected"] and final[0]["id"] == tree["branches"][0]["token_ids"][1]  # greedy: the top one
    page.page.keyboard.press("ArrowDown")
    page.page.wait_for_function(
        "() => document.querySelector('[data-testid=stage]:last-child .cand.selected')?.dataset.tokenId === "
        f"'{final[1]['id']}'"
    )
    with page.page.expect_response(lambda r: r.url.endswith("/branch")):
        page.page.keyboard.press("Enter")
    page.settle()
    branches = http.get(f"/explore/api/trees/{tree['id']}").json()["branches"]
    assert [(b["id"], b["parent"], b["start"], b["token_ids"][0]) for b in branches[1:]] == [
        ("b1", "b0", start + 1, final[1]["id"])
    ]
    length = len(branches[1]["token_ids"])
    assert page.selected_node() == f"b1:{start + 1}" and len(page.tokens()) == 1 + length
    with page.page.expect_response(lambda r: r.url.endswith("/branches/b1/continue")):
        page.page.keyboard.press("s")
    page.settle()
    grown = http.get(f"/explore/api/trees/{tree['id']}").json()["branches"][1]
    assert len(grown["token_ids"]) == length + 1 and grown["token_ids"][:length] == branches[1]["token_ids"]
    assert page.token_ids() == tree["branches"][0]["token_ids"][:1] + grown["token_ids"]
    assert page.selected_node() == f"b1:{start + length + 1}"  # the new last token
    page.screenshot(tmp_path, "keyboard")


def test_branching_from_a_clicked_candidate_then_deleting_it_frees_its_blocks(page, http, tmp_path):
    tree = page.generate("Hello world! Hello", temperature="0", max_tokens="24")
    start = len(tree["prompt_token_ids"])
    page.select(3)
    other = _second_candidate(page)
    assert other != tree["branches"][0]["token_ids"][3]
    page.page.locator(f"[data-testid=stage]:last-child [data-testid=candidate][data-token-id='{other}']").click()
    text = next(c["text"] for c in page.stages()[-1]["candidates"] if c["id"] == other).rsplit(" ", 1)[0]
    assert page.page.get_by_test_id("branch").locator("code").text_content() == text  # the candidate's own text
    after = page.branch_with(other)
    (b1,) = after["branches"][1:]
    assert (b1["id"], b1["parent"], b1["start"], b1["token_ids"][0], b1["how"][0]) == (
        "b1", "b0", start + 3, other, "forced"
    )  # fmt: skip
    selected = page.page.locator("[data-testid=token].selected")
    assert (selected.get_attribute("data-branch"), selected.get_attribute("data-token-id")) == ("b1", str(other))
    assert page.token_ids() == tree["branches"][0]["token_ids"][:3] + b1["token_ids"]

    row = page.kv_row("b1")
    kv = http.get(f"/explore/api/trees/{tree['id']}/kv").json()
    would_free = kv["would_free"]["b1"]
    assert would_free == sum(ref == "1" for _, ref in row) > 0  # the blocks only b1 holds
    pool = page.page.get_by_test_id("kv-pool")
    assert pool.text_content().startswith(f"pool: {kv['num_free_blocks']} of {kv['num_blocks']} blocks free")
    delete = page.page.get_by_test_id("delete-branch")
    assert delete.text_content().strip() == f"delete b1 (frees {would_free} blocks)"
    delete.click()
    free = kv["num_free_blocks"] + would_free
    notice = page.page.get_by_test_id("notice")
    notice.wait_for()
    assert notice.text_content() == f"deleted b1 and its descendants: freed {would_free} blocks, {free} free"
    page.page.wait_for_function(
        "t => document.querySelector('[data-testid=kv-pool]').textContent.startsWith(t)", arg=f"pool: {free} of "
    )
    assert [b["id"] for b in http.get(f"/explore/api/trees/{tree['id']}").json()["branches"]] == ["b0"]
    assert http.get(f"/explore/api/trees/{tree['id']}/kv").json()["num_free_blocks"] == free
    assert page.page.locator("[data-testid=kv-panel] .kv-row[data-branch-id='b1']").count() == 0
    page.screenshot(tmp_path, "deleted")


@pytest.mark.slow
def test_docs_screenshot_on_the_default_model(browser, default_model_path, tmp_path):
    """docs/images/explorer.png: the default model, one branch from the second token's second candidate."""
    s = start_server(default_model_path, tmp_path / "server.log", "--kv-cache-gb", "0.2")
    context = browser.new_context(viewport=VIEWPORT)
    try:
        context.set_default_timeout(120_000)
        page = Page(context.new_page(), s)
        tree = page.generate("The capital of France is", temperature="0.8", top_k="40", seed="7", max_tokens="12")
        assert len(tree["branches"][0]["token_ids"]) == 12
        page.select(1)
        other = _second_candidate(page)
        after = page.branch_with(other)
        assert after["branches"][1]["token_ids"][0] == other
        page.kv_row("b1")
        path = REPO / "docs" / "images" / "explorer.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        page.page.screenshot(path=str(path))
        print(f"screenshot: {path}")
        assert page.watch.unexpected() == []
    finally:
        context.close()
        stop_server(s)
