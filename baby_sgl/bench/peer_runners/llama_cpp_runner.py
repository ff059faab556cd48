"""Runs a benchmark workload on llama.cpp (llama-cpp-python), one prompt at a time (its Python
API has no batch scheduler). Usage: python llama_cpp_runner.py SPEC.json OUT.json

SPEC: {"model": GGUF file, "threads", "prompts": [[ids]], "output_lens": [n], "max_model_len",
"prompt_lookup": drafts per step by prompt lookup, 0 for none}. Greedy, end-of-sequence ignored (its
logit is masked), every prompt given as token ids."""

import json
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    from llama_cpp import Llama, LogitsProcessorList

    draft = None
    if spec.get("prompt_lookup"):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=spec["prompt_lookup"])
    llm = Llama(model_path=spec["model"], n_ctx=spec["max_model_len"], n_threads=spec["threads"],
                n_threads_batch=spec["threads"], n_batch=512, seed=0, verbose=False, draft_model=draft)
    eos = llm.token_eos()

    def no_eos(_ids, scores):
        scores[eos] = -float("inf")
        return scores

    def run(prompt, n, stamps):
        llm.reset()
        out = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True,
                                  logits_processor=LogitsProcessorList([no_eos])):
            stamps.append(time.perf_counter())
            out.append(int(token))
            if len(out) == n:
                break
        return out

    run(spec["prompts"][0][:8], 2, [])  # warm-up
    outputs, ttfts, steps = [], [], []
    t0 = time.perf_counter()
    for prompt, n in zip(spec["prompts"], spec["output_lens"]):
        start, stamps = time.perf_counter(), list[float]()
        outputs.append(run(prompt, n, stamps))
        ttfts.append(stamps[0] - start)
        steps += [b - a for a, b in zip(stamps, stamps[1:])]
    seconds = time.perf_counter() - t0
    steps.sort()
    json.dump({"seconds": seconds, "outputs": outputs, "prefill_s": ttfts[0], "ttft_mean_s": sum(ttfts) / len(ttfts),
               "decode_step_median_s": steps[len(steps) // 2] if steps else None}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
