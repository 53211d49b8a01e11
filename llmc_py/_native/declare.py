"""A kernel's Python wrapper built from one declaration of its C arguments.

A declaration lists the C function's arguments in its order (llmc_api.h:
arrays, then sizes, then scalars), in three parts separated by "|":

  "out[B,T,C] written, inp[B,T,C], bias[C]=None | B T C from inp | eps=1e-5"

arrays   name[dims], the dims Python expressions of size letters; then
         "written", "+=" or "updated" for an output (the rest are inputs);
         "or None" (None passes NULL) or "=None" (the same, and None is the
         default); "tokens<V" (ids in [0, V); one out of range is named with
         its position) or "targets<V" (the same, or IGNORE_INDEX). A dim
         "..." is any leading dims, the size source's; ">=T" is at least T
         rows, of which the first T are passed. The dtype is the C type's
         (float*, int*, uint16_t*, double*, uint8_t*); a void* array is an
         activation in float32 or bf16 (uint16), either.
sizes    the C size arguments in order, "from" the arrays that give them, in
         the order they are checked. A plain source is unpacked by its dims
         (x[N] and x[...] give their size). A rule such as heads(inp, NH, NKV)
         calls the kernels module's _heads(inp, "inp", NH, NKV), which checks a
         packed layout and returns the sizes it gives in the order listed.
         Sizes no source gives are the caller's.
scalars  name, name=default, or name:convert[=default], convert one of seed or
         window (the kernels module's _seed, _window), int, flag (0 or 1);
         or dtype(x), no parameter: the llmc_dtype of void* array x's dtype.

The wrapper takes the arrays, the caller's sizes and the scalars in that order
(``args`` reorders them), then ``variant=""`` if the kernel has ``variants``:
C twins named <name>_<variant>. It is generated as Python source once, at
import, so that a call runs just what a hand-written wrapper would, in the
same order: the size sources' checks, each array's in C order, the C
function (through lib.called, so that lib.record_calls can record it), and
its status raised as an exception. Its source is kept in
linecache, so tracebacks printed by the traceback module (and pytest) show it."""
import linecache
import re
from typing import NamedTuple

from .lib import ffi

_ADAPTER = {"float *": "fptr", "int *": "iptr", "uint16_t *": "hptr", "double *": "dptr",
            "uint8_t *": "bptr", "void *": "aptr"}
_CONVERT = {"": "{}", "seed": "_seed({})", "window": "_window({})", "int": "int({})",
            "flag": "int(bool({}))", "dtype": "dtype_code({})"}
_DTYPE_OF = re.compile(r"dtype\((\w+)\)$")
_ARRAY = re.compile(r"\s*(\w+)\[([^\]]*)\](=None)?([^,]*)(,|$)")
_SOURCE = re.compile(r"(\w+)(?:\(([^)]*)\))?")


class _Array(NamedTuple):
    name: str
    dims: list          # Python expressions, or "..." first, or ">=T" first
    out: bool
    optional: bool      # None passes NULL
    default_none: bool
    tokens: tuple       # (the vocabulary's size letter, IGNORE_INDEX allowed) or ()
    role: str           # an output's "written", "+=" or "updated"; "" for an input


class _Scalar(NamedTuple):
    name: str
    convert: str
    default: str


def bind(namespace, lib, name, declaration, doc, *, args=None, variants=()):
    """The wrapper of C function ``name`` of ``lib``; its code looks its helpers
    up in ``namespace`` (the kernels module's globals)."""
    array_part, size_part, scalar_part = (declaration.split("|") + ["", ""])[:3]
    arrays = {a.name: a for a in map(_parse_array, _ARRAY.finditer(array_part))}
    letters, _, sources = size_part.partition(" from ")
    letters = letters.split()
    scalars = [_parse_scalar(s) for s in scalar_part.split(",") if s.strip()]

    c_functions = {"": getattr(lib, name), **{v: getattr(lib, f"{name}_{v}") for v in variants}}
    c_args = ffi.typeof(c_functions[""]).args
    if len(c_args) != len(arrays) + len(letters) + len(scalars) \
            or any(ffi.typeof(f) != ffi.typeof(c_functions[""]) for f in c_functions.values()):
        raise TypeError(f"the declaration of {name} does not match its C arguments")

    body, bound = [], []
    for source in _SOURCE.finditer(sources):
        body += _bind_sizes(source, arrays, letters, bound)
    params = _parameters(arrays, [s for s in letters if s not in bound],
                         [s for s in scalars if s.convert != "dtype"], args)
    kernel, where = "c_function", f'"{name}"'
    if variants:
        params.append('variant=""')
        kernel = "_variant(c_function, variant)"
        where += ' + (f"_{variant}" if variant else "")'

    call = [_pointer(a, c_type.cname, name) for a, c_type in zip(arrays.values(), c_args)]
    call += letters + [_CONVERT[s.convert].format(s.name) for s in scalars]
    status = f"called({kernel}, (\n            " + ",\n            ".join(call) + "))"
    tokens = [a for a in arrays.values() if a.tokens]
    if tokens:
        (a,) = tokens
        V, ignore = a.tokens
        body.append(f'_check_tokens({status}, {where}, {a.name}, "{a.name}", {V}'
                    + (", allow_ignore=True)" if ignore else ")"))
    else:
        body.append(f"check({status}, {where})")
    wrapper = _compile(namespace, name, params, body,
                       c_functions if variants else c_functions[""], doc)
    # what each array argument is to the kernel (the benchmark's profile counts its bytes)
    wrapper.roles = {a.name: a.role for a in arrays.values()}
    return wrapper


