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

These functions compute the entries; the scheduler writes them into the requests (LogprobState).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from baby_sgl.core.req import LogprobEntry, Req, TokenLogprobs
from baby_sgl.sampling.sampling_batch import LogprobQuery

_LOGITS_SLICE_ROWS = 256  # prompt rows turned into vocabulary logits at once (bounds memory)
# A token the grammar (or min_new_tokens) forbids has probability 0: its logprob is reported as
# this floor, as OpenAI does, because -inf is not valid JSON.
LOGPROB_FLOOR = -9999.0


def _finite(logprobs: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(logprobs, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR, posinf=0.0).clamp_(min=LOGPROB_FLOOR)


@dataclass
class InputLogprobSpan:
    req: Req
    query: LogprobQuery
    targets: list[int]  # the prompt tokens its rows predict, one per row
    head: int | None  # the first prompt token scored (no entry of its own yet): recorded before the others


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
            lp, ids = req.logprobs, req.origin_input_ids
            start = lp.start_len
            assert start is not None, "a request with pending prompt logprobs has a start"
            next_pos = start + len(lp.input_token_logprobs) - 1 if lp.input_token_logprobs else start
            first, last = max(next_pos, a), min(len(ids) - 1, b)
            assert a <= next_pos or first >= last, "prompt logprob positions were served from the cache"
            head = None if lp.input_token_logprobs else ids[start]
            query = LogprobQuery(lp.top_logprobs_num, lp.token_ids_logprob)
            if last > first:
                rows.extend(range(offset + first - a, offset + last - a))
                spans.append(InputLogprobSpan(req, query, ids[first + 1 : last + 1], head))
            elif head is not None:
                spans.append(InputLogprobSpan(req, query, [], head))
        offset += b - a
    return rows, spans


def input_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor | None,
                   spans: list[InputLogprobSpan]) -> list[list[TokenLogprobs]]:
    """Each span's entries for its target prompt tokens, from its hidden rows a slice at a time
    (hidden: None when no span has a target, the pass then computed none)."""
    out: list[list[TokenLogprobs]] = []
    row = 0
    for span in spans:
        entries: list[TokenLogprobs] = []
        for lo in range(0, len(span.targets), _LOGITS_SLICE_ROWS):
            assert hidden is not None, "the pass computed no hidden states for prompt logprobs"
            targets = span.targets[lo : lo + _LOGITS_SLICE_ROWS]
            logprobs = _finite(torch.log_softmax(compute_logits(hidden[row + lo : row + lo + len(targets)]), dim=-1))
            entries += _entries(logprobs, targets, span.query)
        out.append(entries)
        row += len(span.targets)
    return out


def output_logprobs(logprobs: torch.Tensor, ids: list[int],
                    queries: list[LogprobQuery | None]) -> list[TokenLogprobs | None]:
    """logprobs: [rows, vocab] log-probabilities the rows' tokens were chosen from."""
    rows = [i for i, q in enumerate(queries) if q is not None]
    out: list[TokenLogprobs | None] = [None] * len(ids)
    logprobs = _finite(logprobs)
    for i in rows:
        query = queries[i]
        assert query is not None
        out[i] = _entries(logprobs[i : i + 1], [ids[i]], query)[0]
    return out


def _entries(logprobs: torch.Tensor, targets: list[int], query: LogprobQuery) -> list[TokenLogprobs]:
    """The entries of each row's target token, top-k and requested ids."""
    picked = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None]).squeeze(1).tolist()
    tops: list[list[LogprobEntry] | None] = [None] * len(targets)
    wanted: list[list[LogprobEntry] | None] = [None] * len(targets)
    if query.top_k:
        top = logprobs.topk(query.top_k, dim=-1)
        tops = [[[v, t, None] for v, t in zip(vals, idx)] for vals, idx in zip(top.values.tolist(), top.indices.tolist())]
    if query.token_ids is not None:
        ids = query.token_ids
        wanted = [[[v, t, None] for v, t in zip(vals, ids)] for vals in logprobs[:, ids].tolist()]
    return [TokenLogprobs([lp, t, None], top, w) for lp, t, top, w in zip(picked, targets, tops, wanted)]


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
