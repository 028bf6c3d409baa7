"""Benchmark harness: speculative decoding vs plain decoding on real prompts.

  python -m infer.bench --method ar,dart --dataset mt_bench,humaneval --limit 10 \\
      --max-new-tokens 128 --temperature 0,1 --draft /path/to/dart --json out.json \\
      [--plot out.png] [--model PATH] [--ngram small.trie] [--tree-budget N|auto] \\
      [--profile]
  python -m infer.bench --method ar,dart,dflash-chain,domino-chain,ddtree,dartree-fixed,dartree \\
      --draft /path/to/dart --domino /path/to/domino [--dflash /path/to/dflash] \\
      [--dartree-budget 64|auto --dartree-width 12 --dartree-topk 64 --dartree-depth-bonus -0.2]
  python -m infer.bench --method ar,dart,dart-gru,dart-gru-fixed --dart-gru /path/to/dart_gru \
      [--dartree-budget 16 --dartree-width 4 --dartree-topk 8]

Methods:
  ar    plain autoregressive decoding with ``dart_jax.generate`` (the reference).
  dart  DART speculative decoding (``--draft`` head directory, or ``random`` for a
        randomly initialised head of ``--draft-length`` D: timing only).
  dflash-chain, ddtree
        DFlash drafting from the backbone's UNcorrected marginals: the argmax
        chain, and the best-first tree of ``--dartree-budget`` nodes. Drafter:
        ``--dflash`` (a DFlash directory); without it the ``--domino`` drafter's
        DFlash backbone serves (its correction head is not used by these two).
  domino-chain, dartree-fixed, dartree
        The Domino correction head on the same backbone: Domino's sequential
        chain, and DARTree's batched trees (fixed quota per depth / pruned
        supertree, ``--dartree-*`` options). Drafter: ``--domino``.
        ``--drafter random`` instead makes one randomly initialised Domino
        drafter (``--drafter-*`` size options) that serves all five methods
        (timing and smoke runs only: random drafts are almost never accepted).
        The method names are ``dart_jax.generate``'s ``tree=`` names.
  dart-gru, dart-gru-fixed, dart-gru-chain
        DART-GRU (``dart_jax.draft.dart_gru``): a DART head's levels corrected by a
        GRU head, trees built the DARTree way (pruned / fixed quota / the
        corrected greedy chain; the same ``--dartree-*`` options), verified as in
        DART. Drafter: ``--dart-gru DIR`` (``load_dart_gru``), or ``random``: a
        random DART head of ``--draft-length`` D (``--draft-vocab-size``) with a
        random correction (``--drafter-emb-dim``, ``--drafter-gru-dim``; timing only).
  hf    transformers (torch, CPU) ``generate`` of the same model, when torch and
        transformers are importable (skipped with a message otherwise; the
        project itself never needs torch). torch runs ``--hf-threads`` threads
        (default: the CPU count). On a machine shared with other processes torch's
        OpenMP threads contend badly: on the 2-core development machine 2 threads
        were 3-5x slower than 1, so compare both settings there.

Tree budgets: ``--tree-budget auto`` (dart) and ``--dartree-budget auto`` (ddtree,
dartree-fixed, dartree, dart-gru, dart-gru-fixed; the chains take no budget)
choose the budget before the bench from measurements (``infer.tree_budget``):
the target's verify seconds per tree size, one calibration run of the method
(greedy, a fixed non-benchmark prompt, the largest candidate tree) for its
acceptance length and round overhead, and the budget with the best expected
tokens/s. Every budget method gets its own calibration and budget (at one
budget dartree-fixed's trees differ from the pruned ones, and the drafters
may differ); the DARTree and DART-GRU methods share one verify-cost curve,
timed once with the first method's taps (taps only choose which layer
outputs a pass returns). The choices are logged (``[tree-budget] ...``,
``[dartree-budget] METHOD: ...``) and recorded in the JSON: ``tree`` (dart),
``dartree.methods.METHOD.budget_choice`` and ``dart_gru.methods.METHOD.budget_choice``
(``dartree.config.budget`` / ``dart_gru.config.budget`` read "auto").

Datasets (``infer.datasets``): MT-Bench (``--limit`` questions, both turns; turn 2
continues from the AR greedy turn-1 answer for every method) and HumanEval
(``--limit`` problems). The target's chat template is applied.

Protocol, per dataset and temperature: every prompt runs every method in one
process, in alternating order (as given, e.g. ``ar, dart, dartree``, for even
prompts, reversed for odd ones) with the same seed, so slow drift of a shared
machine cancels. JAX compiles per shape; a run during which JAX compiled a
decoding function (anything but the prefill) is discarded and repeated, so
compile time never counts. HF gets one untimed warm-up call.

Timing: decode time = a call's wall time after its first token (prefill excluded),
decode tokens = new tokens - 1; tokens/s is reported both as total decode tokens /
total decode time and as the median of per-prompt rates. Speedup of a method =
AR seconds per decode token / the method's, per prompt (median) and over all
prompts (aggregate). Acceptance length = tokens emitted per round (bonus token
included), aggregated over rounds.

Greedy check: at temperature 0 every speculative method's output (``dart`` and
the five DARTree methods, all lossless) must equal AR's token for token;
mismatches are printed loudly and the exit status is 3. (HF's matches are
reported for information: torch sums floats in another order, so near-ties can
flip a token.)

``--profile`` adds, for every speculative method, one more run per prompt with
the round split into separately compiled phases and reports mean ms per round of
each, next to AR's ms per step. The phases mean the same for every method:
search (tree build: DART's beam search, DARTree's / DART-GRU's tree builder),
verify (the target pass over root + tree), accept (sample-and-match and KV
compaction) and draft (the drafter's pass for the next round: the DART head's
levels, or DFlash's context write and backbone block). The phased runs are not
used for the speedup (the fused round is slightly faster than the sum of its
phases), but their greedy outputs are checked against AR's like the others.

Output: a progress bar on stderr, a table on stdout, everything (per-prompt
records, tokens and text included) in ``--json``, and a bar chart of speedup and
acceptance length in ``--plot`` (needs matplotlib).
"""

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax

import dart_jax as dj
from dart_jax.errors import InputError
from dart_jax.generate import encode_prompts, stop_token_ids
from dart_jax.tree.dartree import DARTreeConfig, num_tree_nodes, resolve_method
from infer import datasets
from infer import tree_budget as tb

