"""Incremental detokenization (managers/detokenizer.py): the streamed text is a whole decode's,
characters are sent once complete, and the work per step is bounded whatever the tokens are
(a run of special tokens or of bytes that never form a character once cost a decode of the whole
run at every step)."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from baby_sgl.core.req import Req
from baby_sgl.core.sampling_params import SamplingParams
from baby_sgl.managers.detokenizer import WINDOW_LIMIT, WINDOW_MAX, Detokenizer

SPECIALS = ["<unk>", "<s>", "</s>"]


def byte_level() -> PreTrainedTokenizerFast:
    """Every byte a token (the tests' checkpoints' tokenizer), and an added special token."""
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.add_tokens([AddedToken("<|im_start|>", special=True)])
    return fast


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """Llama's kind: "▁" for a space, bytes as <0xNN> tokens, the first token's space dropped."""
    pieces = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + ["▁hello", "▁world", "▁", "!", "a"]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                               byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


class CountingTokenizer:
    """The tokenizer, counting the ids each decode is given."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.inner, self.largest, self.total = tokenizer, 0, 0
        self.all_special_ids, self.added_tokens_decoder = tokenizer.all_special_ids, tokenizer.added_tokens_decoder

    def decode(self, ids: list[int], **kw) -> str:
        self.largest, self.total = max(self.largest, len(ids)), self.total + len(ids)
        return self.inner.decode(ids, **kw)


def stream(tokenizer, ids: list[int], chunks: list[int] | None = None, **params) -> tuple[list[str], CountingTokenizer]:
    """The text after each step, the ids arriving `chunks[i]` at a time (one by default)."""
    counting = CountingTokenizer(tokenizer)
    detok, req = Detokenizer(counting), Req("r", [1], SamplingParams(**params))
    texts, at, i = [], 0, 0
    while at < len(ids):
        step = chunks[i % len(chunks)] if chunks else 1
        req.output_ids += ids[at : at + step]
        at, i = at + step, i + 1
        detok.step(req, final=at >= len(ids))
        texts.append(req.text)
    return texts, counting


def utf8_tokens(tokenizer, text: str) -> list[int]:
    """The text as one token per byte."""
    if tokenizer.decode(tokenizer.convert_tokens_to_ids(["<0x41>"])) == "A":  # byte fallback tokens
        return tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in text.encode()])
    return tokenizer.convert_tokens_to_ids([_byte_char(b) for b in text.encode()])


def _byte_char(b: int) -> str:
    # GPT-2's byte-to-character map (printable bytes stand for themselves, the rest from 256 on).
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    return chr(b) if b in printable else chr(256 + sorted(set(range(256)) - set(printable)).index(b))


@pytest.mark.parametrize("make", [byte_level, sentencepiece_like])
@pytest.mark.parametrize("chunks", [[1], [3, 1, 2]])
def test_characters_are_sent_whole_and_as_soon_as_complete(make, chunks):
    tokenizer = make()
    text = "héllo, 世界! 🙂 ok ∑x → y; 日本語のテキスト😀😀 end"
    ids = utf8_tokens(tokenizer, text)
    texts, counting = stream(tokenizer, ids, chunks)
    assert texts[-1] == text
    at = 0
    for i, sent in enumerate(texts):
        at = min(len(ids), at + chunks[i % len(chunks)])
        # Complete characters only, and all of them where the bytes so far end one. (SentencePiece's
        # byte tokens decode to "\ufffd"s as a run until its last character is complete.)
        complete = text.encode()[:at].decode(errors="ignore")
        assert complete.startswith(sent), (i, sent)
        if len(complete.encode()) == at:
            assert sent == complete, (i, sent)
    # A few ids a decode: the window is cut once its text is complete again.
    assert counting.largest <= WINDOW_MAX + 8 and counting.total <= 2 * WINDOW_MAX * len(texts)


def test_spacing_survives_runs_of_skipped_special_tokens():
    tokenizer = sentencepiece_like()
    hello, world, eos = tokenizer.convert_tokens_to_ids(["▁hello", "▁world", "</s>"])
    ids = [hello] + [eos] * 50 + [world] + [eos] * 3 + [world]
    texts, counting = stream(tokenizer, ids)
    assert texts[-1] == tokenizer.decode(ids, skip_special_tokens=True) == "hello world world"
    assert counting.largest <= 3  # the special tokens never entered the window
    kept, _ = stream(tokenizer, ids, skip_special_tokens=False)
    assert kept[-1] == tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("run", ["special", "continuation bytes", "lead bytes"])
def test_a_long_run_of_tokens_without_text_costs_a_bounded_decode_per_step(run):
    """Before, each of these tokens made every later step decode the whole run: 3000 of them
    cost 4.5 million ids decoded; now at most WINDOW_LIMIT a step."""
    tokenizer = byte_level()
    a = utf8_tokens(tokenizer, "a")
    token = {"special": tokenizer.convert_tokens_to_ids("<|im_start|>"), "continuation bytes": _id(tokenizer, 0x80),
             "lead bytes": _id(tokenizer, 0xE4)}[run]
    ids = a + [token] * 3000 + a
    texts, counting = stream(tokenizer, ids)
    assert texts[-1] == tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.largest <= WINDOW_LIMIT + 1 and counting.total <= len(ids) * WINDOW_LIMIT
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))  # sent text never changes


def _id(tokenizer, byte: int) -> int:
    return tokenizer.convert_tokens_to_ids(_byte_char(byte))


@pytest.mark.parametrize("seed", range(4))
def test_random_bytes_stream_the_whole_decodes_text(seed):
    """Valid and invalid UTF-8 mixed at random (lone continuation bytes, cut sequences, specials):
    the text sent is the whole decode's, and what is sent is never taken back."""
    tokenizer = byte_level()
    rng = random.Random(seed)
    alphabet = [*utf8_tokens(tokenizer, "ab 世🙂"), _id(tokenizer, 0x80), _id(tokenizer, 0xBF), _id(tokenizer, 0xE4),
                _id(tokenizer, 0xF0), tokenizer.convert_tokens_to_ids("</s>")]
    ids = [rng.choice(alphabet) for _ in range(600)]
    texts, counting = stream(tokenizer, ids, [1, 1, 4])
    assert texts[-1] == tokenizer.decode(ids, skip_special_tokens=True)
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert counting.largest <= WINDOW_LIMIT + 4


def test_an_engine_request_forced_onto_a_continuation_byte(engine):
    """Through the engine: a logit bias makes every output token the byte 0x80, which no token
    ever completes; the text is the whole decode's (one "\ufffd" a byte), streamed or not."""
    byte = _id(engine.tokenizer, 0x80)
    params = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0, "logit_bias": {str(byte): 100.0}}
    out = engine.generate(input_ids=[5, 6, 7], sampling_params=params)
    assert out["output_ids"] == [byte] * 200
    assert out["text"] == engine.tokenizer.decode(out["output_ids"]) == "\ufffd" * 200
    chunks = list(engine.generate(input_ids=[5, 6, 7], sampling_params=params, stream=True))
    assert "".join(c["text"] for c in chunks) == out["text"]
