# The two commands of the README. Both do all set-up first (scripts/setup.sh), offline-safe.
VENV ?= .venv
PROMPT ?= a red circle on a blue background

.PHONY: demo test setup setup-test browser-deps

setup:
	VENV=$(VENV) ./scripts/setup.sh

setup-test:
	VENV=$(VENV) EXTRAS=test,openvino,onnxruntime,video,lora,serve,browser,ray ./scripts/setup.sh

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/memfit generate --prompt "$(PROMPT)" --out demo.png

test: setup-test
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest -q

# The web page's browser test (tests/test_serve_live.py) needs Debian's chromium and its driver;
# it is skipped, saying so, where they are absent. CI runs this first where it may use apt.
browser-deps:
	apt-get install -y chromium chromium-driver || sudo apt-get install -y chromium chromium-driver
