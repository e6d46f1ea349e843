"""Incremental detokenization for streaming: token ids in, text out, cut at stop strings.

Each step decodes only a short window of ids (vLLM's prefix_offset/read_offset): the window's text
without the new ids is subtracted from its text with them, so a leading space or a character
spread over several byte tokens comes out right, and text ending in a partial character waits.
"""

from __future__ import annotations

from tokenloop.tokenizer.tokenizer import Tokenizer

# How many prompt tokens seed the first window, so the first generated token decodes in context.
_INITIAL_WINDOW = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids)
        self._prefix_offset = max(len(self._ids) - _INITIAL_WINDOW, 0)  # window start
        self._read_offset = len(self._ids)  # ids before this are already in the text
        self._text = ""
        self._streamed = 0  # characters of _text already handed out by stream_delta
        # a stop string may start in text that is already out, so a stream keeps this many characters back
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    @property
    def output_text(self) -> str:
        """The generated text so far, never including a stop string."""
        return self._text

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append generated ids; return the stop string the text now contains (text cut right before it), else None."""
        self._ids.extend(new_token_ids)
        old_len = len(self._text)
        self._text += self._decode_new()
        return self._find_stop(old_len)

    def stream_delta(self, finished: bool) -> str:
        """Text not handed out before; until finished, the last characters that could begin a stop string wait."""
        end = len(self._text) if finished else max(len(self._text) - self._holdback, self._streamed)
        delta = self._text[self._streamed : end]
        self._streamed = end
        return delta

    def _decode_new(self) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        full = decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        # "\ufffd" at the end is a character whose remaining bytes are still to come
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    def _find_stop(self, old_len: int) -> str | None:
        """Earliest stop string that ends in the new text; only the tail where one could be is searched."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self._text.find(s, max(old_len - len(s) + 1, 0))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self._text = self._text[: best[0]]
        return best[1]
