// One place binds htm to Preact's h, so every module writes the same tagged templates (no build step, no JSX).
import { h } from "./vendor/preact.mjs";
import htm from "./vendor/htm.mjs";

export const html = htm.bind(h);
