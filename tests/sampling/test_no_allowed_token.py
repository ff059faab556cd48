"""A constrained request left with no token it may take (min_new_tokens and stop_token_ids forbid
every one its grammar allows) ends with an abort, and reports nothing of the token the sampler
had to pick from a row of -inf: no output, and no logprob entry."""

from __future__ import annotations


def test_no_logprob_is_reported_for_a_token_the_grammar_refused(engine):
    # Before: Sampler.__call__ recorded the picked token's logprobs (record_output_logprobs) before
    # OutputProcessing._append_token's accept_token refused it, so the answer held one entry more
    # than its output: a token that was never given.
    a = engine.generate("x", {"regex": "a", "temperature": 0, "max_new_tokens": 4})["output_ids"]
    assert len(a) == 1  # the one token that spells "a"
    out = engine.generate("x", {"regex": "a", "stop_token_ids": a, "min_new_tokens": 2, "temperature": 0,
                                "max_new_tokens": 4}, return_logprob=True, top_logprobs_num=2)
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    assert meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == []
    assert meta["output_token_logprobs_length"] == meta["completion_tokens"] == 0
