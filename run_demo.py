"""python run_demo.py --comprehensive --seed=42 (the same as `baby-sgl demo --comprehensive`)."""

from baby_sgl.cli import main

if __name__ == "__main__":
    import sys

    raise SystemExit(main(["demo", *sys.argv[1:]]))
