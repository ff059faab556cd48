"""Runs a benchmark workload on vLLM's CPU engine. Usage: python vllm_runner.py SPEC.json OUT.json

SPEC: {"model": HF directory, "dtype", "prompts": [[ids]], "output_lens": [n], "one_batch": bool,
"max_model_len": int, optionally "lora_paths": [each prompt's PEFT adapter directory], "max_lora_rank"}.
Greedy, ignore_eos, every prompt given as token ids."""

import json
import os
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    adapters = sorted(set(spec.get("lora_paths") or []))
    lora = {"enable_lora": True, "max_loras": len(adapters), "max_lora_rank": spec["max_lora_rank"]} if adapters else {}
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
              max_num_seqs=max(1, min(256, len(spec["prompts"]))), **lora)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    requests = None
    if adapters:
        from vllm.lora.request import LoRARequest

        by_path = {p: LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)}
        requests = [by_path[p] for p in spec["lora_paths"]]

    def run(lens):
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lens]
        # Each run starts from an empty prefix cache, as baby-sgl's does (its cache is flushed
        # after the warm-up): otherwise the measured run would find every prompt cached.
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
        return time.perf_counter() - t0, outs

    run([2] * len(prompts))  # warm-up: compiles and touches the whole batch's shapes
    result = {}
    if spec["one_batch"]:
        result["prefill_s"], _ = run([1] * len(prompts))
    seconds, outs = run(spec["output_lens"])
    result.update(seconds=seconds, outputs=[list(o.outputs[0].token_ids) for o in outs])
    json.dump(result, open(sys.argv[2], "w"))


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()
