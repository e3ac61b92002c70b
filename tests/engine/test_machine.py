"""dtype ``auto``: bf16 only on CPUs with native bf16 matmuls (AVX512_BF16 / AMX), fp32 elsewhere."""

from __future__ import annotations

import pytest

from prism_serve.config import default_config
from prism_serve.engine.config import EngineConfig
from prism_serve.engine.machine import cpu_flags, native_bf16, resolve_dtype
from prism_serve.errors import InvalidRequestError
from prism_serve.runtime.models import ModelSpec

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
SAPPHIRE_RAPIDS = AVX2 | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
ZEN4 = AVX2 | {"avx512f", "avx512_bf16"}


@pytest.mark.parametrize(
    ("flags", "expected"),
    [(AVX2, "float32"), (AVX2 | {"avx512f", "avx512bw"}, "float32"), (ZEN4, "bfloat16"),
     (SAPPHIRE_RAPIDS, "bfloat16"), (frozenset(), "float32")],
)  # fmt: skip
def test_auto_is_bf16_only_with_native_bf16_matmuls(flags, expected):
    assert resolve_dtype("auto", flags=flags) == expected
    assert native_bf16(flags) is (expected == "bfloat16")


def test_explicit_dtypes_and_aliases_are_kept_and_unknown_ones_named():
    aliases = [("fp32", "float32"), ("float32", "float32"), ("bf16", "bfloat16"), ("bfloat16", "bfloat16")]
    for name, concrete in aliases:
        assert resolve_dtype(name, flags=AVX2) == concrete
        assert resolve_dtype(name, flags=SAPPHIRE_RAPIDS) == concrete
    assert resolve_dtype("auto", "cuda", flags=AVX2) == "bfloat16"  # tensor cores, whatever the host CPU
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16")


def test_auto_is_the_default_everywhere_and_resolves_on_this_machine():
    here = "bfloat16" if cpu_flags() & {"avx512_bf16", "amx_bf16"} else "float32"
    assert EngineConfig().dtype == "auto"
    assert ModelSpec("m").engine.dtype == here  # resolved once: status and the weight cache show it
    assert ModelSpec("m", engine=EngineConfig(dtype="bf16")).engine.dtype == "bfloat16"
    assert all(m.dtype == "auto" for m in default_config().models)  # the built-in config follows it
    with pytest.raises(InvalidRequestError):
        ModelSpec("m", engine=EngineConfig(dtype="int4"))
