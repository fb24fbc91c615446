# The two commands of the README. Both do all set-up first (scripts/setup.sh), offline-safe.
VENV ?= .venv
PROMPT ?= a red circle on a blue background

.PHONY: demo test docs setup setup-test browser-deps

setup:
	VENV=$(VENV) ./scripts/setup.sh

setup-test:
	VENV=$(VENV) EXTRAS=test,openvino,onnxruntime,video,lora,serve,browser,ray,docs,gguf ./scripts/setup.sh

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/memfit generate --prompt "$(PROMPT)" --out demo.png

# The docs site is built first, strictly (a broken link or a missing nav page fails), into the
# git-ignored .site/; NO_MKDOCS_2_WARNING drops mkdocs-material's end-of-life banner from the log.
test: setup-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir .site
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest -q

# Serves the docs site (mkdocs.yml, docs/) at http://127.0.0.1:8000/, rebuilding on every change.
docs:
	VENV=$(VENV) EXTRAS=docs ./scripts/setup.sh
	$(VENV)/bin/mkdocs serve

# The web page's browser test (tests/test_serve_live.py) needs Debian's chromium and its driver;
# it is skipped, saying so, where they are absent. CI runs this first where it may use apt.
browser-deps:
	apt-get install -y chromium chromium-driver || sudo apt-get install -y chromium chromium-driver
