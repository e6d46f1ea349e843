"""What the explore API does to the engine: every branch is a retained engine request (a fork of its parent's at
its start, sharing the parent's KV blocks by reference), traced (engine/trace.py), so that each step it took can be
shown again from its raw logits. Continuing a branch forks its own request at its end and lets the old one go.

A segment (one engine request) samples with seed tree.seed + k: explore requests are always seeded, and an
export's segments replay to the same tokens.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from tokenloop.engine.async_engine import AsyncEngine
from tokenloop.engine.beam_search import BeamSearchParams
from tokenloop.engine.llm_engine import LLMEngine
from tokenloop.engine.requests import Fork
from tokenloop.engine.trace import TraceStep
from tokenloop.explorer.nodes import StepContext, how_chosen, stages_of, token_stats
from tokenloop.explorer.protocol import ExploreParams
from tokenloop.explorer.tree import Branch, ExploreTree, Segment
from tokenloop.sampling.params import SamplingParams
from tokenloop.strategies.self_consistency import AnswerSpec


class RequestError(ValueError):
    """A request the explorer cannot do as asked (a 400)."""


class Explorer:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.inputs = engine.inputs
        self.tokenizer = engine.inputs.tokenizer
        self._ids = 0

    # --- one step's context -------------------------------------------------------------------------------------

    def params_of(self, tree: ExploreTree, seed: int = 0, max_tokens: int | None = None) -> SamplingParams:
        """The tree's settings as SamplingParams (max_tokens None: showing a step, whose stages it does not change)."""
        return ExploreParams(**tree.params).sampling_params(seed, max_tokens or max(1, tree.params["min_tokens"]))

    def context(
        self, tree: ExploreTree, branch: Branch, index: int, params: SamplingParams | None = None
    ) -> StepContext:
        """The context of `branch`'s token `index`: the sequence before it, the params, where its output began."""
        position = branch.start + index
        return StepContext(tree.sequence(branch)[:position], params or self.params_of(tree), branch.output_start[index])

    def stages(self, step: TraceStep, ctx: StepContext):
        return stages_of(
            step,
            ctx,
            lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            self.tokenizer.eos_token_ids,
            self.inputs.grammars,
        )

    # --- growing branches ---------------------------------------------------------------------------------------

    async def run_segment(
        self,
        tree: ExploreTree,
        branch: Branch,
        prompt: list[int],
        max_tokens: int,
        fork_of: Fork | None,
        seed: int | None = None,
    ) -> None:
        """Run one engine request for `branch` and append its tokens with their steps; the request is kept."""
        seed = tree.segment_seed() if seed is None else seed
        params = self.params_of(tree, seed, max_tokens)
        self._ids += 1
        request_id = f"explore-{tree.id}-{branch.id}-{self._ids}"
        final = None
        try:
            async for out in self.engine.generate(
                {"prompt_token_ids": prompt}, params, request_id=request_id, retain=True, fork_of=fork_of
            ):
                final = out
        except ValueError as e:
            raise RequestError(str(e)) from None

        def take(engine: LLMEngine) -> dict[int, TraceStep]:
            seq = engine.retained(request_id)
            trace, seq.trace = seq.trace, {}  # the tree holds them now
            return trace

        trace = await self.engine.call(take)
        old, branch.request_id = branch.request_id, request_id
        if old is not None:
            await self.engine.call(lambda engine: engine.release_request(old))  # the new request holds its blocks
        branch.segments.append(Segment(seed, max_tokens, len(prompt)))
        # Forks continue the tree's output (its processors count from the prompt); a fresh request starts its own.
        output_start = len(tree.prompt_token_ids) if fork_of is not None else len(prompt)
        completion = final.outputs[0]
        branch.finish_reason = completion.finish_reason
        start = branch.end
        steps = [trace.get(start + i) for i in range(len(completion.token_ids))]
        stats = await self.engine.input_threads.run(
            self._stats,
            tree,
            prompt + completion.token_ids,
            start,
            list(zip(completion.token_ids, steps)),
            output_start,
        )
        params = self.params_of(tree)
        for token_id, step, numbers in zip(completion.token_ids, steps, stats):
            self._append(branch, token_id, step, how_chosen(step, params, forced=False), output_start, numbers)
        self._mark_drafts(branch)

    def _stats(
        self,
        tree: ExploreTree,
        sequence: list[int],
        start: int,
        tokens: list[tuple[int, TraceStep | None]],
        output_start: int,
    ) -> list[tuple[float | None, float | None, int | None]]:
        """(p, entropy, rank) of each (token, its step) from position `start` of `sequence`, from the step's stages
        (None for a step the engine kept no record of). Vocabulary-wide work: run on an input thread."""
        params = self.params_of(tree)
        return [
            token_stats(self.stages(step, StepContext(sequence[: start + i], params, output_start)), token_id)
            if step is not None
            else (None, None, None)
            for i, (token_id, step) in enumerate(tokens)
        ]

    @staticmethod
    def _append(
        branch: Branch,
        token_id: int,
        step: TraceStep | None,
        how: str,
        output_start: int,
        stats: tuple[float | None, float | None, int | None],
    ) -> None:
        """A token of `branch`, with its step's record and its probability, entropy and rank."""
        branch.token_ids.append(token_id)
        branch.output_start.append(output_start)
        branch.steps.append(step)
        branch.spec.append(None)
        branch.how.append(how)
        branch.p.append(stats[0]), branch.entropy.append(stats[1]), branch.rank.append(stats[2])

    def _mark_drafts(self, branch: Branch) -> None:
        """At the first token of each verified draft: what was drafted, how many were accepted, and the token that
        ended the step (a rejection's recovery, or the bonus after a whole draft)."""
        for i, step in enumerate(branch.steps):
            if step is None or step.drafted is None or branch.spec[i] is not None:
                continue
            end = i
            while end < len(branch.how) - 1 and branch.how[end] == "accepted":
                end += 1
            branch.spec[i] = {
                "drafted": step.drafted,
                "drafted_texts": [
                    t.decode("utf-8", errors="replace") for t in self.tokenizer.token_bytes(step.drafted)
                ],
                "accepted": end - i,
                "final": branch.token_ids[end],
                "final_kind": branch.how[end],
            }

    async def new_tree(self, tree: ExploreTree) -> None:
        b0 = tree.new_branch(None, len(tree.prompt_token_ids), "sample")
        await self.run_segment(tree, b0, tree.prompt_token_ids, tree.max_tokens, None)

    def node(self, tree: ExploreTree, branch_id: str, position: int) -> tuple[Branch, Branch, int]:
        """(the branch named, the branch whose own token is at position, its index there)."""
        branch = tree.branches.get(branch_id)
        found = tree.owner(branch, position) if branch is not None else None
        if found is None:
            raise LookupError(f"node {branch_id}:{position} is not a generated token of tree {tree.id}")
        return branch, found[0], found[1]

    async def branch_from(
        self, tree: ExploreTree, branch_id: str, position: int, token_id: int, max_tokens: int, seed: int | None = None
    ) -> Branch:
        """A new branch at node (branch, position) whose first token is `token_id` (picked), then sampled on."""
        branch, owner, index = self.node(tree, branch_id, position)
        if token_id >= self.inputs.vocab_size:
            raise RequestError(f"token_id must be below the vocabulary size {self.inputs.vocab_size}, got {token_id}")
        ctx = self.context(tree, owner, index)
        if ctx.params.structured_outputs is not None:  # the pick must be one the grammar allows, or it could not go on
            matcher = self.inputs.grammars().matcher(ctx.params.structured_outputs)
            matcher.sync(ctx.history[ctx.num_prompt_tokens :])
            if not matcher.allowed()[token_id]:
                raise RequestError(f"token_id {token_id} is not allowed by the grammar at this step")
        prefix = ctx.history + [token_id]
        # The same prefix, so the same distribution as the parent's token there: another pick from it.
        step, output_start = owner.steps[index], owner.output_start[index]
        (stats,) = await self.engine.input_threads.run(
            self._stats, tree, prefix, position, [(token_id, step)], output_start
        )
        child = tree.new_branch(branch.id, position, "branch")
        self._append(child, token_id, step, "forced", output_start, stats)
        fork_of = Fork(branch.request_id, position, True) if branch.request_id is not None else None
        await self.run_segment(tree, child, prefix, max_tokens, fork_of, seed)
        return child

    async def continue_branch(
        self, tree: ExploreTree, branch_id: str, max_tokens: int, seed: int | None = None
    ) -> None:
        branch = tree.branches.get(branch_id)
        if branch is None:
            raise LookupError(f"branch {branch_id} is not in tree {tree.id}")
        if branch.kind == "beam":
            raise RequestError("a beam is a result of the search: branch from one of its tokens to continue it")
        if branch.finish_reason == "stop":
            raise RequestError(f"branch {branch_id} has ended (a stop token or string): branch from one of its tokens")
        fork_of = Fork(branch.request_id, None, True) if branch.request_id is not None else None
        await self.run_segment(tree, branch, tree.sequence(branch), max_tokens, fork_of, seed)

    async def vote(
        self, tree: ExploreTree, branch_id: str, position: int, n: int, max_tokens: int, answer: str
    ) -> list[Branch]:
        """Self-consistency from a node: n samples of its position on (forks sharing the prefix's blocks), each
        one's answer read by the regex, and the vote."""
        try:
            spec = AnswerSpec(regex=answer)
        except ValueError as e:
            raise RequestError(str(e)) from None
        branch, _, _ = self.node(tree, branch_id, position)
        samples = [tree.new_branch(branch.id, position, "vote") for _ in range(n)]
        seeds = [tree.segment_seed() for _ in samples]
        await asyncio.gather(
            *(self.resample(tree, branch, s, position, max_tokens, seed) for s, seed in zip(samples, seeds))
        )
        counts: Counter = Counter()
        for s in samples:
            s.answer = spec.read(self.tokenizer.decode(s.token_ids))
            if s.answer is not None:
                counts[s.answer] += 1
        votes = dict(counts.most_common())
        tree.vote = {
            "node": f"{branch.id}:{position}",
            "answer_regex": answer,
            "answers": {s.id: s.answer for s in samples},
            "votes": votes,
            "winner": next(iter(votes), None),
        }
        return samples

    async def resample(
        self, tree: ExploreTree, parent: Branch, sample: Branch, position: int, max_tokens: int, seed: int
    ) -> None:
        prefix = tree.sequence(parent)[:position]
        fork_of = Fork(parent.request_id, position, True) if parent.request_id is not None else None
        await self.run_segment(tree, sample, prefix, max_tokens, fork_of, seed)

    async def beam(self, tree: ExploreTree, beam_width: int, max_tokens: int) -> list[Branch]:
        """Beam search from the prompt (engine/beam_search.py): each returned beam a scored branch (not resident:
        the search ends its sequences)."""
        params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens)
        final = None
        async for out in self.engine.generate({"prompt_token_ids": tree.prompt_token_ids}, params):
            final = out
        beams = []
        for completion in final.outputs:
            b = tree.new_branch(None, len(tree.prompt_token_ids), "beam")
            b.score, b.finish_reason = completion.cumulative_logprob, completion.finish_reason
            for token_id in completion.token_ids:  # the search kept no record of its steps
                self._append(b, token_id, None, "beam", len(tree.prompt_token_ids), (None, None, None))
            beams.append(b)
        tree.beam = {"beam_width": beam_width, "max_tokens": max_tokens}
        return beams

    async def release(self, request_ids: list[str]) -> tuple[int, int]:
        """Let the requests go; (blocks freed, free blocks now)."""

        def release(engine: LLMEngine) -> tuple[int, int]:
            before = engine.block_manager.num_free_blocks
            for request_id in request_ids:
                engine.release_request(request_id)
            after = engine.block_manager.num_free_blocks
            return after - before, after

        return await self.engine.call(release)

    async def delete_branch(self, tree: ExploreTree, branch_id: str) -> tuple[int, int]:
        if branch_id not in tree.branches:
            raise LookupError(f"branch {branch_id} is not in tree {tree.id}")
        if tree.branches[branch_id].parent is None and tree.branches[branch_id].kind != "beam":
            raise RequestError("a tree's first branch holds the others: delete the tree instead")
        gone = tree.descendants(branch_id)
        for b in gone:
            del tree.branches[b.id]
        return await self.release([b.request_id for b in gone if b.request_id is not None])
