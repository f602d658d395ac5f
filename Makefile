# Quick start: `make demo` runs the main job on the built-in attention example,
# `make test` runs the test suite. Both create .venv (Python >= 3.12) on first use
# and reuse it afterwards.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test gpu-test clean

$(PY):
	@interpreter=$$(.ci/find-python) || exit 1; \
	  echo "creating $(VENV) with $$interpreter"; \
	  "$$interpreter" -m venv $(VENV) && $(PY) -m pip install -q --upgrade pip

$(VENV)/.installed-base: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	@touch $@

$(VENV)/.installed-dev: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@ $(VENV)/.installed-base

demo: $(VENV)/.installed-base
	$(VENV)/bin/cherenkov optimize --example attention

# pytest exits with 5 when it collects no test: that is a failure, not a pass.
test: $(VENV)/.installed-dev
	@$(PY) -m pytest -q -m "not gpu" -n auto --dist loadfile; status=$$?; \
	  if [ $$status -eq 5 ]; then echo "make test: pytest ran no tests" >&2; exit 1; fi; \
	  exit $$status

gpu-test: $(VENV)/.installed-dev
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
