"""The training loop: jitted train step, evaluation, Orbax checkpoints, export.

One loop for every drafter kind (``head.kind``); what differs per kind (making
the drafter, its loss and metrics, its export format) is its objective module
in ``train/objectives`` (``dart``, ``dflash`` for DFlash / Domino, ``dart_gru``),
so the loop names no kind.

State (a pytree, checkpointed whole): the drafter's trainable parameters and
(DART) its ``d2t``/``t2d`` buffers as nested dicts (DART-GRU: the frozen DART
head, whole, is the buffers), the Optax state, the step
and the RNG key (anchor sampling). The data iterator's state is saved next to
it as JSON, so a restarted run continues with exactly the batches and anchors
it would have seen. After each evaluation the head with the best held-out
estimated acceptance so far is exported to ``WORKDIR/best`` (``best.json``
records its step and score, and survives a resume). The target is frozen: its parameters are an argument of the step, never
differentiated and never saved. With ``data.target_features=cached`` its pass
runs once per training row before the first step (``train/features.py``) and
batches carry the stored features instead.
"""

import dataclasses
import functools
import json
import logging
import os
import shutil
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import dart_jax as dj
from dart_jax import sharding as model_sharding
from dart_jax.draft.dart_gru import DartGruConfig, DartGruDrafter
from dart_jax.draft.dart_head import DartConfig, DartHead
from dart_jax.draft.dflash import DFlashConfig, DFlashDrafter
from dart_jax.errors import CheckpointError, ConfigError
from dart_jax.models import precision as precision_lib
from train import data as data_lib
from train import features as features_lib
from train import objectives
from train import sharding
from train.configs import REQUIRED, OptimSection, TrainConfig, to_dict

log = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class StepSettings:
  """Everything static about a train step (hashable: one compile per setting).

  head_config: a ``DartConfig`` (DART), ``DFlashConfig`` (DFlash / Domino) or
    ``DartGruConfig`` (DART-GRU).
  position_gamma: DFlash slot weights ``exp(-(k-1)/gamma)`` (resolved, > 0).
  anneal_steps: Domino's l goes 1 -> 0 over these steps.
  domino_floor: Domino's l never falls below this.
  """

  head_config: DartConfig | DFlashConfig | DartGruConfig
  num_anchors: int
  level_decay: float
  param_dtype: str
  compute_dtype: str
  attn_impl: str
  optim: OptimSection
  steps: int
  position_gamma: float = 1.0
  anneal_steps: int = 0
  domino_floor: float = 0.0

  @property
  def objective(self):
    """The objective module of the drafter (``train.objectives``)."""
    return objectives.for_config(self.head_config)


def make_optimizer(optim: OptimSection, steps: int) -> tuple[optax.GradientTransformation,
                                                             optax.Schedule]:
  """AdamW (decay on matrices only) after global-norm clipping; linear warmup
  then cosine decay to ``end_lr_ratio * learning_rate``."""
  warmup = min(optim.warmup_steps, max(steps - 1, 0))
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=optim.learning_rate, warmup_steps=warmup,
      decay_steps=max(steps, warmup + 1), end_value=optim.learning_rate * optim.end_lr_ratio)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  tx = optax.chain(
      optax.clip_by_global_norm(optim.clip_norm),
      optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                  weight_decay=optim.weight_decay, mask=decay_mask))
  return tx, schedule


def head_from_state(config, state: dict):
  """The trained head or drafter (host arrays) from a train state."""
  host = lambda tree: jax.tree.map(jnp.asarray, jax.device_get(tree))
  return objectives.for_config(config).from_state(config, host(state["params"]),
                                                  host(state["buffers"]))


def state_specs(state: dict, settings: StepSettings, mesh) -> dict:
  """PartitionSpecs of a train state: parameters and moments by the rules."""
  def param_spec(path, leaf):
    return model_sharding.spec_for(model_sharding.path_str(path), np.shape(leaf), mesh)

  params = jax.tree_util.tree_map_with_path(param_spec, state["params"])
  tx, _ = make_optimizer(settings.optim, settings.steps)
  opt = optax.tree_map_params(tx, lambda _, spec: spec, state["opt_state"], params,
                              transform_non_params=lambda _: P(),
                              is_leaf=lambda x: isinstance(x, P))
  return {"params": params, "buffers": jax.tree.map(lambda _: P(), state["buffers"]),
          "opt_state": opt, "step": P(), "rng": P()}


