# Everything runs in .venv, created on first use. PyTorch's CPU build is installed first so pip
# does not pull the CUDA packages; override TORCH (e.g. TORCH="torch --index-url <cpu index>").
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: setup demo speed-demo bench bench-dit test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[test]"
	# The ldm UNet code the WebUI pins (Stability-AI/stablediffusion), shipped on PyPI by
	# stable-diffusion-sdkit; --no-deps because it pins an old transformers we do not need.
	$(PY) -m pip install -q --no-deps stable-diffusion-sdkit==2.1.5
	touch $(STAMP)

# Grid of images, quality-vs-speed plot and table on the shipped tiny model (out/showcase/).
demo: setup
	$(PY) -m tome_lab.showcase

# One SD1.5 UNet forward with and without ToMe (random weights): speed only.
speed-demo: setup
	$(PY) -m tome_lab.speed_demo

# SD1.5 at 256 px and the matching step, unmerged vs tomesd vs ours (python -m tome_lab.bench works too).
bench: setup
	$(PY) -m tome_lab.bench --quick

# Flux- and SD3-shaped transformers at 512 to 2048 px, unpooled vs pooled image keys/values
# (docs/speed.md#dits-flux-sd3; about 30 min on one CPU thread).
bench-dit: setup
	$(PY) -m tome_lab.dit_bench

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) out
