# Developer conveniences; the package itself builds with pip alone.
PYTHON ?= python3

.PHONY: build dev test bench clean

# build: compile the C kernels in place (an editable install)
build dev:
	$(PYTHON) -m pip install -e .

# test: the full suite against the PyTorch reference (needs torch==2.13.0)
test: build
	$(PYTHON) -m pytest -q

# bench: a training-step timing
bench: build
	$(PYTHON) -m llmc_py.bench

# clean: build products and caches
clean:
	rm -rf build dist *.egg-info .pytest_cache
	rm -f llmc_py/_llmc*.so llmc_py/_llmc.c llmc_py/_llmc.o
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
