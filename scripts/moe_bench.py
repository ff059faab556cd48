"""A mixture-of-experts model against dense ones on this machine: output tokens/s at batch 1 and 8,
and the share of the time spent in the experts (router and expert matmuls).

    .venv/bin/python scripts/moe_bench.py [--dtype auto] [--output-len 64] [--op-by-op]

Three random checkpoints are built at run time with transformers (cached under the cache root):
a Qwen3-MoE of ~89M parameters (8 layers, hidden 512, 8 experts of size 768, 2 per token: ~32M
active), a dense Qwen3 of the same total size (intermediate 6144: it computes all of it) and a
dense Qwen3 of the same active size (intermediate 1536). Random weights: the tokens are noise, the
costs are real. Each batch is timed twice, prefill alone (max_new_tokens=1) and prefill plus
decode, and decode tokens/s is taken from the difference. Decode runs in the one-call CPU step
(its own profile gives the experts' time) unless --op-by-op keeps every pass in torch ops (with
oneDNN's prepacked weights where they pay).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from baby_sgl import Engine
from baby_sgl.cache_dirs import cache_root
from baby_sgl.layers import moe
from baby_sgl.cpu import decode_step

COMMON = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
              head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
MODELS = {
    "moe (8 experts, top-2)": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                               dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768,
                                    intermediate_size=768, norm_topk_prob=True)),
    "dense, same total": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=8 * 768)),
    "dense, same active": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=2 * 768)),
}


def build(name: str) -> str:
    import transformers
    from tokenizers import Tokenizer, models

    out = cache_root() / "moe-bench" / name.split(" (")[0].replace(", ", "-").replace(" ", "-")
    if (out / "config.json").exists():
        return str(out)
    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    model.save_pretrained(out)
    vocab = {f"t{i}": i for i in range(COMMON["vocab_size"])}
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                               bos_token="t1", eos_token="t2", unk_token="t0")
    tok.save_pretrained(out)
    return str(out)


def checkpoint_params(path: str) -> int:
    from safetensors import safe_open

    total = 0
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(torch.Size(st.get_slice(k).get_shape()).numel() for k in st.keys())
    return total


def timed(engine: Engine, prompts: list[list[int]], new: int) -> float:
    params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--op-by-op", action="store_true", help="decode op by op, not in the one-call CPU step")
    args = p.parse_args()
    if args.op_by_op:
        decode_step.can_run = lambda model, dtype: False
    spent = [0.0]
    forward = moe.SparseMoE.forward

    def timed_forward(self, x):
        t0 = time.perf_counter()
        out = forward(self, x)
        spent[0] += time.perf_counter() - t0
        return out

    moe.SparseMoE.forward = timed_forward
    rows = []
    for name in MODELS:
        path = build(name)
        with Engine(path, dtype=args.dtype, disable_radix_cache=True) as engine:
            mode = "op by op" if engine.runner.step is None else "one-call step"
            params = checkpoint_params(path)
            for batch in (1, 8):
                g = torch.Generator().manual_seed(batch)
                prompts = torch.randint(3, COMMON["vocab_size"], (batch, args.input_len), generator=g).tolist()
                timed(engine, prompts, 2)  # warm-up
                prefill = timed(engine, prompts, 1)
                spent[0] = 0.0
                step = engine.runner.step
                if step is not None:
                    step.step.profile(True)
                whole = timed(engine, prompts, args.output_len)
                if step is not None:
                    spent[0] += step.step.profile(False)["experts (router, products, activation)"]
                decode = whole - prefill
                rows.append((name, params / 1e6, str(engine.dtype).removeprefix("torch."), mode, batch,
                             batch * (args.output_len - 1) / decode, spent[0] / whole))
    print("| model | parameters (M) | dtype | decode | batch | decode tok/s | time in experts |")
    print("|---|---|---|---|---|---|---|")
    for name, params, dtype, mode, batch, tok_s, share in rows:
        print(f"| {name} | {params:.0f} | {dtype} | {mode} | {batch} | {tok_s:.1f} | {share:.0%} |")


if __name__ == "__main__":
    main()
