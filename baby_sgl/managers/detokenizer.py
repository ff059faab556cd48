"""Incremental detokenization: text grows token by token and never splits a multi-byte character."""

from __future__ import annotations

from typing import TYPE_CHECKING

from baby_sgl.core.req import Req

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def detokenize_step(tokenizer: PreTrainedTokenizerBase, req: Req, final: bool) -> None:
    """Appends to req.text whatever the new output tokens complete.

    The text is the difference between decoding the window [surr_offset:] and its already
    emitted part [surr_offset:read_offset]: decoding with a little left context keeps
    tokenizers' spacing rules (SentencePiece's leading space) the same as a whole decode."""
    ids, p, d = req.output_ids, req.sampling_params, req.detok
    # spaces_between_special_tokens is honoured by the tokenizers that have the option (slow ones).
    kw = {"skip_special_tokens": p.skip_special_tokens, "spaces_between_special_tokens": p.spaces_between_special_tokens}
    prefix, full = (tokenizer.decode(part, **kw) for part in (ids[d.surr_offset : d.read_offset], ids[d.surr_offset :]))
    assert isinstance(prefix, str) and isinstance(full, str)
    # "\ufffd" at the end means a character's bytes are still incomplete: wait for more tokens.
    if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
        req.text += full[len(prefix) :]
        d.surr_offset, d.read_offset = d.read_offset, len(ids)