# DARTree methods (``dart_jax.generate``'s ``tree=`` names), baselines first; the
# DFlash ones read only the backbone's uncorrected marginals, the Domino ones need
# the correction head.
DARTREE_METHODS = ("dflash-chain", "domino-chain", "ddtree", "dartree-fixed", "dartree")
DFLASH_METHODS = ("dflash-chain", "ddtree")
DOMINO_METHODS = ("domino-chain", "dartree-fixed", "dartree")
# DART-GRU methods -> ``generate``'s ``tree=`` name for a DART-GRU drafter.
DART_GRU_TREES = {"dart-gru": "dartree", "dart-gru-fixed": "dartree-fixed",
                  "dart-gru-chain": "chain"}
DART_GRU_METHODS = tuple(DART_GRU_TREES)
# ``generate`` tree names whose size is ``--dartree-budget`` (chains ignore it).
BUDGET_TREES = ("ddtree", "dartree-fixed", "dartree")
METHODS = ("ar", "dart") + DARTREE_METHODS + DART_GRU_METHODS + ("hf",)
# Speculative methods whose greedy output must equal AR's token for token.
LOSSLESS_METHODS = ("dart",) + DARTREE_METHODS + DART_GRU_METHODS
PHASES = ("search", "verify", "accept", "draft")
GREEDY_MISMATCH_EXIT = 3
MAX_COLD_RETRIES = 2
_PREFILL_FUNCTIONS = ("prefill", "dart_prefill", "dartree_prefill")


# ----------------------------------------------------------------------------
# Compile detection.
# ----------------------------------------------------------------------------

_compile_log: list[tuple[str, float]] | None = None
_listening = False


def _on_event(event: str, duration: float, **kwargs) -> None:
  if _compile_log is not None and event == "/jax/core/compile/backend_compile_duration":
    _compile_log.append((str(kwargs.get("fun_name", "")), duration))


class CompileWatch:
  """Collects JAX backend compilations inside a ``with`` block.

  ``decode_compiles`` lists those of anything but the prefill functions: the
  prefill is outside decode time, the rest is not.
  """

  def __enter__(self) -> "CompileWatch":
    global _compile_log, _listening
    if not _listening:
      jax.monitoring.register_event_duration_secs_listener(_on_event)
      _listening = True
    self.events = _compile_log = []
    return self

  def __exit__(self, *exc) -> None:
    global _compile_log
    _compile_log = None

  @property
  def decode_compiles(self) -> list[tuple[str, float]]:
    return [(name, d) for name, d in self.events
            if not any(name == f"jit({p})" for p in _PREFILL_FUNCTIONS)]


# ----------------------------------------------------------------------------
# Methods.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class RunRecord:
  """One method on one prompt. Times in seconds; tokens include a final EOS."""

  tokens: list[int]
  decode_s: float
  ttft_s: float
  wall_s: float
  rounds: int
  accept_len: float
  phase_s: dict = dataclasses.field(default_factory=dict)
  reruns: int = 0

  @property
  def new_tokens(self) -> int:
    return len(self.tokens)

  @property
  def decode_tokens(self) -> int:
    return max(len(self.tokens) - 1, 0)


@dataclasses.dataclass
class Sampling:
  temperature: float
  top_p: float = 1.0
  top_k: int = 0


class JaxMethod:
  """``dart_jax.generate`` with fixed method options (AR when ``draft`` is None).

  draft: a DART head (``tree`` a ``TreeConfig``) or a DFlash/Domino drafter
  (``tree`` a DARTree method name, ``tree_config`` a ``DARTreeConfig``).
  """

  def __init__(self, target, *, draft=None, ngram=None, tree=None, tree_config=None,
               profile: bool = False):
    self.target = target
    self.kwargs: dict[str, Any] = {}
    if draft is not None:
      self.kwargs.update(draft=draft, ngram=ngram, tree=tree)
      if tree_config is not None:
        self.kwargs["tree_config"] = tree_config
      if profile:
        self.kwargs["profile"] = True

  def run(self, prompt_ids: list[int], sampling: Sampling, max_new_tokens: int,
          seed: int) -> RunRecord:
    for attempt in range(MAX_COLD_RETRIES + 1):
      start = time.perf_counter()
      with CompileWatch() as watch:
        out = dj.generate(self.target, prompt_ids, max_new_tokens=max_new_tokens,
                          temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k, seed=seed, **self.kwargs)
      wall = time.perf_counter() - start
      if not watch.decode_compiles:
        break
    s = out.stats
    return RunRecord(tokens=list(out.tokens), decode_s=s.total_s - s.time_to_first_token_s,
                     ttft_s=s.time_to_first_token_s, wall_s=wall, rounds=s.rounds,
                     accept_len=s.mean_accept_len, phase_s=dict(s.phase_s), reruns=attempt)


class _TokenClock:
  """A transformers streamer that only notes when each ``put`` happens (the
  first put is the prompt, the second the first new token)."""

  def __init__(self):
    self.times: list[float] = []

  def put(self, value) -> None:
    del value
    self.times.append(time.perf_counter())

  def end(self) -> None:
    pass


class HFMethod:
  """transformers ``generate`` on CPU (torch imported lazily by ``load_hf_model``)."""

  def __init__(self, model, torch_module, stop_ids: Iterable[int]):
    self.model, self.torch = model, torch_module
    self.stop_ids = sorted(stop_ids)
    self.warm = False

  def _generate(self, prompt_ids, sampling: Sampling, max_new_tokens: int, seed: int):
    torch = self.torch
    torch.manual_seed(seed)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    clock = _TokenClock()
    greedy = sampling.temperature <= 0
    start = time.perf_counter()
    with torch.inference_mode():
      out = self.model.generate(
          input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
          do_sample=not greedy, max_new_tokens=max_new_tokens,
          temperature=None if greedy else sampling.temperature,
          top_p=None if greedy else sampling.top_p,
          top_k=None if greedy else sampling.top_k,
          eos_token_id=self.stop_ids or None,
          pad_token_id=self.stop_ids[0] if self.stop_ids else 0, streamer=clock)
    end = time.perf_counter()
    tokens = [int(t) for t in out[0, len(prompt_ids):].tolist()]
    first = clock.times[1] if len(clock.times) > 1 else end
    return tokens, start, first, end

  def run(self, prompt_ids: list[int], sampling: Sampling, max_new_tokens: int,
          seed: int) -> RunRecord:
    if not self.warm:  # torch has nothing to compile, but first calls are slow.
      self._generate(prompt_ids, sampling, min(max_new_tokens, 8), seed)
      self.warm = True
    tokens, start, first, end = self._generate(prompt_ids, sampling, max_new_tokens, seed)
    return RunRecord(tokens=tokens, decode_s=end - first, ttft_s=first - start,
                     wall_s=end - start, rounds=max(len(tokens) - 1, 0), accept_len=1.0)


