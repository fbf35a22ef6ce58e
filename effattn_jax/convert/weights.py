"""Tensors between safetensors files and this model's parameters: where each Hugging Face
tensor goes and how it is laid out there, read one tensor at a time."""

from __future__ import annotations

import functools
import json
import math
import shutil
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from effattn_jax.convert.hf_config import ConvertError, family, is_dsa
from effattn_jax.sharding import leaves_by_path

IGNORED = (".rotary_emb.inv_freq",)  # buffers some checkpoints carry; recomputed here


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except ValueError:
            raise ConvertError(f"{index}: not JSON; the download was cut short (download it again)") from None
        except (KeyError, TypeError, AttributeError):
            raise ConvertError(
                f"{index}: no weight_map of tensor names to files (download it again)"
            ) from None
        paths = [model_dir / f for f in files]
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise ConvertError(f"{model_dir}: no *.safetensors weights")
    if missing := [p.name for p in paths if not p.exists()]:
        raise ConvertError(f"{model_dir}: {missing[0]} is missing (named by the index)")
    return paths


def _tensors(model_dir: Path) -> Iterator[tuple[Path, str, np.ndarray]]:
    """(file, name, float32 array) of every tensor, one at a time (bf16 and fp16 widened). The files are
    read, not memory-mapped: a mapping's pages would stay resident until the whole file is done.
    The format: a little-endian u64 header length, the JSON header, the tensors' bytes."""
    import ml_dtypes

    dtypes = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
    for path in _weight_files(model_dir):
        with open(path, "rb") as f:
            header, size = _header(path, f)
            for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                if entry["dtype"] not in dtypes:
                    raise ConvertError(f"{path}: tensor {name} is {entry['dtype']}; floating point expected")
                start, end = entry["data_offsets"]
                want = math.prod(entry["shape"]) * np.dtype(dtypes[entry["dtype"]]).itemsize
                f.seek(8 + size + start)
                data = f.read(end - start)
                if len(data) != want:
                    raise ConvertError(
                        f"{path}: tensor {name} has {len(data)} of its {want} bytes; the file is "
                        "truncated or corrupt (download it again)"
                    )
                yield (
                    path,
                    name,
                    np.frombuffer(data, dtypes[entry["dtype"]]).reshape(entry["shape"]).astype(np.float32),
                )


def _header(path: Path, f) -> tuple[dict, int]:
    """A safetensors file's tensor entries and header length; ConvertError when it has none."""
    bad = f"{path}: not a safetensors file, or truncated (download it again)"
    prefix = f.read(8)
    if len(prefix) < 8:
        raise ConvertError(bad)
    (size,) = struct.unpack("<Q", prefix)
    try:
        header = json.loads(f.read(min(size, 100_000_000)))
    except (ValueError, UnicodeDecodeError):
        raise ConvertError(f"{bad}: its header is not JSON") from None
    if not isinstance(header, dict):
        raise ConvertError(f"{bad}: its header is not a JSON object")
    header.pop("__metadata__", None)
    entry_ok = lambda e: isinstance(e, dict) and {"dtype", "shape", "data_offsets"} <= set(e)
    if not all(entry_ok(e) for e in header.values()):
        raise ConvertError(f"{bad}: a header entry lacks dtype, shape or data_offsets")
    return header, size


