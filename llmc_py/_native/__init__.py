"""The C kernels: the cffi build (build.py), the one module that sees cffi
(lib.py: statuses, pointers, threads, instruction sets) and one thin wrapper
per kernel (kernels.py), each built from a declaration of its C arguments
(declare.py)."""
import pkgutil

# run from a source checkout after `pip install .`, Python imports this folder,
# which has no compiled module; let it also search the installed copy
__path__ = pkgutil.extend_path(__path__, __name__)
