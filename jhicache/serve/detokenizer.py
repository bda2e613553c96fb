"""IncrementalDetokenizer: generated token ids in, text out as soon as it is final; a character
whose bytes span several tokens is held back until its last byte has arrived."""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence
# Prompt tokens decoded ahead of the output: decoders drop or add a leading space depending on
# what precedes a token, so the first output token is decoded after a little of the prompt.
CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Streams the text of a growing list of token ids.

    Each `push` decodes a short window: the tokens already shown last time (`_start` to
    `_shown`, decoded for context) and everything after. The text past the context's own
    decoding is new, unless it ends in U+FFFD, which means a multi-byte character is still
    incomplete: then nothing is released until a later token completes it. Decoding a window
    rather than the whole output keeps each push short however long the output grows.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt[-CONTEXT_TOKENS:]) if CONTEXT_TOKENS else []
        self._start = 0  # first id of the decoding window
        self._shown = len(self._ids)  # ids whose text has been released
        self.text = ""  # everything released so far

    def push(self, ids: Sequence[int]) -> str:
        """Adds generated ids; returns the text they complete (maybe "")."""
        self._ids.extend(ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Releases what is left, an incomplete character included (the output ended there)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._shown == len(self._ids):
            return ""
        context = self._decode(self._ids[self._start:self._shown])
        window = self._decode(self._ids[self._start:])
        if len(window) <= len(context) or (window.endswith(REPLACEMENT_CHAR) and not final):
            return ""  # a special token that decodes to nothing, or a character still split
        delta = window[len(context):]
        self._start, self._shown = self._shown, len(self._ids)
        self.text += delta
        return delta
