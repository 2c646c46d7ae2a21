# The two commands of the README. Both set up .venv first (idempotent).
PY := .venv/bin/python

.PHONY: setup demo test

setup:
	bash scripts/setup.sh

# Prune the embedded SmolLM2-135M-Instruct to 2:4 with Wanda on offline Wikipedia text and report
# perplexity on the held-out Brown corpus (ctx 512, 32768 tokens) before and after.
demo: setup
	.venv/bin/shuffleprune prune --base wanda --pattern 2:4 --calib wiki --nsamples 32 --seqlen 512 \
		--seed 0 --eval-text brown --eval-ctx 512 --eval-tokens 32768 --out out/smollm2-wanda-2of4 --overwrite

test: setup
	$(PY) -m pytest -q
