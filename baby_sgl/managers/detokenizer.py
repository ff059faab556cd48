"""Incremental detokenization: text grows token by token and never splits a multi-byte character.

Each step decodes a short window of the latest output tokens and sends the part of its text not
sent yet. Trailing "\ufffd"s are held back: they may be a character whose bytes are still
incomplete, which a later token completes (with SentencePiece's byte tokens a whole run of
bytes decodes to "\ufffd"s until its last character is complete). The window starts a few
tokens back, so tokenizers' spacing rules (SentencePiece's leading space, which a decode drops
from its first token only) give the text a whole decode gives. Work per step is bounded
whatever the tokens: tokens the decode skips (special tokens, when skip_special_tokens is set)
never enter the window, a window longer than WINDOW_MAX tokens is cut where its text is
complete and splits cleanly, and one that reaches WINDOW_LIMIT tokens without (a run of bytes
that form no character) is sent as it decodes and started afresh."""

from __future__ import annotations

from typing import TYPE_CHECKING

from baby_sgl.core.req import Req

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A window longer than WINDOW_MAX tokens is cut to its last WINDOW_KEEP or a few more. Valid text
# is complete every few tokens (a character's UTF-8 bytes span at most four); none in
# WINDOW_LIMIT tokens means bytes that form no character (or, in theory, tokens that each end
# inside a character), whose "\ufffd"s are sent then.
WINDOW_MAX, WINDOW_KEEP, WINDOW_LIMIT = 8, 4, 64


def _trailing_unknowns(text: str) -> int:
    return len(text) - len(text.rstrip("\ufffd"))


class Detokenizer:
    """Turns each request's new output ids into text (Req.text), a step at a time."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        # What skip_special_tokens removes before decoding: the named special tokens and the
        # added tokens marked special.
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_ids = frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}

    def _decode(self, req: Req, ids: list[int]) -> str:
        p = req.sampling_params
        # spaces_between_special_tokens is honoured by the tokenizers that have the option (slow ones).
        text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens,
                                     spaces_between_special_tokens=p.spaces_between_special_tokens)
        assert isinstance(text, str)
        return text

    def step(self, req: Req, final: bool) -> None:
        """Appends to req.text whatever the output ids not read yet complete (all of it if final)."""
        d = req.detok
        new = req.output_ids[d.read_offset :]
        d.read_offset = len(req.output_ids)
        if req.sampling_params.skip_special_tokens:
            new = [t for t in new if t not in self.special_ids]
        if not new and not final:
            return
        d.window += new
        text = self._decode(req, d.window)
        held = 0 if final else _trailing_unknowns(text)
        if len(text) - held > d.window_sent:
            req.text += text[d.window_sent : len(text) - held]
            d.window_sent = len(text) - held
        if len(d.window) > WINDOW_LIMIT:  # never a clean cut: bytes that form no character, sent as they are
            req.text += text[d.window_sent :]
            d.window, d.window_sent = [], 0
        elif len(d.window) > WINDOW_MAX and not held:
            self._cut(req, text)

    def _cut(self, req: Req, text: str) -> None:
        """Starts the window (its text all sent) at a later token c where the text splits
        cleanly: the tokens before c decode alone to the start of the text and those from c to
        its end (which may lack the space a decode drops from its first token)."""
        d = req.detok
        n = len(d.window)
        for c in range(n - WINDOW_KEEP, max(0, n - WINDOW_MAX), -1):
            kept = self._decode(req, d.window[c:])
            if kept and text.endswith(kept) and text.startswith(self._decode(req, d.window[:c])):
                d.window, d.window_sent = d.window[c:], len(kept)
                return
