"""A seeded, generated set of user prompts for self-distillation.

DART heads learn best from the target's own answers (``train.data
regenerate``), so the training data needs questions, not answers. This module
writes a broad, reproducible set of them by filling templates of six task
families (writing, coding and code completion, math, explanation, extraction,
roleplay, plus advice / brainstorming) with topics drawn by a seeded generator. A fraction of
the conversations get a second user turn (a follow-up), so heads also see
answers conditioned on an earlier answer, as in chat benchmarks.

The lists below were written for this project; MT-Bench and HumanEval prompts
are held out for evaluation and are never used here (``tests/train/test_prompts.py``
checks that no generated prompt equals a benchmark prompt).

Two recipes, each reproducible from (num, seed):
- ``v1``: the eight families above in round-robin order, one optional follow-up;
  it tops out near 3,300 distinct conversations (code completion runs out). The
  shipped head of session 5 was trained on its seed-0 answers.
- ``v2``: v1's families plus summarising / rewriting a given passage, math
  with several steps, long-form writing, debugging and explaining given code,
  code in more languages, and short knowledge questions; families are drawn at
  random and one that keeps repeating itself is retired, so it reaches tens of
  thousands of conversations. Follow-ups are wider and some conversations get
  two.

Command line:
  python -m train.prompts --num 2000 --seed 0 --out prompts.jsonl
  python -m train.prompts --recipe v2 --num 12000 --heldout 400 --seed 0 \
      --out prompts.jsonl --heldout-out heldout.jsonl
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


# ------------------------------------------------------------------ recipe v2
# Everything below is v2 only; v1's lists and functions above stay as they were
# so that v1 output (and the shipped head's recipe) is unchanged.

MORE_LANGUAGES = LANGUAGES + ("TypeScript", "C#", "Kotlin", "Swift", "Ruby", "PHP",
                              "Haskell", "R", "Scala", "Julia")
MORE_CODE_TASKS = CODE_TASKS + (
    "parses a line of key=value pairs into a dictionary", "checks whether brackets in a "
    "string are balanced", "finds the most common element in a list",
    "converts a Roman numeral to an integer", "splits a list into chunks of size n",
    "computes a moving average over a window", "finds all prime numbers below n",
    "counts the lines, words and characters of a file", "sorts a list of records by two keys",
    "implements a queue using two stacks", "finds the shortest path in a grid with BFS",
    "computes the edit distance between two strings", "serialises a tree to a string and "
    "back", "validates a Sudoku board", "merges overlapping intervals",
    "converts a number to words in English", "implements a simple rate limiter",
    "retries a failing network call with exponential backoff", "deep-copies a nested "
    "structure", "formats a duration in seconds as hours, minutes and seconds",
    "reads a JSON file and prints one field of every record", "implements a min-heap",
    "checks whether a year is a leap year", "compresses a string with run-length encoding",
    "finds the k largest numbers in a list", "tokenises a simple arithmetic expression",
)
# (snippet, what is wrong) for debugging prompts; the snippets are Python.
BUGGY_SNIPPETS = (
    ("def average(xs):\n    return sum(xs) / len(xs) + 1", "it returns the wrong value"),
    ("def last(items):\n    return items[len(items)]", "it raises an IndexError"),
    ("def count_a(text):\n    n = 0\n    for c in text:\n        if c == 'a':\n"
     "            n =+ 1\n    return n", "the count is always 0 or 1"),
    ("def add_item(item, basket=[]):\n    basket.append(item)\n    return basket",
     "items from earlier calls show up"),
    ("def is_even(n):\n    return n % 2 == 1", "it gives the opposite answer"),
    ("def factorial(n):\n    if n == 0:\n        return 0\n    return n * factorial(n - 1)",
     "it always returns 0"),
    ("def reverse(s):\n    out = ''\n    for i in range(len(s)):\n        out += s[i]\n"
     "    return out", "the string comes back unchanged"),
    ("def find(items, x):\n    for i, v in enumerate(items):\n        if v == x:\n"
     "            return i\n        else:\n            return -1", "it only finds the first "
     "element"),
    ("def total(prices):\n    for p in prices:\n        s = 0\n        s += p\n    return s",
     "it returns only the last price"),
    ("def read_numbers(path):\n    f = open(path)\n    return [int(x) for x in f]",
     "the file is never closed and blank lines crash it"),
    ("def middle(xs):\n    return xs[len(xs) / 2]", "it raises a TypeError"),
    ("def squares(n):\n    return [i * i for i in range(1, n)]", "it misses the last square"),
)
PASSAGE_OPENINGS = (
    "{subject} has shaped the way people live for a long time.",
    "Many people have heard of {subject}, but few know how it really works.",
    "Last year our town held a public meeting about {subject}.",
    "{name} first became interested in {subject} as a student.",
    "Scientists and historians still argue about {subject}.",
)
PASSAGE_MIDDLES = (
    "Supporters say it brings clear benefits, such as lower costs and better health.",
    "Critics point out that the benefits are uneven and that some groups are left behind.",
    "A survey of {number} people found that most of them wanted to learn more.",
    "{name} spent {years} years collecting stories and measurements about it.",
    "The early results were surprising, and several experts changed their minds.",
    "Funding was cut twice, which delayed the work by several months.",
    "Local schools now teach the basics, and the museum runs a small exhibition.",
    "Some of the claims made online, however, are not supported by the evidence.",
)
PASSAGE_ENDINGS = (
    "In the end, the debate is likely to continue for years.",
    "The next report is expected early next year.",
    "For now, the best advice is to stay curious and check the sources.",
    "{name} hopes that the next generation will finish what was started.",
)
REWRITE_INSTRUCTIONS = (
    "Summarise this text in two sentences.", "Summarise the text below in three bullet "
    "points.", "Rewrite this paragraph for {audience}.", "Rewrite the text in a {style} "
    "tone.", "Give this passage a short title and a one-line summary.",
    "Shorten this text to about half its length without losing the key points.",
    "List the main claims in this passage and say which ones need evidence.",
    "Turn this paragraph into a short list of facts.", "Rewrite this as a short news "
    "headline and lead sentence.", "Paraphrase the text below in plain English.",
    "What is the main idea of this passage? Answer in one sentence.",
    "Translate this paragraph into {language}.",
)
WORLD_LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch")
LONG_FORMS = (
    "an essay of about 500 words", "a detailed report", "a complete beginner's guide",
    "a long blog post with headings", "a two-page story", "a lesson plan",
    "a detailed project proposal", "a product review with pros and cons",
    "a travel itinerary for five days", "a study guide with practice questions",
)
KNOWLEDGE_QUESTIONS = (
    "What is the boiling point of water at the top of a high mountain, and why?",
    "How do airplanes stay in the air?", "Why is the sky blue?",
    "How do vaccines train the immune system?", "What causes the seasons on Earth?",
    "Why do we have leap years?", "How does a refrigerator keep food cold?",
    "What is the difference between weather and climate?", "How do bees make honey?",
    "Why do cats purr?", "How does a credit score work?", "What makes a rainbow?",
    "How do noise-cancelling headphones work?", "Why does bread go stale?",
    "What is a black hole made of?", "How do plants know which way is up?",
    "Why does ice float on water?", "How does GPS find my location?",
    "What happens in the body during a fever?", "How are mountains formed?",
    "Why do onions make people cry?", "How does a battery store energy?",
    "What is the difference between a virus and a bacterium?",
    "How does the heart pump blood?", "Why do stars twinkle?",
    "How do search engines rank pages?", "What is the greenhouse effect?",
    "How does a microwave oven heat food?", "Why do leaves change colour in autumn?",
    "How is paper made?",
)
KNOWLEDGE_FRAMES = ("{q}", "{q} Explain it to {audience}.", "{q} Keep the answer short.",
                    "{q} Give a simple example.", "Quick question: {q}",
                    "{q} Answer in a {style} way.")
MORE_FOLLOW_UPS = FOLLOW_UPS + (
    "Can you give a concrete example with numbers?", "Now write the same for {audience}.",
    "Translate your answer into {language}.", "What are the limitations of this?",
    "Can you expand the second point?", "Write it as a short dialogue instead.",
    "Make it more {style}.", "Add a title and headings.", "What should I read next to "
    "learn more?", "Explain it again as if I had never heard of it.",
    "Give me a quiz with three questions about it.", "Check your answer for mistakes.",
)


def _fill_follow_up(rng, text: str) -> str:
  return text.format(audience=_pick(rng, AUDIENCES), style=_pick(rng, STYLES),
                     language=_pick(rng, WORLD_LANGUAGES))


def _passage(rng) -> str:
  values = dict(subject=_pick(rng, SUBJECTS), name=_pick(rng, NAMES),
                number=int(rng.integers(50, 5000)), years=int(rng.integers(2, 30)))
  middles = rng.choice(len(PASSAGE_MIDDLES), int(rng.integers(2, 4)), replace=False)
  parts = ([_pick(rng, PASSAGE_OPENINGS)] + [PASSAGE_MIDDLES[int(i)] for i in middles]
           + [_pick(rng, PASSAGE_ENDINGS)])
  text = " ".join(part.format(**values) for part in parts)
  return text[0].upper() + text[1:]


def _rewrite(rng):
  instruction = _fill_follow_up(rng, _pick(rng, REWRITE_INSTRUCTIONS))
  return f"{instruction}\n\n{_passage(rng)}"


def _math_steps(rng):
  a, b, c, d = (int(v) for v in rng.integers(2, 60, 4))
  name, other, item = _pick(rng, NAMES), _pick(rng, NAMES), _pick(rng, ITEMS)
  price = int(rng.integers(2, 40))
  return _pick(rng, (
      f"{name} buys {a} {item} at {price} dollars each and pays with a {100 * (1 + a * price // 100)}"
      f" dollar note. How much change does {name} get? Show each step.",
      f"A shop gives {b % 50 + 5}% off a jacket that costs {c * 10} dollars, then adds {d % 20 + 1}%"
      f" tax. What is the final price? Work it out step by step.",
      f"{name} is {a} years old and {other} is {a + b} years old. In how many years will "
      f"{other} be twice as old as {name}, if ever? Explain your reasoning.",
      f"A car drives {a * 5} km at {40 + b} km/h and then {c * 5} km at {50 + d} km/h. "
      f"What is its average speed for the whole trip? Show the working.",
      f"Solve the system of equations step by step: x + y = {a + b}, x - y = {a - b}.",
      f"A tank holds {a * 10} litres. It fills at {b} litres per minute and leaks {max(1, c % b)}"
      f" litres per minute. How long until it is full? Explain.",
      f"The average of {a}, {b}, {c} and one more number is {(a + b + c + d) / 4:g}. What is "
      f"the missing number? Show the steps.",
      f"A bag has {a} red and {b} blue marbles. If you draw two without replacement, what is "
      f"the probability that both are red? Explain each step.",
      f"Add the fractions {a}/{b} and {c}/{d}, simplify the result, and explain how.",
      f"{name} reads {a} pages on Monday and {b} pages more each day than the day before. "
      f"How many pages has {name} read after {3 + d % 5} days? Show the pattern.",
      f"Convert {a * 100} minutes into days, hours and minutes, showing each step.",
      f"A recipe for {2 + a % 6} people needs {b * 10} grams of flour. How much flour do you "
      f"need for {3 + c % 10} people? Explain the calculation.",
  ))


def _long_form(rng):
  form, subject = _pick(rng, LONG_FORMS), _pick(rng, SUBJECTS)
  topic, audience = _pick(rng, ADVICE_TOPICS), _pick(rng, AUDIENCES)
  return _pick(rng, (
      f"Write {form} about {subject}, with an introduction, three sections and a "
      f"conclusion.",
      f"Write {form} on {topic} for {audience}.",
      f"Write {form} comparing {subject} and {_pick(rng, SUBJECTS)}.",
      f"Write {form} about {_pick(rng, WRITING_TOPICS)} in a {_pick(rng, STYLES)} style.",
      f"Plan and then write {form} about {subject}. Start with a short outline.",
  ))


def _code_more(rng):
  lang, task = _pick(rng, MORE_LANGUAGES), _pick(rng, MORE_CODE_TASKS)
  snippet, problem = BUGGY_SNIPPETS[int(rng.integers(len(BUGGY_SNIPPETS)))]
  code = f"```python\n{snippet}\n```"
  return _pick(rng, (
      f"Write a {lang} function that {task}.",
      f"Write a {lang} function that {task}, with comments and an example call.",
      f"Show two ways to write code in {lang} that {task}, and compare them.",
      f"Write unit tests in {lang} for a function that {task}.",
      f"This Python function is buggy: {problem}. Find the bug and fix it.\n\n{code}",
      f"Explain what this Python code does, line by line.\n\n{code}",
      f"Rewrite this Python function in {lang}, fixing any bugs.\n\n{code}",
      f"What is the time complexity of a {lang} function that {task}? Show the code.",
  ))


def _knowledge(rng):
  frame = _pick(rng, KNOWLEDGE_FRAMES)
  return _fill_follow_up(rng, frame.replace("{q}", _pick(rng, KNOWLEDGE_QUESTIONS)))


FAMILIES_V2 = {
    **FAMILIES, "rewrite": _rewrite, "math_steps": _math_steps, "long_form": _long_form,
    "code_more": _code_more, "knowledge": _knowledge,
}
RECIPES = {"v1": FAMILIES, "v2": FAMILIES_V2}
# v2 retires a family after this many draws in a row gave only used prompts.
_V2_RETIRE_AFTER = 300


def _v1_conversations(rng, num: int, follow_up_fraction: float) -> list[dict]:
  """Round-robin over the v1 families; fails when one runs out."""
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
                         f"({family} ran out); ask for fewer than {num} or use "
                         f"recipe v2")
      continue
    repeats = 0
    seen.add(prompt)
    messages = [{"role": "user", "content": prompt}]
    if rng.random() < follow_up_fraction:
      messages.append({"role": "user", "content": _pick(rng, FOLLOW_UPS)})
    records.append({"messages": messages, "family": family})
  return records


def _v2_conversations(rng, num: int, follow_up_fraction: float) -> list[dict]:
  """Families drawn at random; an exhausted family is retired, not fatal."""
  live = sorted(FAMILIES_V2)
  repeats = dict.fromkeys(live, 0)
  records, seen = [], set()
  while len(records) < num:
    if not live:
      raise InputError(f"only {len(records)} distinct prompts could be generated "
                       f"(every family ran out); ask for fewer than {num}")
    family = _pick(rng, live)
    prompt = FAMILIES_V2[family](rng)
    if prompt in seen:
      repeats[family] += 1
      if repeats[family] > _V2_RETIRE_AFTER:
        live.remove(family)
      continue
    repeats[family] = 0
    seen.add(prompt)
    messages = [{"role": "user", "content": prompt}]
    if rng.random() < follow_up_fraction:
      messages.append({"role": "user",
                       "content": _fill_follow_up(rng, _pick(rng, MORE_FOLLOW_UPS))})
      if rng.random() < 0.25:
        messages.append({"role": "user",
                         "content": _fill_follow_up(rng, _pick(rng, MORE_FOLLOW_UPS))})
    records.append({"messages": messages, "family": family})
  return records


def generate_prompts(num: int, seed: int = 0, follow_up_fraction: float = 0.3,
                     recipe: str = "v1") -> list[dict]:
  """``num`` distinct conversations (user turns only) by the given recipe.

  The same (num, seed, follow_up_fraction, recipe) always gives the same list,
  and a shorter list is a prefix of a longer one.
  """
  if recipe not in RECIPES:
    raise InputError(f"unknown prompt recipe {recipe!r}; choose from {sorted(RECIPES)}")
  if num < 1:
    raise InputError(f"num must be >= 1, got {num}")
  if not 0 <= follow_up_fraction <= 1:
    raise InputError(f"follow_up_fraction must be in [0, 1], got {follow_up_fraction}")
  rng = np.random.default_rng(seed)
  if recipe == "v1":
    return _v1_conversations(rng, num, follow_up_fraction)
  return _v2_conversations(rng, num, follow_up_fraction)


def split_heldout(records: list[dict], heldout: int) -> tuple[list[dict], list[dict]]:
  """-> (train, held-out): the last ``heldout`` records are held out.

  The records are distinct, so no held-out first turn appears in train.
  """
  if not 0 <= heldout < len(records):
    raise InputError(f"heldout must be in [0, {len(records)}), got {heldout}")
  cut = len(records) - heldout
  return records[:cut], records[cut:]


def _write_jsonl(path: str, records: list[dict]) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record, ensure_ascii=False) + "\n")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m train.prompts", description=__doc__.split(
      "\n")[0])
  p.add_argument("--num", type=int, default=2000, help="conversations in all")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--follow-up-fraction", type=float, default=0.3)
  p.add_argument("--recipe", choices=sorted(RECIPES), default="v1")
  p.add_argument("--heldout", type=int, default=0,
                 help="hold out the last N conversations (written to --heldout-out)")
  p.add_argument("--heldout-out", default=None)
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)
  try:
    if args.heldout and not args.heldout_out:
      raise InputError("--heldout needs --heldout-out")
    records = generate_prompts(args.num, args.seed, args.follow_up_fraction, args.recipe)
    train, heldout = split_heldout(records, args.heldout)
  except InputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  _write_jsonl(args.out, train)
  print(f"wrote {len(train)} conversations to {args.out}")
  if args.heldout:
    _write_jsonl(args.heldout_out, heldout)
    print(f"wrote {len(heldout)} held-out conversations to {args.heldout_out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