def _forward(settings: StepSettings, target_graphdef, target_params, params, buffers,
             batch, key, step):
  """Loss and per-level (per-slot) stats of one batch (drafter params differentiable)."""
  target_model = nnx.merge(target_graphdef, target_params)
  compute = (target_model.precision.dtype if settings.compute_dtype == "auto"
             else _DTYPES[settings.compute_dtype])
  return settings.objective.forward(settings, target_model, params, buffers, batch, key,
                                    step, compute)


def _global_norm(tree) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def _constrain(tree, specs):
  if jax.sharding.get_abstract_mesh().empty:
    return tree
  return jax.lax.with_sharding_constraint(tree, specs)


@functools.partial(jax.jit, static_argnames=("settings", "target_graphdef"),
                   donate_argnames=("state",))
def train_step(state: dict, target_params, batch: dict, *, settings: StepSettings,
               target_graphdef) -> tuple[dict, dict]:
  """One optimizer step. batch: dict of [B, T] arrays (tokens, loss_mask,
  segment_ids, positions). Returns (new state, metrics with LevelStats /
  BlockStats sums)."""
  rng, key = jax.random.split(state["rng"])
  grad_fn = jax.value_and_grad(
      lambda p: _forward(settings, target_graphdef, target_params, p, state["buffers"],
                         batch, key, state["step"]), has_aux=True)
  (loss, stats), grads = grad_fn(state["params"])
  tx, schedule = make_optimizer(settings.optim, settings.steps)
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  new_state = {"params": params, "buffers": state["buffers"], "opt_state": opt_state,
               "step": state["step"] + 1, "rng": rng}
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    new_state = _constrain(new_state, state_specs(new_state, settings, mesh))
  metrics = {"loss": loss, "grad_norm": _global_norm(grads),
             "lr": schedule(state["step"]), "stats": stats,
             "tokens": jnp.sum(batch["segment_ids"] > 0),
             **settings.objective.step_metrics(settings, state["step"])}
  return new_state, metrics


@functools.partial(jax.jit, static_argnames=("settings", "target_graphdef"))
def eval_step(params, buffers, target_params, batch, key, *, settings: StepSettings,
              target_graphdef):
  """Per-level (per-slot) stats of one held-out batch (fixed anchors for a fixed key)."""
  _, stats = _forward(settings, target_graphdef, target_params, params, buffers, batch, key,
                      jnp.int32(settings.steps))
  return stats


def summarize(settings: StepSettings, stats) -> dict:
  """Host-side metrics of summed stats for the settings' drafter kind."""
  return settings.objective.summarize(settings, stats)


def init_state(head, settings: StepSettings, seed: int) -> dict:
  """A fresh train state. Arrays are copies: the step donates its state, and
  ``head`` must stay usable."""
  params, buffers = jax.tree.map(jnp.copy, settings.objective.split(
      head, _DTYPES[settings.param_dtype]))
  tx, _ = make_optimizer(settings.optim, settings.steps)
  return {"params": params, "buffers": buffers, "opt_state": tx.init(params),
          "step": jnp.zeros((), jnp.int32), "rng": jax.random.PRNGKey(seed)}


def place_state(state: dict, settings: StepSettings, mesh) -> dict:
  specs = state_specs(state, settings, mesh)
  shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs,
                           is_leaf=lambda x: isinstance(x, P))
  return model_sharding.put(state, shardings)


def place_target(target, mesh):
  """The target's parameters sharded by the rules over ``mesh``."""
  return model_sharding.put(target.params, model_sharding.param_shardings(target.params, mesh))


# ---------------------------------------------------------------- logging


