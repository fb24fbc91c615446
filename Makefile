# The two commands of the README. Both do all set-up first (scripts/setup.sh), offline-safe.
VENV ?= .venv
PROMPT ?= a red circle on a blue background

.PHONY: demo test setup setup-test

setup:
	VENV=$(VENV) ./scripts/setup.sh

setup-test:
	VENV=$(VENV) EXTRAS=test,openvino,onnxruntime,serve ./scripts/setup.sh

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/memfit generate --prompt "$(PROMPT)" --out demo.png

test: setup-test
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest -q
