"""Between the API and the scheduler, as SGLang's tokenizer manager: a request's prompt, sampling
parameters and options are validated and tokenized into scheduler requests (Req), and the
scheduler's outputs are formatted as the API returns them (text, ids, meta_info with SGLang's
logprob fields). Used by Engine, on the caller's threads and the scheduler's output callbacks;
it holds no scheduler state."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from jinja2.exceptions import TemplateError

from baby_sgl.constrained.grammar import CompiledGrammar, GrammarCache, GrammarError
from baby_sgl.managers.io_struct import MAX_TOKEN_IDS_LOGPROB, LogprobBudget, ReqOptions
from baby_sgl.core.finish_reason import FinishAbort
from baby_sgl.core.req import LogprobState, Req, ReqOutput
from baby_sgl.lora.registry import LoRARegistry
from baby_sgl.sampling.logprobs import with_texts
from baby_sgl.core.sampling_params import SamplingParams, ServerGrammar, check_copies_budget
from baby_sgl.validation import validate, validate_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# Ordinary text runs at 2-6 characters a token. A text longer than the prompt limit times this
# is tokenized by a prefix of that size first: one that already fills the limit is refused
# without tokenizing the rest.
PREFIX_CHARS_PER_TOKEN = 16

# SGLang's meta_info names the weights that answered (updated in place by its RL training loop);
# ours never change after load: SGLang's default name.
WEIGHT_VERSION = "default"


@dataclass
class LogprobCursor:
    """How much of one request's logprobs its consumer has been given."""

    output: int = 0  # output entries
    prompt: bool = False  # the prompt's, which come all at once


def split_batch(prompt: Any, input_ids: Any, sampling_params: Any, rid: Any,
                prompt_name: str = "prompt") -> tuple[list[Any], list[Any], list[Any], bool]:
    """An SGLang request holds one prompt (text or ids) or a batch of them, with one sampling
    params dict and rid for all or a list of them: (prompts, their params, their rids, whether
    it held one). Raises ValueError naming what does not fit."""
    if (prompt is None) == (input_ids is None):
        raise ValueError(f"give exactly one of {prompt_name} or input_ids")
    single = isinstance(prompt, str) if prompt is not None else (not input_ids or isinstance(input_ids[0], int))
    given = prompt if prompt is not None else input_ids
    items = [given] if single else list(given)
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
    rids = rid if isinstance(rid, list) else [rid] * len(items)
    if len(params) != len(items) or len(rids) != len(items):
        raise ValueError(f"got {len(items)} prompts but {len(params)} sampling_params and {len(rids)} rids: "
                         "give one for all or one per prompt")
    return items, params, rids, single


