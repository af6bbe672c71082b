# One command each for a fresh machine: `make test` (the whole suite), `make demo` (the main job:
# GRPO on CPU with torchrun, 2 processes); `make demo-ppo` runs the PPO-with-critic variant,
# `make demo-moe` a MoE actor with expert parallelism (ep=2).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test install demo demo-ppo demo-moe clean

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

demo: $(STAMP)
	launch/run.sh 2 configs/grpo_demo.yaml

demo-ppo: $(STAMP)
	launch/run.sh 2 configs/ppo_demo.yaml

demo-moe: $(STAMP)
	launch/run.sh 2 configs/grpo_moe_demo.yaml

clean:
	rm -rf $(VENV)
