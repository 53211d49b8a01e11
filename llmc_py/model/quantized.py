"""A linear layer's weight held in llama.cpp's quantized blocks (Q8_0, Q4_0):
made from an fp32 weight (or from a GGUF tensor's bytes) and called like
matmul_forward without the weight; ``backward`` gives the input gradient
(LoRA on a frozen quantized base); ``rows`` gathers an embedding's rows.
Norms and biases stay fp32, as llama.cpp keeps them.

Two kernels, picked by the number of rows of a call:
  at most FEW_ROWS (decoding)  matmul_forward_quant: each row quantized to
      Q8_0, integer dot products; reads the weight's bytes once.
  more (prefill, training)     the panel path: the weight dequantised to bf16
      (d*q rounded to nearest even) a tile at a time into the bf16 GEMM, which
      is compute-bound at bf16 speed.
The few-row kernel's time grows with every row while the panel path's is
first its dequantisation of the whole weight; timed once at a 1024 x 3072
Q8_0 weight on a shared Zen 5 (2 threads) they crossed near 8 rows (8 rows:
0.46 against 0.50 ms; 4 rows: 0.22 against 0.47; an earlier few-row kernel,
slower per row than today's), so a decoding batch of up to 8 keeps the
integer kernel. A row's result thus
depends on which side of FEW_ROWS its call is, not on the rows beside it
otherwise. The backward (no decoding use) is the panel path for any count.

QuantizedExperts holds an MoE layer's stack of expert weights the same way
(each expert's rows packed as QuantizedLinear's, one after another) for
the grouped forward: each expert of at most FEW_ROWS rows takes the
decoding kernel, all of them in one parallel loop; an expert of more the
panel path."""
import numpy as np

from .._native import kernels as K
from .._native.lib import called, check, ffi, lib
from ..errors import ShapeError

FEW_ROWS = 8   # calls of at most this many rows take the decoding kernel
# the weights of a model's linear layers that Transformer.quantize replaces
# (besides the embedding and the head)
QUANTIZED_LINEARS = ("qkvw", "attprojw", "fcw", "fcprojw")
# the MoE layers' stacks of expert weights [E, OC, IC] it replaces (their
# routers stay float32, as llama.cpp keeps ffn_gate_inp)
QUANTIZED_EXPERTS = ("expertfcw", "expertprojw")
# quant.c's panel tiles: at most this many bytes of bf16, at least this many columns
_PANEL_TILE_BYTES, _PANEL_MIN_TILE = 8 << 20, 192


def _quant_type(qtype):
    """GGML's type number of a quantisation named "q8_0" or "q4_0"."""
    if qtype not in K.QUANT_TYPES:
        raise ValueError(f"unknown quantisation type {qtype!r}; known: {', '.join(K.QUANT_TYPES)}")
    return K.QUANT_TYPES[qtype]


def check_weights_type(qtype):
    """ValueError naming ``qtype`` unless it is "q8_0" or "q4_0"."""
    _quant_type(qtype)


def block_bytes(qtype):
    """Bytes of one block of 32 weights: 34 for Q8_0, 18 for Q4_0."""
    return K._BLOCK_BYTES[_quant_type(qtype)]


