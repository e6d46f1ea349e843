// Pure helpers over the API's JSON (no rendering): a branch's token sequence, token text for display, colour
// buckets, stage column order, and the sampling settings as form strings <-> Params.

export const branchById = (tree, id) => tree.branches.find((b) => b.id === id);

/** A branch's generated tokens as the model saw them: its ancestors' tokens before its start, then its own.
 * Each token keeps the node id of the branch that generated it (that is where its detail lives). */
export function branchSequence(tree, branchId) {
  const branch = branchById(tree, branchId);
  if (!branch) return [];
  const before = branch.parent ? branchSequence(tree, branch.parent).filter((t) => t.position < branch.start) : [];
  const own = branch.token_ids.map((tokenId, i) => ({
    node: `${branch.id}:${branch.start + i}`,
    branch: branch.id,
    position: branch.start + i,
    token_id: tokenId,
    text: branch.texts[i],
    p: branch.p[i],
    entropy: branch.entropy[i],
    rank: branch.rank[i],
    how: branch.how[i],
    spec: branch.spec?.[i] ?? null,
  }));
  return before.concat(own);
}

/** Branches in tree order (each followed by its descendants), with their depth for indentation. */
export function branchOutline(tree) {
  const out = [];
  const visit = (parent, depth) => {
    for (const b of tree.branches) {
      if (b.parent === parent) {
        out.push({ branch: b, depth });
        visit(b.id, depth + 1);
      }
    }
  };
  visit(null, 0);
  return out;
}

export const pct = (p) => `${(p * 100).toFixed(1)}%`;
export const hexBytes = (hex) => (hex ? hex.match(/../g).join(" ") : "");

const ESCAPES = { "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t" };

/** JSON-style escapes without the quotes, so " the" stays readable and "\n" is visible in a candidate list. */
export const escapeToken = (text) =>
  text.replace(/[\\\u0000-\u001f\u007f]/g, (c) => ESCAPES[c] ?? `\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}`);

/** Running text keeps its line breaks but shows them: a newline becomes ↵ plus the break itself. */
export const visibleText = (text) => text.replace(/\r/g, "␍").replace(/\t/g, "⇥").replace(/\n/g, "↵\n");

/** Colour bucket 0 (expected) .. 9 (surprising) of a token under the chosen colouring. */
export function heat(token, colorBy) {
  if (colorBy === "entropy") return Math.min(9, Math.floor(token.entropy / 0.4)); // 0 .. 3.6+ nats
  if (colorBy === "rank") return Math.min(9, Math.ceil(Math.log2(token.rank) * 1.5)); // rank 1 -> 0, 64+ -> 9
  return Math.min(9, Math.floor((1 - token.p) * 10));
}

/** Display order (candidate indices) of each stage column. The first stage is sorted by p; every later one leaves
 * the tokens it does not keep where they stood in the previous column, and sorts the kept ones by its own p into
 * the remaining slots, so a removed token stays in place, greyed. */
export function stageOrders(stages, numCandidates) {
  let prev = [...Array(numCandidates).keys()];
  return stages.map((stage) => {
    const kept = prev.filter((c) => stage.kept[c]).sort((a, b) => stage.p[b] - stage.p[a]); // stable: ties keep order
    let k = 0;
    prev = prev.map((c) => (stage.kept[c] ? kept[k++] : c));
    return prev;
  });
}

// The sampling settings. kind: num | int | bias ("id:bias, id:bias") | json (a JSON value) | text (null if blank).
export const FIELDS = [
  { key: "temperature", testid: "temperature", kind: "num", def: 1.0, live: true },
  { key: "top_k", testid: "top-k", kind: "int", def: -1, live: true },
  { key: "top_p", testid: "top-p", kind: "num", def: 1.0, live: true },
  { key: "min_p", testid: "min-p", kind: "num", def: 0.0, live: true },
  { key: "seed", testid: "seed", kind: "int", def: null },
  { key: "repetition_penalty", testid: "repetition-penalty", kind: "num", def: 1.0, live: true },
  { key: "presence_penalty", testid: "presence-penalty", kind: "num", def: 0.0, live: true },
  { key: "frequency_penalty", testid: "frequency-penalty", kind: "num", def: 0.0, live: true },
  { key: "no_repeat_ngram_size", testid: "no-repeat-ngram", kind: "int", def: 0 },
  { key: "min_tokens", testid: "min-tokens", kind: "int", def: 0 },
  { key: "logit_bias", testid: "logit-bias", kind: "bias", def: {}, live: true },
  { key: "json_schema", testid: "json-schema", kind: "json", def: null, live: true },
  { key: "regex", testid: "regex", kind: "text", def: null, live: true },
];
export const LIVE_FIELDS = FIELDS.filter((f) => f.live);

function parseField(f, raw) {
  const text = raw.trim();
  if (f.kind === "num" || f.kind === "int") {
    if (text === "") return f.def;
    const v = Number(text);
    if (!Number.isFinite(v) || (f.kind === "int" && !Number.isInteger(v))) {
      throw new Error(`${f.testid}: expected ${f.kind === "int" ? "an integer" : "a number"}, got "${raw}"`);
    }
    return v;
  }
  if (f.kind === "bias") {
    const bias = {};
    for (const part of text.split(",").filter((s) => s.trim())) {
      const m = part.trim().match(/^(\d+)\s*:\s*(-?\d+(?:\.\d+)?)$/);
      if (!m) throw new Error(`logit-bias: expected "id:bias, id:bias", got "${part.trim()}"`);
      bias[m[1]] = Number(m[2]);
    }
    return bias;
  }
  if (f.kind === "json") {
    if (text === "") return null;
    try {
      return JSON.parse(text);
    } catch (e) {
      throw new Error(`json-schema: not valid JSON (${e.message})`);
    }
  }
  return text === "" ? null : raw;
}

/** Params from form strings; fields missing from `values` keep their value in `base`. Throws on bad input. */
export function paramsFromFields(values, base = {}) {
  const params = { ...base };
  for (const f of FIELDS) if (f.key in values) params[f.key] = parseField(f, values[f.key]);
  return params;
}

/** Form strings for the given fields from Params (absent fields show their default). */
export function fieldsFromParams(params, fields = FIELDS) {
  const out = {};
  for (const f of fields) {
    const v = params?.[f.key] ?? f.def;
    if (f.kind === "bias")
      out[f.key] = Object.entries(v ?? {})
        .map(([id, b]) => `${id}:${b}`)
        .join(", ");
    else if (f.kind === "json") out[f.key] = v === null ? "" : JSON.stringify(v);
    else out[f.key] = v === null ? "" : String(v);
  }
  return out;
}
