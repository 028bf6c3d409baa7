"""Dense-layer dots for x86-64 CPUs (AVX2 + FMA): an XLA FFI kernel and its reference.

``rows_matmul(x, w)`` computes ``x @ w.T`` for float32 ``x [M, K]`` and float32 or
bfloat16 ``w [N, K]`` (the checkpoint layout), in float32 (bf16 weights widened
exactly); leading dims, equal in both, are independent items (attention scores). Each output
is computed the same way whatever M is, so a model's numbers for a token do not
depend on how many tokens one call holds; see ``rows_matmul.cc`` for why this is
faster than XLA:CPU's dot at 2-64 rows.

The C++ source is compiled on first use with the system C++ compiler (``$CXX``,
else ``g++``/``c++``) against jaxlib's FFI headers, into
``$DART_JAX_CACHE/kernels`` (default ``~/.cache/dart_jax/kernels``), keyed by a
hash of the source, jaxlib's version and the compiler; later processes load the
built library. Where it cannot run (not x86-64 Linux with AVX2 + FMA, no
compiler, a failed build, or ``DART_JAX_CPU_MATMUL=0``), ``available()`` is False
and callers use XLA's dot; the reason is logged once.
"""

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

SOURCES = (pathlib.Path(__file__).with_name("rows_matmul.cc"),
           pathlib.Path(__file__).with_name("dart_search.cc"))
"""The C++ files compiled into the one library (dense dots, attention, sampling
scans; DART's tree search)."""
ENV_SWITCH = "DART_JAX_CPU_MATMUL"
AMX_ENV_SWITCH = "DART_JAX_CPU_AMX"
_TARGETS = {  # weight dtype -> (FFI target name, library symbol)
    jnp.dtype(jnp.float32): ("dart_rows_matmul_f32", "DartRowsMatmulF32"),
    jnp.dtype(jnp.bfloat16): ("dart_rows_matmul_bf16", "DartRowsMatmulBF16"),
}
_PANELS_TARGET = ("dart_panels_matmul_bf16", "DartPanelsMatmulBF16")
_ARGMAX_TARGET = ("dart_rows_argmax", "DartRowsArgmax")
_TOP_P_TARGET = ("dart_top_p_threshold", "DartTopPThreshold")
_SEARCH_TARGET = ("dart_search_tree", "DartSearchTreeCpu")
_CONTEXT_INSERT_TARGET = ("dart_context_insert", "DartContextInsertCpu")
_ATTENTION_TARGETS = {  # cache dtype -> (FFI target name, library symbol)
    jnp.dtype(jnp.float32): ("dart_tree_attention_f32", "DartTreeAttentionF32"),
    jnp.dtype(jnp.bfloat16): ("dart_tree_attention_bf16", "DartTreeAttentionBF16"),
}
ATTENTION_HEAD_DIMS = (16, 32, 64, 128, 256)
"""Head sizes ``tree_attention`` takes (whole 8-lane vectors, unrolled)."""
PANEL = 8
"""Output columns per panel of ``panels_matmul``'s weight layout ``[N / PANEL, K, PANEL]``."""


@functools.cache
def cpu_flags() -> frozenset[str]:
  """The CPU's feature flags from ``/proc/cpuinfo`` (empty off x86-64 Linux)."""
  if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
    return frozenset()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("flags"):
          return frozenset(line.split(":", 1)[1].split())
  except OSError:
    pass
  return frozenset()


def cpu_supports_kernel() -> bool:
  """x86-64 Linux whose CPU reports AVX2 and FMA."""
  return {"avx2", "fma"} <= cpu_flags()


def cpu_has_bf16_dot_instruction() -> bool:
  """AVX512-BF16 (VDPBF16PS): XLA:CPU's bf16 x bf16 -> f32 dot of many rows
  runs about twice as fast as its float32 dot there (2-core Zen 4, 512 rows of
  the tied LM head 576 x 49152: 102 vs 221 ms), though not at few rows and
  not for split3's three rows per row (see ``cpu_has_bf16_matrix_unit``)."""
  return "avx512_bf16" in cpu_flags()


