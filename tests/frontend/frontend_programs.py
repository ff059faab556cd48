"""SGLang's frontend language (`import sglang as sgl`) run as a client against a server at
BASE_URL; prints one JSON object: every program's outcome and every HTTP exchange the frontend
made, in order.

    python frontend_programs.py BASE_URL

The tests run this in a child process and never import sglang themselves: `import sglang` sets
cache-directory variables in os.environ and renames every SGL_* variable to SGLANG_*.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback
from urllib.parse import urlsplit

from baby_sgl.sglang_client import import_sglang

# Programs whose requests use this schema must terminate: every value has a bounded length.
JSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
               "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}
BATCH_QUESTIONS = ["What is 2+2?", "Capital of Italy?", "Color of grass?"]
BATCH_PREFIX = "You are a terse assistant. Answer every question with one short sentence only.\n"
CHAT_SYSTEM = "You are a helpful assistant."
CHAT_TURNS = {"first": "Hi, who are you?", "second": "Name a color."}


def record_http(wire: list[dict]) -> None:
    """Every request the backend makes goes through runtime_endpoint.http_request; we keep the
    path, body, status and (when not streamed) the answer of each."""
    from sglang.lang.backend import runtime_endpoint

    send = runtime_endpoint.http_request
    lock = threading.Lock()  # forks and run_batch send from many threads

    def recording(url, json=None, stream=False, **kwargs):
        res = send(url, json=json, stream=stream, **kwargs)
        entry = {"method": kwargs.get("method") or ("POST" if json is not None or stream else "GET"),
                 "path": urlsplit(url).path, "body": json, "stream": stream, "status": res.status_code}
        if stream:
            res.iter_lines = keep_lines(res.iter_lines, entry.setdefault("events", []))
        else:
            try:
                entry["response"] = res.json()
            except ValueError:
                entry["response"] = res.text
        with lock:
            wire.append(entry)
        return res

    runtime_endpoint.http_request = recording


def keep_lines(iter_lines, events: list[str]):
    """A streamed answer's lines, as the frontend reads them, are also kept in events."""

    def lines(*args, **kwargs):
        for line in iter_lines(*args, **kwargs):
            events.append(line.decode("utf-8"))
            yield line

    return lines


def define_programs(sgl) -> dict:
    @sgl.function
    def constrained(s):
        s += "Pick a number: " + sgl.gen("num", regex=r"[0-9]{1,3}", max_tokens=8)
        s += "\nA code: " + sgl.gen("code", regex=r"[A-Z]{2}-[0-9]{2}", max_tokens=8)
        s += "\nAn integer: " + sgl.gen("n_int", dtype=int, max_tokens=8)
        s += "\nA decimal: " + sgl.gen("n_float", dtype=float, max_tokens=8)
        s += "\nTrue or False: " + sgl.gen("flag", dtype=bool, max_tokens=8)
        s += "\nA quoted word: " + sgl.gen("word", dtype=str, max_tokens=24)
        s += "\nJSON: " + sgl.gen("js", json_schema=json.dumps(JSON_SCHEMA), max_tokens=32)
        # The regex forces two digits after some letters, so the stop regex must fire there.
        s += "\nCut: " + sgl.gen("cut", regex=r"[a-z]{1,4}[0-9]{2}[a-z]{1,4}", stop_regex=[r"[0-9]{2}"],
                                 max_tokens=16)

    @sgl.function
    def choose(s):
        s += "Question: Is the sky blue?\nAnswer (yes or no): " + sgl.select("yes_no", choices=["yes", "no"])
        s += "\nConfidence: " + sgl.gen("conf", choices=["low", "medium", "high"])

    @sgl.function
    def fork_gather(s):
        s += "Here are two tips about sleep.\n"
        forks = s.fork(2)
        forks += lambda i: f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=12, stop=["\n"])
        branch_tips = [f["tip"] for f in forks]
        forks.join()
        return {"branch_tips": branch_tips}

    @sgl.function
    def fork_concat(s):
        s += "Two sentences about tea.\n"
        prefix = s.text()
        forks = s.fork(2)
        forks += lambda i: f"Sentence {i + 1}:" + sgl.gen("sent", max_tokens=10, stop=["\n"]) + "\n"
        branch_texts = [f.text() for f in forks]
        forks.join("concate_and_append")
        joined = s.text()
        s += "Done:" + sgl.gen("done", max_tokens=6)
        return {"prefix": prefix, "branch_texts": branch_texts, "joined": joined}

    @sgl.function
    def batch_qa(s, question):
        # Constant text over 64 characters before the first argument: run_batch caches it first.
        s += BATCH_PREFIX
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=10, stop=["\n"])

    @sgl.function
    def streamed(s):
        # ASCII only, so that every token is text at once (a partial UTF-8 character is held back).
        s += "Once upon a time" + sgl.gen("story", regex=r"[a-z ]{8,16}", max_tokens=16, return_logprob=True,
                                          top_logprobs_num=2, return_text_in_logprobs=True)

    @sgl.function
    def chat(s, first, second):
        s += sgl.system(CHAT_SYSTEM)
        s += sgl.user(first)
        s += sgl.assistant(sgl.gen("reply1", max_tokens=8))
        with s.user():
            s += second
        with s.assistant():
            s += sgl.gen("reply2", max_tokens=8)

    @sgl.function
    def knobs(s):
        s += "Scored: " + sgl.gen("scored", max_tokens=3, return_logprob=True, logprob_start_len=4,
                                  top_logprobs_num=1, return_text_in_logprobs=True)
        s += "\nLine: " + sgl.gen("line", stop="\n", max_tokens=8)  # without a template stop: a bare string
        s += "\nSampled: " + sgl.gen("sampled", max_tokens=6, min_tokens=6, temperature=0.7, top_p=0.9, top_k=20,
                                    min_p=0.05, frequency_penalty=0.5, presence_penalty=0.3, stop_token_ids=[2])

    return {f.func.__name__: f for f in (constrained, choose, fork_gather, fork_concat, batch_qa, streamed, chat,
                                         knobs)}


