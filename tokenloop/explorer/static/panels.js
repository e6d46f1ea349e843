// The smaller panels: the settings fields (shared by the generation form and the live controls), the generated
// tokens, the branch tree, the vote result and the list of trees.
import { html } from "./html.js";
import { branchOutline, escapeToken, heat, pct, visibleText } from "./tree.js";

/** One settings input per field; `prefix` keeps the live copies' test ids apart from the generation form's. */
export function Fields({ fields, values, onInput, prefix = "" }) {
  return html`<div class="fields">
    ${fields.map((f) => {
      const attrs = {
        "data-testid": prefix + f.testid,
        name: prefix + f.testid,
        value: values[f.key],
        spellcheck: false,
        onInput: (e) => onInput(f.key, e.currentTarget.value),
      };
      const input =
        f.kind === "json"
          ? html`<textarea rows="2" placeholder='{"type": "object"}' ...${attrs} />`
          : html`<input type="text" inputmode=${f.kind === "num" || f.kind === "int" ? "decimal" : "text"}
              placeholder=${f.kind === "bias" ? "id:bias, id:bias" : f.def === null ? "none" : ""} ...${attrs} />`;
      return html`<label class=${f.kind === "json" || f.kind === "bias" ? "field wide" : "field"} key=${f.key}>
        <span>${f.testid}</span>${input}
      </label>`;
    })}
  </div>`;
}

const HOW_CLASS = { accepted: "how-accepted", recovery: "how-recovery", bonus: "how-bonus", forced: "how-forced" };
const MARKS = [
  ["spec-start", "speculative step"],
  ["how-accepted", "accepted draft"],
  ["how-recovery", "recovery"],
  ["how-bonus", "bonus"],
  ["how-forced", "picked by hand"],
];

/** The prompt (grey) then the selected branch's tokens, coloured; clicking a token selects that step. */
export function TokenView({ tree, seq, index, colorBy, onSelect }) {
  const marks = new Set(seq.flatMap((tok) => [HOW_CLASS[tok.how], tok.spec && "spec-start"]));
  return html`<div class="tokens" data-testid="tokens">
    ${tree.prompt_texts.map((t, i) => html`<span class="ptok" key=${`p${i}`}>${visibleText(t)}</span>`)}
    ${seq.map((tok, i) => {
      const cls = ["tok", `heat-${heat(tok, colorBy)}`, HOW_CLASS[tok.how], tok.spec && "spec-start"];
      if (i === index) cls.push("selected");
      const title = `${tok.node} · p ${pct(tok.p)} · entropy ${tok.entropy.toFixed(2)} nats · rank ${tok.rank}`;
      return html`<span
        key=${tok.node}
        data-testid="token"
        data-token-id=${tok.token_id}
        data-p=${String(tok.p)}
        data-node=${tok.node}
        data-branch=${tok.branch}
        class=${cls.filter(Boolean).join(" ")}
        title=${`${title}\n${tok.how}`}
        onClick=${() => onSelect(i)}
      >${visibleText(tok.text)}</span>`;
    })}
    </div>
    <div class="marks">
      ${MARKS.filter(([c]) => marks.has(c)).map(
        ([c, label]) => html`<span class=${`mark ${c}`} key=${c}>${label}</span>`,
      )}
    </div>`;
}

function branchLabel(b) {
  const first = b.texts.length ? escapeToken(b.texts[0]) : "";
  const extra = [b.score != null && `score ${b.score.toFixed(3)}`, b.answer != null && `answer ${b.answer}`];
  if (b.finish_reason) extra.push(b.finish_reason);
  if (!b.resident) extra.push("not resident");
  return { first, extra: extra.filter(Boolean).join(" · ") };
}

/** Branches indented under their parents; select one, or delete the selected one (and its descendants). */
export function TreePanel({ tree, selected, wouldFree, onSelect, onDelete, busy }) {
  const frees = wouldFree === undefined || selected === "b0" ? "" : ` (frees ${wouldFree} blocks)`;
  return html`<section class="panel branches" data-testid="tree-panel">
    <h3>branches</h3>
    <ul>
      ${branchOutline(tree).map(({ branch: b, depth }) => {
        const { first, extra } = branchLabel(b);
        return html`<li key=${b.id} class=${`depth-${Math.min(depth, 6)}${b.id === selected ? " sel" : ""}`}>
          <button class="branch-row" data-testid="tree-branch" data-branch-id=${b.id} onClick=${() => onSelect(b.id)}>
            <b>${b.id}</b> ${b.kind} @${b.start} <code class="tokcode">${first}</code> ${b.token_ids.length} tok
            ${extra && html`<span class="muted">${extra}</span>`}
          </button>
        </li>`;
      })}
    </ul>
    <button data-testid="delete-branch" disabled=${busy || !selected || selected === "b0"} onClick=${onDelete}>
      delete ${selected ?? "branch"}${frees}
    </button>
  </section>`;
}

/** Self-consistency: the answer each sampled branch reached, the counts, the majority. */
export function VotePanel({ vote, onSelect }) {
  const counts = Object.entries(vote.votes).sort((a, b) => b[1] - a[1]);
  return html`<section class="panel vote" data-testid="vote-result">
    <h3>vote at ${vote.node}</h3>
    <div>winner: <b data-testid="vote-winner">${vote.winner ?? "none"}</b></div>
    <ul class="counts">
      ${counts.map(([answer, n]) => html`<li key=${answer}><code>${answer}</code>: ${n}</li>`)}
    </ul>
    <ul class="answers">
      ${Object.entries(vote.answers).map(
        ([b, answer]) => html`<li key=${b}>
          <button class="link" onClick=${() => onSelect(b)}>${b}</button> → ${answer ?? html`<i>no answer</i>`}
        </li>`,
      )}
    </ul>
  </section>`;
}

export function TreeList({ trees, current, onOpen, onDelete, busy }) {
  return html`<div class="tree-list">
    <h3>trees</h3>
    <ul data-testid="trees">
      ${trees.map(
        (t) => html`<li key=${t.id} class=${t.id === current ? "sel" : ""}>
          <button class="link" data-tree-id=${t.id} onClick=${() => onOpen(t.id)}>
            ${t.id} · ${t.num_branches} br · ${(t.prompt ?? "").slice(0, 40)}
          </button>
        </li>`,
      )}
    </ul>
    ${
      current && html`<button data-testid="delete-tree" disabled=${busy} onClick=${onDelete}>delete ${current}</button>`
    }
  </div>`;
}
