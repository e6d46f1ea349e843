// The KV cache behind the tree: each branch's block table, which blocks branches share (copy-on-write forks), which
// are in the prefix cache, and what deleting a branch would give back to the pool.
import { html } from "./html.js";

function Block({ id, info, cow, current }) {
  const cls = ["kvb", info.ref_count > 1 && "shared", info.hashed && "hashed", cow && "cow", current && "current"];
  const title = [
    `block ${id}: ${info.ref_count} holder(s) ${info.holders.join(", ")}`,
    info.hashed && "full and hashed: in the prefix cache",
    cow && `copied on write from block ${cow.parent_block} where this branch diverged`,
  ];
  return html`<span class=${cls.filter(Boolean).join(" ")} data-block=${id} data-ref=${info.ref_count}
    title=${title.filter(Boolean).join("\n")}>${id}</span>`;
}

/** kv: GET .../kv; branch and position: the selected token, to mark the block that holds its K/V. */
export function KvPanel({ kv, tree, branch, position }) {
  if (!kv) return html`<section class="panel kv" data-testid="kv-panel"><h3>KV cache</h3>…</section>`;
  return html`<section class="panel kv" data-testid="kv-panel">
    <h3>KV cache</h3>
    <div class="kv-pool" data-testid="kv-pool">
      pool: ${kv.num_free_blocks} of ${kv.num_blocks} blocks free · ${kv.block_size} tokens per block
    </div>
    ${tree.branches.map((b) => {
      const table = kv.branches[b.id];
      if (!table)
        return html`<div class="kv-row gone" key=${b.id}><span class="kv-label">${b.id}</span> not resident</div>`;
      const here = b.id === branch ? Math.floor(position / kv.block_size) : -1;
      return html`<div class=${b.id === branch ? "kv-row sel" : "kv-row"} key=${b.id} data-branch-id=${b.id}>
        <span class="kv-label">${b.id}</span>
        <span class="kv-blocks">
          ${table.blocks.map(
            (id, i) => html`<${Block}
              id=${id}
              info=${kv.blocks[String(id)] ?? { ref_count: 1, hashed: false, holders: [b.id] }}
              cow=${kv.cow.find((c) => c.branch === b.id && c.index === i)}
              current=${i === here}
            />`,
          )}
        </span>
        <span class="kv-free" data-would-free=${kv.would_free[b.id] ?? 0}>
          ${b.id === "b0" ? "" : `delete frees ${kv.would_free[b.id] ?? 0}`}
          ${table.num_cached_tokens ? ` · ${table.num_cached_tokens} tokens from prefix cache` : ""}
        </span>
      </div>`;
    })}
    <div class="legend">
      <span class="kvb shared">n</span> shared (ref > 1) <span class="kvb hashed">n</span> prefix-cached
      <span class="kvb cow">n</span> copied on write <span class="kvb current">n</span> holds the selected token
    </div>
  </section>`;
}
