"""A seeded, generated set of user prompts for self-distillation.

DART heads learn best from the target's own answers (``train.data
regenerate``), so the training data needs questions, not answers. This module
writes a broad, reproducible set of them by filling templates of six task
families (writing, coding and code completion, math, explanation, extraction,
roleplay, plus advice / brainstorming) with topics drawn by a seeded generator. A fraction of
the conversations get a second user turn (a follow-up), so heads also see
answers conditioned on an earlier answer, as in chat benchmarks.

The lists below were written for this project; MT-Bench and HumanEval prompts
are held out for evaluation and are never used here (``tests/test_prompts.py``
checks that no generated prompt equals a benchmark prompt).

Command line:
  python -m train.prompts --num 2000 --seed 0 --out prompts.jsonl
Output lines are OpenAI-style records with user turns only:
  {"messages": [{"role": "user", "content": "..."}, ...], "family": "coding"}
"""

import argparse
import json
import os
import sys
from typing import Sequence

import numpy as np

from dart_jax.errors import InputError

SUBJECTS = (
    "photosynthesis", "black holes", "the French Revolution", "compound interest",
    "vaccines", "plate tectonics", "the water cycle", "machine learning", "inflation",
    "the Roman Empire", "climate change", "DNA replication", "electric cars",
    "the stock market", "volcanoes", "the immune system", "renewable energy",
    "the printing press", "quantum computing", "coral reefs", "the Silk Road",
    "supply and demand", "sleep", "honeybees", "the Internet", "gravity",
    "the Renaissance", "recycling", "earthquakes", "antibiotics", "the Moon landing",
    "rainforests", "blockchain", "the human heart", "tides", "democracy",
    "coffee", "the Olympic Games", "solar panels", "memory in the brain",
)
AUDIENCES = ("a ten-year-old", "a high-school student", "a busy manager", "a beginner",
             "an expert", "my grandmother", "a new employee", "a tourist")
STYLES = ("formal", "friendly", "humorous", "concise", "persuasive", "poetic",
          "enthusiastic", "neutral")
WRITING_FORMS = ("a short story", "a poem", "a blog post", "an email", "a product description",
                 "a speech", "a cover letter", "a diary entry", "a limerick", "a news article",
                 "a thank-you note", "a haiku sequence")
WRITING_TOPICS = ("a lost dog finding its way home", "the first day at a new job",
                  "a city after the rain", "a robot learning to cook", "a summer festival",
                  "an old lighthouse keeper", "moving to another country",
                  "a mysterious letter", "a team winning a hard match", "the last day of school",
                  "a garden in autumn", "a train journey through the mountains",
                  "a friendship between a cat and a crow", "a bakery opening at dawn",
                  "a storm at sea", "a library at midnight")
LANGUAGES = ("Python", "JavaScript", "C++", "Java", "Go", "Rust", "SQL", "Bash")
CODE_TASKS = (
    "reverses the words in a sentence", "checks whether a string is a palindrome",
    "counts the vowels in a string", "merges two sorted lists",
    "finds the second largest number in a list", "removes duplicates from a list while "
    "keeping order", "computes the factorial of n iteratively",
    "returns the n-th Fibonacci number", "parses a date string in the format YYYY-MM-DD",
    "flattens a nested list", "computes the average of the values in a dictionary",
    "validates an email address with a regular expression", "reads a CSV file and sums a "
    "column", "implements binary search", "converts Celsius to Fahrenheit",
    "groups words by their first letter", "finds the longest common prefix of strings",
    "rotates a matrix by 90 degrees", "implements a stack with push and pop",
    "checks if two strings are anagrams", "counts word frequencies in a text",
    "computes the greatest common divisor of two numbers", "transposes a matrix",
    "generates all permutations of a string", "implements a simple LRU cache",
)
CODE_TEMPLATES = (
    "Write a {lang} function that {task}.",
    "How do I write code in {lang} that {task}? Please explain each step.",
    "Write a {lang} program that {task}, and add a few test cases.",
    "Can you show me a short {lang} snippet that {task}?",
    "Explain what a function that {task} needs to handle, then implement it in {lang}.",
)
CODE_CONCEPTS = ("recursion", "a hash map", "big-O notation", "a linked list", "closures",
                 "exceptions", "unit testing", "a REST API", "garbage collection",
                 "a binary tree", "dynamic programming", "version control with git",
                 "object-oriented programming", "a race condition", "an index in a database")