class TokenizerManager:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, sampling_defaults: dict[str, Any], grammars: GrammarCache,
                 context_len: int, max_total_tokens: int, max_input_len: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.sampling_defaults, self.grammars = sampling_defaults, grammars
        self.context_len, self.max_total_tokens, self.max_input_len = context_len, max_total_tokens, max_input_len
        self.lora_registry: LoRARegistry | None = None  # set when LoRA adapters are served
        # No token is longer than this many characters, so a longer text is refused untokenized.
        self.max_prompt_chars = max_input_len * max(map(len, tokenizer.get_vocab()), default=1)
        self._token_texts: dict[int, str] = {}

    def make_reqs(self, prompt: Any, input_ids: Any, sampling_params: Any, rid: Any,
                  *, server_grammar: ServerGrammar | None = None, lora_path: str | list[str | None] | None = None,
                  **options: Any) -> tuple[list[Req | ValueError], bool]:
        """One Req per prompt (n per prompt sampled n times), or the ValueError that refused it.
        server_grammar: the constraint the server built (SamplingParams.server_grammar); lora_path:
        the LoRA adapter of all prompts or of each; options: the ReqOptions fields besides rid
        (logprobs)."""
        items, params, rids, single = split_batch(prompt, input_ids, sampling_params, rid)
        if isinstance(lora_path, list) and len(lora_path) != len(items):
            raise ValueError(f"lora_path: {len(lora_path)} adapters for {len(items)} prompts")
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * len(items)
        reqs: list[Req | ValueError] = []
        budget = LogprobBudget()
        for i, (item, sp, r) in enumerate(zip(items, params, rids)):
            try:
                lora_id = self.resolve_lora(loras[i])
                made = self.make_req(item, sp, r, options, server_grammar, budget)
                for req in made:
                    req.lora_id = lora_id
                reqs.extend(made)
            except ValueError as e:
                reqs.append(ValueError(f"request {i}: {e}" if not single else str(e)))
        return reqs, single

    def resolve_lora(self, name: str | None) -> str | None:
        """The adapter a request names, checked: ValueError for one not loaded."""
        if name is None:
            return None
        if self.lora_registry is None:
            raise ValueError("lora_path: LoRA adapters are not supported by this server (start it with "
                             "--enable-lora or --lora-paths)")
        return self.lora_registry.resolve(name)

    def make_req(self, item: str | list[int], sampling_params: dict[str, Any] | SamplingParams | None, rid: str | None,
                 options: dict[str, Any], server_grammar: ServerGrammar | None, budget: LogprobBudget) -> list[Req]:
        """The request's n Reqs. budget: the logprob entries of the call it is part of."""
        params = SamplingParams.from_dict(sampling_params, self.sampling_defaults, server_grammar)
        params.check_vocab(self.vocab_size)
        opts = validate(ReqOptions, {"rid": rid, **{k: v for k, v in options.items() if v is not None}})
        ids = self.prompt_ids(item)
        if len(ids) > self.max_input_len:
            raise ValueError(f"prompt is too long: {len(ids)} tokens, the limit is {self.max_input_len} "
                             f"(context length {self.context_len}, KV pool {self.max_total_tokens})")
        return_logprob = opts.return_logprob or opts.top_logprobs_num > 0 or opts.token_ids_logprob is not None
        start = None  # SGLang's -1: no prompt logprobs (the same as starting at the prompt's end)
        if return_logprob and opts.logprob_start_len >= 0:
            if opts.logprob_start_len > len(ids):
                raise ValueError(f"logprob_start_len={opts.logprob_start_len} is beyond the prompt's "
                                 f"{len(ids)} tokens")
            start = opts.logprob_start_len
        check_copies_budget("token_ids_logprob", len(opts.token_ids_logprob or []), params.n, MAX_TOKEN_IDS_LOGPROB)
        bad = [t for t in opts.token_ids_logprob or [] if t >= self.vocab_size]
        if bad:
            raise ValueError(f"token_ids_logprob holds token ids outside the vocabulary: {bad[:5]}")
        if return_logprob:
            positions = (len(ids) - start if start is not None else 0) + min(params.max_new_tokens, self.context_len - len(ids))
            width = 1 + opts.top_logprobs_num + len(opts.token_ids_logprob or [])
            budget.take(params.n * max(positions, 0) * width)
        grammar = self._grammar(params)
        reqs = [Req(r, ids, params) for r in self.copy_rids(opts.rid or uuid.uuid4().hex, params.n)]
        for req in reqs:
            req.logprobs = LogprobState(return_logprob, opts.top_logprobs_num, opts.token_ids_logprob or None,
                                        opts.return_text_in_logprobs, start)
            req.grammar = grammar.matcher() if grammar is not None else None
        return reqs

    def _grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The request's constraint, compiled here (off the scheduler). One the server built is
        refused in the name of what the client sent for it (tools), not as an ebnf it never sent."""
        if not params.grammar:
            return None
        try:
            return self.grammars.get(params.grammar)
        except GrammarError as e:
            if params.server_grammar is None:
                raise
            raise ValueError(f"the constraint built from {params.server_grammar.source} cannot be compiled: "
                             f"{e.reason}") from None

    @staticmethod
    def copy_rids(rid: str, n: int) -> list[str]:
        """The engine requests' rids of one prompt sampled n times."""
        return [rid] if n == 1 else [f"{rid}-{k}" for k in range(n)]

    def prompt_ids(self, item: Any) -> list[int]:
        """A prompt's token ids; a text is bounded before it is tokenized."""
        if isinstance(item, str):
            if not item:
                raise ValueError("prompt is empty")
            validate_text(item, "prompt")
            return self.encode(item)
        if not isinstance(item, (list, tuple)):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(item).__name__}")
        if not item:
            raise ValueError("input_ids is empty")
        if len(item) > self.max_input_len:
            raise ValueError(f"prompt is too long: {len(item)} tokens, the limit is {self.max_input_len}")
        vocab = self.vocab_size
        bad = [t for t in item if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return list(item)

    def result(self, req: Req, with_logprobs: bool = True) -> dict[str, Any]:
        return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": self.meta_info(req, with_logprobs)}

    def meta_info(self, req: Req, with_logprobs: bool = True, since: LogprobCursor | None = None) -> dict[str, Any]:
        ts = req.time_stats
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finished_reason and req.finished_reason.to_json(),
            "num_retractions": req.num_retractions,
            # Speculative decoding (as SGLang): verify passes in which the request had drafts, and
            # the drafts they accepted.
            "spec_verify_ct": req.spec.verify_ct,
            "spec_accepted_tokens": req.spec.accepted_tokens,
            "weight_version": WEIGHT_VERSION,
            "e2e_latency": (ts.finished or ts.created) - ts.created,
            "ttft": (ts.first_token - ts.created) if ts.first_token else None,
        }
        if req.logprobs.return_logprob and with_logprobs:
            meta.update(self.logprobs(req, since))
        return meta

    def logprobs(self, req: Req, since: LogprobCursor | None = None) -> dict[str, Any]:
        """SGLang's logprob fields of meta_info; prompt ones once they are all computed. With
        `since`, only what it has not counted yet (output entries past it, prompt ones once), and
        it is advanced: a stream's pieces then carry each entry once."""
        cursor, lp = since or LogprobCursor(), req.logprobs
        prompt = not req.input_logprobs_pending() and not cursor.prompt
        sides = ("output", "input") if prompt else ("output",)
        kinds = ["token_logprobs"] + ["top_logprobs"] * bool(lp.top_logprobs_num) + \
            ["token_ids_logprobs"] * (lp.token_ids_logprob is not None)
        fields = {f"{side}_{kind}": getattr(lp, f"{side}_{kind}")[cursor.output if side == "output" else 0:]
                  for kind in kinds for side in sides}
        if lp.return_text_in_logprobs:
            fields = {k: with_texts(v, self.token_text) for k, v in fields.items()}
        total = len(lp.output_token_logprobs)
        cursor.output, cursor.prompt = total, cursor.prompt or prompt
        # as SGLang: how many output logprobs there are so far, whatever a piece carries
        return fields | {"output_token_logprobs_length": total}

    def template_knows_tools(self) -> bool:
        """The chat template renders `tools` and tool calls itself (else they are written into
        the messages: entrypoints/chat.py)."""
        template = getattr(self.tokenizer, "chat_template", None) or ""
        return "tools" in (template if isinstance(template, str) else json.dumps(template))

    def token_text(self, token: int) -> str:
        """One token's text, special tokens included (return_text_in_logprobs); kept per engine
        (at most one per vocabulary entry), so nothing outlives the engine."""
        if token not in self._token_texts:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            assert isinstance(text, str)
            self._token_texts[token] = text
        return self._token_texts[token]

    @staticmethod
    def error_result(err: ValueError) -> dict[str, Any]:
        return {"text": "", "output_ids": [], "error": str(err),
                "meta_info": {"finish_reason": FinishAbort(str(err)).to_json()}}

    @staticmethod
    def check_session_logprobs(session_params: Any, options: dict[str, Any]) -> None:
        start = options.get("logprob_start_len")
        if session_params is not None and start is not None and start >= 0 and options.get("return_logprob"):
            raise ValueError("prompt logprobs (logprob_start_len >= 0) are not available for session turns")

    def chunk(self, out: ReqOutput, with_logprobs: bool = True,
              since: LogprobCursor | None = None) -> dict[str, Any]:
        """A scheduler output as the API shows it: the new text and ids, meta_info so far (its
        logprobs only those past `since`, when given)."""
        return {"text": out.text, "output_ids": out.output_ids,
                "meta_info": self.meta_info(out.req, with_logprobs, since), "finished": out.finished,
                "prompt_token_ids": out.req.origin_input_ids}

    def apply_chat_template(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        chars = len(json.dumps(tools)) if tools else 0
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                validate_text(content, f"messages[{i}].content")
                chars += len(content)
            if isinstance(m, dict) and m.get("tool_calls"):
                chars += len(json.dumps(m["tool_calls"]))
        if chars > self.max_prompt_chars:
            raise ValueError(f"prompt is too long: the messages hold {chars} characters, more than "
                             f"{self.max_input_len} tokens can hold")
        reserved = {"add_generation_prompt", "tokenize", "conversation", "messages", "chat_template", "tools",
                    "documents", "return_dict", "continue_final_message", "tokenizer_kwargs"}
        if clash := sorted(reserved & set(template_kwargs or {})):
            raise ValueError(f"chat_template_kwargs may not set {clash[0]!r}")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                      tools=cast(Any, tools), **(template_kwargs or {}))
        except TemplateError as e:  # the template's own refusal (raise_exception), e.g. roles out of order
            raise ValueError(f"the chat template refused the messages: {e}") from None
        return self.encode(cast(str, text), add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids, at a cost bounded by the prompt limit rather than by the text: a text
        longer than any max_input_len tokens can be is refused untokenized, and a long one is
        refused by its prefix alone when that already holds more tokens than the limit."""
        limit = self.max_input_len
        if len(text) > self.max_prompt_chars:
            raise ValueError(f"prompt is too long: {len(text)} characters, more than {limit} tokens can hold")
        window = limit * PREFIX_CHARS_PER_TOKEN
        if len(text) > window:
            # Cut before a space, where tokenizers split words anyway: the prefix's tokens are
            # the text's first tokens.
            cut = text.rfind(" ", window // 2, window)
            cut = cut if cut > 0 else window
            head = self.tokenizer.encode(text[:cut], add_special_tokens=add_special_tokens)
            if len(head) > limit:
                raise ValueError(f"prompt is too long: its first {cut} of {len(text)} characters already make more "
                                 f"than {limit} tokens, the limit (the rest was not read)")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