def panel_scratch_bytes(N, OC, IC, widened):
    """The panel path's temporary bytes for N rows of an [OC, IC] weight,
    the larger of forward and backward (quant.c's panel_tile): a bf16 tile
    and an [N, tile] float part; ``widened`` (no AVX512_BF16) adds the bf16
    GEMM's float32 copies of the tile and of the rounded input."""
    most = 0
    for tiled, other in ((OC, IC), (IC, OC)):
        cols = max(_PANEL_TILE_BYTES // 2 // other // _PANEL_MIN_TILE * _PANEL_MIN_TILE,
                   _PANEL_MIN_TILE)
        cols = min(cols, -(-tiled // 32) * 32)
        nbytes = 2 * cols * other + 4 * N * cols
        if widened:
            nbytes += 4 * cols * other + 4 * N * other
        most = max(most, nbytes)
    return most


def check_input_dim(name, shape, qtype):
    """ShapeError naming tensor ``name`` unless its input dimension (the last
    of ``shape``) is a whole number of blocks."""
    if shape[-1] % K.QUANT_BLOCK != 0:
        raise ShapeError(f"{name} has shape {tuple(shape)}: its input dimension {shape[-1]} is "
                         f"not a multiple of {K.QUANT_BLOCK}, which {qtype} blocks need")


class QuantizedLinear:
    """weight [OC, IC] as OC rows of IC/32 blocks of ``qtype`` ("q8_0": 34
    bytes a block, "q4_0": 18). Held in the kernels' packed layout (each
    row's bytes moved within the row: quant_pack_rows); ``blocks`` gives
    them byte for byte as GGUF stores them. ``name`` (the tensor's) is what
    errors name. ``packed``: the uint8 [OC, row bytes] memory to hold them
    (a part of a model's one buffer for all its quantized weights), else
    a new array."""

    def __init__(self, blocks, IC, qtype, name="weight", packed=None):
        self.qtype, self.name = qtype, name
        self._type = _quant_type(qtype)
        check_input_dim(name, (len(blocks), IC), qtype)
        row_bytes = IC // K.QUANT_BLOCK * K._BLOCK_BYTES[self._type]
        if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != row_bytes:
            raise ShapeError(f"{name}: blocks of {blocks.dtype} {blocks.shape}, expected uint8 "
                             f"[OC, {row_bytes}] for {qtype} with {IC} inputs")
        if packed is None:
            packed = np.empty(blocks.shape, np.uint8)
        elif packed.dtype != np.uint8 or packed.shape != blocks.shape:
            raise ShapeError(f"{name}: memory of {packed.dtype} {packed.shape} for its packed "
                             f"blocks, expected uint8 {list(blocks.shape)}")
        self.packed = packed
        K.quant_pack_rows(self.packed, np.ascontiguousarray(blocks), self._type)
        self._packed_pointer = ffi.from_buffer("uint8_t[]", self.packed)
        self.shape = (blocks.shape[0], IC)

    @classmethod
    def quantize(cls, weight, qtype, name="weight", packed=None):
        """The blocks of an fp32 weight [OC, IC], rounded as llama.cpp rounds
        (held in ``packed``, as the constructor's)."""
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        if weight.ndim != 2:
            raise ShapeError(f"{name} has shape {weight.shape}, expected [OC, IC]")
        kind = _quant_type(qtype)
        check_input_dim(name, weight.shape, qtype)
        OC, IC = weight.shape
        blocks = np.empty((OC, IC // K.QUANT_BLOCK * K._BLOCK_BYTES[kind]), np.uint8)
        K.quantize_rows(blocks, weight, kind)
        return cls(blocks, IC, qtype, name, packed)

    @property
    def nbytes(self):
        return self.packed.nbytes

    @property
    def blocks(self):
        """The weight's blocks as GGUF stores them (a new array)."""
        return self._unpacked(self.packed)

    def _unpacked(self, packed):
        blocks = np.empty_like(packed)
        K.quant_unpack_rows(blocks, packed, self._type)
        return blocks

    def dequantize(self):
        """The weight [OC, IC] in fp32 (d * q per block)."""
        out = np.empty(self.shape, np.float32)
        K.dequantize_rows(out, self.blocks, self._type)
        return out

    def rows(self, out, ids):
        """out[..., IC] (written) = the weight's rows ``ids`` (int, any shape),
        dequantised exactly (d * q): an embedding's gather."""
        K.dequantize_rows(out.reshape(-1, self.shape[1]),
                          self._unpacked(self.packed[ids.reshape(-1)]), self._type)

    def __call__(self, out, inp, bias=None):
        """out[..., OC] (written) = inp[..., IC] . W^T + bias[OC] (or None), as
        matmul_forward: up to FEW_ROWS rows with each row quantized to Q8_0
        on the fly, more on the panel path (see the module)."""
        OC, IC = self.shape
        self._check(inp, out, "input", "output", out)
        rows = np.ascontiguousarray(inp).reshape(-1, IC)
        if len(rows) > FEW_ROWS:
            K.matmul_forward_quant_panels(out.reshape(-1, OC), rows, self.packed, bias,
                                          self._type)
        elif (rows.dtype == out.dtype == np.float32
              and (bias is None or (bias.dtype == np.float32 and bias.shape == (OC,)
                                    and bias.flags.c_contiguous))):
            # decoding calls the C function itself: _check and the line above
            # are the wrapper's checks, at a third of its ~14 us (a step makes
            # four or more calls a layer)
            check(called(lib.matmul_forward_quant, (
                ffi.from_buffer("float[]", out, require_writable=True),
                ffi.from_buffer("float[]", rows), self._packed_pointer,
                ffi.NULL if bias is None else ffi.from_buffer("float[]", bias),
                len(rows), IC, OC, self._type)), f"{self.name}: matmul_forward_quant")
        else:   # the wrapper, for its errors
            K.matmul_forward_quant(out.reshape(-1, OC), rows, self.packed, bias, self._type)

    def backward(self, dinp, dout):
        """dinp[..., IC] (+=) dout[..., OC] . W, on the panel path; the weight
        is frozen, so there is no weight gradient."""
        OC, IC = self.shape
        self._check(dinp, dout, "input gradient", "output gradient", dinp)
        K.matmul_backward_quant_panels(dinp.reshape(-1, IC),
                                       np.ascontiguousarray(dout).reshape(-1, OC),
                                       self.packed, self._type)

    def _check(self, inp, out, inp_name, out_name, written):
        """ShapeError unless inp [..., IC] and out [..., OC] fit the weight
        and ``written`` (one of them) is C-contiguous."""
        OC, IC = self.shape
        if inp.shape[-1] != IC or out.shape != inp.shape[:-1] + (OC,):
            raise ShapeError(f"{self.name} [{OC}, {IC}]: {inp_name} {inp.shape} and "
                             f"{out_name} {out.shape} do not fit it")
        if not written.flags.c_contiguous:
            name = out_name if written is out else inp_name
            raise ShapeError(f"{self.name}: the {name} must be C-contiguous")


class QuantizedExperts(QuantizedLinear):
    """An MoE layer's stack of expert weights [E, OC, IC] as E * OC rows of
    ``qtype`` blocks (expert e's OC rows from e * OC), in QuantizedLinear's
    packed layout; ``blocks`` gives them [E, OC, bytes] as GGUF stores a
    stack (ffn_gate_exps, ...). Called as moe.c's grouped forward."""

    def __init__(self, blocks, IC, qtype, name="experts"):
        if blocks.ndim != 3:
            raise ShapeError(f"{name}: blocks of shape {blocks.shape}, expected uint8 "
                             f"[E, OC, bytes] (a stack of experts)")
        E, OC, row_bytes = blocks.shape
        super().__init__(blocks.reshape(E * OC, row_bytes), IC, qtype, name)
        self.shape = (E, OC, IC)

    @classmethod
    def quantize(cls, weight, qtype, name="experts"):
        """The blocks of an fp32 stack [E, OC, IC], rounded as llama.cpp rounds."""
        weight = np.asarray(weight)
        if weight.ndim != 3:
            raise ShapeError(f"{name} has shape {weight.shape}, expected [E, OC, IC]")
        E, OC, IC = weight.shape
        rows = QuantizedLinear.quantize(weight.reshape(E * OC, IC), qtype, name)
        return cls(rows.blocks.reshape(E, OC, -1), IC, qtype, name)

    @classmethod
    def zeros(cls, shape, qtype, name="experts"):
        """A stack [E, OC, IC] of zero weights, for put_expert to fill."""
        E, OC, IC = shape
        check_input_dim(name, shape, qtype)
        return cls(np.zeros((E, OC, IC // K.QUANT_BLOCK * block_bytes(qtype)), np.uint8), IC,
                   qtype, name)

    def put_expert(self, e, weight):
        """Expert e's weight [OC, IC] (float) quantized into its rows."""
        E, OC, IC = self.shape
        if np.shape(weight) != (OC, IC):
            raise ShapeError(f"{self.name}: expert {e}'s weight has shape {np.shape(weight)}, "
                             f"expected {[OC, IC]}")
        rows = QuantizedLinear.quantize(weight, self.qtype, f"{self.name}[{e}]")
        self.packed[e * OC:(e + 1) * OC] = rows.packed

    @property
    def blocks(self):
        return super().blocks.reshape(self.shape[0], self.shape[1], -1)

    def dequantize(self):
        """The stack [E, OC, IC] in fp32 (d * q per block)."""
        E, OC, IC = self.shape
        out = np.empty((E * OC, IC), np.float32)
        K.dequantize_rows(out, self._unpacked(self.packed), self._type)
        return out.reshape(self.shape)

    def __call__(self, out, inp, offsets):
        """out[R, OC] (written): rows offsets[e] .. offsets[e+1] of inp[R, IC]
        times expert e's weight^T (moe_grouped_forward_quant)."""
        K.moe_grouped_forward_quant(out, np.ascontiguousarray(inp), self.packed, offsets,
                                    self._type, FEW_ROWS)