ROLES = ("a pirate captain", "a medieval knight", "a travel guide in Rome", "a detective",
         "a friendly librarian", "a space station commander", "a chef in a busy kitchen",
         "a museum curator", "a personal fitness coach", "a wise old wizard",
         "a tech support agent", "a shopkeeper in a fantasy village", "a ship's navigator",
         "a park ranger", "a famous painter", "a radio host", "a time traveller from 1900",
         "a robot butler", "a mountain guide", "a school principal", "a jazz musician",
         "a dragon who loves books")
ROLE_SITUATIONS = ("welcome a new visitor", "explain today's plan", "tell me about your "
                   "favourite memory", "give advice to a nervous beginner",
                   "describe your workplace", "answer my question about your job",
                   "convince me to join your team", "tell a short story about your day",
                   "describe the hardest thing you ever did", "teach me a skill you know",
                   "react to some surprising news", "plan a celebration with me")
ITEMS = ("apples", "books", "tickets", "marbles", "pencils", "cookies", "stamps", "coins")
NAMES = ("Alice", "Bob", "Maria", "Chen", "Omar", "Priya", "Lucas", "Sofia", "Yuki", "Ahmed")
ADVICE_TOPICS = ("learning a new language", "saving money each month", "preparing for a job "
                 "interview", "staying focused while studying", "starting to run",
                 "keeping houseplants alive", "planning a weekend trip",
                 "organising a small team", "writing a good resume", "sleeping better",
                 "cooking healthy meals on a budget", "giving a presentation",
                 "making new friends in a new city", "reading more books", "learning to draw",
                 "reducing screen time", "negotiating a salary", "training a puppy",
                 "writing a first novel", "moving house", "learning to code", "managing stress",
                 "hosting a dinner party", "choosing a laptop")
FOLLOW_UPS = ("Can you make it shorter?", "Now explain it in simpler words.",
              "Give me one more example.", "Can you rewrite it in a more formal tone?",
              "What are the most common mistakes here?", "Summarize your answer in three "
              "bullet points.", "Can you add a short conclusion?", "Why is that the case?",
              "Turn that into a numbered list.", "What would you change to improve it?")


def _pick(rng: np.random.Generator, options: Sequence[str]) -> str:
  return options[int(rng.integers(len(options)))]


def _writing(rng):
  form, topic, style = _pick(rng, WRITING_FORMS), _pick(rng, WRITING_TOPICS), _pick(rng, STYLES)
  return _pick(rng, (
      f"Write {form} about {topic}.",
      f"Write {form} about {topic} in a {style} style.",
      f"Compose {form} for {_pick(rng, AUDIENCES)} about {topic}.",
      f"I need {form} about {topic}. Keep it {style} and under 200 words.",
      f"Draft {form} that describes {_pick(rng, SUBJECTS)} in a {style} tone.",
  ))


def _coding(rng):
  if rng.random() < 0.75:
    return _pick(rng, CODE_TEMPLATES).format(lang=_pick(rng, LANGUAGES),
                                             task=_pick(rng, CODE_TASKS))
  concept, lang = _pick(rng, CODE_CONCEPTS), _pick(rng, LANGUAGES)
  return _pick(rng, (f"Explain {concept} with an example in {lang}.",
                     f"What is {concept} and when should I use it?",
                     f"Show me how {concept} works in {lang}, with comments."))