class MetricsLog:
  """stdout lines (through tqdm) and ``WORKDIR/metrics.jsonl``; process 0 only.

  resume_step: the step training restarts from; records of later steps (written
  by a run that died before its next checkpoint) are dropped, so the file reads
  as one uninterrupted run.
  """

  def __init__(self, workdir: str, enabled: bool, bar=None, resume_step: int = 0):
    self.enabled = enabled
    self.bar = bar
    self.path = os.path.join(workdir, "metrics.jsonl")
    if enabled and os.path.exists(self.path):
      with open(self.path, encoding="utf-8") as f:
        lines = f.readlines()  # ends only at newlines (str.splitlines also breaks at U+2028)
      kept = [line for line in lines if line.endswith("\n") and
              json.loads(line).get("step", 0) <= resume_step]
      if len(kept) != len(lines):
        with open(self.path, "w", encoding="utf-8") as f:
          f.writelines(kept)

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps(record) + "\n")
    acc = " ".join(f"{a:.3f}" for a in record.get("acc", []))
    text = (f"[{record['split']}] step {record['step']}: loss {record['loss']:.4f} "
            f"acc {acc} accept_len {record['accept_len']:.3f}")
    if "accept_len_base" in record:
      # DART-GRU logs its head's base estimate but has no candidate table.
      bound = record.get("accept_len_candidates")
      text += (f" (base {record['accept_len_base']:.3f}" +
               (f", top-K candidates bound {bound:.3f})" if bound is not None else ")"))
    if "domino_lambda" in record:
      text += f" lambda {record['domino_lambda']:.3f}"
    if "grad_norm" in record:
      text += f" grad_norm {record['grad_norm']:.3f} lr {record['lr']:.2e}"
    if "tokens_per_s" in record:
      text += f" tok/s {record['tokens_per_s']:.0f}"
    if self.bar is not None:
      self.bar.write(text)
    else:
      print(text, flush=True)


# ------------------------------------------------------------------- train


@dataclasses.dataclass
class TrainResult:
  """What ``train`` returns: the final head or drafter, its state and the logged records."""

  head: DartHead | DFlashDrafter | DartGruDrafter
  state: dict
  history: list
  export_dir: str | None
  start_step: int
  best: dict | None = None  # {"step", "accept_len", "dir"} of the best evaluated head


BEST_JSON = "best.json"


def read_best(workdir: str) -> dict | None:
  """The best evaluated head's record in ``workdir`` (None before the first eval)."""
  path = os.path.join(workdir, BEST_JSON)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def export_if_best(objective, head, record: dict, workdir: str, best: dict | None
                   ) -> dict | None:
  """Exports ``head`` to ``WORKDIR/best`` when its eval ``accept_len`` beats ``best``.

  The export goes to ``best.partial``, which replaces ``best`` only once it is
  complete, and ``best.json`` is written after that: a failed or killed export
  leaves the previous best head and its record (a kill in the instant between
  removing the old directory and renaming the new one leaves only the
  complete ``best.partial``). Returns the best record.
  """
  if best is not None and record["accept_len"] <= best["accept_len"]:
    return best
  final_dir = os.path.join(workdir, "best")
  partial = final_dir + ".partial"
  shutil.rmtree(partial, ignore_errors=True)
  objective.export(head, partial)
  shutil.rmtree(final_dir, ignore_errors=True)
  os.replace(partial, final_dir)
  best = {"step": record["step"], "accept_len": record["accept_len"], "dir": final_dir}
  with open(os.path.join(workdir, BEST_JSON + ".tmp"), "w") as f:
    json.dump(best, f)
  os.replace(os.path.join(workdir, BEST_JSON + ".tmp"), os.path.join(workdir, BEST_JSON))
  return best


def _load_target(config: TrainConfig):
  path = config.target.path
  if path == REQUIRED:
    raise ConfigError("this preset needs the target model: set target.path=/path/to/hf_dir")
  return dj.load_target(path, dtype=None if config.target.dtype == "auto"
                        else config.target.dtype)


def _drafter_target(target):
  """``target`` as the trainable drafter is built against.

  A drafter takes its layout from its target's mode: in the CPU fast mode its
  dense layers store ``weight [out, in]``. The objectives' ``merge`` rebuilds the
  drafter inside the step in the uniform mode of the compute dtype, ``kernel
  [in, out]``. So the drafter to train is made (fresh or loaded) against the
  uniform mode of the target's dtype; the target itself keeps its mode for the
  features.
  """
  return dataclasses.replace(target, precision=precision_lib.of_dtype(target.dtype))