def _parameters(arrays, given, scalars, args):
    """The wrapper's parameters: arrays, the caller's sizes, scalars, or in ``args``'s order."""
    params = {a.name: a.name + ("=None" if a.default_none else "") for a in arrays.values()}
    params.update({s: s for s in given})
    params.update({s.name: s.name + (f"={s.default}" if s.default else "") for s in scalars})
    return [params[p] for p in args.split()] if args else list(params.values())


def _parse_array(match):
    name, dims, default_none, qualifiers, _ = match.groups()
    words = qualifiers.replace("or None", "").split()
    tokens = [w for w in words if w.startswith(("tokens<", "targets<"))]
    roles = [w for w in words if w in ("written", "+=", "updated")]
    if len(tokens) + len(roles) != len(words) or len(tokens) > 1 or len(roles) > 1:
        raise ValueError(f"{name}: unknown or repeated qualifiers in {qualifiers.strip()!r}")
    return _Array(name, [d.strip() for d in dims.split(",")], bool(roles),
                  bool(default_none) or "or None" in qualifiers, bool(default_none),
                  (tokens[0].split("<")[1], tokens[0].startswith("targets")) if tokens else (),
                  roles[0] if roles else "")


def _parse_scalar(text):
    dtype_of = _DTYPE_OF.match(text.strip())
    if dtype_of:   # not a parameter: the array's element type
        return _Scalar(dtype_of.group(1), "dtype", "")
    name, _, default = text.strip().partition("=")
    name, _, convert = name.partition(":")
    if convert not in _CONVERT:
        raise ValueError(f"{name}: unknown conversion {convert!r}")
    return _Scalar(name, convert, default)


def _bind_sizes(source, arrays, letters, bound):
    """The lines that check one size source and bind the sizes it gives."""
    rule, rule_args = source.groups()
    if rule_args is None:
        arr = rule
        dims = arrays[arr].dims
        if dims == ["..."] or (len(dims) == 1 and dims[0] in letters):
            gives = [next(s for s in letters if s not in bound) if dims == ["..."] else dims[0]]
            lines = [f'_dims({arr}, "{arr}")', f"{gives[0]} = {arr}.size"]
        else:
            names = []
            for d in dims:   # a letter twice, as in att[B,NH,T,T], is given by its first dim
                names.append(d if d in letters and d not in bound and d not in names else "_")
            gives = [d for d in names if d != "_"]
            lines = [f'{_unpack(names)} = _dims({arr}, "{arr}", {len(dims)})']
    else:
        arr, *taken = [s.strip() for s in rule_args.split(",")]
        dims = arrays[arr].dims
        gives = [s for s in letters if s not in bound and s not in taken]
        lines = [f'{_unpack(gives)} = _{rule}({arr}, "{arr}"{"".join(", " + s for s in taken)})']
    if "..." in dims:
        lines.append(f"lead = {arr}.shape" + (f"[:-{len(dims) - 1}]" if len(dims) > 1 else ""))
    bound += gives
    return lines


def _unpack(names):
    return ", ".join(names) + ("," if len(names) == 1 else "")


def _tuple(items):
    return f"({_unpack(items)})"


def _pointer(array, c_type, name):
    """The expression that passes one array argument."""
    if c_type not in _ADAPTER:
        raise TypeError(f"{name}: {array.name} is declared an array but C takes {c_type}")
    dims = array.dims
    if dims[0] == "...":
        shape = "lead" + (f" + {_tuple(dims[1:])}" if dims[1:] else "")
    else:
        shape = _tuple([d.removeprefix(">=") for d in dims])
    value = array.name
    if dims[0].startswith(">="):
        value = f'_first_rows({array.name}, {dims[0][2:]}, "{array.name}")'
    pointer = f'{_ADAPTER[c_type]}({value}, "{array.name}", {shape}' \
              + (", out=True)" if array.out else ")")
    return f"ffi.NULL if {array.name} is None else {pointer}" if array.optional else pointer


def _compile(namespace, name, params, body, c_function, doc):
    """The wrapper from its lines; a closure over the C function (or its variants)."""
    source = "\n".join([
        "def make(c_function):",
        f"    def {name}({', '.join(params)}):",
        *(f"        {line}" for line in body),
        f"    return {name}", ""])
    filename = f"<kernel {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope = {}
    exec(compile(source, filename, "exec"), namespace, scope)
    wrapper = scope["make"](c_function)
    wrapper.__qualname__, wrapper.__doc__ = name, doc
    return wrapper
