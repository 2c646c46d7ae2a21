# The two commands of the README. Both set up .venv first (idempotent).
PY := .venv/bin/python

.PHONY: setup demo test

setup:
	bash scripts/setup.sh

# Prune the embedded SmolLM2-135M-Instruct to 2:4 with the `fast` recipe (Wanda in swap-searched input
# coordinates) on offline Wikipedia text, report perplexity on the held-out Brown corpus (ctx 512,
# 32768 tokens) before and after, and export the deployable compressed checkpoint.
demo: setup
	.venv/bin/shuffleprune prune --recipe fast --pattern 2:4 --calib wiki --nsamples 32 --seqlen 512 \
		--seed 0 --eval-text brown --eval-ctx 512 --eval-tokens 32768 --out out/smollm2-wanda-2of4 --overwrite \
		--export out/smollm2-wanda-2of4-deployed

# the suite across the machine's cores (pytest-xdist: at most 4 workers, as each holds its own torch; 0 on one
# core, which runs it in one process)
TEST_WORKERS ?= $(shell python3 -c "import os; n = len(os.sched_getaffinity(0)); print(min(4, n) if n > 1 else 0)")

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS)
