# One command each for a fresh machine: `make test` (the whole suite), `make demo` (the main job:
# GRPO on CPU with torchrun, 2 processes); `make demo-ppo` runs the PPO-with-critic variant,
# `make demo-moe` a MoE actor with expert parallelism (ep=2), `make demo-deepseek` a DeepSeek-V3 actor
# (multi-latent attention, ep=2, routing replay), `make demo-hybrid` a Qwen3-Next actor (Gated
# DeltaNet + gated attention, ep=2, packed), `make demo-gptoss` a gpt-oss actor (sinks, sliding
# windows, ep=2, packed), `make demo-smollm2` GRPO on a real model.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# verl's tests run in a second environment with verl's pins (transformers < 5.11, omegaconf 2.3)
VERL_VENV ?= .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.installed

.PHONY: test docs docs-serve install install-verl prepare-smollm2 demo demo-ppo demo-moe demo-deepseek demo-hybrid demo-gptoss demo-smollm2 demo-smollm2-lora demo-verl-smollm2 clean

$(STAMP): setup.py constraints-cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, exactly the CPU wheel; the constraints keep every later step from replacing it.
	$(PY) -m pip install --quiet torch==2.13.0
	PIP_CONSTRAINT=$(CURDIR)/constraints-cpu.txt $(PY) -m pip install --quiet -e '.[test,docs]'
	touch $(STAMP)

# mcore_rl without its own dependency list (omegaconf >= 2.4 is the main job's; hydra pins < 2.4):
# the integration needs megatron-core and what verl already brings. verl 0.9.1 imports uvicorn and
# fastapi without declaring them; its default RL trainer (main_ppo, trainer.use_v1) needs what its
# verl-core extra lists for it: TransferQueue (with pyzmq, msgspec; tensordict exactly 0.10.0) and
# cachetools (the rollout router). The extra itself also pulls GPU-only packages (nvtx, torchcodec).
$(VERL_STAMP): setup.py constraints-cpu.txt Makefile
	python3 -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install --quiet --upgrade pip
	$(VERL_PY) -m pip install --quiet torch==2.13.0
	PIP_CONSTRAINT=$(CURDIR)/constraints-cpu.txt $(VERL_PY) -m pip install --quiet 'verl==0.9.1' \
		'transformers>=5.5.3,<5.11,!=5.6.0' uvicorn fastapi megatron-core==0.16.1 safetensors pyyaml \
		psutil 'xxhash>=3.4' tqdm matplotlib pytest 'TransferQueue==0.1.11' pyzmq msgspec cachetools 'tensordict==0.10.0'
	$(VERL_PY) -m pip install --quiet --no-deps -e .
	touch $(VERL_STAMP)

install: $(STAMP)

install-verl: $(VERL_STAMP)

# SmolLM2-135M-Instruct (a real model) into ${MCORE_RL_CACHE:-~/.cache/mcore_rl}/smollm2, once
prepare-smollm2: $(STAMP)
	PY=$(PY) launch/prepare_smollm2.sh

# The documentation site (mkdocs.yml, docs/) into the ignored site/: --strict turns a broken link, a
# page missing from the nav or a docstring mkdocstrings cannot read into an error; then the README's
# docs/ links must name files and the README stay <= 250 lines. It takes seconds
# and is test's first prerequisite, so a docs break fails before the long steps start. (No --quiet:
# it hides the warnings, and --strict then no longer counts them.)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir $(CURDIR)/site
	$(PY) -c "import re, pathlib, sys; text = pathlib.Path('README.md').read_text(); \
		bad = [l for l in re.findall(r'\]\((docs/[^)#]+)', text) if not pathlib.Path(l).is_file()]; \
		n = len(text.splitlines()); \
		sys.exit(f'README.md links to missing {bad}' if bad else f'README.md has {n} lines; keep it <= 250 (the reference goes in docs/)' if n > 250 else 0)"

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

# The two suites run side by side: each keeps about one of the two cores busy on its own (the main
# suite 1.25 cores on average, tests/verl less: Ray start-up and launches wait), so together they
# take about the longer one's time instead of the sum. tests/verl's output is printed after the
# main suite's; the target fails when either fails.
test: docs $(VERL_STAMP) prepare-smollm2
	@log=$$(mktemp); \
	$(VERL_PY) -m pytest -q --durations=15 tests/verl > $$log 2>&1 & verl=$$!; \
	$(PY) -m pytest -q --durations=15 tests --ignore=tests/verl; main=$$?; \
	wait $$verl; status=$$?; \
	echo "== main suite exit $$main; tests/verl (ran beside it) exit $$status, its output: =="; \
	cat $$log; rm -f $$log; \
	test $$main -eq 0 -a $$status -eq 0

demo: $(STAMP)
	launch/run.sh 2 configs/grpo_demo.yaml

demo-ppo: $(STAMP)
	launch/run.sh 2 configs/ppo_demo.yaml

demo-moe: $(STAMP)
	launch/run.sh 2 configs/grpo_moe_demo.yaml

demo-deepseek: $(STAMP)
	launch/run.sh 2 configs/grpo_deepseek_demo.yaml

# a hybrid Qwen3-Next actor (Gated DeltaNet + gated attention, experts, ep=2, packed sequences)
demo-hybrid: $(STAMP)
	launch/run.sh 2 configs/grpo_hybrid_demo.yaml

# a gpt-oss actor (attention sinks, a sliding window of 4 on every other layer, experts with
# biases, the clamped SwiGLU, YaRN; ep=2, packed sequences)
demo-gptoss: $(STAMP)
	launch/run.sh 2 configs/grpo_gptoss_demo.yaml

# GRPO on the real model (SmolLM2-135M-Instruct, arithmetic task, transformers rollout engines):
# about 25 minutes on 2 cores
demo-smollm2: prepare-smollm2
	launch/run.sh 2 configs/grpo_smollm2.yaml model.hf_dir=$${MCORE_RL_CACHE:-$$HOME/.cache/mcore_rl}/smollm2/hf

demo-smollm2-lora: prepare-smollm2
	launch/run.sh 2 configs/grpo_smollm2_lora.yaml model.hf_dir=$${MCORE_RL_CACHE:-$$HOME/.cache/mcore_rl}/smollm2/hf

# The same GRPO through verl's own RL entry point (python -m verl.trainer.main_ppo, Ray): the actor on
# mcore_rl, the rollout on mcore_rl's CPU server (docs/verl.md)
demo-verl-smollm2: $(VERL_STAMP) prepare-smollm2
	PY=$(VERL_PY) launch/verl/grpo_smollm2.sh

clean:
	rm -rf $(VENV) $(VERL_VENV)