def outcome(state, names: list[str]) -> dict:
    error = state.error()
    return {"error": None if error is None else repr(error), "text": state.text(), "messages": state.messages(),
            "vars": {n: state[n] for n in names}, "meta": {n: state.get_meta_info(n) for n in names},
            "ret": getattr(state, "ret_value", None)}


def run_all(sgl, base_url: str, wire: list[dict]) -> dict:
    programs = define_programs(sgl)
    backend = sgl.RuntimeEndpoint(base_url, chat_template_name="chatml")
    default_backend = sgl.RuntimeEndpoint(base_url, chat_template_name="default")
    sgl.set_default_backend(backend)
    results: dict = {"model_info": backend.model_info}

    def step(name, run):
        start = len(wire)
        try:
            results[name] = run()
        except Exception:  # noqa: BLE001 - reported to the tests, which fail on it
            results[name] = {"exception": traceback.format_exc()}
        results[name]["wire"] = [start, len(wire)]

    step("constrained", lambda: outcome(programs["constrained"].run(temperature=0),
                                        ["num", "code", "n_int", "n_float", "flag", "word", "js", "cut"]))
    step("choose", lambda: outcome(programs["choose"].run(), ["yes_no", "conf"]))
    step("fork_gather", lambda: outcome(programs["fork_gather"].run(temperature=0), ["tip"]))
    step("fork_concat", lambda: outcome(programs["fork_concat"].run(temperature=0), ["done"]))

    def batch() -> dict:
        states = programs["batch_qa"].run_batch([{"question": q} for q in BATCH_QUESTIONS], temperature=0,
                                               progress_bar=False)
        return {"states": [outcome(st, ["answer"]) for st in states]}

    step("batch", batch)

    def stream() -> dict:
        state = programs["streamed"].run(stream=True, temperature=0)
        pieces = list(state.text_iter("story"))
        return outcome(state, ["story"]) | {"pieces": pieces}

    step("stream", stream)
    step("chat_chatml", lambda: outcome(programs["chat"].run(**CHAT_TURNS, temperature=0), ["reply1", "reply2"]))
    step("chat_default", lambda: outcome(programs["chat"].run(**CHAT_TURNS, temperature=0, backend=default_backend),
                                         ["reply1", "reply2"]))
    step("knobs", lambda: outcome(programs["knobs"].run(temperature=0, backend=default_backend),
                                  ["scored", "line", "sampled"]))
    step("server_info", lambda: {"info": sgl.get_server_info()})
    step("flush_cache", lambda: {"flushed": sgl.flush_cache()})
    return results


def main() -> None:
    sgl = import_sglang()
    wire: list[dict] = []
    record_http(wire)
    results = run_all(sgl, sys.argv[1], wire)
    print(json.dumps({"results": results, "wire": wire}))


if __name__ == "__main__":
    main()