def _target_features(config: TrainConfig, target, rows: data_lib.Rows, head,
                     settings: StepSettings, workdir: str) -> features_lib.FeatureStore:
  """The cached frozen-target features of the training rows (built on first use)."""
  if jax.process_count() > 1:
    raise ConfigError("data.target_features=cached runs on a single host; use "
                      "data.target_features=online on a multi-host run")
  spec = settings.objective.feature_spec(head)
  return features_lib.load_or_build(
      target, rows, spec.tap_layers, spec.d2t,
      config.data.features_dir or os.path.join(workdir, "features"),
      dtype=config.data.features_dtype, batch_size=config.batch_size,
      attn_impl=settings.attn_impl, progress=config.progress,
      teacher_topk=config.data.teacher_topk)


def _checkpoint_manager(workdir: str, keep: int) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
  return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")),
                               options=options)


def _step_settings(config: TrainConfig, head, objective) -> StepSettings:
  return StepSettings(
      head_config=head.config, num_anchors=config.loss.num_anchors,
      level_decay=config.loss.level_decay, param_dtype=config.param_dtype
      if config.param_dtype != "auto" else "float32", compute_dtype=config.compute_dtype,
      attn_impl=config.attn_impl, optim=config.optim, steps=config.steps,
      **objective.step_options(config, head))


def _local_eval_batches(config: TrainConfig, rows: data_lib.Rows | None) -> list[dict]:
  """This process's rows of the fixed held-out batches (none without eval data)."""
  if rows is None:
    return []
  local_rows = config.batch_size // jax.process_count()
  lo = jax.process_index() * local_rows
  return [{k: v[lo:lo + local_rows] for k, v in b.items()}
          for b in data_lib.eval_batches(rows, config.batch_size, config.eval_batches)]


