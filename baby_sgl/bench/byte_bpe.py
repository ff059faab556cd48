"""A byte-level BPE vocabulary of any size, for checkpoints whose real tokenizer is not at hand
(bench/checkpoints.py): the 256 byte tokens, then every byte pair, then pairs extended by a byte, in
a fixed order, each with the merge that makes it; then special tokens; then padding tokens up to the
embedding's row count, named as llama.cpp's converter names them. Every text encodes (bytes are
tokens) and every id decodes, in the Hugging Face tokenizer and in the GGUF file alike; the merges
are not learned from text, so it compresses text worse than the real tokenizer would."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGUFWriter, TokenType


@dataclass(frozen=True)
class ByteBpeVocab:
    tokens: list[str]  # the regular tokens, in id order
    merges: list[tuple[str, str]]
    specials: list[str]  # ids len(tokens)...
    pads: list[str]  # then these, up to the embedding's rows

    @property
    def size(self) -> int:
        return len(self.tokens) + len(self.specials) + len(self.pads)

    def special_id(self, token: str) -> int:
        return len(self.tokens) + self.specials.index(token)


def byte_bpe_vocab(regular: int, specials: list[str], size: int) -> ByteBpeVocab:
    """`regular` byte-level tokens (at least 256), the specials after them, padded to `size` ids."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 bytes as GPT-2 spells them
    tokens, merges, level = list(alphabet), [], alphabet
    while len(tokens) < regular:
        longer = []
        for head in level:
            for byte in alphabet[: regular - len(tokens)]:
                tokens.append(head + byte)
                merges.append((head, byte))
                longer.append(head + byte)
            if len(tokens) == regular:
                break
        level = longer
    first_pad = regular + len(specials)
    return ByteBpeVocab(tokens[:regular], merges, specials, [f"[PAD{i}]" for i in range(first_pad, size)])


def save_hf_tokenizer(vocab: ByteBpeVocab, out_dir: str, bos: str, eos: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)}, merges=vocab.merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in vocab.specials + vocab.pads])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos).save_pretrained(out_dir)


def add_to_gguf(vocab: ByteBpeVocab, w: GGUFWriter, bos: str, eos: str) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")  # the GPT-2 split the Hugging Face ByteLevel pre-tokenizer makes
    w.add_token_list(vocab.tokens + vocab.specials + vocab.pads)
    w.add_token_types([TokenType.NORMAL] * len(vocab.tokens) + [TokenType.CONTROL] * len(vocab.specials)
                      + [TokenType.UNUSED] * len(vocab.pads))
    w.add_token_merges([f"{a} {b}" for a, b in vocab.merges])
    w.add_bos_token_id(vocab.special_id(bos))
    w.add_eos_token_id(vocab.special_id(eos))
    w.add_add_bos_token(False)
