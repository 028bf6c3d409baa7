"""The target model handle: config + NNX graphdef/params + tokenizer, and loading."""

import dataclasses
import functools
import logging
import os
from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx

from dart_jax import sharding as sharding_lib
from dart_jax.errors import CheckpointError
from dart_jax.models import checkpoint, moe, static_graph
from dart_jax.models import precision as precision_lib
from dart_jax.models.config import ModelConfig, config_from_hf
from dart_jax.models.precision import Precision
from dart_jax.models.transformer import KVCache, ModelOutput, Transformer
from dart_jax import io as dio

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
  """A loaded target model, used functionally.

  Attributes:
    config: the architecture.
    graphdef: static NNX graph of ``Transformer``.
    params: NNX state (a pytree of arrays).
    tokenizer: ``dart_jax.io.Tokenizer`` or None for token-id-only use.
    precision: how weights are stored and dense layers run
      (``dart_jax.models.precision``); ``dtype`` is its compute / cache dtype.
    attn_impl: tree_attention implementation used by every call.
    source: where the weights came from (for messages).
    mesh: the device mesh the parameters are sharded over (``shard``), or None
      on one device. Caches and prompt batches follow it.
  """

  config: ModelConfig
  graphdef: Any
  params: Any
  tokenizer: Any = None
  precision: Precision = precision_lib.FLOAT32
  attn_impl: str = "auto"
  source: str = ""
  mesh: Any = None

  def __post_init__(self):
    static_graph.use_static_graphdefs(self)  # a cheap static jit argument

  @functools.cached_property
  def dense_layout(self) -> str:
    """How the dense layers store their matrices: "panels", "weight" or "kernel"
    (``precision.weight_layout``; a target holds one, the LM head aside)."""
    names = {str(getattr(key, "key", "")) for path, _ in
             jax.tree_util.tree_leaves_with_path(self.params) for key in path}
    return next((name for name in ("panels", "weight", "kernel") if name in names), "kernel")

  @functools.cached_property
  def call_params(self) -> static_graph.FlatTree:
    """``params`` as the argument of the decoding calls (flattened once)."""
    return static_graph.FlatTree(self.params)

  @classmethod
  def init(cls, config: ModelConfig, *, seed: int = 0, dtype=None, tokenizer=None,
           attn_impl: str = "auto") -> "Target":
    """A randomly initialised target (tests, tiny experiments).

    dtype: a ``Precision``, its name, or a dtype; default
    ``precision.default()`` (``fast`` on CPU).
    """
    precision = precision_lib.resolve(dtype)
    model = Transformer(config, rngs=nnx.Rngs(seed), precision=precision)
    graphdef, params = nnx.split(model)
    return cls(config, graphdef, params, tokenizer, precision, attn_impl, "random")

  @property
  def dtype(self):
    """Compute / KV-cache dtype."""
    return self.precision.dtype

  def module(self) -> Transformer:
    """The NNX module (call inside jit, as flax examples/gemma does)."""
    return nnx.merge(self.graphdef, self.params)

  def new_cache(self, batch: int, capacity: int) -> KVCache:
    """An empty KV cache in the layout this target's attention reads; on the
    target's mesh, sharded like its attention."""
    c = self.config
    split_heads = (self.mesh is not None and
                   sharding_lib.attention_splits(c.num_heads, c.num_kv_heads, self.mesh))
    return KVCache.for_attention(c.num_layers, batch, capacity, c.num_kv_heads,
                                 c.head_dim, self.dtype, self.attn_impl, mesh=self.mesh,
                                 split_heads=split_heads)

  def shard(self, mesh: jax.sharding.Mesh) -> "Target":
    """This target with its parameters sharded over ``mesh`` (``dart_jax.sharding``:
    heads, MLP and vocabulary over "tensor", norms replicated)."""
    mesh = sharding_lib.auto_mesh(mesh)
    params = sharding_lib.place_params(
        self.params, mesh, what=f"{self.config.arch} target", num_heads=self.config.num_heads,
        num_kv_heads=self.config.num_kv_heads)
    return dataclasses.replace(self, params=params, mesh=mesh)

  def place_batch(self, x) -> jax.Array:
    """A host array [B, ...] on the target's devices (rows over "data")."""
    return sharding_lib.place_batch(x, self.mesh)

  def forward(self, tokens, positions, cache, tree_mask, *, attend_len=None,
              taps=(), logit_rows=None) -> ModelOutput:
    """Jitted ``Transformer.__call__`` (donates ``cache``)."""
    return _forward(self.graphdef, self.call_params, tokens, positions, cache, tree_mask,
                    attend_len=attend_len, taps=tuple(taps), logit_rows=logit_rows,
                    attn_impl=self.attn_impl)

  def with_params(self, params) -> "Target":
    return dataclasses.replace(self, params=params)


@functools.partial(jax.jit, static_argnames=("graphdef", "attend_len", "taps", "attn_impl"),
                   donate_argnames=("cache",))
def _forward(graphdef, params, tokens, positions, cache, tree_mask, *, attend_len, taps,
             logit_rows, attn_impl):
  model = nnx.merge(graphdef, params)
  return model(tokens, positions, cache, tree_mask, attend_len=attend_len, taps=taps,
               logit_rows=logit_rows, attn_impl=attn_impl)


