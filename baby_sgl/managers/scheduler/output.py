"""What the scheduler does with a pass's logits (a part of the Scheduler, run in its thread):
samples the next token of each request (the sampler sees only the batch's SamplingBatch), advances
it with its token and logprobs (grammar, stop tokens, lengths, detokenizing, stop strings and
regexes), finishes and releases it, and emits its new text and ids to whoever waits. A request
ends here whatever ends it (`finish`, `fail`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from baby_sgl.constrained.grammar import ConstraintError
from baby_sgl.core.finish_reason import FinishAbort, FinishLength, FinishMatched, FinishReason
from baby_sgl.core.forward_batch import ForwardMode
from baby_sgl.core.req import ReqOutput, TokenLogprobs
from baby_sgl.core.sampling_params import STOP_WINDOW
from baby_sgl.managers.detokenizer import Detokenizer
from baby_sgl.sampling.sampling_batch import SamplingBatch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from baby_sgl.core.req import Req
    from baby_sgl.managers.activity import Activity
    from baby_sgl.managers.scheduler.batch import ScheduleBatch
    from baby_sgl.managers.scheduler.queues import RequestQueues
    from baby_sgl.managers.session_controller import SessionController
    from baby_sgl.mem_cache.base_prefix_cache import BasePrefixCache
    from baby_sgl.sampling.sampler import Sampler
    from baby_sgl.speculative.ngram import NgramDrafter

logger = logging.getLogger(__name__)

# A request's share of the sampling: its token and, if it asked for them, the token's logprobs.
Sampled = tuple[int, TokenLogprobs | None]


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: set[int], context_len: int,
                 sampler: Sampler, tree_cache: BasePrefixCache[Any], sessions: SessionController,
                 drafter: NgramDrafter | None, queues: RequestQueues, stats: dict[str, int], activity: Activity) -> None:
        self.detokenizer, self.eos_token_ids, self.context_len = Detokenizer(tokenizer), eos_token_ids, context_len
        self.sampler, self.tree_cache, self.sessions, self.drafter = sampler, tree_cache, sessions, drafter
        self.queues, self.stats, self.activity = queues, stats, activity

    def process_result(self, batch: ScheduleBatch, logits: torch.Tensor) -> list[Req]:
        """Each request's share of the pass, one at a time: an error in one (sampling, the
        detokenizer, a stop check, its session) ends that request alone. Returns those that go on
        decoding."""
        tokens = self.sample(logits, batch.reqs)
        still_running = []
        num_extend = 0 if batch.mode == ForwardMode.DECODE else len(batch.reqs) - batch.num_decode_reqs
        for i, (req, seq_len, token) in enumerate(zip(batch.reqs, batch.seq_lens, tokens)):
            req.kv.kv_len = seq_len
            if self.guarded(req, partial(self._advance, req, i < num_extend, token)):
                still_running.append(req)
        return still_running

    def guarded(self, req: Req, step: Callable[[], bool]) -> bool:
        """Runs one request's share of a pass (step: True if it keeps decoding); an error, or an
        exception in place of its token, ends that request alone (False)."""
        try:
            return step()
        except ConstraintError as e:  # the request's own constraint, not our error
            logger.warning("request %s: %s", req.rid, e)
            self.finish(req, FinishAbort(str(e)))
        except Exception as e:
            logger.exception("request %s failed", req.rid)
            self.fail(req, f"internal error while handling this request: {e!r}")
        return False

    def _needs_token(self, req: Req) -> bool:
        return not req.kv.is_chunked and not req.to_abort and req.sampling_params.max_new_tokens > 0

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> list[Sampled | Exception | None]:
        """The next token of every request that gets one (None for the others). Sampling is
        batched; if the batch fails, each row is sampled alone so one bad row fails one request."""
        rows = [i for i, r in enumerate(reqs) if self._needs_token(r)]
        out: list[Sampled | Exception | None] = [None] * len(reqs)
        if not rows:
            return out
        try:
            batch_logits = logits if len(rows) == len(reqs) else logits[rows]
            result = self.sampler.sample(batch_logits, SamplingBatch.from_reqs([reqs[i] for i in rows]))
            for i, token, logprobs in zip(rows, result.tokens, result.logprobs):
                out[i] = token, logprobs
            return out
        except ConstraintError as e:  # a client's constraint, not a fault of ours: no traceback
            logger.info("a constraint left a request no token (%s); sampling row by row", e)
        except Exception:
            logger.exception("batched sampling failed; sampling row by row")
        for i in rows:
            try:
                out[i] = self.sample_one(logits[i : i + 1], reqs[i])
            except Exception as e:
                out[i] = e
        return out

    def sample_one(self, logits: torch.Tensor, req: Req) -> Sampled:
        result = self.sampler.sample(logits, SamplingBatch.from_reqs([req]))
        return result.tokens[0], result.logprobs[0]

    def _advance(self, req: Req, extended: bool, sampled: Sampled | Exception | None) -> bool:
        """Applies one pass to one request (`extended`: the pass computed part of its prompt
        rather than one decode step); True if it keeps decoding."""
        if isinstance(sampled, Exception):  # its sampling failed
            raise sampled
        if req.kv.is_chunked:  # more of its prompt to come; it stays the chunked request
            self.tree_cache.cache_unfinished_req(req)
            return False
        if req.to_abort:
            self.finish(req, FinishAbort(req.to_abort))
            return False
        ts = req.time_stats
        if ts.first_token is None:  # prefill complete: its first token; its prompt counted once
            ts.first_token = time.perf_counter()
            self.stats["prompt_tokens"] += len(req.origin_input_ids)
            self.stats["cached_tokens"] += req.cached_tokens
            self.activity.record_ttft(ts.first_token - ts.created)
        if sampled is None:  # max_new_tokens == 0: prefill only, the prompt stays in the cache
            self.finish(req, FinishLength(0))
            return False
        self.append_token(req, *sampled)
        if req.finished:
            self.release(req)
        elif extended:
            self.tree_cache.cache_unfinished_req(req)
        self.emit(req)
        return not req.finished

    def append_token(self, req: Req, token: int, logprobs: TokenLogprobs | None) -> None:
        if req.grammar is not None:  # raises ConstraintError if the token breaks the constraint
            req.grammar.accept_token(token)
        req.output_ids.append(token)
        if logprobs is not None:
            req.logprobs.add_output(logprobs)
        self.stats["generation_tokens"] += 1
        p = req.sampling_params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            req.finished_reason = FinishMatched(token)
        elif len(req.output_ids) >= p.max_new_tokens or req.seqlen >= self.context_len:
            req.finished_reason = FinishLength(len(req.output_ids))
        elif req.grammar is not None and req.grammar.is_terminated():
            req.finished_reason = FinishMatched(token)
        text_before = len(req.text)
        self.detokenizer.step(req, final=req.finished)
        if not req.finished and len(req.text) > text_before:  # only new text can complete a stop
            if p.stop:
                self._check_stop_strings(req, max(0, text_before - max(map(len, p.stop)) + 1))
            if not req.finished and p.stop_regex:
                self._check_stop_regex(req, max(0, text_before - STOP_WINDOW))

    def _check_stop_strings(self, req: Req, start: int) -> None:
        """Looks for a stop string in the text that could contain one only now."""
        hits = [(pos, s) for s in req.sampling_params.stop if (pos := req.text.find(s, start)) >= 0]
        if hits:
            pos, matched = min(hits)
            if not req.sampling_params.no_stop_trim:
                req.text = req.text[:pos]
            req.finished_reason = FinishMatched(matched)

    @staticmethod
    def _check_stop_regex(req: Req, start: int) -> None:
        """As SGLang, a search of the output text (which is kept whole), for a match beginning at
        `start` or later: one ending in the new text, at most STOP_WINDOW characters long. The
        character before `start` is given as context, for ^ and \\b."""
        context = max(0, start - 1)
        window = req.text[context:]
        p = req.sampling_params
        for pattern, regex in zip(p.stop_regex, p.stop_regexes):
            if regex.search(window, start - context):
                req.finished_reason = FinishMatched(pattern)
                return

    def finish(self, req: Req, reason: FinishReason) -> None:
        req.finished_reason = reason
        self.release(req)
        self.emit(req)

    def fail(self, req: Req, message: str) -> None:
        """Ends one request with an error, wherever it is; whatever it held is released."""
        self.stats["num_failed_reqs"] += 1
        self.queues.discard(req)
        self.finish(req, FinishAbort(message))  # releasing is idempotent

    def release(self, req: Req) -> None:
        """A finished request's KV goes back through the cache layer, unless its streaming
        session keeps the row for the next turn."""
        if not self.sessions.keep_row(req):
            self.tree_cache.release_req(req)
        self.sessions.turn_ended(req)
        if self.drafter is not None:  # its text joins what later requests may draft from
            self.drafter.add_cached_text(req.fill_ids)
        req.spec.drafts = None  # its own index of its text: no later step drafts for it

    def emit(self, req: Req) -> None:
        """Sends the new text and ids to whoever waits for this request (stream) or the whole
        result when it finishes."""
        interval = req.sampling_params.stream_interval
        if req.finished:
            req.time_stats.finished = time.perf_counter()
        elif not req.stream:
            return
        elif interval and req.detok.sent_ids_len and len(req.output_ids) - req.detok.sent_ids_len < interval:
            return  # stream_interval: a piece every `interval` tokens (the first at once)
        sent = req.detok
        text_end = len(req.text)
        if not req.finished and req.sampling_params.stop:
            # Hold back what could still become the start of a stop string.
            text_end = max(sent.sent_text_len, text_end - max(map(len, req.sampling_params.stop)) + 1)
        out = ReqOutput(req, req.text[sent.sent_text_len : text_end], req.output_ids[sent.sent_ids_len :],
                        req.finished, req.finished_reason)
        sent.sent_text_len, sent.sent_ids_len = text_end, len(req.output_ids)
        if req.on_output is None:
            return
        try:
            req.on_output(out)
        except Exception as e:  # the consumer's code, not ours: end its request, nothing else
            logger.exception("output callback of request %s failed", req.rid)
            if not req.finished:
                req.to_abort = f"its output callback failed: {e!r}"
