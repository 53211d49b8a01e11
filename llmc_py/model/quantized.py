"""A linear layer's weight held in llama.cpp's quantized blocks (Q8_0, Q4_0),
for decoding: made from an fp32 weight (or from a GGUF tensor's bytes) and
called like matmul_forward without the weight. Norms, biases and
embeddings stay fp32, as llama.cpp keeps them."""
import numpy as np

from .._native import kernels as K
from ..errors import ShapeError


def _quant_type(qtype):
    """GGML's type number of a quantisation named "q8_0" or "q4_0"."""
    if qtype not in K.QUANT_TYPES:
        raise ValueError(f"unknown quantisation type {qtype!r}; known: {', '.join(K.QUANT_TYPES)}")
    return K.QUANT_TYPES[qtype]


def check_weights_type(qtype):
    """ValueError naming ``qtype`` unless it is "q8_0" or "q4_0"."""
    _quant_type(qtype)


def check_input_dim(name, shape, qtype):
    """ShapeError naming tensor ``name`` unless its input dimension (the last
    of ``shape``) is a whole number of blocks."""
    if shape[-1] % K.QUANT_BLOCK != 0:
        raise ShapeError(f"{name} has shape {tuple(shape)}: its input dimension {shape[-1]} is "
                         f"not a multiple of {K.QUANT_BLOCK}, which {qtype} blocks need")


class QuantizedLinear:
    """weight [OC, IC] as OC rows of IC/32 blocks of ``qtype`` ("q8_0": 34
    bytes a block, "q4_0": 18), byte for byte as GGUF stores it. ``name``
    (the tensor's) is what errors name."""

    def __init__(self, blocks, IC, qtype, name="weight"):
        self.qtype, self.name = qtype, name
        self._type = _quant_type(qtype)
        check_input_dim(name, (len(blocks), IC), qtype)
        row_bytes = IC // K.QUANT_BLOCK * K._BLOCK_BYTES[self._type]
        if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != row_bytes:
            raise ShapeError(f"{name}: blocks of {blocks.dtype} {blocks.shape}, expected uint8 "
                             f"[OC, {row_bytes}] for {qtype} with {IC} inputs")
        self.blocks = np.ascontiguousarray(blocks)
        self.shape = (blocks.shape[0], IC)

    @classmethod
    def quantize(cls, weight, qtype, name="weight"):
        """The blocks of an fp32 weight [OC, IC], rounded as llama.cpp rounds."""
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        if weight.ndim != 2:
            raise ShapeError(f"{name} has shape {weight.shape}, expected [OC, IC]")
        kind = _quant_type(qtype)
        check_input_dim(name, weight.shape, qtype)
        OC, IC = weight.shape
        blocks = np.empty((OC, IC // K.QUANT_BLOCK * K._BLOCK_BYTES[kind]), np.uint8)
        K.quantize_rows(blocks, weight, kind)
        return cls(blocks, IC, qtype, name)

    @property
    def nbytes(self):
        return self.blocks.nbytes

    def dequantize(self):
        """The weight [OC, IC] in fp32 (d * q per block)."""
        out = np.empty(self.shape, np.float32)
        K.dequantize_rows(out, self.blocks, self._type)
        return out

    def __call__(self, out, inp, bias=None):
        """out[..., OC] (written) = inp[..., IC] . W^T + bias[OC] (or None), as
        matmul_forward; each row of inp quantized to Q8_0 on the fly."""
        OC, IC = self.shape
        if inp.shape[-1] != IC or out.shape != inp.shape[:-1] + (OC,):
            raise ShapeError(f"{self.name} [{OC}, {IC}]: input {inp.shape} and output "
                             f"{out.shape} do not fit it")
        if not out.flags.c_contiguous:
            raise ShapeError(f"{self.name}: the output must be C-contiguous")
        K.matmul_forward_quant(out.reshape(-1, OC), np.ascontiguousarray(inp).reshape(-1, IC),
                               self.blocks, bias, self._type)