def load_hf_model(model_path: str | None, num_threads: int | None = None):
  """(torch module, transformers model in float32 eval mode) or raises ImportError.

  The embedded SmolLM2 and ``.gguf`` files go through transformers' GGUF reader
  (``load_gguf_checkpoint``: config, dequantised tensors) into ``LlamaForCausalLM``;
  ``from_pretrained(gguf_file=...)`` would need ``accelerate``. HF directories use
  ``AutoModelForCausalLM.from_pretrained``.
  """
  import torch  # Only here: the project does not depend on torch.
  import transformers
  from transformers import modeling_gguf_pytorch_utils as gguf_utils

  torch.set_num_threads(num_threads or os.cpu_count() or 1)
  if model_path is None:
    from dart_jax.io import default_model
    model_path = str(default_model.embedded_gguf_path())
  if os.path.isdir(model_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path,
                                                              dtype=torch.float32)
    return torch, model.float().eval()
  meta = gguf_utils.load_gguf_checkpoint(model_path)
  config_dict = dict(meta["config"])
  if config_dict.get("model_type") != "llama":
    raise InputError(f"hf method: only Llama-architecture GGUF files are supported, "
                     f"{model_path} is {config_dict.get('model_type')!r}")
  config = transformers.LlamaConfig(**config_dict)
  model = transformers.LlamaForCausalLM(config).float()
  loaded = gguf_utils.load_gguf_checkpoint(model_path, return_tensors=True,
                                           model_to_load=model, torch_dtype=torch.float32)
  missing, unexpected = model.load_state_dict(loaded["tensors"], strict=False)
  if config.tie_word_embeddings:
    model.tie_weights()
    missing = [m for m in missing if m != "lm_head.weight"]
  if missing or unexpected:
    raise InputError(f"hf method: GGUF tensors of {model_path} do not fit "
                     f"LlamaForCausalLM (missing {missing[:3]}, unexpected {unexpected[:3]})")
  return torch, model.eval()


# ----------------------------------------------------------------------------
# Prompts.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class BenchItem:
  """One benchmark prompt: chat messages (or token ids) and where it came from."""

  dataset: str
  item_id: str
  prompt: Any
  turn: int = 1


def dataset_items(name: str, limit: int | None,
                  turn1_answer: Callable[[Any], str]) -> Iterator[BenchItem]:
  """Benchmark items of ``name`` in order. MT-Bench yields turn 1, then (after the
  caller ran it) turn 2 built with ``turn1_answer(turn-1 messages)``."""
  if name == "mt_bench":
    for q in datasets.load_mt_bench(limit):
      first = datasets.mt_bench_messages(q, 1)
      yield BenchItem(name, f"{q.question_id}", first, 1)
      yield BenchItem(name, f"{q.question_id}", datasets.mt_bench_messages(
          q, 2, turn1_answer(first)), 2)
  elif name == "humaneval":
    for p in datasets.load_humaneval(limit):
      yield BenchItem(name, p.task_id, datasets.humaneval_messages(p), 1)
  else:
    raise InputError(f"unknown dataset {name!r}; choose from {datasets.DATASETS}")


def num_items(name: str, limit: int | None) -> int:
  size = {"mt_bench": datasets.MT_BENCH_SIZE, "humaneval": datasets.HUMANEVAL_SIZE}[name]
  size = min(size, limit) if limit is not None else size
  return 2 * size if name == "mt_bench" else size


# ----------------------------------------------------------------------------
# The harness.
# ----------------------------------------------------------------------------


def method_order(methods: Sequence[str], index: int) -> list[str]:
  """Methods in the order prompt ``index`` runs them: as given for even indices,
  reversed for odd ones."""
  return list(methods) if index % 2 == 0 else list(reversed(methods))


def _rate(tokens: int, seconds: float) -> float | None:
  return tokens / seconds if tokens > 0 and seconds > 0 else None


def record_json(rec: RunRecord, target, ar: RunRecord | None) -> dict:
  """Per-prompt JSON of one method's run (compared with AR's run when given)."""
  out = {
      "new_tokens": rec.new_tokens, "decode_tokens": rec.decode_tokens,
      "decode_s": rec.decode_s, "ttft_s": rec.ttft_s, "wall_s": rec.wall_s,
      "tokens_per_s": _rate(rec.decode_tokens, rec.decode_s),
      "rounds": rec.rounds, "accept_len": rec.accept_len, "reruns": rec.reruns,
      "tokens": rec.tokens,
      "text": target.tokenizer.decode(rec.tokens) if target.tokenizer is not None else None,
  }
  if ar is not None:
    out["matches_ar"] = rec.tokens == ar.tokens
    ar_tpt = ar.decode_s / ar.decode_tokens if ar.decode_tokens else None
    tpt = rec.decode_s / rec.decode_tokens if rec.decode_tokens else None
    out["speedup_vs_ar"] = ar_tpt / tpt if ar_tpt and tpt else None
  return out


def phase_json(rec: RunRecord) -> dict:
  """A profiled run: seconds per phase and mean ms per round."""
  rounds = max(rec.rounds, 1)
  return {"rounds": rec.rounds, "phase_s": rec.phase_s,
          "phase_ms_per_round": {k: v * 1e3 / rounds for k, v in rec.phase_s.items()},
          "decode_s": rec.decode_s, "accept_len": rec.accept_len,
          "tokens": rec.tokens}


