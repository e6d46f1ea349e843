// The explorer page: prefix → next-token distribution → choose → append, one step at a time. This module holds
// the page state, calls the API and wires the keyboard; the panels in the other modules only draw.
import { render } from "./vendor/preact.mjs";
import { useEffect, useLayoutEffect, useState } from "./vendor/hooks.mjs";
import { api, downloadExport, exportPath, needsKey } from "./api.js";
import { html } from "./html.js";
import { KvPanel } from "./kv.js";
import { Fields, TokenView, TreeList, TreePanel, VotePanel } from "./panels.js";
import { NodeDetail } from "./stages.js";
import {
  FIELDS,
  LIVE_FIELDS,
  branchById,
  branchSequence,
  fieldsFromParams,
  paramsFromFields,
  stageOrders,
} from "./tree.js";

const FORM_DEFAULTS = {
  prompt: "",
  chat: false,
  max_tokens: "16",
  top_n: "10",
  beam_width: "3",
  vote_n: "5",
  vote_answer: "(-?\\d+)",
  ...fieldsFromParams({}),
};

function intIn(value, name, lo, hi) {
  const v = Number(value);
  if (!Number.isInteger(v) || v < lo || v > hi) throw new Error(`${name}: expected an integer in ${lo}..${hi}`);
  return v;
}

/** A labelled small input bound to one key of the form. */
function Small({ form, set, name, testid, wide }) {
  return html`<label class=${wide ? "field wide" : "field"}>
    <span>${testid}</span>
    <input type="text" data-testid=${testid} value=${form[name]} onInput=${(e) => set(name, e.currentTarget.value)} />
  </label>`;
}

function LivePanel({ values, active, onInput, onReset }) {
  return html`<section class="panel live" data-testid="live-panel">
    <h3>live controls <span class="muted">reshape this step's stored logits; nothing is generated</span></h3>
    <${Fields} fields=${LIVE_FIELDS} values=${values} onInput=${onInput} prefix="live-" />
    <button data-testid="reset" disabled=${!active} onClick=${onReset}>reset to this step's own settings</button>
  </section>`;
}

const COLOR_HINT = {
  p: "probability: high → low",
  entropy: "entropy: certain → uncertain",
  rank: "rank: 1 → far down",
};

