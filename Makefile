# One command each for a fresh machine: `make test` (the whole suite), `make demo` (main job, later).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test install clean

$(STAMP): setup.py constraints-cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, exactly the CPU wheel; the constraints keep every later step from replacing it.
	$(PY) -m pip install --quiet torch==2.13.0
	PIP_CONSTRAINT=$(CURDIR)/constraints-cpu.txt $(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV)