class Bench:
  """Runs methods on prompts and keeps the AR greedy answers (MT-Bench turn 2).

  methods: name -> a ``JaxMethod``/``HFMethod`` (``ar`` must be among them for
  speedups and greedy checks); profilers: method name -> the same method as a
  ``JaxMethod`` with ``profile=True`` (one extra phased run per prompt each).
  """

  def __init__(self, target, methods: dict[str, Any], *, max_new_tokens: int,
               seed: int = 0, top_p: float = 1.0, top_k: int = 0,
               profilers: dict[str, Any] | None = None,
               progress: Callable[[int], None] | None = None):
    self.target = target
    self.methods = methods
    self.max_new_tokens = max_new_tokens
    self.seed, self.top_p, self.top_k = seed, top_p, top_k
    self.profilers = dict(profilers or {})
    self.progress = progress or (lambda n: None)
    self.greedy_answers: dict[tuple[int, ...], list[int]] = {}
    self._greedy_ar = JaxMethod(target)

  def prompt_ids(self, prompt) -> list[int]:
    ids, is_batch = encode_prompts(self.target, prompt)
    if is_batch:
      raise InputError("a benchmark item must be one prompt, not a batch")
    return ids[0]

  def turn1_answer(self, prompt) -> str:
    """The AR greedy answer to ``prompt`` (reused from a T=0 AR run if any)."""
    ids = tuple(self.prompt_ids(prompt))
    if ids not in self.greedy_answers:
      rec = self._greedy_ar.run(list(ids), Sampling(0.0), self.max_new_tokens, self.seed)
      self.greedy_answers[ids] = rec.tokens
    return self.target.tokenizer.decode(self.greedy_answers[ids])

  def run_item(self, item: BenchItem, index: int, sampling: Sampling) -> dict:
    """All methods on one item, in alternating order -> per-prompt JSON."""
    ids = self.prompt_ids(item.prompt)
    order = method_order(list(self.methods), index)
    records = {}
    for name in order:
      records[name] = self.methods[name].run(ids, sampling, self.max_new_tokens, self.seed)
      self.progress(1)
    ar = records.get("ar")
    if ar is not None and sampling.temperature <= 0:
      self.greedy_answers[tuple(ids)] = ar.tokens
    row = {"dataset": item.dataset, "id": item.item_id, "turn": item.turn,
           "prompt_tokens": len(ids), "order": order,
           "methods": {name: record_json(rec, self.target, ar if name != "ar" else None)
                       for name, rec in records.items()}}
    profiled = [name for name in order if name in self.profilers]
    if profiled:
      row["profile"] = {}
    for name in profiled:
      prof = self.profilers[name].run(ids, sampling, self.max_new_tokens, self.seed)
      row["profile"][name] = phase_json(prof)
      if ar is not None:
        row["profile"][name]["matches_ar"] = prof.tokens == ar.tokens
      self.progress(1)
    return row

  def run_dataset(self, name: str, items: Iterable[BenchItem], sampling: Sampling) -> dict:
    rows = [self.run_item(item, i, sampling) for i, item in enumerate(items)]
    return {"dataset": name, "temperature": sampling.temperature,
            "summary": summarize(rows, list(self.methods), sampling.temperature),
            "prompts": rows}


def _median(values: list[float | None]) -> float | None:
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def summarize(rows: list[dict], methods: Sequence[str], temperature: float) -> dict:
  """Per-method aggregates of per-prompt rows (see the module docstring)."""
  summary = {}
  ar_rows = [r["methods"]["ar"] for r in rows] if "ar" in methods else None
  for name in methods:
    recs = [r["methods"][name] for r in rows]
    decode_tokens = sum(r["decode_tokens"] for r in recs)
    decode_s = sum(r["decode_s"] for r in recs)
    rounds = sum(r["rounds"] for r in recs)
    s = {
        "prompts": len(recs),
        "new_tokens": sum(r["new_tokens"] for r in recs),
        "decode_tokens": decode_tokens, "decode_s": decode_s,
        "tokens_per_s": _rate(decode_tokens, decode_s),
        "tokens_per_s_median": _median([r["tokens_per_s"] for r in recs]),
        "mean_accept_len": (sum(r["accept_len"] * r["rounds"] for r in recs) / rounds
                            if rounds else None),
        "ms_per_round": decode_s * 1e3 / rounds if rounds else None,
    }
    if ar_rows is not None and name != "ar":
      ar_tokens = sum(r["decode_tokens"] for r in ar_rows)
      ar_s = sum(r["decode_s"] for r in ar_rows)
      s["speedup_vs_ar"] = ((ar_s / ar_tokens) / (decode_s / decode_tokens)
                            if ar_tokens and decode_tokens and decode_s > 0 else None)
      s["speedup_vs_ar_median"] = _median([r["speedup_vs_ar"] for r in recs])
      s["matches_ar"] = sum(bool(r["matches_ar"]) for r in recs)
      s["compared"] = len(recs)
    summary[name] = s
  if "hf" in summary and "ar" in summary:
    hf, ar = summary["hf"], summary["ar"]
    summary["hf"]["ar_over_hf"] = (ar["tokens_per_s"] / hf["tokens_per_s"]
                                   if ar["tokens_per_s"] and hf["tokens_per_s"] else None)
    summary["hf"]["ar_over_hf_median"] = _median([
        a["tokens_per_s"] / h["tokens_per_s"]
        if a["tokens_per_s"] and h["tokens_per_s"] else None
        for a, h in zip(ar_rows, [r["methods"]["hf"] for r in rows])])
  profiled = [m for m in methods if any(m in r.get("profile", {}) for r in rows)]
  if profiled:
    summary["profile"] = {}
  for name in profiled:
    profiles = [r["profile"][name] for r in rows if name in r.get("profile", {})]
    rounds = sum(p["rounds"] for p in profiles)
    phases = {k: sum(p["phase_s"].get(k, 0.0) for p in profiles) * 1e3 / max(rounds, 1)
              for k in PHASES}
    summary["profile"][name] = {
        "prompts": len(profiles), "rounds": rounds, "phase_ms_per_round": phases,
        "phased_round_ms": sum(phases.values()),
        "ar_ms_per_step": summary.get("ar", {}).get("ms_per_round"),
        "matches_ar": sum(bool(p.get("matches_ar")) for p in profiles),
    }
  summary["greedy"] = temperature <= 0
  return summary


def greedy_mismatches(runs: list[dict], strict_methods: Sequence[str] = LOSSLESS_METHODS
                      ) -> list[dict]:
  """Prompts where a strict (lossless speculative) method's T=0 output differs
  from AR's. ``hf`` is not strict (torch sums floats in another order)."""
  bad = []
  for run in runs:
    if run["temperature"] > 0:
      continue
    for row in run["prompts"]:
      checks = {m: rec.get("matches_ar") for m, rec in row["methods"].items()
                if m in strict_methods}
      for m, prof in row.get("profile", {}).items():
        checks[f"{m}(profile)"] = prof.get("matches_ar")
      for m, ok in checks.items():
        if ok is False:
          bad.append({"dataset": run["dataset"], "id": row["id"], "turn": row["turn"],
                      "method": m})
  return bad


# ----------------------------------------------------------------------------
# Reporting.
# ----------------------------------------------------------------------------


def _fmt(value, spec: str = ".2f", none: str = "-") -> str:
  return none if value is None else format(value, spec)


