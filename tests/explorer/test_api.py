"""The explore API on the tiny model's server: stages in the engine's order that reproduce the engine's choices,
branches sharing their prefix's KV blocks, deletes returning blocks to the pool, export and import replaying the
same tokens, and the security headers."""

from __future__ import annotations

import math

import torch

from tests.server.conftest import MODEL_NAME
from tokenloop.sampling.sampler import apply_top_k_top_p

PROMPT = [0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # 19 tokens: one block and 3


def new_tree(http, **body) -> dict:
    r = http.post("/explore/api/trees", json={"prompt": PROMPT, "max_tokens": 12, "top_n": 8} | body)
    assert r.status_code == 200, r.text
    return r.json()


def node(http, tree: dict, node_id: str) -> dict:
    r = http.get(f"/explore/api/trees/{tree['id']}/nodes/{node_id.replace(':', '/')}")
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_steps_are_the_completions_apis_greedy_tokens_and_each_stage_comes_in_the_engines_order(http):
    tree = new_tree(
        http, params={"temperature": 0, "logit_bias": {"7": 3.0}, "repetition_penalty": 1.2, "bad_words": ["x"]}
    )
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logit_bias": {"7": 3.0}, "repetition_penalty": 1.2}
    completion = http.post("/v1/completions", json={"model": MODEL_NAME} | body | {"bad_words": ["x"]}).json()
    (b0,) = tree["branches"]
    shown = http.post("/detokenize", json={"tokens": b0["token_ids"]}).json()["prompt"]
    assert shown == completion["choices"][0]["text"] and len(b0["token_ids"]) == 12
    detail = node(http, tree, f"b0:{len(PROMPT) + 3}")
    names = [s["name"] for s in detail["stages"]]
    assert names[0] == "raw" and names[-1] == "final" and names.index("logit_bias") < names.index("penalties")
    assert detail["how"] == "argmax" and detail["seed"] is None
    final = detail["stages"][-1]
    best = max(range(len(final["p"])), key=lambda i: final["p"][i])
    assert detail["candidates"][best]["token_id"] == detail["token_id"]
    for stage in detail["stages"]:
        kept = [p for p, k in zip(stage["p"], stage["kept"]) if k]
        assert all(p == 0 for p, k in zip(stage["p"], stage["kept"]) if not k)
        assert sum(kept) <= 1 + 1e-6 and stage["num_kept"] >= len(kept)


def test_a_seeded_draw_is_found_again_from_the_seed_and_its_key_is_the_largest(http):
    tree = new_tree(http, params={"temperature": 0.9, "top_k": 50, "top_p": 0.9, "min_p": 0.01})
    b0 = tree["branches"][0]
    for i in range(len(b0["token_ids"])):
        detail = node(http, tree, f"b0:{len(PROMPT) + i}")
        assert detail["how"] == "draw" and detail["seed"] == tree["seed"] and detail["q"] > 0
        final = detail["stages"][-1]
        chosen = next(j for j, c in enumerate(detail["candidates"]) if c["token_id"] == detail["token_id"])
        assert math.isclose(detail["key"], final["p"][chosen] / detail["q"], rel_tol=1e-5)
        assert [s["name"] for s in detail["stages"]] == ["raw", "temperature", "min_p", "top_k", "top_p", "final"]


def test_the_live_controls_keep_exactly_the_set_computed_from_the_raw_stage(http):
    tree = new_tree(http, params={"temperature": 1.0})
    node_id = f"b0:{len(PROMPT) + 2}"
    raw = node(http, tree, node_id)["stages"][0]
    r = http.post(
        f"/explore/api/trees/{tree['id']}/nodes/{node_id.replace(':', '/')}/reshape",
        json={"params": {"temperature": 1.0, "top_k": 3}},
    )
    assert r.status_code == 200, r.text
    shaped = r.json()
    top_k = next(s for s in shaped["stages"] if s["name"] == "top_k")
    logits = {c["token_id"]: raw["logit"][i] for i, c in enumerate(node(http, tree, node_id)["candidates"])}
    expected = set(sorted(logits, key=lambda t: (-logits[t], t))[:3])
    assert {c["token_id"] for c, k in zip(shaped["candidates"], top_k["kept"]) if k} == expected
    # The same over the candidates' logits with the sampler's own function.
    ids = [c["token_id"] for c in shaped["candidates"]]
    row = torch.tensor([[shaped["stages"][0]["logit"][i] for i in range(len(ids))]])
    kept = torch.isfinite(apply_top_k_top_p(row, torch.tensor([3]), None))[0].tolist()
    assert {t for t, k in zip(ids, kept) if k} == expected


def test_a_branch_shares_the_blocks_before_it_and_copies_the_one_it_diverges_in(http):
    tree = new_tree(http, params={"temperature": 0}, max_tokens=20)
    bs = tree["block_size"]
    position = len(PROMPT) + 5  # inside the second block
    detail = node(http, tree, f"b0:{position}")
    other = next(c["token_id"] for c in detail["candidates"] if c["token_id"] != detail["token_id"])
    r = http.post(
        f"/explore/api/trees/{tree['id']}/nodes/b0/{position}/branch", json={"token_id": other, "max_tokens": 4}
    )
    assert r.status_code == 200, r.text
    b1 = r.json()["branches"][1]
    assert b1["parent"] == "b0" and b1["start"] == position and b1["token_ids"][0] == other and b1["how"][0] == "forced"
    kv = http.get(f"/explore/api/trees/{tree['id']}/kv").json()
    b0_blocks, b1_blocks = kv["branches"]["b0"]["blocks"], kv["branches"]["b1"]["blocks"]
    index = position // bs
    assert node(http, tree, f"b1:{position}")["kv"] == {"branch": "b1", "blocks": b1_blocks[: index + 1]}
    assert b1_blocks[:index] == b0_blocks[:index]
    assert all(kv["blocks"][str(b)]["ref_count"] == 2 for b in b0_blocks[:index])
    assert kv["cow"] == [{"branch": "b1", "index": index, "parent_block": b0_blocks[index], "block": b1_blocks[index]}]
    free_before = kv["num_free_blocks"]
    r = http.delete(f"/explore/api/trees/{tree['id']}/branches/b1")
    assert r.json() == {"freed_blocks": kv["would_free"]["b1"], "num_free_blocks": free_before + kv["would_free"]["b1"]}
    r = http.delete(f"/explore/api/trees/{tree['id']}")
    assert r.status_code == 200 and http.get(f"/explore/api/trees/{tree['id']}").status_code == 404


def test_export_then_import_replays_the_same_tokens(http):
    tree = new_tree(http, params={"temperature": 1.0, "top_p": 0.95})
    tid = tree["id"]
    http.post(f"/explore/api/trees/{tid}/branches/b0/continue", json={"max_tokens": 3})
    http.post(f"/explore/api/trees/{tid}/nodes/b0/{len(PROMPT) + 1}/branch", json={"token_id": 33, "max_tokens": 5})
    http.post(f"/explore/api/trees/{tid}/nodes/b0/{len(PROMPT) + 4}/sample", json={"n": 3, "max_tokens": 4})
    exported = http.get(f"/explore/api/trees/{tid}/export")
    assert exported.headers["content-disposition"].startswith("attachment")
    r = http.post("/explore/api/import", json=exported.json())
    assert r.status_code == 200, r.text
    again = r.json()
    assert again["id"] != tid
    assert [b["token_ids"] for b in again["branches"]] == [b["token_ids"] for b in exported.json()["tree"]["branches"]]
    assert [b["start"] for b in again["branches"]] == [b["start"] for b in exported.json()["tree"]["branches"]]


def test_deleting_a_tree_returns_its_blocks_to_the_pool(http):
    free = http.get("/explore/api/trees").status_code
    assert free == 200
    tree = new_tree(http, max_tokens=30)
    kv = http.get(f"/explore/api/trees/{tree['id']}/kv").json()
    held = len({b for t in kv["branches"].values() for b in t["blocks"]})
    r = http.delete(f"/explore/api/trees/{tree['id']}").json()
    assert held > 0 and r["freed_blocks"] == held and r["num_free_blocks"] == kv["num_free_blocks"] + held


def test_unknown_trees_and_nodes_are_404s_and_bad_settings_400s_in_the_error_shape(http):
    assert http.get("/explore/api/trees/t999").json()["error"]["code"] == 404
    tree = new_tree(http)
    assert http.get(f"/explore/api/trees/{tree['id']}/nodes/b0/0").status_code == 404  # a prompt position
    r = http.post("/explore/api/trees", json={"prompt": PROMPT, "params": {"json_schema": {}, "regex": "a"}})
    assert r.status_code == 400 and "json_schema" in r.json()["error"]["message"]
    r = http.post(f"/explore/api/trees/{tree['id']}/nodes/b0/{len(PROMPT)}/branch", json={"token_id": 10**6})
    assert r.status_code == 400


def test_every_explore_response_carries_the_content_security_policy(http):
    for path in ("/explore", "/explore/api/trees", "/explore/static/app.js"):
        r = http.get(path)
        assert r.status_code == 200 and r.headers["content-security-policy"] == "default-src 'self'", path
    assert http.get("/explore/static/app.js").headers["content-type"].startswith("text/javascript")


def test_stepping_a_branch_one_token_at_a_time_keeps_one_grammar_and_a_forbidden_pick_is_refused(http):
    tree = new_tree(http, params={"temperature": 0.7, "regex": "[0-9]{8}"}, max_tokens=1)
    tid = tree["id"]
    for _ in range(9):  # 8 digits at most, then the grammar leaves EOS alone
        tree = http.post(f"/explore/api/trees/{tid}/branches/b0/continue", json={"max_tokens": 1}).json()
        if tree["branches"][0]["finish_reason"] == "stop":
            break
    b0 = tree["branches"][0]
    text = http.post("/detokenize", json={"tokens": b0["token_ids"][:-1]}).json()["prompt"]
    assert b0["finish_reason"] == "stop" and len(text) == 8 and text.isdigit()  # one grammar from the first step
    r = http.post(f"/explore/api/trees/{tid}/branches/b0/continue", json={"max_tokens": 1})
    assert r.status_code == 400 and "has ended" in r.json()["error"]["message"]
    detail = node(http, tree, f"b0:{len(PROMPT)}")
    grammar = detail["grammar"]
    assert grammar is not None and 0 < grammar["allowed"] < 400
    banned = next(c["token_id"] for c, k in zip(detail["candidates"], detail["stages"][-1]["kept"]) if not k)
    r = http.post(f"/explore/api/trees/{tid}/nodes/b0/{len(PROMPT)}/branch", json={"token_id": banned})
    assert r.status_code == 400 and "not allowed by the grammar" in r.json()["error"]["message"]
