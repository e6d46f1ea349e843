// Talks to /explore/api on this origin only. Every failure becomes an ApiError the page shows in its error line,
// so an expected 4xx never escapes as an uncaught promise.

const KEY_STORE = "tokenloop-explore-key";

// The optional API key arrives as #key=... (a fragment never reaches server logs); keep it for this tab only.
const fromHash = new URLSearchParams(location.hash.slice(1)).get("key");
if (fromHash) sessionStorage.setItem(KEY_STORE, fromHash);
const apiKey = sessionStorage.getItem(KEY_STORE);

export class ApiError extends Error {}

function headers(json) {
  const out = {};
  if (apiKey) out.Authorization = `Bearer ${apiKey}`;
  if (json) out["Content-Type"] = "application/json";
  return out;
}

/** method + path under /explore/api; body: an object (sent as JSON), a string (sent as is) or undefined. */
export async function api(method, path, body) {
  const init = { method, headers: headers(body !== undefined) };
  if (body !== undefined) init.body = typeof body === "string" ? body : JSON.stringify(body);
  let res;
  try {
    res = await fetch(`/explore/api${path}`, init);
  } catch (e) {
    throw new ApiError(`${method} ${path}: ${e.message}`);
  }
  const text = await res.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    // a non-JSON body is only ever an error page; its status line says enough
  }
  if (!res.ok) throw new ApiError(data?.error?.message ?? `${method} ${path}: ${res.status} ${res.statusText}`);
  return data;
}

export const exportPath = (treeId) => `/explore/api/trees/${treeId}/export`;
export const needsKey = () => Boolean(apiKey);

/** A plain link cannot send the Authorization header: fetch the export, then save it through an object URL. */
export async function downloadExport(treeId) {
  const res = await fetch(exportPath(treeId), { headers: headers(false) });
  if (!res.ok) throw new ApiError(`export ${treeId}: ${res.status} ${res.statusText}`);
  const url = URL.createObjectURL(await res.blob());
  const a = document.createElement("a");
  a.href = url;
  a.download = `tokenloop-${treeId}.json`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}
