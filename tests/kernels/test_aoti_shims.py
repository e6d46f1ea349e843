"""The kernels' C functions for the compiled decode step (kernels/aoti_shims.h): one for every op a model's step
calls, each taking the op's arguments in AOTInductor's C shim convention and an output pointer for each result
(or a null one where the op returns nothing): the order inductor's generated code passes them in."""

from __future__ import annotations

import pytest
import torch

from tokenloop import kernels

pytestmark = pytest.mark.skipif(kernels._unsupported_reason() is not None, reason="no CPU kernels here")
SAMPLER_OPS = {  # run eager, outside the step
    "argmax",
    "softmax_normalizers",
    "scaled_softmax",
    "top_candidates",
    "exponential_race",
    "race_exponentials",
    "racing_rows",
}


def c_type(arg: torch._C.Argument) -> str:
    types = {"Tensor": "AtenTensorHandle", "Optional[Tensor]": "AtenTensorHandle*", "int": "int64_t", "float": "double"}
    return types.get(str(arg.type), "const char*" if str(arg.type) == "str" else str(arg.type))


def test_every_op_of_a_models_step_has_a_c_function_with_its_schemas_parameters():
    assert kernels.cpu_kernels_available()
    shims = kernels.aoti_c_shims()
    ops = {
        name
        for name in dir(torch.ops.tokenloop)
        if isinstance(getattr(torch.ops.tokenloop, name), torch._ops.OpOverloadPacket)
    }
    assert {op.name().removeprefix("tokenloop::") for op in shims} == ops - SAMPLER_OPS
    for op, (declaration,) in shims.items():
        name = op.name().removeprefix("tokenloop::")
        parameters = declaration.split("(", 1)[1].rstrip(")").split(", ")
        expected = [f"{c_type(arg)} {arg.name}" for arg in op._schema.arguments]
        assert parameters[: len(expected)] == expected, name
        returns = len(op._schema.returns)
        outputs = [f"AtenTensorHandle* ret{i}" for i in range(returns)] or ["AtenTensorHandle* no_output"]
        assert parameters[len(expected) :] == outputs, name