function App() {
  const [form, setForm] = useState(FORM_DEFAULTS);
  const [trees, setTrees] = useState([]);
  const [tree, setTree] = useState(null);
  const [sel, setSel] = useState({ branch: null, index: 0 }); // selected branch, token index in its sequence
  const [cand, setCand] = useState(null); // token id of the selected candidate
  const [detail, setDetail] = useState(null); // {path, node}: the NodeDetail fetched for path
  const [live, setLive] = useState(null); // live control strings; null: the step's own stages
  const [shaped, setShaped] = useState(null); // {path, answer}: the reshape answer under `live`
  const [kv, setKv] = useState(null);
  const [colorBy, setColorBy] = useState("p");
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState("");
  const [notice, setNotice] = useState("");

  const seq = tree && sel.branch ? branchSequence(tree, sel.branch) : [];
  const token = seq[sel.index];
  // The API addresses a node as nodes/<branch>/<position>; the page names it "<branch>:<position>".
  const nodePath = tree && token ? `/trees/${tree.id}/nodes/${token.node.replace(":", "/")}` : null;
  const node = detail?.path === nodePath ? detail.node : null;
  const view = node && (live && shaped?.path === nodePath ? shaped.answer : node);
  const orders = view ? stageOrders(view.stages, view.candidates.length) : [];
  const set = (key, value) => setForm((f) => ({ ...f, [key]: value }));

  // Every action goes through here: one busy flag, and any failure (an expected 4xx too) lands in the error line.
  async function act(fn) {
    setBusy(true);
    setError("");
    try {
      await fn();
    } catch (e) {
      setError(e.message);
    } finally {
      setBusy(false);
    }
  }

  const refreshTrees = async () => setTrees((await api("GET", "/trees")).trees);

  /** Show tree t with a branch and token selected; a negative index counts from the sequence's end. */
  function show(t, branch, index) {
    const n = branchSequence(t, branch).length;
    setTree(t);
    setSel({ branch, index: Math.max(0, Math.min(n - 1, index < 0 ? n + index : index)) });
  }

  useEffect(() => void act(refreshTrees), []);
  useEffect(() => setLive(null), [tree?.id]);

  // The selected step's detail; a late answer for a step no longer selected is dropped.
  useEffect(() => {
    if (!nodePath) return undefined;
    let stale = false;
    api("GET", nodePath).then(
      (n) => stale || (setDetail({ path: nodePath, node: n }), setCand(n.token_id)),
      (e) => stale || setError(e.message),
    );
    return () => void (stale = true);
  }, [nodePath]);

  // The KV picture (and the tree list's branch counts) after every change to the tree.
  useEffect(() => {
    if (!tree) return undefined;
    let stale = false;
    refreshTrees().catch((e) => stale || setError(e.message));
    api("GET", `/trees/${tree.id}/kv`).then(
      (k) => stale || setKv(k),
      (e) => stale || setError(e.message),
    );
    return () => void (stale = true);
  }, [tree]);

  // Live controls: recompute the step's stages under the edited settings, 150 ms after the last keystroke.
  useEffect(() => {
    if (!live || !node) return undefined;
    let stale = false;
    const timer = setTimeout(() => {
      let params;
      try {
        params = paramsFromFields(live, tree.params);
      } catch (e) {
        setError(e.message);
        return;
      }
      api("POST", `${nodePath}/reshape`, { params }).then(
        (answer) => stale || (setShaped({ path: nodePath, answer }), setError("")),
        (e) => stale || setError(e.message),
      );
    }, 150);
    return () => {
      stale = true;
      clearTimeout(timer);
    };
  }, [live, node]);

  /** Select a branch at its own first token (the one that makes it differ from its parent). */
  const selectBranch = (id) => {
    const b = branchById(tree, id);
    setSel({
      branch: id,
      index: Math.max(
        0,
        branchSequence(tree, id).findIndex((x) => x.position === b?.start),
      ),
    });
  };

  const maxTokens = () => intIn(form.max_tokens, "max-tokens", 1, 256);
  const newBranches = (t) => t.branches.filter((b) => !tree?.branches.some((old) => old.id === b.id));

  const generate = () =>
    act(async () => {
      if (!form.prompt.trim()) throw new Error("prompt: write a prompt first");
      const params = paramsFromFields(form);
      const topN = intIn(form.top_n, "top-n", 1, 64);
      const body = { prompt: form.prompt, chat: form.chat, params, max_tokens: maxTokens(), top_n: topN };
      show(await api("POST", "/trees", body), "b0", 0);
    });

  // step (n = 1) and run on (n = max-tokens): the selected branch grows; select its new last token.
  const grow = (count) =>
    act(async () => {
      const body = { max_tokens: count() };
      show(await api("POST", `/trees/${tree.id}/branches/${sel.branch}/continue`, body), sel.branch, -1);
    });

  const branchHere = () =>
    act(async () => {
      const t = await api("POST", `${nodePath}/branch`, { token_id: cand, max_tokens: maxTokens() });
      const fresh = newBranches(t)[0];
      if (!fresh) return show(t, sel.branch, sel.index);
      show(
        t,
        fresh.id,
        branchSequence(t, fresh.id).findIndex((x) => x.position === fresh.start),
      );
    });

  const deleteBranch = () =>
    act(async () => {
      const b = branchById(tree, sel.branch);
      const r = await api("DELETE", `/trees/${tree.id}/branches/${b.id}`);
      setNotice(`deleted ${b.id} and its descendants: freed ${r.freed_blocks} blocks, ${r.num_free_blocks} free`);
      show(await api("GET", `/trees/${tree.id}`), b.parent ?? "b0", sel.index);
    });

  const beam = () =>
    act(async () => {
      const body = { beam_width: intIn(form.beam_width, "beam-width", 1, 8), max_tokens: maxTokens() };
      const t = await api("POST", `/trees/${tree.id}/beam`, body);
      const best = newBranches(t).sort((a, b) => (b.score ?? -Infinity) - (a.score ?? -Infinity))[0];
      show(t, best?.id ?? sel.branch, 0);
    });

  const vote = () =>
    act(async () => {
      const body = { n: intIn(form.vote_n, "vote-n", 2, 16), max_tokens: maxTokens() };
      if (form.vote_answer.trim()) body.answer = form.vote_answer;
      show(await api("POST", `${nodePath}/sample`, body), sel.branch, sel.index);
    });

  const openTree = (id) => act(async () => show(await api("GET", `/trees/${id}`), "b0", 0));

  const deleteTree = () =>
    act(async () => {
      const r = await api("DELETE", `/trees/${tree.id}`);
      setNotice(`deleted ${tree.id}: freed ${r.freed_blocks} blocks, ${r.num_free_blocks} free`);
      setTree(null);
      setKv(null);
      setSel({ branch: null, index: 0 });
      await refreshTrees();
    });

  const importFile = (e) => {
    const input = e.currentTarget;
    const file = input.files?.[0];
    if (!file) return;
    act(async () => {
      const text = await file.text();
      try {
        JSON.parse(text);
      } catch {
        throw new Error(`import: ${file.name} is not JSON`);
      }
      const t = await api("POST", "/import", text);
      show(t, "b0", 0);
      setNotice(`imported ${file.name} as ${t.id}`);
    }).finally(() => (input.value = "")); // the same file can be imported again
  };

  // With an API key a plain link cannot authenticate: fetch, then save through an object URL.
  const onExport = (e) => {
    if (!needsKey()) return;
    e.preventDefault();
    act(() => downloadExport(tree.id));
  };

  /** ArrowUp/ArrowDown walk the candidates in the last stage column's order. */
  function moveCand(delta) {
    if (!view) return;
    const order = orders[orders.length - 1];
    const at = order.findIndex((i) => view.candidates[i].token_id === cand);
    setCand(view.candidates[order[Math.max(0, Math.min(order.length - 1, at + delta))]].token_id);
  }

  // Keys act on the page unless the user is typing into a field. A fresh listener each render sees fresh state; it
  // is swapped in the commit (a layout effect), so a key pressed just after a render never meets the old closure
  // (a plain effect waits for the next frame: ↓ then Enter at once would branch from the previous candidate).
  useLayoutEffect(() => {
    const onKey = (e) => {
      if (!tree || e.ctrlKey || e.metaKey || e.altKey || e.target.closest?.("input, textarea, select")) return;
      const keys = {
        ArrowLeft: () => setSel((s) => ({ ...s, index: Math.max(0, s.index - 1) })),
        ArrowRight: () => setSel((s) => ({ ...s, index: Math.min(seq.length - 1, s.index + 1) })),
        ArrowUp: () => moveCand(-1),
        ArrowDown: () => moveCand(1),
        Enter: () => !busy && node && cand !== null && branchHere(),
        s: () => !busy && grow(() => 1),
      };
      if (!keys[e.key]) return;
      e.preventDefault(); // arrows would scroll; Enter would also click whichever button has focus
      keys[e.key]();
    };
    document.addEventListener("keydown", onKey);
    return () => document.removeEventListener("keydown", onKey);
  });

  const onLive = (key, value) =>
    setLive((l) => ({ ...(l ?? fieldsFromParams(tree.params, LIVE_FIELDS)), [key]: value }));
  const need = busy || !tree;

  return html`<div class="app">
    <header class="top">
      <h1>tokenloop explorer</h1>
      <span class="loop">prefix → next-token distribution → choose → append</span>
      <div class="error" data-testid="error" role="alert" hidden=${!error}>${error}</div>
      <div class="notice" data-testid="notice" hidden=${!notice}>${notice}</div>
    </header>

    <aside class="left panel">
      <textarea
        data-testid="prompt"
        rows="4"
        placeholder="prompt"
        value=${form.prompt}
        onInput=${(e) => set("prompt", e.currentTarget.value)}
      />
      <label class="check">
        <input
          type="checkbox"
          data-testid="chat"
          checked=${form.chat}
          onChange=${(e) => set("chat", e.currentTarget.checked)}
        />
        chat template
      </label>
      <${Fields} fields=${FIELDS} values=${form} onInput=${set} />
      <div class="fields">
        <${Small} form=${form} set=${set} name="max_tokens" testid="max-tokens" />
        <${Small} form=${form} set=${set} name="top_n" testid="top-n" />
      </div>
      <div class="buttons">
        <button data-testid="generate" class="primary" disabled=${busy} onClick=${generate}>generate</button>
        <button data-testid="step" disabled=${need} onClick=${() => grow(() => 1)} title="key: s">step</button>
        <button data-testid="run-on" disabled=${need} onClick=${() => grow(maxTokens)}>run on</button>
      </div>
      <div class="fields">
        <${Small} form=${form} set=${set} name="beam_width" testid="beam-width" />
        <button data-testid="beam" disabled=${need} onClick=${beam}>beam</button>
      </div>
      <div class="fields">
        <${Small} form=${form} set=${set} name="vote_n" testid="vote-n" />
        <${Small} form=${form} set=${set} name="vote_answer" testid="vote-answer" />
        <button data-testid="vote" disabled=${need || !node} onClick=${vote}>vote</button>
      </div>
      <div class="buttons">
        ${
          tree &&
          html`<a data-testid="export" class="button" href=${exportPath(tree.id)}
            download=${`tokenloop-${tree.id}.json`} onClick=${onExport}>export</a>`
        }
        <label class="import">
          import <input type="file" data-testid="import" accept=".json" onChange=${importFile} />
        </label>
      </div>
      <${TreeList} trees=${trees} current=${tree?.id} onOpen=${openTree} onDelete=${deleteTree} busy=${busy} />
    </aside>

    <main class="middle">
      <section class="panel tokens-panel">
        <div class="toolbar">
          colour by
          <select data-testid="color-by" value=${colorBy} onChange=${(e) => setColorBy(e.currentTarget.value)}>
            <option value="p">probability</option>
            <option value="entropy">entropy</option>
            <option value="rank">rank</option>
          </select>
          <span class="scale">${[...Array(10).keys()].map((i) => html`<span class=${`heat-${i}`}> </span>`)}</span>
          <span class="muted">${COLOR_HINT[colorBy]} · ←/→ token, ↑/↓ candidate, Enter branch, s step</span>
        </div>
        ${
          tree
            ? html`<${TokenView} tree=${tree} seq=${seq} index=${sel.index} colorBy=${colorBy}
              onSelect=${(i) => setSel((s) => ({ ...s, index: i }))} />`
            : html`<p class="muted">Write a prompt and press generate: every token is one trip round the loop.</p>`
        }
      </section>
      ${
        view &&
        html`<${NodeDetail} node=${node} view=${view} orders=${orders} selected=${cand} onSelect=${setCand}
        onBranch=${branchHere} busy=${busy} live=${Boolean(live)} />`
      }
      ${
        node &&
        html`<${LivePanel} values=${live ?? fieldsFromParams(tree.params, LIVE_FIELDS)} active=${Boolean(live)}
        onInput=${onLive} onReset=${() => setLive(null)} />`
      }
    </main>

    <aside class="right">
      ${
        tree &&
        html`<${TreePanel} tree=${tree} selected=${sel.branch} wouldFree=${kv?.would_free?.[sel.branch]}
        onSelect=${selectBranch} onDelete=${deleteBranch} busy=${busy} />`
      }
      ${tree?.vote && html`<${VotePanel} vote=${tree.vote} onSelect=${selectBranch} />`}
      ${tree && html`<${KvPanel} kv=${kv} tree=${tree} branch=${sel.branch} position=${token?.position} />`}
    </aside>
  </div>`;
}

render(html`<${App} />`, document.getElementById("app"));