def cpu_has_bf16_matrix_unit() -> bool:
  """AMX-BF16: XLA:CPU then runs bf16 x bf16 -> f32 dots on a fast path nearly
  flat in the row count (measured on the first, AMX machine), and the library
  keeps XLA's dots.

  AVX512-BF16 alone (a vector dot instruction, e.g. AMD Zen 4) does not count:
  on a 2-core Zen 4 EPYC XLA's split3 bf16 dot was slower than this kernel
  (plain decoding 38-39 vs 47-51 tok/s, a 512-token pass 1.8-2.1 s vs 1.5-1.6 s
  with widened weights; one process, alternating)."""
  return "amx_bf16" in cpu_flags()


def cpu_supports_amx_path() -> bool:
  """AMX-TILE/BF16 plus the AVX-512 (F, VL, BF16) instructions the tile path
  packs its rows with: the kernel is then built with its AMX path."""
  return {"amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx512vl"} <= cpu_flags()


def _compiler() -> str | None:
  for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
    if name and shutil.which(name):
      return name
  return None


def _cache_dir() -> pathlib.Path:
  root = os.environ.get("DART_JAX_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "dart_jax")
  return pathlib.Path(root) / "kernels"


def compile_flags() -> list[str]:
  """Instruction-set flags for this CPU: AVX2 + FMA, AVX-512F/VL where the
  CPU has them (the kernel's 256-bit code then has 32 registers and a larger
  tile; see ``rows_matmul.cc``), and AMX-TILE/BF16 (the tile path for bf16
  weights)."""
  flags = ["-mavx2", "-mfma"]
  if {"avx512f", "avx512vl"} <= cpu_flags():
    flags += ["-mavx512f", "-mavx512vl"]
  if cpu_supports_amx_path():
    flags += ["-mamx-tile", "-mamx-bf16", "-mavx512bf16"]
  return flags


def build(compiler: str) -> pathlib.Path:
  """Compiles ``SOURCES`` into one library (once per source, flags, jaxlib and
  compiler) and returns the shared library's path. Raises ``RuntimeError`` with
  the compiler's output on failure."""
  import jaxlib  # pylint: disable=import-outside-toplevel
  flags = compile_flags()
  sources = b"".join(source.read_bytes() for source in SOURCES)
  key = hashlib.sha256(sources + jaxlib.__version__.encode()
                       + compiler.encode() + " ".join(flags).encode()).hexdigest()[:16]
  out = _cache_dir() / f"rows_matmul-{key}.so"
  if out.exists():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  # Build beside the target and rename: a concurrent process never loads half a file.
  with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
    partial = pathlib.Path(tmp) / out.name
    cmd = [compiler, "-O3", *flags, "-std=c++17", "-shared", "-fPIC", "-w",
           f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(partial)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
      raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    os.replace(partial, out)
  return out


@functools.cache
def available() -> bool:
  """True when the kernel is built and registered with XLA for this process."""
  if os.environ.get(ENV_SWITCH, "1") in ("0", "false", "off"):
    log.info("cpu_matmul: off (%s=%s)", ENV_SWITCH, os.environ[ENV_SWITCH])
    return False
  if not cpu_supports_kernel():
    log.info("cpu_matmul: this CPU is not x86-64 Linux with AVX2 + FMA; using XLA's dot")
    return False
  compiler = _compiler()
  if compiler is None:
    log.warning("cpu_matmul: no C++ compiler (set CXX); using XLA's dot, which is "
                "slower at 2-64 rows on CPU")
    return False
  try:
    library = ctypes.cdll.LoadLibrary(str(build(compiler)))
    for name, symbol in (*_TARGETS.values(), *_ATTENTION_TARGETS.values(), _PANELS_TARGET,
                         _ARGMAX_TARGET, _TOP_P_TARGET, _SEARCH_TARGET,
                         _CONTEXT_INSERT_TARGET):
      jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)),
                                  platform="cpu")
    _enable_amx(library)
  except (RuntimeError, OSError, AttributeError) as e:
    log.warning("cpu_matmul: could not build or load the kernel, using XLA's dot: %s", e)
    return False
  return True


_amx_state: list[bool] = []  # [True] once the AMX path is on in this process


def _enable_amx(library) -> None:
  """Turns on the kernel's AMX path for bf16 weights where the CPU has AMX-BF16
  and Linux grants the tile state (``DART_JAX_CPU_AMX=0`` keeps the AVX2 path)."""
  if not cpu_supports_amx_path():
    return
  if os.environ.get(AMX_ENV_SWITCH, "1") in ("0", "false", "off"):
    log.info("cpu_matmul: AMX path off (%s=%s)", AMX_ENV_SWITCH, os.environ[AMX_ENV_SWITCH])
    return
  if library.DartRowsMatmulEnableAmx() == 1:
    _amx_state.append(True)
  else:
    log.warning("cpu_matmul: Linux refused the AMX tile state; bf16 weights take the AVX2 path")


