# Convenience targets; each one is a thin wrapper over scripts/.
.PHONY: venv test main bench
venv:
	bash scripts/setup_venv.sh
test:
	bash scripts/test.sh
main:
	bash scripts/main.sh
bench: venv
	.venv/bin/python benchmarks/bench_linear.py
