"""Writes the bundled sample chat data (seeded, byte-for-byte reproducible).

    python train/sample_data/make_sample_data.py

Short templated conversations (arithmetic, unit conversion, word games, simple
facts, small talk; some multi-turn, some with a system prompt) written by this
script. They exist so that the tiny training preset and the tests run offline;
they are not a benchmark and not real training data. Half of the conversations
go to ``chat_sharegpt.jsonl`` (``conversations`` with from/value), the other
half to ``chat_openai.jsonl`` (``messages`` with role/content).
"""

import json
import os
import random

NUM_CONVERSATIONS = 400
SEED = 1234

_CAPITALS = [
    ("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
    ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Canada", "Ottawa"), ("Egypt", "Cairo"),
    ("Norway", "Oslo"), ("Chile", "Santiago"), ("Greece", "Athens"), ("Poland", "Warsaw"),
    ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Austria", "Vienna"),
    ("Thailand", "Bangkok"),
]
_COLOURS = [
    ("banana", "yellow"), ("lime", "green"), ("tomato", "red"), ("carrot", "orange"),
    ("blueberry", "blue"), ("plum", "purple"), ("coconut", "brown"), ("lemon", "yellow"),
    ("cucumber", "green"), ("cherry", "red"),
]
_WORDS = ["garden", "window", "planet", "river", "candle", "pencil", "forest", "castle",
          "rocket", "silver", "bridge", "marble", "jacket", "orange", "summer", "winter"]
_ANIMAL_GROUPS = {
    "live in the ocean": ["dolphin", "octopus", "shark", "whale", "starfish", "seal"],
    "can fly": ["eagle", "sparrow", "bat", "owl", "parrot", "swan"],
    "live on a farm": ["cow", "sheep", "goat", "horse", "pig", "hen"],
}
_UNITS = [("minutes", "hours", 60), ("seconds", "minutes", 60), ("hours", "days", 24),
          ("days", "weeks", 7), ("months", "years", 12), ("centimetres", "metres", 100)]
_GREETINGS = [
    ("Hi! How are you?", "Hello! I'm doing well, thanks for asking. How can I help you "
     "today?"),
    ("Good morning.", "Good morning! What would you like to talk about?"),
    ("Hello there.", "Hello! How can I help you today?"),
    ("Thanks for your help!", "You're welcome! Let me know if you need anything else."),
]
_SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a friendly and concise assistant.",
                   "Answer briefly and clearly."]
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                 "nine", "ten", "eleven", "twelve"]


def _arithmetic(rng):
  a, b = rng.randint(2, 60), rng.randint(2, 40)
  op = rng.choice(["plus", "minus", "times"])
  value = {"plus": a + b, "minus": a - b, "times": a * b}[op]
  question = rng.choice([f"What is {a} {op} {b}?", f"Can you compute {a} {op} {b}?",
                         f"Please tell me {a} {op} {b}."])
  answer = rng.choice([f"{a} {op} {b} is {value}.", f"The answer is {value}.",
                       f"{a} {op} {b} equals {value}."])
  follow = (f"And if you add 10 to that?", f"Adding 10 gives {value + 10}.")
  return question, answer, follow


def _capital(rng):
  country, city = rng.choice(_CAPITALS)
  question = rng.choice([f"What is the capital of {country}?",
                         f"Which city is the capital of {country}?"])
  answer = rng.choice([f"The capital of {country} is {city}.",
                       f"{city} is the capital of {country}."])
  follow = (f"Is {city} a big city?",
            f"Yes, {city} is one of the largest cities in {country}.")
  return question, answer, follow


def _colour(rng):
  thing, colour = rng.choice(_COLOURS)
  question = rng.choice([f"What colour is a {thing}?", f"What color is a ripe {thing}?"])
  answer = rng.choice([f"A ripe {thing} is usually {colour}.", f"It is usually {colour}."])
  others = [t for t, c in _COLOURS if c == colour and t != thing]
  follow = (f"Name another {colour} food.",
            f"Another {colour} food is the {others[0]}." if others else
            f"I can't think of another {colour} food right now.")
  return question, answer, follow


def _word(rng):
  word = rng.choice(_WORDS)
  if rng.random() < 0.5:
    question = f"Spell the word '{word}' backwards."
    answer = f"Backwards, '{word}' is '{word[::-1]}'."
  else:
    question = f"How many letters are in the word '{word}'?"
    answer = f"The word '{word}' has {_NUMBER_WORDS[len(word)]} letters."
  follow = (f"What is the first letter of '{word}'?",
            f"The first letter of '{word}' is '{word[0]}'.")
  return question, answer, follow


def _units(rng):
  small, big, factor = rng.choice(_UNITS)
  n = rng.randint(2, 9)
  question = f"How many {small} are in {n} {big}?"
  answer = rng.choice([f"There are {n * factor} {small} in {n} {big}.",
                       f"{n} {big} is {n * factor} {small}."])
  follow = (f"And in one {big[:-1]}?", f"One {big[:-1]} has {factor} {small}.")
  return question, answer, follow


def _animals(rng):
  group = rng.choice(sorted(_ANIMAL_GROUPS))
  names = rng.sample(_ANIMAL_GROUPS[group], 3)
  question = f"Name three animals that {group}."
  answer = f"Three animals that {group} are the {names[0]}, the {names[1]} and the {names[2]}."
  follow = (f"Which of those is the largest?", f"Of those, the {names[0]} is a good guess, "
            "but it depends on the individual animal.")
  return question, answer, follow


def _greeting(rng):
  question, answer = rng.choice(_GREETINGS)
  return question, answer, ("Tell me a fun fact.",
                            "Honey never spoils if it is stored in a sealed jar.")


_TOPICS = [_arithmetic, _capital, _colour, _word, _units, _animals, _greeting]


def conversation(rng) -> list[dict]:
  """One conversation as OpenAI-style messages."""
  messages = []
  if rng.random() < 0.25:
    messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
  question, answer, follow = rng.choice(_TOPICS)(rng)
  messages += [{"role": "user", "content": question},
               {"role": "assistant", "content": answer}]
  if rng.random() < 0.35:
    messages += [{"role": "user", "content": follow[0]},
                 {"role": "assistant", "content": follow[1]}]
  return messages


def to_sharegpt(messages: list[dict]) -> dict:
  names = {"system": "system", "user": "human", "assistant": "gpt"}
  return {"conversations": [{"from": names[m["role"]], "value": m["content"]}
                            for m in messages]}


def main() -> None:
  rng = random.Random(SEED)
  here = os.path.dirname(os.path.abspath(__file__))
  conversations = [conversation(rng) for _ in range(NUM_CONVERSATIONS)]
  half = NUM_CONVERSATIONS // 2
  with open(os.path.join(here, "chat_sharegpt.jsonl"), "w", encoding="utf-8") as f:
    for i, messages in enumerate(conversations[:half]):
      f.write(json.dumps({"id": f"sample-{i}", **to_sharegpt(messages)}) + "\n")
  with open(os.path.join(here, "chat_openai.jsonl"), "w", encoding="utf-8") as f:
    for messages in conversations[half:]:
      f.write(json.dumps({"messages": messages}) + "\n")


if __name__ == "__main__":
  main()
