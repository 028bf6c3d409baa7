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
        supertree, ``--dartree-*`` options). Drafter: ``--domino``. On the
        embedded target (no ``--model``) the Domino drafter shipped for it
        serves all five methods when no drafter flag is given, with its
        measured tree settings (the ``--dartree-*`` flags change them).
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
choose the budget before the bench from measurements (``dart_jax.tree_budget``):
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

Code: this module is the harness and the CLI's main; the options, method names
and drafter loading are in ``infer.bench_options``, the summaries, greedy check,
table and plot in ``infer.bench_report``.
"""

import dataclasses
import json
import os
import platform
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax

import dart_jax as dj
from dart_jax.errors import InputError
from dart_jax import sharding
from dart_jax.models import precision
from dart_jax.generate import encode_prompts, stop_token_ids
from dart_jax.decode.methods import METHODS as REGISTRY
from dart_jax.profiling import CompileWatch, free_compiled_code_near_map_limit
from dart_jax.tree.dartree import num_tree_nodes, resolve_method
from infer import datasets
from infer.bench_options import (DART_GRU_METHODS, DART_GRU_TREES, DART_METHODS,
                                 DARTREE_METHODS,
                                 GREEDY_MISMATCH_EXIT, LOSSLESS_METHODS, METHODS,
                                 auto_dartree_budgets, build_parser, check_drafter_args,
                                 dartree_budget_arg, dartree_config, load_dart_args,
                                 load_dart_gru_args, load_drafters, split_arg,
                                 tree_config_from_args)
from infer.bench_report import (format_table, greedy_mismatches, rate, summarize,
                                write_plot)

MAX_COLD_RETRIES = 2


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
               context_ngram: bool | None = None, profile: bool = False):
    self.target = target
    self.kwargs: dict[str, Any] = {}
    if draft is not None:
      self.kwargs.update(draft=draft, ngram=ngram, tree=tree)
      if tree_config is not None:
        self.kwargs["tree_config"] = tree_config
      if context_ngram is not None:
        self.kwargs["context_ngram"] = context_ngram
      if profile:
        self.kwargs["profile"] = True

  def run(self, prompt_ids: list[int], sampling: Sampling, max_new_tokens: int,
          seed: int) -> RunRecord:
    # A run that recompiles after this is discarded and rerun, as any cold run.
    if free_compiled_code_near_map_limit():
      print("[bench] near the process's memory-map limit: dropped JAX's compiled "
            "programs (they recompile)", file=sys.stderr)
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
  elif name == "rewrite":
    for item_id, messages in datasets.rewrite_messages(limit):
      yield BenchItem(name, item_id, messages, 1)
  else:
    raise InputError(f"unknown dataset {name!r}; choose from {datasets.DATASETS}")


def num_items(name: str, limit: int | None) -> int:
  size = {"mt_bench": datasets.MT_BENCH_SIZE, "humaneval": datasets.HUMANEVAL_SIZE,
          "rewrite": datasets.REWRITE_SIZE}[name]
  size = min(size, limit) if limit is not None else size
  return 2 * size if name == "mt_bench" else size


# ----------------------------------------------------------------------------
# The harness.
# ----------------------------------------------------------------------------


def method_order(methods: Sequence[str], index: int) -> list[str]:
  """Methods in the order prompt ``index`` runs them: as given for even indices,
  reversed for odd ones."""
  return list(methods) if index % 2 == 0 else list(reversed(methods))


def record_json(rec: RunRecord, target, ar: RunRecord | None) -> dict:
  """Per-prompt JSON of one method's run (compared with AR's run when given)."""
  out = {
      "new_tokens": rec.new_tokens, "decode_tokens": rec.decode_tokens,
      "decode_s": rec.decode_s, "ttft_s": rec.ttft_s, "wall_s": rec.wall_s,
      "tokens_per_s": rate(rec.decode_tokens, rec.decode_s),
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


# ----------------------------------------------------------------------------
# The CLI.
# ----------------------------------------------------------------------------


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
  methods = split_arg(args.method, METHODS, "method")
  names = split_arg(args.dataset, datasets.DATASETS, "dataset")
  temperatures = [float(t) for t in split_arg(args.temperature, None, "temperature")]
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
  if any(m in DARTREE_METHODS + DART_GRU_METHODS for m in methods):
    dartree_config(args, allow_auto=True)  # Bad --dartree-* values fail before loading.

  mesh = sharding.mesh_from_flag(args.mesh)
  target = dj.load_target(args.model, dtype=precision.resolve_flag(args.precision), mesh=mesh)
  if target.tokenizer is None:
    raise InputError(f"the target at {target.source} has no tokenizer; the benchmark "
                     "prompts are chat text")
  drafters = load_drafters(args, target, methods)
  dart_gru = load_dart_gru_args(args, target, methods)
  # DARTree-family bench method -> (drafter, ``generate``'s tree name).
  tree_methods = {m: (drafter, m) for m, (drafter, _) in drafters.items()}
  tree_methods.update({m: (dart_gru, DART_GRU_TREES[m]) for m in methods
                       if m in DART_GRU_METHODS})
  # The --dartree-* flags change each drafter's measured settings (the shipped
  # drafter's), else the defaults.
  bases = {m: dartree_config(args, allow_auto=True, base=drafter.tree_config)
           for m, (drafter, _) in tree_methods.items()}
  choices = (auto_dartree_budgets(target, tree_methods, bases, log)
             if dartree_budget == "auto" else {})
  configs = {m: choices[m].tree if m in choices else bases[m] for m in tree_methods}

  def config_json(m: str) -> dict:
    return dict(dataclasses.asdict(bases[m]),
                **({"budget": "auto"} if dartree_budget == "auto" else {}))
  # Speculative method -> its ``generate`` options (a runner each, and with
  # --profile a phased twin).
  speculative: dict[str, dict[str, Any]] = {}
  skipped, tree_info = [], None
  dartree_info = None
  if drafters:
    dartree_info = {"methods": {}}
    for m, (drafter, source) in drafters.items():
      speculative[m] = dict(draft=drafter, tree=m, tree_config=configs[m])
      c = drafter.config
      dartree_info["methods"][m] = {
          "drafter": source, "domino": drafter.domino, "block_size": c.block_size,
          "config": config_json(m),
          "nodes": num_tree_nodes(m, configs[m], c.num_depths, c.vocab_size)}
  dart_gru_info = None
  if dart_gru is not None:
    c, head_c = dart_gru.config, dart_gru.config.dart
    dart_gru_info = {"drafter": str(args.dart_gru),
                     "draft_length": head_c.draft_length,
                     "draft_vocab_size": head_c.draft_vocab_size,
                     "emb_dim": c.emb_dim, "gru_hidden_dim": c.gru_hidden_dim, "methods": {}}
    for m in (m for m in methods if m in DART_GRU_METHODS):
      tree = DART_GRU_TREES[m]
      speculative[m] = dict(draft=dart_gru, tree=tree, tree_config=configs[m])
      nodes = num_tree_nodes(resolve_method(tree, True), configs[m], head_c.num_levels,
                             head_c.draft_vocab_size)
      dart_gru_info["methods"][m] = {"tree": tree, "config": config_json(m), "nodes": nodes}
  for m, choice in choices.items():
    info = dart_gru_info if m in DART_GRU_METHODS else dartree_info
    info["methods"][m]["budget_choice"] = {"source": "auto", **choice.to_json()}
  if any(m in DART_METHODS for m in methods):
    head, ngram = load_dart_args(args, target)
    tree, tree_info = tree_config_from_args(args, target, head, ngram, log)
    for m in (m for m in methods if m in DART_METHODS):
      # The registry says whether the method uses the context N-gram at all.
      context = REGISTRY[m].context_ngram and args.context_ngram != "off"
      speculative[m] = dict(draft=head, ngram=ngram, tree=tree, context_ngram=context)
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
  config["precision"] = target.precision.name  # "auto" resolved
  config["mesh"] = dict(mesh.shape) if mesh is not None else None
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
