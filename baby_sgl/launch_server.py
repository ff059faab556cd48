"""python -m baby_sgl.launch_server --model-path ... --port 30000 (as SGLang's)."""

from baby_sgl.entrypoints.launch_server import main

if __name__ == "__main__":
    raise SystemExit(main())
