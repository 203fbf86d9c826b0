"""Code generation: static config -> CUDA C++ (templates in `templates/`) -> cubin."""
from .compiler import CompileError, Compiled, compile_nvcc, compile_source
from .decode_kernel import TILE_TOKENS, DecodeKernelConfig, DecodePlanKernelConfig, DecodeVariant
from .params import DECODE_PARAMS, PLAN_PARAMS, Field, ParamStruct, TensorMap

__all__ = ["CompileError", "Compiled", "DECODE_PARAMS", "DecodeKernelConfig", "DecodePlanKernelConfig", "DecodeVariant", "Field",
           "PLAN_PARAMS", "ParamStruct", "TILE_TOKENS", "TensorMap", "compile_nvcc",
           "compile_source"]