def format_table(runs: list[dict]) -> str:
  """A readable summary table of every (dataset, temperature) run."""
  lines = []
  head = (f"{'dataset':<10} {'T':>4} {'method':<14} {'prompts':>7} {'tok/s':>8} "
          f"{'tok/s med':>9} {'speedup':>8} {'spd med':>8} {'acc len':>8} {'greedy=AR':>10}")
  lines += [head, "-" * len(head)]
  for run in runs:
    s = run["summary"]
    for name, m in s.items():
      if name in ("greedy", "profile"):
        continue
      match = (f"{m['matches_ar']}/{m['compared']}" if "matches_ar" in m and s["greedy"]
               else "")
      lines.append(
          f"{run['dataset']:<10} {run['temperature']:>4g} {name:<14} {m['prompts']:>7} "
          f"{_fmt(m['tokens_per_s'], '.1f'):>8} {_fmt(m['tokens_per_s_median'], '.1f'):>9} "
          f"{_fmt(m.get('speedup_vs_ar'), '.2f') + ('x' if m.get('speedup_vs_ar') else ''):>8} "
          f"{_fmt(m.get('speedup_vs_ar_median'), '.2f'):>8} "
          f"{_fmt(m['mean_accept_len'], '.2f'):>8} {match:>10}")
    if "hf" in s and s["hf"].get("ar_over_hf") is not None:
      lines.append(f"{'':<24} ours (ar) / hf tokens/s: {s['hf']['ar_over_hf']:.2f}x "
                   f"(median per prompt {_fmt(s['hf']['ar_over_hf_median'])}x)")
    for name, prof in s.get("profile", {}).items():
      ph = prof["phase_ms_per_round"]
      lines.append(
          f"{'':<24} {name} ms/round: search {ph['search']:.1f}, verify {ph['verify']:.1f}, "
          f"accept {ph['accept']:.1f}, draft {ph['draft']:.1f} "
          f"(sum {prof['phased_round_ms']:.1f}); "
          f"ar ms/step {_fmt(prof['ar_ms_per_step'], '.1f')}")
  return "\n".join(lines)