# (function name, arguments, return annotation, docstring) for code-completion prompts.
FUNCTION_STUBS = (
    ("reverse_words", "sentence: str", "str", "Return the sentence with its words in reverse order."),
    ("reads_same_backwards", "text: str", "bool", "Return True if text reads the same backwards, ignoring case."),
    ("count_vowels", "text: str", "int", "Return how many vowels (a, e, i, o, u) text contains."),
    ("merge_sorted", "a: list, b: list", "list", "Merge two sorted lists into one sorted list."),
    ("second_largest", "numbers: list", "int", "Return the second largest distinct number."),
    ("unique_in_order", "items: list", "list", "Remove duplicates while keeping the first occurrences in order."),
    ("fibonacci", "n: int", "int", "Return the n-th Fibonacci number, with fibonacci(0) == 0."),
    ("flatten", "nested: list", "list", "Flatten a list that may contain lists, to any depth."),
    ("mean_value", "scores: dict", "float", "Return the average of the values of the dictionary."),
    ("binary_search", "items: list, target: int", "int", "Return the index of target in the sorted list, or -1."),
    ("celsius_to_fahrenheit", "celsius: float", "float", "Convert a temperature from Celsius to Fahrenheit."),
    ("common_prefix", "words: list", "str", "Return the longest common prefix of all the words."),
    ("rotate_matrix", "matrix: list", "list", "Rotate a square matrix by 90 degrees clockwise."),
    ("are_anagrams", "a: str, b: str", "bool", "Return True if a and b contain the same letters."),
    ("word_counts", "text: str", "dict", "Return a dictionary mapping each word to its count."),
    ("gcd", "a: int, b: int", "int", "Return the greatest common divisor of a and b."),
    ("transpose", "matrix: list", "list", "Return the transpose of a rectangular matrix."),
    ("digit_sum", "n: int", "int", "Return the sum of the decimal digits of n."),
    ("running_total", "numbers: list", "list", "Return the list of prefix sums of numbers."),
    ("capitalize_words", "sentence: str", "str", "Capitalize the first letter of every word."),
    ("count_primes", "limit: int", "int", "Return how many primes are smaller than limit."),
    ("chunk", "items: list, size: int", "list", "Split items into consecutive chunks of the given size."),
    ("max_profit", "prices: list", "int", "Return the best profit from one buy and one later sell."),
    ("to_binary", "n: int", "str", "Return the binary representation of a non-negative integer."),
    ("strip_vowels", "text: str", "str", "Return text without its vowels."),
    ("pair_sums", "numbers: list, target: int", "list", "Return all index pairs whose values add up to target."),
)
COMPLETION_INSTRUCTIONS = (
    "Complete the following Python function.",
    "Finish this Python function. Reply with the complete function in a code block.",
    "Implement the function below.",
    "Write the body of this Python function and explain it briefly.",
)


def _code_completion(rng):
  name, args, returns, doc = FUNCTION_STUBS[int(rng.integers(len(FUNCTION_STUBS)))]
  example = ""
  if rng.random() < 0.5:
    example = f"\n\n    Example: call {name}(...) and check the result.\n    "
  stub = f'def {name}({args}) -> {returns}:\n    """{doc}{example}"""\n'
  if rng.random() < 0.3:
    stub = "from typing import List\n\n\n" + stub
  return f"{_pick(rng, COMPLETION_INSTRUCTIONS)}\n\n```python\n{stub}```"


def _math(rng):
  a, b, c = (int(v) for v in rng.integers(2, 99, 3))
  name, other, item = _pick(rng, NAMES), _pick(rng, NAMES), _pick(rng, ITEMS)
  return _pick(rng, (
      f"What is {a} times {b} plus {c}? Show your work.",
      f"{name} has {a} {item} and gives {min(a, b)} of them to {other}. Then {name} buys "
      f"{c} more. How many {item} does {name} have now?",
      f"Solve for x: {a}x + {b} = {a * c + b}. Explain each step.",
      f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
      f"If a train travels {a * 10} km in {max(2, c % 9)} hours, what is its average speed?",
      f"What is {a}% of {b * 10}? Explain how to compute percentages.",
      f"Is {a * b + 1} a prime number? Explain how you check.",
      f"{name} saves {a} dollars every week. How many weeks until {name} has {a * c} dollars?",
  ))


def _explanation(rng):
  subject, audience = _pick(rng, SUBJECTS), _pick(rng, AUDIENCES)
  other = _pick(rng, SUBJECTS)
  return _pick(rng, (
      f"Explain {subject} to {audience}.",
      f"What are the main causes and effects of {subject}?",
      f"Give me five interesting facts about {subject}.",
      f"How does {subject} work? Explain it step by step.",
      f"What is the difference between {subject} and {other}?",
      f"Why is {subject} important today?",
      f"Write a short summary of the history of {subject}.",
  ))