def file_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> its shape as stored in the file ([out, in] for a linear layer),
    from config.json alone: what each tensor is checked against before any transpose or reshape
    (after them, any tensor with the right number of elements would fit)."""
    d, heads, vocab, mlp = (
        hf["hidden_size"],
        hf["num_attention_heads"],
        hf["vocab_size"],
        hf["intermediate_size"],
    )
    head_dim = hf.get("head_dim") or d // heads
    kv = hf.get("num_key_value_heads") or heads
    attn = {
        "q_proj.weight": (heads * head_dim, d),
        "k_proj.weight": (kv * head_dim, d),
        "v_proj.weight": (kv * head_dim, d),
        "o_proj.weight": (d, heads * head_dim),
    }
    if family(hf) == "qwen2":
        attn |= {
            "q_proj.bias": (heads * head_dim,),
            "k_proj.bias": (kv * head_dim,),
            "v_proj.bias": (kv * head_dim,),
        }
    if family(hf) == "qwen3":
        attn |= {"q_norm.weight": (head_dim,), "k_norm.weight": (head_dim,)}
    if family(hf) == "deepseek":
        n, r, v, c = (hf[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
        q_in = hf.get("q_lora_rank") or d
        attn = {
            "kv_a_proj_with_mqa.weight": (c + r, d),
            "kv_a_layernorm.weight": (c,),
            "kv_b_proj.weight": (heads * (n + v), c),
            "o_proj.weight": (d, heads * v),
            "q_b_proj.weight" if hf.get("q_lora_rank") else "q_proj.weight": (heads * (n + r), q_in),
        }
        if hf.get("q_lora_rank"):
            attn |= {"q_a_proj.weight": (q_in, d), "q_a_layernorm.weight": (q_in,)}
    if is_dsa(hf):
        hi, di = hf["index_n_heads"], hf["index_head_dim"]
        attn |= {
            "indexer.wq_b.weight": (hi * di, hf["q_lora_rank"]),
            "indexer.wk.weight": (di, d),
            "indexer.k_norm.weight": (di,),
            "indexer.k_norm.bias": (di,),
            "indexer.weights_proj.weight": (hi, d),
        }
    per_layer = {f"self_attn.{k}": shape for k, shape in attn.items()} | {
        "mlp.gate_proj.weight": (mlp, d),
        "mlp.up_proj.weight": (mlp, d),
        "mlp.down_proj.weight": (d, mlp),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }
    out = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    for i in range(hf["num_hidden_layers"]):
        out |= {f"model.layers.{i}.{name}": shape for name, shape in per_layer.items()}
    return out


def check_file_shape(path: Path, name: str, array: np.ndarray, shapes: dict) -> None:
    """ConvertError, one line naming the tensor, both shapes and the file, where a tensor is not
    stored in the shape config.json implies (a transposed, flattened or reshaped weight)."""
    want = shapes.get(name)
    if want is not None and tuple(array.shape) != want:
        raise ConvertError(
            f"{path}: tensor {name} is stored as {tuple(array.shape)}, but config.json implies {want} "
            "([out, in] for a linear layer)"
        )


def layouts(hf: dict) -> dict[str, tuple[tuple[str, ...], Callable, Callable]]:
    """Hugging Face tensor name -> (this model's parameter path, to ours, back to theirs), for
    every tensor of a Llama-layout model. Hugging Face stores a linear layer as [out, in]; this
    model as [in, ...out]."""
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    kv = hf.get("num_key_value_heads") or heads
    same = lambda w: w
    t = lambda w: w.T
    split = lambda *shape: lambda w: w.T.reshape(*shape)
    split_bias = lambda *shape: lambda w: w.reshape(*shape)
    flat = lambda w: w.reshape(-1)
    merge_out = lambda w: w.reshape(d, -1).T  # [d, heads, head_dim] -> [heads * head_dim, d]
    merge_in = lambda w: w.reshape(-1, d).T  # [heads, head_dim, d] -> [d, heads * head_dim]
    per_layer = {
        "self_attn.q_proj.weight": (("attn", "q", "kernel"), split(d, heads, head_dim), merge_out),
        "self_attn.k_proj.weight": (("attn", "k", "kernel"), split(d, kv, head_dim), merge_out),
        "self_attn.v_proj.weight": (("attn", "v", "kernel"), split(d, kv, head_dim), merge_out),
        "self_attn.o_proj.weight": (("attn", "o", "kernel"), split(heads, head_dim, d), merge_in),
        "mlp.gate_proj.weight": (("mlp", "gate", "kernel"), t, t),
        "mlp.up_proj.weight": (("mlp", "up", "kernel"), t, t),
        "mlp.down_proj.weight": (("mlp", "down", "kernel"), t, t),
        "input_layernorm.weight": (("attn_norm", "scale"), same, same),
        "post_attention_layernorm.weight": (("mlp_norm", "scale"), same, same),
    }
    if family(hf) == "qwen2":
        for proj, n in (("q", heads), ("k", kv), ("v", kv)):
            per_layer[f"self_attn.{proj}_proj.bias"] = (("attn", proj, "bias"), split_bias(n, head_dim), flat)
    if family(hf) == "qwen3":
        for proj in ("q", "k"):
            per_layer[f"self_attn.{proj}_norm.weight"] = (("attn", f"{proj}_norm", "scale"), same, same)
    if family(hf) == "deepseek":
        per_layer = {k: v for k, v in per_layer.items() if not k.startswith("self_attn.")} | _mla_layouts(hf)
    out = {
        "model.embed_tokens.weight": (("embed",), same, same),
        "model.norm.weight": (("final_norm", "scale"), same, same),
    }
    if not hf.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (("lm_head",), t, t)
    for i in range(hf["num_hidden_layers"]):
        for name, (path, ours, theirs) in per_layer.items():
            out[f"model.layers.{i}.{name}"] = (("blocks", str(i), *path), ours, theirs)
    return out


def _mla_layouts(hf: dict) -> dict:
    """DeepSeek's MLA tensors (import only). Its RoPE rotates interleaved channel pairs (2i, 2i+1);
    this model rotates halves (i, i + d/2): the RoPE channels of q and k^R are reordered alike,
    which leaves every score unchanged. kv_a_proj_with_mqa (the latent and k^R) and kv_b_proj
    (W_UK and W_UV) are each split in two (`_split`)."""
    h, n, r, v = (
        hf[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    )
    halves = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])  # interleaved -> rotate-half
    if not hf.get("rope_interleave", True):  # DeepSeek-V3 may rotate halves already
        halves = np.arange(r)
    q_order = np.concatenate([np.arange(n), n + halves])
    q = lambda w: w.reshape(h, n + r, -1)[:, q_order, :].transpose(2, 0, 1)  # [in, H, n + r]
    up = lambda w: w.transpose(2, 0, 1)  # [H, width, d_c] -> [d_c, H, width]
    t = lambda w: w.T
    out = {
        "self_attn.kv_a_proj_with_mqa.weight:latent": (("attn", "dkv", "kernel"), t, None),
        "self_attn.kv_a_proj_with_mqa.weight:rope": (("attn", "kr", "kernel"), lambda w: w[halves].T, None),
        "self_attn.kv_a_layernorm.weight": (("attn", "kv_norm", "scale"), lambda w: w, None),
        "self_attn.kv_b_proj.weight:k": (("attn", "uk", "kernel"), up, None),
        "self_attn.kv_b_proj.weight:v": (("attn", "uv", "kernel"), up, None),
        "self_attn.o_proj.weight": (("attn", "o", "kernel"), lambda w: w.T.reshape(h, v, -1), None),
    }
    if hf.get("q_lora_rank"):
        out |= {
            "self_attn.q_a_proj.weight": (("attn", "dq", "kernel"), t, None),
            "self_attn.q_a_layernorm.weight": (("attn", "q_norm", "scale"), lambda w: w, None),
            "self_attn.q_b_proj.weight": (("attn", "q", "kernel"), q, None),
        }
    else:
        out["self_attn.q_proj.weight"] = (("attn", "q", "kernel"), q, None)
    if is_dsa(hf):  # the indexer rotates halves of its first channels, as this model does: no reorder
        hi, di = hf["index_n_heads"], hf["index_head_dim"]
        out |= {
            "self_attn.indexer.wq_b.weight": (
                ("attn", "indexer", "wq_b", "kernel"),
                lambda w: w.T.reshape(-1, hi, di),
                None,
            ),
            "self_attn.indexer.wk.weight": (("attn", "indexer", "wk", "kernel"), t, None),
            "self_attn.indexer.k_norm.weight": (("attn", "indexer", "k_norm", "scale"), lambda w: w, None),
            "self_attn.indexer.k_norm.bias": (("attn", "indexer", "k_norm", "bias"), lambda w: w, None),
            "self_attn.indexer.weights_proj.weight": (("attn", "indexer", "weights_proj", "kernel"), t, None),
        }
    return out


def mla_tensors(flat: Mapping, hf: dict) -> Iterator[tuple[str, np.ndarray]]:
    """DeepSeek's attention tensors of this model's MLA parameters (the inverse of
    `_mla_layouts` and `_split`), a layer at a time."""
    n, r = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    interleaved = np.argsort(np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)]))
    if not hf.get("rope_interleave", True):
        interleaved = np.arange(r)
    q_order = np.concatenate([np.arange(n), n + interleaved])
    for i in range(hf["num_hidden_layers"]):
        out = {}
        p = lambda *path: np.asarray(flat[("blocks", str(i), "attn", *path)], np.float32)  # noqa: B023
        name = f"model.layers.{i}.self_attn."
        q = p("q", "kernel")  # [in, H, n + r]
        q = q.transpose(1, 2, 0)[:, q_order, :].reshape(-1, q.shape[0])
        if hf.get("q_lora_rank"):
            out[name + "q_a_proj.weight"] = p("dq", "kernel").T
            out[name + "q_a_layernorm.weight"] = p("q_norm", "scale")
            out[name + "q_b_proj.weight"] = q
        else:
            out[name + "q_proj.weight"] = q
        kr = p("kr", "kernel").T[interleaved]
        out[name + "kv_a_proj_with_mqa.weight"] = np.concatenate([p("dkv", "kernel").T, kr])
        out[name + "kv_a_layernorm.weight"] = p("kv_norm", "scale")
        uk, uv = p("uk", "kernel").transpose(1, 2, 0), p("uv", "kernel").transpose(1, 2, 0)  # [H, width, d_c]
        out[name + "kv_b_proj.weight"] = np.concatenate([uk, uv], axis=1).reshape(-1, uk.shape[-1])
        o = p("o", "kernel")  # [H, v, D]
        out[name + "o_proj.weight"] = o.reshape(-1, o.shape[-1]).T
        if is_dsa(hf):
            wq_b = p("indexer", "wq_b", "kernel")  # [q_lora, Hi, Di]
            out[name + "indexer.wq_b.weight"] = wq_b.reshape(wq_b.shape[0], -1).T
            out[name + "indexer.wk.weight"] = p("indexer", "wk", "kernel").T
            out[name + "indexer.k_norm.weight"] = p("indexer", "k_norm", "scale")
            out[name + "indexer.k_norm.bias"] = p("indexer", "k_norm", "bias")
            out[name + "indexer.weights_proj.weight"] = p("indexer", "weights_proj", "kernel").T
        yield from out.items()


def write_safetensors(path: Path, tensors: Iterator[tuple[str, np.ndarray]], metadata: dict) -> None:
    """(name, array) pairs as one float32 safetensors file, one tensor on the host at a time. The
    format puts a header naming every tensor's offsets before the bytes: the bytes go to a side
    file first, then follow the header into `path`."""
    entries, offset = {}, 0
    side = path.with_name(path.name + ".partial")
    with open(side, "wb") as data:
        for name, array in tensors:
            array = np.ascontiguousarray(array, np.float32)
            data.write(memoryview(array).cast("B"))
            entries[name] = {
                "dtype": "F32",
                "shape": list(array.shape),
                "data_offsets": [offset, offset + array.nbytes],
            }
            offset += array.nbytes
            del array
    header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the tensors' bytes start 8-aligned, as safetensors writes them
    try:
        with open(path, "wb") as f, open(side, "rb") as data:
            f.write(struct.pack("<Q", len(header)) + header)
            shutil.copyfileobj(data, f, 1 << 24)
    finally:
        side.unlink()


def _split(tensors: Iterator[tuple[Path, str, np.ndarray]], hf: dict):
    """Every tensor checked against its stored shape (`file_shapes`), then DeepSeek's fused tensors
    as the two parameters each holds (others unchanged)."""
    shapes = file_shapes(hf)
    for path, name, array in tensors:
        check_file_shape(path, name, array, shapes)
        if name.endswith("kv_a_proj_with_mqa.weight"):
            c = hf["kv_lora_rank"]
            yield f"{name}:latent", array[:c]
            yield f"{name}:rope", array[c:]
        elif name.endswith("kv_b_proj.weight"):
            h, n, v = hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["v_head_dim"]
            heads = array.reshape(h, n + v, -1)
            yield f"{name}:k", heads[:, :n]
            yield f"{name}:v", heads[:, n:]
        else:
            yield name, array


def stacked_layers(cfg) -> dict[int, tuple[int, int]]:
    """Layer -> (its stack in `blocks`, its index there) for a model of stacked layers
    (`model.scan_layers`, one stack per run of layers of one kind); {} for one Block per layer."""
    from effattn_jax.model import layer_groups

    if not cfg.model.scan_layers:
        return {}
    return {start + j: (g, j) for g, (start, n, _) in enumerate(layer_groups(cfg)) for j in range(n)}


def in_stack(
    key: tuple[str, ...], stacks: dict[int, tuple[int, int]] | None
) -> tuple[tuple[str, ...], int | None]:
    """A per-layer parameter path ("blocks", layer, ...) -> (the path holding it, its index in the
    stack), or (the path, None) where layers are not stacked."""
    if not stacks or key[0] != "blocks":  # also None
        return key, None
    g, j = stacks[int(key[1])]
    return ("blocks", str(g), *key[2:]), j


@functools.cache
def _zeros(shape: tuple[int, ...], dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.cache
def _put_layer(sharding):
    """stack, layer, j -> the stack with layer j replaced, in place (the stack is donated)."""
    set_layer = lambda stack, layer, j: jax.lax.dynamic_update_index_in_dim(stack, layer, j, 0)
    return jax.jit(set_layer, out_shardings=sharding, donate_argnums=0)


def load_weights(model_dir: Path, hf: dict, abstract: dict, stacks: dict | None = None) -> dict:
    """The model's parameters, each tensor read, laid out and placed into its sharding in turn
    (host memory: one tensor at a time; a stacked layer's goes into its slot of the stack, in
    place); ConvertError naming the first tensor that is unknown, missing or of the wrong shape
    for the config. `stacks`: `stacked_layers` of a model of stacked layers."""
    flat = leaves_by_path(abstract)
    where, done, filled = layouts(hf), {}, {}
    for name, array in _split(_tensors(model_dir), hf):
        if name.endswith(IGNORED):
            continue
        key, j = in_stack(where[name][0], stacks) if name in where else (None, None)
        if key not in flat:
            raise ConvertError(f"{model_dir}: tensor {name} is not one a {hf['architectures'][0]} has here")
        layout, want = where[name][1], flat[key]
        value, shape = layout(array), want.shape if j is None else want.shape[1:]
        if value.shape != shape:
            raise ConvertError(
                f"{model_dir}: tensor {name} of shape {array.shape} does not match its config "
                f"(expected {shape} as {'/'.join(where[name][0])})"
            )
        if j is None:
            done[key] = jax.device_put(np.asarray(value, want.dtype), want.sharding)
        else:
            stack = done[key] if key in done else _zeros(want.shape, want.dtype, want.sharding)()
            done[key] = _put_layer(want.sharding)(stack, np.asarray(value, want.dtype), j)
            filled.setdefault(key, set()).add(j)
        del array, value  # one tensor on the host at a time
    short = lambda k: k not in done or (k in filled and len(filled[k]) < flat[k].shape[0])
    if missing := [k for k in flat if short(k)]:
        raise ConvertError(f"{model_dir}: no tensor for {'/'.join(missing[0])} ({len(missing)} missing)")
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), [done[k] for k in flat])


class Unstacked(Mapping):
    """A run's parameters by per-layer path ("blocks", layer, ...), whether its layers are stacked
    or not: a stacked layer is sliced out when asked for, one tensor at a time (never the whole
    model unstacked at once)."""

    def __init__(self, flat: dict, stacks: dict[int, tuple[int, int]]):
        self.flat, self.stacks = flat, stacks

    def __getitem__(self, key):
        path, j = in_stack(key, self.stacks)
        return self.flat[path] if j is None else self.flat[path][j]

    def __iter__(self):
        return iter(self.flat)

    def __len__(self):
        return len(self.flat)
