"""transformers on the same prompts, same weights, dtype and threads: static batched `generate`
and its continuous batching `generate_batch`. Only useful tokens (those asked for) count."""

from __future__ import annotations

import os
import time

import torch

from baby_sgl.bench.workloads import Workload

HF_STATIC_BATCH = 32


def load_hf_model(model_path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
                                                    dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()


def hf_static(model, wl: Workload) -> dict:
    """Batches of HF_STATIC_BATCH prompts, left-padded; each batch runs to its longest output."""
    t0 = time.perf_counter()
    for i in range(0, len(wl.prompts), HF_STATIC_BATCH):
        prompts, lens = wl.prompts[i : i + HF_STATIC_BATCH], wl.output_lens[i : i + HF_STATIC_BATCH]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=False, pad_token_id=0)
    return _summary("transformers generate (static)", wl, time.perf_counter() - t0)


# Tokens per page of generate_batch's paged cache (transformers' default).
HF_PAGE_TOKENS = 256


def hf_generate_batch(model, wl: Workload) -> dict:
    """One call with every prompt; it takes a single max_new_tokens, the longest asked for. Its
    paged cache holds the workload's tokens: left to size itself, it takes 90% of the free memory
    (with a tiny model on a 24 GB machine, 14 GB and 16 s to set up for four prompts)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    new_tokens = max(wl.output_lens)
    cfg = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    pages = sum(-(-(len(p) + new_tokens) // HF_PAGE_TOKENS) for p in wl.prompts)
    cache = ContinuousBatchingConfig(page_size=HF_PAGE_TOKENS, num_blocks=pages)
    t0 = time.perf_counter()
    outputs = model.generate_batch(inputs=wl.prompts, generation_config=cfg, continuous_batching_config=cache)
    dt = time.perf_counter() - t0
    produced = sorted(len(o.generated_tokens) for o in outputs.values())
    if len(produced) != len(wl.prompts) or produced[0] < min(wl.output_lens):
        raise RuntimeError(f"generate_batch returned {len(produced)} of {len(wl.prompts)} requests, "
                           f"shortest {produced[0] if produced else 0} tokens")
    return _summary("transformers generate_batch", wl, dt)


def _summary(name: str, wl: Workload, dt: float) -> dict:
    out = sum(wl.output_lens)
    return {"engine": name, "seconds": dt, "requests_per_s": len(wl.prompts) / dt, "input_tok_s": wl.input_tokens / dt,
            "output_tok_s": out / dt, "total_tok_s": (wl.input_tokens + out) / dt}


def compare_hf(model_path: str, dtype: torch.dtype, wl: Workload) -> list[dict]:
    model = load_hf_model(model_path, dtype)
    results = [hf_static(model, wl)]
    try:
        results.append(hf_generate_batch(model, wl))
    except Exception as e:  # reported, not hidden: older transformers lack generate_batch
        results.append({"engine": "transformers generate_batch", "error": repr(e)})
    return results