def write_plot(runs: list[dict], path: str) -> None:
  """Bar chart: speedup vs AR and acceptance length per dataset/temperature/method."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise InputError("--plot needs matplotlib: pip install matplotlib "
                     "(or pip install -e '.[bench]')") from e
  groups = [f"{r['dataset']}\nT={r['temperature']:g}" for r in runs]
  methods = [m for m in METHODS if any(m in r["summary"] for r in runs)]
  fig, axes = plt.subplots(
      1, 2, figsize=(max(7, len(groups) * (1 + 0.4 * len(methods)) + 3), 4.5))
  width = 0.8 / max(len(methods), 1)
  for ax, key, title in ((axes[0], "speedup_vs_ar", "speedup vs AR (aggregate)"),
                         (axes[1], "mean_accept_len", "mean acceptance length")):
    for j, m in enumerate(methods):
      values = []
      for r in runs:
        s = r["summary"].get(m, {})
        v = 1.0 if (m == "ar" and key == "speedup_vs_ar") else s.get(key)
        values.append(v or 0.0)
      xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(runs))]
      bars = ax.bar(xs, values, width, label=m)
      ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90 if len(methods) > 4 else 0)
    ax.set_xticks(range(len(runs)), groups)
    ax.set_title(title)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
  # Below the axes: with many methods a legend inside would cover bars.
  handles, labels = axes[0].get_legend_handles_labels()
  ncol = min(len(methods), 4)
  legend_rows = -(-len(methods) // ncol)
  fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
  fig.tight_layout(rect=(0, 0.07 * legend_rows, 1, 1))
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ----------------------------------------------------------------------------
# CLI.
# ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m infer.bench",
      description="Benchmark DART and DARTree speculative decoding against plain "
                  "decoding on MT-Bench and HumanEval (same process, alternating runs).",
      epilog=f"Exit status {GREEDY_MISMATCH_EXIT} if a greedy speculative output "
             "differs from AR's.", formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--method", default="ar,dart",
                 help=f"comma list of {', '.join(METHODS)} (default ar,dart); ar is "
                      "always run as the reference")
  p.add_argument("--dataset", default="mt_bench,humaneval",
                 help="comma list of mt_bench, humaneval (default both)")
  p.add_argument("--limit", type=int, default=10,
                 help="questions/problems per dataset (MT-Bench: each question gives "
                      "two prompts, its two turns; default 10)")
  p.add_argument("--max-new-tokens", type=int, default=128, help="per prompt (128)")
  p.add_argument("--temperature", default="0",
                 help="comma list of temperatures, e.g. 0,1 (default 0)")
  p.add_argument("--top-p", type=float, default=1.0, help="sampling top-p (1.0 = off)")
  p.add_argument("--top-k", type=int, default=0, help="sampling top-k (0 = off)")
  p.add_argument("--seed", type=int, default=0, help="seed, the same for every method")
  p.add_argument("--json", default=None, help="write all results to this JSON file")
  p.add_argument("--plot", default=None, help="write a PNG bar chart (needs matplotlib)")
  p.add_argument("--model", default=None,
                 help="target: HF directory or .gguf (default: embedded SmolLM2-135M-Instruct)")
  p.add_argument("--draft", default=None,
                 help="DART head directory, or 'random' for a random head (timing only); "
                      "default for the embedded target: the head shipped with dart-jax")
  p.add_argument("--draft-length", type=int, default=4,
                 help="D of a random head (default 4)")
  p.add_argument("--draft-vocab-size", type=int, default=None,
                 help="draft vocabulary of a random head (default: the target's)")
  p.add_argument("--ngram", default=None,
                 help="N-gram .trie for DART's tree search (default with the shipped "
                      "head: the N-gram shipped with it)")
  p.add_argument("--tree-budget", default=None,
                 help="DART draft nodes per round (remain_total) or 'auto' to choose "
                      "from measured verify costs (see infer/tree_budget.py); default: "
                      "TreeConfig's default, which is large for a CPU")
  p.add_argument("--topk", type=int, default=None,
                 help="tree search top-k per level (default min(25, budget))")
  p.add_argument("--beam-width", type=int, default=None,
                 help="tree search beam width (default min(20, budget))")
  add_dartree_args(p)
  p.add_argument("--hf-threads", type=int, default=None,
                 help="torch threads for the hf method (default: the CPU count; on a "
                      "busy machine 1 can be much faster, see the module docstring)")
  p.add_argument("--profile", action="store_true",
                 help="also run every speculative method once more per prompt with "
                      "per-phase timing (search/verify/accept/draft)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  return p


def _split(value: str, allowed: Sequence[str] | None, what: str) -> list[str]:
  items = [v.strip() for v in value.split(",") if v.strip()]
  if not items:
    raise InputError(f"--{what} is empty")
  if allowed is not None:
    bad = [v for v in items if v not in allowed]
    if bad:
      raise InputError(f"unknown --{what} {bad}; choose from {', '.join(allowed)}")
  return list(dict.fromkeys(items))


def add_dartree_args(p: argparse.ArgumentParser) -> None:
  """Drafter and tree options of the DARTree methods (shared with infer.main)."""
  g = p.add_argument_group(
      "DARTree methods", f"drafters and trees of {', '.join(DARTREE_METHODS)}")
  g.add_argument("--dflash", default=None, metavar="DIR",
                 help="DFlash drafter directory for dflash-chain and ddtree (default: "
                      "the --domino drafter's backbone)")
  g.add_argument("--domino", default=None, metavar="DIR",
                 help="Domino drafter directory (DFlash backbone + correction head) for "
                      "domino-chain, dartree-fixed and dartree")
  g.add_argument("--drafter", default=None, metavar="random",
                 help="'random': one randomly initialised Domino drafter for every "
                      "DARTree method, instead of --dflash/--domino (timing only)")
  g.add_argument("--drafter-block-size", type=int, default=16,
                 help="block size B of a random drafter (B-1 draft depths; default 16)")
  g.add_argument("--drafter-layers", type=int, default=1,
                 help="backbone layers of a random drafter (default 1)")
  g.add_argument("--drafter-emb-dim", type=int, default=32,
                 help="correction head width E of a random drafter (default 32)")
  g.add_argument("--drafter-gru-dim", type=int, default=32,
                 help="GRU state size G of a random drafter (default 32)")
  defaults = DARTreeConfig()
  g.add_argument("--dartree-budget", default=None, metavar="N|auto",
                 help=f"draft nodes per round: DARTree's B_tree (the fixed variant's "
                      f"total), DDTree's node budget (default {defaults.budget}); "
                      "infer.bench also takes 'auto': for each benched method that "
                      "uses a budget (ddtree, dartree-fixed, dartree, dart-gru, "
                      "dart-gru-fixed) it times the target's verify pass per tree size "
                      "(once, shared) and runs one calibration, then picks the budget "
                      "of the best expected tokens/s (see infer/tree_budget.py)")
  g.add_argument("--dartree-width", type=int, default=None,
                 help=f"dartree (pruned): supertree pairs kept per depth (default "
                      f"{defaults.supertree_width})")
  g.add_argument("--dartree-topk", type=int, default=None,
                 help=f"candidates per depth, top-K of the base logits (default "
                      f"{defaults.topk})")
  g.add_argument("--dartree-depth-bonus", type=float, default=None,
                 help=f"dartree (pruned): per-depth bonus of the final ranking, <= 0 "
                      f"(default {defaults.depth_bonus})")
  g.add_argument("--dart-gru", default=None, metavar="DIR",
                 help=f"DART-GRU drafter directory (load_dart_gru) for "
                      f"{', '.join(DART_GRU_METHODS)}, or 'random' (a random DART head of "
                      "--draft-length with a random correction; timing only); trees "
                      "take the --dartree-* options")


_DARTREE_OPTIONS = (("topk", "dartree_topk"), ("supertree_width", "dartree_width"),
                    ("budget", "dartree_budget"), ("depth_bonus", "dartree_depth_bonus"))


def dartree_options_given(args) -> list[str]:
  """The ``--dartree-*`` / drafter flags set on the command line."""
  given = [f"--{dest.replace('_', '-')}" for _, dest in _DARTREE_OPTIONS
           if getattr(args, dest) is not None]
  return given + [f"--{name.replace('_', '-')}"
                  for name in ("dflash", "domino", "drafter", "dart_gru")
                  if getattr(args, name) is not None]


def dartree_budget_arg(args) -> int | str | None:
  """``--dartree-budget``: an int >= 1, "auto" or None (not given); InputError
  for anything else."""
  value = args.dartree_budget
  if value is None or value == "auto":
    return value
  try:
    budget = int(value)
  except (TypeError, ValueError):
    budget = None
  if budget is None or budget < 1:
    raise InputError(f"--dartree-budget must be an integer >= 1 or 'auto', got {value!r}")
  return budget


def dartree_config(args, allow_auto: bool = False) -> DARTreeConfig:
  """``DARTreeConfig`` from the ``--dartree-*`` flags (ConfigError if invalid).

  With ``--dartree-budget auto`` (only if ``allow_auto``: infer.bench measures
  it per method) the budget is left at its default, to be replaced.
  """
  budget = dartree_budget_arg(args)
  if budget == "auto" and not allow_auto:
    raise InputError("--dartree-budget auto is measured by python -m infer.bench (it "
                     "logs the budget it picks); pass an integer number of draft nodes here")
  given = {field: getattr(args, dest) for field, dest in _DARTREE_OPTIONS
           if getattr(args, dest) is not None and field != "budget"}
  if budget is not None and budget != "auto":
    given["budget"] = budget
  return DARTreeConfig(**given)


def auto_dartree_budgets(target, tree_methods: dict[str, tuple[Any, str]],
                         base: DARTreeConfig, log) -> dict[str, tb.BudgetChoice]:
  """``--dartree-budget auto``: a measured budget per bench method whose tree takes one.

  tree_methods: bench method -> (its drafter, ``generate``'s tree name); chains
  are skipped. One verify-cost curve of the target, over the sizes every method
  needs, is timed in one pass (with the first method's taps: taps only choose
  which layer outputs a pass returns) and shared; each method then gets its own
  calibration run (``tb.choose_budget``).
  """
  families = {m: tb.dartree_family(drafter, tree, base, label=m)
              for m, (drafter, tree) in tree_methods.items() if tree in BUDGET_TREES}
  if not families:
    log("[dartree-budget] auto: none of the benched methods uses a budget (chains "
        "ignore it)")
    return {}
  sizes = tuple(sorted(set().union(*(tb.verify_sizes(f) for f in families.values()))))
  log(f"[dartree-budget] timing target verify passes for T in {sizes} (shared by "
      f"{', '.join(families)}) ...")
  costs = tb.measure_verify_costs(target, sizes, taps=next(iter(families.values())).taps)
  return {m: tb.choose_budget(target, family, verify_costs=costs, log=log)
          for m, family in families.items()}


def check_drafter_args(args, methods: Sequence[str]) -> None:
  """Raises InputError if the DARTree methods among ``methods`` lack a drafter
  (or get conflicting ones); loads nothing, so it can run before the target."""
  if args.drafter not in (None, "random"):
    raise InputError(f"--drafter takes only 'random' (a random drafter), got "
                     f"{args.drafter!r}; pass drafter directories with --dflash DIR / "
                     "--domino DIR")
  wanted = [m for m in methods if m in DARTREE_METHODS]
  if not wanted:
    return
  if args.drafter is not None and (args.dflash or args.domino):
    raise InputError("--drafter random replaces --dflash/--domino; pass one or the other")
  if args.drafter == "random":
    if args.drafter_block_size < 2:
      raise InputError(f"--drafter-block-size must be >= 2 (the root plus at least one "
                       f"draft depth), got {args.drafter_block_size}")
    for flag in ("drafter_layers", "drafter_emb_dim", "drafter_gru_dim"):
      if getattr(args, flag) < 1:
        raise InputError(f"--{flag.replace('_', '-')} must be >= 1, got "
                         f"{getattr(args, flag)}")
    return
  need_domino = [m for m in wanted if m in DOMINO_METHODS]
  if need_domino and not args.domino:
    plain = (f"; --dflash {args.dflash} gives only the DFlash backbone" if args.dflash
             else "")
    raise InputError(f"--method {','.join(need_domino)} needs a Domino drafter (DFlash "
                     f"backbone + correction head): pass --domino DIR, or --drafter "
                     f"random for a random one (timing only){plain}")
  if not (args.dflash or args.domino):
    raise InputError(f"--method {','.join(wanted)} needs a drafter: --dflash DIR (a "
                     "DFlash drafter), --domino DIR (its DFlash backbone serves), or "
                     "--drafter random (timing only)")


def load_drafters(args, target, methods: Sequence[str]) -> dict[str, tuple[Any, str]]:
  """The drafter serving each DARTree method in ``methods``: name -> (drafter, source).

  dflash-chain and ddtree use ``--dflash``, else the ``--domino`` drafter (they read
  only its backbone's uncorrected marginals); the other three need ``--domino``.
  ``--drafter random`` makes one random Domino drafter for all of them. Raises
  InputError for missing / conflicting drafter flags (``check_drafter_args``),
  CheckpointError / ConfigError for bad directories and drafters made for another
  target (hidden size, vocabulary or layer count).
  """
  check_drafter_args(args, methods)
  wanted = [m for m in methods if m in DARTREE_METHODS]
  if not wanted:
    return {}
  if args.drafter == "random":
    drafter = dj.DFlashDrafter.init(
        target, block_size=args.drafter_block_size, num_layers=args.drafter_layers,
        domino=True, emb_dim=args.drafter_emb_dim, gru_hidden_dim=args.drafter_gru_dim,
        seed=args.seed)
    return {m: (drafter, "random") for m in wanted}
  domino = dj.load_domino(args.domino, target) if args.domino else None
  use_dflash = args.dflash and any(m in DFLASH_METHODS for m in wanted)
  dflash = dj.load_dflash(args.dflash, target) if use_dflash else None
  out = {}
  for m in wanted:
    if m in DFLASH_METHODS and dflash is not None:
      out[m] = (dflash, str(args.dflash))
    else:
      out[m] = (domino, str(args.domino))
  return out


def load_dart_gru_args(args, target, methods: Sequence[str]):
  """The DART-GRU drafter for the dart-gru methods among ``methods`` (None if
  there are none): ``--dart-gru DIR`` or ``random``. Raises InputError without it."""
  wanted = [m for m in methods if m in DART_GRU_METHODS]
  if not wanted:
    return None
  if not args.dart_gru:
    raise InputError(f"--method {','.join(wanted)} needs a DART-GRU drafter: --dart-gru "
                     "DIR (a train.main head.kind=dart_gru export), or --dart-gru random "
                     "(timing only)")
  if args.dart_gru != "random":
    return dj.load_dart_gru(args.dart_gru, target)
  head = dj.DartHead.init(target, draft_length=getattr(args, "draft_length", 4),
                          draft_vocab_size=getattr(args, "draft_vocab_size", None),
                          seed=args.seed)
  return dj.DartGruDrafter.from_head(head, emb_dim=args.drafter_emb_dim,
                                     gru_hidden_dim=args.drafter_gru_dim, seed=args.seed)


def load_dart_args(args, target) -> tuple[Any, Any]:
  """(DART head, N-gram or None) from ``--draft`` / ``--ngram``.

  Without ``--draft`` the embedded target (no ``--model``) uses the head and
  N-gram shipped for it (``--ngram`` still overrides the N-gram); other targets
  need a head directory. ``--draft random`` is a random head (timing only).
  """
  ngram = dj.ngram.NGram.load_trie(args.ngram) if args.ngram else None
  if args.draft is None:
    if args.model is not None:
      raise InputError("--method dart needs --draft: a DART head directory for this "
                       "model, or 'random' for a randomly initialised head (timing only)")
    return dj.load_dart(None, target), ngram if ngram is not None else dj.load_ngram()
  if args.draft == "random":
    return dj.DartHead.init(target, draft_length=getattr(args, "draft_length", 4),
                            draft_vocab_size=getattr(args, "draft_vocab_size", None),
                            seed=args.seed), ngram
  return dj.load_dart(args.draft, target), ngram


def tree_config_from_args(args, target, head, ngram, log) -> tuple[Any, dict]:
  """(DART TreeConfig, how it was chosen) from ``--tree-budget auto|N``, ``--topk``,
  ``--beam-width``; without a budget, the head's own tree (or the default)."""
  if args.tree_budget == "auto":
    choice = tb.auto_tree_budget(target, head, ngram, topk=args.topk,
                                 beam_width=args.beam_width, log=log)
    return choice.tree, {"source": "auto", **choice.to_json()}
  if args.tree_budget is not None:
    try:
      budget = int(args.tree_budget)
    except ValueError:
      raise InputError(f"--tree-budget must be an integer or 'auto', got "
                       f"{args.tree_budget!r}") from None
    if budget < 1:
      raise InputError(f"--tree-budget must be >= 1, got {budget}")
    tree = tb.tree_config_for(budget, args.topk, args.beam_width)
  else:
    given = {k: v for k, v in (("topk", args.topk), ("beam_width", args.beam_width))
             if v is not None}
    # The shipped head carries the tree measured for it.
    tree = dataclasses.replace(head.tree or dj.tree.TreeConfig(), **given)
  return tree, {"source": "fixed", "budget": tree.remain_total, "topk": tree.topk,
                "beam_width": tree.beam_width}


def _environment() -> dict:
  env = {"python": platform.python_version(), "jax": jax.__version__,
         "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
         "cpu_count": os.cpu_count(), "platform": platform.platform()}
  for name in ("torch", "transformers"):
    module = sys.modules.get(name)
    env[name] = getattr(module, "__version__", None) if module else None
  return env


def run_benchmark(args, log=lambda msg: print(msg, file=sys.stderr)) -> dict:
  """Everything the CLI does except printing; returns the JSON document."""
  methods = _split(args.method, METHODS, "method")
  names = _split(args.dataset, datasets.DATASETS, "dataset")
  temperatures = [float(t) for t in _split(args.temperature, None, "temperature")]
  if args.limit is not None and args.limit < 1:
    raise InputError(f"--limit must be >= 1, got {args.limit}")
  if "ar" not in methods:
    methods.insert(0, "ar")  # The reference for speedups and greedy checks.
  if args.profile and not any(m in LOSSLESS_METHODS for m in methods):
    raise InputError("--profile times the phases of speculative methods: add at least "
                     f"one of {', '.join(LOSSLESS_METHODS)} to --method")
  check_drafter_args(args, methods)
  if any(m in DART_GRU_METHODS for m in methods) and not args.dart_gru:
    raise InputError(f"--method {','.join(m for m in methods if m in DART_GRU_METHODS)} "
                     "needs --dart-gru DIR (or --dart-gru random, timing only)")
  dartree_budget = dartree_budget_arg(args)
  tree_config = (dartree_config(args, allow_auto=True)
                 if any(m in DARTREE_METHODS + DART_GRU_METHODS for m in methods) else None)

  target = dj.load_target(args.model)
  if target.tokenizer is None:
    raise InputError(f"the target at {target.source} has no tokenizer; the benchmark "
                     "prompts are chat text")
  drafters = load_drafters(args, target, methods)
  dart_gru = load_dart_gru_args(args, target, methods)
  # DARTree-family bench method -> (drafter, ``generate``'s tree name).
  tree_methods = {m: (drafter, m) for m, (drafter, _) in drafters.items()}
  tree_methods.update({m: (dart_gru, DART_GRU_TREES[m]) for m in methods
                       if m in DART_GRU_METHODS})
  choices = (auto_dartree_budgets(target, tree_methods, tree_config, log)
             if dartree_budget == "auto" else {})
  configs = {m: choices[m].tree if m in choices else tree_config for m in tree_methods}
  config_json = None if tree_config is None else dict(
      dataclasses.asdict(tree_config), **({"budget": "auto"} if dartree_budget == "auto"
                                          else {}))
  # Speculative method -> its ``generate`` options (a runner each, and with
  # --profile a phased twin).
  speculative: dict[str, dict[str, Any]] = {}
  skipped, tree_info = [], None
  dartree_info = None
  if drafters:
    dartree_info = {"config": dict(config_json), "methods": {}}
    for m, (drafter, source) in drafters.items():
      speculative[m] = dict(draft=drafter, tree=m, tree_config=configs[m])
      c = drafter.config
      dartree_info["methods"][m] = {
          "drafter": source, "domino": drafter.domino, "block_size": c.block_size,
          "nodes": num_tree_nodes(m, configs[m], c.num_depths, c.vocab_size)}
  dart_gru_info = None
  if dart_gru is not None:
    c = dart_gru.config
    dart_gru_info = {"drafter": str(args.dart_gru), "config": dict(config_json),
                     "draft_length": c.draft_length, "draft_vocab_size": c.draft_vocab_size,
                     "emb_dim": c.emb_dim, "gru_hidden_dim": c.gru_hidden_dim, "methods": {}}
    for m in (m for m in methods if m in DART_GRU_METHODS):
      tree = DART_GRU_TREES[m]
      speculative[m] = dict(draft=dart_gru, tree=tree, tree_config=configs[m])
      dart_gru_info["methods"][m] = {"tree": tree, "nodes": num_tree_nodes(
          resolve_method(tree, True), configs[m], c.num_levels, c.draft_vocab_size)}
  for m, choice in choices.items():
    info = dart_gru_info if m in DART_GRU_METHODS else dartree_info
    info["methods"][m]["budget_choice"] = {"source": "auto", **choice.to_json()}
  if "dart" in methods:
    head, ngram = load_dart_args(args, target)
    tree, tree_info = tree_config_from_args(args, target, head, ngram, log)
    speculative["dart"] = dict(draft=head, ngram=ngram, tree=tree)
  runners: dict[str, Any] = {"ar": JaxMethod(target)}
  runners.update({m: JaxMethod(target, **options) for m, options in speculative.items()})
  profilers = ({m: JaxMethod(target, **options, profile=True)
                for m, options in speculative.items()} if args.profile else {})
  if "hf" in methods:
    try:
      torch_module, hf_model = load_hf_model(args.model, args.hf_threads)
      runners["hf"] = HFMethod(hf_model, torch_module, stop_token_ids(target, None))
    except ImportError as e:
      skipped.append(f"hf: torch/transformers not importable ({e})")
      log(f"[bench] skipping hf: torch/transformers not importable ({e})")
  runners = {m: runners[m] for m in methods if m in runners}

  total = sum(num_items(n, args.limit) for n in names) * len(temperatures) * (
      len(runners) + len(profilers))
  bar = None
  if not args.no_progress:
    from tqdm import tqdm
    bar = tqdm(total=total, file=sys.stderr, desc="bench", unit="run")
  bench = Bench(target, runners, max_new_tokens=args.max_new_tokens, seed=args.seed,
                top_p=args.top_p, top_k=args.top_k, profilers=profilers,
                progress=bar.update if bar is not None else None)
  runs = []
  try:
    # T=0 first: MT-Bench turn 2 reuses its AR greedy turn-1 answers at T>0.
    for temperature in sorted(temperatures):
      sampling = Sampling(temperature, args.top_p, args.top_k)
      for name in names:
        if bar is not None:
          bar.set_description(f"{name} T={temperature:g}")
        items = dataset_items(name, args.limit, bench.turn1_answer)
        runs.append(bench.run_dataset(name, items, sampling))
  finally:
    if bar is not None:
      bar.close()
  config = {k: v for k, v in vars(args).items()}
  config["dartree_budget"] = dartree_budget  # parsed: an int, "auto" or None
  config["methods_run"] = list(runners)
  return {"config": config, "environment": _environment(), "tree": tree_info,
          "dartree": dartree_info, "dart_gru": dart_gru_info, "skipped": skipped,
          "runs": runs,
          "greedy_mismatches": greedy_mismatches(runs)}


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    result = run_benchmark(args)
    print(format_table(result["runs"]))
    for note in result["skipped"]:
      print(f"skipped {note}")
    if args.json:
      with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
      print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
      write_plot(result["runs"], args.plot)
      print(f"wrote {args.plot}", file=sys.stderr)
  except dj.DartJaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  bad = result["greedy_mismatches"]
  if bad:
    print("\n" + "!" * 72 + f"\nGREEDY MISMATCH: {len(bad)} speculative output(s) differ "
          "from AR at temperature 0 (speculative decoding must be lossless):",
          file=sys.stderr)
    for b in bad:
      print(f"  {b['dataset']} {b['id']} turn {b['turn']} ({b['method']})", file=sys.stderr)
    print("!" * 72, file=sys.stderr)
    return GREEDY_MISMATCH_EXIT
  return 0


if __name__ == "__main__":
  sys.exit(main())
