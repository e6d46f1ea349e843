"""/explore (the page, its static files) and /explore/api (the tree API), registered on the server's app. The page
only draws: every number it shows comes from here, computed by the engine's own sampling functions."""

from __future__ import annotations

import mimetypes
import random
from collections.abc import Awaitable, Callable
from importlib.resources import files
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from tokenloop.engine.async_engine import AsyncEngine
from tokenloop.explorer.kv import kv_snapshot
from tokenloop.explorer.protocol import (
    MAX_SEED,
    Beam,
    BranchFrom,
    Continue,
    Exported,
    Freed,
    NewTree,
    Reshape,
    SampleVote,
    TreeOut,
)
from tokenloop.explorer.session import Explorer, RequestError
from tokenloop.explorer.store import ExplorerStore, StoreLimits
from tokenloop.explorer.tree import ExploreTree
from tokenloop.explorer.views import export_json, node_json, tree_json
from tokenloop.sampling.params import SamplingParams
from tokenloop.server.errors import ERROR_RESPONSES, APIError, param_of
from tokenloop.server.schema_bounds import integer_schemas

CONTENT_SECURITY_POLICY = b"default-src 'self'"
mimetypes.add_type("text/javascript", ".mjs")  # a module script served as anything else is refused
API = "/explore/api"


class ContentSecurityPolicy:
    """Every /explore response may load only from this origin: no CDN, no inline script (plain ASGI)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/explore"):
            await self.app(scope, receive, send)
            return

        async def send_with_policy(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + [
                    (b"content-security-policy", CONTENT_SECURITY_POLICY),
                    (b"x-content-type-options", b"nosniff"),
                ]
            await send(message)

        await self.app(scope, receive, send_with_policy)


class _Errors:
    """LookupError → 404, RequestError or ValueError → 400, in the server's error shape."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> None:
        if isinstance(e, LookupError):
            raise APIError(404, str(e)) from None
        if isinstance(e, ValueError):
            raise APIError(400, str(e), param_of(str(e))) from None


