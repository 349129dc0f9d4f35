# One idempotent setup path for README's two commands and .ci/run.
#   make run     set up .venv, then a 2-rank torchx launch of DLRM training on the default data
#   make test    set up .venv, then the test suite
#   make bench   set up .venv, then the stock benchmark (benchmarks/RESULTS.md)
#   make bench-bandwidth   (root) samples/s of stock and herald with tc-limited per-rank links
#   make test-compat       the test suite on TorchRec 1.8.0 (in .venv-torchrec1.8), for users of that release
# CUDA machines: make setup FBGEMM=fbgemm-gpu  (torch==2.13.0 from PyPI is then the CUDA build)
# fbgemm-gpu 1.9.0 is not used: its CPU wheel fails to load against torch 2.13.0 (undefined symbol
# torch::autograd::_wrap_outputs), so fbgemm stays at 1.8.0 under both TorchRec releases.
PYTHON   ?= python3
VENV     ?= .venv
FBGEMM   ?= fbgemm-gpu-cpu
TORCHREC ?= 1.9.2
NPROC    ?= 2
PIP      := $(VENV)/bin/python -m pip
STAMP    := $(VENV)/.herald-installed-torchrec$(TORCHREC)

.PHONY: setup run test test-compat bench bench-bandwidth clean

NATIVE   := torchrec_herald/native/_build/herald_native.so

setup: $(STAMP) $(NATIVE)

# herald's compiled scheduler (a torch C++ extension: g++ and ninja; one line names a missing one)
$(NATIVE): $(STAMP) $(wildcard torchrec_herald/native/*.cpp torchrec_herald/native/*.h) torchrec_herald/native/build.py
	$(VENV)/bin/python -m torchrec_herald.native.build

$(STAMP): constraints.txt pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: a newer torch would pull CUDA wheels and break fbgemm 1.8's ABI
	$(PIP) install -q -c constraints.txt torch==2.13.0 $(FBGEMM)==1.8.0
	# torchrec's metadata requires the CUDA fbgemm-gpu: install it without deps, then its real deps
	$(PIP) install -q --no-deps torchrec==$(TORCHREC)
	$(PIP) install -q -c constraints.txt -e '.[test]'
	$(VENV)/bin/python -c "import torch, fbgemm_gpu, torchrec, torchx, hydra; assert torch.__version__.startswith('2.13.0'), torch.__version__; assert torchrec.__version__ == '$(TORCHREC)', torchrec.__version__"
	rm -f $(VENV)/.herald-installed*
	touch $(STAMP)

# the main job: herald (hot-row replication + Herald scheduling: allocator, caches, lazy plan), with stock TorchRec all-TABLE_WISE (the exact reference) trained on the same
# batches as the baseline, the two in turns of 100 steps (compare_turn_steps); both are printed side by side (ARGS adds/overrides Hydra keys)
RUN_ARGS ?= planner=herald pipeline=herald compare_with=table_wise
run: setup
	$(VENV)/bin/torchx run --log -s local_cwd torchrec_herald/components.py:train --nproc_per_node $(NPROC) $(RUN_ARGS) $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

# the same suite on the previous TorchRec release, in a venv of its own
test-compat:
	$(MAKE) test VENV=.venv-torchrec1.8 TORCHREC=1.8.0

bench: setup
	$(VENV)/bin/python benchmarks/bench_traffic.py $(ARGS)

# speed under emulated bandwidth (root: network namespaces, veth, tc tbf); see benchmarks/bench_bandwidth.py
bench-bandwidth: setup
	$(VENV)/bin/python benchmarks/bench_bandwidth.py $(ARGS)

clean:
	rm -rf $(VENV) .venv-torchrec1.8 outputs