# HF parameter name for each NNX state path of ``Transformer``.
hf_name = checkpoint.renamer((
    (r"embed_tokens/embedding", "model.embed_tokens.weight"),
    (r"norm/scale", "model.norm.weight"),
    (r"lm_head/(kernel|weight|panels)", "lm_head.weight"),
    (r"tied_head/panels", "model.embed_tokens.weight"),  # a packed copy (panels)
    # MoE layers, in the stacked names ``moe_tensors`` gives any released layout.
    (r"layers/(\d+)/mlp/router/(kernel|weight|panels)", r"model.layers.\1.mlp.gate.weight"),
    (r"layers/(\d+)/mlp/experts/(gate_proj|up_proj|down_proj)/(kernel|weight|panels)",
     r"model.layers.\1.mlp.experts.\2.weight"),
    (r"layers/(\d+)/(self_attn|mlp)/(\w+_proj)/(kernel|weight|panels)",
     r"model.layers.\1.\2.\3.weight"),
    (r"layers/(\d+)/(self_attn|mlp)/(\w+_proj)/bias", r"model.layers.\1.\2.\3.bias"),
    (r"layers/(\d+)/self_attn/(q_norm|k_norm)/scale", r"model.layers.\1.self_attn.\2.weight"),
    (r"layers/(\d+)/(\w+_layernorm)/scale", r"model.layers.\1.\2.weight"),
))


def params_from_hf(config: ModelConfig, tensors: Mapping[str, np.ndarray], precision,
                   source: str = "", mesh: jax.sharding.Mesh | None = None
                   ) -> tuple[Any, Any]:
  """Builds (graphdef, params) from HF-named tensors ([out, in] linear weights).

  precision: a ``Precision`` or anything ``precision.resolve`` takes. MoE experts
  may come per expert or fused (``moe.stack_expert_tensors``). mesh: build the
  parameters sharded over it (``dart_jax.sharding``), slice by slice.
  """
  if config.sparse_layers:
    tensors = moe.stack_expert_tensors(config, tensors, source=source)
  placement = None
  if mesh is not None:
    placement = sharding_lib.Placement(mesh, what=f"{config.arch} target",
                                       num_heads=config.num_heads,
                                       num_kv_heads=config.num_kv_heads)
  graphdef, params = checkpoint.state_from_tensors(
      lambda: Transformer(config, rngs=nnx.Rngs(0), precision=precision), tensors, hf_name,
      source=source, what=f"{config.arch} checkpoint", sharding_of=placement)
  if placement is not None:
    placement.report()
  return graphdef, params


def load_target(path: str | os.PathLike | None = None, *, dtype=None,
                attn_impl: str = "auto", mesh: jax.sharding.Mesh | None = None) -> Target:
  """Loads a target model.

  Args:
    path: a HF directory (config.json + model.safetensors or sharded safetensors
      with an index), a ``.gguf`` file, or None for the embedded default
      (SmolLM2-135M-Instruct, converted once into ``dart_jax.io.cache_dir()``).
    dtype: the numeric mode: a ``Precision``, its name ("fast", "float32",
      "bfloat16", "fast-rows") or a dtype (``jnp.float32`` = the exact float32
      mode). Default ``fast`` on CPU (bf16 weights, float32-accurate
      activations), ``bfloat16`` on TPU/GPU.
    attn_impl: tree_attention implementation ("auto" picks the kernel per backend).
    mesh: a device mesh with a "tensor" axis (and optionally "data"): the
      parameters are built sharded over it (``dart_jax.sharding``), each device
      receiving only its slices, read from safetensors files slice by slice;
      ``generate`` then runs sharded. GGUF files and MoE experts are read whole
      on the host first.
  Returns:
    A ``Target``.
  """
  if mesh is not None:
    mesh = sharding_lib.auto_mesh(mesh)
  precision = precision_lib.resolve(dtype)
  if path is None:
    path = dio.ensure_embedded_converted()
  path = os.fspath(path)
  if not os.path.exists(path):
    raise CheckpointError(f"no checkpoint at {path!r}: expected a HF model directory "
                          "(config.json + *.safetensors) or a .gguf file")
  if os.path.isfile(path):
    if not path.endswith(".gguf"):
      raise CheckpointError(f"{path!r} is a file but not a .gguf; pass a HF model "
                            "directory or a .gguf file")
    hf_config, tensors, tokenizer = dio.read_gguf(path)
  else:
    hf_config, tensors = dio.read_safetensors_dir(path, lazy=mesh is not None)
    tokenizer = None
    if os.path.exists(os.path.join(path, "tokenizer.json")):
      tokenizer = dio.Tokenizer.from_dir(path)
  config = config_from_hf(hf_config)
  if tokenizer is not None and not config.eos_token_ids and tokenizer.eos_token_ids:
    config = dataclasses.replace(config, eos_token_ids=tuple(tokenizer.eos_token_ids))
  graphdef, params = params_from_hf(config, tensors, precision, source=path, mesh=mesh)
  log.info("loaded %s target from %s (%s%s)", config.arch, path, precision.name,
           f", mesh {dict(mesh.shape)}" if mesh is not None else "")
  return Target(config, graphdef, params, tokenizer, precision, attn_impl, path, mesh)