def add_explorer_routes(app: FastAPI, engine: AsyncEngine, limits: StoreLimits = StoreLimits()) -> ExplorerStore:
    explorer = Explorer(engine)
    store = ExplorerStore(explorer, limits)
    app.add_middleware(ContentSecurityPolicy)
    static = files("tokenloop.explorer") / "static"
    app.mount("/explore/static", StaticFiles(packages=[("tokenloop.explorer", "static")]), name="explore-static")
    block_size = engine.engine.config.block_size

    @app.get("/explore", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(str(static / "index.html"), media_type="text/html")

    def tree_out(tree: ExploreTree) -> dict[str, Any]:
        return tree_json(explorer, tree, block_size)

    async def grow(tree_id: str, new_branches: int, op: Callable[[ExploreTree], Awaitable[object]]) -> dict[str, Any]:
        """Run `op` on a tree that may take `new_branches` more (one operation on a tree at a time)."""
        with _Errors():
            tree = store.get(tree_id)
            async with store.lock(tree_id):
                await store.make_room(tree, new_branches)
                await op(tree)
            return tree_out(tree)

    @app.post(f"{API}/trees", response_model=TreeOut, responses=ERROR_RESPONSES)
    async def new_tree(body: NewTree) -> dict[str, Any]:
        """Generate from a prompt, tracing each step: the tree's first branch."""
        await store.sweep()
        with _Errors():
            prompt_ids = await _prompt_ids(engine, body)
            seed = body.params.seed if body.params.seed is not None else random.randrange(MAX_SEED // 2)
            body.params.sampling_params(seed, body.max_tokens)  # the settings are checked before anything runs
            tree = ExploreTree(store.new_id(), prompt_ids, body.params.model_dump(), seed, body.top_n, body.max_tokens)
            await store.add(tree)
            async with store.lock(tree.id):
                await store.make_room(tree)
                try:
                    await explorer.new_tree(tree)
                except BaseException:
                    await store.delete(tree.id)
                    raise
        return tree_out(tree)

    @app.get(f"{API}/trees", responses=ERROR_RESPONSES)
    async def list_trees() -> dict[str, Any]:
        await store.sweep()
        return {
            "trees": [
                {"id": t.id, "prompt": explorer.tokenizer.decode(t.prompt_token_ids), "num_branches": len(t.branches)}
                for t in store.trees.values()
            ]
        }

    @app.get(f"{API}/trees/{{tree_id}}", response_model=TreeOut, responses=ERROR_RESPONSES)
    async def get_tree(tree_id: str) -> dict[str, Any]:
        with _Errors():
            return tree_out(store.get(tree_id))

    @app.delete(f"{API}/trees/{{tree_id}}", responses=ERROR_RESPONSES)
    async def delete_tree(tree_id: str) -> Freed:
        """Let the tree go: its blocks return to the pool."""
        with _Errors():
            freed, free = await store.delete(tree_id)
        return Freed(freed_blocks=freed, num_free_blocks=free)

    @app.get(f"{API}/trees/{{tree_id}}/nodes/{{branch_id}}/{{position}}", responses=ERROR_RESPONSES)
    async def get_node(tree_id: str, branch_id: str, position: int) -> dict[str, Any]:
        """A generated token: its stages in the engine's order, each with its top candidates, how it was chosen, and
        the KV blocks its sequence holds up to it (the last: the block its K/V go to)."""
        with _Errors():
            tree = store.get(tree_id)
            branch, _, _ = explorer.node(tree, branch_id, position)
            detail = await engine.input_threads.run(node_json, explorer, tree, branch, position)
            blocks = None
            if branch.request_id is not None:
                table = await engine.call(lambda e: list(e.retained(branch.request_id).block_table))
                blocks = table[: position // block_size + 1]
            return detail | {"kv": {"branch": branch.id, "blocks": blocks}}

    @app.post(f"{API}/trees/{{tree_id}}/nodes/{{branch_id}}/{{position}}/reshape", responses=ERROR_RESPONSES)
    async def reshape(tree_id: str, branch_id: str, position: int, body: Reshape) -> dict[str, Any]:
        """The node's distribution under other settings, from its raw logits: nothing is generated."""
        with _Errors():
            tree = store.get(tree_id)
            branch, _, _ = explorer.node(tree, branch_id, position)
            params = body.params.sampling_params(tree.seed, max(1, body.params.min_tokens))
            explorer.inputs.validate(tree.prompt_token_ids[:1], params)  # the settings' own checks; nothing runs
            return await engine.input_threads.run(node_json, explorer, tree, branch, position, params)

    @app.post(
        f"{API}/trees/{{tree_id}}/nodes/{{branch_id}}/{{position}}/branch",
        response_model=TreeOut,
        responses=ERROR_RESPONSES,
    )
    async def branch(tree_id: str, branch_id: str, position: int, body: BranchFrom) -> dict[str, Any]:
        """Continue from the node with another token picked there, sharing the blocks before it."""
        return await grow(
            tree_id, 1, lambda tree: explorer.branch_from(tree, branch_id, position, body.token_id, body.max_tokens)
        )

    @app.post(
        f"{API}/trees/{{tree_id}}/branches/{{branch_id}}/continue", response_model=TreeOut, responses=ERROR_RESPONSES
    )
    async def continue_branch(tree_id: str, branch_id: str, body: Continue) -> dict[str, Any]:
        """Grow the branch by up to max_tokens (1: one step)."""
        return await grow(tree_id, 0, lambda tree: explorer.continue_branch(tree, branch_id, body.max_tokens))

    @app.delete(f"{API}/trees/{{tree_id}}/branches/{{branch_id}}", responses=ERROR_RESPONSES)
    async def delete_branch(tree_id: str, branch_id: str) -> Freed:
        """Delete the branch and those continuing it: the blocks only they held return to the pool."""
        with _Errors():
            tree = store.get(tree_id)
            async with store.lock(tree_id):
                freed, free = await explorer.delete_branch(tree, branch_id)
        return Freed(freed_blocks=freed, num_free_blocks=free)

    @app.post(
        f"{API}/trees/{{tree_id}}/nodes/{{branch_id}}/{{position}}/sample",
        response_model=TreeOut,
        responses=ERROR_RESPONSES,
    )
    async def sample(tree_id: str, branch_id: str, position: int, body: SampleVote) -> dict[str, Any]:
        """Self-consistency from the node: n samples on, their answers and the vote."""
        return await grow(
            tree_id, body.n, lambda tree: explorer.vote(tree, branch_id, position, body.n, body.max_tokens, body.answer)
        )

    @app.post(f"{API}/trees/{{tree_id}}/beam", response_model=TreeOut, responses=ERROR_RESPONSES)
    async def beam(tree_id: str, body: Beam) -> dict[str, Any]:
        """Beam search from the prompt: its beams as scored branches."""
        return await grow(tree_id, body.beam_width, lambda tree: explorer.beam(tree, body.beam_width, body.max_tokens))

    @app.get(f"{API}/trees/{{tree_id}}/kv", responses=ERROR_RESPONSES)
    async def kv(tree_id: str) -> dict[str, Any]:
        """The KV blocks the tree's branches hold, shared and copied on write."""
        with _Errors():
            tree = store.get(tree_id)
            async with store.lock(tree_id):
                return await engine.call(lambda e: kv_snapshot(e, tree))

    @app.get(f"{API}/trees/{{tree_id}}/export", responses=ERROR_RESPONSES)
    async def export(tree_id: str) -> JSONResponse:
        """The tree and how to replay it, as a file."""
        with _Errors():
            tree = store.get(tree_id)
        headers = {"content-disposition": f'attachment; filename="tokenloop-{tree_id}.json"'}
        return JSONResponse(export_json(explorer, tree, block_size), headers=headers)

    @app.post(f"{API}/import", response_model=TreeOut, responses=ERROR_RESPONSES)
    async def import_tree(body: Exported) -> dict[str, Any]:
        """An exported tree, replayed through the engine with its seeds: the same tokens, resident again."""
        await store.sweep()
        with _Errors():
            tree = await _replay(explorer, store, body)
        return tree_out(tree)

    return store


async def _prompt_ids(engine: AsyncEngine, body: NewTree) -> list[int]:
    inputs = engine.inputs
    if body.chat:
        if not isinstance(body.prompt, str):
            raise RequestError("chat: the chat template takes a prompt (text)")
        prompt = await engine.input_threads.run(inputs.chat, [{"role": "user", "content": body.prompt}])
    else:
        prompt = {"prompt": body.prompt} if isinstance(body.prompt, str) else {"prompt_token_ids": body.prompt}
    processed = await engine.input_threads.run(inputs.process, prompt, SamplingParams(max_tokens=body.max_tokens))
    return processed.prompt_token_ids


async def _replay(explorer: Explorer, store: ExplorerStore, body: Exported) -> ExploreTree:
    """Rebuild an exported tree by running its segments again, in the order its branches were made."""
    data = body.tree
    vocab = explorer.inputs.vocab_size
    if any(t >= vocab for t in data.prompt_token_ids) or any(t >= vocab for b in data.branches for t in b.token_ids):
        raise RequestError(f"the export's token ids must be below the vocabulary size {vocab}")
    if any(b.kind == "beam" for b in data.branches) and body.replay.beam is None:
        raise RequestError("the export cannot replay branch of kind beam: replay.beam is missing")
    params = data.params.model_dump()
    tree = ExploreTree(store.new_id(), data.prompt_token_ids, params, data.seed, data.top_n, data.max_tokens)
    await store.add(tree)
    async with store.lock(tree.id):
        try:
            await _replay_branches(explorer, store, tree, body)
        except BaseException:
            await store.delete(tree.id)
            raise
    return tree


async def _replay_branches(explorer: Explorer, store: ExplorerStore, tree: ExploreTree, body: Exported) -> None:
    names: dict[str, str] = {}  # exported branch id -> replayed one
    branches, replay = body.tree.branches, body.replay
    exported_beams = [b.id for b in branches if b.kind == "beam"]
    for b in branches:
        runs = replay.segments.get(b.id) or []
        await store.make_room(tree)
        if b.kind == "beam":
            if b.id == exported_beams[0] and replay.beam is not None:  # one search gives the beams again, in order
                beams = await explorer.beam(tree, replay.beam.beam_width, replay.beam.max_tokens)
                names.update(zip(exported_beams, (new.id for new in beams)))
            continue
        parent = names.get(b.parent) if b.parent is not None else None
        if not runs or (b.parent is not None and parent is None) or (b.kind == "branch" and not b.token_ids):
            raise RequestError(f"the export cannot replay branch {b.id}: its segments or its parent are missing")
        first, rest = runs[0], runs[1:]
        if parent is None:
            new = tree.new_branch(None, len(tree.prompt_token_ids), b.kind)
            await explorer.run_segment(tree, new, tree.prompt_token_ids, first.max_tokens, None, first.seed)
        elif b.kind == "branch":
            new = await explorer.branch_from(tree, parent, b.start, b.token_ids[0], first.max_tokens, first.seed)
        else:
            new = tree.new_branch(parent, b.start, b.kind)
            explorer.node(tree, parent, b.start)  # the position must be a generated token of the parent
            await explorer.resample(tree, tree.branches[parent], new, b.start, first.max_tokens, first.seed)
        for run in rest:
            await explorer.continue_branch(tree, new.id, run.max_tokens, run.seed)
        new.answer = b.answer
        names[b.id] = new.id
    runs = [s for segments in replay.segments.values() for s in segments]
    tree.next_segment = max((s.seed - tree.seed + 1 for s in runs), default=0)
    if replay.vote and isinstance(replay.vote.get("node"), str):
        vote = dict(replay.vote)
        vote["answers"] = {names.get(k, k): v for k, v in (vote.get("answers") or {}).items()}
        branch, _, position = vote["node"].partition(":")
        vote["node"] = f"{names.get(branch, branch)}:{position}"
        tree.vote = vote


def explore_openapi(schema: dict, vocab_size: int) -> None:
    """The explore API's part of the OpenAPI schema, made true to this server: token ids bounded by the vocabulary,
    and links from the operations that make a tree to those that take one (what a fuzzer follows)."""
    components = schema["components"]["schemas"]
    for name, field in [
        ("NewTree", "prompt"),
        ("ExploreParams", "allowed_token_ids"),
        ("BranchFrom", "token_id"),
        ("ExportedTree", "prompt_token_ids"),
        ("ExportedBranch", "token_ids"),
    ]:
        for integer in integer_schemas(components[name]["properties"][field]):
            integer["maximum"] = vocab_size - 1
    first = "$response.body#/branches/0"
    values = {"tree_id": "$response.body#/id", "branch_id": f"{first}/id", "position": f"{first}/start"}
    links = {}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if path.startswith(f"{API}/trees/{{tree_id}}"):
                names = [p["name"] for p in operation.get("parameters", []) if p["in"] == "path"]
                links[operation["operationId"]] = {
                    "operationId": operation["operationId"],
                    "parameters": {n: values[n] for n in names},
                }
    for path in (f"{API}/trees", f"{API}/import"):
        schema["paths"][path]["post"]["responses"]["200"]["links"] = links
