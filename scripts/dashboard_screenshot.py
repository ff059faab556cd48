"""Makes docs/images/dashboard.png: a server on the default model, chat requests that share a system
prompt (some finished, some still running), and headless Chromium's screenshot of /dashboard.

    python scripts/dashboard_screenshot.py [--out docs/images/dashboard.png] [--port 31900]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import shutil
import subprocess
import sys
import tempfile
import time

import httpx

from dashboard_cost import running_server  # scripts/ is on the path when run as a script

SYSTEM = "You are a helpful assistant who answers questions about RadixAttention, the prefix cache of SGLang."
QUESTIONS = ["What is a radix tree?", "Why share a prefix?", "What is a KV cache?", "How does eviction work?",
             "Tell me a long story about caches."]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="docs/images/dashboard.png")
    p.add_argument("--port", type=int, default=31900)
    args = p.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("needs Debian's chromium (apt-get install chromium)", file=sys.stderr)
        return 1
    with running_server(args.port, "--max-total-tokens", "4096") as base:

        def chat(question: str, tokens: int) -> int:
            body = {"model": "default", "max_tokens": tokens, "temperature": 0,
                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
            return httpx.post(base + "/v1/chat/completions", json=body, timeout=300).status_code

        for q in QUESTIONS[:2]:
            chat(q, 24)
        httpx.post(base + "/generate", json={"text": "Translate to French: the cat sits on the mat.",
                                             "sampling_params": {"max_new_tokens": 16}}, timeout=300)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            running = [pool.submit(chat, q, 200) for q in QUESTIONS[2:]]
            time.sleep(4)  # mid-decode: their nodes are locked, the pool has request-owned slots
            with tempfile.TemporaryDirectory() as profile:
                subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                "--window-size=1400,1000", "--virtual-time-budget=3000", f"--user-data-dir={profile}",
                                f"--screenshot={args.out}", base + "/dashboard"], capture_output=True, timeout=120)
            assert all(f.result() == 200 for f in running)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
