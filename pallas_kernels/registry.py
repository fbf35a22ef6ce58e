"""Every Pallas kernel, by (family, part, backend): the one place the model's code asks for one.
Each entry imports its module inside its own function, so the import graph sees every kernel
while a GPU run imports no TPU code (and the reverse).

  ("moba", "attention", b)  b in tpu / triton / mosaic: moba.kernels.Kernels (own + selected blocks)
  ("moba", "routing", b)    the fused gate's selection (routing_{tpu,gpu,mgpu}.py)
  ("moba", "decode", b)     a single-token step over a K/V cache ({tpu,gpu,mgpu}_decode.py)
  ("mla", "decode", b)      a single-token step in latent space (mla_decode/{tpu,gpu,mgpu}.py)
  ("dsa", "attention", b)   b in triton / tpu: attention over each query's selected keys, forward
                            and backward (dsa/triton.py, dsa/tpu_attention.py)
  ("dsa", "decode", b)      b in triton / tpu: a decode step over the selected latent rows
                            (dsa/triton_decode.py, dsa/tpu_decode.py)
  ("dsa", "select", b)      b in triton / tpu: the indexer's scores and each query's top-k of a
                            whole sequence in one kernel (dsa/triton_select.py, dsa/tpu_select.py)

Every routing entry takes (q, starts, means, lo, hi, picks, *, seq, key_dtype, interpret); every
decode entry the arguments of its family's XLA step and `interpret`. Which backend runs is decided
by the callers (ops/moba.py, ops/routing.py, ops/moba_decode.py, ops/mla_decode.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pallas_kernels.moba import kernels as moba_attention


def _moba_routing_tpu():
    from pallas_kernels.moba.routing_tpu import routing_tpu

    return routing_tpu


def _moba_routing_triton():
    from pallas_kernels.moba.routing_gpu import routing_gpu

    return routing_gpu


def _moba_routing_mosaic():
    from pallas_kernels.moba.routing_mgpu import routing_mgpu

    return routing_mgpu


def _moba_decode_tpu():
    from pallas_kernels.moba.tpu_decode import moba_decode_tpu

    return moba_decode_tpu


def _moba_decode_triton():
    from pallas_kernels.moba.gpu_decode import moba_decode_gpu

    return moba_decode_gpu


def _moba_decode_mosaic():
    from pallas_kernels.moba.mgpu_decode import moba_decode_mgpu

    return moba_decode_mgpu


def _mla_decode_tpu():
    from pallas_kernels.mla_decode.tpu import mla_decode_tpu

    return mla_decode_tpu


def _mla_decode_triton():
    from pallas_kernels.mla_decode.gpu import mla_decode_gpu

    return mla_decode_gpu


def _mla_decode_mosaic():
    from pallas_kernels.mla_decode.mgpu import mla_decode_mgpu

    return mla_decode_mgpu


def _dsa_attention_triton():
    from pallas_kernels.dsa.triton import sparse_attention_gpu

    return sparse_attention_gpu


def _dsa_attention_tpu():
    from pallas_kernels.dsa.tpu_attention import sparse_attention_tpu

    return sparse_attention_tpu


def _dsa_decode_triton():
    from pallas_kernels.dsa.triton_decode import sparse_latent_decode_gpu

    return sparse_latent_decode_gpu


def _dsa_decode_tpu():
    from pallas_kernels.dsa.tpu_decode import sparse_latent_decode_tpu

    return sparse_latent_decode_tpu


def _dsa_select_triton():
    from pallas_kernels.dsa.triton_select import index_topk_gpu

    return index_topk_gpu


def _dsa_select_tpu():
    from pallas_kernels.dsa.tpu_select import index_topk_tpu

    return index_topk_tpu


REGISTRY: dict[tuple[str, str, str], Callable[[], Any]] = {
    ("moba", "attention", "tpu"): moba_attention.tpu,
    ("moba", "attention", "triton"): moba_attention.triton,
    ("moba", "attention", "mosaic"): moba_attention.mosaic,
    ("moba", "routing", "tpu"): _moba_routing_tpu,
    ("moba", "routing", "triton"): _moba_routing_triton,
    ("moba", "routing", "mosaic"): _moba_routing_mosaic,
    ("moba", "decode", "tpu"): _moba_decode_tpu,
    ("moba", "decode", "triton"): _moba_decode_triton,
    ("moba", "decode", "mosaic"): _moba_decode_mosaic,
    ("mla", "decode", "tpu"): _mla_decode_tpu,
    ("mla", "decode", "triton"): _mla_decode_triton,
    ("mla", "decode", "mosaic"): _mla_decode_mosaic,
    ("dsa", "attention", "triton"): _dsa_attention_triton,
    ("dsa", "attention", "tpu"): _dsa_attention_tpu,
    ("dsa", "decode", "triton"): _dsa_decode_triton,
    ("dsa", "decode", "tpu"): _dsa_decode_tpu,
    ("dsa", "select", "triton"): _dsa_select_triton,
    ("dsa", "select", "tpu"): _dsa_select_tpu,
}


def kernel(family: str, part: str, backend: str):
    """The kernel registered for (family, part, backend), imported on first use."""
    key = (family, part, backend)
    if key not in REGISTRY:
        backends = sorted(b for f, p, b in REGISTRY if (f, p) == (family, part))
        allowed = f"one of {backends}" if backends else f"a registered (family, part), not {family, part}"
        raise ValueError(f"{family} {part} kernel backend must be {allowed}, got {backend!r}")
    return REGISTRY[key]()
