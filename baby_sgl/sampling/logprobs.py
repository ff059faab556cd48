"""Log-probabilities as SGLang returns them: (logprob, token_id, text-or-None) per token.

Output tokens: the distribution the token was drawn from (after penalties, the grammar mask and
logit_bias; divided by the temperature when sampled), its top-k, and the ids the request asked
for (token_ids_logprob).

Prompt tokens, from `logprob_start_len` = s on: entry 0 is (None, token[s]) (nothing predicts
it here), entry j is the model's log-probability of token[s + j] given token[:s + j], from the
hidden state at position s + j - 1. So positions s .. L - 2 of a prompt of L tokens must be
computed in this request's own extend passes: the prefix cache serves at most s tokens of it
(`max_prefix_len`). Under chunked prefill the entries gather chunk by chunk; after a retraction
they are complete already and are not computed again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from baby_sgl.core.req import LogprobState, Req

_LOGITS_SLICE_ROWS = 256  # prompt rows turned into vocabulary logits at once (bounds memory)
# A token the grammar (or min_new_tokens) forbids has probability 0: its logprob is reported as
# this floor, as OpenAI does, because -inf is not valid JSON.
LOGPROB_FLOOR = -9999.0


def _finite(logprobs: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(logprobs, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR, posinf=0.0).clamp_(min=LOGPROB_FLOOR)


@dataclass
class InputLogprobSpan:
    req: Req
    first_pos: int  # absolute position of the first hidden row (predicts token first_pos + 1)
    count: int


def plan_input_logprobs(reqs: list[Req], prefix_lens: list[int], seq_lens: list[int],
                        num_extend: int) -> tuple[list[int], list[InputLogprobSpan]]:
    """The token rows of an extend (or mixed) pass whose hidden states give prompt logprobs:
    for each extending request, the positions of [prefix, seq) that predict a prompt token
    not yet scored."""
    rows: list[int] = []
    spans: list[InputLogprobSpan] = []
    offset = 0
    for i, (req, a, b) in enumerate(zip(reqs, prefix_lens, seq_lens)):
        if i < num_extend and req.input_logprobs_pending():
            lp = req.logprobs
            start = lp.start_len
            assert start is not None, "a request with pending prompt logprobs has a start"
            next_pos = start + len(lp.input_token_logprobs) - 1 if lp.input_token_logprobs else start
            first, last = max(next_pos, a), min(len(req.origin_input_ids) - 1, b)
            assert a <= next_pos or first >= last, "prompt logprob positions were served from the cache"
            if not lp.input_token_logprobs:
                lp.input_token_logprobs.append([None, req.origin_input_ids[start], None])
                if lp.top_logprobs_num:
                    lp.input_top_logprobs.append(None)
                if lp.token_ids_logprob is not None:
                    lp.input_token_ids_logprobs.append(None)
            if last > first:
                rows.extend(range(offset + first - a, offset + last - a))
                spans.append(InputLogprobSpan(req, first, last - first))
        offset += b - a
    return rows, spans


def record_input_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                          spans: list[InputLogprobSpan]) -> None:
    """Scores each span's next prompt tokens from its hidden rows, a slice at a time."""
    row = 0
    for span in spans:
        req, ids = span.req, span.req.origin_input_ids
        for lo in range(0, span.count, _LOGITS_SLICE_ROWS):
            n = min(_LOGITS_SLICE_ROWS, span.count - lo)
            logprobs = _finite(torch.log_softmax(compute_logits(hidden[row + lo : row + lo + n]), dim=-1))
            targets = ids[span.first_pos + lo + 1 : span.first_pos + lo + 1 + n]
            picked = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None]).squeeze(1).tolist()
            req.logprobs.input_token_logprobs.extend([lp, t, None] for lp, t in zip(picked, targets))
            _record_extras(logprobs, req.logprobs, req.logprobs.input_top_logprobs, req.logprobs.input_token_ids_logprobs)
        row += span.count


def record_output_logprobs(logprobs: torch.Tensor, reqs: list[Req], ids: list[int]) -> None:
    """logprobs: [len(reqs), vocab] log-probabilities the rows' tokens were chosen from."""
    rows = [i for i, r in enumerate(reqs) if r.logprobs.return_logprob]
    if not rows:
        return
    logprobs = _finite(logprobs)
    picked = logprobs[rows].gather(1, torch.tensor([ids[i] for i in rows], device=logprobs.device)[:, None]).squeeze(1).tolist()
    for j, i in enumerate(rows):
        lp = reqs[i].logprobs
        lp.output_token_logprobs.append([picked[j], ids[i], None])
        _record_extras(logprobs[i : i + 1], lp, lp.output_top_logprobs, lp.output_token_ids_logprobs)


def _record_extras(logprobs: torch.Tensor, req: LogprobState, top_out: list, ids_out: list) -> None:
    """Top-k and the requested ids' log-probabilities of each row."""
    if req.top_logprobs_num:
        top = logprobs.topk(req.top_logprobs_num, dim=-1)
        for vals, idx in zip(top.values.tolist(), top.indices.tolist()):
            top_out.append([[v, t, None] for v, t in zip(vals, idx)])
    if req.token_ids_logprob is not None:
        wanted = req.token_ids_logprob
        for vals in logprobs[:, wanted].tolist():
            ids_out.append([[v, t, None] for v, t in zip(vals, wanted)])


def with_texts(entries: list, token_text: Callable[[int], str]) -> list:
    """A logprob list (of entries, or of lists of entries, or None) with each token's text filled."""
    out: list = []
    for e in entries:
        if e is None:
            out.append(None)
        elif not e or isinstance(e[0], list):
            out.append([[v, t, token_text(t)] for v, t, _ in e])
        else:
            out.append([e[0], e[1], token_text(e[1])])
    return out