def amx_active() -> bool:
  """True when bf16-weight calls of ``rows_matmul`` run on the AMX tile unit
  (each row split exactly into three bf16 parts; see ``rows_matmul.cc``)."""
  return available() and bool(_amx_state)


def rows_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
  """What ``rows_matmul`` computes, as an XLA dot (float32 accumulation).

  x: [..., M, K] float32; w: [..., N, K] (the same leading dims) -> [..., M, N]
  float32.
  """
  batch = tuple(range(x.ndim - 2))
  return jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32),
                             (((x.ndim - 1,), (w.ndim - 1,)), (batch, batch)),
                             preferred_element_type=jnp.float32)


@jax.custom_jvp
def rows_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """``x @ w.T`` with the FFI kernel; call only when ``available()``.

  x: [..., M, K] float32; w: [..., N, K] float32 or bfloat16, the same leading
  (batch) dims -> [..., M, N] float32. Differentiable: derivatives use
  ``rows_matmul_reference``.
  """
  if x.ndim < 2 or w.ndim != x.ndim or x.shape[:-2] != w.shape[:-2] or (
      x.shape[-1] != w.shape[-1]):
    raise ValueError(f"rows_matmul: x {x.shape} and w {w.shape} are not [..., M, K] and "
                     "[..., N, K] with equal leading dims")
  name, _ = _TARGETS[jnp.dtype(w.dtype)]
  return jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[-2],),
                                                     jnp.float32),
                          vmap_method="sequential")(x, w)


def _jvp_of_reference(kernel, reference):
  """A kernel's JVP rule: its value, and the tangent its XLA reference gives."""
  def jvp(primals, tangents):
    x, w = primals
    dx, dw = tangents
    return kernel(x, w), reference(dx, w) + reference(x, dw.astype(jnp.float32))
  return jvp


rows_matmul.defjvp(_jvp_of_reference(rows_matmul, rows_matmul_reference))


def to_panels(w):
  """``w [..., N, K]`` (numpy or jax) -> ``[..., N / PANEL, K, PANEL]``, the layout
  ``panels_matmul`` reads: panel p holds output columns ``PANEL * p ..`` for every k."""
  *lead, n, k = w.shape
  if n % PANEL:
    raise ValueError(f"to_panels: {n} output columns are not a multiple of {PANEL}")
  return w.reshape(*lead, n // PANEL, PANEL, k).swapaxes(-1, -2)


def from_panels(w):
  """The inverse of ``to_panels``: ``[..., N / PANEL, K, PANEL]`` -> ``[..., N, K]``."""
  *lead, p, k, width = w.shape
  return w.swapaxes(-1, -2).reshape(*lead, p * width, k)


def panels_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
  """What ``panels_matmul`` computes, as an XLA dot (float32 accumulation).

  x: [M, K] float32; w: [N / PANEL, K, PANEL] -> [M, N] float32.
  """
  out = jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32),
                            (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  return out.reshape(x.shape[0], -1)


@jax.custom_jvp
def panels_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """``x @ from_panels(w).T`` with the FFI kernel's panel form; call only when
  ``available()``.

  x: [M, K] float32; w: [N / PANEL, K, PANEL] bfloat16 (``to_panels`` of the
  ``[N, K]`` weights) -> [M, N] float32. Each output is one FMA chain over k in
  order, whatever M is (bitwise M-invariant, like ``rows_matmul``, but not
  bitwise equal to it). Derivatives use ``panels_matmul_reference``.
  """
  if (x.ndim != 2 or w.ndim != 3 or w.shape[-1] != PANEL or x.shape[1] != w.shape[1]
      or jnp.dtype(w.dtype) != jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"panels_matmul: x {x.shape} and w {w.shape} {w.dtype} are not [M, K] "
                     f"and bfloat16 [N / {PANEL}, K, {PANEL}]")
  return jax.ffi.ffi_call(_PANELS_TARGET[0],
                          jax.ShapeDtypeStruct((x.shape[0], w.shape[0] * PANEL), jnp.float32),
                          vmap_method="sequential")(x, w)


panels_matmul.defjvp(_jvp_of_reference(panels_matmul, panels_matmul_reference))


def _per_row(target: str, what: str, logits: jax.Array, dtype, **attrs) -> jax.Array:
  """A row-wise FFI call over ``logits [..., V]`` float32 -> [...] of ``dtype``."""
  if logits.ndim < 1 or logits.shape[-1] < 1 or logits.dtype != jnp.float32:
    raise ValueError(f"{what}: logits {logits.shape} {logits.dtype} are not float32 "
                     "[..., V] with V >= 1")
  rows = logits.reshape(-1, logits.shape[-1])
  out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(rows.shape[:1], dtype),
                         vmap_method="sequential")(rows, **attrs)
  return out.reshape(logits.shape[:-1])


