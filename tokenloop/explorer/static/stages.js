// The selected step: how its next-token distribution was shaped, stage by stage, and how the token was chosen.
import { html } from "./html.js";
import { escapeToken, hexBytes, pct } from "./tree.js";

const HOW = {
  argmax: "argmax: the most likely token of the final distribution (greedy)",
  forced: "forced: picked by hand (a branch), not sampled",
  accepted: "speculative: drafted, then accepted by the target model",
  recovery: "speculative: resampled from the target after a draft token was rejected",
  bonus: "speculative: the target's extra token after every draft token was accepted",
  beam: "beam search: this continuation stayed among the best-scoring beams",
};

function HowChosen({ node }) {
  if (node.how !== "draw") return html`<div class="how">${HOW[node.how] ?? node.how}</div>`;
  // The seed fixes q for every token; the sampler keeps the token with the largest p/q.
  return html`<div class="how">
    seeded draw (seed ${node.seed}): this token's q = ${node.q?.toFixed(4)}, key p/q = ${node.key?.toFixed(4)},
    the largest key of all candidates
  </div>`;
}

function SpecDrafts({ spec }) {
  return html`<div class="spec" data-testid="spec">
    drafted:
    ${spec.drafted_texts.map(
      (text, i) =>
        html`<span class=${i < spec.accepted ? "draft accepted" : "draft rejected"} data-token-id=${spec.drafted[i]}
          >${escapeToken(text)}</span
        >`,
    )}
    → ${spec.accepted} accepted, then a ${spec.final_kind} token (id ${spec.final})
  </div>`;
}

function Candidate({ cand, stage, index, selected, chosen, onSelect }) {
  const p = stage.p[index];
  const kept = stage.kept[index];
  const cls = ["cand", kept ? "kept" : "dropped", selected && "selected", chosen && "chosen"].filter(Boolean);
  // Visible text is exactly `${token} ${percent}` (e.g. " the 42.1%"): the page tests read it.
  return html`<li
    data-testid="candidate"
    data-token-id=${cand.token_id}
    data-p=${String(p)}
    data-kept=${String(kept)}
    data-stage=${stage.name}
    class=${cls.join(" ")}
    title=${`id ${cand.token_id}, bytes ${hexBytes(cand.bytes)}, logit ${stage.logit[index] ?? "removed"}`}
    onClick=${() => onSelect(cand.token_id)}
  >
    <span class=${`bar w-${Math.round(p * 20)}`}></span>
    <span class="ctext">${escapeToken(cand.text)}</span><span class="cpct">${" " + pct(p)}</span>
  </li>`;
}

function StageColumn({ stage, order, candidates, selected, chosen, onSelect }) {
  return html`<div class="stage" data-testid="stage" data-stage=${stage.name}>
    <h4>${stage.name}</h4>
    <div class="stage-stats">
      <span title="tokens still possible">${stage.num_kept} kept</span>
      <span title="probability, in the previous stage, of the tokens this stage removed">
        −${pct(stage.removed_mass)}
      </span>
      <span title="entropy of this stage's distribution, in nats">H ${stage.entropy.toFixed(2)}</span>
    </div>
    <ol>
      ${order.map(
        (i) => html`<${Candidate}
          key=${candidates[i].token_id}
          cand=${candidates[i]}
          stage=${stage}
          index=${i}
          selected=${candidates[i].token_id === selected}
          chosen=${candidates[i].token_id === chosen}
          onSelect=${onSelect}
        />`,
      )}
    </ol>
  </div>`;
}

/** node: the NodeDetail; view: what the columns draw (the node itself, or a reshape answer for the live controls). */
export function NodeDetail({ node, view, orders, selected, onSelect, onBranch, busy, live }) {
  const sel = view.candidates.find((c) => c.token_id === selected);
  return html`<section class="panel detail" data-testid="node-detail" data-node=${node.id}>
    <div class="detail-head">
      <div>
        <b>position ${node.position}</b>${" · token "}<code class="tokcode">${escapeToken(node.text)}</code>
        ${` (id ${node.token_id}) · bytes `}<code>${hexBytes(node.bytes)}</code>
        ${` · entropy ${node.entropy.toFixed(3)} nats`}
      </div>
      <${HowChosen} node=${node} />
      ${node.spec && html`<${SpecDrafts} spec=${node.spec} />`}
      ${
        view.grammar &&
        html`<div class="grammar" data-testid="grammar">
        grammar: allowed ${view.grammar.allowed} tokens, removed mass ${pct(view.grammar.removed_mass)}
      </div>`
      }
      ${live && html`<div class="live-note">live: the columns show this step's logits under the live settings</div>`}
      <button data-testid="branch" disabled=${busy || !sel} onClick=${onBranch}>
        continue from here with <code class="tokcode">${sel ? escapeToken(sel.text) : "?"}</code>
      </button>
    </div>
    <div class="stages">
      ${view.stages.map(
        (stage, s) => html`<${StageColumn}
          key=${stage.name}
          stage=${stage}
          order=${orders[s]}
          candidates=${view.candidates}
          selected=${selected}
          chosen=${node.token_id}
          onSelect=${onSelect}
        />`,
      )}
    </div>
  </section>`;
}
