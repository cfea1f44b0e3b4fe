# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Both create .venv on first use and are fast when nothing changed.

PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
MPIRUN  := $(VENV)/bin/mpirun --oversubscribe
STAMP   := $(VENV)/.installed
NATIVE_SRC := $(wildcard native/*.c native/*.h native/*.pyx)

# Open MPI refuses root without these; one compute thread per rank so that
# oversubscribed ranks do not fight over the two cores.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_mpi_yield_when_idle := 1
export OMP_NUM_THREADS := 1
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: install test test-long test-python test-mpi test-c test-stress test-slurm test-cluster chaos-quick examples demo bench docs-figures lint clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(NATIVE_SRC)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel Cython numpy
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	$(PY) setup.py -q build_ext --inplace
	touch $(STAMP)

test: test-python test-mpi test-c

# make test checks every feature once against its reference; the fault scenarios found by
# campaigns and the variants of fast tests are marked `long` and run by make test-long
# (.ci/run runs both).
test-python: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --ignore=tests/cluster -m "not long" tests

test-long: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --ignore=tests/cluster -m long tests

test-mpi: $(STAMP)
	timeout 1200 $(MPIRUN) -n 4 $(PY) -m pytest -q -p no:cacheprovider --with-mpi tests/mpi

test-c:
	cmake -S . -B build/ctest -DCMAKE_BUILD_TYPE=Debug >/dev/null
	cmake --build build/ctest -j2 >/dev/null
	ctest --test-dir build/ctest --output-on-failure

# make test three times with two busy loops beside it (a flaky test shows here first).
test-stress: $(STAMP)
	bash tests/stress.sh

# A small random fault campaign (docs/respipe.md, "Chaos"): 12 scenarios at a fixed seed,
# ResPipe on 3 and 4 stages, every mode; then Stannis. Fails on any hang, crash, wrong
# result or verdict the docs do not allow.
chaos-quick: $(STAMP)
	test -d data/digits || $(PY) -m native.convert digits data/digits
	test -f data/stannis-digits/split.json || $(PY) -m stannis prepare
	$(PY) -m mpipipe chaos --config jobs/configs/respipe-digits.toml --set 'data.path="data/digits"' \
		--stages 3,4 --runs 12 --seed 1
	$(PY) -m stannis chaos --config jobs/configs/stannis-digits.toml --set csd.slowdown=2.0 \
		--runs 4 --seed 1

# The examples of your own model and data (see the README), on tiny data: a ResNet-18
# with BatchNorm under ResPipe hot mode with a stage killed, a BatchNorm + Dropout CNN
# with AdamW and OneCycleLR under Stannis, and a folder of PNGs made at run time,
# converted and trained on with augmentation under ResPipe.
examples: $(STAMP)
	test -d data/digits || $(PY) -m native.convert digits data/digits
	test -d data/synthetic32 || $(PY) -m native.convert synthetic --shape 3,32,32 --count 1024 data/synthetic32
	test -f data/stannis-digits-2/split.json || $(PY) -m stannis prepare --csds 2 --out data/stannis-digits-2
	$(MPIRUN) --with-ft ulfm -n 4 $(PY) examples/resnet18_respipe.py --data data/synthetic32 --width 16 \
		--log runs/example-resnet18.h5
	$(MPIRUN) -n 3 $(PY) examples/own_model_stannis.py --data data/stannis-digits-2 --log runs/example-stannis.h5
	$(PY) -m mpipipe report runs/example-resnet18.h5 --no-plots
	rm -rf runs/example-own-images  # this target's own scratch folder: a rerun starts afresh
	bash examples/own_images.sh runs/example-own-images

test-slurm: $(STAMP)
	bash tests/slurm/run.sh

# The emulated cluster (mpipipe.tools.emulator): root only; installs iproute2/util-linux if missing.
test-cluster: $(STAMP)
	test -d data/digits || $(PY) -m native.convert digits data/digits
	test -f data/stannis-digits/split.json || $(PY) -m stannis prepare
	bash tests/cluster/run.sh

demo: $(STAMP)
	bash jobs/demo.sh

bench: $(STAMP)
	$(PY) -m native.bench
	$(PY) bench/pipeline.py
	$(PY) bench/resilience.py
	$(PY) bench/stannis.py

# The docs' pictures, and the only way they are rewritten: a bench run on its own never
# writes into the checkout (without --out its plots go to a new temporary folder). Each
# bench takes tens of minutes; the cluster bench needs the emulated testbed (root).
docs-figures: $(STAMP)
	$(PY) bench/resilience.py --out docs/respipe-bench.png
	$(PY) bench/cluster.py --out docs/cluster-tradeoff.png

lint: $(STAMP)
	$(VENV)/bin/ruff check native mpipipe stannis tests bench

clean:
	rm -rf build native/_shard.c native/*.so runs data
