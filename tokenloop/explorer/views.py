"""The explore API's answers as JSON: a tree, a node's detail (its stages in the engine's order), an export."""

from __future__ import annotations

from tokenloop.explorer.nodes import draw_of, how_chosen, summarize
from tokenloop.explorer.session import Explorer
from tokenloop.explorer.tree import Branch, ExploreTree
from tokenloop.sampling.params import SamplingParams

EXPORT_FORMAT, EXPORT_VERSION = "tokenloop-explore", 1


def texts(explorer: Explorer, token_ids: list[int]) -> list[str]:
    """Each token's own bytes as text (a token holding part of a character shows the replacement character)."""
    return [raw.decode("utf-8", errors="replace") for raw in explorer.tokenizer.token_bytes(token_ids)]


def branch_json(explorer: Explorer, branch: Branch) -> dict:
    return {
        "id": branch.id,
        "parent": branch.parent,
        "start": branch.start,
        "kind": branch.kind,
        "resident": branch.request_id is not None,
        "token_ids": branch.token_ids,
        "texts": texts(explorer, branch.token_ids),
        "p": branch.p,
        "entropy": branch.entropy,
        "rank": branch.rank,
        "how": branch.how,
        "spec": branch.spec,
        "score": branch.score,
        "answer": branch.answer,
        "finish_reason": branch.finish_reason,
    }


def tree_json(explorer: Explorer, tree: ExploreTree, block_size: int) -> dict:
    return {
        "id": tree.id,
        "seed": tree.seed,
        "params": tree.params,
        "top_n": tree.top_n,
        "max_tokens": tree.max_tokens,
        "prompt_token_ids": tree.prompt_token_ids,
        "prompt_texts": texts(explorer, tree.prompt_token_ids),
        "block_size": block_size,
        "branches": [branch_json(explorer, b) for b in tree.branches.values()],
        "vote": tree.vote,
    }


def node_json(
    explorer: Explorer, tree: ExploreTree, branch: Branch, position: int, params: SamplingParams | None = None
) -> dict:
    """Node (branch, position): its token, how it was chosen, and its stages, from the step's raw logits (under
    `params` instead of the tree's: the live controls)."""
    owner, index = tree.owner(branch, position)
    token_id, step = owner.token_ids[index], owner.steps[index]
    raw = explorer.tokenizer.token_bytes([token_id])[0]
    detail = {
        "id": f"{branch.id}:{position}",
        "branch": owner.id,
        "position": position,
        "token_id": token_id,
        "text": raw.decode("utf-8", errors="replace"),
        "bytes": raw.hex(),
        "how": owner.how[index],
        "seed": None,
        "q": None,
        "key": None,
        "entropy": owner.entropy[index],
        "candidates": [],
        "stages": [],
        "spec": owner.spec[index],
        "grammar": None,
    }
    if step is None:  # a beam's token: the search kept no record of its steps
        return detail
    ctx = explorer.context(tree, owner, index, params)
    stages = explorer.stages(step, ctx)
    candidates, summary = summarize(stages, tree.top_n, token_id)
    candidate_bytes = explorer.tokenizer.token_bytes(candidates)
    detail["candidates"] = [
        {"token_id": t, "text": b.decode("utf-8", errors="replace"), "bytes": b.hex()}
        for t, b in zip(candidates, candidate_bytes)
    ]
    detail["stages"] = summary
    grammar = next((s for s in summary if s["name"] == "grammar"), None)
    if grammar is not None:
        detail["grammar"] = {"allowed": grammar["num_kept"], "removed_mass": grammar["removed_mass"]}
    if params is not None:
        detail["how"] = how_chosen(step, params, forced=False)
    if detail["how"] == "draw" and params is None:
        detail["seed"] = owner.segments[_segment_index(owner, index)].seed
        drawn = draw_of(step, stages, token_id)
        if drawn is not None:
            detail["q"], detail["key"] = drawn
    return detail


def _segment_index(branch: Branch, index: int) -> int:
    """The segment that sampled token `index` (segments follow one another along the branch)."""
    starts = [s.num_prompt_tokens - branch.start for s in branch.segments]
    return max(i for i, start in enumerate(starts) if start <= index)


def export_json(explorer: Explorer, tree: ExploreTree, block_size: int) -> dict:
    replay = {
        "segments": {
            b.id: [{"seed": s.seed, "max_tokens": s.max_tokens} for s in b.segments] for b in tree.branches.values()
        },
        "beam": tree.beam,
        "vote": tree.vote,
    }
    return {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "tree": tree_json(explorer, tree, block_size),
        "replay": replay,
    }