def rows_argmax(logits: jax.Array) -> jax.Array:
  """The first index of each row's maximum with the FFI kernel (greedy tokens);
  call only when ``available()``.

  logits: [..., V] float32 -> [...] int32. A row's NaNs are skipped (an all-NaN
  row gives 0). XLA:CPU's reductions over a 49152-token vocabulary cost 0.2 ms
  for one row and 0.5-0.9 ms for six on the 2-core Zen 3 (``jnp.argmax`` and
  the max-then-first-index form alike); this scan takes tens of microseconds.
  """
  return _per_row(_ARGMAX_TARGET[0], "rows_argmax", logits, jnp.int32)


def top_p_threshold(logits: jax.Array, top_p: float) -> jax.Array:
  """The smallest logit that top-p (nucleus) sampling keeps in each row, with
  the FFI kernel; call only when ``available()``.

  logits: [..., V] float32 (temperature applied) -> [..., 1] float32: walking
  the logits from the largest down, a token is kept while the probability mass
  strictly before it is below ``top_p``; ``logits >= threshold`` is the nucleus.
  XLA:CPU sorts the whole vocabulary for this (6 rows of 49152: 85 ms on the
  2-core Zen 3); the kernel orders only the top logits that hold ``top_p``.
  """
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p_threshold: top_p must be in (0, 1], got {top_p}")
  return _per_row(_TOP_P_TARGET[0], "top_p_threshold", logits, jnp.float32,
                  top_p=np.float32(top_p))[..., None]


def dart_search_tree(tokens: jax.Array, log_probs: jax.Array, context: jax.Array,
                     context_len: jax.Array, table: tuple[jax.Array, jax.Array, jax.Array],
                     context_table: tuple[jax.Array, jax.Array], weights: jax.Array, *,
                     num_nodes: int, **attrs) -> tuple[jax.Array, ...]:
  """DART's beam search for a batch in one FFI call (``dart_search.cc``); call only
  when ``available()``. ``dart_jax.tree.dart_search.search_batch`` prepares the
  arguments and is the API.

  tokens: int32 [B, L, k] candidates per level; log_probs: float32 [B, L, k];
  context: int32 [B, C]; context_len: int32 [B]; table: the corpus N-gram's
  (keys int32 [K, 2], counts int32 [K], bucket starts int32 [...]); context_table:
  (keys uint32 [B, S], values int32 [B, S]); weights: float32 [2L] level weights
  then logit weights; num_nodes: N, the node budget; attrs: the search's static
  settings (see ``dart_search.cc``). Returns (tokens [B, N+1], parents, depth,
  scores, mask [B, N+1, N+1], paths [B, N, L+1], num_leaves [B]).
  """
  batch, levels, _ = tokens.shape
  size = num_nodes + 1
  shapes = (jax.ShapeDtypeStruct((batch, size), jnp.int32),
            jax.ShapeDtypeStruct((batch, size), jnp.int32),
            jax.ShapeDtypeStruct((batch, size), jnp.int32),
            jax.ShapeDtypeStruct((batch, size), jnp.float32),
            jax.ShapeDtypeStruct((batch, size, size), jnp.bool_),
            jax.ShapeDtypeStruct((batch, num_nodes, levels + 1), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))
  return jax.ffi.ffi_call(_SEARCH_TARGET[0], shapes, vmap_method="sequential")(
      tokens, log_probs, context, context_len, *table, *context_table, weights, **attrs)