def _extraction(rng):
  names = rng.choice(NAMES, 3, replace=False)
  a, b, c = (int(v) for v in rng.integers(18, 70, 3))
  subject = _pick(rng, SUBJECTS)
  return _pick(rng, (
      f"Extract the names and ages from this text as JSON: {names[0]} is {a} years old, "
      f"{names[1]} just turned {b}, and {names[2]} will be {c} next year.",
      f"List every number that appears in this sentence: The shop sold {a} shirts, {b} "
      f"hats and {c} pairs of shoes on Monday.",
      f"From the text below, list the people mentioned and what they did.\n\n{names[0]} "
      f"organised the meeting, {names[1]} presented the budget and {names[2]} wrote the "
      f"notes.",
      f"Turn this into a table with columns name and score: {names[0]} {a}, {names[1]} {b}, "
      f"{names[2]} {c}.",
      f"Summarize the following in one sentence: {subject} has been studied for many years. "
      f"Researchers agree that it matters, but they still debate the details and the "
      f"best way to explain it to the public.",
      f"Classify the sentiment of these reviews as positive or negative: 1) 'I loved the "
      f"{_pick(rng, ITEMS)}!' 2) 'It broke after a day.' 3) 'Great value, would buy again.'",
  ))


def _roleplay(rng):
  role, situation = _pick(rng, ROLES), _pick(rng, ROLE_SITUATIONS)
  return _pick(rng, (
      f"Pretend you are {role}. {situation[0].upper()}{situation[1:]}.",
      f"You are {role}. In character, {situation}.",
      f"Act as {role} and {situation}. Stay in character.",
  ))


def _advice(rng):
  topic, audience = _pick(rng, ADVICE_TOPICS), _pick(rng, AUDIENCES)
  return _pick(rng, (
      f"Give me some tips for {topic}.",
      f"Explain to {audience} how to get better at {topic}.",
      f"Write a {_pick(rng, STYLES)} checklist for {topic}.",
      f"What is a good plan for {topic} for {audience}?",
      f"Brainstorm ten ideas to help with {topic}.",
      f"What are the pros and cons of {_pick(rng, SUBJECTS)}?",
      f"I am struggling with {topic}. What should I do first?",
  ))


FAMILIES = {
    "writing": _writing, "coding": _coding, "code_completion": _code_completion, "math": _math, "explanation": _explanation,
    "extraction": _extraction, "roleplay": _roleplay, "advice": _advice,
}


def generate_prompts(num: int, seed: int = 0, follow_up_fraction: float = 0.3
                     ) -> list[dict]:
  """``num`` distinct conversations (user turns only), families in round-robin order.

  The same (num, seed) always gives the same list.
  """
  if num < 1:
    raise InputError(f"num must be >= 1, got {num}")
  if not 0 <= follow_up_fraction <= 1:
    raise InputError(f"follow_up_fraction must be in [0, 1], got {follow_up_fraction}")
  rng = np.random.default_rng(seed)
  names = sorted(FAMILIES)
  records, seen = [], set()
  repeats = 0  # Draws in a row that gave an already used prompt.
  while len(records) < num:
    family = names[len(records) % len(names)]
    prompt = FAMILIES[family](rng)
    if prompt in seen:
      repeats += 1
      if repeats > 2000:  # The family is (nearly) exhausted.
        raise InputError(f"only {len(records)} distinct prompts could be generated "
                         f"({family} ran out); ask for fewer than {num}")
      continue
    repeats = 0
    seen.add(prompt)
    messages = [{"role": "user", "content": prompt}]
    if rng.random() < follow_up_fraction:
      messages.append({"role": "user", "content": _pick(rng, FOLLOW_UPS)})
    records.append({"messages": messages, "family": family})
  return records


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m train.prompts", description=__doc__.split(
      "\n")[0])
  p.add_argument("--num", type=int, default=2000)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--follow-up-fraction", type=float, default=0.3)
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)
  try:
    records = generate_prompts(args.num, args.seed, args.follow_up_fraction)
  except InputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record, ensure_ascii=False) + "\n")
  print(f"wrote {len(records)} conversations to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
