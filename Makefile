# Developer conveniences; the package itself builds with pip alone.
PYTHON ?= python3

.PHONY: build dev test bench sanitize fuzz clean

# build: compile the C kernels in place (an editable install)
build dev:
	$(PYTHON) -m pip install -e .

# test: the full suite against the PyTorch reference (needs torch==2.13.0)
test: build
	$(PYTHON) -m pytest -q

# bench: a training-step timing
bench: build
	$(PYTHON) -m llmc_py.bench

# The tests of the C kernels: tests/test_<family>.py for each csrc/<family>.c
# (and quant.c's panel path in tests/test_quant_panels.py), the raw calls with
# bad arguments, and a whole model step
KERNEL_TESTS = $(wildcard $(patsubst csrc/%.c,tests/test_%.py,$(wildcard csrc/*.c))) \
               tests/test_quant_panels.py tests/test_errors.py tests/test_gpt2_step.py
ASAN_LIB = $(shell $(CC) -print-file-name=libasan.so)
# the interpreter itself, not a wrapper script (which would run under ASan too)
PYTHON_EXE = $(shell $(PYTHON) -c "import sys; print(sys.executable)")

# sanitize: the kernels built in place with AddressSanitizer and
# UndefinedBehaviorSanitizer (LLMC_SANITIZE=1), and their tests run on that
# build; any report fails it. libasan must be loaded before Python, hence the
# preload; PYTHONMALLOC=malloc lets ASan see the interpreter's allocations too;
# leak reports are off (the interpreter keeps memory at exit by design);
# --capture=sys leaves fd 2 alone, so a report that kills the process is seen. A
# planted overflow (tests/sanitize_canary.py) must be caught first, so that a
# build without working sanitizers cannot pass. The normal build is restored
# afterwards, pass or fail (SANITIZE_RESTORE=0 leaves the sanitizer build in
# place: CI, which ends there).
SANITIZE_RESTORE ?= 1
SANITIZE_ENV = LD_PRELOAD="$(ASAN_LIB)" ASAN_OPTIONS=detect_leaks=0 \
               UBSAN_OPTIONS=print_stacktrace=1 PYTHONMALLOC=malloc PYTHONPATH="$(CURDIR)"
sanitize:
	LLMC_SANITIZE=1 $(PYTHON) setup.py -q build_ext --inplace --force --build-temp build/sanitize
	status=0; \
	if $(SANITIZE_ENV) $(PYTHON_EXE) tests/sanitize_canary.py 2>&1 | grep -q heap-buffer-overflow; \
	then \
	    $(SANITIZE_ENV) $(PYTHON_EXE) -m pytest -q --capture=sys -p no:cacheprovider \
	        -m "not slow" $(KERNEL_TESTS) || status=$$?; \
	else \
	    echo "make sanitize: AddressSanitizer missed the planted overflow"; status=1; \
	fi; \
	if [ "$(SANITIZE_RESTORE)" != 0 ]; then $(PYTHON) setup.py -q build_ext --inplace --force; fi; \
	exit $$status

# fuzz: the file-reader properties of tests/test_fuzz.py with many more cases
# and fresh randomness each run (the suite runs a small fixed set)
FUZZ_EXAMPLES ?= 10000
fuzz:
	LLMC_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) LLMC_FUZZ_FRESH=1 \
	    $(PYTHON) -m pytest -q -s -p no:cacheprovider tests/test_fuzz.py

# clean: build products and caches
clean:
	rm -rf build dist *.egg-info .pytest_cache
	rm -f llmc_py/_native/_llmc*.so llmc_py/_native/_llmc.c llmc_py/_native/_llmc.o
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