def context_insert(keys: jax.Array, values: jax.Array, new_keys: jax.Array,
                   new_values: jax.Array, valid: jax.Array, *, probes: int,
                   add: bool) -> tuple[jax.Array, jax.Array]:
  """``dart_jax.ngram.context``'s row inserts for a batch in one FFI call; call only
  when ``available()``.

  keys: uint32 [B, S] (S a power of two); values: int32 [B, S]; new_keys: uint32
  [B, n]; new_values: int32 [B, n]; valid: bool [B, n]. Returns the updated
  (keys, values), bit-identical to ``_insert_row``'s (the same claim rounds).
  """
  shapes = (jax.ShapeDtypeStruct(keys.shape, jnp.uint32),
            jax.ShapeDtypeStruct(values.shape, jnp.int32))
  return jax.ffi.ffi_call(_CONTEXT_INSERT_TARGET[0], shapes, vmap_method="sequential",
                          input_output_aliases={0: 0, 1: 1})(
      keys.astype(jnp.uint32), values.astype(jnp.int32), new_keys.astype(jnp.uint32),
      new_values.astype(jnp.int32), valid.astype(jnp.bool_), probes=int(probes),
      add=int(add))


def _tree_attention_reference(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask,
                              scale):
  # Imported here: kernels.tree_attention imports this module.
  from kernels.tree_attention import common, reference  # pylint: disable=import-outside-toplevel
  return reference.tree_attention_reference(q, k_cache, v_cache, lengths, k_tree, v_tree,
                                            tree_mask, scale=scale,
                                            cache_layout=common.HEAD_MAJOR)


@functools.partial(jax.custom_jvp, nondiff_argnums=(7,))
def tree_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                   k_tree: jax.Array, v_tree: jax.Array, tree_mask: jax.Array,
                   scale: float) -> jax.Array:
  """Tree attention over a head-major cache in one FFI call per layer; call only
  when ``available()``.

  q: [B, T, Hq, hd]; k_cache, v_cache: [B, Hkv, S, hd] float32 or bfloat16 (only
  the first ``lengths[b]`` positions of row b are read); lengths: [B] int;
  k_tree, v_tree: [B, T, Hkv, hd]; tree_mask: [B, T, T] bool; hd in
  ``ATTENTION_HEAD_DIMS`` -> [B, T, Hq, hd] in q's dtype. The semantics of
  ``kernels.tree_attention.tree_attention_reference`` (a row that sees nothing
  gives zeros), computed in float32 row by row: scores, softmax and the weighted
  values of one query row do not depend on the other rows of the call. XLA:CPU
  runs the same as a score dot, masks, exps, sums and two value dots, ~0.13 ms a
  layer for 6 tokens on the 2-core Zen 3. Derivatives use the reference.
  """
  head_dim = q.shape[-1]
  if (q.ndim != 4 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape
      or head_dim not in ATTENTION_HEAD_DIMS or k_cache.shape[-1] != head_dim
      or jnp.dtype(k_cache.dtype) not in _ATTENTION_TARGETS):
    raise ValueError(f"tree_attention: q {q.shape} and caches {k_cache.shape} "
                     f"{k_cache.dtype} are not [B, T, Hq, hd] and float32 / bfloat16 "
                     f"[B, Hkv, S, hd] with hd in {ATTENTION_HEAD_DIMS}")
  name, _ = _ATTENTION_TARGETS[jnp.dtype(k_cache.dtype)]
  out = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                         vmap_method="sequential")(
      q.astype(jnp.float32), k_cache, v_cache, lengths.astype(jnp.int32),
      k_tree.astype(jnp.float32), v_tree.astype(jnp.float32), tree_mask.astype(jnp.bool_),
      scale=np.float32(scale))
  return out.astype(q.dtype)


@tree_attention.defjvp
def _tree_attention_jvp(scale, primals, tangents):
  value = tree_attention(*primals, scale)
  _, tangent = jax.jvp(lambda *a: _tree_attention_reference(*a, scale), primals, tangents)
  return value, tangent


__all__ = ["tree_attention", "dart_search_tree", "context_insert", "ATTENTION_HEAD_DIMS", "rows_matmul", "rows_argmax", "top_p_threshold", "panels_matmul",
           "panels_matmul_reference", "to_panels", "from_panels", "PANEL",
           "rows_matmul_reference", "available", "amx_active", "cpu_flags",
           "cpu_supports_kernel", "cpu_supports_amx_path", "cpu_has_bf16_matrix_unit",
           "cpu_has_bf16_dot_instruction", "build"]