def _restore(manager: ocp.CheckpointManager, state: dict, iterator, workdir: str,
             is_main: bool) -> tuple[dict, int]:
  """The latest checkpoint's state and data position, else ``state`` at step 0."""
  start = manager.latest_step()
  if start is None:
    return state, 0
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  try:
    restored = manager.restore(start, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
  except Exception as e:  # Orbax raises several types for a mismatched tree.
    raise CheckpointError(
        f"cannot restore the checkpoint of step {start} in "
        f"{os.path.join(workdir, 'checkpoints')}: {e}; was it written with another "
        "config (head.kind, draft_length, draft_vocab_size, dflash.*, optimizer)? "
        "Use a new --workdir") from e
  iterator.set_state(restored["data"])
  if is_main:
    log.info("resumed from step %d", start)
  return restored["state"], int(start)


def _train_record(settings: StepSettings, done: int, host: dict, steps: int,
                  seconds: float) -> dict:
  """The logged record of the last ``steps`` steps (host copies of the sums)."""
  record = {"split": "train", "step": done, **summarize(settings, host["running"]),
            "loss": float(host["loss"]) / steps,
            "grad_norm": float(host["m"]["grad_norm"]), "lr": float(host["m"]["lr"]),
            "tokens_per_s": float(host["tokens"]) / max(seconds, 1e-9), "time": time.time()}
  if "domino_lambda" in host["m"]:
    record["domino_lambda"] = float(host["m"]["domino_lambda"])
  return record


def train(config: TrainConfig, workdir: str, *,
          step_callback: Callable[[int, dict], None] | None = None) -> TrainResult:
  """Trains (or resumes training) a DART head or a DFlash / Domino drafter
  (``config.head.kind``); see the module docstring.

  step_callback(step, metrics) runs after every step (tests use it to stop a
  run mid-way as a crash would).
  """
  os.makedirs(workdir, exist_ok=True)
  is_main = jax.process_index() == 0
  mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
  if config.batch_size % batch_shards:
    raise ConfigError(f"batch_size={config.batch_size} must be a multiple of the "
                      f"data x fsdp mesh size {batch_shards}")
  target = _load_target(config)
  prepared = data_lib.prepare_data(
      config.data, target.tokenizer,
      os.path.join(workdir, "data_cache") if config.data.cache else None,
      write_cache=is_main)
  objective = objectives.for_kind(config.head.kind)
  head = objective.make(config, _drafter_target(target), prepared.train)
  head.check_target(target)
  if is_main:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(to_dict(config), f, indent=2)
    s = prepared.stats
    log.info("data: %d records (%d malformed, %d truncated), %d train rows, %d eval rows, "
             "%d target tokens", s.records, s.malformed, s.truncated, len(prepared.train),
             0 if prepared.eval is None else len(prepared.eval), s.target_tokens)

  settings = _step_settings(config, head, objective)
  iterator = data_lib.BatchIterator(
      prepared.train, config.batch_size, config.data.shuffle_seed,
      process_index=jax.process_index(), process_count=jax.process_count())
  features = None
  if config.data.target_features == "cached":
    features = _target_features(config, target, prepared.train, head, settings, workdir)
  evals = _local_eval_batches(config, prepared.eval)

  history: list = []
  manager = _checkpoint_manager(workdir, config.keep_checkpoints)
  with jax.set_mesh(mesh):
    target_params = place_target(target, mesh)
    state = place_state(init_state(head, settings, config.seed), settings, mesh)
    state, start = _restore(manager, state, iterator, workdir, is_main)

    bar = tqdm(total=config.steps, initial=start, unit="step", dynamic_ncols=True,
               disable=not (config.progress and is_main))
    logger = MetricsLog(workdir, is_main, bar if config.progress else None,
                        resume_step=start)
    eval_key = jax.random.PRNGKey(config.seed + 1)
    best = read_best(workdir)

    def run_eval(step: int) -> None:
      nonlocal best
      if not evals:
        return
      total = None
      for b in evals:
        stats = eval_step(state["params"], state["buffers"], target_params,
                          sharding.global_batch(b, mesh), eval_key, settings=settings,
                          target_graphdef=target.graphdef)
        total = stats if total is None else jax.tree.map(jnp.add, total, stats)
      record = {"split": "eval", "step": step, **summarize(settings, jax.device_get(total))}
      history.append(record)
      logger.write(record)
      evaluated = head_from_state(head.config, state)  # Every process: it gathers.
      if is_main:
        before = best
        best = export_if_best(objective, evaluated, record, workdir, best)
        if best is not before:
          log.info("step %d: best held-out accept_len %.3f, exported to %s", step,
                   best["accept_len"], best["dir"])

    running = None
    running_loss = 0.0
    n_running = 0
    t_last = time.perf_counter()
    tokens = 0
    try:
      for step in range(start, config.steps):
        index = iterator.indices(iterator.batches)
        local = next(iterator)
        if features is not None:
          local = {**local, **features.take(index)}
        batch = sharding.global_batch(local, mesh)
        state, metrics = train_step(state, target_params, batch, settings=settings,
                                    target_graphdef=target.graphdef)
        running = (metrics["stats"] if running is None
                   else jax.tree.map(jnp.add, running, metrics["stats"]))
        running_loss = running_loss + metrics["loss"]
        tokens = tokens + metrics["tokens"]
        n_running += 1
        done = step + 1
        if done % config.log_every == 0 or done == config.steps:
          host = jax.device_get({"m": metrics, "running": running, "loss": running_loss,
                                 "tokens": tokens})
          now = time.perf_counter()
          record = _train_record(settings, done, host, n_running, now - t_last)
          history.append(record)
          logger.write(record)
          bar.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record['acc'][0]:.3f}")
          running, running_loss, n_running, tokens, t_last = None, 0.0, 0, 0, now
        if done % config.checkpoint_every == 0 or done == config.steps:
          manager.save(done, args=ocp.args.Composite(
              state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(iterator.get_state())))
        if done % config.eval_every == 0 or done == config.steps:
          run_eval(done)
        bar.update(1)
        if step_callback is not None:
          step_callback(done, metrics)
    finally:
      manager.wait_until_finished()
      manager.close()
      bar.close()

  final = head_from_state(head.config, state)
  export_dir = None
  if is_main:
    export_dir = config.export_dir or os.path.join(workdir, "export")
    objective.export(final, export_dir)
    log.info("exported the %s to %s", "head" if config.head.kind == "dart" else "drafter",
             export_dir)
  return TrainResult(final, state, history, export_dir, start, read_best(workdir))
