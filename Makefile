# Two entry points that work on a fresh machine (Python 3.10+, a C++ compiler, cmake):
#   make demo   set up, build, run examples/demo.py, moe_layer.py, rl_weight_sync.py and afd_decode.py on 4 ranks,
#               kv_transfer.py on 2
#   make test   set up, build, run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
NPROC  ?= 4

.PHONY: setup ucx build demo test bench clean

# UCX, the inter-host engine of groups that span hosts: installed where this runs as root with
# apt; elsewhere the build goes on without it (such groups then use gloo between hosts).
ucx:
	@pkg-config --exists ucx 2>/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -q libucx-dev pkg-config >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libucx-dev pkg-config >/dev/null 2>&1; }; }; } || \
	  echo "torch_cam: UCX is not installed (apt-get install libucx-dev); groups that span hosts will use gloo"

$(VENV)/.setup-done:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION) pytest expecttest numpy build wheel
	$(PY) -m pip install -q -r tests/integration/requirements.txt torch==$(TORCH_VERSION)
	touch $@

setup: $(VENV)/.setup-done

build: setup ucx
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .

demo: build
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) examples/demo.py
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) examples/moe_layer.py
	$(VENV)/bin/torchrun --nproc-per-node 2 examples/kv_transfer.py
	$(VENV)/bin/torchrun --nproc-per-node 4 examples/rl_weight_sync.py
	$(VENV)/bin/torchrun --nproc-per-node 4 examples/afd_decode.py

test: build
	bash tests/run_all.sh $(PY)

bench: build
	$(PY) benchmarks/bench_collectives.py --ranks 2 4 8
	$(PY) benchmarks/bench_moe.py --ranks 2 4 8

clean:
	rm -rf build torch_cam/_C*.so *.egg-info
